"""`modcli eval`: flags -> EvalConfig -> modcli.evaluate -> one table per routing mode, and the causal rules'
agreement with top-k."""

from __future__ import annotations

import dataclasses
import math

import typer
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.reports.console import print_json


@subcommand
def eval_command(
    ctx: typer.Context,
    checkpoint: options.Checkpoint,
    data: options.Data = None,
    glob: options.Glob = None,
    routing: options.RoutingModes = None,
    batches: options.Batches = None,
    batch_size: options.BatchSize = None,
    device: options.Device = None,
    dtype: options.Dtype = None,
    json_output: options.Json = False,
) -> None:
    """Validation loss, bits per byte and perplexity under each routing mode (non-causal ones as a reference)."""
    result = modcli.evaluate(options.build(modcli.EvalConfig, options.given(ctx)))
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
