"""CPU inference through oneDNN's prepacked linear kernel: the same products as nn.Linear, about 2x faster on AMD.

On a CPU, PyTorch runs a float32 nn.Linear through its BLAS (MKL in the x86 wheels). MKL runs its tuned code on
Intel CPUs only: on this project's 2-core AMD EPYC (Zen 5) it stays on a narrow code path ((256 x 256) @ (256 x 1408)
at ~175 GFLOP/s), while oneDNN, which PyTorch also ships and which torch.compile's CPU "freezing" path calls, runs the
same product at ~400 GFLOP/s from a weight reordered once into its blocked layout. On a 2-core Intel Xeon (AVX-512,
AMX) MKL time / packed time is 0.71-1.48 from 32 rows up and down to 0.24 at 1-2 rows (`bench/cpu_linear_kernels.py` measures
both per shape; bench/results/speed/cpu_linear_kernels*.txt). So the packed kernel is the default where it was
measured to pay, AMD x86-64 CPUs (`packed_by_default`), and a choice elsewhere (--packed-linears).
`PackedLinears` gives eager inference that kernel: inside `with PackedLinears(model):`, each nn.Linear of the model
computes `torch.ops.mkldnn._linear_pointwise` on its weight's packed copy. The copy is made on first use and made
again when the weight changed: its version counter moved (an optimizer step, `load_state_dict`, any in-place op),
the parameter was replaced, or its storage was (`weight.data = ...`). Only an in-place write through `.data`, which
PyTorch does not count, goes unseen.

A call takes nn.Linear's own forward (bit for bit what it computes without this) where the packed kernel does not
apply: grad enabled (it has no backward), an input or weight that is not float32 on the CPU, autocast on, or oneDNN
missing from the PyTorch build. It also takes nn.Linear's forward where the packed kernel does not pay: a oneDNN call
costs ~10 us more than MKL's, so small products stay on MKL (`min_rows`).

Results differ from MKL's by rounding only (another summation order: logits within ~4e-6 relative on the small
preset and SmolLM2-135M). Memory: a second copy of every weight that was packed, held as long as the
`PackedLinears` object lives. The instance-level forward is set on entry and removed on exit, so a model compiled,
exported or copied outside the `with` never sees it; do not compile, export, deepcopy or pickle the model inside it
(a copy would keep a forward bound to the original's weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.hardware import cpu_vendor

SMALL_WEIGHT = 1 << 17
"""Weights below this many elements stay on MKL unless the product has >= LARGE_PRODUCT multiply-adds."""
SINGLE_ROW_WEIGHT = 1 << 19
"""A single-row product (batch-1 decode) is packed only from this many weight elements up."""
LARGE_PRODUCT = 1 << 21
"""Rows x weight elements from which any product is packed."""


def available() -> bool:
    """Whether this PyTorch build has oneDNN and the packed linear kernel."""
    return torch.backends.mkldnn.is_available() and all(
        hasattr(torch.ops.mkldnn, op) for op in ("_linear_pointwise", "_reorder_linear_weight"))


def min_rows(weight_elements: int) -> int:
    """The fewest input rows for which the packed kernel beats MKL with a weight of `weight_elements`.

    From bench/cpu_linear_kernels.py on the 2-core Zen 5 (MKL time / packed time): a 256 x 704 weight (180k
    elements) is 0.49 at 1 row, 1.23 at 2, 1.69 at 32; 768 x 256 (197k) 0.64 / 1.71 / 1.74; 1536 x 576 (885k) 1.38
    at 1 row; 256 x 256 (65k) 0.60-0.65 at 2 rows, 1.12-1.30 at 32, 1.86-2.05 at 256."""
    if weight_elements >= SINGLE_ROW_WEIGHT:
        return 1
    if weight_elements >= SMALL_WEIGHT:
        return 2
    return -(-LARGE_PRODUCT // max(weight_elements, 1))


def pays(rows: int, weight_elements: int) -> bool:
    """Whether a product of `rows` input rows with a weight of `weight_elements` takes the packed kernel."""
    return rows >= min_rows(weight_elements)


def _packed_product(x: Tensor, packed: Tensor, bias: Tensor | None, *fusion) -> Tensor:
    """x @ W^T + b from W's packed copy; `fusion`: oneDNN's post-op ("none", no scalars, no algorithm)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *fusion)


class PackedLinears:
    """The packed-weight forward for the nn.Linear modules of `model`, active inside `with` (every one) or
    `with .up_to(rows)` (those that can pay at that many rows); re-entrant and reusable."""

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.enabled = enabled and available()
        # nn.Linear itself: a subclass with a forward of its own (an adapter, a quantised layer) keeps it; disabled,
        # none (entering changes nothing, and building one costs nothing)
        self.linears = [module for module in model.modules() if isinstance(module, nn.Linear)
                        and type(module).forward is nn.Linear.forward] if self.enabled else []
        # id(module) -> (weight, its version, its storage's address, packed copy)
        self._packed: dict[int, tuple[Tensor, int, int, Tensor]] = {}
        self._entered: list[contextlib.AbstractContextManager] = []

    @property
    def kernel(self) -> str:
        """What nn.Linear runs with inside: onednn-packed (where it pays) or aten (PyTorch's default)."""
        return "onednn-packed" if self.enabled else "aten"

    def packed_weight(self, module: nn.Linear) -> Tensor:
        """`module.weight` in oneDNN's blocked layout, packed again if the weight changed since."""
        weight = module.weight
        cached = self._packed.get(id(module))
        if (cached is None or cached[0] is not weight or cached[1] != weight._version
                or cached[2] != weight.data_ptr()):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            cached = (weight, weight._version, weight.data_ptr(), packed)
            self._packed[id(module)] = cached
        return cached[3]

    def packed_count(self) -> int:
        """How many weights have a packed copy (those that were used in a product that pays)."""
        return len(self._packed)

    def _forward(self, module: nn.Linear) -> Callable[[Tensor], Tensor]:
        """`module`'s forward inside `with`: the packed product from `min_rows` rows up, nn.Linear's own below it
        and wherever the packed kernel does not apply (the fallback is a few attribute reads: decoding calls it for
        every single-row product)."""
        min_elements = min_rows(module.weight.numel()) * module.in_features  # input elements from which it pays

        def forward(x: Tensor) -> Tensor:
            weight = module.weight
            if (x.numel() < min_elements or torch.is_grad_enabled() or x.dtype is not torch.float32 or not x.is_cpu
                    or weight.dtype is not torch.float32 or not weight.is_cpu or torch.is_autocast_enabled("cpu")):
                return F.linear(x, weight, module.bias)
            return _packed_product(x, self.packed_weight(module), module.bias, "none", [], "")

        return forward

    @contextlib.contextmanager
    def up_to(self, max_rows: int | None = None) -> Iterator[PackedLinears]:
        """Inside: the packed forward on each nn.Linear for which a product of at most `max_rows` input rows can
        pay (`min_rows`; None: every nn.Linear). A caller that knows its products are small (a decode step of B
        rows: `up_to(B)`) thereby leaves the others on nn.Linear's own forward, with no check per call."""
        chosen = [module for module in self.linears
                  if max_rows is None or min_rows(module.weight.numel()) <= max_rows]
        outer = [module.__dict__.get("forward") for module in chosen]  # an enclosing `with`'s, restored on exit
        try:
            for module in chosen:
                module.forward = self._forward(module)
            yield self
        finally:
            for module, forward in zip(chosen, outer, strict=True):
                if forward is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = forward

    def __enter__(self) -> PackedLinears:
        context = self.up_to()
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc) -> None:
        self._entered.pop().__exit__(*exc)


def packed_by_default() -> bool:
    """Whether CPU inference takes the packed kernel when not told (--packed-linears unset): on AMD CPUs, where MKL
    leaves its tuned code (bench/results/speed/cpu_linear_kernels.txt, Zen 5: the small preset's forward 1.40x
    (MoD) and 1.54x (dense) faster, SmolLM2-135M's 2.04x, its decode step 1.76x). Not on Intel, where MKL is tuned
    (cpu_linear_kernels-intel.txt, a Xeon with AVX-512: the small preset's forward 0.85-0.90x, SmolLM2-135M's
    forward 1.03-1.05x and its decode step 0.83x), nor on CPUs nobody measured."""
    return cpu_vendor() == "AuthenticAMD"


def linear_kernel(device: torch.device, dtype: str, enabled: bool | None) -> str:
    """What eager inference on `device` in `dtype` runs nn.Linear with: onednn-packed or aten. `enabled`: asked
    (True), refused (False) or the CPU's default (None: `packed_by_default`)."""
    wanted = packed_by_default() if enabled is None else enabled
    return "onednn-packed" if wanted and device.type == "cpu" and dtype == "float32" and available() else "aten"


def inference_linears(model: nn.Module, device: torch.device, dtype: str, enabled: bool | None) -> PackedLinears:
    """The `PackedLinears` of `model` for inference on `device` in `dtype`: enabled when asked (`enabled`; None: the
    CPU's default) and it applies (float32 on the CPU, oneDNN present); disabled, entering it changes nothing."""
    return PackedLinears(model, linear_kernel(device, dtype, enabled) == "onednn-packed")
