"""`modcli profile --backends eager,onnxruntime` with a given pause before each onnxruntime call that follows a
PyTorch call (modcli.profiling.onnx.ONNXRUNTIME_SETTLE_S; 0 = the harness before the pause), printing profile's
JSON; alternate runs with and without it and compare, e.g.

    for r in 1 2 3 4; do for s in 0.02 0; do
        python bench/ort_settle_ab.py $s 1 > bench/results/speed/ort-settle/ab_s${s}_r$r.json; done; done
    python bench/ort_settle_ab.py --summary bench/results/speed/ort-settle/*.json
"""

from __future__ import annotations

import json
import sys

import modcli.profiling.onnx as onnx_profile


def summary(paths: list[str]) -> None:
    """One line per profile JSON: eager and onnxruntime forward and decode of both models, and ratio / ideal."""
    for path in paths:
        result = json.load(open(path))["results"][0]
        cells = []
        for name in ("model", "baseline"):
            p = result[name]
            eager, ort = p["forward"]["latency_ms"], p["onnxruntime"]["forward"]["latency_ms"]
            cells.append(f"{'MoD' if name == 'model' else 'dense'}: forward eager {eager:.2f} ms, onnxruntime {ort:.2f} "
                         f"ms ({ort / eager:.3f}x); decode eager {p['decode']['latency_ms']:.2f}, onnxruntime "
                         f"{p['onnxruntime']['decode']['latency_ms']:.2f} ms")
        ratio = result["ratio"]
        over = ", ".join(f"{key} {ratio[key]['measured'] / ratio[key]['ideal']:.2f}" for key in
                         ("forward_latency", "prefill_latency", "decode_latency", "onnxruntime_forward_latency",
                          "onnxruntime_decode_latency"))
        print(f"{path.split('/')[-1]}: {' | '.join(cells)} | ratio / ideal: {over}")


def main() -> None:
    if sys.argv[1] == "--summary":
        summary(sys.argv[2:])
        return
    onnx_profile.ONNXRUNTIME_SETTLE_S = float(sys.argv[1])  # read by the pause rule and recorded in the JSON
    from modcli.cli import app

    sys.argv = ["modcli", "profile", "--preset", "small", "--batch-size", sys.argv[2], "--seq-lens", "256",
                "--compare", "dense", "--backends", "eager,onnxruntime", "--repeats", "7", "--warmup", "2",
                "--no-memory", "--json"]
    app()


if __name__ == "__main__":
    main()
