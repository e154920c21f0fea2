"""What a routed block's rows cost in the exported decode step: routers forced to skip or to process every row.

    python bench/decode_rows.py [--batch-sizes 1,8] [--rounds 21]

For each batch size, a fresh small-preset MoD model is exported three ways as `modcli export` writes its decode
graph (fused): its routers' biases shifted so that every row skips, so that every row processes, and its dense
twin. Each runs in an onnxruntime session with 2 intra-op threads (spinning off, as in `modcli profile`) for
--steps steps from the same eager-prefilled cache, each step followed by the runtime's row write; the calls
alternate for --rounds rounds and the medians are printed, with a routed block's cost of processing every row
over skipping, per block ((process - skip) / routed blocks).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from modcli_runtime.cache import CacheSpec

from modcli.bundle.fusion import fuse_graph
from modcli.bundle.lowering import MIN_OPSET, decode_spec, export_onnx, export_program
from modcli.config import resolve_run_config
from modcli.hardware import seed_everything
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.profiling import onnx as profile_onnx
from modcli.profiling.calls import decode_tokens_for, input_tokens

CPU = torch.device("cpu")
SHIFTS = {"skip": -1e4, "process": 1e4, "dense": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = resolve_run_config("small", None, {}).model
    batches = [int(b) for b in args.batch_sizes.split(",")]
    calls = {}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            for name, shift in SHIFTS.items():
                seed_everything(0)
                model = build_model(config if shift is not None else config.dense_mlp_twin()).eval()
                routing = "router" if shift is not None else None
                if shift is not None:
                    with torch.no_grad():
                        for block in model.blocks:
                            if block.router is not None:
                                block.router.score.bias += shift
                mc = model.config
                spec = decode_spec(model, routing)
                path = Path(tmp) / f"{name}-{batch}.onnx"
                export_onnx(spec, export_program(spec), path, MIN_OPSET)
                fuse_graph(path, config.n_heads, config.d_model)
                options = ort.SessionOptions()
                options.intra_op_num_threads = 2
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                cache_spec = CacheSpec(n_layers=mc.n_layers, n_heads=mc.kv_heads, head_dim=mc.head_dim,
                                       dtype="float32", routed_layers=mc.routed_layers(),
                                       capacity=mc.capacity_fraction(),
                                       processed_row_layers=[layer for layer in range(mc.n_layers)
                                                             if mc.attention_is_routed(layer)])
                prefilled = DecoderCache.allocate(mc, batch, args.seq_len + args.steps, CPU)
                with torch.no_grad():
                    model(input_tokens(mc, batch, args.seq_len, 0, CPU), routing, cache=prefilled)
                tokens = decode_tokens_for(mc.vocab_size, batch, args.seq_len, args.steps, CPU).numpy()
                calls[batch, name] = profile_onnx._decode_call(session, spec.output_names, cache_spec, prefilled,
                                                               tokens, args.steps)
        times: dict = {key: [] for key in calls}
        for call in calls.values():
            call()
        for round_ in range(args.rounds):
            for key in list(calls) if round_ % 2 else list(calls)[::-1]:
                times[key].append(calls[key]()["decode"])
    median = {key: 1e3 * float(np.median(values)) for key, values in times.items()}
    routed = len(config.routed_layers())
    for batch in batches:
        print(f"batch {batch}: " + ", ".join(f"{name} {median[batch, name]:.3f} ms" for name in SHIFTS)
              + f"; a routed block processing every row costs "
              f"{(median[batch, 'process'] - median[batch, 'skip']) / routed:.3f} ms over skipping")


if __name__ == "__main__":
    main()
