"""`attention`: A-MoD (Gadhikar et al., 2024, "Attention Is All You Need For Mixture-of-Depths Routing").

No router parameters: a token's score is the attention it received in the block before, which must be dense. The
paper's ViTs attend bidirectionally; in a causal decoder the raw attention is biased by position twice: token j is
seen only by the n - j queries at or after it, and query i spreads its weight over i + 1 tokens, so an early
token takes its share of the short, heavy rows (under uniform attention, dividing the sum by n - j still scores
position 0 5.4x position 127 of 128, and top-k is positions 0..k-1). The score is therefore position-neutral:
query i's attention row is divided by its uniform share 1 / (i + 1), the ratios are averaged over the n - j
queries that see token j, then over heads, so uniform attention scores every token 1 (`Attention.forward`,
modcli.models.decoder; the histogram of selected positions of a trained model is in docs/families.md). That
block computes its attention probabilities explicitly (no fused kernel) in the full-sequence mode only. Training
keeps the top k = capacity x T scores of each sequence (non-causal: later queries contribute). Decoding cannot
know what later tokens will attend to, so the causal rule is a predictor MLP on a stop-gradient copy of the block
input, trained against the top-k choice (paper method 2 of Mixture-of-Depths); the router weight is 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.models.routing.base import ExportedRule, Router, RouterCapabilities, RoutingRecord
from modcli.models.routing.selection import Selection, select_topk
from modcli.models.routing.topk import Predictor, _labels, agreement, shift_output_bias


class AttentionRouter(Router):
    kind = "attention"
    reads_previous_attention = True
    capabilities = RouterCapabilities(
        modes=("topk", "predictor"), causal_modes=("predictor",), static_mode="topk", needs_predictor=("predictor",),
        parameters="none for routing; a predictor MLP (--predictor-hidden) for decoding",
        notes={"topk": "top-k of the attention each token received in the block before (training; non-causal)",
               "predictor": "predictor logit > 0 (causal, a stop-gradient MLP trained against the top-k choice)"})

    def __init__(self, config, layer: int) -> None:
        super().__init__(config, layer)
        self.predictor = Predictor(config.d_model, config.predictor_hidden)

    def logits(self, x: Tensor, positions: Tensor, previous_attention: Tensor | None = None) -> Tensor:
        if previous_attention is None:  # decoding, or a causal mode: the predictor decides, the weight is 1
            return x.new_zeros(x.shape[:2])
        return previous_attention.to(x.dtype)  # (B, T)

    def select(self, logits: Tensor, mode: str, k: int) -> Selection:
        return select_topk(logits, k)

    def decide(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
               predictor_logits: Tensor | None = None) -> Tensor:
        return (self.predictor(x) if predictor_logits is None else predictor_logits) > 0

    def boundary_distance(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
                          predictor_logits: Tensor | None = None) -> Tensor:
        return (self.predictor(x) if predictor_logits is None else predictor_logits).float().abs()

    def exported_rule(self, mode: str) -> ExportedRule | None:
        # decodes by its predictor alone; its scores (attention received) need no network, the weight is 1
        return ExportedRule("predictor") if mode == "predictor" else None

    def losses(self, record: RoutingRecord) -> tuple[Tensor, Tensor]:
        zero = record.router_logits.new_zeros((), dtype=torch.float32)
        if record.predictor_logits is None:
            return zero, zero
        labels = _labels(record)
        return zero, F.binary_cross_entropy_with_logits(record.predictor_logits.float(), labels)

    @torch.no_grad()
    def metrics(self, record: RoutingRecord) -> dict[str, dict[str, float]]:
        if record.predictor_logits is None:
            return super().metrics(record)
        return {"predictor": agreement(record.predictor_logits > 0, _labels(record))}

    @classmethod
    def flops(cls, config, seq_len: int, include_predictor: bool = False) -> tuple[int, int]:
        hidden = config.predictor_hidden
        return 0, (2 * seq_len * config.d_model * hidden + 2 * seq_len * hidden) if include_predictor else 0

    @torch.no_grad()
    def calibrate(self, record: RoutingRecord, capacity: float) -> bool:
        if record.predictor_logits is None:
            return False
        shift_output_bias(self.predictor.net, torch.quantile(record.predictor_logits.float().flatten(), 1 - capacity))
        return True
