"""The eager decode step with LayerKVCache's fast append (every row appends to equally long rows: two slice copies,
no mask) against the general path (indexed writes at per-row slots and a mask, the code before), on fresh
small-preset models, MoD and dense, interleaved in 15 rounds of 20 steps after the same prefill; logits checked
equal bit for bit:

    python bench/decode_cache_ab.py 1; python bench/decode_cache_ab.py 8      # batch size
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from modcli.config import PRESETS, ModelConfig
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache

ROUNDS, STEPS = 15, 20


def measure(label: str, route_every: int, batch: int) -> str:
    """One model's line: both decode steps' median (min-max) ms and their ratio."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    torch.manual_seed(0)
    config = ModelConfig(**{k: v for k, v in PRESETS["small"].items() if k in fields}, route_every=route_every)
    model = build_model(config).eval()
    routing = "router" if route_every else "dense"
    new_tokens = torch.randint(0, 256, (batch,))
    prompt = torch.randint(0, 256, (batch, 256))
    caches = {}
    with torch.no_grad():
        for name in ("masked", "slice"):
            caches[name] = DecoderCache.allocate(config, batch, 256 + ROUNDS * STEPS + 8, torch.device("cpu"))
            model(prompt, "router" if route_every else None, cache=caches[name])

        def masked_step():
            for layer in caches["masked"].layers:
                layer.full = False  # the general path: indexed writes and a mask
            return model.decode_step(new_tokens, caches["masked"], routing)

        calls = {"masked": masked_step, "slice": lambda: model.decode_step(new_tokens, caches["slice"], routing)}
        first = {name: call() for name, call in calls.items()}
        assert torch.equal(first["masked"], first["slice"])
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    call()
                times[name].append((time.perf_counter() - start) / STEPS * 1000)
    medians = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    cells = ", ".join(f"{name} {medians[name]:.3f} ms ({min(v):.3f}-{max(v):.3f})" for name, v in times.items())
    return f"{label} batch {batch}: {cells}; slice / masked {medians['slice'] / medians['masked']:.3f}"


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for label, route_every in (("dense", 0), ("mod", 2)):
        print(measure(label, route_every, batch), flush=True)


if __name__ == "__main__":
    main()
