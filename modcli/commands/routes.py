"""`modcli routes`: flags -> RouteConfig -> modcli.route_map -> which tokens each routed block processed for one text,
as HTML or a PNG heat map."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.commands.config_flags import config_flags, source_flags
from modcli.errors import UserError
from modcli.reports.console import print_json

DEFAULT_OUT = "routes.html"


@subcommand
@config_flags(lambda: source_flags("reports/route_map.py", "RouteConfig", leave_out=("checkpoint", "text")))
def routes(
    checkpoint: options.Checkpoint = None,
    text: options.RoutesText = None,
    out: options.RoutesOut = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Per routed block of an MoD model: the tokens each routing mode processed, the causal rule's probability, and
    where the causal rules disagree with top-k. --out routes.html: the whole text per block, every mode; routes.png:
    512 tokens (--start, --max-tokens) as wrapped rows of text with one strip per block under each row."""
    out = DEFAULT_OUT if out is None else out
    suffix = Path(out).suffix.lower()
    if suffix not in (".html", ".png"):
        raise UserError(f"--out must end in .html or .png, got {out!r}")
    if text is None:
        raise UserError("--text is required: the UTF-8 text file to route (e.g. --text README.md)")
    values = {**flags, "checkpoint": checkpoint, "text": text}
    if suffix == ".png":
        values.setdefault("max_tokens", modcli.PNG_WINDOW)  # a window a person can read; the HTML holds any length
        if values["max_tokens"] > modcli.PNG_MAX_TOKENS:
            raise UserError(f"--max-tokens: a PNG draws at most {modcli.PNG_MAX_TOKENS} tokens, got "
                            f"{values['max_tokens']}; --out routes.html shows the whole text")
    result = modcli.route_map(modcli.RouteConfig(**values))
    (modcli.write_html if suffix == ".html" else modcli.write_png)(result, out)
    if json_output:
        print_json({"out": out, **dataclasses.asdict(result)})
        return
    span = "" if result.text_tokens in (None, len(result.tokens)) else f" of {result.text_tokens}"
    table = Table(title=f"{result.checkpoint}: tokens {result.start}-{result.start + len(result.tokens) - 1}{span}, "
                        f"{result.router} router")
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
