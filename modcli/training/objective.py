"""Language-model loss, the routers' auxiliary losses, and their routing statistics."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.config import TrainConfig
from modcli.models.routing.base import RoutingRecord


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def bits_per_byte(loss_nats: float, bytes_per_token: float = 1.0) -> float:
    """A loss in nats per token -> bits per byte of text (bytes_per_token = 1 when tokens are bytes)."""
    return loss_nats / math.log(2) / bytes_per_token


def routing_losses(records: list[RoutingRecord]) -> tuple[Tensor, Tensor]:
    """The routers' auxiliary losses of one training pass, each the mean over routed blocks: (router loss, weighted
    by --router-aux-weight; predictor loss, added as it is).

    Each router kind defines its own (modcli.models.routing): for `topk` the BCE of the router logits (paper method 1) and
    of the stop-gradient predictor (method 2) against the block's top-k choice, built per sequence; for `threshold`
    the capacity regulariser; `random` has none. Records of a causal forward are refused where labels come from
    top-k (their selections are padded and are the causal rule's own choice).
    """
    if not records:
        zero = torch.zeros(())
        return zero, zero
    terms = [record.router.losses(record) for record in records]
    router = torch.stack([router for router, _ in terms]).mean()
    predictor = torch.stack([predictor for _, predictor in terms]).mean()
    return router, predictor


@torch.no_grad()
def routing_agreement(records: list[RoutingRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """Per routed block, the router's statistics of a training-mode pass (`Router.metrics`): for `topk` the
    accuracy, precision, recall and processed fraction of each causal rule against top-k."""
    return {f"block{record.layer}": record.router.metrics(record) for record in records}


def _unwrapped(model):
    module = getattr(model, "module", getattr(model, "_orig_mod", model))  # DDP / torch.compile wrappers
    return getattr(module, "_orig_mod", module)


def early_exit_losses(model, targets: Tensor) -> tuple[Tensor, Callable[[], dict[str, float]] | None]:
    """The early-exit loss of the model's last training forward (`--arch early-exit`, modcli.models.early_exit): the
    cross-entropy of the exit after each block but the last (through the shared final norm and head) against
    `targets` (B, T), weighted by `exit_loss_weights` (rising with depth, summing to 1) and scaled by
    --exit-loss-scale; 0 for a model that stored no exits. And, for metrics, a function of no arguments that reads
    each exit's loss (one device sync when called)."""
    module = _unwrapped(model)
    exit_logits = getattr(module, "exit_logits", None)  # (L-1, B, T, V)
    if exit_logits is None:
        return torch.zeros(()), None
    exits = exit_logits.shape[0]
    per_token = F.cross_entropy(exit_logits.float().flatten(0, 2), targets.repeat(exits, 1, 1).flatten(),
                                reduction="none")  # (L-1 x B x T,)
    per_exit = per_token.view(exits, -1).mean(dim=1)  # (L-1,)
    loss = module.config.exit_loss_scale * (module.exit_loss_weights.to(per_exit) * per_exit).sum()

    def read() -> dict[str, float]:
        return {f"block{layer}": round(value, 4) for layer, value in enumerate(per_exit.detach().tolist())}

    return loss, read


def expert_losses(model) -> tuple[Tensor, Callable[[], dict[str, dict]] | None]:
    """The MoE load-balancing loss of the model's last forward pass (mean over MoE blocks; 0 without experts) and,
    for metrics, a function of no arguments that reads each block's statistics (one device sync when called)."""
    module = _unwrapped(model)
    blocks = [(layer, block.mlp.stats) for layer, block in enumerate(module.blocks)
              if getattr(block.mlp, "stats", None) is not None]
    if not blocks:
        return torch.zeros(()), None
    aux = torch.stack([stats.aux_loss for _, stats in blocks]).mean()

    def read() -> dict[str, dict[str, float]]:
        return {f"block{layer}": {"dropped": stats.dropped.item(), "noop": stats.noop.item(),
                                  "load": [round(x, 4) for x in stats.load.tolist()]} for layer, stats in blocks}

    return aux, read


@dataclass
class Objective:
    """One training forward's loss: `total` is what backward runs on; the rest is for metrics."""

    total: Tensor
    lm: Tensor
    """The next-token cross-entropy alone (nats, the number `modcli train` reports as its loss)."""
    terms: dict[str, Tensor]
    """Each auxiliary loss by its metrics name, before its weight."""
    weights: dict[str, float]
    """The weight each term is added to `total` with."""
    records: list[RoutingRecord]
    """The routed blocks' records of this forward (routing statistics)."""
    readers: dict[str, Callable[[], dict]]
    """Per-block statistics to read for metrics (each read costs one device sync)."""


def training_loss(model, tokens: Tensor, targets: Tensor, train: TrainConfig, routing: str | None = None,
                  capacity: float | None = None) -> Objective:
    """The one training objective: a training-mode forward of `model` (or its DDP / compiled wrapper) on tokens
    (B, T), its LM loss against targets (B, T), plus every auxiliary loss the model's family declares at its
    configured weight. `modcli train` and `modcli profile`'s training step both call this."""
    logits, records = model(tokens, routing, return_records=True, capacity=capacity)
    lm = lm_loss(logits, targets)
    router_aux, predictor_aux = routing_losses(records)
    expert_aux, expert_stats = expert_losses(model)
    exit_aux, exit_stats = early_exit_losses(model, targets)
    device = lm.device
    terms, weights, readers = {}, {}, {}
    if records:
        terms["router_aux_loss"], weights["router_aux_loss"] = router_aux.to(device), train.router_aux_weight
        terms["predictor_loss"], weights["predictor_loss"] = predictor_aux.to(device), 1.0
    if expert_stats is not None:
        terms["expert_aux_loss"], weights["expert_aux_loss"] = expert_aux.to(device), train.expert_aux_weight
        readers["experts"] = expert_stats
    if exit_stats is not None:
        terms["exit_loss"], weights["exit_loss"] = exit_aux.to(device), 1.0
        readers["exit_losses"] = exit_stats
    total = lm
    for name, term in terms.items():
        total = total + weights[name] * term
    return Objective(total, lm, terms, weights, records, readers)
