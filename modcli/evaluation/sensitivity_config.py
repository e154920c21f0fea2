"""What `modcli sensitivity` is asked (`SensitivityConfig`). Torch-free: `modcli --help` reads its fields as flags
(modcli.commands.config_flags.flags_of) without importing torch; the measurement is modcli.evaluation.sensitivity."""

from __future__ import annotations

from dataclasses import dataclass, field

from modcli.config import DEVICES, DTYPES, require

PARTS = ("attention", "mlp", "block")
"""The sublayers removed one at a time: the attention update, the MLP update, or both (the whole block)."""


@dataclass
class SensitivityConfig:
    """What `modcli sensitivity` measures."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder of a dense model (an imported one, say)."""
    data: str | None = None
    """Measure on this corpus' validation split instead of the one the model was trained on."""
    glob: str = "**/*"
    """File pattern when --data is a folder."""
    shares: list[float] = field(default_factory=lambda: [0.125])
    """Shares of tokens that skip each sublayer, chosen at random, each in (0, 1) (default 0.125); a skipped token is
    left out of attention (no query, key or value), as an MoD routed block leaves it."""
    seq_len: int | None = None
    """Window length in tokens; None = the run's seq_len (a shorter window measures faster)."""
    batches: int = 2
    """Validation batches."""
    batch_size: int = 4
    """Windows per batch."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype."""
    seed: int = 1337
    """Seed of the random choice of skipping tokens (the same tokens for every block and part)."""
    plot: str | None = None
    """Write a heatmap PNG of the loss increase of each drop (blocks x parts; needs matplotlib)."""
    plan: str | None = None
    """Write a plan TOML here: the cheapest static drops (measured cost per FLOP saved) that bring the forward FLOPs
    to --target-flops of the model's; `modcli train --init-from RUN --config PLAN --max-steps 0` converts."""
    target_flops: float = 0.8
    """--plan: the planned model's forward FLOPs as a share of the model's, in (0, 1), at the window length."""
    plan_routing: float | None = None
    """--plan: also consider routing each sublayer with this share of the tokens skipping it (capacity 1 - share, a
    per-block --route-part), costed by the map's loss at that share (it must be one of the map's --shares)."""
    plan_keep_skipped_kv: bool = False
    """--plan-routing: routed attention keeps the skipped tokens' keys and values (--keep-skipped-kv), costed by the
    map's K/V-kept share loss; MLPs are then only dropped."""
    measured: str | None = None
    """A map saved by `modcli sensitivity --json`: plan from it without measuring again (its checkpoint must be this
    one)."""

    def __post_init__(self) -> None:
        require(bool(self.shares), "--shares: give at least one share")
        for share in self.shares:
            require(0 < share < 1, f"--shares must each be in (0, 1) (0 is the dense model, 1 the drop), got {share}")
        repeated = [share for share in self.shares if self.shares.count(share) > 1]
        require(not repeated, f"--shares: {repeated[0]} given twice" if repeated else "")
        require(self.seq_len is None or self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}")
        require(self.batches >= 1, f"--batches must be >= 1, got {self.batches}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.plot is None or self.plot.lower().endswith(".png"), f"--plot must name a .png file, got {self.plot!r}")
        require(0 < self.target_flops < 1, f"--target-flops must be in (0, 1), got {self.target_flops}")
        require(self.plan is None or self.plan.lower().endswith(".toml"), f"--plan must name a .toml file, got "
                                                                          f"{self.plan!r}")
        require(self.plan_routing is None or 0 < self.plan_routing < 1,
                f"--plan-routing must be in (0, 1) (the share of tokens a routed sublayer skips), got "
                f"{self.plan_routing}")
        require((self.plan_routing is None and not self.plan_keep_skipped_kv) or self.plan is not None,
                "--plan-routing: give --plan PLAN.toml")
        require(not self.plan_keep_skipped_kv or self.plan_routing is not None,
                "--plan-keep-skipped-kv: give --plan-routing SHARE")
        require(self.measured is None or self.plan is not None, "--measured: give --plan PLAN.toml (it plans from "
                                                                 "a saved map)")


def share_key(share: float) -> str:
    """A share as the key of `share_losses` in the result and its JSON: 0.125 -> "0.125"."""
    return f"{share:g}"
