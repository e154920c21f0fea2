"""`modcli export`: a trained checkpoint -> a validated bundle of graphs that run without the training code.

The bundle is a folder:

- `forward.onnx`: tokens (B, T) -> logits (B, T, V) and each routed block's selected positions, with the
  training-time top-k routing (non-causal: a token's selection depends on later tokens; for scoring whole
  sequences, not for decoding). k = max(1, T * num // den) is computed inside the graph, so one graph serves
  every T and B.
- `decode.onnx`: one token per sequence plus an explicit KV cache (per layer (B, H, slots, hd) keys/values and
  (B,) lengths, returned updated), with causal routing (`--routing router|predictor`). The prompt is fed through
  this graph one token at a time, which fills the cache with exactly the decisions `modcli generate` makes.
- with `--compile`: `<graph>.pt2` (torch.export ExportedProgram, dynamic dims) and `<graph>.aoti.pt2`
  (AOTInductor package for this machine's CPU).
- `config.json` (the checkpoint's run config) and `manifest.json` (files and sha256, versions, opset, inputs
  and outputs, the routing of each graph, validation results, `valid`).

Everything is written to a temporary folder that is renamed into place at the end; a failure leaves nothing
behind. Validation always runs: every graph against eager PyTorch (top-k forward on random tokens and real
text at several T and B, selected positions and logits; greedy decoding against `modcli generate`'s PyTorch
path, tokens, logits and per-layer processed counts). A failed check marks the bundle invalid.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import platform
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modcli.config import DTYPES, ModelConfig, require
from modcli.errors import UserError
from modcli.model import MoDDecoder

PROVIDERS = ("auto", "cpu", "cuda")
GRAPHS = ("forward", "decode")
DEFAULT_ATOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
"""Default --atol per dtype: logits of the exported graph against eager PyTorch in the same dtype."""
MIN_OPSET = 18
"""The dynamo exporter's translation library targets opset 18 and later (opset 18 is also what we validate)."""
FORWARD_NOTE = ("top-k routing (training-time, non-causal: whether a token is processed depends on later tokens); "
                "for scoring whole sequences, not for decoding")
DECODE_NOTE = ("causal routing ({routing} logit > 0), one token per sequence with an explicit KV cache; routed blocks "
               "run inside an If: skipped entirely when no row of the batch processes the token (a real skip for "
               "batch 1), otherwise computed for every row with skipped rows left bit for bit unchanged")
PREFILL_NOTE = ("the prompt is fed through the decode graph one token per step (exactly the causal decisions of "
                "`modcli generate`); there is no batched causal prefill graph")


@dataclass
class ExportConfig:
    """What `modcli export` writes and how it is checked."""

    checkpoint: str
    """A run folder (its newest checkpoint) or one checkpoint folder."""
    out: str = "bundles/latest"
    """Bundle folder to write (must not exist unless --force)."""
    onnx: bool = True
    """Export the ONNX graphs (forward.onnx, decode.onnx) that the PyTorch-free runtime runs."""
    compile: bool = False
    """Also save torch.export ExportedPrograms (.pt2) and AOTInductor packages (.aoti.pt2) of both graphs."""
    graphs: list[str] = field(default_factory=lambda: list(GRAPHS))
    """Which graphs to export: forward (top-k, scoring) and/or decode (causal, what the runtime generates with)."""
    routing: str = "router"
    """Causal routing of the decode graph: router (router logit > 0) or predictor (predictor logit > 0)."""
    dtype: str = "float32"
    """Weights and activations of the exported graphs: float32, float16 or bfloat16."""
    provider: str = "auto"
    """onnxruntime providers to validate on: cpu, cuda, or auto (cpu, plus cuda when it really works)."""
    opset: int = MIN_OPSET
    """ONNX opset of the exported graphs (>= 18)."""
    atol: float | None = None
    """Largest |logit difference| against eager PyTorch; default 1e-4 (float32), 2e-2 (float16), 1e-1 (bfloat16)."""
    decode_steps: int = 16
    """Greedy tokens generated per prompt when the decode graph is compared with `modcli generate`."""
    text: str | None = None
    """Text file for the real-text validation cases; default: the standard library's textwrap.py."""
    seed: int = 1337
    """Seed of the random validation tokens."""
    force: bool = False
    """Replace an existing bundle at --out."""

    def __post_init__(self) -> None:
        require(self.onnx or self.compile, "nothing to export: give --onnx and/or --compile")
        require(bool(self.graphs) and all(g in GRAPHS for g in self.graphs),
                f"--graph must be among {', '.join(GRAPHS)}, got {', '.join(map(repr, self.graphs)) or 'none'}")
        self.graphs = [g for g in GRAPHS if g in self.graphs]
        require(self.routing in ("router", "predictor"),
                f"--routing must be router or predictor (the decode graph routes causally; the forward graph always "
                f"uses top-k), got {self.routing!r}")
        require(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        require(self.provider in PROVIDERS, f"--provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        require(not (self.onnx and self.dtype == "bfloat16"),
                "--dtype bfloat16 cannot be exported to ONNX: onnxruntime has no bfloat16 kernels on the CPU provider "
                "and TopK has no bfloat16 type at opset 18; use --dtype float16 or float32, or --no-onnx --compile "
                "for a bfloat16 ExportedProgram/AOTInductor package")
        require(self.opset >= MIN_OPSET, f"--opset must be >= {MIN_OPSET} for the dynamo exporter, got {self.opset}")
        if self.atol is None:
            self.atol = DEFAULT_ATOL[self.dtype] if self.dtype in DEFAULT_ATOL else 1e-4
        require(self.atol > 0, f"--atol must be positive, got {self.atol}")
        require(1 <= self.decode_steps <= 4096, f"--decode-steps must be in [1, 4096], got {self.decode_steps}")


@dataclass
class GraphFile:
    """One file of the bundle that holds a graph."""

    graph: str
    """forward or decode."""
    kind: str
    """onnx, exported_program or aoti."""
    file: str
    bytes: int
    seconds: float
    """Time to export (onnx, exported_program) or compile (aoti) it."""
    op_histogram: dict[str, int] = field(default_factory=dict)
    """ONNX op types and their counts (nodes inside If branches included)."""


@dataclass
class Check:
    """One validation case of one graph on one runner, against eager PyTorch."""

    graph: str
    runner: str
    case: str
    max_abs_diff: float
    indices_match: bool | None
    """forward: every routed block selected the same positions; decode: the same processed counts per layer."""
    tokens_match: bool | None
    """decode only: greedy tokens equal to `modcli generate`'s."""
    passed: bool
    detail: str = ""


@dataclass
class ExportResult:
    bundle: str
    valid: bool
    atol: float
    dtype: str
    routing: str
    files: list[GraphFile]
    checks: list[Check]
    seconds: float
    failures: list[str]


# ----------------------------------------------------------------------------------------------- graph specs


@dataclass
class GraphSpec:
    """A graph to export: its wrapper module, sample inputs, dynamic dims, names and readable axis names."""

    name: str
    module: torch.nn.Module
    args: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    input_axes: dict[str, dict[int, str]]
    """Readable names of each input's dynamic axes (the ONNX file uses them)."""
    output_axes: dict[str, dict[int, str]]
    """Readable names of dynamic output axes that are not an input's axis (e.g. the top-k capacity)."""
    routing: str
    causal: bool
    note: str


def forward_spec(model: MoDDecoder) -> GraphSpec:
    from torch.export import Dim

    from modcli.export_graphs import ForwardGraph

    config = model.config
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=generator)  # (B, T) odd T: no coincidences
    routed = config.routed_layers()
    outputs = ["logits", *[f"selected.{layer}" for layer in routed]]
    return GraphSpec(
        name="forward", module=ForwardGraph(model).eval(), args=(tokens,),
        dynamic_shapes=({0: Dim("batch", min=1), 1: Dim("seq", min=1)},),
        input_names=["tokens"], output_names=outputs, input_axes={"tokens": {0: "batch", 1: "seq"}},
        output_axes={f"selected.{layer}": {1: "capacity"} for layer in routed},
        routing="topk" if routed else "dense", causal=not routed, note=FORWARD_NOTE if routed else "dense model")


def decode_spec(model: MoDDecoder, routing: str) -> GraphSpec:
    from torch.export import Dim

    from modcli.export_graphs import DecodeStepGraph

    config = model.config
    dtype = model.embed.weight.dtype
    generator = torch.Generator().manual_seed(0)
    batch = Dim("batch", min=1)
    tokens = torch.randint(0, config.vocab_size, (2,), generator=generator)  # (B,)
    positions = torch.tensor([9, 12])  # (B,)
    cache: list[torch.Tensor] = []
    cache_shapes: list[dict[int, Any]] = []
    names, out_names, axes = ["tokens", "positions"], ["logits"], {"tokens": {0: "batch"}, "positions": {0: "batch"}}
    for layer in range(config.n_layers):
        slots = 13 + 2 * layer  # distinct sample sizes: each layer's slot count is its own dimension
        shape = (2, config.n_heads, slots, config.head_dim)
        cache += [torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype),
                  torch.tensor([4, 7])]
        slot_dim = Dim(f"slots_{layer}", min=1)
        cache_shapes += [{0: batch, 2: slot_dim}, {0: batch, 2: slot_dim}, {0: batch}]
        for kind in ("keys", "values", "lengths"):
            names.append(f"{kind}.{layer}")
            out_names.append(f"next_{kind}.{layer}")
            axes[f"{kind}.{layer}"] = {0: "batch", 2: f"slots.{layer}"} if kind != "lengths" else {0: "batch"}
    out_names += [f"processed.{layer}" for layer in config.routed_layers()]
    mode = routing if not config.dense else "dense"
    return GraphSpec(
        name="decode", module=DecodeStepGraph(model, routing).eval(), args=(tokens, positions, *cache),
        dynamic_shapes=({0: batch}, {0: batch}, tuple(cache_shapes)), input_names=names, output_names=out_names,
        input_axes=axes, output_axes={}, routing=mode, causal=True,
        note=DECODE_NOTE.format(routing=routing) if not config.dense else "dense model, one token per sequence")


# ----------------------------------------------------------------------------------------------- exporting


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters log optional-dependency notes and deprecation warnings; results go to the manifest instead."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._inductor", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def export_program(spec: GraphSpec) -> torch.export.ExportedProgram:
    """torch.export (non-strict) with dynamic dims; a failure says which graph and keeps its traceback."""
    try:
        with _quiet_exporter():
            return torch.export.export(spec.module, spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
    except Exception as exc:
        raise RuntimeError(f"torch.export of the {spec.name} graph failed (no fallback is tried): {exc}") from exc


def export_onnx(spec: GraphSpec, program: torch.export.ExportedProgram, path: Path, opset: int) -> None:
    """torch.onnx.export(dynamo=True) of an ExportedProgram, dynamic axes renamed to readable names."""
    try:
        with _quiet_exporter():
            onnx_program = torch.onnx.export(copy.deepcopy(program), spec.args, dynamo=True, opset_version=opset,
                                             input_names=spec.input_names, output_names=spec.output_names,
                                             verbose=False, optimize=True)
    except Exception as exc:
        raise RuntimeError(f"ONNX export of the {spec.name} graph failed (opset {opset}; no fallback to the "
                           f"TorchScript exporter is tried): {exc}") from exc
    graph = onnx_program.model.graph
    renames: dict[Any, str] = {}
    for values, axes in ((graph.inputs, spec.input_axes), (graph.outputs, spec.output_axes)):
        for value in values:
            for axis, readable in axes.get(value.name, {}).items():
                dim = value.shape[axis]
                if isinstance(getattr(dim, "value", None), str):
                    renames[dim] = readable
    onnx_program.rename_axes(renames)
    onnx_program.save(str(path))


def onnx_summary(path: Path) -> tuple[dict[str, int], list[dict[str, Any]], list[dict[str, Any]]]:
    """(op histogram including If branches, inputs, outputs) of an ONNX file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    histogram: Counter[str] = Counter()

    def visit(graph) -> None:
        for node in graph.node:
            histogram[node.op_type] += 1
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    visit(attribute.g)

    visit(model.graph)

    def describe(value) -> dict[str, Any]:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        return {"name": value.name, "shape": shape, "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name}

    return (dict(histogram.most_common()), [describe(v) for v in model.graph.input],
            [describe(v) for v in model.graph.output])


def aoti_supported() -> tuple[bool, str]:
    """AOTInductor on CPU needs a C++ compiler; says why not when it cannot run."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None and shutil.which("clang++") is None:
        return False, f"no C++ compiler ({compiler} or clang++) on PATH"
    if platform.system() not in ("Linux", "Darwin"):
        return False, f"AOTInductor packages are not supported on {platform.system()} here"
    return True, ""


def compile_aoti(spec: GraphSpec, program: torch.export.ExportedProgram, path: Path) -> float:
    from torch._inductor import aoti_compile_and_package

    start = time.perf_counter()
    try:
        with _quiet_exporter():
            aoti_compile_and_package(program, package_path=str(path))
    except Exception as exc:
        raise RuntimeError(f"AOTInductor compile of the {spec.name} graph failed: {exc} "
                           "(export without --compile for an ONNX-only bundle)") from exc
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------- validation


def validation_lengths(config: ModelConfig) -> list[int]:
    """Sequence lengths around the points where k = max(1, T * num // den) changes, plus the training length."""
    num, den = config.capacity_fraction()
    step = max(1, -(-den // num))  # T where k first reaches 1 without the max
    lengths = {1, 2, 3, step - 1, step, step + 1, 2 * step - 1, 2 * step, 2 * step + 1, config.seq_len}
    longest = max(config.seq_len, min(2 * step + 1, 4 * config.seq_len))  # a tiny capacity must not ask for huge T
    return sorted(t for t in lengths if 1 <= t <= longest)


def validation_text(path: str | None, vocab_size: int) -> np.ndarray:
    if path is None:
        import textwrap

        raw = Path(textwrap.__file__).read_bytes()
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"--text: no such file: {p}")
        raw = p.read_bytes()
        if len(raw) < 16:
            raise UserError(f"--text: {p} is too short ({len(raw)} bytes, need at least 16)")
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64) % vocab_size


def _text_windows(text: np.ndarray, batch: int, length: int) -> torch.Tensor:
    reps = -(-(batch * length + 1) // len(text))
    tiled = np.tile(text, reps)
    starts = [(i * 997) % max(1, len(tiled) - length) for i in range(batch)]
    return torch.from_numpy(np.stack([tiled[s:s + length] for s in starts]))


def forward_cases(config: ModelConfig, text: np.ndarray, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for length in validation_lengths(config):
        tokens = torch.randint(0, config.vocab_size, (2, length), generator=generator)
        cases.append((f"random B=2 T={length}", tokens))
    top = max(validation_lengths(config))
    cases.append((f"random B=1 T={top}", torch.randint(0, config.vocab_size, (1, top), generator=generator)))
    cases.append((f"text B=3 T={config.seq_len}", _text_windows(text, 3, config.seq_len)))
    odd = max(3, config.seq_len // 2 + 1)
    cases.append((f"text B=2 T={odd}", _text_windows(text, 2, odd)))
    return cases


def decode_cases(config: ModelConfig, text: np.ndarray, seed: int) -> list[tuple[str, list[list[int]]]]:
    rng = np.random.default_rng(seed)
    windows = _text_windows(text, 3, 24).tolist()
    return [
        ("text B=1 prompt 17", [windows[0][:17]]),
        ("text B=2 prompts 21,9", [windows[1][:21], windows[2][:9]]),
        ("random B=3 prompts 4,11,7", [rng.integers(0, config.vocab_size, n).tolist() for n in (4, 11, 7)]),
        ("text+random B=2 prompts 12,12", [windows[0][:12], rng.integers(0, config.vocab_size, 12).tolist()]),
    ]


@torch.no_grad()
def eager_forward(model: MoDDecoder, tokens: torch.Tensor) -> tuple[np.ndarray, list[np.ndarray]]:
    logits, records = model(tokens, "topk", return_records=True)
    return logits.float().numpy(), [r.selection.selected_idx.numpy() for r in records]


@torch.no_grad()
def eager_generation(model: MoDDecoder, prompts: list[list[int]], steps: int, routing: str
                     ) -> tuple[list[list[int]], list[np.ndarray], dict[int, list[int]]]:
    """`modcli generate`'s PyTorch path at temperature 0: its prefill, then `decode_step` with the KV cache.

    Returns the greedy tokens per row, the (steps, V) logits each was chosen from, and per routed layer the
    number of tokens each row's cache holds (= tokens the layer processed).
    """
    from modcli.cache import DecoderCache
    from modcli.generate import prefill

    device = torch.device("cpu")
    dtype = model.embed.weight.dtype
    cache = DecoderCache.allocate(model.config, len(prompts), max(map(len, prompts)) + steps, device, dtype)
    logits = prefill(model, prompts, cache, routing, device, "float32")  # (B, V); the model is in the export dtype
    tokens: list[list[int]] = [[] for _ in prompts]
    kept: list[list[np.ndarray]] = [[] for _ in prompts]
    for step in range(steps):
        chosen = logits.argmax(dim=-1)  # (B,)
        for row in range(len(prompts)):
            tokens[row].append(int(chosen[row]))
            kept[row].append(logits[row].float().numpy())
        if step + 1 < steps:
            logits = model.decode_step(chosen, cache, routing).float()
    processed = {layer: cache.layers[layer].lengths.tolist() for layer in model.config.routed_layers()}
    return tokens, [np.stack(rows) for rows in kept], processed


def _torch_runner(call: Callable, dtype: torch.dtype) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """numpy in, numpy out around a torch callable (AOTInductor package, ExportedProgram module)."""

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        tensors = [t.to(dtype) if t.is_floating_point() else t for t in tensors]
        with torch.no_grad():
            outputs = call(*tensors)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return [o.float().numpy() if o.is_floating_point() else o.numpy() for o in outputs]

    return run


def _check_forward(model: MoDDecoder, runner_name: str, run: Callable[[np.ndarray], list[np.ndarray]],
                   cases: list[tuple[str, torch.Tensor]], atol: float) -> list[Check]:
    checks = []
    for case, tokens in cases:
        ref_logits, ref_selected = eager_forward(model, tokens)
        try:
            outputs = run(tokens.numpy())
        except Exception as exc:  # a runtime failure on one shape is a failed check, not a crash
            checks.append(Check("forward", runner_name, case, float("inf"), None, None, False, f"failed to run: {exc}"))
            continue
        diff = float(np.abs(outputs[0].astype(np.float32) - ref_logits).max())
        same = all(o.shape == r.shape and bool((o == r).all()) for o, r in zip(outputs[1:], ref_selected, strict=True))
        passed = diff <= atol and same
        detail = "" if same else "selected positions differ from eager top-k"
        checks.append(Check("forward", runner_name, case, diff, same if ref_selected else None, None, passed, detail))
    return checks


def _check_decode(model: MoDDecoder, runner_name: str, step, cache_spec, cases: list[tuple[str, list[list[int]]]],
                  steps: int, routing: str, atol: float) -> list[Check]:
    from modcli_runtime.generate import generate_tokens

    checks = []
    for case, prompts in cases:
        ref_tokens, ref_logits, ref_processed = eager_generation(model, prompts, steps, routing)
        try:
            got = generate_tokens(step, cache_spec, prompts, vocab_size=model.config.vocab_size,
                                  max_new_tokens=steps, temperature=0, return_logits=True)
        except Exception as exc:
            checks.append(Check("decode", runner_name, case, float("inf"), None, None, False, f"failed to run: {exc}"))
            continue
        diffs, details = [], []
        for row, (mine, ref) in enumerate(zip(got.logits, ref_logits, strict=True)):
            agree = next((i for i, (a, b) in enumerate(zip(got.tokens[row], ref_tokens[row], strict=True)) if a != b),
                         steps)
            diffs.append(float(np.abs(mine[:agree + 1] - ref[:agree + 1]).max()) if agree < steps
                         else float(np.abs(mine - ref).max()))
            if agree < steps:
                details.append(f"row {row}: greedy tokens differ from step {agree}")
        tokens_same = got.tokens == ref_tokens
        processed_same = got.processed_tokens == ref_processed
        if not processed_same:
            details.append(f"processed tokens per layer {got.processed_tokens} != eager {ref_processed}")
        diff = max(diffs)
        checks.append(Check("decode", runner_name, f"{case} +{steps}", diff,
                            processed_same if ref_processed else None, tokens_same,
                            diff <= atol and tokens_same and processed_same, "; ".join(details)))
    return checks


def _provider_names(provider: str) -> list[str]:
    """--provider -> the runtime providers to validate on; an unusable explicit one is a UserError."""
    from modcli_runtime.bundle import BundleError, session_providers

    try:
        session_providers(provider)
    except BundleError as exc:
        raise UserError(str(exc)) from None
    if provider == "cpu":
        return ["cpu"]
    cuda = _cuda_provider_works()
    if provider == "cuda" and not cuda:
        raise UserError("--provider cuda: onnxruntime's CUDAExecutionProvider cannot start on this machine "
                        "(no GPU or missing CUDA/cuDNN libraries); use --provider cpu")
    return ["cpu", "cuda"] if cuda and provider == "auto" else (["cuda"] if cuda else ["cpu"])


def _cuda_provider_works() -> bool:
    """Start the CUDA provider on a one-node model: onnxruntime-gpu lists it even where it cannot load."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    value = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [value("x", TensorProto.FLOAT, [1])], [value("y", TensorProto.FLOAT, [1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", MIN_OPSET)], ir_version=8)
    onnx.checker.check_model(probe)
    ort.set_default_logger_severity(4)  # the failed library load is reported as one line by our caller instead
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 4
        session = ort.InferenceSession(probe.SerializeToString(), sess_options=options,
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return "CUDAExecutionProvider" in session.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(2)


# ----------------------------------------------------------------------------------------------- the bundle


def _check_out(out: Path, force: bool) -> None:
    if not out.exists():
        return
    if not force:
        raise UserError(f"--out {out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise UserError(f"--out {out} is a file, not a bundle folder; refusing to replace it")
    if any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise UserError(f"--force: {out} is a non-empty folder without manifest.json (not a modcli bundle); "
                        "refusing to delete it")


def _fsync_tree(folder: Path) -> None:
    for child in folder.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_entries(folder: Path) -> dict[str, dict[str, Any]]:
    from modcli_runtime.bundle import sha256_of

    return {p.name: {"sha256": sha256_of(p), "bytes": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


def _require_runtime() -> None:
    try:
        import modcli_runtime  # noqa: F401
    except ImportError:
        raise UserError("the PyTorch-free runtime package modcli_runtime is not importable; reinstall modcli "
                        "(pip install -e .) so that export/modcli_runtime is installed") from None


def export(config: ExportConfig, log: Callable[[str], None] | None = None) -> ExportResult:
    """Export, validate and write the bundle; returns what was written and every check (see `valid`)."""
    from modcli.checkpoint import load_model_from
    from modcli.runtime import TORCH_DTYPES

    log = log or (lambda message: None)
    started = time.perf_counter()
    out = Path(config.out)
    _check_out(out, config.force)
    _require_runtime()
    model, run_config, checkpoint = load_model_from(config.checkpoint, "cpu")
    if config.routing == "predictor" and not model.config.dense and not model.config.predictor_hidden:
        raise UserError(f"--routing predictor: {checkpoint} was trained without a predictor "
                        "(--predictor-hidden 0); use --routing router")
    if config.onnx:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if config.opset > newest:
            raise UserError(f"--opset must be <= {newest} (the newest opset of the installed onnx), got {config.opset}")
    providers = _provider_names(config.provider) if config.onnx else []
    aoti_ok, aoti_reason = aoti_supported() if config.compile else (False, "")
    if config.compile and not aoti_ok:
        log(f"[yellow]note: no AOTInductor package: {aoti_reason}; the .pt2 ExportedPrograms are still written[/]")
    model = model.to(TORCH_DTYPES[config.dtype]).eval()
    text = validation_text(config.text, model.config.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        result = _write_bundle(tmp, out, config, model, run_config.to_dict(), str(checkpoint.resolve()), providers,
                               aoti_ok, aoti_reason, text, log)
        _fsync_tree(tmp)
        if out.exists():  # --force, checked above: swap, then remove the old bundle
            old = out.parent / f".old-{out.name}-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.seconds = time.perf_counter() - started
    return result


def _write_bundle(tmp: Path, out: Path, config: ExportConfig, model: MoDDecoder, run_config: dict[str, Any],
                  checkpoint: str, providers: list[str], aoti_ok: bool, aoti_reason: str, text: np.ndarray,
                  log: Callable[[str], None]) -> ExportResult:
    from modcli_runtime.bundle import FORMAT, FORMAT_VERSION, Bundle, BundleError, CacheSpec

    model_config = model.config
    dtype = model.embed.weight.dtype
    (tmp / "config.json").write_text(json.dumps(run_config, indent=2))
    makers = {"forward": lambda: forward_spec(model), "decode": lambda: decode_spec(model, config.routing)}
    specs = [makers[name]() for name in config.graphs]
    files: list[GraphFile] = []
    graphs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        log(f"exporting the {spec.name} graph ({spec.routing} routing)")
        start = time.perf_counter()
        program = export_program(spec)
        export_s = time.perf_counter() - start
        if config.compile:
            path = tmp / f"{spec.name}.pt2"
            torch.export.save(program, str(path))
            files.append(GraphFile(spec.name, "exported_program", path.name, path.stat().st_size, export_s))
            if aoti_ok:
                log(f"compiling the {spec.name} graph with AOTInductor")
                aoti_path = tmp / f"{spec.name}.aoti.pt2"
                seconds = compile_aoti(spec, program, aoti_path)
                files.append(GraphFile(spec.name, "aoti", aoti_path.name, aoti_path.stat().st_size, seconds))
                log(f"  AOTInductor compile took {seconds:.1f} s")
        info: dict[str, Any] = {"routing": spec.routing, "causal": spec.causal, "note": spec.note}
        if config.onnx:
            start = time.perf_counter()
            path = tmp / f"{spec.name}.onnx"
            export_onnx(spec, program, path, config.opset)
            seconds = export_s + time.perf_counter() - start
            histogram, inputs, outputs = onnx_summary(path)
            files.append(GraphFile(spec.name, "onnx", path.name, path.stat().st_size, seconds, histogram))
            info.update(kind="onnx", file=path.name, inputs=inputs, outputs=outputs)
        else:
            info.update(kind="exported_program", file=f"{spec.name}.pt2",
                        inputs=[{"name": n} for n in spec.input_names], outputs=[{"name": n} for n in spec.output_names])
        info["exported_program"] = f"{spec.name}.pt2" if config.compile else None
        info["aoti"] = f"{spec.name}.aoti.pt2" if config.compile and aoti_ok else None
        graphs[spec.name] = info
    num, den = model_config.capacity_fraction()
    if "decode" in graphs:
        graphs["decode"]["cache"] = {
            "n_layers": model_config.n_layers, "n_heads": model_config.n_heads, "head_dim": model_config.head_dim,
            "dtype": config.dtype, "routed_layers": model_config.routed_layers(), "capacity": [num, den],
            "prefill": PREFILL_NOTE}
    if "forward" in graphs and not model_config.dense:
        graphs["forward"]["capacity"] = {"fraction": [num, den], "k": "max(1, T * num // den), computed in the graph"}

    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "valid": False, "created_unix": time.time(),
        "checkpoint": checkpoint, "dtype": config.dtype, "opset": config.opset if config.onnx else None,
        "versions": _versions(),
        "model": {"vocab_size": model_config.vocab_size, "seq_len": model_config.seq_len,
                  "tokens": "bytes (UTF-8)", "dense": model_config.dense, "routed_layers": model_config.routed_layers()},
        "graphs": graphs,
        "compile": {"asked": config.compile, "aoti": aoti_ok, "aoti_skipped_because": aoti_reason or None,
                    "target": "cpu",
                    "seconds": {f"{f.graph}.{f.kind}": round(f.seconds, 3) for f in files}},
        "validation": {"status": "pending"},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

    log("validating against eager PyTorch")
    checks: list[Check] = []
    fwd_cases = forward_cases(model_config, text, config.seed)
    dec_cases = decode_cases(model_config, text, config.seed)
    steps, atol = config.decode_steps, float(config.atol)
    for provider in providers:
        try:
            bundle = Bundle(tmp, provider=provider, verify=False, allow_invalid=True)
            name = f"ort-{bundle.active_provider.removesuffix('ExecutionProvider').lower()}"
        except BundleError as exc:
            raise UserError(f"--dtype {config.dtype} with --provider {provider}: {exc}") from None

        def run_forward(tokens: np.ndarray, bundle=bundle) -> list[np.ndarray]:
            logits, selected = bundle.forward(tokens)
            return [logits, *selected]

        if "forward" in graphs:
            checks += _check_forward(model, name, run_forward, fwd_cases, atol)
        if "decode" in graphs:
            checks += _check_decode(model, name, bundle.decode_step, bundle.cache_spec, dec_cases, steps,
                                    config.routing, atol)
    if config.compile:
        runners: list[tuple[str, dict[str, Callable]]] = []
        loaded = {s.name: torch.export.load(str(tmp / f"{s.name}.pt2")).module() for s in specs}
        runners.append(("pt2", loaded))
        if aoti_ok:
            from torch._inductor import aoti_load_package

            runners.append(("aoti-cpu", {s.name: aoti_load_package(str(tmp / f"{s.name}.aoti.pt2")) for s in specs}))
        torch_spec = CacheSpec(model_config.n_layers, model_config.n_heads, model_config.head_dim, "float32",
                               model_config.routed_layers(), (num, den))
        by_name = {s.name: s for s in specs}
        for name, calls in runners:
            if "forward" in calls:
                forward_run = _torch_runner(calls["forward"], dtype)
                checks += _check_forward(model, name, lambda tokens, run=forward_run: run([tokens]), fwd_cases, atol)
            if "decode" in calls:
                decode_run = _torch_runner(calls["decode"], dtype)

                def step(feeds: dict[str, np.ndarray], run=decode_run) -> dict[str, np.ndarray]:
                    outputs = run([feeds[n] for n in by_name["decode"].input_names])
                    return dict(zip(by_name["decode"].output_names, outputs, strict=True))

                checks += _check_decode(model, name, step, torch_spec, dec_cases, steps, config.routing, atol)

    failures = [f"{c.graph} on {c.runner}, {c.case}: max |diff| {c.max_abs_diff:.3g} (atol {atol:g})"
                + (f"; {c.detail}" if c.detail else "") for c in checks if not c.passed]
    valid = bool(checks) and not failures
    manifest["valid"] = valid
    manifest["validation"] = {"status": "passed" if valid else "failed", "atol": atol, "decode_steps": steps,
                              "reference": "eager PyTorch on the same checkpoint in the same dtype "
                                           "(forward: model(tokens, 'topk'); decode: modcli.generate's prefill and "
                                           "decode_step, greedy)",
                              "checks": [_finite(dataclasses.asdict(c)) for c in checks], "failures": failures}
    manifest["files"] = _file_entries(tmp)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, allow_nan=False))
    return ExportResult(bundle=str(out), valid=valid, atol=atol, dtype=config.dtype, routing=config.routing,
                        files=files, checks=checks, seconds=0.0, failures=failures)


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: a check that could not run records max_abs_diff null."""
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in record.items()}


def time_bundle(path: str | Path, **options) -> dict[str, Any]:
    """Latency of a bundle's ONNX graphs through onnxruntime (see modcli_runtime.bench.time_bundle).

    `modcli profile --onnx BUNDLE` calls this next to its eager PyTorch timings: forward on (batch, seq_len)
    tokens and one decode step at `cache_tokens` cached tokens; median/min/p90 milliseconds and tokens/s.
    """
    from modcli_runtime.bench import time_bundle as run

    try:
        return run(path, **options)
    except Exception as exc:
        from modcli_runtime.bundle import BundleError

        if isinstance(exc, BundleError):
            raise UserError(str(exc)) from None
        raise
