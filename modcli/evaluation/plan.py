"""`modcli sensitivity --plan PLAN.toml --target-flops F`: the cheapest static drops that meet a FLOP target, from the
sensitivity map, written as a TOML that `modcli train --init-from RUN --config PLAN.toml` takes.

Each candidate is one sublayer (a block's attention or MLP) dropped for every token. Its cost is what the map
measured for it alone (drop_loss - dense_loss, nats/token; a negative cost counts as 0), its saving the forward FLOPs
it removes at the map's window length (modcli.models.flops, the LM head included in the total). Candidates are
taken greedily by cost per FLOP saved until the model's forward FLOPs are at most the target share of the
original's; a part is never dropped in every block. The predicted loss adds the chosen cuts' costs, a block with
both parts cut counting its measured whole-block cost: an estimate (cuts interact), which `modcli eval` of the
converted model replaces with a measurement. Routed sublayers are not candidates yet (a plan holds static drops).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from modcli.config import ModelConfig
from modcli.config.drops import format_drops
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


def plan_drops(model: ModelConfig, results: list, dense_loss: float, seq_len: int, target: float) -> Plan:
    """The plan for a model of config `model` from sensitivity results ([PartSensitivity or dicts with block, part,
    drop_loss]); a target no set of drops can meet is a UserError."""
    if not 0 < target < 1:
        raise UserError(f"--target-flops must be in (0, 1) (a share of the model's forward FLOPs), got {target}")
    measured = {(_get(r, "block"), _get(r, "part")): float(_get(r, "drop_loss")) for r in results}
    total = flops(model, seq_len).total

    def with_drops(drops: dict[str, list[int]]) -> ModelConfig:
        return dataclasses.replace(model, route_every=0, route_layers=None,
                                   drop=format_drops({part: tuple(sorted(b)) for part, b in drops.items()}))

    candidates = []
    for (block, part), loss in measured.items():
        if part not in CUT_PARTS:
            continue
        saved = total - flops(with_drops({part: [block]}), seq_len).total
        candidates.append(PlannedCut(block, part, max(0.0, loss - dense_loss), saved))
    candidates.sort(key=lambda cut: (cut.cost / max(cut.flops_saved, 1), cut.block, cut.part))
    chosen: dict[str, list[int]] = {part: [] for part in CUT_PARTS}
    plan = Plan(target, 1.0, seq_len, dense_loss, dense_loss, "")
    for cut in candidates:
        if plan.flops_ratio <= target:
            break
        if len(chosen[cut.part]) + 1 >= model.n_layers:  # a part is never dropped in every block
            continue
        chosen[cut.part].append(cut.block)
        plan.cuts.append(cut)
        plan.flops_ratio = flops(with_drops(chosen), seq_len).total / total
    if plan.flops_ratio > target:
        raise UserError(f"--target-flops {target:g} cannot be met by static drops: dropping all but one block's "
                        f"attention and MLP leaves {plan.flops_ratio:.2f} of the forward FLOPs at T {seq_len} (the "
                        "embedding and LM head stay)")
    plan.drop = with_drops(chosen).drop

    def cut_cost(block: int) -> float:
        """The predicted cost of the cuts in one block: its measured whole-block drop where both parts are cut and
        the map has it, else its cuts' costs added."""
        cuts = [cut for cut in plan.cuts if cut.block == block]
        if len(cuts) == len(CUT_PARTS) and (block, "block") in measured:
            return max(0.0, measured[(block, "block")] - dense_loss)
        return sum(cut.cost for cut in cuts)

    plan.predicted_loss = dense_loss + sum(cut_cost(block) for block in {cut.block for cut in plan.cuts})
    return plan


def _get(record, name: str):
    return record[name] if isinstance(record, dict) else getattr(record, name)


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
             "# cuts, cheapest per FLOP first: " + ", ".join(f"{c.part} {c.block} (+{c.cost:.4f})" for c in plan.cuts),
             f"# convert: modcli train --init-from {checkpoint} --config {path.name} --max-steps 0 --out DIR",
             "route_every = 0", f'drop = "{plan.drop}"', ""]
    try:
        path.write_text("\n".join(lines))
    except OSError as exc:
        raise UserError(f"--plan: cannot write {path}: {exc.strerror or exc}") from None
    plan.path = str(path)
    return str(path)
