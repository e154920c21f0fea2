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

Method: each timed call is synchronised (CUDA), warm-up calls are excluded, `--repeats` timed calls give the
median with min and max, and the two models alternate call by call (A B, then B A, ...) so that drift of the
machine (other processes, clocks, caches) hits both. With `--compile` the first call of each compiled model is
reported as its compile time and never timed again.

A model built from a config (no checkpoint) has untrained routers, whose causal yes/no would process about half of
the tokens. At each measured T, before anything is timed, each routed block's router and predictor bias is shifted
so that the causal rule (`--routing`) says yes to the top `capacity` share of the tokens, as a trained router does:
block by block in causal routing, on calibration tokens drawn apart from the timed ones. Such runs are labelled
"calibrated". A checkpoint's routers are used as trained.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modcli.compiling import CompileStats, compile_module, first_call
from modcli.config import DEVICES, DTYPES, ModelConfig, TrainConfig, require
from modcli.errors import UserError
from modcli.hardware import TORCH_DTYPES, autocast, device_name, resolve_device, seed_everything
from modcli.models.cache import DecoderCache
from modcli.models.decoder import MoDDecoder
from modcli.models.families import model_class
from modcli.models.flops import counted_flops, flops, training_flops
from modcli.reports.console import stderr_console
from modcli.training.objective import training_loss

MEASUREMENTS = ("forward", "train", "decode")
BACKENDS = ("eager", "compiled", "onnxruntime")
CALIBRATION_SEED_OFFSET = 2**31
"""Calibration tokens use seed + 2**31 + T; timed tokens use seed + T, so the two never coincide."""
CALIBRATION_ROWS = 8
"""Sequences of calibration tokens: the share a quantile keeps generalises better from more tokens."""

MEMORY_METHOD = (
    "peak_mem_bytes: each measurement runs twice in a fresh child process holding only that model. CPU: the "
    "model's parameter and buffer bytes plus the rise of the process's peak resident set (VmHWM, reset through "
    "/proc/self/clear_refs once the model is built and freed heap memory is trimmed; glibc maps every block over "
    "128 KiB on its own, so freed tensors leave the resident set) while the calls run: weights, gradients, "
    "optimizer state, activations, KV cache, library buffers and some allocator slack are counted, the Python "
    "and library code is not. CUDA: the same with torch.cuda.max_memory_allocated after "
    "reset_peak_memory_stats (tensor memory only, not the allocator's reserve). Other devices: not measured."
)
FLOPS_NOTE = (
    "Analytic and counted FLOPs both count matmuls and attention (q k^T and scores v, the full T x T square even "
    "though a causal kernel may skip the masked half); neither counts element-wise work (RMSNorm, RoPE, softmax, "
    "SiLU, residual adds, sigmoid router weights), the embedding lookup, top-k/sort, gather/scatter or the "
    "optimizer step. Training FLOPs are forward + backward: a matmul's backward is 2 x its forward, attention's "
    "2.5 x (the scores are recomputed), and the predictor's stop-gradient input gets no gradient."
)


@dataclass
class ProfileConfig:
    """What `modcli profile` measures."""

    checkpoint: str | None = None
    """A run folder (its newest checkpoint) or a checkpoint folder; None = a freshly initialised `model`."""
    model: ModelConfig | None = None
    """The shape to profile when no checkpoint is given (from --preset, --config and the model flags)."""
    compare: str = "dense"
    """dense (the model's dense twin: no routing, the dense MLP), moe (the same experts without MoD routing or no-op
    experts), none, or a run/checkpoint folder to compare with."""
    seq_lens: list[int] | None = None
    """Sequence lengths to profile; None = the model's seq_len."""
    batch_size: int = 8
    """Sequences per call."""
    repeats: int = 5
    """Timed calls per measurement and model (median, min and max are reported)."""
    warmup: int = 1
    """Untimed calls per measurement and model before the timed ones."""
    measure: list[str] = field(default_factory=lambda: list(MEASUREMENTS))
    """Which measurements to run: forward, train, decode (decode includes the causal prefill)."""
    decode_tokens: int = 32
    """Decode steps timed after prefilling T tokens; the KV cache is measured after T + this many tokens."""
    routing: str | None = None
    """Causal routing of the prefill and decode (a causal mode of the routers); None = the model's first."""
    device: str = "auto"
    """auto, cpu, cuda or mps."""
    dtype: str = "float32"
    """Autocast dtype (weights stay float32; the KV cache uses this dtype)."""
    backends: list[str] = field(default_factory=lambda: ["eager"])
    """Which paths to time, each against the baseline in the same interleaved run: eager (PyTorch as is),
    compiled (torch.compile: forward, training step, causal prefill, and the static-shape decode step of
    `modcli.decode.static`; compile time reported apart), onnxruntime (both models exported to ONNX here and run
    through the PyTorch-free runtime: forward and decode step)."""
    compile: bool = False
    """Same as adding compiled to `backends` (the --compile flag)."""
    memory: bool = True
    """Measure peak memory in a fresh child process per measurement (a few seconds each)."""
    seed: int = 1337
    """Seed of the weights of freshly initialised models and of the token inputs."""
    plot: str | None = None
    """Write a PNG of latency and FLOPs against sequence length for both models (needs matplotlib)."""
    onnx: list[str] = field(default_factory=list)
    """Exported bundles (`modcli export`) to time through onnxruntime at the same shapes (e.g. MoD and dense)."""

    def __post_init__(self) -> None:
        require(self.checkpoint is None or self.model is None,
                "--preset, --config and the model flags describe a new model; do not combine them with a checkpoint")
        require(bool(self.compare), "--compare must be dense, moe, none or a run/checkpoint folder")
        if self.seq_lens is not None:
            require(bool(self.seq_lens), "--seq-lens: give at least one sequence length")
            for seq_len in self.seq_lens:
                require(seq_len >= 2, f"--seq-len must be >= 2, got {seq_len}")
        require(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        require(self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}")
        require(self.warmup >= 0, f"--warmup must be >= 0, got {self.warmup}")
        require(bool(self.measure), "--measure: name at least one of forward, train, decode")
        for name in self.measure:
            require(name in MEASUREMENTS, f"--measure must be among {', '.join(MEASUREMENTS)}, got {name!r}")
        require(self.decode_tokens >= 1, f"--decode-tokens must be >= 1, got {self.decode_tokens}")
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.plot is None or self.plot.lower().endswith(".png"), f"--plot must name a .png file, got {self.plot!r}")
        require(bool(self.backends), "--backends: name at least one of " + ", ".join(BACKENDS))
        for backend in self.backends:
            require(backend in BACKENDS, f"--backends must be among {', '.join(BACKENDS)}, got {backend!r}")
        if self.compile and "compiled" not in self.backends:
            self.backends = [*self.backends, "compiled"]
        self.compile = "compiled" in self.backends


@dataclass
class Timing:
    """One measurement of one model: the median of the timed calls with their min and max."""

    latency_ms: float
    latency_min_ms: float
    latency_max_ms: float
    tokens_per_s: float
    """Tokens per second at the median latency (B x T per call; B per decode step)."""
    peak_mem_bytes: int | None = None
    compile_s: float | None = None
    """Compiled: wall time of the first call (compilation plus one run), never timed again."""
    graph_breaks: int | None = None
    """Compiled: graph breaks torch.compile met (0: one graph)."""


@dataclass
class ModelProfile:
    """Everything measured for one model at one sequence length."""

    forward_flops_per_seq: int
    """Analytic forward FLOPs of one sequence with top-k routing."""
    train_flops_per_seq: int
    """Analytic training FLOPs of one sequence (`modcli.models.flops.training_flops`: forward + backward)."""
    forward_flops_counted_per_seq: int | None = None
    """FlopCounterMode's count of the same forward pass."""
    forward_flops_counted_by_op: dict[str, int] = field(default_factory=dict)
    train_flops_counted_per_seq: int | None = None
    """Counted FLOPs of one training sequence (forward with the auxiliary losses, backward)."""
    prefill_flops_counted_per_seq: int | None = None
    """Counted FLOPs of the causal prefill (depends on how many tokens the routers let through)."""
    decode_flops_counted_per_token: int | None = None
    """Counted FLOPs of one decode step, per sequence, averaged over the decode steps."""
    forward: Timing | None = None
    train_step: Timing | None = None
    prefill: Timing | None = None
    decode: Timing | None = None
    """Latency of one decode step (all B sequences), the mean over --decode-tokens steps per timed call."""
    kv_cache_bytes: int | None = None
    """K/V bytes stored after T + --decode-tokens tokens (filled slots: a routed block stores only the tokens it
    processed)."""
    kv_cache_allocated_bytes: int | None = None
    """K/V bytes of the cache buffers as allocated after T + --decode-tokens tokens (routed buffers grow by doubling,
    dense ones are preallocated for T + --decode-tokens)."""
    kv_cache_dense_bytes: int | None = None
    """What a dense model of this shape stores for the same tokens."""
    kv_cache_dense_allocated_bytes: int | None = None
    """What a dense model of this shape allocates for the same tokens."""
    processed_fraction: dict[str, float] = field(default_factory=dict)
    """Per routed block: the share of the T + --decode-tokens tokens it processed under causal routing."""
    compiled: dict[str, Timing] = field(default_factory=dict)
    """--backends compiled: forward, train_step, prefill and decode through torch.compile."""
    onnxruntime: dict[str, Timing] = field(default_factory=dict)
    """--backends onnxruntime: forward and decode through the exported ONNX graphs and modcli_runtime."""


@dataclass
class Ratio:
    """Model / baseline: measured, and the ideal ratio the FLOPs predict."""

    measured: float | None
    ideal: float | None = None


@dataclass
class SeqLenProfile:
    seq_len: int
    model: ModelProfile
    baseline: ModelProfile | None
    ratio: dict[str, Ratio]
    """forward_latency, train_step_latency, prefill_latency, decode_latency, forward_flops, *_peak_mem, kv_cache."""


@dataclass
class ModelInfo:
    label: str
    source: str
    parameters: int
    active_parameters: int
    """Parameters one token uses (MoE: only the experts it chooses; see MoDDecoder.active_parameters)."""
    dense: bool
    routed_layers: list[int]
    capacity: float
    routers_calibrated: bool
    """True when untrained routers are shifted, at each measured T, to process the capacity share under the causal
    rule (see the module docstring)."""
    config: dict[str, Any]


@dataclass
class ProfileResult:
    device: str
    device_name: str
    dtype: str
    torch_version: str
    threads: int
    batch_size: int
    repeats: int
    warmup: int
    decode_tokens: int
    routing: str
    compile: bool
    backends: list[str]
    model: ModelInfo
    baseline: ModelInfo | None
    results: list[SeqLenProfile]
    memory_method: str
    flops_note: str
    environment: dict[str, str]
    """Thread settings that change CPU timings (OMP_NUM_THREADS, OMP_WAIT_POLICY, ...), where set."""
    load_avg_start: list[float]
    """The machine's 1, 5 and 15 minute load averages before and after: other work disturbs timings."""
    load_avg_end: list[float]
    wall_time_s: float
    plot: str | None = None
    onnx: list[dict] = field(default_factory=list)
    """Per --onnx bundle and sequence length: onnxruntime forward and decode-step latency (modcli_runtime)."""


def profile(config: ProfileConfig, quiet: bool = False) -> ProfileResult:
    """Profile a model (and the model it is compared with) as `config` says."""
    from modcli.hardware import tune_cpu_allocator

    tune_cpu_allocator()  # what `modcli` does at start: the timings are those of the command
    from modcli.bundle.writer import time_bundle  # onnxruntime is imported only when --onnx is given

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

    model, info = _load_subject(config, device)
    baseline, baseline_info = _load_baseline(config, model, info, device)
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
                info.routers_calibrated = _calibrate_routers(model, config, device, seq_len)
            if config.memory and (info.routers_calibrated or not weights):
                weights = _save_for_children(models, Path(tmp))
            per_model = _measure_seq_len(config, models, seq_len, device, log)
            if config.memory:
                log(f"T={seq_len}: peak memory, one fresh process per measurement")
                _measure_memory(config, models, weights, seq_len, device, per_model)
            results.append(SeqLenProfile(seq_len, per_model["model"], per_model.get("baseline"),
                                         _ratios(per_model["model"], per_model.get("baseline"))))

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
        backends=config.backends, model=info,
        baseline=baseline_info, results=results,
        memory_method=MEMORY_METHOD if config.memory else "peak memory: not measured (--no-memory)",
        flops_note=FLOPS_NOTE, environment=_environment(), load_avg_start=load_start, load_avg_end=_load_avg(),
        wall_time_s=time.perf_counter() - started, plot=config.plot, onnx=onnx)
    if config.plot:
        write_plot(result, config.plot)
        log(f"wrote {config.plot}")
    return result


# --- the models -------------------------------------------------------------------------------------------------


def _load_subject(config: ProfileConfig, device: torch.device) -> tuple[MoDDecoder, ModelInfo]:
    if config.checkpoint is not None:
        from modcli.checkpoint.store import load_model_from

        model, _, checkpoint = load_model_from(config.checkpoint, device)
        return model, _info(model, str(checkpoint), calibrated=False)
    model_config = config.model or ModelConfig()
    seed_everything(config.seed)
    model = model_class(model_config.arch)(model_config).to(device).eval()
    return model, _info(model, "config", calibrated=not model_config.dense)  # unless the router has nothing to shift


def _load_baseline(config: ProfileConfig, model: MoDDecoder, info: ModelInfo,
                   device: torch.device) -> tuple[MoDDecoder | None, ModelInfo | None]:
    if config.compare == "none":
        return None, None
    if config.compare in ("dense", "moe"):
        mc = model.config
        if config.compare == "dense":
            twin_config, what = mc.dense_mlp_twin(), "dense twin"
            if twin_config == mc:
                raise UserError(f"--compare dense: {info.source} is already dense; compare it with a checkpoint or "
                                "none")
        else:
            twin_config, what = mc.dense_twin(), "MoE twin"
            if not mc.experts:
                raise UserError(f"--compare moe: {info.source} has no experts (train it with --experts E)")
            if not mc.routed_layers() and not mc.noop_layers():
                raise UserError(f"--compare moe: {info.source} is already MoE without MoD; compare it with dense")
        seed_everything(config.seed)
        twin = model_class(twin_config.arch)(twin_config).to(device).eval()
        return twin, _info(twin, f"{what} of {info.source}", calibrated=False)
    from modcli.checkpoint.store import load_model_from

    try:
        other, _, checkpoint = load_model_from(config.compare, device)
    except UserError as exc:
        raise UserError(f"--compare: {exc}") from None
    return other, _info(other, str(checkpoint), calibrated=False)


def _info(model: MoDDecoder, source: str, calibrated: bool) -> ModelInfo:
    mc = model.config
    return ModelInfo(label=mc.kind, source=source, parameters=model.num_parameters(),
                     active_parameters=model.active_parameters(), dense=mc.dense,
                     routed_layers=mc.routed_layers(), capacity=mc.capacity, routers_calibrated=calibrated,
                     config=dataclasses.asdict(mc))


@torch.no_grad()
def _calibrate_routers(model: MoDDecoder, config: ProfileConfig, device: torch.device, seq_len: int) -> bool:
    """Shift each untrained router (`Router.calibrate`) so its causal rule keeps the top `capacity` share.

    Block by block in order, running the model in the causal routing being profiled, because a block's decisions
    and router weights change what the next block sees. The tokens are drawn apart from the timed ones. Returns
    False when the router kind has nothing to calibrate (e.g. random).
    """
    tokens = _tokens(model.config, CALIBRATION_ROWS, seq_len, config.seed + CALIBRATION_SEED_OFFSET, device)
    calibrated = False
    count = len(model(tokens, config.routing, return_records=True)[1])
    for index in range(count):  # each router in order (MoD: routed blocks; Mixture-of-Recursions: steps)
        _, records = model(tokens, config.routing, return_records=True)
        record = records[index]
        calibrated |= record.router.calibrate(record, record.capacity)
    return calibrated


def _tokens(model_config: ModelConfig, batch: int, seq_len: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + seq_len)
    return torch.randint(0, model_config.vocab_size, (batch, seq_len), generator=generator).to(device)


# --- the measured calls -----------------------------------------------------------------------------------------
# Each factory returns a call that runs once and returns its own durations in seconds (synchronised), so the
# same calls serve the timed runs here and the memory runs in a child process.


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward_call(model, tokens: torch.Tensor, device: torch.device, dtype: str) -> Callable[[], dict[str, float]]:
    def call() -> dict[str, float]:
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad(), autocast(device, dtype):
            model(tokens)  # the router's training mode
        _sync(device)
        return {"forward": time.perf_counter() - start}

    return call


def train_call(model: MoDDecoder, step_model, tokens: torch.Tensor, device: torch.device,
               dtype: str) -> Callable[[], dict[str, float]]:
    """One optimiser step as `modcli train` takes it: aux losses, backward, clipping, AdamW (default settings).

    `model` owns the parameters; `step_model` is what is called (the model itself or its compiled wrapper).
    """
    from modcli.training.loop import make_optimizer

    train_config = TrainConfig()
    optimizer = make_optimizer(model, train_config)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
    targets = tokens.roll(-1, dims=1)  # (B, T): any targets cost the same
    model.train()

    def call() -> dict[str, float]:
        _sync(device)
        start = time.perf_counter()
        with autocast(device, dtype):
            total = training_loss(step_model, tokens, targets, train_config).total  # the router's training mode
        scaler.scale(total).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        return {"train_step": time.perf_counter() - start}

    return call


def decode_tokens_for(vocab_size: int, batch: int, seq_len: int, decode_tokens: int,
                      device: torch.device) -> torch.Tensor:
    """The fixed tokens every decode measurement feeds after a prefill of T = seq_len tokens: (decode_tokens, B).
    Fixed rather than sampled, so sampling costs nothing and every call (and every backend) decodes the same."""
    generator = torch.Generator().manual_seed(seq_len)
    return torch.randint(0, vocab_size, (decode_tokens, batch), generator=generator).to(device)


def _prefill_then_steps(prefill: Callable[[], Any], step: Callable[[torch.Tensor], Any], new_tokens: torch.Tensor,
                        device: torch.device, dtype: str) -> dict[str, float]:
    """Time prefill() and then one step(token row) per row of new_tokens: seconds of the prefill and per step."""
    _sync(device)
    start = time.perf_counter()
    with autocast(device, dtype):
        prefill()
    _sync(device)
    prefilled = time.perf_counter()
    with autocast(device, dtype):
        for tokens in new_tokens:
            step(tokens)
    _sync(device)
    return {"prefill": prefilled - start, "decode": (time.perf_counter() - prefilled) / len(new_tokens)}


def decode_call(model: MoDDecoder, tokens: torch.Tensor, decode_tokens: int, routing: str, device: torch.device,
                dtype: str, keep: dict | None = None) -> Callable[[], dict[str, float]]:
    """Causal prefill of the T tokens into a fresh KV cache, then `decode_tokens` decode steps (eager).

    The last call's cache is left in `keep["cache"]`.
    """
    batch, seq_len = tokens.shape
    new_tokens = decode_tokens_for(model.config.vocab_size, batch, seq_len, decode_tokens, device)
    kv_dtype = TORCH_DTYPES[dtype]

    @torch.no_grad()
    def call() -> dict[str, float]:
        cache = DecoderCache.allocate(model.config, batch, seq_len + decode_tokens, device, kv_dtype)
        seconds = _prefill_then_steps(lambda: model(tokens, routing, cache=cache),
                                      lambda step_tokens: model.decode_step(step_tokens, cache, routing),
                                      new_tokens, device, dtype)
        if keep is not None:
            keep["cache"] = cache
        return seconds

    return call


def static_decode_call(static, tokens: torch.Tensor, decode_tokens: int, device: torch.device,
                       dtype: str) -> Callable[[], dict[str, float]]:
    """`decode_call` through a compiled `modcli.decode.static.StaticDecoder`: its compiled causal prefill, then
    its compiled static-shape decode step, on the same tokens."""
    batch, seq_len = tokens.shape
    new_tokens = decode_tokens_for(static.model.config.vocab_size, batch, seq_len, decode_tokens, device)

    @torch.no_grad()
    def call() -> dict[str, float]:
        static.reset()
        return _prefill_then_steps(lambda: static.prefill(tokens), static.step, new_tokens, device, dtype)

    return call


# --- timing -----------------------------------------------------------------------------------------------------


def _interleaved(calls: dict[str, Callable[[], dict[str, float]]], warmup: int,
                 repeats: int) -> dict[str, dict[str, list[float]]]:
    """Warm each call up, then time them alternately (A B, B A, A B, ...): model -> quantity -> seconds."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    names = list(calls)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one model's call would be charged to that model
    try:
        for repeat in range(repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                for quantity, seconds in calls[name]().items():
                    samples[name].setdefault(quantity, []).append(seconds)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def _timing(seconds: list[float], tokens_per_call: int, compile_s: float | None = None) -> Timing:
    median = statistics.median(seconds)
    return Timing(latency_ms=median * 1e3, latency_min_ms=min(seconds) * 1e3, latency_max_ms=max(seconds) * 1e3,
                  tokens_per_s=tokens_per_call / median if median > 0 else math.inf, compile_s=compile_s)


def _measure_seq_len(config: ProfileConfig, models: dict[str, MoDDecoder], seq_len: int, device: torch.device,
                     log: Callable[[str], None]) -> dict[str, ModelProfile]:
    """Every measurement of every model at one T. Within a measurement, every (model, backend) call is interleaved
    with the others, so drift of the machine hits all of them alike; compiled calls run once before (compile)."""
    batch = config.batch_size
    compiled = "compiled" in config.backends
    tokens = {name: _tokens(m.config, batch, seq_len, config.seed, device) for name, m in models.items()}
    out = {name: ModelProfile(forward_flops_per_seq=flops(m.config, seq_len).total,
                              train_flops_per_seq=training_flops(m.config, seq_len))
           for name, m in models.items()}

    def store(name: str, backend: str, quantity: str, timing: Timing) -> None:
        if backend == "eager":
            setattr(out[name], quantity, timing)
        else:
            getattr(out[name], backend)[quantity] = timing

    def run(calls: dict[tuple[str, str], Callable[[], dict[str, float]]],
            stats: dict[tuple[str, str], CompileStats], per_call: dict[str, int]) -> None:
        samples = _interleaved({f"{n}:{b}": call for (n, b), call in calls.items()}, config.warmup, config.repeats)
        for (name, backend) in calls:
            for quantity, seconds in samples[f"{name}:{backend}"].items():
                timing = _timing(seconds, per_call[quantity])
                if (name, backend) in stats:
                    timing.compile_s = stats[name, backend].compile_s
                    timing.graph_breaks = stats[name, backend].graph_breaks
                store(name, backend, quantity, timing)

    if "forward" in config.measure:
        log(f"T={seq_len}: forward (training-mode routing), {config.repeats} timed calls each"
            + (" (compiling first)" if compiled else ""))
        calls, stats = {}, {}
        for name, m in models.items():
            m.eval()
            counted = counted_flops(lambda m=m, name=name: _no_grad_forward(m, tokens[name], device, config.dtype))
            out[name].forward_flops_counted_per_seq = sum(counted.values()) // batch
            out[name].forward_flops_counted_by_op = {op: n // batch for op, n in counted.items()}
            calls[name, "eager"] = forward_call(m, tokens[name], device, config.dtype)
            if compiled:
                calls[name, "compiled"] = forward_call(compile_module(m, device), tokens[name], device, config.dtype)
                stats[name, "compiled"] = CompileStats()
                first_call(calls[name, "compiled"], stats[name, "compiled"])
        run(calls, stats, {"forward": batch * seq_len})

    if "train" in config.measure:
        log(f"T={seq_len}: training step (forward + aux losses, backward, AdamW), {config.repeats} timed calls each")
        calls, stats = {}, {}
        for name, m in models.items():
            for backend in ("eager", "compiled") if compiled else ("eager",):
                trainee = copy.deepcopy(m)  # the optimiser changes the weights; other measurements keep the originals
                if backend == "eager":
                    counted = counted_flops(lambda t=trainee, name=name: _forward_backward(t, tokens[name], device,
                                                                                          config.dtype))
                    trainee.zero_grad(set_to_none=True)
                    out[name].train_flops_counted_per_seq = sum(counted.values()) // batch
                    calls[name, backend] = train_call(trainee, trainee, tokens[name], device, config.dtype)
                else:
                    calls[name, backend] = train_call(trainee, compile_module(trainee, device), tokens[name], device,
                                                      config.dtype)
                    stats[name, backend] = CompileStats()
                    first_call(calls[name, backend], stats[name, backend])
        run(calls, stats, {"train_step": batch * seq_len})
        del calls
        gc.collect()

    if "decode" in config.measure:
        log(f"T={seq_len}: causal prefill ({config.routing}) and {config.decode_tokens} decode steps, "
            f"{config.repeats} timed calls each")
        calls, stats, kept = {}, {}, {}
        for name, m in models.items():
            m.eval()
            kept[name] = {}
            calls[name, "eager"] = decode_call(m, tokens[name], config.decode_tokens, config.routing, device,
                                               config.dtype, kept[name])
            if compiled:
                from modcli.decode.static import StaticDecoder

                static = StaticDecoder(m, batch, seq_len + config.decode_tokens, config.routing, device,
                                       config.dtype, compile=True)
                calls[name, "compiled"] = static_decode_call(static, tokens[name], config.decode_tokens, device,
                                                             config.dtype)
                calls[name, "compiled"]()  # compiles: the decoder times its own first prefill and step
                stats[name, "compiled"] = static.compile_stats
            prefill_flops, decode_flops = _counted_decode(m, tokens[name], config)
            out[name].prefill_flops_counted_per_seq = prefill_flops // batch
            out[name].decode_flops_counted_per_token = decode_flops // (batch * config.decode_tokens)
        run(calls, stats, {"prefill": batch * seq_len, "decode": batch})
        for name, m in models.items():
            cache: DecoderCache = kept[name]["cache"]
            out[name].kv_cache_bytes = cache.stored_bytes()
            out[name].kv_cache_allocated_bytes = cache.allocated_bytes()
            out[name].kv_cache_dense_bytes = cache.dense_equivalent_bytes()
            out[name].kv_cache_dense_allocated_bytes = cache.dense_equivalent_allocated_bytes()
            held = cache.positions.sum().item()
            out[name].processed_fraction = {f"block{layer}": cache.layers[layer].lengths.sum().item() / held
                                            for layer in m.config.routed_layers()
                                            if m.config.attention_is_routed(layer)}

    if "onnxruntime" in config.backends:
        from modcli.profiling.onnx import onnxruntime_calls

        log(f"T={seq_len}: exporting both models to ONNX and timing them through onnxruntime")
        calls = onnxruntime_calls(config, models, seq_len, device)
        samples = _interleaved({f"{n}:{q}": call for (n, q), call in calls.items()}, max(1, config.warmup),
                               config.repeats)
        for (name, quantity) in calls:
            seconds = samples[f"{name}:{quantity}"][quantity]
            store(name, "onnxruntime", quantity, _timing(seconds, batch * seq_len if quantity == "forward" else batch))
    return out


def _no_grad_forward(model: MoDDecoder, tokens: torch.Tensor, device: torch.device, dtype: str) -> None:
    with torch.no_grad(), autocast(device, dtype):
        model(tokens)


def _forward_backward(model: MoDDecoder, tokens: torch.Tensor, device: torch.device, dtype: str) -> None:
    """The FLOP-bearing part of a training step (`train_call`): forward with the auxiliary losses, backward."""
    model.train()
    with autocast(device, dtype):
        total = training_loss(model, tokens, tokens.roll(-1, dims=1), TrainConfig()).total
    total.backward()


def _counted_decode(model: MoDDecoder, tokens: torch.Tensor, config: ProfileConfig) -> tuple[int, int]:
    """Counted FLOPs of the causal prefill and of all decode steps of one (untimed) decode call."""
    device = tokens.device
    cache = DecoderCache.allocate(model.config, tokens.shape[0], tokens.shape[1] + config.decode_tokens, device,
                                  TORCH_DTYPES[config.dtype])
    new_tokens = decode_tokens_for(model.config.vocab_size, tokens.shape[0], tokens.shape[1], config.decode_tokens,
                                   device)

    def decode_all() -> None:
        for step in range(config.decode_tokens):
            model.decode_step(new_tokens[step], cache, config.routing)

    with torch.no_grad(), autocast(device, config.dtype):
        prefill = sum(counted_flops(lambda: model(tokens, config.routing, cache=cache)).values())
        decode = sum(counted_flops(decode_all).values())
    return prefill, decode


# --- peak memory in child processes -----------------------------------------------------------------------------


def _save_for_children(models: dict[str, MoDDecoder], folder: Path) -> dict[str, str]:
    from safetensors.torch import save_model

    paths = {}
    for name, m in models.items():
        path = folder / f"{name}.safetensors"
        save_model(m, str(path))
        paths[name] = str(path)
    return paths


def _measure_memory(config: ProfileConfig, models: dict[str, MoDDecoder], weights: dict[str, str], seq_len: int,
                    device: torch.device, out: dict[str, ModelProfile]) -> None:
    kinds = {"forward": "forward", "train": "train_step", "decode": "decode"}
    jobs = []
    for name, m in models.items():
        for measurement in config.measure:
            spec = {"model": dataclasses.asdict(m.config), "weights": weights[name], "measurement": measurement,
                    "batch_size": config.batch_size, "seq_len": seq_len, "seed": config.seed,
                    "decode_tokens": config.decode_tokens, "routing": config.routing, "device": str(device),
                    "dtype": config.dtype, "threads": torch.get_num_threads()}
            jobs.append((name, kinds[measurement], spec))
    # Memory does not depend on timing, so two children run at once to save wall time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        peaks = list(pool.map(lambda job: _run_memory_child(job[2]), jobs))
    for (name, attribute, _), peak in zip(jobs, peaks, strict=True):
        timing: Timing = getattr(out[name], attribute)
        timing.peak_mem_bytes = peak
        if attribute == "decode":
            out[name].prefill.peak_mem_bytes = peak  # one call holds both: the prefill and the steps after it


def _run_memory_child(spec: dict[str, Any]) -> int | None:
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    # glibc: every block over 128 KiB gets its own mapping, returned to the system when freed, so the resident set
    # follows the live tensors instead of what the heap kept from earlier calls (the child is never timed).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    done = subprocess.run([sys.executable, "-c", "from modcli.profiling.profile import memory_child; memory_child()"],
                          input=json.dumps(spec), capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory measurement process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_mem_bytes"]


def memory_child() -> None:
    """Entry point of the child process: read a spec on stdin, print {"peak_mem_bytes": n or null} on stdout."""
    spec = json.loads(sys.stdin.read())
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    model_config = ModelConfig(**spec["model"])
    model = model_class(model_config.arch)(model_config)
    from safetensors.torch import load_model

    load_model(model, spec["weights"])
    model = model.to(device).eval()
    tokens = _tokens(model_config, spec["batch_size"], spec["seq_len"], spec["seed"], device)
    if spec["measurement"] == "forward":
        call = forward_call(model, tokens, device, spec["dtype"])
    elif spec["measurement"] == "train":
        call = train_call(model, model, tokens, device, spec["dtype"])
    else:
        call = decode_call(model, tokens, spec["decode_tokens"], spec["routing"], device, spec["dtype"])
    state_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if device.type == "cuda":
        peak = _peak_cuda(call, device)
    elif device.type == "cpu":
        peak = _peak_rss(call)
    else:
        peak = None  # no sound per-process peak for this device type
    print(json.dumps({"peak_mem_bytes": None if peak is None else peak + state_bytes}))


def _peak_cuda(call: Callable[[], Any], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    for _ in range(2):  # the second training step also holds the optimizer state
        call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _peak_rss(call: Callable[[], Any]) -> int | None:
    """Rise of the peak resident set while `call` runs twice; None where Linux's /proc interface is missing."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so reusing them shows as a rise
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _proc_status_bytes("VmRSS")
    except OSError:
        return None
    for _ in range(2):
        call()
    return _proc_status_bytes("VmHWM") - base


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


# --- ratios and the plot ----------------------------------------------------------------------------------------


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _ratios(model: ModelProfile, baseline: ModelProfile | None) -> dict[str, Ratio]:
    if baseline is None:
        return {}
    ratio = {
        "forward_flops": Ratio(_div(model.forward_flops_counted_per_seq, baseline.forward_flops_counted_per_seq),
                               _div(model.forward_flops_per_seq, baseline.forward_flops_per_seq)),
        "train_flops": Ratio(_div(model.train_flops_counted_per_seq, baseline.train_flops_counted_per_seq),
                             _div(model.train_flops_per_seq, baseline.train_flops_per_seq)),
    }
    ideal = {"forward": ratio["forward_flops"].ideal, "train_step": ratio["train_flops"].ideal,
             "prefill": _div(model.prefill_flops_counted_per_seq, baseline.prefill_flops_counted_per_seq),
             "decode": _div(model.decode_flops_counted_per_token, baseline.decode_flops_counted_per_token)}
    for name, ideal_ratio in ideal.items():
        mine, theirs = getattr(model, name), getattr(baseline, name)
        if mine is None or theirs is None:
            continue
        ratio[f"{name}_latency"] = Ratio(_div(mine.latency_ms, theirs.latency_ms), ideal_ratio)
        if mine.peak_mem_bytes is not None and theirs.peak_mem_bytes is not None:
            ratio[f"{name}_peak_mem"] = Ratio(_div(mine.peak_mem_bytes, theirs.peak_mem_bytes))
    for backend in ("compiled", "onnxruntime"):
        for name, mine in getattr(model, backend).items():
            theirs = getattr(baseline, backend).get(name)
            if theirs is not None:
                ratio[f"{backend}_{name}_latency"] = Ratio(_div(mine.latency_ms, theirs.latency_ms), ideal[name])
    if model.kv_cache_bytes is not None and baseline.kv_cache_bytes is not None:
        ratio["kv_cache"] = Ratio(_div(model.kv_cache_bytes, baseline.kv_cache_bytes))
        ratio["kv_cache_allocated"] = Ratio(_div(model.kv_cache_allocated_bytes, baseline.kv_cache_allocated_bytes))
    return ratio


def write_plot(result: ProfileResult, path: str) -> None:
    """Latency (forward, training step, prefill) and FLOPs per call against sequence length, both models.

    One colour per measurement; solid lines are the model, dashed lines the baseline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    seq_lens = [r.seq_len for r in result.results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    subjects = [("model", result.model.label, "-")]
    if result.baseline is not None:
        subjects.append(("baseline", result.baseline.label, "--"))
    colours = {"forward": "C0", "train_step": "C1", "prefill": "C2"}
    for key, label, style in subjects:
        rows = [getattr(r, key) for r in result.results]
        for measurement, colour in colours.items():
            values = [getattr(row, measurement) for row in rows]
            if all(v is not None for v in values):
                left.plot(seq_lens, [v.latency_ms for v in values], style, color=colour, marker="o",
                          label=f"{label} {measurement.replace('_', ' ')}")
        right.plot(seq_lens, [row.forward_flops_per_seq * result.batch_size for row in rows], style,
                   color=colours["forward"], marker="o", label=f"{label} forward")
        right.plot(seq_lens, [row.train_flops_per_seq * result.batch_size for row in rows], style,
                   color=colours["train_step"], marker="o", label=f"{label} training step")
    left.set(ylabel="latency per call (ms, median)", title=f"latency, batch {result.batch_size}")
    right.set(ylabel="FLOPs per call (analytic)", title="FLOPs")
    for axis in (left, right):
        axis.set(xscale="log", yscale="log", xlabel="sequence length T")
        axis.set_xticks(seq_lens, [str(t) for t in seq_lens])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    right.yaxis.get_major_formatter().set_scientific(True)
    fig.suptitle(f"modcli profile: {result.model.label} vs {result.baseline.label if result.baseline else '-'} on "
                 f"{result.device_name} ({result.dtype}); solid = model, dashed = baseline", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _environment() -> dict[str, str]:
    from modcli.hardware import ALLOCATOR_NOTE

    names = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
             "CUDA_VISIBLE_DEVICES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
    found = {name: os.environ[name] for name in names if name in os.environ}
    return found | ({"allocator": ALLOCATOR_NOTE} if ALLOCATOR_NOTE else {})


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
