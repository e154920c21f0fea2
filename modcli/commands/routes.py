"""`modcli routes`: which tokens each routed block processed for one text, as HTML or a PNG heat map."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from modcli.commands.common import Device, Json, stdout, user_errors


@user_errors
def routes(
    run: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder of an MoD model.")],
    text: Annotated[Path, typer.Option(help="Text file to route (UTF-8).")],
    out: Annotated[str, typer.Option(help="routes.html (the text coloured per block) or routes.png (a heat map).")
                   ] = "routes.html",
    max_tokens: Annotated[Optional[int], typer.Option(
        help="Route only the first N tokens (default: all, in windows of the model's seq_len).")] = None,
    device: Device = "auto",
    json_output: Json = False,
) -> None:
    """Per routed block: the tokens each routing mode processed, the causal rule's probability, and where the causal
    rules disagree with top-k."""
    from modcli.reports.route_map import RouteConfig, route_map, write_html, write_png

    suffix = Path(out).suffix.lower()
    if suffix not in (".html", ".png"):
        from modcli.errors import UserError
        raise UserError(f"--out must end in .html or .png, got {out!r}")
    result = route_map(RouteConfig(checkpoint=run, text=str(text), max_tokens=max_tokens, device=device))
    (write_html if suffix == ".html" else write_png)(result, out)
    if json_output:
        import dataclasses

        from modcli.reports.console import print_json
        print_json({"out": out, **dataclasses.asdict(result)})
        return
    from rich.table import Table

    table = Table(title=f"{result.checkpoint}: {len(result.tokens)} tokens, {result.router} router")
    table.add_column("block", justify="right")
    for mode in result.modes:
        table.add_column(f"{mode} processed" + ("" if result.causal[mode] else " (non-causal)"), justify="right")
    for mode in result.causal_modes:
        if result.reference_mode:
            table.add_column(f"{mode} agrees with {result.reference_mode}", justify="right")
    for block in result.blocks:
        row = [str(block.layer)] + [f"{block.processed_fraction[m]:.3f}" for m in result.modes]
        if result.reference_mode:
            row += [f"{1 - block.disagreement_fraction[m]:.3f}" for m in result.causal_modes]
        table.add_row(*row)
    stdout.print(table)
    stdout.print(f"wrote {out}", highlight=False)
