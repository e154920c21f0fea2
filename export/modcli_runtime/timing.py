"""The one timing harness of modcli: warm-up calls, timed calls interleaved, repeats, and their statistics.

Plain Python, so that the PyTorch-free runtime times a bundle (`modcli_runtime.bench.time_bundle`) by the same rules
as `modcli profile` times its eager, compiled and onnxruntime calls (`modcli.profiling` imports this module).

A timed call runs once and returns its own durations in seconds, {quantity: seconds}: it starts its clock after its
untimed set-up (a fresh KV cache, lengths put back) and, on an accelerator, synchronises before reading the clock.
One call may time several quantities (a causal prefill, then the decode steps after it).

Statistics of the `repeats` timed calls, in milliseconds: `latency_ms` is the median (the mean of the two middle
calls for an even count), `latency_min_ms` the fastest call, `latency_max_ms` the slowest; `tokens_per_s` is the
tokens of one call at the median latency.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

Name = TypeVar("Name", bound=Hashable)
TimedCall = Callable[[], dict[str, float]]
"""Runs once and returns {quantity: seconds} of its own timed part."""


def timed(quantity: str, call: Callable[[], Any]) -> TimedCall:
    """A timed call of `call` as a whole (wall clock, no device to synchronise): {quantity: seconds}."""

    def run() -> dict[str, float]:
        start = time.perf_counter()
        call()
        return {quantity: time.perf_counter() - start}

    return run


def interleaved(calls: Mapping[Name, TimedCall], warmup: int, repeats: int,
                settle: Callable[[Name, Name], float] | None = None) -> dict[Name, dict[str, list[float]]]:
    """`warmup` untimed calls of each, then `repeats` rounds calling each once: name -> quantity -> seconds.

    The order alternates round by round (A B, then B A, ...), so that drift of the machine (other processes,
    clocks, caches) hits every call alike. The garbage collector is off while they run: a collection inside one
    call would be charged to that call alone. `settle(previous, name)`: seconds to wait, untimed, before the timed
    call `name` when the call `previous` ran just before it, e.g. until the threads of another runtime's pool have
    stopped spinning, so that the call meets the cores as it would in a process of its own.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {warmup} and {repeats}")
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    samples: dict[Name, dict[str, list[float]]] = {name: {} for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    previous = None
    try:
        for repeat in range(repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                if settle is not None and previous is not None and (pause := settle(previous, name)) > 0:
                    time.sleep(pause)
                previous = name
                for quantity, seconds in calls[name]().items():
                    samples[name].setdefault(quantity, []).append(seconds)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def latency_stats(seconds: Sequence[float], tokens_per_call: int) -> dict[str, float]:
    """The statistics of timed calls (see the module docstring) from their durations in seconds."""
    if not seconds:
        raise ValueError("latency_stats needs at least one timed call")
    median = statistics.median(seconds)
    return {"latency_ms": median * 1e3, "latency_min_ms": min(seconds) * 1e3, "latency_max_ms": max(seconds) * 1e3,
            "tokens_per_s": tokens_per_call / median if median > 0 else math.inf}
