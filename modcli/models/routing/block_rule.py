"""The routed-block rule: which tokens a Mixture-of-Depths block processes, and what it updates for them.

One statement of the rule, called by every execution path of the model (the eager forward and the cached decode
in `modcli.models.decoder`, the static decode graph in `modcli.decode.graphs`). The Hugging Face remote code
(`modcli/bundle/hf/remote/modeling_modcli.py`) cannot import modcli and restates it; tests/models/test_block_rule.py
checks the two against each other on every route part.

- Capacity: a full-sequence mode keeps k = max(1, floor(capacity x T)) tokens, in exact integer arithmetic from the
  capacity read as a fraction num/den (`capacity_tokens`; `capacity_tokens_in_graph` inside a traced graph).
- Keep-first (--keep-first N): positions 0..N-1 are always processed, in every mode (`keep_first_decisions` for the
  causal modes' yes/no, `keep_first_scores` for the full-sequence modes' scores).
- Route part (--route-part, `route_part`): which sublayers a skipped token skips. `block`: attention and MLP;
  `attention`: attention only (the MLP then runs on every token, after the routed update); `mlp`: the MLP only
  (attention, and so the KV cache, then covers every token, before the routed update). The router weight multiplies
  the routed update f(x) only, never the residual nor the sublayers every token runs: `x + w * f(x)`
  (`modcli.models.routing.selection.residual_update`).

Imports no torch (configuration reads `route_part`): the tensor helpers use only tensor methods and operators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class RoutePart:
    """What a routed block's router decides for a skipped token: which sublayers it skips."""

    name: str
    """The --route-part value: block, attention or mlp."""
    attention: bool
    """Attention is in the routed update: it (and the layer's KV cache) covers only the selected tokens."""
    mlp: bool
    """The MLP is in the routed update: it runs on the selected tokens only."""

    @property
    def before(self) -> str | None:
        """The sublayer every token runs before the routed update (a `delta` part name), or None."""
        return None if self.attention else "attention"

    @property
    def after(self) -> str | None:
        """The sublayer every token runs after the routed update (a `delta` part name), or None."""
        return None if self.mlp else "mlp"


ROUTE_PART_RULES = {
    "block": RoutePart("block", attention=True, mlp=True),
    "attention": RoutePart("attention", attention=True, mlp=False),
    "mlp": RoutePart("mlp", attention=False, mlp=True),
}
ROUTE_PARTS = tuple(ROUTE_PART_RULES)


def route_part(name: str) -> RoutePart:
    """The rule of a --route-part value (also a `delta` part: the sublayers an update is made of)."""
    return ROUTE_PART_RULES[name]


def capacity_tokens(seq_len: int, num: int, den: int) -> int:
    """k for a sequence of `seq_len` tokens at capacity num/den: max(1, floor(T x num / den)), integers only."""
    return max(1, seq_len * num // den)


def capacity_tokens_in_graph(seq_len: Tensor, num: int, den: int) -> Tensor:
    """`capacity_tokens` on a 0-d int64 tensor T, so a traced graph keeps the arithmetic (Mul, Div, Clip)."""
    return (seq_len * num // den).clamp(min=1)


def keep_first_decisions(decisions: Tensor, positions: Tensor, keep_first: int) -> Tensor:
    """A causal mode's yes/no per token with positions 0..keep_first-1 forced to yes; `positions` broadcasts to
    `decisions` (B, T) or (B,)."""
    return decisions | (positions < keep_first) if keep_first else decisions


def keep_first_scores(scores: Tensor, positions: Tensor, keep_first: int) -> Tensor:
    """A full-sequence mode's router scores (B, T) with positions 0..keep_first-1 (T,) raised to +inf, so top-k
    keeps them (inside the k: they count against the capacity)."""
    return scores.masked_fill(positions < keep_first, float("inf")) if keep_first else scores
