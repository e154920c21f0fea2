"""The exported decode step of two versions of `modcli.decode.graphs`, timed against each other and the dense twin.

    git show REV:modcli/decode/graphs.py > /tmp/graphs_before.py
    python bench/decode_graph_ab.py /tmp/graphs_before.py --batch-size 1

A fresh small-preset MoD model (routers calibrated as `modcli profile` does) has its decode-step graph exported
and fused (as `modcli export` does) once with this checkout's `DecodeStepGraph` ("now") and once with the one in
the given file ("before"); its dense twin once with this checkout's. Each graph runs in an onnxruntime session
with 2 intra-op threads (spinning off, as in `modcli profile`) for --steps steps from the same eager-prefilled
cache, each step followed by the runtime's row write; the three calls alternate for --rounds rounds (order
reversed every other round) and the medians are printed, with each MoD version's ratio to dense (and, with
--ideal, that ratio over the counted-FLOP ideal `modcli profile` gives the decode step).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from modcli_runtime.cache import CacheSpec

import modcli.bundle.lowering as lowering
from modcli.bundle.fusion import fuse_graph
from modcli.bundle.lowering import MIN_OPSET, export_onnx, export_program
from modcli.config import resolve_run_config
from modcli.hardware import seed_everything
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.profiling import onnx as profile_onnx
from modcli.profiling.calls import decode_tokens_for, input_tokens
from modcli.profiling.config import ProfileConfig
from modcli.profiling.subjects import calibrate_routers

CPU = torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="a modcli/decode/graphs.py of another revision")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--ideal", type=float, help="the decode step's FLOP ideal ratio for this shape (from "
                        "bench/results/speed/table.md: 0.560 at batch 1, 0.552 at batch 8)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = resolve_run_config("small", None, {}).model
    seed_everything(0)
    mod = build_model(config).eval()
    calibrate_routers(mod, ProfileConfig(model=config, batch_size=args.batch_size, routing="router"), CPU,
                      args.seq_len)
    seed_everything(0)
    dense = build_model(config.dense_mlp_twin()).eval()
    spec = importlib.util.spec_from_file_location("graphs_before", args.before)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before  # torch.export imports the module its code comes from by name
    spec.loader.exec_module(before)
    now = lowering.DecodeStepGraph
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, graph, routing in (("now", mod, now, "router"), ("before", mod, before.DecodeStepGraph,
                                                                          "router"), ("dense", dense, now, None)):
            lowering.DecodeStepGraph = graph
            try:
                graph_spec = lowering.decode_spec(model, routing)
            finally:
                lowering.DecodeStepGraph = now
            path = Path(tmp) / f"{name}.onnx"
            export_onnx(graph_spec, export_program(graph_spec), path, MIN_OPSET)
            fuse_graph(path, config.n_heads, config.d_model)
            print(f"{name}: {len(onnx.load(str(path)).graph.node)} top-level nodes")
            options = ort.SessionOptions()
            options.intra_op_num_threads = 2
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            mc = model.config
            cache_spec = CacheSpec(n_layers=mc.n_layers, n_heads=mc.kv_heads, head_dim=mc.head_dim, dtype="float32",
                                   routed_layers=mc.routed_layers(), capacity=mc.capacity_fraction(),
                                   processed_row_layers=[layer for layer in range(mc.n_layers)
                                                         if mc.attention_is_routed(layer)])
            prefilled = DecoderCache.allocate(mc, args.batch_size, args.seq_len + args.steps, CPU)
            with torch.no_grad():
                model(input_tokens(mc, args.batch_size, args.seq_len, 0, CPU), routing, cache=prefilled)
            tokens = decode_tokens_for(mc.vocab_size, args.batch_size, args.seq_len, args.steps, CPU).numpy()
            calls[name] = profile_onnx._decode_call(session, graph_spec.output_names, cache_spec, prefilled, tokens,
                                                    args.steps)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()
        for round_ in range(args.rounds):
            for name in list(calls) if round_ % 2 else list(calls)[::-1]:
                times[name].append(calls[name]()["decode"])
    median = {name: float(np.median(values)) for name, values in times.items()}
    for name in ("now", "before"):
        ratio = median[name] / median["dense"]
        print(f"{name}: {1e3 * median[name]:.3f} ms, dense {1e3 * median['dense']:.3f} ms, ratio {ratio:.3f}"
              + (f", ratio / ideal {ratio / args.ideal:.3f}" if args.ideal else ""))


if __name__ == "__main__":
    main()
