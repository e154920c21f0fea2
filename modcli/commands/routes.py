"""`modcli routes`: flags -> RouteConfig -> modcli.route_map -> which tokens each routed block processed for one text,
as HTML or a PNG heat map."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.errors import UserError
from modcli.reports.console import print_json

DEFAULT_OUT = "routes.html"


@subcommand
def routes(
    ctx: typer.Context,
    checkpoint: options.Checkpoint,
    text: options.Text,
    out: options.Out = None,
    max_tokens: options.MaxTokens = None,
    device: options.Device = None,
    json_output: options.Json = False,
) -> None:
    """Per routed block of an MoD model: the tokens each routing mode processed, the causal rule's probability, and
    where the causal rules disagree with top-k; --out routes.html colours the text per block, routes.png is a heat
    map."""
    out = DEFAULT_OUT if out is None else out
    suffix = Path(out).suffix.lower()
    if suffix not in (".html", ".png"):
        raise UserError(f"--out must end in .html or .png, got {out!r}")
    result = modcli.route_map(options.build(modcli.RouteConfig, options.given(ctx)))
    (modcli.write_html if suffix == ".html" else modcli.write_png)(result, out)
    if json_output:
        print_json({"out": out, **dataclasses.asdict(result)})
        return
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
