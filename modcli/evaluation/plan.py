"""`modcli sensitivity --plan PLAN.toml --target-flops F`: the cheapest cuts that meet a FLOP target, from the
sensitivity map, written as a TOML that `modcli train --init-from RUN --config PLAN.toml` takes.

Each candidate is one sublayer (a block's attention or MLP) dropped for every token, and with `--plan-routing S`
also the same sublayer routed so that a share S of the tokens skips it (`--capacity 1 - S`, a per-block
`--route-part`). A drop's cost is what the map measured for it alone (drop_loss - dense_loss, nats/token; a negative
cost counts as 0); a routed sublayer's is the map's loss with a random share S of the tokens skipping it
(`share_losses`, or `share_losses_kv_kept` with `--keep-skipped-kv`): what an untrained router that picks at random
costs, which a trained router should beat. The saving of each is the forward FLOPs it removes at the map's window
length (modcli.models.flops: the LM head, and a routed block's router, counted). Candidates are taken greedily by
cost per FLOP saved until the model's forward FLOPs are at most the target share of the original's; a part is
never dropped in every block, and a block is dropped (one part or both) or routed, not both. Greedy choice is not
optimal (a cheap routed cut can take a block whose drop would have been cheaper): with routing offered, the plan
is the one of the two, with and without routed cuts, whose predicted loss is lower. The predicted loss
adds the chosen cuts' costs, a block with both parts cut alike counting its measured whole-block cost: an estimate
(cuts interact), which `modcli eval` of the converted model replaces with a measurement. A plan with routed blocks
has new routers: train them before judging it (`--objective distill`, for instance).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from modcli.config import ModelConfig
from modcli.config.drops import format_drops
from modcli.config.routing import format_route_parts
from modcli.errors import UserError
from modcli.models.flops import flops

CUT_PARTS = ("attention", "mlp")


@dataclass
class PlannedCut:
    block: int
    part: str
    cost: float
    """Measured loss increase of this cut alone (nats/token)."""
    flops_saved: int
    """Forward FLOPs per window it removes."""
    how: str = "drop"
    """drop (every token) or route (a share of the tokens skips it, at the plan's capacity)."""


@dataclass
class Plan:
    target_flops: float
    flops_ratio: float
    """Forward FLOPs of the planned model over the original's, at `seq_len`."""
    seq_len: int
    dense_loss: float
    predicted_loss: float
    drop: str
    """The --drop text."""
    cuts: list[PlannedCut] = field(default_factory=list)
    """In the order they were taken (cheapest per FLOP first)."""
    path: str | None = None
    route_part: str = ""
    """The per-block --route-part text of the routed sublayers ("" = none routed)."""
    capacity: float = 1.0
    """--capacity of the routed blocks (1 - the --plan-routing share)."""
    keep_skipped_kv: bool = False


def plan_drops(model: ModelConfig, results: list, dense_loss: float, seq_len: int, target: float,
               routing_share: float | None = None, keep_skipped_kv: bool = False) -> Plan:
    """The plan for a model of config `model` from sensitivity results ([PartSensitivity or dicts with block, part,
    drop_loss, share_losses]); `routing_share`: also consider routing each sublayer with that share of the tokens
    skipping it (the map must hold it). A target no set of cuts can meet is a UserError."""
    if not 0 < target < 1:
        raise UserError(f"--target-flops must be in (0, 1) (a share of the model's forward FLOPs), got {target}")
    measured = {(_get(r, "block"), _get(r, "part"), "drop"): float(_get(r, "drop_loss")) for r in results}
    if routing_share is not None:
        key, losses = f"{routing_share:g}", "share_losses_kv_kept" if keep_skipped_kv else "share_losses"
        missing = [r for r in results if key not in _optional(r, losses)]
        if missing:
            raise UserError(f"--plan-routing {key}: the map has no {losses} at that share; measure it with "
                            f"--shares {key}{' (a map saved since K/V-kept shares were measured)' if keep_skipped_kv else ''}")
        measured.update({(_get(r, "block"), _get(r, "part"), "route"): float(_optional(r, losses)[key])
                         for r in results})
    capacity = 1.0 - routing_share if routing_share is not None else 1.0
    total = flops(model, seq_len).total

    def with_cuts(cuts: list[PlannedCut]) -> ModelConfig:
        drops = {part: tuple(sorted(c.block for c in cuts if c.how == "drop" and c.part == part)) for part in CUT_PARTS}
        routed: dict[int, set[str]] = {}
        for cut in cuts:
            if cut.how == "route":
                routed.setdefault(cut.block, set()).add(cut.part)
        parts = tuple((block, "block" if len(names) == 2 else next(iter(names)))
                      for block, names in sorted(routed.items()))
        return dataclasses.replace(model, route_every=0, route_layers=[block for block, _ in parts] or None,
                                   route_part=format_route_parts(parts) if parts else "block",
                                   capacity=capacity if parts else model.capacity,
                                   keep_skipped_kv=keep_skipped_kv and bool(parts), drop=format_drops(drops))

    candidates = []
    for (block, part, how), loss in measured.items():
        if part not in CUT_PARTS:
            continue
        cut = PlannedCut(block, part, max(0.0, loss - dense_loss), 0, how)
        if how == "route" and part == "mlp" and keep_skipped_kv:
            continue  # --keep-skipped-kv routes attention (an MLP-only block would refuse it)
        cut.flops_saved = total - flops(with_cuts([cut]), seq_len).total
        if cut.flops_saved > 0:
            candidates.append(cut)
    candidates.sort(key=lambda cut: (cut.cost / cut.flops_saved, cut.block, cut.part, cut.how))
    plan = Plan(target, 1.0, seq_len, dense_loss, dense_loss, "", capacity=capacity)
    for cut in candidates:
        if plan.flops_ratio <= target:
            break
        taken = [c for c in plan.cuts if c.block == cut.block]
        if any(c.part == cut.part or c.how != cut.how for c in taken):  # dropped or routed, not both
            continue
        if cut.how == "drop" and sum(c.how == "drop" and c.part == cut.part for c in plan.cuts) + 1 >= model.n_layers:
            continue  # a part is never dropped in every block
        plan.cuts.append(cut)
        plan.flops_ratio = flops(with_cuts(plan.cuts), seq_len).total / total
    if plan.flops_ratio > target:
        cuts = "static drops" + (" and routing" if routing_share is not None else "")
        raise UserError(f"--target-flops {target:g} cannot be met by {cuts}: every cut the plan can combine leaves "
                        f"{plan.flops_ratio:.2f} of the forward FLOPs at T {seq_len} (the embedding and LM head stay, "
                        "a part is never dropped in every block, a routed block is not also dropped)")
    planned = with_cuts(plan.cuts)
    plan.drop = planned.drop
    plan.route_part = planned.route_part if planned.route_layers else ""
    plan.keep_skipped_kv = planned.keep_skipped_kv

    def cut_cost(block: int) -> float:
        """The predicted cost of the cuts in one block: its measured whole-block cost where both parts are cut alike
        and the map has it, else its cuts' costs added."""
        cuts = [cut for cut in plan.cuts if cut.block == block]
        whole = (block, "block", cuts[0].how)
        if len(cuts) == len(CUT_PARTS) and whole in measured:
            return max(0.0, measured[whole] - dense_loss)
        return sum(cut.cost for cut in cuts)

    plan.predicted_loss = dense_loss + sum(cut_cost(block) for block in {cut.block for cut in plan.cuts})
    if routing_share is not None:  # greedy is not optimal: a drops-only plan may predict less (routing is offered)
        try:
            drops_only = plan_drops(model, results, dense_loss, seq_len, target)
        except UserError:
            return plan
        if drops_only.predicted_loss < plan.predicted_loss:
            return drops_only
    return plan


def _get(record, name: str):
    return record[name] if isinstance(record, dict) else getattr(record, name)


def _optional(record, name: str) -> dict:
    """A per-share table a map may lack (share_losses_kv_kept: maps saved before it was measured): {} then."""
    return (record.get(name) if isinstance(record, dict) else getattr(record, name, None)) or {}


def write_plan(plan: Plan, path: str | Path, checkpoint: str) -> str:
    """The plan as a TOML `--config` file (flat keys named like the flags), with what it is in comments."""
    path = Path(path)
    if not path.resolve().parent.is_dir():
        raise UserError(f"--plan: the folder of {path} does not exist")
    lines = [f"# modcli sensitivity plan for {checkpoint}",
             f"# forward FLOPs {plan.flops_ratio:.3f} of the original's at T {plan.seq_len} (target "
             f"{plan.target_flops:g}); predicted loss {plan.predicted_loss:.4f} against {plan.dense_loss:.4f} "
             f"({(plan.predicted_loss - plan.dense_loss) / plan.dense_loss:+.1%}): the measured costs of the cuts "
             "added, each measured alone; measure the converted model with modcli eval",
             "# cuts, cheapest per FLOP first: " + ", ".join(
                 f"{c.part} {c.block}{' routed' if c.how == 'route' else ''} (+{c.cost:.4f})" for c in plan.cuts),
             (f"# convert: modcli train --init-from {checkpoint} --config {path.name} --max-steps 0 --out DIR"
              if not plan.route_part else
              f"# convert and train the new routers: modcli train --init-from {checkpoint} --config {path.name} "
              "--objective distill --trainable lora --out DIR"),
             "route_every = 0", f'drop = "{plan.drop}"']
    if plan.route_part:
        lines += [f'route_part = "{plan.route_part}"', f"capacity = {plan.capacity:g}"]
        if plan.keep_skipped_kv:
            lines.append("keep_skipped_kv = true")
    lines.append("")
    try:
        path.write_text("\n".join(lines))
    except OSError as exc:
        raise UserError(f"--plan: cannot write {path}: {exc.strerror or exc}") from None
    plan.path = str(path)
    return str(path)
