"""CPU inference through oneDNN's prepacked linear kernel: the same products as nn.Linear, 1.7-3x faster.

On a CPU, PyTorch runs a float32 nn.Linear through its BLAS (MKL in the x86 wheels). On this project's 2-core AMD
EPYC (Zen 5) MKL stays on a narrow code path: (256 x 256) @ (256 x 1408) runs at ~175 GFLOP/s. oneDNN, which
PyTorch also ships and which torch.compile's CPU "freezing" path calls, runs the same product at ~420 GFLOP/s from a
weight reordered once into its blocked layout (`bench/cpu_linear_kernels.py` measures both per shape).
`PackedLinears` gives eager inference that kernel: inside `with PackedLinears(model):`, each nn.Linear of the model
computes `torch.ops.mkldnn._linear_pointwise` on its weight's packed copy. The copy is made on first use and made
again only when the weight changed (its version counter moved, or the parameter was replaced), so an optimizer step
or `load_state_dict` between two uses is never read stale.

A call takes nn.Linear's own forward (bit for bit what it computes without this) where the packed kernel does not
apply: grad enabled (it has no backward), an input or weight that is not float32 on the CPU, autocast on, or oneDNN
missing from the PyTorch build. It also takes nn.Linear's forward where the packed kernel does not pay: a oneDNN call
costs ~10 us more than MKL's, so small products stay on MKL (`pays`).

Results differ from MKL's by rounding only (another summation order: ~1e-6 relative). Memory: a second copy of every
weight that was packed, held as long as the `PackedLinears` object lives. The instance-level forward is set on entry
and removed on exit, so a model compiled or exported outside the `with` never sees it; do not compile or export
inside it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

SMALL_WEIGHT = 1 << 17
"""Weights below this many elements stay on MKL unless the product has >= LARGE_PRODUCT multiply-adds."""
SINGLE_ROW_WEIGHT = 1 << 19
"""A single-row product (batch-1 decode) is packed only from this many weight elements up."""
LARGE_PRODUCT = 1 << 22
"""Rows x weight elements from which any product is packed."""


def available() -> bool:
    """Whether this PyTorch build has oneDNN and the packed linear kernel."""
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


def pays(rows: int, weight_elements: int) -> bool:
    """Whether the packed kernel beats MKL for a product of `rows` input rows with a weight of `weight_elements`.

    From bench/cpu_linear_kernels.py on the 2-core Zen 5 (MKL time / packed time): a 256 x 704 weight (180k
    elements) is 0.49 at 1 row, 1.23 at 2, 1.69 at 32; 768 x 256 (197k) 0.64 / 1.71 / 1.74; 1536 x 576 (885k) 1.38
    at 1 row; 256 x 256 (65k) 0.65 at 2 rows, 1.12 at 32, 1.86 at 256."""
    if rows * weight_elements >= LARGE_PRODUCT:
        return True
    if rows == 1:
        return weight_elements >= SINGLE_ROW_WEIGHT
    return weight_elements >= SMALL_WEIGHT


def _packed_product(x: Tensor, packed: Tensor, bias: Tensor | None, *fusion) -> Tensor:
    """x @ W^T + b from W's packed copy; `fusion`: oneDNN's post-op ("none", no scalars, no algorithm)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *fusion)


class PackedLinears:
    """The packed-weight forward for every nn.Linear of `model`, active inside `with` (re-entrant, reusable)."""

    def __init__(self, model: nn.Module):
        self.linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        self._packed: dict[int, tuple[Tensor, int, Tensor]] = {}  # id(module) -> (weight, its version, packed copy)
        self._depth = 0
        self.enabled = available()

    def packed_weight(self, module: nn.Linear) -> Tensor:
        """`module.weight` in oneDNN's blocked layout, packed again if the weight changed since."""
        weight = module.weight
        cached = self._packed.get(id(module))
        if cached is None or cached[0] is not weight or cached[1] != weight._version:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            cached = (weight, weight._version, packed)
            self._packed[id(module)] = cached
        return cached[2]

    def packed_count(self) -> int:
        """How many weights have a packed copy (those that were used in a product that pays)."""
        return len(self._packed)

    def forward(self, module: nn.Linear, x: Tensor) -> Tensor:
        weight = module.weight
        if (not self.enabled or torch.is_grad_enabled() or x.dtype != torch.float32 or weight.dtype != torch.float32
                or x.device.type != "cpu" or weight.device.type != "cpu" or torch.is_autocast_enabled("cpu")
                or not pays(x.numel() // max(x.shape[-1], 1), weight.numel())):
            return nn.Linear.forward(module, x)
        return _packed_product(x, self.packed_weight(module), module.bias, "none", [], "")

    def __enter__(self) -> PackedLinears:
        if self._depth == 0 and self.enabled:
            for module in self.linears:
                module.forward = functools.partial(self.forward, module)
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0 and self.enabled:
            for module in self.linears:
                module.__dict__.pop("forward", None)


def linear_kernel(device: torch.device, dtype: str, enabled: bool) -> str:
    """What eager inference on `device` in `dtype` runs nn.Linear with: onednn-packed or aten."""
    return "onednn-packed" if enabled and device.type == "cpu" and dtype == "float32" and available() else "aten"


def inference_linears(model: nn.Module, device: torch.device, dtype: str, enabled: bool) -> PackedLinears | None:
    """The `PackedLinears` of `model` for inference on `device` in `dtype` when asked (`enabled`) and it applies
    (float32 on the CPU, oneDNN present); None otherwise: the caller enters `packed or contextlib.nullcontext()`."""
    if linear_kernel(device, dtype, enabled) != "onednn-packed":
        return None
    return PackedLinears(model)
