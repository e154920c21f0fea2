"""The optimiser and the schedule of `modcli train`: AdamW's parameter groups, warm-up and cosine decay of the
learning rate, the capacity warm-up, and how many steps a FLOP budget pays for."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.distributed.tensor import DTensor

from modcli.config import ModelConfig, RunConfig, TrainConfig
from modcli.models.decoder import LowRankSkip
from modcli.models.flops import training_flops
from modcli.models.routing.base import Router


def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warm-up to lr, then cosine decay to lr x min_lr_ratio at total_steps (steps count from 1)."""
    if config.warmup and step <= config.warmup:
        return config.lr * step / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, total_steps - config.warmup))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on the blocks' matrices, the MoE experts' stacked (E, D, H)
    weights included (not norms, biases or the embedding). Router parameters (MoD and MoR routers, their
    predictors) learn at --router-lr-scale x the learning rate, the MoE gates at --expert-gate-lr-scale x (`lr_scale`
    of their groups). Parameters with the same decay and scale share a group, so a run whose scales are all 1 has
    the two groups it always had."""
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    routers = router_parameter_names(model)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decays = param.ndim >= 2 and "embed" not in name
        groups.setdefault((decays, lr_scale_of(name, config, name in routers)), []).append(param)
    ordered = sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1] != 1.0, -item[0][1]))
    return torch.optim.AdamW(
        [{"params": params, "weight_decay": config.weight_decay if decays else 0.0, "lr_scale": scale}
         for (decays, scale), params in ordered],
        lr=config.lr, betas=(0.9, 0.95), **_fused_if_possible([p for params in groups.values() for p in params]))


def lr_scale_of(name: str, config: TrainConfig, is_router: bool) -> float:
    """A parameter's learning rate relative to --lr: `is_router` (`router_parameter_names`) at --router-lr-scale, an
    MoE gate at --expert-gate-lr-scale."""
    if is_expert_gate_parameter(name):
        return config.expert_gate_lr_scale
    return config.router_lr_scale if is_router else 1.0


def router_parameter_names(model: torch.nn.Module) -> set[str]:
    """The routing parameters of `model`, by their names in `model.named_parameters()` (a DDP / compile wrapper's
    prefix included): every parameter of a routing module (modcli.models.routing.base.Router, its predictor
    included), wherever the family keeps it: an MoD block's router (`blocks.1.router.`), an MoR step's
    (`routers.0.`), and a routed block's skip forecast (--skip-update linear: `blocks.1.skip.`), which belongs to its
    routing. The one answer to "is this a router parameter" for the learning rates, --trainable and what an
    --init-from conversion starts afresh."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() if isinstance(module, (Router, LowRankSkip))
            for name, _ in module.named_parameters()}


def is_expert_gate_parameter(name: str) -> bool:
    """An MoE gate (`blocks.0.mlp.gate.`), a DDP / compile wrapper's prefix allowed."""
    return ".mlp.gate." in f".{name}"


def _fused_if_possible(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's fused kernel where it exists (plain CPU or CUDA tensors): one kernel over all parameters instead of
    a loop of small ops. On the small preset's 6.5M parameters, one CPU step (1 thread) takes 6.8 ms fused against
    64.5 ms (for-loop, PyTorch's CPU default): the update does not shrink with routed tokens, and it was most of an
    MoD training step at batch 1 (the whole step measured 109.5 ms on 1 thread). Sharded (FSDP2 DTensor) or other
    devices' parameters keep PyTorch's default."""
    plain = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in params)
    return {"fused": True} if params and plain else {}


def capacity_at(step: int, model_config: ModelConfig, config: TrainConfig) -> float:
    """The capacity in force at `step` (from 1): 1.0 annealed linearly to --capacity over --capacity-warmup steps."""
    if not config.capacity_warmup or step >= config.capacity_warmup:
        return model_config.capacity
    return 1.0 - (1.0 - model_config.capacity) * step / config.capacity_warmup


def expert_capacity_factor_at(step: int, model_config: ModelConfig, config: TrainConfig) -> float:
    """The MoE capacity factor in force at `step` (from 1): no limit (infinite) during --expert-capacity-warmup."""
    return math.inf if step <= config.expert_capacity_warmup else model_config.expert_capacity_factor


def step_flops(config: RunConfig, world_size: int = 1, step: int | None = None) -> int:
    """Training FLOPs of one optimiser step over the global batch; at `step` (from 1) an MoE's capacity is that step's
    (unlimited during --expert-capacity-warmup), else the configured one."""
    tc, model = config.train, config.model
    if step is not None and model.experts:
        model = dataclasses.replace(model, expert_capacity_factor=expert_capacity_factor_at(step, model, tc))
    return training_flops(model, model.seq_len, tc.batch_size) * tc.grad_accum * world_size


def total_steps(config: RunConfig, world_size: int = 1) -> int:
    """--max-steps, or with --flops-budget the steps that budget pays for (the budget wins; the MoE capacity
    warm-up's steps cost more)."""
    budget = config.train.flops_budget
    if not budget:
        return config.train.max_steps
    warm = config.train.expert_capacity_warmup if config.model.experts else 0
    warm_flops = step_flops(config, world_size, step=1) if warm else 0
    if warm * warm_flops >= budget:
        return max(1, math.ceil(budget / warm_flops))
    return max(1, warm + math.ceil((budget - warm * warm_flops) / step_flops(config, world_size)))
