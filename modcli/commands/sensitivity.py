"""`modcli sensitivity`: flags -> SensitivityConfig -> modcli.sensitivity -> one table sorted by the cost of each
drop (or one JSON object), progress on stderr, a heatmap with --plot."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stderr, stdout, subcommand
from modcli.commands.config_flags import config_flags, flags_of
from modcli.evaluation.sensitivity_config import SensitivityConfig, share_key
from modcli.reports.console import print_json


@subcommand
@config_flags(lambda: flags_of(SensitivityConfig, leave_out=("checkpoint",)))
def sensitivity(
    checkpoint: options.Checkpoint = None,
    json_output: options.Json = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Where a dense model can spare depth: for every block and part (attention, mlp, the whole block) the validation
    loss when it is removed for every token, when a random share of tokens skips it (skipped tokens are left out of
    the attention, keys and values included), and Block Influence 1 - cos(x, x + f(x)). Dense models only (an
    imported run, or one trained with --dense); a routed run is refused."""
    config = SensitivityConfig(checkpoint=checkpoint, **flags)
    progress = None if json_output else (lambda block, blocks, seconds: stderr.print(
        f"block {block + 1}/{blocks} measured ({seconds:.1f} s)", highlight=False))
    result = modcli.measured_map(config) if config.measured else modcli.sensitivity(config, on_block=progress)
    plan = modcli.plan_from(config, result) if config.plan else None
    if json_output:
        print_json({**dataclasses.asdict(result), **({"plan": dataclasses.asdict(plan)} if plan else {})})
        return
    if plan is not None:
        _print_plan(plan)
        if config.measured:
            return
    table = Table(title=f"{result.checkpoint} ({result.kind}) on {result.corpus}: {result.windows} windows of "
                        f"{result.seq_len} tokens, dense loss {result.dense_loss:.4f}; sorted by the cost of the drop")
    shares = [share_key(share) for share in result.shares]
    kv_kept = [key for key in shares if all(key in r.share_losses_kv_kept for r in result.results)]  # older maps: none
    for column in ("block", "part", "drop loss", "drop cost", *(f"{key} skip loss" for key in shares),
                   *(f"{key} skip cost" for key in shares), *(f"{key} skip cost, K/V kept" for key in kv_kept),
                   "block influence"):
        table.add_column(column, justify="left" if column == "part" else "right")

    def cost(loss: float) -> str:
        return f"{loss - result.dense_loss:+.4f} ({(loss - result.dense_loss) / result.dense_loss:+.1%})"

    for r in sorted(result.results, key=lambda r: r.drop_loss, reverse=True):
        table.add_row(str(r.block), r.part, f"{r.drop_loss:.4f}", cost(r.drop_loss),
                      *(f"{r.share_losses[key]:.4f}" for key in shares),
                      *(cost(r.share_losses[key]) for key in shares),
                      *(cost(r.share_losses_kv_kept[key]) for key in kv_kept), f"{r.block_influence:.4f}")
    (stdout if stdout.is_terminal else Console(width=160)).print(table)
    stderr.print(f"measured in {result.seconds:.1f} s" + (f"; heatmap: {result.plot}" if result.plot else ""),
                 highlight=False)


def _print_plan(plan) -> None:
    routed = (f" --route-part {plan.route_part} --capacity {plan.capacity:g}"
              + (" --keep-skipped-kv" if plan.keep_skipped_kv else "") if plan.route_part else "")
    stdout.print(f"plan ({plan.path}): --drop {plan.drop}{routed}", highlight=False, soft_wrap=True)
    stdout.print(f"forward FLOPs {plan.flops_ratio:.3f} of the model's at T {plan.seq_len} (target "
                 f"{plan.target_flops:g}); predicted loss {plan.predicted_loss:.4f} against {plan.dense_loss:.4f} "
                 f"({(plan.predicted_loss - plan.dense_loss) / plan.dense_loss:+.1%}; the cuts' costs added, each "
                 "measured alone: modcli eval the converted model)", highlight=False, soft_wrap=True)
