"""The training objective, every loss in one place: the language-model loss, and each auxiliary loss a model family
declares (modcli.models.families: `aux_losses`), computed from what its forward returned (ForwardAux).

- `routing` (mod, recursion): each router's own auxiliary losses (modcli.models.routing), mean over routed blocks:
  `router_aux_loss` at --router-aux-weight (topk: BCE of the router logits against top-k; threshold: the capacity
  regulariser) and `predictor_loss` at weight 1 (the stop-gradient predictor's BCE).
- `experts` (mod): the Switch load-balancing loss of each MoE block at --expert-aux-weight, summed over the blocks
  (Switch's 0.01 is per layer; --expert-aux-mean, the behaviour of runs saved before, averages instead).
- `exits` (early-exit): the cross-entropy of the exit after every block but the last, weighted by depth, times
  --exit-loss-scale, at weight 1.

The main loss is the language-model loss (`--objective lm`); with `--objective block-match` the local block-match
loss of a conversion (`block_match`): each modified block's output (routed, or with a dropped sublayer) against the
original block's on the original's input to it, so the backward stays inside each block; with `--objective distill`
the KL divergence from the original model's next-token distribution (`distill_loss`), mixed with the LM loss, after
--local-steps of block-match (blockwise local, then global distillation). The first --router-warmup steps of any
objective train the routers alone against oracle labels (`router_warmup_loss`: the tokens whose own update in the
original block is largest), before the joint stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from modcli.config import ModelConfig, TrainConfig
from modcli.errors import UserError
from modcli.models.decoder import ForwardAux, MoDDecoder, config_rope
from modcli.models.routing.base import RoutingRecord
from modcli.models.routing.block_rule import keep_first_scores, route_part
from modcli.models.routing.selection import select_topk, topk_labels


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
    loss, per_exit = exit_losses(aux, targets, config.family_options.exit_loss_scale)

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


def modified_blocks(decoder) -> list[int]:
    """The blocks of a conversion that differ from the original's: routed, or with a dropped sublayer."""
    return [block.layer for block in getattr(decoder, "blocks", [])
            if getattr(block, "router", None) is not None or getattr(block, "kept", "block") != "block"]


def check_objective(model, train: TrainConfig, world_size: int = 1) -> None:
    """A UserError unless `train.objective` can train `model` (block-match, and distill's local stage: a Mixture-of-
    Depths decoder with modified blocks (`modified_blocks`) whose routers score each block's own input, in one
    process)."""
    if train.router_warmup:
        _check_router_warmup(unwrapped(model), world_size)
    if train.objective == "lm" or (train.objective == "distill" and not train.local_steps):
        return
    flag = "--objective block-match" if train.objective == "block-match" else "--local-steps"
    decoder = unwrapped(model)
    if type(decoder) is not MoDDecoder or not modified_blocks(decoder):
        raise UserError(f"{flag} needs routed blocks or dropped sublayers (--drop) of the Mixture-of-Depths decoder "
                        "(--arch mod)")
    if any(block.router is not None and block.router.reads_previous_attention for block in decoder.blocks):
        raise UserError(f"{flag}: the {decoder.config.router} router reads the attention of the block before, which "
                        "the dense pass does not hand on; use --objective lm")
    if world_size > 1:
        raise UserError(f"{flag} runs in one process; use --objective lm (or distill without --local-steps) under "
                        "torchrun")


def _check_router_warmup(decoder, world_size: int) -> None:
    if type(decoder) is not MoDDecoder or not any(block.router is not None for block in decoder.blocks):
        raise UserError("--router-warmup trains the routers of routed blocks (--route-every, --route-layers or a "
                        "per-block --route-part of --arch mod); this model has none")
    router = next(block.router for block in decoder.blocks if block.router is not None)
    if not list(router.parameters()):
        raise UserError(f"--router-warmup needs a router that ranks tokens by a learned score; the "
                        f"{decoder.config.router} router has none")
    if router.reads_previous_attention:
        raise UserError(f"--router-warmup: the {decoder.config.router} router reads the attention of the block before, "
                        "which the original's pass does not hand on")
    if world_size > 1:
        raise UserError("--router-warmup runs in one process; leave it out under torchrun")


def _reference_inputs(decoder, reference, tokens: Tensor, layers: list[int], cos: Tensor,
                      sin: Tensor) -> dict[int, Tensor]:
    """The reference model's input to each of `layers` (B, T, D), every block dense and whole, without gradient."""
    inputs = {}
    with torch.no_grad():
        x = reference.embed(tokens)  # (B, T, D)
        for block in reference.blocks[:max(layers) + 1]:
            if block.layer in layers:
                inputs[block.layer] = x
            x = _dense_step(block, x, cos, sin, tokens)
    return inputs


def _dense_step(block, x: Tensor, cos: Tensor, sin: Tensor, tokens: Tensor) -> Tensor:
    """A block's output with every token processed (its kept sublayers; the identity when both are dropped)."""
    if block.kept is None:
        return x
    return x + block.delta(x, cos[None], sin[None], part=block.kept, token_ids=tokens)


def block_match(model, tokens: Tensor, routing: str | None = None, capacity: float | None = None,
                reference=None) -> tuple[Tensor, ForwardAux, Tensor]:
    """The block-match loss of `model` (a MoDDecoder, or its compiled wrapper) on tokens (B, T): (the mean over
    modified blocks (`modified_blocks`) of each block's relative squared error, the routed blocks' records, that error
    per modified block).

    The reference is `reference` (the original model, frozen: --init-from), or else the same weights with routing
    off, run once without gradient; modified block i is then run on the reference's input to it, x_i (detached), and
    its output y_i compared with the reference block's, d_i:

        error_i = sum_t |y_i,t - d_i,t|^2 / sum_t |d_i,t - x_i,t|^2

    (the squared error of the tokens against the reference block's whole update). With every token processed, a
    router weight of value 1 (--router-weight unit) and the reference's weights, y_i = d_i and the loss is 0; the
    backward never crosses a block, so it reaches only the modified blocks' own parameters (their routers, and their
    weights or adapters where those train).
    """
    decoder = unwrapped(model)
    reference = decoder if reference is None else unwrapped(reference)
    routing = decoder.training_mode if routing is None else routing
    seq_len = tokens.shape[1]
    cos, sin = config_rope(decoder.config, torch.arange(seq_len, device=tokens.device))  # (T, hd/2)
    modified = modified_blocks(decoder)
    dense_in = _reference_inputs(decoder, reference, tokens, modified, cos, sin)
    with torch.no_grad():  # the reference block: every token, all of it
        dense_out = {layer: _dense_step(reference.blocks[layer], x, cos, sin, tokens) for layer, x in dense_in.items()}
    records, errors = [], []
    for layer, x_in in dense_in.items():
        block = decoder.blocks[layer]
        if block.router is not None:
            out, record = block(x_in, cos, sin, routing, True, capacity=capacity, token_ids=tokens)  # (B, T, D)
            records.append(record)
        else:  # a dropped sublayer, every token: what is kept
            out = _dense_step(block, x_in, cos, sin, tokens)
        target = dense_out[layer]
        error = (out.float() - target.float()).pow(2).sum()
        errors.append(error / (target.float() - x_in.float()).pow(2).sum().clamp(min=1e-12))
    per_block = torch.stack(errors)  # (modified,)
    return per_block.mean(), ForwardAux(records, decoder.expert_stats()), per_block


def oracle_labels(block, x: Tensor, cos: Tensor, sin: Tensor, tokens: Tensor, k: int) -> Tensor:
    """(B, T) labels, 1 for the k tokens of each sequence whose own update by `block`'s routed part (--route-part),
    |f(x_t)|^2, is largest on the block's input x (B, T, D): what the routed block would lose most by skipping (the
    oracle of bench/smollm2_oracle.py). --keep-first positions are always among them; ties go to the lower position,
    as top-k's."""
    rule = route_part(block.part)
    if rule.before:  # only the MLP is routed: its input has had every token's attention update
        x = x + block.delta(x, cos[None], sin[None], part=rule.before, token_ids=tokens)
    update = block.delta(x, cos[None], sin[None], part=block.part, token_ids=tokens)  # (B, T, D)
    positions = torch.arange(x.shape[1], device=x.device)
    scores = keep_first_scores(update.float().pow(2).sum(-1), positions, block.config.keep_first)  # (B, T)
    return topk_labels(select_topk(scores, k).selected_idx, x.shape[1])


def router_warmup_loss(model, tokens: Tensor, capacity: float | None = None,
                       reference=None) -> tuple[Tensor, Tensor]:
    """--router-warmup: each routed block's router (and predictor) trained alone against `oracle_labels` at the
    capacity in force, on the reference's input to the block (`reference`: the original model, --init-from; else the
    same weights with routing off). Returns (the mean over routed blocks of the BCE of the router logits, plus the
    predictor's where there is one; that BCE per routed block). The backward reaches the routers only: the inputs are
    the reference's, without gradient, and the labels are constants."""
    decoder = unwrapped(model)
    reference = decoder if reference is None else unwrapped(reference)
    seq_len = tokens.shape[1]
    positions = torch.arange(seq_len, device=tokens.device)
    cos, sin = config_rope(decoder.config, positions)  # (T, hd/2)
    routed = [block.layer for block in decoder.blocks if block.router is not None]
    inputs = _reference_inputs(decoder, reference, tokens, routed, cos, sin)
    losses = []
    for layer, x in inputs.items():
        router = decoder.blocks[layer].router
        k = router.static_tokens(seq_len, decoder.config.capacity if capacity is None else capacity)
        with torch.no_grad():
            labels = oracle_labels(reference.blocks[layer], x, cos, sin, tokens, k)  # (B, T)
        loss = F.binary_cross_entropy_with_logits(router.logits(x, positions).float(), labels)
        predictor = router.predictor_logits(x)
        if predictor is not None:
            loss = loss + F.binary_cross_entropy_with_logits(predictor.float(), labels)
        losses.append(loss)
    per_block = torch.stack(losses)  # (routed,)
    return per_block.mean(), per_block


def distill_loss(logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher || student) of the next-token distributions at `temperature`, mean over tokens, times the
    temperature's square (Hinton et al.: the gradient's scale stays that of temperature 1); logits (B, T, V)."""
    student = F.log_softmax(logits.float().flatten(0, 1) / temperature, dim=-1)  # (B x T, V)
    teacher = F.log_softmax(teacher_logits.float().flatten(0, 1) / temperature, dim=-1)  # (B x T, V)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature ** 2


def training_loss(model, tokens: Tensor, targets: Tensor, train: TrainConfig, routing: str | None = None,
                  capacity: float | None = None, teacher=None, step: int | None = None) -> Objective:
    """The one training objective: a forward of `model` (or its DDP / compiled wrapper) on tokens (B, T), its LM
    loss against targets (B, T) (or with --objective block-match the block-match loss, `block_match`; with distill
    the KL from `teacher`'s distribution, or the block-match loss against `teacher` while `step` (from 1) is within
    --local-steps), plus every auxiliary loss the model's family declares, at its weight. `teacher`: the original
    model (--init-from), frozen. `modcli train` and `modcli profile`'s training step both call this."""
    readers: dict[str, Callable[[], dict]] = {}
    terms: list[LossTerm] = []
    warmup = step is not None and step <= train.router_warmup
    local = train.objective == "block-match" or (train.objective == "distill" and step is not None
                                                 and step <= train.router_warmup + train.local_steps)
    if warmup:
        main, per_block = router_warmup_loss(model, tokens, capacity, teacher)
        routed = [block.layer for block in unwrapped(model).blocks if block.router is not None]
        readers["router_warmup"] = lambda: {f"block{layer}": round(value, 5)
                                            for layer, value in zip(routed, per_block.detach().tolist(), strict=True)}
        return Objective(main, main, terms, ForwardAux([], {}), readers)
    if local:
        lm, aux, per_block = block_match(model, tokens, routing, capacity, teacher)
        main = lm
        layers = modified_blocks(unwrapped(model))
        readers["block_match"] = lambda: {f"block{layer}": round(value, 5)
                                          for layer, value in zip(layers, per_block.detach().tolist(), strict=True)}
    else:
        logits, aux = model(tokens, routing, return_aux=True, capacity=capacity)
        lm = main = lm_loss(logits, targets)
        if train.objective == "distill":
            if teacher is None:
                raise UserError("--objective distill needs the original model (--init-from) to distil from")
            with torch.no_grad():
                teacher_logits = teacher(tokens)  # (B, T, V)
            kl = distill_loss(logits, teacher_logits, train.distill_temperature)
            main = (1.0 - train.distill_weight) * lm
            terms.append(LossTerm("distill_loss", kl, train.distill_weight))
    config = unwrapped(model).config
    for name in config.family.aux_losses:
        more, read = AUX_LOSSES[name](aux, targets, config, train)
        terms += more
        readers.update(read)
    total = main
    for term in terms:
        total = total + term.weight * term.value.to(lm.device)
    return Objective(total, lm, terms, aux, readers)
