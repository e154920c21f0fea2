"""The Router interface: what a router kind declares and does, whatever rule it routes by.

A routed block owns one Router. The block asks it for per-token scores (`logits`), then either a full-sequence
selection of a fixed number of tokens (`select`, the non-causal modes) or a causal per-token yes/no (`decide`,
the modes that prefill and decoding use), and the weight that multiplies the block's update (`weight`). The
block writes `x + w * f(x)` itself (modcli.models.routing.selection.residual_update), so no router touches the
residual stream. Training asks the router for its auxiliary losses and metrics, `modcli profile` for the
calibration of a fresh model, every command for its `capabilities` instead of comparing names, and the Hugging Face
export for its causal rule as code outside modcli restates it (`exported_rule`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from modcli.models.routing.block_rule import capacity_tokens
from modcli.models.routing.selection import Selection

if TYPE_CHECKING:
    from modcli.config import ModelConfig

def unit_weight(logits: Tensor) -> Tensor:
    """Value exactly 1 with the sigmoid's gradient: (s - stopgrad(s)) + 1, s = sigmoid(logits). A processed token's
    update is the block's whole delta, as in the model a conversion starts from, and the router still learns by
    gradient through the weight."""
    weight = torch.sigmoid(logits)
    return weight - weight.detach() + 1.0


ROUTER_WEIGHT_FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "identity": lambda logits: logits,
    "none": torch.ones_like,
    "unit": unit_weight,
}


def fraction(value: float) -> tuple[int, int]:
    """A capacity read as an exact fraction (0.125 = 1/8), so k = T * num // den has no floating-point surprises."""
    frac = Fraction(value).limit_denominator(1_000_000)
    return frac.numerator, frac.denominator


@dataclass(frozen=True)
class RouterCapabilities:
    """What a router kind can do; commands read this instead of checking the kind's name."""

    modes: tuple[str, ...]
    """Routing modes of a full forward pass, the training mode first."""
    causal_modes: tuple[str, ...]
    """The modes that decide token by token (future tokens change nothing): usable for prefill and decoding."""
    static_mode: str
    """The mode with a fixed number of tokens for a given T: the exported forward graph and compiled training."""
    graphs: tuple[str, ...] = ("forward", "decode")
    """The export graphs this router can be lowered into."""
    needs_predictor: tuple[str, ...] = ()
    """Modes that exist only when the model has a predictor (--predictor-hidden > 0)."""
    parameters: str = ""
    """Extra parameters per routed block, in words (for --help and the README)."""
    notes: dict[str, str] = field(default_factory=dict)
    """A one-line description of each mode."""

    @property
    def training_mode(self) -> str:
        return self.modes[0]

    def is_causal(self, mode: str) -> bool:
        return mode in self.causal_modes


@dataclass(frozen=True)
class ExportedRule:
    """A causal mode's decision as code that cannot import modcli restates it: the Hugging Face folder's remote code
    (modcli/bundle/hf/remote/modeling_modcli.py) keeps one implementation per `name` and reads `cut` and `weighted`
    from its config.json (route_decision, route_cut, route_score)."""

    name: str
    """score: router logit > cut; predictor: predictor logit > 0; position_hash: hash(layer, position) // 256 < cut."""
    cut: float | None = None
    """The value the rule compares with; for score, None lets every token pass (a threshold of p = 0)."""
    weighted: bool = False
    """The block keeps the router's scoring network, whose logit gives the update weight (--router-weight of it);
    False: no scoring network, weight 1."""


@dataclass
class RoutingRecord:
    """What a routed block decided in one forward pass, for the auxiliary losses and routing statistics."""

    layer: int
    mode: str
    router: Router
    router_logits: Tensor
    """(B, T) the router's per-token scores in this pass."""
    predictor_logits: Tensor | None
    """(B, T) predictor logits, when the router has a predictor and they were asked for."""
    selection: Selection
    """The tokens the block processed in this forward pass."""
    capacity: float
    """The capacity in force for this pass (lower than the target during --capacity-warmup)."""


class Router(nn.Module, metaclass=abc.ABCMeta):
    """One routed block's router. Subclasses set `kind` and `capabilities` and implement the methods below."""

    kind: ClassVar[str]
    capabilities: ClassVar[RouterCapabilities]
    reads_previous_attention: ClassVar[bool] = False
    """True when the router scores tokens by the attention they received in the block before (A-MoD): that block
    then computes its attention probabilities explicitly in full-sequence modes."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.predictor: nn.Module | None = None

    def modes(self) -> tuple[str, ...]:
        """The modes this router offers with this model (a predictor mode only where there is a predictor)."""
        caps = self.capabilities
        return tuple(m for m in caps.modes if m not in caps.needs_predictor or self.predictor is not None)

    @abc.abstractmethod
    def logits(self, x: Tensor, positions: Tensor, previous_attention: Tensor | None = None) -> Tensor:
        """Per-token scores (B, T) of x (B, T, D) at positions (B, T) or (T,); `previous_attention` (B, T) is what
        each token received in the block before, for routers that read it."""

    def weight(self, logits: Tensor) -> Tensor:
        """The factor w of the block's update for tokens with these scores (same shape)."""
        return torch.ones_like(logits)

    def static_fraction(self, capacity: float) -> tuple[int, int]:
        """How many tokens the full-sequence modes keep, as a fraction num/den of T: k = max(1, T * num // den)."""
        return fraction(capacity)

    def static_tokens(self, seq_len: int, capacity: float) -> int:
        return capacity_tokens(seq_len, *self.static_fraction(capacity))

    def select(self, logits: Tensor, mode: str, k: int) -> Selection:
        """A full-sequence (non-causal) mode: which tokens of each sequence the block processes, k of them."""
        raise ValueError(f"router {self.kind} has no full-sequence mode {mode!r}")

    def decide(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
               predictor_logits: Tensor | None = None) -> Tensor:
        """A causal mode: yes/no (B, T) per token from that token alone (and the tokens before it).

        x (B, T, D), logits (B, T), positions broadcastable to (B, T); `predictor_logits` when already computed."""
        raise ValueError(f"router {self.kind} has no causal mode {mode!r}")

    def boundary_distance(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
                          predictor_logits: Tensor | None = None) -> Tensor:
        """How far each token's causal decision is from flipping (same units as the rule's score); export
        validation treats choices within --atol of the boundary as ambiguous. Exact (integer) rules: inf."""
        return torch.full_like(logits, float("inf"), dtype=torch.float32)

    def exported_rule(self, mode: str) -> ExportedRule | None:
        """The causal `mode`'s rule for exported code (the Hugging Face folder), with this router's values; None: the
        mode has no exported form."""
        return None

    def predictor_logits(self, x: Tensor) -> Tensor | None:
        return None if self.predictor is None else self.predictor(x)

    def losses(self, record: RoutingRecord) -> tuple[Tensor, Tensor]:
        """(auxiliary router loss, predictor loss) of one training pass; the first is weighted by
        --router-aux-weight, the second (a stop-gradient predictor) is added as it is."""
        zero = record.router_logits.new_zeros(())
        return zero, zero

    def metrics(self, record: RoutingRecord) -> dict[str, dict[str, float]]:
        """Routing statistics of one training-mode pass, per rule: at least the processed fraction."""
        return {"selected": {"processed_fraction": record.selection.counts.sum().item() / record.router_logits.numel()}}

    @classmethod
    def flops(cls, config: ModelConfig, seq_len: int, include_predictor: bool = False) -> tuple[int, int]:
        """(router, predictor) forward FLOPs of one sequence in one routed block (matmuls, as FlopCounterMode
        counts them)."""
        return 0, 0

    @torch.no_grad()
    def calibrate(self, record: RoutingRecord, capacity: float) -> bool:
        """Shift an untrained router so its causal rule says yes to about `capacity` of the tokens in `record`
        (a causal pass). Returns False when the router has nothing to calibrate."""
        return False
