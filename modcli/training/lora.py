"""`--trainable lora`: low-rank adapters (LoRA, Hu et al. 2021) on the blocks' linear layers, merged into the weights
whenever a checkpoint is written, so every checkpoint is a plain model and deployment pays nothing for them.

Each adapted layer's weight becomes `W + (alpha / rank) B A` (A: rank x in, Kaiming-uniform; B: out x rank, zero, so
a model starts exactly where it was) through a torch parametrization (`torch.nn.utils.parametrize`): the module
keeps its name and its `.weight`, which every path of the decoder reads (the fused qkv's query and key/value rows are
sliced from it), and torch's own `remove_parametrizations` merges. peft was the other candidate: its LoRA layers
replace the modules (`base_layer` wrappers with their own forward), which our slicing of the fused projection, the
static decode graph and the ONNX lowering would each have to learn, and it would be a dependency of training for
~60 lines of code.

A checkpoint of a LoRA run holds the merged weights in model.safetensors (what eval, generate, profile and export
read) and the adapters in adapters.safetensors (what --resume reads: the frozen weights are the merged ones less
the adapters' product, equal to the originals up to float rounding).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from modcli.errors import UserError

TARGETS = {"qkv": ("attn", "qkv"), "proj": ("attn", "proj"), "gate_up": ("mlp", "gate_up"), "down": ("mlp", "down")}
"""--lora-targets: each name -> (sublayer, linear layer) in every block that has that sublayer."""
ADAPTERS_FILE = "adapters.safetensors"


class LowRankUpdate(nn.Module):
    """The parametrization W -> W + scale * B A of one linear layer's weight (out, in)."""

    def __init__(self, out_features: int, in_features: int, rank: int, scale: float) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear's own init (and peft's)
        self.scale = scale

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.scale * (self.lora_b @ self.lora_a).to(weight.dtype)  # (out, in)


def parse_targets(text: str) -> tuple[str, ...]:
    """--lora-targets "qkv,proj,gate_up,down" -> the names (TrainConfig checked them: LORA_TARGETS)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def add_adapters(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...]) -> list[str]:
    """A LowRankUpdate on each target linear layer of every block of `model` (a sublayer --drop removed has none);
    returns the adapted layers' names. The model computes what it computed before (B = 0)."""
    adapted = []
    for layer, block in enumerate(getattr(model, "blocks", [])):
        for target in targets:
            sublayer, name = TARGETS[target]
            linear = getattr(getattr(block, sublayer, None), name, None)
            if not isinstance(linear, nn.Linear):  # dropped, or an MoE MLP (stacked experts)
                continue
            update = LowRankUpdate(linear.out_features, linear.in_features, rank, alpha / rank)
            parametrize.register_parametrization(linear, "weight", update.to(linear.weight))
            adapted.append(f"blocks.{layer}.{sublayer}.{name}")
    if not adapted:
        raise UserError(f"--trainable lora: the model has no linear layer named by --lora-targets "
                        f"{','.join(targets)} (an MoE MLP's experts take no adapters)")
    return adapted


def adapted_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> the linear layers of `model` that carry an adapter."""
    return {name: module for name, module in model.named_modules()
            if parametrize.is_parametrized(module, "weight")
            and isinstance(module.parametrizations.weight[0], LowRankUpdate)}


def is_adapter_parameter(name: str) -> bool:
    return name.endswith((".lora_a", ".lora_b"))


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters by "<layer>.lora_a" / "<layer>.lora_b" (CPU copies), for adapters.safetensors."""
    state = {}
    for name, module in adapted_layers(model).items():
        update = module.parametrizations.weight[0]
        state[f"{name}.lora_a"] = update.lora_a.detach().cpu().contiguous()
        state[f"{name}.lora_b"] = update.lora_b.detach().cpu().contiguous()
    return state


def merged_state(model: nn.Module) -> dict[str, Tensor]:
    """`model`'s state dict as a plain model's: each adapted weight merged (W + scale B A) under its own name, no
    adapter or parametrization keys."""
    state = {}
    for name, tensor in model.state_dict().items():
        if ".parametrizations." not in name:
            state[name] = tensor
        elif name.endswith(".parametrizations.weight.original"):
            layer = name.removesuffix(".parametrizations.weight.original")
            state[f"{layer}.weight"] = model.get_submodule(layer).weight.detach()
    return state


def load_adapters(model: nn.Module, state: dict[str, Tensor], origin: str) -> None:
    """Set `model`'s adapters (added by add_adapters, its weights loaded merged) from `state`, and its frozen weights
    to the merged ones less the adapters' product, so that it computes what was saved."""
    layers = adapted_layers(model)
    expected = {f"{name}.{part}" for name in layers for part in ("lora_a", "lora_b")}
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise UserError(f"{origin} does not fit this run's adapters (missing {missing}, unexpected {unexpected}); "
                        "--lora-rank and --lora-targets must be the run's")
    with torch.no_grad():
        for name, module in layers.items():
            update = module.parametrizations.weight[0]
            a, b = state[f"{name}.lora_a"], state[f"{name}.lora_b"]
            if a.shape != update.lora_a.shape or b.shape != update.lora_b.shape:
                raise UserError(f"{origin}: {name}'s adapter has shapes {tuple(a.shape)}, {tuple(b.shape)}, this run's "
                                f"{tuple(update.lora_a.shape)}, {tuple(update.lora_b.shape)}")
            update.lora_a.copy_(a)
            update.lora_b.copy_(b)
            original = module.parametrizations.weight.original
            original.sub_(update.scale * (update.lora_b @ update.lora_a).to(original.dtype))


def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its weight and remove it: `model` is then a plain model computing the same."""
    for module in adapted_layers(model).values():
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
