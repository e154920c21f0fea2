"""`modcli sweep`: flags -> SweepConfig -> modcli.sweep.runner.sweep -> summary table (or one JSON object)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from modcli.commands.common import Json, stdout, user_errors


@user_errors
def sweep(
    grid: Annotated[Path, typer.Argument(help="Grid TOML: budgets, \\[\\[size]], \\[\\[variant]], \\[common] flags.")],
    out: Annotated[Optional[str], typer.Option(
        help="Sweep folder (runs/, results.jsonl, isoflop.png, frontier.png); default runs/sweeps/GRID-NAME.")] = None,
    profile: Annotated[bool, typer.Option(
        "--profile", help="Time each run's forward and decode against its dense twin (frontier.png).")] = False,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or mps (overrides the grid).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 (overrides the grid).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the grid and list its runs; train nothing.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show each run's training progress.")] = False,
    json_output: Json = False,
) -> None:
    """Train, evaluate (and profile) every budget x size x variant of a grid; resumable. Prints a summary table."""
    from modcli.sweep.runner import SweepConfig, best_per_budget, summary_rows
    from modcli.sweep.runner import sweep as run_sweep

    result = run_sweep(SweepConfig(grid=str(grid), out=out or str(Path("runs") / "sweeps" / grid.stem), profile=profile,
                                   device=device, dtype=dtype, dry_run=dry_run, verbose=verbose))
    if json_output:
        import dataclasses

        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    from rich.console import Console
    from rich.table import Table

    if result.dry_run:
        table = Table(title=f"{result.grid}: {result.points} runs (dry run, nothing trained)")
        for column in ("run", "parameters", "steps", "FLOPs per step"):
            table.add_column(column, justify="left" if column == "run" else "right")
        for r in result.runs:
            table.add_row(r["name"], f"{r['parameters']:,}", str(r["planned_steps"]), f"{r['step_flops']:.3g}")
        stdout.print(table)
        return
    rows = summary_rows(result.runs, result.best or best_per_budget(result.runs))
    table = Table(title=f"sweep {result.out}: {result.points} runs ({len(result.trained)} trained now, "
                        f"{len(result.skipped)} already done); * = best causal loss of its budget")
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
    if result.plots:
        stdout.print("plots: " + ", ".join(result.plots.values()), highlight=False)
    stdout.print(f"results: {Path(result.out) / 'results.jsonl'}; wall time {result.wall_time_s:.0f} s", highlight=False)
