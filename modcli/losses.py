"""Language-model loss, the auxiliary routing losses, and how well the causal rules agree with top-k."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.model import RoutingRecord
from modcli.routing import topk_labels


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def bits_per_byte(loss_nats: float) -> float:
    """Tokens are bytes, so bits per byte is the loss in bits."""
    return loss_nats / math.log(2)


def routing_losses(records: list[RoutingRecord]) -> tuple[Tensor, Tensor]:
    """Mean BCE of the router logits (paper method 1) and of the predictor logits (method 2) against top-k.

    Labels are built per sequence from each block's top-k selection. The predictor sees a stop-gradient input,
    so its loss trains only the predictor. Records of a causal forward are refused: their selections are padded
    (padding slots hold unselected positions) and are the causal rule's own choice, not top-k's.
    """
    zero = torch.zeros(())
    router_terms, predictor_terms = [], []
    for record in records:
        labels = _topk_labels(record)  # (B, T)
        router_terms.append(F.binary_cross_entropy_with_logits(record.router_logits.float(), labels))
        if record.predictor_logits is not None:
            predictor_terms.append(F.binary_cross_entropy_with_logits(record.predictor_logits.float(), labels))
    router = torch.stack(router_terms).mean() if router_terms else zero
    predictor = torch.stack(predictor_terms).mean() if predictor_terms else zero
    return router, predictor


def _topk_labels(record: RoutingRecord) -> Tensor:
    """(B, T) labels, 1 where top-k chose the token; only a top-k forward's records can give them."""
    if record.selection.valid is not None:
        raise ValueError(f"block {record.layer}: routing labels need the records of a top-k forward pass; these come "
                         "from a causal one (padded selections would label padding slots as chosen)")
    return topk_labels(record.selection.selected_idx, record.router_logits.shape[1])


def _agreement(decisions: Tensor, labels: Tensor) -> dict[str, float]:
    chosen = labels.bool()
    true_pos = (decisions & chosen).sum().item()
    return {
        "accuracy": (decisions == chosen).float().mean().item(),
        "precision": true_pos / max(1, decisions.sum().item()),
        "recall": true_pos / max(1, chosen.sum().item()),
        "processed_fraction": decisions.float().mean().item(),
    }


@torch.no_grad()
def routing_agreement(records: list[RoutingRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """Per routed block: accuracy, precision, recall and processed fraction of each causal rule against top-k.

    The records must come from a top-k forward pass (their selections are the labels).
    """
    out: dict[str, dict[str, dict[str, float]]] = {}
    for record in records:
        labels = _topk_labels(record)
        block = {"router": _agreement(record.router_logits > 0, labels)}
        if record.predictor_logits is not None:
            block["predictor"] = _agreement(record.predictor_logits > 0, labels)
        out[f"block{record.layer}"] = block
    return out
