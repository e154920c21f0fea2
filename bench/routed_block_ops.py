"""One routed block against one dense block in eager PyTorch: operator calls (torch profiler) and interleaved times.

Small preset, batch 1, T 256, a fresh model whose first routed block's router is shifted to keep 12.5% under its
causal rule; each block is called alone on the same input (B, T, D), in the training-mode forward (`topk`, k = 32)
and in the causal prefill (`router`, writing a KV cache), no grad. Prints JSON: per call the top-level aten calls
(what the block's Python issues), all aten calls (with those they make), and the median of --repeats interleaved
timings; then routed / dense.

    python bench/routed_block_ops.py [--repeats 300] > bench/results/speed/routed_block_ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.models.decoder import config_rope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    model = build_model(config).eval()
    batch, seq_len = 1, config.seq_len
    x = torch.randn(batch, seq_len, config.d_model)
    cos, sin = config_rope(config, torch.arange(seq_len))
    routed = next(block for block in model.blocks if block.routed)
    dense = next(block for block in model.blocks if not block.routed)
    with torch.no_grad():  # keep 12.5% under the router's sign, as `modcli profile` calibrates
        logits = routed.router.logits(x, torch.arange(seq_len)).flatten()
        routed.router.score.bias -= torch.quantile(logits, 1 - config.capacity)
    caches = [DecoderCache.allocate(config, batch, seq_len + 8, torch.device("cpu")) for _ in range(2)]

    def call(block, mode, cache=None):
        def run():
            with torch.no_grad():
                block(x, cos, sin, mode, False, cache.layers[block.layer] if cache else None,
                      torch.arange(batch) if cache else None)
        return run

    calls = {"dense forward": call(dense, "topk"), "routed forward": call(routed, "topk"),
             "dense prefill": call(dense, "router", caches[0]), "routed prefill": call(routed, "router", caches[1])}
    result: dict[str, object] = {"threads": args.threads, "seq_len": seq_len, "k": seq_len // 8}
    for name, run in calls.items():
        for _ in range(5):
            run()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        result[name] = {"aten_calls": len(top), "aten_calls_all": len(events)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, run in calls.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    for name in calls:
        result[name]["median_ms"] = round(statistics.median(times[name]) * 1e3, 4)
    for kind in ("forward", "prefill"):
        result[f"routed/dense {kind}"] = round(result[f"routed {kind}"]["median_ms"]
                                               / result[f"dense {kind}"]["median_ms"], 4)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
