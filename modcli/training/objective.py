"""The training objective, every loss in one place: the language-model loss, and each auxiliary loss a model family
declares (modcli.models.families: `aux_losses`), computed from what its forward returned (ForwardAux).

- `routing` (mod, recursion): each router's own auxiliary losses (modcli.models.routing), mean over routed blocks:
  `router_aux_loss` at --router-aux-weight (topk: BCE of the router logits against top-k; threshold: the capacity
  regulariser) and `predictor_loss` at weight 1 (the stop-gradient predictor's BCE).
- `experts` (mod): the Switch load-balancing loss of each MoE block at --expert-aux-weight, summed over the blocks
  (Switch's 0.01 is per layer; --expert-aux-mean, the behaviour of runs saved before, averages instead).
- `exits` (early-exit): the cross-entropy of the exit after every block but the last, weighted by depth, times
  --exit-loss-scale, at weight 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.config import ModelConfig, TrainConfig
from modcli.models.decoder import ForwardAux
from modcli.models.routing.base import RoutingRecord


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def bits_per_byte(loss_nats: float, bytes_per_token: float = 1.0) -> float:
    """A loss in nats per token -> bits per byte of text (bytes_per_token = 1 when tokens are bytes)."""
    return loss_nats / math.log(2) / bytes_per_token


@dataclass
class LossTerm:
    """One auxiliary loss of a training forward."""

    name: str
    """Its metrics key (metrics.jsonl), e.g. router_aux_loss."""
    value: Tensor
    """The loss before its weight (0-d)."""
    weight: float
    """The weight it is added to the total with."""


@dataclass
class Objective:
    """One training forward's loss: `total` is what backward runs on; the rest is for metrics."""

    total: Tensor
    lm: Tensor
    """The next-token cross-entropy alone (nats, the number `modcli train` reports as its loss)."""
    terms: list[LossTerm]
    """Each auxiliary loss the model's family declares, in order."""
    aux: ForwardAux
    """What the forward returned besides the logits (routing records, expert statistics, exits)."""
    readers: dict[str, Callable[[], dict]]
    """Per-block statistics to read for metrics, by metrics key (each read costs one device sync)."""


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


def exit_losses(aux: ForwardAux, targets: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The early-exit loss (`--arch early-exit`, modcli.models.early_exit): the cross-entropy of the exit after each
    block but the last (through the shared final norm and head) against `targets` (B, T), weighted by
    `aux.exit_weights` (rising with depth, summing to 1) and scaled by --exit-loss-scale; and each exit's loss
    (L-1,). 0 and an empty tensor for a pass that returned no exits (evaluation, or --exit-loss-scale 0)."""
    if aux.exit_logits is None:
        return torch.zeros(()), torch.zeros(0)
    exits = aux.exit_logits.shape[0]
    per_token = F.cross_entropy(aux.exit_logits.float().flatten(0, 2), targets.repeat(exits, 1, 1).flatten(),
                                reduction="none")  # (L-1 x B x T,)
    per_exit = per_token.view(exits, -1).mean(dim=1)  # (L-1,)
    return scale * (aux.exit_weights.to(per_exit) * per_exit).sum(), per_exit


def _routing(aux: ForwardAux, targets: Tensor, config: ModelConfig, train: TrainConfig):
    if not aux.records:
        return [], {}
    router, predictor = routing_losses(aux.records)
    return [LossTerm("router_aux_loss", router, train.router_aux_weight),
            LossTerm("predictor_loss", predictor, 1.0)], {}


def _experts(aux: ForwardAux, targets: Tensor, config: ModelConfig, train: TrainConfig):
    if not aux.experts:
        return [], {}
    blocks = aux.experts
    per_block = torch.stack([stats.aux_loss for stats in blocks.values()])  # (MoE blocks,)
    balance = per_block.sum() if train.expert_aux_sum else per_block.mean()

    def read() -> dict[str, dict[str, float]]:
        return {f"block{layer}": {"dropped": stats.dropped.item(), "noop": stats.noop.item(),
                                  "load": [round(x, 4) for x in stats.load.tolist()]} for layer, stats in blocks.items()}

    return [LossTerm("expert_aux_loss", balance, train.expert_aux_weight)], {"experts": read}


def _exits(aux: ForwardAux, targets: Tensor, config: ModelConfig, train: TrainConfig):
    if aux.exit_logits is None:
        return [], {}
    loss, per_exit = exit_losses(aux, targets, config.exit_loss_scale)

    def read() -> dict[str, float]:
        return {f"block{layer}": round(value, 4) for layer, value in enumerate(per_exit.detach().tolist())}

    return [LossTerm("exit_loss", loss, 1.0)], {"exit_losses": read}


AUX_LOSSES: dict[str, Callable] = {"routing": _routing, "experts": _experts, "exits": _exits}
"""Every auxiliary loss a family may declare: name -> f(aux, targets, model config, train config) -> (terms,
metric readers)."""


def unwrapped(model):
    """The decoder inside DDP / torch.compile wrappers."""
    module = getattr(model, "module", getattr(model, "_orig_mod", model))
    return getattr(module, "_orig_mod", module)


def training_loss(model, tokens: Tensor, targets: Tensor, train: TrainConfig, routing: str | None = None,
                  capacity: float | None = None) -> Objective:
    """The one training objective: a forward of `model` (or its DDP / compiled wrapper) on tokens (B, T), its LM
    loss against targets (B, T), plus every auxiliary loss the model's family declares, at its weight.
    `modcli train` and `modcli profile`'s training step both call this."""
    logits, aux = model(tokens, routing, return_aux=True, capacity=capacity)
    lm = lm_loss(logits, targets)
    config = unwrapped(model).config
    terms, readers = [], {}
    for name in config.family.aux_losses:
        more, read = AUX_LOSSES[name](aux, targets, config, train)
        terms += more
        readers.update(read)
    total = lm
    for term in terms:
        total = total + term.weight * term.value.to(lm.device)
    return Objective(total, lm, terms, aux, readers)
