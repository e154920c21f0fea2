"""`modcli profile --backends onnxruntime`: both models exported to ONNX here and timed through modcli_runtime.

The graphs are the ones `modcli export` writes (`modcli.bundle.lowering`: the forward graph in the router's static
mode, the decode graph in the profiled causal mode, float32, opset 18); they run in onnxruntime sessions of the
PyTorch-free runtime with as many intra-op threads as PyTorch uses. What is timed, per model:

- forward: the forward graph on the same (B, T) tokens as the eager forward;
- decode: `--decode-tokens` steps of the decode graph, each followed by `CacheSpec.write_rows` (what one step of
  the runtime's generate costs), starting from the KV cache an (untimed) eager causal prefill of the same T tokens
  leaves, copied into numpy once, on the same new tokens as the eager decode; every call starts from that cache.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder

CPU = torch.device("cpu")


def onnxruntime_calls(config, models: dict[str, MoDDecoder], seq_len: int,
                      device: torch.device) -> dict[tuple[str, str], Callable]:
    """(model name, forward|decode) -> a call returning {quantity: seconds}, for `_interleaved`."""
    from modcli_runtime.bundle import CacheSpec, session_providers

    from modcli.bundle.lowering import decode_spec, forward_spec
    from modcli.profiling.profile import _tokens, decode_tokens_for

    providers = session_providers("cuda" if device.type == "cuda" else "cpu")
    threads = torch.get_num_threads()
    batch = config.batch_size
    calls: dict[tuple[str, str], Callable] = {}
    with tempfile.TemporaryDirectory(prefix="modcli-profile-onnx-") as tmp:  # a session keeps what it loaded
        folder = Path(tmp)
        for name, model in models.items():
            model.to("cpu").eval()  # exported and prefilled on the CPU, then back where it was
            tokens = _tokens(model.config, batch, seq_len, config.seed, CPU)  # the eager calls' tokens
            if "forward" in config.measure:
                spec = forward_spec(model)
                session = _session(spec, folder / f"{name}.forward.onnx", providers, threads)
                calls[name, "forward"] = _forward_call(session, spec.input_names[0], tokens.numpy())
            if "decode" in config.measure:
                spec = decode_spec(model, config.routing)
                session = _session(spec, folder / f"{name}.decode.onnx", providers, threads)
                model_config = model.config
                cache_spec = CacheSpec(
                    n_layers=model_config.n_layers, n_heads=model_config.kv_heads, head_dim=model_config.head_dim,
                    dtype="float32", routed_layers=model_config.routed_layers(),
                    capacity=model_config.capacity_fraction(),
                    processed_row_layers=[layer for layer in range(model_config.n_layers)
                                          if model_config.attention_is_routed(layer)])
                new_tokens = decode_tokens_for(model_config.vocab_size, batch, seq_len, config.decode_tokens, CPU)
                prefilled = DecoderCache.allocate(model_config, batch, seq_len + config.decode_tokens, CPU)
                with torch.no_grad():  # the eager causal prefill of the same tokens, untimed
                    model(tokens, config.routing, cache=prefilled)
                calls[name, "decode"] = _decode_call(session, spec.output_names, cache_spec, prefilled,
                                                     new_tokens.numpy(), config.decode_tokens)
            model.to(device)
    return calls


def _session(spec, path: Path, providers: list[str], threads: int):
    """Export `spec` to ONNX at `path` and open it in onnxruntime."""
    from modcli_runtime.bundle import create_session

    from modcli.bundle.lowering import MIN_OPSET, export_onnx, export_program

    export_onnx(spec, export_program(spec), path, MIN_OPSET)
    return create_session(path, providers, threads=threads)


def _forward_call(session, input_name: str, tokens: np.ndarray) -> Callable[[], dict[str, float]]:
    def call() -> dict[str, float]:
        start = time.perf_counter()
        session.run(None, {input_name: tokens})
        return {"forward": time.perf_counter() - start}

    return call


def _decode_call(session, output_names: list[str], cache_spec, prefilled: DecoderCache, new_tokens: np.ndarray,
                 steps: int) -> Callable[[], dict[str, float]]:
    """Decode steps from a prefilled cache, copied into numpy buffers with room for every step."""
    feeds: dict[str, np.ndarray] = {}
    start_lengths = {}
    for layer, layer_cache in enumerate(prefilled.layers):
        slots = int(layer_cache.lengths.max()) + steps + 1  # no buffer grows inside a timed call
        shape = (layer_cache.keys.shape[0], layer_cache.keys.shape[1], slots, layer_cache.keys.shape[3])
        keys, values = np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)
        filled = min(slots, layer_cache.slots)
        keys[:, :, :filled] = layer_cache.keys[:, :, :filled].float().cpu().numpy()
        values[:, :, :filled] = layer_cache.values[:, :, :filled].float().cpu().numpy()
        feeds[f"keys.{layer}"], feeds[f"values.{layer}"] = keys, values
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
