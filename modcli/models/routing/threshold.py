"""`threshold`: threshold-p routing (MoDification, Zhang et al., NAACL 2025).

A router (linear, or an MLP with --router-hidden) scores each token, and the token is processed when
sigmoid(logit) > p (--threshold, default 0.5). The rule looks at the token alone, so it is causal: training,
evaluation, prefill and decoding all use it, with no train/decode mismatch and no predictor. How many tokens a
block processes is learnt; a capacity regulariser pulls each block's share toward --capacity, weighted by
--router-aux-weight:

    loss = BCE(logit - logit(p), label),  label = 1 for the top max(1, floor(capacity x T)) logits of the sequence

so the best-scoring capacity share of each sequence is pushed above p and the rest below it (the ranking itself is
learnt from the language-model loss through the router weight). A penalty on the mean of sigmoid(logit) alone is
not enough: every logit can settle at the same value just below p, matching the mean while no token passes (seen
on a tiny model: every block processed 0% after 30 steps). The labels look at the whole sequence, but only the
training loss does; the rule that routes stays causal. Static shapes for compile and export: the `capped` mode
keeps at most
max(1, floor(capacity_max x T)) tokens (--capacity-max, default 2 x capacity), the best scores among those above
p; where more tokens pass p than that, the cap binds (reported as `cap_binds`) and the result is not causal.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.models.routing.base import ROUTER_WEIGHT_FUNCTIONS, ExportedRule, Router, RouterCapabilities, RoutingRecord, fraction
from modcli.models.routing.block_rule import capacity_tokens
from modcli.models.routing.selection import Selection, select_capped, select_topk, topk_labels
from modcli.models.routing.topk import score_flops, score_network, shift_output_bias

DEFAULT_THRESHOLD = 0.5


class ThresholdRouter(Router):
    kind = "threshold"
    capabilities = RouterCapabilities(
        modes=("router", "capped"), causal_modes=("router",), static_mode="capped",
        parameters="a linear router (or an MLP, --router-hidden)",
        notes={"router": "sigmoid(router logit) > p, token by token: training, evaluation and decoding (causal)",
               "capped": "the same rule keeping at most capacity_max x T tokens (static shapes: export and compile; "
                         "non-causal where the cap binds)"})

    def __init__(self, config, layer: int) -> None:
        super().__init__(config, layer)
        self.score = score_network(config.d_model, config.router_hidden)
        self.weight_function = ROUTER_WEIGHT_FUNCTIONS[config.router_weight]
        p = DEFAULT_THRESHOLD if config.router_options.threshold is None else config.router_options.threshold
        self.logit_threshold = -math.inf if p == 0 else math.log(p / (1 - p))

    @staticmethod
    def cap_fraction(config) -> tuple[int, int]:
        cap = config.router_options.capacity_max
        cap = cap if cap is not None else min(1.0, 2 * config.capacity)
        frac = Fraction(cap).limit_denominator(1_000_000)
        return frac.numerator, frac.denominator

    def static_fraction(self, capacity: float) -> tuple[int, int]:
        return self.cap_fraction(self.config)

    def logits(self, x: Tensor, positions: Tensor, previous_attention: Tensor | None = None) -> Tensor:
        return self.score(x).squeeze(-1)  # (B, T)

    def weight(self, logits: Tensor) -> Tensor:
        return self.weight_function(logits)

    def decide(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
               predictor_logits: Tensor | None = None) -> Tensor:
        return logits > self.logit_threshold

    def boundary_distance(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
                          predictor_logits: Tensor | None = None) -> Tensor:
        return (logits.float() - self.logit_threshold).abs()

    def exported_rule(self, mode: str) -> ExportedRule | None:
        if mode != "router":
            return None
        # sigmoid(logit) > p is logit > log(p / (1 - p)); p = 0 lets every token pass (no finite cut)
        cut = None if self.logit_threshold == -math.inf else self.logit_threshold
        return ExportedRule("score", cut=cut, weighted=True)

    def select(self, logits: Tensor, mode: str, k: int) -> Selection:
        return select_capped(logits, logits > self.logit_threshold, k)

    def losses(self, record: RoutingRecord) -> tuple[Tensor, Tensor]:
        logits = record.router_logits.float()  # (B, T)
        zero = logits.new_zeros(())
        if self.logit_threshold == -math.inf:  # p = 0: every token passes whatever the logits
            return zero, zero
        num, den = fraction(record.capacity)  # the capacity in force (--capacity-warmup included), not the cap
        k = capacity_tokens(logits.shape[1], num, den)
        labels = topk_labels(select_topk(logits.detach(), k).selected_idx, logits.shape[1])  # (B, T)
        return F.binary_cross_entropy_with_logits(logits - self.logit_threshold, labels), zero

    @torch.no_grad()
    def metrics(self, record: RoutingRecord) -> dict[str, dict[str, float]]:
        passed = record.router_logits > self.logit_threshold  # (B, T)
        seq_len = passed.shape[1]
        cap = capacity_tokens(seq_len, *self.cap_fraction(self.config))
        return {"threshold": {
            "processed_fraction": passed.float().mean().item(),
            "soft_share": torch.sigmoid(record.router_logits.float() - self.logit_threshold).mean().item(),
            "cap_binds": (passed.sum(dim=1) > cap).float().mean().item(),
        }}

    @classmethod
    def flops(cls, config, seq_len: int, include_predictor: bool = False) -> tuple[int, int]:
        return score_flops(config.d_model, config.router_hidden, seq_len), 0

    @torch.no_grad()
    def calibrate(self, record: RoutingRecord, capacity: float) -> bool:
        quantile = torch.quantile(record.router_logits.float().flatten(), 1.0 - capacity)
        shift_output_bias(self.score, quantile - max(self.logit_threshold, -1e4))
        return True
