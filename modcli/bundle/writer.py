"""`modcli export`: a trained checkpoint -> a validated bundle of graphs that run without the training code.

The bundle is a folder:

- `forward.onnx`: tokens (B, T) -> logits (B, T, V) and each routed block's selected positions, with the
  training-time top-k routing (non-causal: a token's selection depends on later tokens; for scoring whole
  sequences, not for decoding). k = max(1, T * num // den) is computed inside the graph, so one graph serves
  every T and B.
- `decode.onnx`: one token per sequence plus an explicit, read-only KV cache (per layer (B, Hkv, slots, hd)
  keys/values and (B,) lengths; a local (--sliding-window) layer also (B, slots) slot_positions, each slot's
  original position, which the runtime stores beside the K/V: modcli.decode.graphs), with causal routing
  (`--routing router|predictor`). It returns the logits, only this step's K/V per layer (new_keys.L/new_values.L,
  (B, Hkv, 1, hd)) and per routed layer which rows processed the token; the manifest's `graphs.decode.cache` says
  which layers store every row's K/V and which only the processed rows' (the runtime writes them in place). The
  prompt is fed through this graph one token at a time, which fills the cache with exactly the decisions `modcli
  generate` makes.
- `cache_write.onnx` (with decode.onnx): writes a step's K/V rows into a cache buffer in place; the runtime uses it
  to keep the KV cache on the device with the CUDA provider (modcli_runtime.device).
- with `--compile`: `<graph>.pt2` (torch.export ExportedProgram, dynamic dims) and `<graph>.aoti.pt2`
  (AOTInductor package for this machine's CPU).
- `config.json` (the checkpoint's run config) and `manifest.json` (files and sha256, versions, opset, inputs
  and outputs, the routing of each graph, validation results, `valid`).

Everything is written to a temporary folder that is renamed into place at the end (modcli.checkpoint.atomic, as
checkpoints are), under --out's lock (modcli.checkpoint.lock, the one every writing command takes); a failure leaves
nothing behind, and a folder that appeared at --out (or changed) after it was checked is never replaced. Validation
always runs: every graph against eager PyTorch (top-k forward on random tokens and real text at several T and B,
selected positions and logits; greedy decoding against `modcli generate`'s PyTorch path, tokens, logits and per-layer
processed counts). A failed check marks the bundle invalid. Progress lines (each step and the seconds since the start)
go to `log`.

This module holds the orchestration and the bundle on disk; its config is modcli.bundle.config.ExportConfig, the
graphs are built by modcli.bundle.lowering (over the wrappers in modcli.decode.graphs) and checked by
modcli.bundle.validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from modcli_runtime.bench import time_bundle as time_bundle_graphs
from modcli_runtime.bundle import FORMAT, FORMAT_VERSION, sha256_of
from modcli_runtime.errors import BundleError

from modcli.bundle.config import ExportConfig
from modcli.bundle.fusion import FUSED, PLAIN, fuse_graph
from modcli.bundle.lowering import (
    CACHE_WRITE_NOTE,
    aoti_supported,
    compile_aoti,
    decode_spec,
    export_onnx,
    export_program,
    forward_spec,
    onnx_summary,
    write_cache_writer,
)
from modcli.bundle.validation import Check, validate_bundle, validation_providers, validation_text
from modcli.checkpoint import atomic
from modcli.checkpoint.lock import OutLock
from modcli.checkpoint.store import is_write_error, load_model_from
from modcli.errors import UserError, WriteFailed
from modcli.hardware import TORCH_DTYPES
from modcli.models.decoder import MoDDecoder

CACHE_UPDATE_NOTE = ("the graph only reads the cache and returns this step's K/V per layer of kv_layers (a layer whose "
                     "attention a static drop removed has no cache) as new_keys.L/new_values.L "
                     "(B, Hkv, 1, hd); the caller stores row b's at slot lengths.L[b] of its own buffers, in place, "
                     "and adds 1 to lengths.L[b]: for every row in every_row_layers, and only for rows with "
                     "processed.L[b] true in processed_row_layers (attention-routed layers whose skipped "
                     "tokens keep no K/V); a local (sliding-window) layer of local_layers also reads "
                     "slot_positions.L (B, slots) int64, the original position of the token in each slot (a routed "
                     "layer's slots are not positions), and the caller stores positions[b] at the same slot as row "
                     "b's K/V; the graph masks the slots at or past lengths.L[b] and those window or more positions "
                     "before the query's")
PREFILL_NOTE = ("the prompt is fed through the decode graph one token per step (exactly the causal decisions of "
                "`modcli generate`); there is no batched causal prefill graph")


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
class ExportResult:
    """What `export` wrote and every check it ran; `valid` is false when any check failed."""

    bundle: str
    valid: bool
    atol: float
    dtype: str
    routing: str
    files: list[GraphFile]
    checks: list[Check]
    seconds: float
    failures: list[str]


# ----------------------------------------------------------------------------------------------- the bundle


def check_out(out: Path, force: bool, is_ours: Callable[[Path], bool], kind: str, not_ours: str) -> None:
    """An existing --out needs --force, and --force replaces only an empty folder or one `is_ours` recognises
    (`kind`: what the folder should be; `not_ours`: why a non-empty one is not, for the refusal)."""
    if not out.exists():
        return
    if not force:
        raise UserError(f"--out {out} already exists; pass --force to replace it")
    if not out.is_dir():
        raise UserError(f"--out {out} is a file, not a {kind}; refusing to replace it")
    if any(out.iterdir()) and not is_ours(out):
        raise UserError(f"--force: {out} is a non-empty folder {not_ours}; refusing to delete it")


def _file_entries(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"sha256": sha256_of(p), "bytes": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": onnxscript.__version__,
            "onnxruntime": onnxruntime.__version__, "python": platform.python_version()}


def export(config: ExportConfig, log: Callable[[str], None] | None = None) -> ExportResult:
    """Export, validate and write the bundle; returns what was written and every check (see `valid`).

    Holds a lock next to --out while it works, so a second export into the same --out is refused (UserError); a
    failure to write (disk full) is a WriteFailed naming the path, and leaves no partial bundle behind.
    """
    log = log or (lambda message: None)
    started = time.perf_counter()
    out = Path(config.out)
    with export_lock(out, log):
        return _export(config, out, log, started)


@contextlib.contextmanager
def export_lock(out: Path, log: Callable[[str], None]):
    """Hold --out's lock while an export works (any other command writing --out is refused at once), after putting
    back what a killed command left beside it (modcli.checkpoint.lock.OutLock); one note per thing to `log`."""
    lock = OutLock(out, "export")
    for note in lock.acquire():
        log(note)
    try:
        yield
    finally:
        lock.release()


def write_failed(exc: BaseException, what: str) -> WriteFailed | None:
    """A refused write (disk full, permissions, a file-size limit; as OSError or a writer's own error) as the one
    line of exit code 1; None for any other exception."""
    if not is_write_error(exc):
        return None
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return WriteFailed(f"cannot write {what}: {exc.strerror or exc}{where}")
    return WriteFailed(f"cannot write {what}: {' '.join(str(exc).split())[:300]}")


def timed_export(config, export: Callable, log: Callable[[str], None] | None = None):
    """`export(config, out, progress)` under --out's lock (`export_lock`), its result's `seconds` set: the frame of
    `export --hf` and `export --gguf`."""
    log = log or (lambda message: None)
    started = time.perf_counter()
    out = Path(config.out)
    with export_lock(out, log):
        result = export(config, out, Progress(log, started))
    result.seconds = time.perf_counter() - started
    return result


class Progress:
    """Progress lines to `log` (stderr; nothing with --json) with the seconds since the export started."""

    heartbeat_s = 30.0
    """While a step runs longer, a line every this many seconds says it is still running."""

    def __init__(self, log: Callable[[str], None], started: float) -> None:
        self.log, self.started = log, started

    @contextlib.contextmanager
    def step(self, what: str):
        """Say `what` starts, that it still runs every `heartbeat_s` (torch.export of a decode graph takes minutes
        on a small CPU), and how long it took."""
        self(what)
        start, done = time.perf_counter(), threading.Event()

        def beat() -> None:
            while not done.wait(self.heartbeat_s):
                self(f"  still {what} ({time.perf_counter() - start:.0f} s so far)")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
        self(f"  took {time.perf_counter() - start:.1f} s")

    def __call__(self, message: str) -> None:
        if message.startswith(("note:", "[yellow]note:")):  # notes read the same with or without a clock
            self.log(message)
        else:
            self.log(f"[{time.perf_counter() - self.started:6.1f} s] {message}")


def _export(config: ExportConfig, out: Path, log: Callable[[str], None], started: float) -> ExportResult:
    check_out(out, config.force, lambda folder: (folder / "manifest.json").is_file(), "bundle folder",
              "without manifest.json (not a modcli bundle)")
    checked = atomic.folder_state(out)  # what is published over must still be this
    model, run_config, checkpoint = load_model_from(config.checkpoint, "cpu")
    family = model.config.family
    if not family.exportable:
        raise UserError(f"--arch {family.name} cannot be exported: {family.export_note}")
    if family.export_note:
        log(f"note: --arch {family.name}: {family.export_note}")
    config = dataclasses.replace(config, routing=config.routing or (model.causal_modes() or ("dense",))[0])
    model.check_routing(config.routing, causal=True)
    if model.capabilities is not None:
        refused = [graph for graph in config.graphs if graph not in model.capabilities.graphs]
        if refused:
            raise UserError(f"--graph {', '.join(refused)}: the {model.config.router} router cannot be exported to "
                            f"that graph (it offers {', '.join(model.capabilities.graphs) or 'none'})")
    if config.onnx:
        import onnx

        newest = onnx.defs.onnx_opset_version()
        if config.opset > newest:
            raise UserError(f"--opset must be <= {newest} (the newest opset of the installed onnx), got {config.opset}")
    providers = validation_providers(config.provider) if config.onnx else []
    aoti_ok, aoti_reason = aoti_supported() if config.compile else (False, "")
    if config.compile and not aoti_ok:
        log(f"[yellow]note: no AOTInductor package: {aoti_reason}; the .pt2 ExportedPrograms are still written[/]")
    model = model.to(TORCH_DTYPES[config.dtype]).eval()
    text = validation_text(config.text, model.config.vocab_size)

    try:
        with atomic.publish_folder(out, expect=checked) as tmp:  # a bundle checked above (--force) is replaced
            if run_config.data.tokenizer != "bytes":  # the bundle carries the run's tokenizer; modcli-run reads it
                shutil.copyfile(checkpoint.parent / run_config.data.tokenizer, tmp / "tokenizer.json")
            result = _write_bundle(tmp, out, config, model, run_config.to_dict(), str(checkpoint.resolve()),
                                   providers, aoti_ok, aoti_reason, text, Progress(log, started))
            log(f"[{time.perf_counter() - started:6.1f} s] publishing {out}")
    except Exception as exc:
        failed = write_failed(exc, f"the bundle {out}")
        if failed is None:
            raise
        raise failed from None
    result.seconds = time.perf_counter() - started
    return result


def _write_bundle(tmp: Path, out: Path, config: ExportConfig, model: MoDDecoder, run_config: dict[str, Any],
                  checkpoint: str, providers: list[str], aoti_ok: bool, aoti_reason: str, text: np.ndarray,
                  log: Progress) -> ExportResult:
    model_config = model.config
    tokenizer = run_config["data"]["tokenizer"]
    (tmp / "config.json").write_text(json.dumps(run_config, indent=2))
    makers = {"forward": lambda: forward_spec(model), "decode": lambda: decode_spec(model, config.routing)}
    specs = [makers[name]() for name in config.graphs]
    files: list[GraphFile] = []
    graphs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        start = time.perf_counter()
        with log.step(f"exporting the {spec.name} graph ({spec.routing} routing): torch.export"):
            program = export_program(spec)
        export_s = time.perf_counter() - start
        if config.compile:
            path = tmp / f"{spec.name}.pt2"
            torch.export.save(program, str(path))
            files.append(GraphFile(spec.name, "exported_program", path.name, path.stat().st_size, export_s))
            if aoti_ok:
                aoti_path = tmp / f"{spec.name}.aoti.pt2"
                with log.step(f"compiling the {spec.name} graph with AOTInductor"):
                    seconds = compile_aoti(spec, program, aoti_path)
                files.append(GraphFile(spec.name, "aoti", aoti_path.name, aoti_path.stat().st_size, seconds))
        info: dict[str, Any] = {"routing": spec.routing, "causal": spec.causal, "note": spec.note}
        if config.onnx:
            start = time.perf_counter()
            path = tmp / f"{spec.name}.onnx"
            with log.step(f"writing {path.name} (ONNX opset {config.opset})"):
                export_onnx(spec, program, path, config.opset)
            fused: dict[str, int] = {}
            if not config.opset_only:
                with log.step(f"fusing attention in {path.name}"):
                    fused = fuse_graph(path, model_config.n_heads, model_config.d_model)
            seconds = export_s + time.perf_counter() - start
            log(f"{path.name}: {path.stat().st_size / 1e6:.2f} MB, {seconds:.1f} s in all")
            histogram, inputs, outputs = onnx_summary(path)
            files.append(GraphFile(spec.name, "onnx", path.name, path.stat().st_size, seconds, histogram))
            info.update(kind="onnx", file=path.name, inputs=inputs, outputs=outputs,
                        operators=PLAIN if config.opset_only else FUSED, fused=fused)
        else:
            info.update(kind="exported_program", file=f"{spec.name}.pt2",
                        inputs=[{"name": n} for n in spec.input_names], outputs=[{"name": n} for n in spec.output_names])
        info["exported_program"] = f"{spec.name}.pt2" if config.compile else None
        info["aoti"] = f"{spec.name}.aoti.pt2" if config.compile and aoti_ok else None
        graphs[spec.name] = info
    if config.onnx and "decode" in graphs:  # the device-resident cache's in-place row writer (modcli_runtime.device)
        start = time.perf_counter()
        path = tmp / "cache_write.onnx"
        write_cache_writer(path, config.dtype, config.opset)
        histogram, inputs, outputs = onnx_summary(path)
        files.append(GraphFile("cache_write", "onnx", path.name, path.stat().st_size, time.perf_counter() - start,
                               histogram))
        graphs["cache_write"] = {"kind": "onnx", "file": path.name, "inputs": inputs, "outputs": outputs,
                                 "note": CACHE_WRITE_NOTE}
    num, den = model_config.capacity_fraction()
    if "decode" in graphs:
        graphs["decode"]["cache"] = {
            "n_layers": model_config.n_layers, "n_heads": model_config.kv_heads, "head_dim": model_config.head_dim,
            "dtype": config.dtype, "routed_layers": model_config.routed_layers(), "capacity": [num, den],
            "kv_layers": model_config.kv_layers(),
            "every_row_layers": [layer for layer in model_config.kv_layers()
                                 if not model_config.kv_is_routed(layer)],
            "processed_row_layers": [layer for layer in range(model_config.n_layers)
                                     if model_config.kv_is_routed(layer)],
            "local_layers": [layer for layer in model_config.kv_layers() if model_config.is_sliding(layer)],
            "window": model_config.sliding_window,
            "update": CACHE_UPDATE_NOTE, "prefill": PREFILL_NOTE}
    if "forward" in graphs and not model_config.dense:
        graphs["forward"]["capacity"] = {"fraction": [num, den], "k": "max(1, T * num // den), computed in the graph"}

    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "valid": False, "created_unix": time.time(),
        "checkpoint": checkpoint, "dtype": config.dtype, "opset": config.opset if config.onnx else None,
        "operators": (PLAIN if config.opset_only else FUSED) if config.onnx else None,
        "versions": _versions(),
        "model": {"vocab_size": model_config.vocab_size, "seq_len": model_config.seq_len,
                  "tokens": "bytes (UTF-8)" if tokenizer == "bytes" else "tokenizer.json",
                  "tokenizer": None if tokenizer == "bytes" else "tokenizer.json",
                  "dense": model_config.dense, "routed_layers": model_config.routed_layers(),
                  "arch": model_config.arch, "export_note": model_config.family.export_note},
        "graphs": graphs,
        "compile": {"asked": config.compile, "aoti": aoti_ok, "aoti_skipped_because": aoti_reason or None,
                    "target": "cpu",
                    "seconds": {f"{f.graph}.{f.kind}": round(f.seconds, 3) for f in files}},
        "validation": {"status": "pending"},
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))

    runners = f"onnxruntime {', '.join(providers)}" if config.onnx else "the exported programs"
    with log.step(f"validating the {' and '.join(spec.name for spec in specs)} graphs against eager PyTorch "
                  f"({runners})"):
        checks = validate_bundle(tmp, model, specs, config, providers, aoti_ok, text)
    log(f"  {len(checks)} checks, {sum(not c.passed for c in checks)} failed")
    steps, atol = config.decode_steps, float(config.atol)
    failures = [f"{c.graph} on {c.runner}, {c.case}: max |diff| {c.max_abs_diff:.3g} (atol {atol:g})"
                + (f"; {c.detail}" if c.detail else "") for c in checks if not c.passed]
    valid = bool(checks) and not failures
    manifest["valid"] = valid
    manifest["validation"] = {"status": "passed" if valid else "failed", "atol": atol, "decode_steps": steps,
                              "reference": "eager PyTorch on the same checkpoint in the same dtype "
                                           "(forward: model(tokens, 'topk'); decode: modcli.decode.generation's prefill and "
                                           "decode_step, greedy)",
                              "checks": [_finite(dataclasses.asdict(c)) for c in checks], "failures": failures,
                              "ambiguous": [f"{c.graph} on {c.runner}, {c.case}: {c.detail}"
                                            for c in checks if c.ambiguous]}
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
    tokens and one decode step at `cache_tokens` cached tokens; the statistics of `modcli_runtime.timing` (latency_ms
    the median, latency_min_ms, latency_max_ms, tokens_per_s), as for the eager timings.
    """
    try:
        return time_bundle_graphs(path, **options)
    except BundleError as exc:
        raise UserError(str(exc)) from None
