"""`modcli profile`: FLOPs, latency, memory and KV-cache size of an MoD model against its dense twin.

What is measured, per model and per sequence length T, at batch size B:

- FLOPs per sequence: forward analytic (`modcli.models.flops.flops`, routed blocks at capacity) and counted
  (`torch.utils.flop_counter.FlopCounterMode` over a real forward pass); training FLOPs per sequence, analytic
  (`modcli.models.flops.training_flops`) and counted over forward + backward; FLOPs of the causal prefill and of one
  decode step, counted.
- Latency: forward (the router's training mode, e.g. top-k; no grad), one training step as `modcli train` runs it
  (forward with the auxiliary routing losses, backward, gradient clipping, AdamW), the causal prefill of T tokens
  into a KV cache, and one decode step (`decode_step` with `--routing`, a causal mode), averaged over
  `--decode-tokens` steps.
- Peak memory of each measurement (see `MEMORY_METHOD`), KV-cache bytes after T + `--decode-tokens` tokens.

How: `modcli.profiling.measure` (timing: warm-up, MoD and baseline interleaved call by call, the median with min and
max, through the harness `modcli_runtime.timing` that `modcli profile --onnx` shares), `modcli.profiling.memory`,
and `modcli.profiling.subjects` (untrained routers are calibrated to their capacity before anything is timed).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch

from modcli.bundle.writer import time_bundle
from modcli.errors import UserError
from modcli.hardware import device_name, resolve_device, tune_cpu_allocator
from modcli.packed_linear import linear_kernel
from modcli.profiling.config import ProfileConfig, ProfileResult, SeqLenProfile
from modcli.profiling.flop_counts import FLOPS_NOTE
from modcli.profiling.measure import measure_seq_len
from modcli.profiling.memory import MEMORY_METHOD, measure_memory, save_for_children
from modcli.profiling.onnx import onnxruntime_settings
from modcli.profiling.report import ratios, write_plot
from modcli.profiling.subjects import calibrate_routers, load_baseline, load_subject
from modcli.reports.console import stderr_console

__all__ = ["ProfileConfig", "ProfileResult", "profile"]


def profile(config: ProfileConfig, quiet: bool = False) -> ProfileResult:
    """Profile a model (and the model it is compared with) as `config` says."""
    allocator = tune_cpu_allocator()  # what `modcli` does at start: the timings are those of the command
    for bundle in config.onnx:
        if not (Path(bundle) / "manifest.json").is_file():
            raise UserError(f"--onnx: {bundle} is not a modcli export bundle (no manifest.json)")
    started = time.perf_counter()
    load_start = _load_avg()
    if config.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    device = resolve_device(config.device)
    if config.dtype == "float16" and device.type == "cpu":
        raise UserError("--dtype float16 is not supported on the CPU; use bfloat16 or float32")

    def log(message: str) -> None:
        if not quiet:
            stderr_console.print(message, highlight=False, soft_wrap=True)

    model, info = load_subject(config, device)
    baseline, baseline_info = load_baseline(config, model, info, device)
    models = {"model": model} | ({"baseline": baseline} if baseline is not None else {})
    routing = config.routing or next((m.causal_modes()[0] for m in models.values() if not m.config.dense), "dense")
    for name, m in models.items():
        try:
            m.check_routing(routing, causal=True)
        except UserError as exc:
            raise UserError(f"the {name}: {exc}") from None
    config = dataclasses.replace(config, routing=routing)
    seq_lens = config.seq_lens or [model.config.seq_len]
    cores = os.cpu_count() or 1
    if device.type == "cpu" and load_start and load_start[0] > 0.5 * cores:
        log(f"[yellow]note: the load average is {load_start[0]} on {cores} cores: other processes share the CPU, so "
            "timings will be noisy (the interleaving spreads the noise over both models)[/]")
    log(f"profiling on {device_name(device)}: {info.label} ({info.parameters:,} parameters)"
        + (f" against {baseline_info.label} ({baseline_info.parameters:,})" if baseline_info else "")
        + f", batch {config.batch_size}, T = {', '.join(map(str, seq_lens))}")

    results = []
    with tempfile.TemporaryDirectory(prefix="modcli-profile-") as tmp:
        weights = {}
        for seq_len in seq_lens:
            if info.routers_calibrated:
                log(f"T={seq_len}: calibrating the untrained routers on separate tokens ({config.routing} rule, "
                    f"capacity {model.config.capacity:g})")
                info.routers_calibrated = calibrate_routers(model, config, device, seq_len)
            if config.memory and (info.routers_calibrated or not weights):
                weights = save_for_children(models, Path(tmp))
            per_model = measure_seq_len(config, models, seq_len, device, log)
            if config.memory:
                log(f"T={seq_len}: peak memory, one fresh process per measurement")
                measure_memory(config, models, weights, seq_len, device, per_model)
            results.append(SeqLenProfile(seq_len, per_model["model"], per_model.get("baseline"),
                                         ratios(per_model["model"], per_model.get("baseline"))))

    onnx = []
    for bundle in config.onnx:
        for seq_len in seq_lens:
            log(f"T={seq_len}: onnxruntime timing of {bundle}")
            onnx.append({"seq_len": seq_len, **time_bundle(
                bundle, batch=config.batch_size, seq_len=seq_len, cache_tokens=seq_len, repeats=config.repeats,
                warmup=max(1, config.warmup), provider="cuda" if device.type == "cuda" else "cpu",
                threads=torch.get_num_threads(), seed=config.seed)})

    result = ProfileResult(
        device=str(device), device_name=device_name(device), dtype=config.dtype, torch_version=torch.__version__,
        threads=torch.get_num_threads(), batch_size=config.batch_size, repeats=config.repeats, warmup=config.warmup,
        decode_tokens=config.decode_tokens, routing=config.routing, compile=config.compile,
        backends=config.backends, linear_kernel=linear_kernel(device, config.dtype, config.packed_linears), model=info,
        baseline=baseline_info, results=results,
        memory_method=MEMORY_METHOD if config.memory else "peak memory: not measured (--no-memory)",
        flops_note=FLOPS_NOTE, environment=_environment(allocator), load_avg_start=load_start, load_avg_end=_load_avg(),
        wall_time_s=time.perf_counter() - started, plot=config.plot, onnx=onnx,
        onnxruntime=onnxruntime_settings(device) if "onnxruntime" in config.backends else None)
    if config.plot:
        write_plot(result, config.plot)
        log(f"wrote {config.plot}")
    return result


def _environment(allocator: str) -> dict[str, str]:
    """Thread and allocator settings that change CPU timings, where set; `allocator`: what modcli set itself."""
    names = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
             "CUDA_VISIBLE_DEVICES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
    found = {name: os.environ[name] for name in names if name in os.environ}
    return found | ({"allocator": allocator} if allocator else {})


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
