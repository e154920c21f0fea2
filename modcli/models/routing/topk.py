"""`topk`: expert-choice top-k routing, as in the Mixture-of-Depths paper (Raposo et al., 2024).

A router (linear, or a small MLP with --router-hidden) scores each token; training keeps the k = capacity x T best
tokens of each sequence (non-causal: it looks at the whole sequence). Decoding cannot see the future, so two
causal rules stand in for top-k, both trained to match its choices: the router's own sign (auxiliary BCE loss on
the router logits, paper method 1) and a small predictor MLP on a stop-gradient copy of the block input (paper
method 2). The router weight (--router-weight, sigmoid by default) multiplies the block's update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.models.routing.base import ROUTER_WEIGHT_FUNCTIONS, ExportedRule, Router, RouterCapabilities, RoutingRecord
from modcli.models.routing.selection import Selection, select_topk, topk_labels


class Predictor(nn.Module):
    """Causal stand-in for top-k (paper method 2): a small MLP on a stop-gradient copy of the block input."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.detach()).squeeze(-1)  # (B, T) logits; never sends gradient into the main model


def score_network(d_model: int, hidden: int) -> nn.Module:
    """The router's scoring network: one linear layer, or with `hidden` > 0 a two-layer MLP."""
    if hidden:
        return nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1))
    return nn.Linear(d_model, 1)


def score_flops(d_model: int, hidden: int, tokens: int) -> int:
    return 2 * tokens * (d_model * hidden + hidden) if hidden else 2 * tokens * d_model


def shift_output_bias(network: nn.Module, by: Tensor) -> None:
    last = network[-1] if isinstance(network, nn.Sequential) else network
    last.bias -= by


class TopKRouter(Router):
    kind = "topk"
    capabilities = RouterCapabilities(
        modes=("topk", "router", "predictor"), causal_modes=("router", "predictor"), static_mode="topk",
        needs_predictor=("predictor",),
        parameters="a linear router (or an MLP, --router-hidden) and a predictor MLP (--predictor-hidden)",
        notes={"topk": "top-k of the router logits over the whole sequence (training; non-causal, reference only)",
               "router": "router logit > 0 (causal, trained by an auxiliary BCE loss against top-k)",
               "predictor": "predictor logit > 0 (causal, a stop-gradient MLP trained against top-k)"})

    def __init__(self, config, layer: int) -> None:
        super().__init__(config, layer)
        self.score = score_network(config.d_model, config.router_hidden)
        self.predictor = Predictor(config.d_model, config.predictor_hidden) if config.predictor_hidden else None
        self.weight_function = ROUTER_WEIGHT_FUNCTIONS[config.router_weight]

    def logits(self, x: Tensor, positions: Tensor, previous_attention: Tensor | None = None) -> Tensor:
        return self.score(x).squeeze(-1)  # (B, T)

    def weight(self, logits: Tensor) -> Tensor:
        return self.weight_function(logits)

    def select(self, logits: Tensor, mode: str, k: int) -> Selection:
        return select_topk(logits, k)

    def decide(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
               predictor_logits: Tensor | None = None) -> Tensor:
        if mode == "router":
            return logits > 0
        return (self.predictor(x) if predictor_logits is None else predictor_logits) > 0

    def boundary_distance(self, x: Tensor, logits: Tensor, mode: str, positions: Tensor, capacity: float,
                          predictor_logits: Tensor | None = None) -> Tensor:
        if mode == "router":
            return logits.float().abs()
        return (self.predictor(x) if predictor_logits is None else predictor_logits).float().abs()

    def exported_rule(self, mode: str) -> ExportedRule | None:
        # either rule keeps the scoring network: the update weight comes from the router logit in both
        if mode == "router":
            return ExportedRule("score", cut=0.0, weighted=True)  # router logit > 0
        if mode == "predictor":
            return ExportedRule("predictor", weighted=True)  # predictor logit > 0
        return None

    def losses(self, record: RoutingRecord) -> tuple[Tensor, Tensor]:
        """BCE of the router logits (method 1) and of the predictor logits (method 2) against top-k's choice."""
        labels = _labels(record)  # (B, T)
        router = F.binary_cross_entropy_with_logits(record.router_logits.float(), labels)
        predictor = record.router_logits.new_zeros((), dtype=torch.float32)
        if record.predictor_logits is not None:
            predictor = F.binary_cross_entropy_with_logits(record.predictor_logits.float(), labels)
        return router, predictor

    @torch.no_grad()
    def metrics(self, record: RoutingRecord) -> dict[str, dict[str, float]]:
        """Accuracy, precision, recall and processed fraction of each causal rule against top-k."""
        labels = _labels(record)
        out = {"router": agreement(record.router_logits > 0, labels)}
        if record.predictor_logits is not None:
            out["predictor"] = agreement(record.predictor_logits > 0, labels)
        return out

    @classmethod
    def flops(cls, config, seq_len: int, include_predictor: bool = False) -> tuple[int, int]:
        d, hidden = config.d_model, config.predictor_hidden
        predictor = 2 * seq_len * d * hidden + 2 * seq_len * hidden if include_predictor and hidden else 0
        return score_flops(d, config.router_hidden, seq_len), predictor

    @torch.no_grad()
    def calibrate(self, record: RoutingRecord, capacity: float) -> bool:
        """Shift the router and the predictor; a `predictor` pass's record shifts the predictor alone (its inputs are
        those the predictor's own decisions gave, not the router's)."""
        if record.mode != "predictor":
            shift_output_bias(self.score, torch.quantile(record.router_logits.float().flatten(), 1.0 - capacity))
        if self.predictor is not None and record.predictor_logits is not None:
            shift_output_bias(self.predictor.net,
                              torch.quantile(record.predictor_logits.float().flatten(), 1.0 - capacity))
        return True


def _labels(record: RoutingRecord) -> Tensor:
    """(B, T) labels, 1 where top-k chose the token; only a top-k pass's records can give them."""
    if record.mode != "topk" or record.selection.valid is not None:
        raise ValueError(f"block {record.layer}: routing labels need the records of a top-k forward pass; these come "
                         f"from a {record.mode} one (padded selections would label padding slots as chosen)")
    return topk_labels(record.selection.selected_idx, record.router_logits.shape[1])


def agreement(decisions: Tensor, labels: Tensor) -> dict[str, float]:
    chosen = labels.bool()
    true_pos = (decisions & chosen).sum().item()
    return {
        "accuracy": (decisions == chosen).float().mean().item(),
        "precision": true_pos / max(1, decisions.sum().item()),
        "recall": true_pos / max(1, chosen.sum().item()),
        "processed_fraction": decisions.float().mean().item(),
    }
