"""Why a routed block at batch 1 costs more than its FLOP share on a CPU: the same weights, fewer rows.

A dense block of the small preset multiplies B x T rows by each weight matrix; a routed block at capacity 0.125
multiplies B x T / 8. This times `x @ W` for the small preset's four matrices (qkv, attention out, SwiGLU gate+up,
down) at both row counts, at batch 1 (256 and 32 rows) and batch 8 (2048 and 256 rows), and prints GFLOP/s and how
much more than 1/8 of the dense time the routed rows take:

    python bench/gemm_rows.py              # torch's default threads
    OMP_NUM_THREADS=1 python bench/gemm_rows.py
"""

from __future__ import annotations

import statistics
import time

import torch

D, HIDDEN = 256, 704  # the small preset: d_model 256, SwiGLU hidden 8/3 x 256 rounded to 64
MATRICES = {"qkv": (D, 3 * D), "attention out": (D, D), "gate+up": (D, 2 * HIDDEN), "down": (HIDDEN, D)}


def median_ms(rows: int, shape: tuple[int, int], repeats: int = 50) -> float:
    x, w = torch.randn(rows, shape[0]), torch.randn(*shape)
    for _ in range(5):
        x @ w
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| batch | matrix | dense rows | dense ms | GFLOP/s | routed rows | routed ms | GFLOP/s | routed / (dense / 8) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in (1, 8):
        dense_rows = batch * 256
        routed_rows = dense_rows // 8
        for name, shape in MATRICES.items():
            dense, routed = median_ms(dense_rows, shape), median_ms(routed_rows, shape)
            flops = 2 * shape[0] * shape[1]
            print(f"| {batch} | {name} {shape[0]}x{shape[1]} | {dense_rows} | {dense:.3f} | "
                  f"{dense_rows * flops / dense / 1e6:.0f} | {routed_rows} | {routed:.3f} | "
                  f"{routed_rows * flops / routed / 1e6:.0f} | {routed / (dense / 8):.2f} |")


if __name__ == "__main__":
    main()
