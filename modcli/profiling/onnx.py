"""`modcli profile --backends onnxruntime`: both models exported to ONNX here and timed through modcli_runtime.

The graphs are the ones `modcli export` writes (`modcli.bundle.lowering`: the forward graph in the router's static
mode, the decode graph in the profiled causal mode, float32, opset 18, with onnxruntime's fusions,
`modcli.bundle.fusion`); they run in onnxruntime sessions of the PyTorch-free runtime with as many intra-op
threads as PyTorch uses, spinning during a call and stopped when it returns (`SESSION_SPINNING`,
`SESSION_STOP_SPINNING`), since PyTorch runs between the calls on the same cores. What is timed, per model:

- forward: the forward graph on the same (B, T) tokens as the eager forward;
- decode: `--decode-tokens` steps of the decode graph, each followed by `CacheSpec.write_rows` (what one step of
  the runtime's generate costs), starting from the KV cache an (untimed) eager causal prefill of the same T tokens
  leaves, copied into numpy once, on the same new tokens as the eager decode; every call starts from that cache.

onnxruntime itself is imported by modcli_runtime when the first session starts.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from modcli_runtime.bundle import CacheSpec, create_session, session_providers, session_settings
from modcli_runtime.timing import TimedCall, timed

from modcli.bundle.fusion import FUSED, fuse_graph
from modcli.bundle.lowering import MIN_OPSET, GraphSpec, decode_spec, export_onnx, export_program, forward_spec
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.profiling.calls import decode_tokens_for, input_tokens
from modcli.profiling.config import ProfileConfig

CPU = torch.device("cpu")
SESSION_SPINNING = True
SESSION_STOP_SPINNING = True
"""onnxruntime's idle threads spin by default, also after a call returns; interleaved with PyTorch on the same
cores they slowed the eager calls timed between them 2x (small preset, T 256, 2 threads). Spinning off altogether
made every onnxruntime call 7-11% slower (a thread wake-up per operator: the small preset's forward 20.3 against
18.9-19.1 ms at B 1, T 256, Intel Xeon, 2 threads; eager beside it 18.3-18.6 against 18.9-19.1 ms), so profile
lets the threads spin within a call and stops them when it returns (`session.force_spinning_stop`). On a 2-core AMD
EPYC (`bench/ort_spinning_ab.py` at 56a5cc4, 3 alternated runs, medians) that made the onnxruntime forward 17.5 -> 15.8 ms (MoD)
and 29.7 -> 26.6 ms (dense) and the decode step 1.12 -> 0.92 ms and 2.06 -> 1.61 ms, the eager calls beside them
unchanged beyond their spread."""

ONNXRUNTIME_SETTLE_S = 0.02
"""Untimed pause before an onnxruntime call that follows a PyTorch call (`modcli_runtime.timing.interleaved`'s
`settle`). PyTorch's OpenMP threads (libgomp) keep spinning for some milliseconds after a parallel region, and an
onnxruntime call started within them shares the cores with them: on a 2-core AMD EPYC the small preset's
onnxruntime dense forward (batch 1, T 256) took 1.18-1.19x its time alone when it started right after an eager
call, and 1.01-1.04x after a pause of 20 ms (`bench/ort_after_eager.py` at 93fede7, `bench/results/speed/ort_after_eager.txt`).
A deployment runs onnxruntime in a process of its own, so that is what is timed. (The reverse needs no pause:
profile's sessions stop their threads spinning when a call returns, `SESSION_STOP_SPINNING`.)"""


def settle_before_onnxruntime(previous: tuple[str, ...], key: tuple[str, ...]) -> float:
    """`interleaved`'s pause before the call `key` (model name, backend, ...) after `previous`: ONNXRUNTIME_SETTLE_S
    from a PyTorch call to an onnxruntime one, else none."""
    return ONNXRUNTIME_SETTLE_S if key[1] == "onnxruntime" and previous[1] != "onnxruntime" else 0.0


def onnxruntime_settings(device: torch.device) -> dict[str, object]:
    """What the profile's onnxruntime sessions ran with (recorded in the result)."""
    return {**session_settings(torch.get_num_threads(), SESSION_SPINNING, SESSION_STOP_SPINNING),
            "settle_after_pytorch_s": ONNXRUNTIME_SETTLE_S, "operators": FUSED,
            "opset": MIN_OPSET,
            "provider": session_providers("cuda" if device.type == "cuda" else "cpu")[0]}


def onnxruntime_calls(config: ProfileConfig, models: dict[str, MoDDecoder], seq_len: int,
                      device: torch.device) -> dict[tuple[str, str], TimedCall]:
    """(model name, forward|decode) -> its timed call through onnxruntime."""
    providers = session_providers("cuda" if device.type == "cuda" else "cpu")
    threads = torch.get_num_threads()
    batch = config.batch_size
    calls: dict[tuple[str, str], TimedCall] = {}
    with tempfile.TemporaryDirectory(prefix="modcli-profile-onnx-") as tmp:  # a session keeps what it loaded
        folder = Path(tmp)
        for name, model in models.items():
            model.to("cpu").eval()  # exported and prefilled on the CPU, then back where it was
            tokens = input_tokens(model.config, batch, seq_len, config.seed, CPU)  # the eager calls' tokens
            if "forward" in config.measure:
                spec = forward_spec(model)
                session = _session(spec, folder / f"{name}.forward.onnx", providers, threads, model)
                calls[name, "forward"] = _forward_call(session, {spec.input_names[0]: tokens.numpy()})
            if "decode" in config.measure:
                spec = decode_spec(model, config.routing)
                session = _session(spec, folder / f"{name}.decode.onnx", providers, threads, model)
                model_config = model.config
                cache_spec = CacheSpec(
                    n_layers=model_config.n_layers, n_heads=model_config.kv_heads, head_dim=model_config.head_dim,
                    dtype="float32", routed_layers=model_config.routed_layers(),
                    capacity=model_config.capacity_fraction(),
                    processed_row_layers=[layer for layer in range(model_config.n_layers)
                                          if model_config.kv_is_routed(layer)],
                    kv_layers=model_config.kv_layers(),
                    local_layers=[layer for layer in model_config.kv_layers() if model_config.is_sliding(layer)])
                new_tokens = decode_tokens_for(model_config.vocab_size, batch, seq_len, config.decode_tokens, CPU)
                prefilled = DecoderCache.allocate(model_config, batch, seq_len + config.decode_tokens, CPU)
                with torch.no_grad():  # the eager causal prefill of the same tokens, untimed
                    model(tokens, config.routing, cache=prefilled)
                calls[name, "decode"] = _decode_call(session, spec.output_names, cache_spec, prefilled,
                                                     new_tokens.numpy(), config.decode_tokens)
            model.to(device)
    return calls


def _session(spec: GraphSpec, path: Path, providers: list[str], threads: int, model: MoDDecoder):
    """Export `spec` to ONNX at `path` as `modcli export` does (fused) and open it in onnxruntime."""
    export_onnx(spec, export_program(spec), path, MIN_OPSET)
    fuse_graph(path, model.config.n_heads, model.config.d_model)
    return create_session(path, providers, threads=threads, spinning=SESSION_SPINNING,
                          stop_spinning=SESSION_STOP_SPINNING)


def _forward_call(session, feeds: dict[str, np.ndarray]) -> TimedCall:
    return timed("forward", lambda: session.run(None, feeds))


def _decode_call(session, output_names: list[str], cache_spec: CacheSpec, prefilled: DecoderCache,
                 new_tokens: np.ndarray, steps: int) -> TimedCall:
    """Decode steps from a prefilled cache, copied into numpy buffers with room for every step."""
    feeds: dict[str, np.ndarray] = {}
    start_lengths = {}
    for layer in cache_spec.layers:  # a layer without attention (a static drop) has no cache inputs
        layer_cache = prefilled.layers[layer]
        slots = int(layer_cache.lengths.max()) + steps + 1  # no buffer grows inside a timed call
        shape = (layer_cache.keys.shape[0], layer_cache.keys.shape[1], slots, layer_cache.keys.shape[3])
        keys, values = np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)
        filled = min(slots, layer_cache.slots)
        keys[:, :, :filled] = layer_cache.keys[:, :, :filled].float().cpu().numpy()
        values[:, :, :filled] = layer_cache.values[:, :, :filled].float().cpu().numpy()
        feeds[f"keys.{layer}"], feeds[f"values.{layer}"] = keys, values
        if layer in cache_spec.local_layers:  # a sliding-window layer's decode graph reads each slot's position
            slot_positions = np.zeros(shape[:1] + shape[2:3], dtype=np.int64)
            slot_positions[:, :filled] = layer_cache.slot_positions[:, :filled].cpu().numpy()
            feeds[f"slot_positions.{layer}"] = slot_positions
        start_lengths[layer] = layer_cache.lengths.cpu().numpy().astype(np.int64)
    positions = prefilled.positions.cpu().numpy().astype(np.int64)

    def call() -> dict[str, float]:
        for layer, lengths in start_lengths.items():  # every call decodes from the same prefilled cache
            feeds[f"lengths.{layer}"] = lengths.copy()
        feeds["positions"] = positions.copy()
        start = time.perf_counter()
        for step in range(steps):
            feeds["tokens"] = new_tokens[step]
            outputs = dict(zip(output_names, session.run(output_names, feeds), strict=True))
            cache_spec.write_rows(feeds, outputs)
            feeds["positions"] = feeds["positions"] + 1
        return {"decode": (time.perf_counter() - start) / steps}

    return call
