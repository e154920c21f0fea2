"""What `modcli profile` is asked (`ProfileConfig`) and what it returns (`ProfileResult` and its parts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modcli.config import DEVICES, DTYPES, ModelConfig, require

MEASUREMENTS = ("forward", "train", "decode")
BACKENDS = ("eager", "compiled", "onnxruntime")


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
    packed_linears: bool | None = None
    """Eager inference on the CPU in float32 (forward, causal prefill, decode step; both models): nn.Linear through
    oneDNN's prepacked kernel (`modcli.packed_linear`); False = PyTorch's default BLAS; None = the CPU's default
    (`packed_linear.packed_by_default`: AMD). Training steps never."""
    memory: bool = True
    """Measure peak memory in a fresh child process per measurement (a few seconds each)."""
    seed: int = 1337
    """Seed of the weights of freshly initialised models and of the token inputs."""
    plot: str | None = None
    """Write a PNG of latency and FLOPs against sequence length for both models (needs matplotlib)."""
    onnx: list[str] = field(default_factory=list, metadata={"repeated": True})
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
    """One measurement of one model: the statistics of its timed calls (`modcli_runtime.timing.latency_stats`)."""

    latency_ms: float
    """The median of the timed calls."""
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
    """Both models at one sequence length, and their ratios."""

    seq_len: int
    model: ModelProfile
    baseline: ModelProfile | None
    ratio: dict[str, Ratio]
    """forward_latency, train_step_latency, prefill_latency, decode_latency, forward_flops, *_peak_mem, kv_cache."""


@dataclass
class ModelInfo:
    """What was profiled: the model's label, where it came from, its size and routing."""

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
    """Everything `modcli profile` measured, with the settings and the machine's state while it ran."""

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
    linear_kernel: str
    """The eager inference calls' nn.Linear kernel: onednn-packed (`modcli.packed_linear`) or aten (PyTorch's
    default BLAS)."""
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
    onnxruntime: dict | None = None
    """--backends onnxruntime: the sessions' settings (graph optimisation level, intra-op threads, spinning,
    operators, provider)."""
    onnx: list[dict] = field(default_factory=list)
    """Per --onnx bundle and sequence length: onnxruntime forward and decode-step latency
    (`modcli_runtime.bench.time_bundle`: the same statistics as `Timing`, in a dict)."""
