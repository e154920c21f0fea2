"""Latency of a bundle's ONNX graphs through onnxruntime (what `modcli profile` times next to eager PyTorch)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from modcli_runtime.bundle import Bundle, load_bundle
from modcli_runtime.cache import NUMPY_DTYPES
from modcli_runtime.timing import interleaved, latency_stats, timed


def time_bundle(path: str | Path, *, batch: int = 1, seq_len: int = 128, cache_tokens: int = 128,
                repeats: int = 20, warmup: int = 3, provider: str = "cpu", threads: int = 0, seed: int = 0,
                routed_cache_tokens: int | None = None, device_cache: bool | None = None) -> dict[str, Any]:
    """Time the forward graph on (batch, seq_len) random tokens and one decode step at `cache_tokens` cached.

    The decode step is timed with the layers that store every token (dense layers, and routed layers whose
    attention is not routed) holding `cache_tokens` tokens, and attention-routed layers holding
    `routed_cache_tokens` (default: their top-k share of `cache_tokens`), on fresh random tokens each call (the
    graph's routing decides per token; the fraction of calls in which each routed block did its work is
    reported). A timed call is what one step of `generate` costs: the graph, then `CacheSpec.write_rows` storing
    its K/V in place (lengths are put back and the token drawn, untimed, before each call, so every call sees the
    same cache). `warmup` untimed calls, then `repeats` timed ones, through the harness `modcli profile` uses
    (`modcli_runtime.timing`). Returns one dict: {"provider", "forward": {...}, "decode": {...}} with latency_ms
    (median), latency_min_ms, latency_max_ms and tokens_per_s (`modcli_runtime.timing.latency_stats`). `threads`:
    onnxruntime intra-op threads (0 = its default); match torch.get_num_threads() for a fair comparison.
    `device_cache`: as in `Bundle` (None: device-resident cache on CUDA, numpy buffers on CPU).
    """
    if batch < 1 or seq_len < 1 or cache_tokens < 0 or repeats < 1 or warmup < 0 or (
            routed_cache_tokens is not None and routed_cache_tokens < 0):
        raise ValueError("batch, seq_len and repeats must be >= 1; cache_tokens, routed_cache_tokens and warmup >= 0")
    bundle = load_bundle(path, provider=provider, verify=False, allow_invalid=True, threads=threads,
                         device_cache=device_cache)
    rng = np.random.default_rng(seed)
    results: dict[str, Any] = {"bundle": str(path), "provider": bundle.active_provider}
    if bundle.forward_info is not None and bundle.forward_info.get("kind") == "onnx":
        tokens = rng.integers(0, bundle.vocab_size, (batch, seq_len), dtype=np.int64)
        seconds = interleaved({"forward": timed("forward", lambda: bundle.forward(tokens))}, warmup, repeats)
        results["forward"] = {"batch": batch, "seq_len": seq_len,
                              **latency_stats(seconds["forward"]["forward"], batch * seq_len)}
    if bundle.decode_info is not None and bundle.decode_info.get("kind") == "onnx":
        results["decode"] = _time_decode(bundle, batch, cache_tokens, routed_cache_tokens, repeats, warmup, rng)
    return results


def _time_decode(bundle: Bundle, batch: int, cache_tokens: int, routed_cache_tokens: int | None, repeats: int,
                 warmup: int, rng: np.random.Generator) -> dict[str, Any]:
    step, cache = bundle.decoder()  # what `generate` runs (a clear error for a decode graph this runtime refuses)
    spec = bundle.cache_spec
    num, den = spec.capacity
    routed_default = min(cache_tokens, max(1, cache_tokens * num // den))
    stored = {layer: cache_tokens if spec.writes_every_row(layer) else
              (routed_default if routed_cache_tokens is None else routed_cache_tokens) for layer in spec.layers}
    dtype = NUMPY_DTYPES[spec.dtype]
    feeds: dict[str, np.ndarray] = {}
    for layer, tokens in stored.items():
        shape = (batch, spec.n_heads, tokens + 1, spec.head_dim)  # room for the step's own K/V
        feeds[f"keys.{layer}"] = rng.standard_normal(shape).astype(dtype)
        feeds[f"values.{layer}"] = rng.standard_normal(shape).astype(dtype)
        feeds[f"lengths.{layer}"] = np.full(batch, tokens, dtype=np.int64)
        if layer in spec.local_layers:  # a local layer's slots hold the latest `tokens` positions, then the step's
            held = np.arange(cache_tokens - tokens, cache_tokens + 1, dtype=np.int64)  # (tokens + 1,)
            feeds[f"slot_positions.{layer}"] = np.tile(held, (batch, 1))  # (B, tokens + 1)
    if cache is not spec:  # the device cache (modcli_runtime.device): the same contents in device buffers
        feeds.update({name: cache.to_device(array) for name, array in feeds.items()
                      if not name.startswith(("lengths", "slot_positions"))})
    feeds["positions"] = np.full(batch, cache_tokens, dtype=np.int64)
    processed = {layer: 0 for layer in spec.routed_layers}

    def one_step() -> dict[str, float]:
        for layer, tokens in stored.items():  # every call sees the same cache
            feeds[f"lengths.{layer}"][:] = tokens
        feeds["tokens"] = rng.integers(0, bundle.vocab_size, batch, dtype=np.int64)
        start = time.perf_counter()
        outputs = step(feeds)
        cache.write_rows(feeds, outputs)
        seconds = time.perf_counter() - start
        for layer in processed:
            processed[layer] += bool(outputs[f"processed.{layer}"].any())
        return {"decode": seconds}

    seconds = interleaved({"decode": one_step}, warmup, repeats)["decode"]["decode"]
    calls = repeats + warmup
    routed = [stored[layer] for layer in spec.processed_row_layers]
    return {"batch": batch, "cache_tokens": cache_tokens, "routed_cache_tokens": routed[0] if routed else None,
            "kv_cache": "numpy" if cache is spec else f"device ({cache.device})",
            **latency_stats(seconds, batch),
            "calls_with_block_work": {f"block{layer}": n / calls for layer, n in processed.items()}}
