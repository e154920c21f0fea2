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
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import statistics
import time
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from modcli.checkpoint.store import complete_checkpoints, read_state
from modcli.config import DataConfig, ModelConfig, RunConfig, TrainConfig, require, resolve_run_config
from modcli.data.corpus import load_corpus
from modcli.data.tokenizer import ByteTokenizer
from modcli.errors import TrainingDiverged, UserError
from modcli.evaluation.perplexity import EvalConfig, evaluate
from modcli.models.build import build_model
from modcli.profiling.profile import ProfileConfig, profile
from modcli.reports.console import stderr_console
from modcli.reports.plots import frontier_plot, isoflop_plot
from modcli.training.loop import step_flops, train

GRID_KEYS = ("preset", "budgets", "common", "size", "variant", "eval", "profile")
SWEEP_SETS = ("out", "resume", "flops_budget", "max_steps", "init_from")
"""Flags the sweep sets per point (the run folder and the budget); a grid may not set them."""
FLAG_KEYS = frozenset({f.name for cls in (ModelConfig, DataConfig, TrainConfig) for f in fields(cls)} | {"dense"})
IGNORED_WHEN_COMPARING = ("out", "resume", "device", "log_every", "keep")
"""Train fields that do not change what a run computes: a run folder made with other values is still this point."""
RESULTS = "results.jsonl"
RUNS = "runs"


@dataclass
class EvalSettings:
    """The evaluation after training ([eval] in the grid)."""

    batches: int = 16
    """Validation batches (the same windows for every run of one sequence length)."""
    batch_size: int = 8
    """Sequences per batch."""

    def __post_init__(self) -> None:
        require(self.batches >= 1, f"[eval] batches must be >= 1, got {self.batches}")
        require(self.batch_size >= 1, f"[eval] batch_size must be >= 1, got {self.batch_size}")


@dataclass
class ProfileSettings:
    """The latency measurement of `--profile` ([profile] in the grid)."""

    batch_size: int = 8
    """Sequences per timed call."""
    repeats: int = 5
    """Timed calls per model (median); the run and its dense twin alternate call by call."""
    warmup: int = 1
    """Untimed calls per model first."""
    decode_tokens: int = 16
    """Decode steps timed after the causal prefill of seq_len tokens."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "repeats", "decode_tokens"):
            require(getattr(self, name) >= 1, f"[profile] {name} must be >= 1, got {getattr(self, name)}")
        require(self.warmup >= 0, f"[profile] warmup must be >= 0, got {self.warmup}")


@dataclass
class Grid:
    """A parsed grid file (see the module docstring)."""

    path: str
    preset: str | None
    budgets: list[float]
    common: dict[str, Any]
    sizes: list[tuple[str | None, dict[str, Any]]]
    """(name or None, flags) per [[size]]."""
    variants: list[tuple[str | None, dict[str, Any]]]
    """(name or None, flags) per variant after expanding list values."""
    eval: EvalSettings
    profile: ProfileSettings


@dataclass
class GridPoint:
    """One run of the sweep: a budget, a size and a variant, resolved into a validated RunConfig."""

    name: str
    budget: float
    size: str
    variant: str
    config: RunConfig
    steps: int
    """Optimiser steps the budget pays for (the last one may overshoot it, as in `modcli train --flops-budget`)."""
    step_flops: int
    parameters: int


@dataclass
class SweepConfig:
    """What `modcli sweep` does."""

    grid: str
    """The grid TOML file."""
    out: str
    """Sweep folder: runs/, results.jsonl, isoflop.png, frontier.png."""
    profile: bool = False
    """Measure each run's forward and decode latency against its dense twin."""
    device: str | None = None
    """Overrides the grid's device for every run, the evaluation and the profile."""
    dtype: str | None = None
    """Overrides the grid's autocast dtype."""
    dry_run: bool = False
    """Validate and list the points; train nothing."""
    verbose: bool = False
    """Show each run's training progress lines."""
    plots: bool = True
    """Write isoflop.png and frontier.png at the end."""


@dataclass
class SweepResult:
    out: str
    grid: str
    points: int
    trained: list[str]
    """Runs trained (or resumed) by this invocation."""
    skipped: list[str]
    """Runs already complete in results.jsonl."""
    runs: list[dict[str, Any]]
    """The results.jsonl object of every point of the grid, in grid order (planned points only with --dry-run)."""
    best: dict[str, dict[str, Any]]
    """Per budget: the best run overall, the best dense and the best MoD run, by causal validation loss."""
    plots: dict[str, str]
    wall_time_s: float
    dry_run: bool = False


# --- the grid -------------------------------------------------------------------------------------------------


def load_grid(path: str | Path) -> Grid:
    """Read and check the shape of a grid file (keys and types; the points are checked by `plan`)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such grid file: {p}")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{p} is not valid TOML: {exc}") from None
    unknown = sorted(set(raw) - set(GRID_KEYS))
    if unknown:
        raise UserError(f"{p}: unknown key(s) {', '.join(map(repr, unknown))}; a grid has {', '.join(GRID_KEYS)} "
                        "(flags for every run go under [common])")
    preset = raw.get("preset", "tiny")
    require(preset is None or isinstance(preset, str), f"{p}: preset must be a preset name, got {preset!r}")
    budgets = raw.get("budgets")
    require(isinstance(budgets, list) and len(budgets) > 0,
            f"{p}: budgets must be a non-empty list of training-FLOP budgets, e.g. budgets = [1e12, 2e12]")
    for budget in budgets:
        require(isinstance(budget, (int, float)) and not isinstance(budget, bool) and budget > 0,
                f"{p}: every budget must be a positive number of training FLOPs, got {budget!r}")
    require(len(set(budgets)) == len(budgets), f"{p}: budgets repeat a value: {budgets}")
    common = _flags(raw.get("common", {}), f"{p}: [common]")
    sizes = [_named(entry, f"{p}: [[size]] {i + 1}") for i, entry in enumerate(_tables(raw.get("size", [{}]), p, "size"))]
    variants = []
    for i, entry in enumerate(_tables(raw.get("variant", [{}]), p, "variant")):
        name, flags = _named(entry, f"{p}: [[variant]] {i + 1}")
        expanded = _expand(flags)
        if name is not None and len(expanded) > 1:
            raise UserError(f"{p}: [[variant]] {i + 1} ({name!r}) expands into {len(expanded)} variants (a list value); "
                            "drop its name so that each gets its own")
        variants.extend((name, one) for one in expanded)
    return Grid(str(p), preset, [float(b) for b in budgets], common, sizes, variants,
                _settings(EvalSettings, raw.get("eval", {}), f"{p}: [eval]"),
                _settings(ProfileSettings, raw.get("profile", {}), f"{p}: [profile]"))


def _tables(value: Any, path: Path, key: str) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        value = [value]
    require(isinstance(value, list) and all(isinstance(v, dict) for v in value) and len(value) > 0,
            f"{path}: {key} must be tables ([[{key}]]), got {value!r}")
    return value


def _flags(table: Any, where: str) -> dict[str, Any]:
    require(isinstance(table, dict), f"{where} must be a table of flags")
    flags = {key.replace("-", "_"): value for key, value in table.items()}
    for key in flags:
        if key in SWEEP_SETS:
            raise UserError(f"{where}: {key!r} is set by the sweep per point (budgets and run folders); remove it")
        if key not in FLAG_KEYS:
            raise UserError(f"{where}: unknown key {key!r} (keys are the flags of `modcli train`, e.g. d_model, "
                            "router, capacity, lr)")
    return flags


def _named(entry: dict[str, Any], where: str) -> tuple[str | None, dict[str, Any]]:
    entry = dict(entry)
    name = entry.pop("name", None)
    require(name is None or (isinstance(name, str) and name and "/" not in name and name.strip() == name),
            f"{where}: name must be a non-empty string without '/', got {name!r}")
    return name, _flags(entry, where)


def _expand(flags: dict[str, Any]) -> list[dict[str, Any]]:
    """A list value lists alternatives (capacity = [0.125, 0.25]); route_layers' own value is a list of ints, so
    only a list of lists expands it."""
    options = []
    for key, value in flags.items():
        listed = isinstance(value, list) and (key != "route_layers" or all(isinstance(v, list) for v in value))
        if listed:
            require(len(value) > 0, f"{key} = [] lists no alternative")
        options.append([(key, v) for v in value] if listed else [(key, value)])
    return [dict(combination) for combination in itertools.product(*options)]


def _settings(cls: type, table: Any, where: str) -> Any:
    require(isinstance(table, dict), f"{where} must be a table")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; it takes {', '.join(sorted(names))}")
    return cls(**table)


# --- the points -------------------------------------------------------------------------------------------------


def budget_label(budget: float) -> str:
    """1.5e12 -> "1.5e12" (run folder names)."""
    mantissa, exponent = f"{budget:.3e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _size_name(name: str | None, config: RunConfig) -> str:
    return name or f"d{config.model.d_model}-L{config.model.n_layers}"


SHORT = {"capacity": "c", "route_every": "every", "route_offset": "offset", "route_part": "part", "threshold": "p"}


def _variant_name(name: str | None, flags: dict[str, Any], config: RunConfig) -> str:
    if name:
        return name
    parts = ["dense" if config.model.dense else config.model.router]
    for key, value in flags.items():
        if key in ("router", "dense"):
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) \
            else str(value)
        parts.append(f"{SHORT.get(key, key)}{text}")
    return "-".join(parts)


def plan(grid: Grid, out: Path, device: str | None = None, dtype: str | None = None) -> list[GridPoint]:
    """Every budget x size x variant as a validated point; a UserError names the first impossible one."""

    overrides = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    points: list[GridPoint] = []
    parameters: dict[str, int] = {}
    for budget in grid.budgets:
        for (size_name, size), (variant_name, variant) in itertools.product(grid.sizes, grid.variants):
            where = f"{grid.path}: budget {budget:g}, size {size_name or size}, variant {variant_name or variant}"
            flags = {**grid.common, **size, **variant, **overrides, "flops_budget": budget}
            try:
                config = resolve_run_config(grid.preset, None, flags)
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
            name = f"{budget_label(budget)}_{_size_name(size_name, config)}_{_variant_name(variant_name, variant, config)}"
            config.train.out = str(out / RUNS / name)
            per_step = step_flops(config)
            if budget < per_step:
                raise UserError(f"{where}: the budget {budget:g} pays for no training step (one step of "
                                f"{config.train.batch_size * config.train.grad_accum} x {config.model.seq_len} tokens "
                                f"costs {per_step:.3g} FLOPs)")
            shape = json.dumps(dataclasses.asdict(config.model), sort_keys=True)
            if shape not in parameters:
                parameters[shape] = build_model(config.model).num_parameters()
            points.append(GridPoint(name, budget, _size_name(size_name, config),
                                    _variant_name(variant_name, variant, config), config,
                                    math.ceil(budget / per_step), per_step, parameters[shape]))
    names = [p.name for p in points]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UserError(f"{grid.path}: two points share the run name {duplicates[0]!r}; give the sizes or variants that "
                        "differ a name")
    for point in points:
        _check_existing_run(point)
    return points


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A run config as a dict without the fields that do not change what the run computes. A config saved before a
    field existed gets that field's default (as loading its checkpoint does), so a newer modcli still resumes it."""
    try:
        config = RunConfig.from_dict(config).to_dict()
    except (UserError, TypeError):
        config = json.loads(json.dumps(config))
    for key in IGNORED_WHEN_COMPARING:
        config.get("train", {}).pop(key, None)
    return config


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"--{key.replace('_', '-')} {old[section].get(key)!r} -> {new[section].get(key)!r}"
            for section in new for key in sorted(set(old.get(section, {})) | set(new[section]))
            if old.get(section, {}).get(key) != new[section].get(key)]


def _check_existing_run(point: GridPoint) -> None:
    """A run folder from an earlier invocation must hold this very point (else resuming would mix two configs)."""

    found = complete_checkpoints(Path(point.config.train.out))
    if not found:
        return
    try:
        saved = json.loads((found[-1] / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{found[-1]}: unreadable config.json ({exc})") from None
    changed = _differences(comparable(saved), comparable(point.config.to_dict()))
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


# --- results.jsonl ----------------------------------------------------------------------------------------------


def read_results(out: Path) -> dict[str, dict[str, Any]]:
    """results.jsonl as name -> object; a line cut short by an interruption is dropped (its run is redone)."""
    path = out / RESULTS
    results: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return results
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "name" in record:
            results[record["name"]] = record
    return results


def write_results(out: Path, results: dict[str, dict[str, Any]]) -> None:
    """Rewrite results.jsonl atomically (one object per line)."""
    path = out / RESULTS
    tmp = out / f".{RESULTS}.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(record) + "\n" for record in results.values()))
    os.replace(tmp, path)


def _is_done(record: dict[str, Any] | None, point: GridPoint, profile: bool) -> bool:
    if record is None or comparable(record.get("config", {})) != comparable(point.config.to_dict()):
        return False
    return not profile or record.get("latency") is not None or bool(record.get("diverged"))


# --- one point --------------------------------------------------------------------------------------------------


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
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
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


# --- the sweep --------------------------------------------------------------------------------------------------


def sweep(config: SweepConfig, quiet: bool = False) -> SweepResult:
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

    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.toml").write_text(Path(config.grid).read_text())
    results = read_results(out)
    todo = [p for p in points if not _is_done(results.get(p.name), p, config.profile)]
    skipped = [p.name for p in points if p not in todo]
    log(f"sweep of {len(points)} runs ({len(grid.budgets)} budgets x {len(grid.sizes)} sizes x {len(grid.variants)} "
        f"variants) in {out}: {len(skipped)} already done, {len(todo)} to do")
    trained: list[str] = []
    eta = ETA(todo)
    for done, point in enumerate(todo):
        log(f"[{len(skipped) + done + 1}/{len(points)}] {point.name}: {point.parameters:,} parameters, budget "
            f"{point.budget:.3g} FLOPs = {point.steps} steps{eta.text()}")
        record = results.get(point.name)
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
        results[point.name] = record
        write_results(out, results)
        eta.finished(point, train_s, record.get("flops", 0.0))
        log(f"    {_one_line(record)}")

    runs = [results[p.name] for p in points]
    best = best_per_budget(runs)
    plots: dict[str, str] = {}
    if config.plots:

        plots["isoflop"] = isoflop_plot(runs, best, out / "isoflop.png")
        if any(r.get("latency") for r in runs):
            plots["frontier"] = frontier_plot(runs, out / "frontier.png")
        log(f"wrote {', '.join(plots.values())}")
    return SweepResult(str(out), grid.path, len(points), trained, skipped, runs, best, plots,
                       time.perf_counter() - started)


def _needs_training(point: GridPoint) -> bool:

    found = complete_checkpoints(Path(point.config.train.out))
    if not found:
        return True
    state = read_state(found[-1])
    return state["step"] < point.steps and state["flops"] < point.budget


def planned_record(point: GridPoint) -> dict[str, Any]:
    mc = point.config.model
    return {"name": point.name, "budget": point.budget, "size": point.size, "variant": point.variant,
            "run_dir": point.config.train.out, "dense": mc.dense, "router": None if mc.dense else mc.router,
            "capacity": None if mc.dense else mc.capacity, "d_model": mc.d_model, "n_layers": mc.n_layers,
            "seq_len": mc.seq_len, "parameters": point.parameters, "planned_steps": point.steps,
            "step_flops": point.step_flops, "config": point.config.to_dict()}


def _one_line(record: dict[str, Any]) -> str:
    if record.get("diverged"):
        return record["diverged"]
    text = (f"{record['steps']} steps, {record['flops']:.3g} FLOPs, causal val loss {record['causal_loss']:.4f} "
            f"({record['causal_mode']})")
    if record.get("reference_loss") is not None:
        text += f", {record['reference_mode']} {record['reference_loss']:.4f} (non-causal)"
    latency = record.get("latency")
    if latency and not record["dense"]:
        text += f", forward {latency['forward_ratio']:.2f} / decode {latency['decode_ratio']:.2f} x dense"
    return text


class ETA:
    """Time left: training seconds per FLOP so far x FLOPs left, plus the mean evaluation/profile time per run."""

    def __init__(self, todo: list[GridPoint]) -> None:
        self.flops_left = sum(p.budget for p in todo)
        self.runs_left = len(todo)
        self.train_s = self.train_flops = 0.0
        self.other_s: list[float] = []
        self.started = time.perf_counter()

    def finished(self, point: GridPoint, train_s: float, flops: float) -> None:
        """`train_s`: this invocation's training time of the point (0 when it was trained before)."""
        self.flops_left -= point.budget
        self.runs_left -= 1
        elapsed = time.perf_counter() - self.started
        self.started = time.perf_counter()
        if train_s > 0 and flops > 0:
            self.train_s += train_s
            self.train_flops += flops
        self.other_s.append(elapsed - train_s)

    def text(self) -> str:
        if not self.train_flops:
            return ""
        seconds = self.flops_left * self.train_s / self.train_flops + self.runs_left * statistics.fmean(self.other_s)
        return f", ETA {seconds / 60:.0f} min" if seconds >= 90 else f", ETA {seconds:.0f} s"


def best_per_budget(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per budget: the lowest causal validation loss overall, among dense runs and among MoD runs."""
    best: dict[str, dict[str, Any]] = {}
    for budget in sorted({r["budget"] for r in runs}):
        at = [r for r in runs if r["budget"] == budget and r.get("causal_loss") is not None]
        if not at:
            continue
        entry: dict[str, Any] = {"budget": budget}
        for key, chosen in (("overall", at), ("dense", [r for r in at if r["dense"]]),
                            ("mod", [r for r in at if not r["dense"]])):
            if chosen:
                top = min(chosen, key=lambda r: r["causal_loss"])
                entry[key] = {"name": top["name"], "causal_loss": top["causal_loss"], "parameters": top["parameters"]}
        if "dense" in entry and "mod" in entry:
            entry["mod_minus_dense"] = entry["mod"]["causal_loss"] - entry["dense"]["causal_loss"]
        best[budget_label(budget)] = entry
    return best


def summary_rows(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The summary table: one row per run, the best causal loss of each budget marked with *."""
    winners = {entry["overall"]["name"] for entry in best.values() if "overall" in entry}
    rows = []
    for r in runs:
        latency = r.get("latency") or {}
        reference = f"{r['reference_mode']} {r['reference_loss']:.4f}" if r.get("reference_loss") is not None else "-"
        rows.append({
            "budget": budget_label(r["budget"]), "size": r["size"], "variant": r["variant"],
            "parameters": f"{r['parameters']:,}", "steps": str(r.get("steps", r.get("planned_steps"))),
            "causal val loss": (f"{r['causal_loss']:.4f}{' *' if r['name'] in winners else ''} ({r['causal_mode']})"
                                if r.get("causal_loss") is not None else "diverged" if r.get("diverged") else "-"),
            "non-causal": reference,
            "forward / dense": _ratio_text(latency.get("forward_ratio"), r["dense"]),
            "decode / dense": _ratio_text(latency.get("decode_ratio"), r["dense"]),
            "train s": f"{r['train_wall_s']:.0f}" if r.get("train_wall_s") is not None else "-",
        })
    return rows


def _ratio_text(value: float | None, dense: bool) -> str:
    if value is None:
        return "-"
    return "1" if dense else f"{value:.3f}"


def as_json(result: SweepResult) -> dict[str, Any]:
    return dataclasses.asdict(result)

