"""`modcli plot`: training curves of several runs on one figure (modcli.curves_plot)."""

from __future__ import annotations

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.errors import UserError
from modcli.reports.console import print_json

DEFAULT_OUT = "curves.png"


@subcommand
def plot(
    runs: options.Runs,
    out: options.PlotOut = None,
    smooth: options.Smooth = 10,
    json_output: options.Json = False,
) -> None:
    """Training loss and causal validation loss against training FLOPs, one curve per run."""
    out = DEFAULT_OUT if out is None else out
    if not out.lower().endswith(".png"):
        raise UserError(f"--out must name a .png file, got {out!r}")
    if smooth < 1:
        raise UserError(f"--smooth must be >= 1, got {smooth}")
    drawn = modcli.curves_plot(runs, out, smooth=smooth)
    if json_output:
        print_json({"out": out, "runs": drawn})
        return
    for label, info in drawn.items():
        final = f"{info['final_val_loss']:.4f}" if info["final_val_loss"] is not None else "-"
        stdout.print(f"{label}: {info['steps']} steps, {info['evaluations']} evaluations, final causal val loss {final}",
                     highlight=False)
    stdout.print(f"wrote {out}", highlight=False)
