"""The eager decode step with the RoPE tables made once per step (decode_step, `decode_rope`) against every block
making its own (Block.decode with rope=None, the code before), on fresh small-preset models, MoD and dense,
interleaved in 15 rounds of 20 steps after the same prefill; logits checked equal bit for bit:

    python bench/decode_rope_ab.py 1; python bench/decode_rope_ab.py 8      # batch size
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


def per_block_rope_step(model, tokens, cache, routing):
    """decode_step as before: each block makes the RoPE tables itself (rope=None)."""
    x = model.embed(tokens)[:, None]  # (B, 1, D)
    for layer, block in enumerate(model.blocks):
        x = block.decode(x, cache.positions, routing, cache.layers[layer], tokens[:, None])
    cache.positions += 1
    return model.head(model.norm(x))[:, 0]


def prefilled(route_every: int, batch: int, names: tuple[str, ...], prepare=None):
    """A fresh small-preset model (MoD every `route_every`-th block, 0 = dense), its decode routing, the step's new
    tokens and, per name, a KV cache prefilled with the same 256-token prompt (room for every timed step).
    `prepare(model, prompt)`, if given, runs on the model before the prefills (to set its routers, say)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    torch.manual_seed(0)
    config = ModelConfig(**{k: v for k, v in PRESETS["small"].items() if k in fields}, route_every=route_every)
    model = build_model(config).eval()
    new_tokens = torch.randint(0, 256, (batch,))
    prompt = torch.randint(0, 256, (batch, 256))
    if prepare is not None:
        prepare(model, prompt)
    caches = {}
    with torch.no_grad():
        for name in names:
            caches[name] = DecoderCache.allocate(config, batch, 256 + ROUNDS * STEPS + 8, torch.device("cpu"))
            model(prompt, "router" if route_every else None, cache=caches[name])
    return model, "router" if route_every else "dense", new_tokens, caches


def compare_steps(label: str, batch: int, calls: dict, before: str, after: str) -> str:
    """Time two decode-step calls interleaved (ROUNDS rounds of STEPS steps each), their first logits checked equal
    bit for bit: one line with each median (min-max) ms and after / before."""
    with torch.no_grad():
        first = {name: call() for name, call in calls.items()}
        assert torch.equal(first[before], first[after])
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(ROUNDS):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    call()
                times[name].append((time.perf_counter() - start) / STEPS * 1000)
    medians = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    cells = ", ".join(f"{name} {medians[name]:.3f} ms ({min(v):.3f}-{max(v):.3f})" for name, v in times.items())
    return f"{label} batch {batch}: {cells}; {after} / {before} {medians[after] / medians[before]:.3f}"


def measure(label: str, route_every: int, batch: int) -> str:
    """One model's line: both decode steps' median (min-max) ms and their ratio."""
    model, routing, new_tokens, caches = prefilled(route_every, batch, ("per block", "once a step"))
    calls = {"per block": lambda: per_block_rope_step(model, new_tokens, caches["per block"], routing),
             "once a step": lambda: model.decode_step(new_tokens, caches["once a step"], routing)}
    return compare_steps(label, batch, calls, "per block", "once a step")


def main(measure=measure) -> None:
    """Each model's line (dense, then MoD) of `measure(label, route_every, batch)`, batch from the command line."""
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for label, route_every in (("dense", 0), ("mod", 2)):
        print(measure(label, route_every, batch), flush=True)


if __name__ == "__main__":
    main()
