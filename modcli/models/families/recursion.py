"""The Mixture-of-Recursions family (`--arch recursion`): its options, their validation and its routing layout.
The decoder is modcli.models.recursion.

The unrolled depth is n_layers = 2 + recursions x shared blocks: layer 0 and layer n_layers - 1 are unique, layer
1 + r x R + j is shared block j at recursion step r (R shared blocks). Every step's layers are routed: they process
only the tokens the step's router kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from modcli.errors import UserError
from modcli.models.families.base import Family

RECURSION_UPDATES = ("published", "delta")
"""--recursion-update: how a step writes its tokens back (modcli.models.recursion)."""


@dataclass(frozen=True)
class RecursionOptions:
    """--arch recursion's own options (ModelConfig.family_options)."""

    recursions: int = 3
    """--arch recursion: how many times the shared stack runs (Mixture-of-Recursions); n_layers, the unrolled depth,
    must be 2 + recursions x the shared blocks (the first and last blocks are unique)."""
    recursion_capacities: list[float] | None = None
    """--arch recursion: share of the tokens each recursion step keeps (non-increasing, in (0, 1]); None =
    (N - r) / N for step r of N (1, 0.67, 0.33 for N = 3)."""
    recursion_update: str = "published"
    """--arch recursion: how a recursion step writes its selected tokens back: published (the MoR authors' code:
    x + alpha x sigmoid(l) x stack(x), a scatter-add of the stack's output) or delta (x + sigmoid(l) x (stack(x) -
    x), the MoD block update with the stack as f; runs saved before this option load with it)."""
    recursion_alpha: float = 0.1
    """--arch recursion with --recursion-update published: alpha, the scale of the scatter-added stack output (the
    authors' 0.1)."""

    def __post_init__(self) -> None:
        n = self.recursions
        if n < 1:
            raise UserError(f"--recursions must be >= 1, got {n}")
        if self.recursion_update not in RECURSION_UPDATES:
            raise UserError(f"--recursion-update must be one of {', '.join(RECURSION_UPDATES)}, got "
                            f"{self.recursion_update!r}")
        if not self.recursion_alpha > 0:
            raise UserError(f"--recursion-alpha must be positive, got {self.recursion_alpha}")
        caps = self.recursion_capacities
        if caps is not None:
            if len(caps) != n:
                raise UserError(f"--recursion-capacities needs {n} values (one per recursion), got {len(caps)}")
            if not (all(0.0 < c <= 1.0 for c in caps) and all(a >= b for a, b in zip(caps, caps[1:], strict=False))):
                raise UserError(f"--recursion-capacities must be in (0, 1] and must not increase, got {caps}")
            object.__setattr__(self, "recursion_capacities", list(caps))


@dataclass(frozen=True)
class Recursion(Family):
    def validate(self, config) -> None:
        n, layers = config.family_options.recursions, config.n_layers
        if layers < 2 + n or (layers - 2) % n:
            raise UserError(f"--n-layers ({layers}) must be 2 + --recursions ({n}) x the shared blocks (unique first "
                            f"and last blocks), e.g. {2 + 2 * n}")

    def describe(self, config) -> str:
        shares = ",".join(f"{c:.2g}" for c in self.capacities(config))
        return f"MoR ({config.family_options.recursions} x {self.shared_blocks(config)} shared blocks, capacities {shares})"

    def shared_blocks(self, config) -> int:
        """Blocks in the shared stack."""
        return (config.n_layers - 2) // config.family_options.recursions

    def capacities(self, config) -> list[float]:
        """Share of the tokens each step keeps: --recursion-capacities, or (N - r) / N for step r of N."""
        n, capacities = config.family_options.recursions, config.family_options.recursion_capacities
        return list(capacities) if capacities else [(n - r) / n for r in range(n)]

    def step_of(self, config, layer: int) -> int:
        """The recursion step an unrolled layer (1 .. n_layers - 2) belongs to."""
        return (layer - 1) // self.shared_blocks(config)

    def step_tokens(self, config, step: int, seq_len: int) -> int:
        """k_r of step r in the full-sequence (top-k) mode, max(1, floor(c_r x T)) exactly."""
        frac = Fraction(self.capacities(config)[step]).limit_denominator(1_000_000)
        return max(1, seq_len * frac.numerator // frac.denominator)

    def is_routed(self, config, layer: int) -> bool:
        return 0 < layer < config.n_layers - 1

    def has_router_at(self, config, layer: int) -> bool:
        """The first layer of each recursion step."""
        return self.is_routed(config, layer) and (layer - 1) % self.shared_blocks(config) == 0

    def block_tokens(self, config, layer: int, seq_len: int) -> tuple[int, int]:
        k = self.step_tokens(config, self.step_of(config, layer), seq_len) if self.is_routed(config, layer) else seq_len
        return k, k


RECURSION = Recursion(
    "recursion", "modcli.models.recursion:RecursionDecoder",
    "Mixture-of-Recursions: unique first and last blocks, a shared stack applied --recursions times, expert-choice "
    "routing keeping a shrinking share of the tokens per step, recursion-wise KV cache",
    options=RecursionOptions, aux_losses=("routing",),
    mod_routing=False, experts=False,
    exportable=False, router_fields=("router_weight", "predictor_hidden"),
    export_note="its decode step keeps one KV cache per recursion step, which a bundle's one-cache-per-block layout "
                "does not describe")
