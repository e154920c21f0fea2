"""Latency of a bundle's ONNX graphs through onnxruntime (what `modcli profile` times next to eager PyTorch)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from modcli_runtime.bundle import Bundle, load_bundle


def _latencies_ms(call: Callable[[], Any], repeats: int, warmup: int) -> np.ndarray:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return np.array(times)


def _summary(times_ms: np.ndarray) -> dict[str, float]:
    return {"latency_ms": float(np.median(times_ms)), "min_ms": float(times_ms.min()),
            "p90_ms": float(np.percentile(times_ms, 90))}


def time_bundle(path: str | Path, *, batch: int = 1, seq_len: int = 128, cache_tokens: int = 128,
                repeats: int = 20, warmup: int = 3, provider: str = "cpu", threads: int = 0, seed: int = 0
                ) -> dict[str, Any]:
    """Time the forward graph on (batch, seq_len) random tokens and one decode step at `cache_tokens` cached.

    The decode step is timed with dense layers holding `cache_tokens` tokens and routed layers their top-k
    share, on fresh random tokens each call (the graph's routing decides per token; the fraction of calls in
    which each routed block did its work is reported). Returns one dict:
    {"provider", "forward": {...}, "decode": {...}} with latency_ms (median), min_ms, p90_ms and tokens_per_s.
    `threads`: onnxruntime intra-op threads (0 = its default); match torch.get_num_threads() for a fair comparison.
    """
    if batch < 1 or seq_len < 1 or cache_tokens < 0 or repeats < 1 or warmup < 0:
        raise ValueError("batch, seq_len and repeats must be >= 1; cache_tokens and warmup >= 0")
    bundle = load_bundle(path, provider=provider, verify=False, allow_invalid=True, threads=threads)
    rng = np.random.default_rng(seed)
    results: dict[str, Any] = {"bundle": str(path), "provider": bundle.active_provider}
    if bundle.forward_info is not None and bundle.forward_info.get("kind") == "onnx":
        tokens = rng.integers(0, bundle.vocab_size, (batch, seq_len), dtype=np.int64)
        stats = _summary(_latencies_ms(lambda: bundle.forward(tokens), repeats, warmup))
        results["forward"] = {"batch": batch, "seq_len": seq_len, **stats,
                              "tokens_per_s": batch * seq_len / (stats["latency_ms"] / 1000)}
    if bundle.decode_info is not None and bundle.decode_info.get("kind") == "onnx":
        results["decode"] = _time_decode(bundle, batch, cache_tokens, repeats, warmup, rng)
    return results


def _time_decode(bundle: Bundle, batch: int, cache_tokens: int, repeats: int, warmup: int, rng: np.random.Generator
                 ) -> dict[str, Any]:
    spec = bundle.cache_spec
    feeds = spec.allocate(batch, cache_tokens + 1)
    num, den = spec.capacity
    for layer in range(spec.n_layers):
        stored = max(1, cache_tokens * num // den) if layer in spec.routed_layers else cache_tokens
        stored = min(stored, cache_tokens)
        feeds[f"lengths.{layer}"][:] = stored
        for name in ("keys", "values"):
            buffer = feeds[f"{name}.{layer}"]
            buffer[:] = rng.standard_normal(buffer.shape).astype(buffer.dtype)
    feeds["positions"] = np.full(batch, cache_tokens, dtype=np.int64)
    spec.ensure_room(feeds)
    processed = {layer: 0 for layer in spec.routed_layers}

    def one_step() -> None:
        feeds["tokens"] = rng.integers(0, bundle.vocab_size, batch, dtype=np.int64)
        outputs = bundle.decode_step(feeds)
        for layer in processed:
            processed[layer] += bool(outputs[f"processed.{layer}"].any())

    stats = _summary(_latencies_ms(one_step, repeats, warmup))
    calls = repeats + warmup
    return {"batch": batch, "cache_tokens": cache_tokens, **stats, "tokens_per_s": batch / (stats["latency_ms"] / 1000),
            "calls_with_block_work": {f"block{layer}": n / calls for layer, n in processed.items()}}
