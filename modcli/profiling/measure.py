"""Every timed measurement of every model at one sequence length, on each backend asked for, and its FLOP counts.

Method (`modcli_runtime.timing`): warm-up calls are excluded, `--repeats` timed calls give the median with min and
max, and within a measurement every (model, backend) call alternates with the others call by call (A B, then B A,
...) so that drift of the machine (other processes, clocks, caches) hits all of them alike. Each PyTorch call is
synchronised with its device. With `--compile` the first call of each compiled model is reported as its compile
time and never timed again. The onnxruntime calls are made first (both models exported, each session run once
untimed: its first run sets it up) and then timed in the same interleaved runs as the PyTorch ones: the forward
graphs with the eager (and compiled) forwards, the decode graphs with the eager prefill and decode, so that a
"vs eager" ratio compares calls made side by side, as the MoD / dense ratios do.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import torch
from modcli_runtime.timing import TimedCall, interleaved, latency_stats

from modcli.compiling import CompileStats, compile_module, first_call
from modcli.decode.static import StaticDecoder
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.models.flops import flops, training_flops
from modcli.packed_linear import inference_linears
from modcli.profiling.calls import decode_call, forward_call, input_tokens, static_decode_call, train_call
from modcli.profiling.config import ModelProfile, ProfileConfig, Timing
from modcli.profiling.flop_counts import counted_decode, counted_forward, counted_training
from modcli.profiling.onnx import onnxruntime_calls, settle_before_onnxruntime

Key = tuple[str, ...]
"""A timed call's name in an interleaved run: (model name, backend), and the measurement where one backend times
several together (onnxruntime: forward and decode)."""


def measure_seq_len(config: ProfileConfig, models: dict[str, MoDDecoder], seq_len: int, device: torch.device,
                    log: Callable[[str], None]) -> dict[str, ModelProfile]:
    """Model name -> everything `config.measure` asks of it at T = seq_len, but peak memory
    (`modcli.profiling.memory` fills that in)."""
    batch = config.batch_size
    tokens = {name: input_tokens(m.config, batch, seq_len, config.seed, device) for name, m in models.items()}
    out = {name: ModelProfile(forward_flops_per_seq=flops(m.config, seq_len).total,
                              train_flops_per_seq=training_flops(m.config, seq_len, batch) // batch)
           for name, m in models.items()}
    compiling = " (compiling first)" if "compiled" in config.backends else ""
    onnx: dict[str, dict[Key, TimedCall]] = {"forward": {}, "decode": {}}
    if "onnxruntime" in config.backends:
        log(f"T={seq_len}: exporting both models to ONNX for onnxruntime (timed beside the PyTorch calls)")
        for (name, what), call in onnxruntime_calls(config, models, seq_len, device).items():
            call()  # a session's first run sets it up: never timed
            onnx[what][name, "onnxruntime", what] = call
    if "forward" in config.measure:
        log(f"T={seq_len}: forward (training-mode routing), {config.repeats} timed calls each{compiling}")
        _forward(config, models, tokens, device, out, onnx["forward"])
    if "train" in config.measure:
        log(f"T={seq_len}: training step (forward + aux losses, backward, AdamW), {config.repeats} timed calls each"
            + compiling)
        _train_step(config, models, tokens, device, out)
    if "decode" in config.measure:
        log(f"T={seq_len}: causal prefill ({config.routing}) and {config.decode_tokens} decode steps, "
            f"{config.repeats} timed calls each{compiling}")
        _prefill_and_decode(config, models, tokens, device, out, onnx["decode"])
    return out


def _forward(config: ProfileConfig, models: dict[str, MoDDecoder], tokens: dict[str, torch.Tensor],
             device: torch.device, out: dict[str, ModelProfile], onnx: dict[Key, TimedCall]) -> None:
    batch = config.batch_size
    calls, compile_stats = dict(onnx), {}
    for name, m in models.items():
        m.eval()
        counted = counted_forward(m, tokens[name], device, config.dtype)
        out[name].forward_flops_counted_per_seq = sum(counted.values()) // batch
        out[name].forward_flops_counted_by_op = {op: n // batch for op, n in counted.items()}
        linears = inference_linears(m, device, config.dtype, config.packed_linears)
        calls[name, "eager"] = forward_call(m, tokens[name], device, config.dtype, linears)
        if "compiled" in config.backends:
            calls[name, "compiled"] = forward_call(compile_module(m, device), tokens[name], device, config.dtype)
            compile_stats[name, "compiled"] = CompileStats()
            first_call(calls[name, "compiled"], compile_stats[name, "compiled"])
    _time(calls, {"forward": tokens["model"].numel()}, config.warmup, config.repeats, out, compile_stats)


def _train_step(config: ProfileConfig, models: dict[str, MoDDecoder], tokens: dict[str, torch.Tensor],
                device: torch.device, out: dict[str, ModelProfile]) -> None:
    batch = config.batch_size
    calls, compile_stats = {}, {}
    for name, m in models.items():
        for backend in ("eager", "compiled") if "compiled" in config.backends else ("eager",):
            trainee = copy.deepcopy(m)  # the optimiser changes the weights; other measurements keep the originals
            if backend == "eager":
                counted = counted_training(trainee, tokens[name], device, config.dtype)
                out[name].train_flops_counted_per_seq = counted // batch
                calls[name, backend] = train_call(trainee, trainee, tokens[name], device, config.dtype)
            else:
                calls[name, backend] = train_call(trainee, compile_module(trainee, device), tokens[name], device,
                                                  config.dtype)
                compile_stats[name, backend] = CompileStats()
                first_call(calls[name, backend], compile_stats[name, backend])
    _time(calls, {"train_step": tokens["model"].numel()}, config.warmup, config.repeats, out, compile_stats)
    del calls  # the trainees, their gradients and optimiser state
    gc.collect()


def _prefill_and_decode(config: ProfileConfig, models: dict[str, MoDDecoder], tokens: dict[str, torch.Tensor],
                        device: torch.device, out: dict[str, ModelProfile], onnx: dict[Key, TimedCall]) -> None:
    batch, seq_len = tokens["model"].shape
    calls, compile_stats, kept = dict(onnx), {}, {}
    for name, m in models.items():
        m.eval()
        kept[name] = {}
        linears = inference_linears(m, device, config.dtype, config.packed_linears)
        calls[name, "eager"] = decode_call(m, tokens[name], config.decode_tokens, config.routing, device,
                                           config.dtype, kept[name], linears)
        if "compiled" in config.backends:
            static = StaticDecoder(m, batch, seq_len + config.decode_tokens, config.routing, device, config.dtype,
                                   compile=True)
            calls[name, "compiled"] = static_decode_call(static, tokens[name], config.decode_tokens, device,
                                                         config.dtype)
            calls[name, "compiled"]()  # compiles: the decoder times its own first prefill and step
            compile_stats[name, "compiled"] = static.compile_stats
        prefill_flops, decode_flops = counted_decode(m, tokens[name], config.decode_tokens, config.routing,
                                                     config.dtype)
        out[name].prefill_flops_counted_per_seq = prefill_flops // batch
        out[name].decode_flops_counted_per_token = decode_flops // (batch * config.decode_tokens)
    _time(calls, {"prefill": batch * seq_len, "decode": batch}, config.warmup, config.repeats, out, compile_stats)
    for name, m in models.items():
        cache: DecoderCache = kept[name]["cache"]  # the last timed call's
        out[name].kv_cache_bytes = cache.stored_bytes()
        out[name].kv_cache_allocated_bytes = cache.allocated_bytes()
        out[name].kv_cache_dense_bytes = cache.dense_equivalent_bytes()
        out[name].kv_cache_dense_allocated_bytes = cache.dense_equivalent_allocated_bytes()
        held = cache.positions.sum().item()
        out[name].processed_fraction = {f"block{layer}": cache.layers[layer].lengths.sum().item() / held
                                        for layer in m.config.routed_layers()
                                        if m.config.kv_is_routed(layer)}


def _time(calls: dict[Key, TimedCall], tokens_per_call: dict[str, int], warmup: int, repeats: int,
          out: dict[str, ModelProfile], compile_stats: dict[Key, CompileStats] | None = None) -> None:
    """Time `calls` interleaved and store each quantity's `Timing` in `out`: eager ones as the model's own fields
    (`forward`, `decode`, ...), other backends' in its `compiled` / `onnxruntime` dicts. `tokens_per_call`: the
    tokens one call processes, per timed quantity."""
    compile_stats = compile_stats or {}
    samples = interleaved(calls, warmup, repeats, settle=settle_before_onnxruntime)
    for key, quantities in samples.items():
        name, backend = key[:2]
        for quantity, seconds in quantities.items():
            timing = Timing(**latency_stats(seconds, tokens_per_call[quantity]))
            if (name, backend) in compile_stats:
                timing.compile_s = compile_stats[name, backend].compile_s
                timing.graph_breaks = compile_stats[name, backend].graph_breaks
            if backend == "eager":
                setattr(out[name], quantity, timing)
            else:
                getattr(out[name], backend)[quantity] = timing
