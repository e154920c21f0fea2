"""The flags no config field holds, each declared once: the CHECKPOINT arguments, each command's --out where its
help is the command's own, --preset, --config, --dense, --json, profile's --seq-len (the one length measured) and
plot's. Every other flag is generated from its config field (modcli.commands.config_flags): its name, type,
default and help (the field's docstring) are the config's.

Defaults. A flag that sets a config field defaults to None, "not given": the config's own value stands (the
dataclass default, the preset's, the TOML file's, or a resumed run's). Only a flag that no config holds has a value
of its own (--json off, plot's --smooth 10); a few commands supply a default where their library function takes
none (plot's and routes' --out, sweep's --out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from modcli.commands.common import USAGE_ERROR
from modcli.commands.config_flags import source_docstring

LATEST_RUN = "runs/latest"
"""Where `modcli train` writes without --out, and what eval, generate, export and routes read without CHECKPOINT."""


def _latest_run_if_none(value: str | None) -> str:
    """CHECKPOINT not given: runs/latest where it exists (what `modcli train` just wrote), else one line saying
    what to give."""
    if value is not None:
        return value
    if not Path(LATEST_RUN).exists():
        raise USAGE_ERROR(f"no CHECKPOINT given and no {LATEST_RUN} here (where `modcli train` writes without --out): "
                          "name a run or checkpoint folder")
    return LATEST_RUN


Checkpoint = Annotated[Optional[str], typer.Argument(
    help=f"Run folder (its newest checkpoint) or checkpoint folder; default {LATEST_RUN} where it exists.",
    show_default=False, callback=_latest_run_if_none)]
"""eval's, generate's, export's and routes' CHECKPOINT (`checkpoint: options.Checkpoint = None`)."""
FreshOrCheckpoint = Annotated[Optional[str], typer.Argument(
    help="Run folder (its newest checkpoint) or checkpoint folder; default: a freshly initialised model.",
    show_default=False)]
"""profile's CHECKPOINT: without one it measures a fresh model of --preset and the model flags."""
ConfigFile = Annotated[Optional[Path], typer.Option(
    "--config", help="TOML file with the same keys as the flags, each of its flag's type, and preset (--preset "
                     "wins over it); flags win.")]
Json = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
# --out: each command writes something of its own, so each has its own help (and default) for it.
ImportOut = Annotated[Optional[str], typer.Option("--out", help="Run folder to write the imported model into (required).")]
SweepOut = Annotated[Optional[str], typer.Option("--out", help=(
    "Sweep folder: grid.toml, results.jsonl, runs/ (default runs/sweeps/GRID-NAME)."))]
PlotOut = Annotated[Optional[str], typer.Option("--out", help="PNG file to draw the curves in (default curves.png).")]
RoutesOut = Annotated[Optional[str], typer.Option("--out", help=(
    "routes.html (default; the whole text, every block) or routes.png (a readable window of --max-tokens tokens "
    "from --start)."))]
Preset = Annotated[Optional[str], typer.Option(
    help="tiny, small or base: the values --config and the flags start from (default: train tiny, profile small).")]
SeqLen = Annotated[Optional[int], typer.Option(help=(
    "The one sequence length to measure (default: the model's); --seq-lens for several."))]
"""profile's --seq-len: the length measured, not the model's context (train's --seq-len is ModelConfig's)."""
RoutesText = Annotated[Optional[str], typer.Option("--text", help="UTF-8 text file to route (required).")]
Dense = Annotated[Optional[bool], typer.Option("--dense", help="The dense twin: routing off (--route-every 0).")]
Source = Annotated[str, typer.Argument(help=source_docstring("pretrained/importer.py", "ImportConfig", "source"),
                                       show_default=False)]
Grid = Annotated[Path, typer.Argument(help="Grid TOML: budgets, [[size]] and [[variant]] tables, [common] flags.",
                                      show_default=False)]
Runs = Annotated[list[str], typer.Argument(help="Run folders (of `modcli train` or a sweep's runs/).",
                                           show_default=False)]
Smooth = Annotated[int, typer.Option(help="Moving average of the training loss over N steps (1 = raw).")]
