"""`modcli sweep`: isoFLOP and speed-quality sweeps over a grid of MoD and dense runs, resumable.

A grid (TOML) names training-FLOP budgets, model sizes and model variants (dense, routers, capacities,
route-every); the sweep trains every budget x size x variant as a normal run folder under `OUT/runs/` with the
same code as `modcli train` (`modcli.training.loop.train`), evaluates each in its routing modes (`modcli.evaluation.perplexity`:
the causal modes are the result, full-sequence modes such as top-k a labelled reference) and, with `--profile`,
measures its forward and decode latency against its dense twin in the same process (`modcli.profiling.profile`).

    preset = "tiny"                     # the base of every run (default tiny)
    budgets = [1.5e12, 3e12, 6e12]      # training FLOPs per run

    [common]                            # any flag of `modcli train`, applied to every run
    seq_len = 128
    batch_size = 8

    [[size]]                            # model sizes: any model flag; `name` is optional
    d_model = 64
    n_layers = 3

    [[variant]]                         # model families: any flag; a list value expands into one variant each
    dense = true
    [[variant]]
    router = "topk"
    capacity = [0.125, 0.25]

    [eval]                              # the evaluation after training
    batches = 16
    batch_size = 8

    [profile]                           # with --profile
    batch_size = 8
    repeats = 5

Every point is resolved with `resolve_run_config` and checked (a budget that pays for no step, a bad flag value,
an unknown key) before anything trains, so a mistake exits with code 2 and no run started. An interrupted sweep
continues where it stopped: points in `results.jsonl` are skipped, a run whose last checkpoint reached its budget is
evaluated without training, a partial run resumes from its newest checkpoint.

The sweep folder is checked and locked as every command's --out is (modcli.checkpoint.lock): a file, a path under a
file or a folder that cannot be written is one line, exit code 2; a non-empty folder that is not a sweep's is
refused; several `modcli sweep` processes share the folder's lock, any other command writing it is refused. The
folder keeps the grid it was started with (`grid.toml`): a second sweep into it with a grid that differs is refused
(copy the new grid over `grid.toml` to extend the sweep on purpose); the same grid continues it.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import math
import statistics
import time
import tomllib
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from modcli.checkpoint import atomic
from modcli.checkpoint.lock import OutLock
from modcli.checkpoint.store import complete_checkpoints, read_state
from modcli.config import RunConfig, resolve_run_config
from modcli.data.corpus import load_corpus
from modcli.data.tokenizer import ByteTokenizer
from modcli.errors import TrainingDiverged, UserError, WriteFailed
from modcli.evaluation.perplexity import EvalConfig, evaluate
from modcli.models.build import build_model
from modcli.profiling.profile import ProfileConfig, profile
from modcli.reports.console import read_metrics_file, stderr_console
from modcli.reports.plots import frontier_plot, isoflop_plot
from modcli.sweep.analysis import isoflop_analysis
from modcli.sweep.grid import (
    ETA,
    LOCKS,
    RESULTS,
    RUNS,
    EvalSettings,
    Grid,
    GridPoint,
    ProfileSettings,
    SweepConfig,
    SweepResult,
    best_per_budget,
    budget_label,
    comparable,
    differences,
    is_done,
    load_grid,
    one_line,
    planned_record,
    read_results,
    size_label,
    update_results,
    variant_label,
)
from modcli.training.loop import train
from modcli.training.schedule import step_flops


def plan(grid: Grid, out: Path, device: str | None = None, dtype: str | None = None) -> list[GridPoint]:
    """Every budget x size x variant (as far as a size's or variant's budgets and sizes allow) as a validated point, in
    the order they train; a UserError names the first impossible one."""

    overrides = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    points: list[GridPoint] = []
    parameters: dict[str, int] = {}
    # Within a budget, the first seed of every point before any second seed: an interrupted budget has whole curves.
    order = sorted(itertools.product(grid.sizes, grid.variants), key=lambda pair: pair[1].repeat)
    for budget in grid.budgets:
        for size, variant in order:
            if any(entry.budgets is not None and budget not in entry.budgets for entry in (size, variant)):
                continue
            where = (f"{grid.path}: budget {budget:g}, size {size.name or size.flags}, "
                     f"variant {variant.name or variant.flags}")
            flags = {**grid.common, **size.flags, **variant.flags, **overrides, "flops_budget": budget}
            try:
                config = resolve_run_config(grid.preset, None, flags)
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
            size_text = size_label(size.name, config)
            if variant.sizes is not None and size_text not in variant.sizes:
                continue
            variant_text = variant_label(variant.name, variant.flags, config)
            name = f"{budget_label(budget)}_{size_text}_{variant_text}"
            if variant.seeded:
                name += f"_s{config.train.seed}"
            config.train.out = str(out / RUNS / name)
            per_step = step_flops(config)
            if budget < per_step:
                raise UserError(f"{where}: the budget {budget:g} pays for no training step (one step of "
                                f"{config.train.batch_size * config.train.grad_accum} x {config.model.seq_len} tokens "
                                f"costs {per_step:.3g} FLOPs)")
            shape = json.dumps(config.model.flat(), sort_keys=True)
            if shape not in parameters:
                parameters[shape] = build_model(config.model).num_parameters()
            points.append(GridPoint(name, budget, size_text, variant_text, config, math.ceil(budget / per_step),
                                    per_step, parameters[shape]))
    labels = {size_label(s.name, resolve_run_config(grid.preset, None, {**grid.common, **s.flags, **overrides}))
              for s in grid.sizes}
    for variant in grid.variants:
        unknown = sorted(set(variant.sizes or []) - labels)
        if unknown:
            raise UserError(f"{grid.path}: a [[variant]] names sizes {unknown} that the grid does not have "
                            f"(its sizes: {', '.join(sorted(labels))})")
    names = [p.name for p in points]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserError(f"{grid.path}: two points share the run name {duplicates[0]!r}; give the sizes or variants that "
                        "differ a name")
    for point in points:
        _check_existing_run(point)
    return points


def _check_existing_run(point: GridPoint) -> None:
    """A run folder from an earlier invocation must hold this very point (else resuming would mix two configs)."""

    found = complete_checkpoints(Path(point.config.train.out))
    if not found:
        return
    try:
        saved = json.loads((found[-1] / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{found[-1]}: unreadable config.json ({exc})") from None
    changed = differences(comparable(saved), comparable(point.config.to_dict()))
    if changed:
        raise UserError(f"{point.config.train.out} was trained with another configuration ({', '.join(changed[:3])}); "
                        "the grid changed under an existing sweep: use another --out")


def check_corpora(points: list[GridPoint]) -> None:
    """Load each distinct corpus once (byte-level ones; a tokenizer.json is read when its run starts), so that a
    missing file or a corpus too short for seq_len stops the sweep before anything trains."""

    seen = set()
    for point in points:
        data, seq_len = point.config.data, point.config.model.seq_len
        key = (json.dumps(dataclasses.asdict(data), sort_keys=True), seq_len)
        if key in seen or data.tokenizer != "bytes":
            continue
        seen.add(key)
        try:
            load_corpus(data, seq_len, ByteTokenizer())
        except UserError as exc:
            raise UserError(f"point {point.name}: {exc}") from None


def train_point(point: GridPoint, verbose: bool = False) -> dict[str, Any]:
    """Train (or resume, or skip when its last checkpoint spent the budget) one point; what its run folder says."""

    run_dir = Path(point.config.train.out)
    found = complete_checkpoints(run_dir)
    state = read_state(found[-1]) if found else None
    if state is None or (state["step"] < point.steps and state["flops"] < point.budget):
        config = RunConfig.from_dict(point.config.to_dict())
        config.train.resume = state is not None
        train(config, quiet=not verbose)
        found = complete_checkpoints(run_dir)
        state = read_state(found[-1])
    train_loss = None
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for record in read_metrics_file(metrics)[0]:  # a last line cut short by a kill is dropped
            if record.get("step") == state["step"]:
                train_loss = record.get("loss")
    return {"checkpoint": str(found[-1]), "steps": state["step"], "tokens": state["tokens"],
            "flops": state["flops"], "train_loss": train_loss, "train_wall_s": state["elapsed_s"]}


def evaluate_point(point: GridPoint, settings: EvalSettings) -> dict[str, Any]:
    """Every routing mode of the run on the same validation windows; the first causal mode is the result."""

    tc = point.config.train
    result = evaluate(EvalConfig(checkpoint=tc.out, batches=settings.batches, batch_size=settings.batch_size,
                                 device=tc.device, dtype=tc.dtype))
    losses = {r.routing: {"loss": r.loss, "causal": r.causal, "bits_per_byte": r.bits_per_byte,
                          "processed_fraction": (statistics.fmean(r.processed_fraction.values())
                                                 if r.processed_fraction else 1.0)}
              for r in result.results}
    causal = next(r for r in result.results if r.causal)
    reference = next((r for r in result.results if not r.causal), None)
    return {"causal_mode": causal.routing, "causal_loss": causal.loss, "causal_bits_per_byte": causal.bits_per_byte,
            "reference_mode": reference.routing if reference else None,
            "reference_loss": reference.loss if reference else None,
            "losses": losses, "eval_tokens": result.tokens, "eval_corpus": result.corpus}


def profile_point(point: GridPoint, settings: ProfileSettings) -> dict[str, Any]:
    """Forward and decode latency of the trained run against its dense twin, interleaved call by call (a dense run
    is timed alone: its ratios are 1 by definition)."""

    tc = point.config.train
    dense = point.config.model.dense
    result = profile(ProfileConfig(
        checkpoint=tc.out, compare="none" if dense else "dense", batch_size=settings.batch_size,
        repeats=settings.repeats, warmup=settings.warmup, measure=["forward", "decode"],
        decode_tokens=settings.decode_tokens, device=tc.device, dtype=tc.dtype, memory=False, seed=tc.seed),
        quiet=True)
    at = result.results[0]
    mine, twin = at.model, at.baseline or at.model

    def ratio(name: str) -> tuple[float | None, float | None]:
        if dense:
            return 1.0, 1.0
        r = at.ratio.get(f"{name}_latency")
        return (r.measured, r.ideal) if r else (None, None)

    latency = {"routing": result.routing, "batch_size": settings.batch_size, "seq_len": at.seq_len,
               "repeats": settings.repeats, "device": result.device_name,
               "load_avg": [result.load_avg_start[0] if result.load_avg_start else None,
                            result.load_avg_end[0] if result.load_avg_end else None]}
    for name in ("forward", "prefill", "decode"):
        measured, ideal = ratio(name)
        latency[f"{name}_ms"] = getattr(mine, name).latency_ms
        latency[f"dense_{name}_ms"] = getattr(twin, name).latency_ms
        latency[f"{name}_ratio"] = measured
        latency[f"{name}_ideal_ratio"] = ideal
    return latency


def run_sweep(config: SweepConfig, quiet: bool = False) -> SweepResult:
    """Run (or continue) a sweep as `config` says."""
    started = time.perf_counter()
    out = Path(config.out)

    def log(message: str) -> None:
        if not quiet:
            stderr_console.print(message, highlight=False, soft_wrap=True)

    grid = load_grid(config.grid)
    points = plan(grid, out, config.device, config.dtype)
    check_corpora(points)
    if config.dry_run:
        runs = [planned_record(point) for point in points]
        return SweepResult(str(out), grid.path, len(points), [], [], runs, {}, {}, time.perf_counter() - started,
                           dry_run=True)

    lock = OutLock(out, "sweep", kind="sweep folder", shared=True, in_place=True)
    for note in lock.acquire():
        log(note)
    try:
        return _sweep(config, grid, points, out, log, started)
    finally:
        lock.release()


SWEEP_FILES = ("grid.toml", RESULTS, RUNS, LOCKS)
"""What marks a folder as a sweep's."""


def check_sweep_folder(out: Path, grid_path: Path, report_only: bool) -> None:
    """--out (locked) is a new or empty folder, or a sweep of this grid; anything else is a UserError."""
    try:
        names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    except OSError as exc:
        raise UserError(f"--out {out}: cannot read it: {exc.strerror or exc}") from None
    if names and not any(name in SWEEP_FILES for name in names):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UserError(f"--out {out} is a non-empty folder that is not a sweep's (it holds {shown}, no grid.toml or "
                        f"{RESULTS}); pick another --out or an empty folder")
    saved = out / "grid.toml"
    if report_only or not saved.exists() or saved.resolve() == grid_path.resolve():
        return
    try:
        same = tomllib.loads(saved.read_text()) == tomllib.loads(grid_path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        same = False
    if not same:
        raise UserError(f"--out {out} holds a sweep of another grid ({saved} differs from {grid_path}): pick another "
                        f"--out, or copy {grid_path} over {saved} to extend that sweep with it")


def _sweep(config: SweepConfig, grid: Grid, points: list[GridPoint], out: Path, log, started: float) -> SweepResult:
    check_sweep_folder(out, Path(config.grid), config.report_only)
    damaged: list[str] = []
    results = read_results(out, damaged)
    for note in damaged:  # a hand-edited or damaged results.jsonl line: skipped, its point run again
        log(note)
    if config.report_only:
        if not results:
            raise UserError(f"{out / RESULTS} holds no run yet: nothing to report")
        todo: list[GridPoint] = []
    else:
        try:
            (out / LOCKS).mkdir(parents=True, exist_ok=True)
            if not (out / "grid.toml").exists():
                atomic.write_file(out / "grid.toml", [Path(config.grid).read_bytes()])
        except OSError as exc:  # a read-only place is the user's to change; a full disk is not
            error = UserError if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else WriteFailed
            raise error(f"--out {out}: cannot write {exc.filename or out}: {exc.strerror or exc}") from None
        todo = [p for p in points if not is_done(results.get(p.name), p, config.profile)]
    skipped = [p.name for p in points if is_done(results.get(p.name), p, config.profile)]
    log(f"sweep of {len(points)} runs ({len(grid.budgets)} budgets x {len(grid.sizes)} sizes x {len(grid.variants)} "
        f"variants, restrictions applied) in {out}: {len(skipped)} already done, {len(todo)} to do")
    trained: list[str] = []
    elsewhere: list[str] = []
    eta = ETA(todo)
    already = len(skipped)
    for done, point in enumerate(todo):
        claim = FileLock(out / LOCKS / f"{point.name}.lock")
        try:
            claim.acquire(timeout=0)
        except Timeout:  # another `modcli sweep` on this folder is running this point right now
            elsewhere.append(point.name)
            eta.finished(point, 0.0, 0.0)
            log(f"[{already + done + 1}/{len(points)}] {point.name}: another sweep process is running it; passed")
            continue
        try:
            record = read_results(out).get(point.name)
            if is_done(record, point, config.profile):  # finished by another process since this one started
                skipped.append(point.name)
                eta.finished(point, 0.0, 0.0)
                continue
            log(f"[{already + done + 1}/{len(points)}] {point.name}: {point.parameters:,} parameters, budget "
                f"{point.budget:.3g} FLOPs = {point.steps} steps{eta.text()}")
            record, train_s = _run_point(point, record, grid, config, trained)
            update_results(out, record)
        finally:
            claim.release()
        eta.finished(point, train_s, record.get("flops", 0.0))
        log(f"    {one_line(record)}")

    results = read_results(out)
    runs = [results.get(p.name) or planned_record(p) for p in points]
    best = best_per_budget(runs)
    analysis = isoflop_analysis(runs)
    plots: dict[str, str] = {}
    if config.plots:

        if analysis:
            plots["isoflop"] = isoflop_plot(analysis, out / "isoflop.png")
        if any(r.get("latency") for r in runs):
            plots["frontier"] = frontier_plot(runs, out / "frontier.png")
        log(f"wrote {', '.join(plots.values())}")
    return SweepResult(str(out), grid.path, len(points), trained, skipped, runs, best, plots,
                       time.perf_counter() - started, analysis=analysis, elsewhere=elsewhere,
                       report_only=config.report_only)


def _run_point(point: GridPoint, record: dict[str, Any] | None, grid: Grid, config: SweepConfig,
               trained: list[str]) -> tuple[dict[str, Any], float]:
    """Train (or resume), evaluate and profile one point as far as its record lacks; (its record, training s)."""
    train_s = 0.0
    if record is None or comparable(record.get("config", {})) != comparable(point.config.to_dict()):
        point_started = time.perf_counter()
        if _needs_training(point):
            trained.append(point.name)
        try:
            record = {**planned_record(point), **train_point(point, config.verbose)}
        except TrainingDiverged as exc:  # a result of the grid (e.g. a learning rate too high for a size)
            record = {**planned_record(point), "diverged": str(exc), "causal_loss": None, "latency": None}
        train_s = time.perf_counter() - point_started
        if not record.get("diverged"):
            record.update(evaluate_point(point, grid.eval))
            record["eval_wall_s"] = time.perf_counter() - point_started - train_s
            record["latency"] = None
    if config.profile and record.get("latency") is None and not record.get("diverged"):
        record["latency"] = profile_point(point, grid.profile)
    return record, train_s


def _needs_training(point: GridPoint) -> bool:

    found = complete_checkpoints(Path(point.config.train.out))
    if not found:
        return True
    state = read_state(found[-1])
    return state["step"] < point.steps and state["flops"] < point.budget
