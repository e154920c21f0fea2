"""Summarise `modcli profile --json` files against the issue's CPU targets; prints a Markdown table.

    python bench/targets.py bench/results/cpu_d256_b1_r1.json bench/results/cpu_d256_b1_r2.json ...

Runs of the same shape (d_model, layers, capacity, T, batch) are grouped: each cell gives the median over the runs,
and the measured ratios of the single runs follow in brackets. Targets (d_model 256-512, 8 layers, capacity 0.125
every other block, T = 1024): MoD forward latency at most 0.60 x dense, training step at most 0.65 x dense,
measured ratio within 10% of the ideal FLOP ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

FORWARD_MAX, TRAIN_MAX, IDEAL_TOLERANCE = 0.60, 0.65, 0.10


def main(paths: list[str]) -> None:
    runs = [json.loads(open(path).read()) for path in paths]
    groups: dict[tuple, list[tuple[dict, dict]]] = defaultdict(list)
    for payload in runs:
        c = payload["model"]["config"]
        for r in payload["results"]:
            key = (c["d_model"], c["n_layers"], c["capacity"], r["seq_len"], payload["batch_size"])
            groups[key].append((payload, r))
    first = runs[0]
    print(f"{first['device_name']}, torch {first['torch_version']}, {first['dtype']}; each run: median of "
          f"{first['repeats']} interleaved MoD/dense calls after {first['warmup']} warm-up; cells: median over runs "
          f"[each run's ratio]; thread environment {first['environment'] or 'default'}\n")
    print("| model | T | batch | runs | forward ms MoD / dense | forward ratio (ideal) | forward target "
          "| train step ms MoD / dense | train ratio (ideal) | train target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (d, layers, capacity, seq_len, batch), members in sorted(groups.items()):
        cells = [f"d={d} L={layers} c={capacity:g}", str(seq_len), str(batch), str(len(members))]
        for name, limit in (("forward", FORWARD_MAX), ("train_step", TRAIN_MAX)):
            ratios = [r["ratio"].get(f"{name}_latency") for _, r in members]
            if any(q is None for q in ratios):
                cells += ["-", "-", "-"]
                continue
            measured = statistics.median(q["measured"] for q in ratios)
            ideal = statistics.median(q["ideal"] for q in ratios)
            mine = statistics.median(r["model"][name]["latency_ms"] for _, r in members)
            theirs = statistics.median(r["baseline"][name]["latency_ms"] for _, r in members)
            gap = measured / ideal - 1
            ok = measured <= limit and abs(gap) <= IDEAL_TOLERANCE
            each = ", ".join(f"{q['measured']:.3f}" for q in ratios)
            cells += [f"{mine:.1f} / {theirs:.1f}", f"**{measured:.3f}** ({ideal:.3f}, {gap:+.1%}) [{each}]",
                      f"<= {limit:.2f}, within 10%: {'met' if ok else 'MISSED'}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
