"""`modcli eval`: one table per routing mode, and the causal rules' agreement with top-k."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Optional

import typer

from modcli.commands.common import Device, Dtype, Json, stdout, user_errors


@user_errors
def eval_command(
    checkpoint: Annotated[str, typer.Argument(help="Run folder (newest checkpoint) or checkpoint folder.")],
    data: Annotated[Optional[str], typer.Option(help="Evaluate on this corpus instead of the training one.")] = None,
    glob: Annotated[str, typer.Option(help="File pattern when --data is a folder.")] = "**/*",
    routing: Annotated[Optional[list[str]], typer.Option(
        help="A mode of the model's router, e.g. topk, router, predictor (repeat; default all).")] = None,
    batches: Annotated[int, typer.Option(help="Validation batches.")] = 16,
    batch_size: Annotated[int, typer.Option(help="Sequences per batch.")] = 8,
    device: Device = "auto",
    dtype: Dtype = "float32",
    json_output: Json = False,
) -> None:
    """Validation loss, bits per byte and perplexity under each routing mode (non-causal ones as a reference)."""
    from rich.table import Table

    from modcli.evaluation.perplexity import EvalConfig, evaluate

    result = evaluate(EvalConfig(checkpoint=checkpoint, data=data, glob=glob, routing=routing or [], batches=batches,
                                 batch_size=batch_size, device=device, dtype=dtype))
    if json_output:
        from modcli.reports.console import print_json
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
    from rich.table import Table

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
    from rich.table import Table

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
