"""torch.compile for modcli's paths, with what a user needs to judge it: compile time apart and graph breaks.

Every path compiles to one graph per call (no breaks): the top-k training step and forward have static shapes
(k is fixed by T and the capacity); the causal prefill reads the number of selected tokens as a size inside the
graph (`capture_scalar_outputs`, as torch.export does), so its shapes are data-dependent but nothing breaks; the
decode step (`modcli.decode.static`) has static shapes throughout. `CompileStats` counts the breaks that remain
(torch._dynamo's own counter), so a regression shows in `modcli train`, `generate` and `profile` output.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.utils import counters


def enable_data_dependent_sizes() -> None:
    """Let a `.item()` inside a compiled region become a symbolic size (the causal prefill's selected count)."""

    torch._dynamo.config.capture_scalar_outputs = True


def compile_mode(device: torch.device, cuda_graphs: bool) -> str | None:
    """reduce-overhead (CUDA graphs: one launch per decode step instead of hundreds) on CUDA when asked; else the
    default mode."""
    return "reduce-overhead" if cuda_graphs and device.type == "cuda" else None


@dataclass
class CompileStats:
    """What compiling cost: the wall time of the first calls (compile + run) and the graph breaks met."""

    compile_s: float = 0.0
    graph_breaks: int = 0
    break_reasons: list[str] = field(default_factory=list)

    def count_breaks_since(self, before: Counter) -> None:
        new = graph_break_counts() - before
        self.graph_breaks += sum(new.values())
        self.break_reasons += [reason.splitlines()[0][:160] for reason in new]

    def describe(self) -> str:
        breaks = "no graph breaks" if not self.graph_breaks else (
            f"{self.graph_breaks} graph break(s): " + "; ".join(self.break_reasons[:3]))
        return f"compiled in {self.compile_s:.1f} s, {breaks}"


def graph_break_counts() -> Counter:
    """torch._dynamo's graph-break counter now, by reason (subtract an earlier reading to get the new ones)."""

    return Counter(dict(counters["graph_break"]))


def compile_module(module: Any, device: torch.device, dynamic: bool | None = False, cuda_graphs: bool = False) -> Any:
    """torch.compile with modcli's settings: data-dependent sizes allowed; with `cuda_graphs`, CUDA graphs on CUDA
    (static shapes only: the decode step)."""
    enable_data_dependent_sizes()
    return torch.compile(module, dynamic=dynamic, mode=compile_mode(device, cuda_graphs))


def first_call(call: Callable[[], Any], stats: CompileStats) -> Any:
    """Run a compiled call for the first time: its wall time is added to `stats.compile_s`, with the new breaks."""
    before = graph_break_counts()
    start = time.perf_counter()
    result = call()
    stats.compile_s += time.perf_counter() - start
    stats.count_breaks_since(before)
    return result
