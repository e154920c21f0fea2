"""`modcli sweep`: flags -> SweepConfig -> modcli.run_sweep (modcli.sweep.runner) -> summary table (or one JSON
object)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.commands.config_flags import config_flags, flags_of
from modcli.reports.console import print_json
from modcli.sweep import grid as sweep_grid


@subcommand
@config_flags(lambda: flags_of(sweep_grid.SweepConfig, leave_out=("grid",)))
def sweep(
    grid: options.Grid,
    out: options.SweepOut = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Train, evaluate (and profile) every budget x size x variant of a grid; resumable. Prints a summary table."""
    folder = out or str(Path("runs") / "sweeps" / grid.stem)
    result = modcli.run_sweep(sweep_grid.SweepConfig(grid=str(grid), out=folder, **flags))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    if result.dry_run:
        table = Table(title=f"{result.grid}: {result.points} runs (dry run, nothing trained)")
        for column in ("run", "parameters", "steps", "FLOPs per step"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for r in result.runs:
            table.add_row(r["name"], f"{r['parameters']:,}", str(r["planned_steps"]), f"{r['step_flops']:.3g}")
        stdout.print(table)
        return
    rows = sweep_grid.summary_rows(result.runs, result.best or sweep_grid.best_per_budget(result.runs))
    finished = sum(r.get("causal_loss") is not None or bool(r.get("diverged")) for r in result.runs)
    table = Table(title=f"sweep {result.out}: {result.points} runs ({len(result.trained)} trained now, "
                        f"{len(result.skipped)} already done" + (f", {finished} finished, report only"
                                                                 if result.report_only else "")
                        + "); * = best causal loss of its budget")
    for column in rows[0]:
        table.add_column(column, justify="left" if column in ("size", "variant", "causal val loss", "non-causal")
                         else "right")
    for row in rows:
        table.add_row(*row.values())
    # A pipe or a file gets the whole table rather than 80 columns of wrapped cells.
    console = stdout if stdout.is_terminal else Console(width=max(stdout.width, 150))
    console.print(table)
    for label, entry in result.best.items():
        if "mod_minus_dense" in entry:
            verdict = "MoD beats dense" if entry["mod_minus_dense"] < 0 else "dense beats MoD"
            stdout.print(f"budget {label}: best MoD {entry['mod']['name']} {entry['mod']['causal_loss']:.4f}, best dense "
                         f"{entry['dense']['name']} {entry['dense']['causal_loss']:.4f}: {verdict} by "
                         f"{abs(entry['mod_minus_dense']):.4f} nats", highlight=False, soft_wrap=True)
    for line in sweep_grid.analysis_lines(result.analysis):
        stdout.print(line, highlight=False, soft_wrap=True)
    if result.elsewhere:
        stdout.print(f"{len(result.elsewhere)} runs were held by another sweep process on this folder: "
                     f"{', '.join(result.elsewhere)}", highlight=False, soft_wrap=True)
    if result.plots:
        stdout.print("plots: " + ", ".join(result.plots.values()), highlight=False)
    stdout.print(f"results: {Path(result.out) / 'results.jsonl'}; wall time {result.wall_time_s:.0f} s", highlight=False)
