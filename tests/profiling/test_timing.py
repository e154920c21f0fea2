"""The one timing harness (modcli_runtime.timing) that every `modcli profile` backend and `--onnx` time through.

Durations here are given, not measured: the statistics and the call order are checked, never a speed."""

from __future__ import annotations

import dataclasses
import gc
import math

import pytest
from modcli_runtime.timing import interleaved, latency_stats, timed

from modcli.profiling.config import Timing
from modcli.profiling.onnx import ONNXRUNTIME_SETTLE_S, settle_before_onnxruntime


def test_latency_stats_are_the_median_the_fastest_and_the_slowest_call_in_milliseconds():
    stats = latency_stats([0.004, 0.001, 0.003], tokens_per_call=8)
    assert stats == pytest.approx({"latency_ms": 3.0, "latency_min_ms": 1.0, "latency_max_ms": 4.0,
                                   "tokens_per_s": 8 / 0.003})
    assert latency_stats([0.002, 0.001, 0.004, 0.010], 1)["latency_ms"] == pytest.approx(3.0)  # even: middle two
    assert latency_stats([0.0], 4)["tokens_per_s"] == math.inf
    with pytest.raises(ValueError, match="at least one"):
        latency_stats([], 1)


def test_profile_timings_hold_exactly_the_harness_statistics():
    extras = {"peak_mem_bytes", "compile_s", "graph_breaks"}  # what only PyTorch measurements add
    assert {f.name for f in dataclasses.fields(Timing)} == set(latency_stats([0.001], 1)) | extras
    timing = Timing(**latency_stats([0.002, 0.001], 10))
    assert (timing.latency_min_ms, timing.latency_ms, timing.latency_max_ms) == pytest.approx((1.0, 1.5, 2.0))


def test_interleaved_warms_up_untimed_then_alternates_the_order_each_round():
    order: list[str] = []

    def call(name: str, seconds: float):
        def run() -> dict[str, float]:
            order.append(name)
            assert not gc.isenabled()  # no collection is charged to one call
            return {"step": seconds}
        return run

    samples = interleaved({"model": call("model", 0.001), "baseline": call("baseline", 0.002)}, warmup=0, repeats=4)
    assert order == ["model", "baseline", "baseline", "model", "model", "baseline", "baseline", "model"]
    assert samples == {"model": {"step": [0.001] * 4}, "baseline": {"step": [0.002] * 4}}
    assert gc.isenabled()


def test_interleaved_excludes_the_warm_up_calls():
    seen: list[int] = []

    def run() -> dict[str, float]:
        seen.append(len(seen))
        return {"forward": float(len(seen))}

    samples = interleaved({("model", "eager"): run}, warmup=2, repeats=3)
    assert len(seen) == 5 and samples[("model", "eager")]["forward"] == [3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="repeats >= 1"):
        interleaved({"model": run}, warmup=0, repeats=0)


def test_interleaved_settles_untimed_between_the_calls_its_rule_names(monkeypatch):
    import modcli_runtime.timing as timing

    events: list[str] = []
    monkeypatch.setattr(timing.time, "sleep", lambda seconds: events.append(f"sleep {seconds}"))

    def run(name):
        return lambda: events.append(name) or {"forward": 0.001}

    calls = {("mod", "eager"): run("mod eager"), ("mod", "onnxruntime"): run("mod ort")}
    interleaved(calls, warmup=1, repeats=3, settle=settle_before_onnxruntime)
    pause = f"sleep {ONNXRUNTIME_SETTLE_S}"  # before onnxruntime after PyTorch only
    assert events == ["mod eager", "mod ort",  # warm-up: no pause
                      "mod eager", pause, "mod ort", "mod ort", "mod eager", "mod eager", pause, "mod ort"]


def test_timed_returns_the_wall_clock_seconds_of_one_call():
    calls = []
    seconds = timed("forward", lambda: calls.append(1))()
    assert calls == [1] and set(seconds) == {"forward"} and 0 <= seconds["forward"] < 1
