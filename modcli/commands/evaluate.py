"""`modcli eval`: flags -> EvalConfig -> modcli.evaluate -> one table per routing mode, and the causal rules'
agreement with top-k; with --tasks, flags -> HarnessConfig -> modcli.evaluate_tasks (lm-evaluation-harness) -> one
row per task and metric."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.commands.config_flags import ConfigFlag, config_flags, source_flags
from modcli.errors import UserError
from modcli.reports.console import print_json

PERPLEXITY_ONLY = {"data": "--data", "glob": "--glob", "batches": "--batches", "against": "--against"}
"""Flags of the perplexity evaluation that mean nothing to lm-eval's tasks."""
TASKS_ONLY = {"include_path": "--include-path", "num_fewshot": "--num-fewshot", "limit": "--limit"}
"""Flags of --tasks that mean nothing to the perplexity evaluation."""


def eval_flags() -> list[ConfigFlag]:
    """The perplexity evaluation's flags, then --tasks' own (the flags both share are the first's)."""
    return [*source_flags("evaluation/perplexity.py", "EvalConfig", leave_out=("checkpoint",)),
            *source_flags("evaluation/harness.py", "HarnessConfig", leave_out=("checkpoint",))]


@subcommand
@config_flags(eval_flags)
def eval_command(
    checkpoint: options.Checkpoint = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Validation loss, bits per byte and perplexity under each routing mode (non-causal ones as a reference); with
    --tasks, lm-evaluation-harness tasks under one causal routing mode."""
    values = {**flags, "checkpoint": checkpoint}
    if "tasks" in values:
        _tasks(values, json_output)
        return
    stray = [flag for name, flag in TASKS_ONLY.items() if name in values]
    if stray:
        raise UserError(f"{stray[0]} applies to lm-evaluation-harness tasks: give --tasks too")
    result = modcli.evaluate(modcli.EvalConfig(**values))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    table = Table(title=f"{result.checkpoint} ({result.kind}) on {result.corpus} ({result.tokens:,} tokens)")
    for column in ("routing", "causal", "loss", "bits/byte", "perplexity", "processed per routed block"):
        table.add_column(column, justify="left" if column in ("routing", "processed per routed block") else "right")
    for r in result.results:
        label = r.routing + (" (non-causal, reference only)" if not r.causal else "")
        fractions = " ".join(f"{k}={v:.3f}" for k, v in r.processed_fraction.items()) or "-"
        table.add_row(label, "yes" if r.causal else "no", f"{r.loss:.4f}", f"{r.bits_per_byte:.4f}",
                      f"{r.perplexity:.3f}", fractions)
    stdout.print(table)
    if result.agreement:
        stdout.print(_agreement_table(result))
    if result.exit_losses:
        stdout.print(_exit_table(result))
    if result.breakdown is not None:
        _print_breakdown(result.breakdown)


def _print_breakdown(b) -> None:
    """--against: where the loss difference goes, by kind of token, by position, and the worst tokens."""
    extra = b.loss - b.against_loss
    stdout.print(f"against {b.against}: loss {b.loss:.4f} ({b.routing}) vs {b.against_loss:.4f}, extra {extra:+.4f} "
                 f"nats/token ({100 * extra / b.against_loss:+.1f}%) over {b.tokens:,} tokens; the worst 1% of tokens "
                 f"carry {100 * b.top_shares['1%']:.0f}% of it, the worst 10% {100 * b.top_shares['10%']:.0f}%; "
                 f"{100 * b.improved:.0f}% of tokens got better", highlight=False, soft_wrap=True)
    for title, groups in (("by kind of target token", b.kinds), ("by position in the window", b.positions)):
        table = Table(title=f"extra loss {title}")
        for column in ("group", "tokens", "loss", "against", "extra/token", "share of extra"):
            table.add_column(column, justify="left" if column == "group" else "right")
        for name, g in groups.items():
            if g.tokens:
                table.add_row(name, f"{100 * g.tokens:.1f}%", f"{g.loss:.3f}", f"{g.against_loss:.3f}",
                              f"{g.loss - g.against_loss:+.3f}", f"{100 * g.extra:.1f}%")
        stdout.print(table)
    table = Table(title="the target tokens with the most extra loss")
    for column in ("token", "count", "extra/token", "share of extra"):
        table.add_column(column, justify="left" if column == "token" else "right")
    for t in b.worst:
        table.add_row(t.text, str(t.count), f"{t.delta:+.3f}", f"{100 * t.extra:.1f}%")
    stdout.print(table)


def _exit_table(result):
    """Early exit: the loss of the exit after each block (causal), the last being the model's."""
    table = Table(title="early exits: the shared final norm and head after each block (causal)")
    for column in ("exit after", "loss", "bits/byte", "perplexity"):
        table.add_column(column, justify="right")
    final = next(reversed(result.exit_losses))
    bits = result.results[0].bits_per_byte / result.results[0].loss if result.results[0].loss else 0.0
    for block, loss in result.exit_losses.items():
        label = f"{block} (final, the model)" if block == final else block
        table.add_row(label, f"{loss:.4f}", f"{loss * bits:.4f}", f"{math.exp(loss):.3f}")
    return table


def _agreement_table(result):
    """The router's statistics per routed block (for topk: the causal rules against top-k)."""
    first = next(iter(next(iter(result.agreement.values())).values()))
    columns = list(first)
    title = ("causal rules against top-k (per routed block)" if "accuracy" in first
             else f"{result.router} router statistics (per routed block)")
    table = Table(title=title)
    for column in ("block", "rule", *columns):
        table.add_column(column.replace("_", " "), justify="right")
    for block, rules in result.agreement.items():
        for rule, stats in rules.items():
            table.add_row(block, rule, *(f"{stats[column]:.3f}" for column in columns))
    return table


def _tasks(values: dict, json_output: bool) -> None:
    """`modcli eval RUN --tasks ...`: the tasks' metrics as a table, or one JSON object."""
    stray = [flag for name, flag in PERPLEXITY_ONLY.items() if name in values]
    if stray:
        raise UserError(f"{stray[0]} applies to the perplexity evaluation, not to --tasks")
    routing = values.pop("routing", None) or [None]
    if len(routing) > 1:
        raise UserError(f"--tasks runs under one causal --routing mode, got {len(routing)}: {', '.join(routing)}")
    values["routing"] = routing[0]
    result = modcli.evaluate_tasks(modcli.HarnessConfig(**values))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    limited = f", first {result.limit} documents per task" if result.limit else ""
    table = Table(title=f"{result.checkpoint} ({result.kind}), routing {result.routing} (causal), lm-eval "
                        f"{result.lm_eval_version}{limited}")
    for column in ("task", "metric", "value", "stderr", "docs", "shots"):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task in result.results:
        for metric, value in task.metrics.items():
            better = {True: " ↑", False: " ↓"}.get(task.higher_is_better.get(metric), "")  # which way is better
            error = task.stderr.get(metric)
            table.add_row(task.task + (" (group)" if task.group else ""), metric + better, f"{value:.6g}",
                          "-" if error is None else f"{error:.4f}", "-" if task.samples is None else str(task.samples),
                          "-" if task.num_fewshot is None else str(task.num_fewshot))
    stdout.print(table)
