"""A routed block inside the model against the same block alone, eager PyTorch, batch 1 (docs/results.md).

A fresh small-preset model, T 256, no grad, 2 threads. Prints, as medians of --rounds:

- every block's time in a forward pass run block by block (embedding first, head last), MoD and its dense twin;
- the first routed block called right after the dense block before it, then again at once, and after that dense
  block again with its own weights read just before (each weight's sum).

    python bench/routed_block_in_model.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.models.decoder import config_rope


def block_times(model, tokens, cos, sin) -> list[float]:
    """[embedding, block 0, ..., block L-1, final norm + head] of one forward pass, in seconds."""
    start = time.perf_counter()
    x = model.embed(tokens)
    times = [time.perf_counter() - start]
    for block in model.blocks:
        start = time.perf_counter()
        x, _ = block(x, cos, sin, model.training_mode)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    model.head(model.norm(x))
    times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    models = {"MoD": build_model(config).eval(), "dense": build_model(config.dense_twin()).eval()}
    tokens = torch.randint(0, config.vocab_size, (1, config.seq_len))
    cos, sin = config_rope(config, torch.arange(config.seq_len))
    mod = models["MoD"]
    routed = next(block for block in mod.blocks if block.routed)
    before = mod.blocks[routed.layer - 1]
    weights = [routed.attn.qkv.weight, routed.attn.proj.weight, routed.mlp.gate_up.weight, routed.mlp.down.weight]
    per_block: dict[str, list[list[float]]] = {name: [] for name in models}
    alone: dict[str, list[float]] = {"right after the dense block before it": [], "again at once": [],
                                     "after that dense block and a read of its weights": []}
    with torch.no_grad():
        for _ in range(5):
            for model in models.values():
                model(tokens)
        x0 = mod.embed(tokens)

        def routed_seconds(x) -> float:
            start = time.perf_counter()
            routed(x, cos, sin, "topk")
            return time.perf_counter() - start

        for _ in range(args.rounds):
            for name, model in models.items():
                per_block[name].append(block_times(model, tokens, cos, sin))
            x, _ = before(x0, cos, sin, "topk")
            alone["right after the dense block before it"].append(routed_seconds(x))
            alone["again at once"].append(routed_seconds(x))
            x, _ = before(x0, cos, sin, "topk")
            for weight in weights:
                weight.sum()
            alone["after that dense block and a read of its weights"].append(routed_seconds(x))
    for name, rounds in per_block.items():
        medians = [statistics.median(column) * 1e3 for column in zip(*rounds, strict=True)]
        print(f"{name}: embedding {medians[0]:.3f} ms, blocks " + ", ".join(f"{m:.3f}" for m in medians[1:-1])
              + f" ms, head {medians[-1]:.3f} ms; sum {sum(medians):.2f} ms")
    weight_mb = sum(weight.numel() * weight.element_size() for weight in weights) / 2**20
    print(f"routed block {routed.layer} ({weight_mb:.1f} MB of matmul weights) alone: "
          + ", ".join(f"{what} {statistics.median(times) * 1e3:.3f} ms" for what, times in alone.items()))


if __name__ == "__main__":
    main()
