"""The exported graphs with RoPE as onnxruntime's fused `RotaryEmbedding` (modcli.bundle.rotary) against the same
graphs with the exporter's eight standard operators, timed alternately in one process.

For the small preset's dense twin and MoD model (fresh, routers as initialised), each graph is exported once and
fused as `modcli export` does, with and without the RoPE rewrite; the two sessions (2 intra-op threads) run the
same tokens in alternation, median of --rounds x --calls. Outputs are checked equal to 1e-4:

    python bench/onnx_rotary_ab.py --batch-size 1 --seq-len 256
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from modcli_runtime.bundle import create_session

from modcli.bundle import fusion
from modcli.bundle.lowering import MIN_OPSET, export_onnx, export_program, forward_spec
from modcli.config import PRESETS, ModelConfig
from modcli.models.build import build_model


def sessions(route_every: int, seq_len: int, folder: Path):
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    torch.manual_seed(0)
    config = ModelConfig(**{k: v for k, v in PRESETS["small"].items() if k in fields}, route_every=route_every)
    config.seq_len = max(config.seq_len, seq_len)
    model = build_model(config).eval()
    spec = forward_spec(model)
    made = {}
    for name, rewrite in (("standard", False), ("rotary", True)):
        path = folder / f"{route_every}-{name}.onnx"
        export_onnx(spec, export_program(spec), path, MIN_OPSET)
        with mock.patch.object(fusion, "fuse_rotary", fusion.fuse_rotary if rewrite else lambda model: 0):
            fused = fusion.fuse_graph(path, config.n_heads, config.d_model)
        made[name] = (create_session(path, ["CPUExecutionProvider"], threads=2), fused)
    return spec.input_names[0], made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (args.batch_size, args.seq_len), dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        for label, route_every in (("dense", 0), ("MoD", 2)):
            input_name, made = sessions(route_every, args.seq_len, Path(tmp))
            feeds = {input_name: tokens}
            outputs = {name: session.run(None, feeds)[0] for name, (session, _) in made.items()}
            difference = float(np.abs(outputs["standard"] - outputs["rotary"]).max())
            assert difference < 1e-4, difference
            times: dict[str, list[float]] = {name: [] for name in made}
            for _ in range(args.rounds):
                for name, (session, _) in made.items():
                    for _ in range(args.calls):
                        start = time.perf_counter()
                        session.run(None, feeds)
                        times[name].append((time.perf_counter() - start) * 1000)
            medians = {name: float(np.median(values)) for name, values in times.items()}
            print(f"{label} forward, batch {args.batch_size}, T {args.seq_len}: standard {medians['standard']:.2f} ms, "
                  f"RotaryEmbedding {medians['rotary']:.2f} ms ({made['rotary'][1]}), rotary / standard "
                  f"{medians['rotary'] / medians['standard']:.3f}; max |logit difference| {difference:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
