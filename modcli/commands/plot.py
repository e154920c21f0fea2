"""`modcli plot`: training curves of several runs on one figure."""

from __future__ import annotations

from typing import Annotated

import typer

from modcli.commands.common import Json, stdout, user_errors


@user_errors
def plot(
    runs: Annotated[list[str], typer.Argument(help="Run folders (of `modcli train` or a sweep's runs/).")],
    out: Annotated[str, typer.Option(help="PNG file to write.")] = "curves.png",
    smooth: Annotated[int, typer.Option(help="Moving average of the training loss over N steps (1 = raw).")] = 10,
    json_output: Json = False,
) -> None:
    """Training loss and causal validation loss against training FLOPs, one curve per run."""
    from modcli.errors import UserError
    from modcli.reports.plots import curves_plot

    if not out.lower().endswith(".png"):
        raise UserError(f"--out must name a .png file, got {out!r}")
    if smooth < 1:
        raise UserError(f"--smooth must be >= 1, got {smooth}")
    drawn = curves_plot(runs, out, smooth=smooth)
    if json_output:
        from modcli.reports.console import print_json
        print_json({"out": out, "runs": drawn})
        return
    for label, info in drawn.items():
        final = f"{info['final_val_loss']:.4f}" if info["final_val_loss"] is not None else "-"
        stdout.print(f"{label}: {info['steps']} steps, {info['evaluations']} evaluations, final causal val loss {final}",
                     highlight=False)
    stdout.print(f"wrote {out}", highlight=False)
