"""The sweep's grid and results, without training anything (PyTorch-free): the grid file, its points' configs and
settings, results.jsonl, and the summary `modcli sweep` prints. modcli.sweep.runner runs the points."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from filelock import FileLock

from modcli.config import (
    RunConfig,
    check_field_types,
    check_flag_types,
    describe_type,
    flag_types,
    require,
    value_fits,
)
from modcli.errors import UserError

GRID_KEYS = ("preset", "budgets", "common", "size", "variant", "eval", "profile")
RESTRICTIONS = ("budgets", "sizes")
"""Keys of a [[size]] or [[variant]] table that are not flags: the budgets (and, for a variant, the size labels) it
runs at, a subset of the grid's; absent, it runs at all of them."""
SWEEP_SETS = ("out", "resume", "flops_budget", "max_steps", "init_from")
"""Flags the sweep sets per point (the run folder and the budget); a grid may not set them."""
IGNORED_WHEN_COMPARING = ("out", "resume", "device", "log_every", "keep")
"""Train fields that do not change what a run computes: a run folder made with other values is still this point."""
EXPERT_TRAIN_FIELDS = ("expert_aux_weight", "expert_capacity_warmup", "expert_aux_sum", "expert_gate_lr_scale")
"""Train fields that act on MoE MLPs only: a model without experts computes the same whatever they hold (their
defaults changed; a sweep made before still continues)."""
RESULTS = "results.jsonl"
RUNS = "runs"
LOCKS = ".locks"
"""Per point a lock file, held by the `modcli sweep` process running it (the OS releases it if that one dies)."""


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
class Entry:
    """One [[size]] or one variant (after expanding list values) of a grid."""

    name: str | None
    flags: dict[str, Any]
    budgets: list[float] | None = None
    """Runs only at these budgets (None: at every budget of the grid)."""
    sizes: list[str] | None = None
    """A variant: runs only at these size labels (None: at every size)."""
    seeded: bool = False
    """Its seed came from a list (`seed = [1, 2]`): the run name ends in `_s<seed>` and the seeds of one
    budget x size x variant are repeats of one point."""
    repeat: int = 0
    """Its seed's place in that list (0: the first seed); within a budget, repeat 0 of every point trains first."""


@dataclass
class Grid:
    """A parsed grid file (see the module docstring)."""

    path: str
    preset: str | None
    budgets: list[float]
    common: dict[str, Any]
    sizes: list[Entry]
    """One per [[size]]."""
    variants: list[Entry]
    """One per variant after expanding list values (seed lists included)."""
    eval: EvalSettings
    profile: ProfileSettings


@dataclass
class GridPoint:
    """One run of the sweep: a budget, a size and a variant, resolved into a validated RunConfig."""

    name: str
    budget: float
    size: str
    variant: str
    """The variant's label without its seed: the seeds of one budget x size x variant are repeats of one point."""
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
    report_only: bool = False
    """Train nothing: summarise, analyse and plot what the folder's results.jsonl holds (a sweep still running in
    another process, or stopped part-way); unfinished points are listed without a loss."""
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
    analysis: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The isoFLOP analysis (`modcli.sweep.analysis.isoflop_analysis`): per budget, each curve's minimum, fit and
    seed spread."""
    elsewhere: list[str] = dataclasses.field(default_factory=list)
    """Runs another sweep process on the same folder held while this one passed them (not in `runs`' results)."""
    report_only: bool = False


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
    common_table = dict(raw.get("common", {})) if isinstance(raw.get("common", {}), dict) else raw.get("common")
    common_seeds = common_table.pop("seed") if isinstance(common_table, dict) and isinstance(
        common_table.get("seed"), list) else None
    common = _flags(common_table, f"{p}: [common]")
    if common_seeds is not None:
        _check_seeds(common_seeds, f"{p}: [common]")
    grid_budgets = [float(b) for b in budgets]
    sizes = []
    for i, table in enumerate(_tables(raw.get("size", [{}]), p, "size")):
        where = f"{p}: [[size]] {i + 1}"
        name, flags, only_budgets, only_sizes = _named(table, where, grid_budgets)
        require(only_sizes is None, f"{where}: 'sizes' belongs in a [[variant]] (the sizes it runs at)")
        require("seed" not in flags, f"{where}: seed belongs in [common] or a [[variant]]")
        sizes.append(Entry(name, flags, only_budgets))
    variants = []
    for i, table in enumerate(_tables(raw.get("variant", [{}]), p, "variant")):
        where = f"{p}: [[variant]] {i + 1}"
        name, flags, only_budgets, only_sizes = _named(table, where, grid_budgets, alternatives=True)
        if "seed" not in flags and common_seeds is not None:
            flags["seed"] = common_seeds
        seeded = isinstance(flags.get("seed"), list)
        expanded = _expand(flags)
        if name is not None and len(expanded) > len(flags["seed"] if seeded else [None]):
            raise UserError(f"{p}: [[variant]] {i + 1} ({name!r}) expands into {len(expanded)} variants (a list value); "
                            "drop its name so that each gets its own")
        variants.extend(Entry(name, one, only_budgets, only_sizes, seeded,
                              flags["seed"].index(one["seed"]) if seeded else 0) for one in expanded)
    return Grid(str(p), preset, grid_budgets, common, sizes, variants,
                _settings(EvalSettings, raw.get("eval", {}), f"{p}: [eval]"),
                _settings(ProfileSettings, raw.get("profile", {}), f"{p}: [profile]"))


def _tables(value: Any, path: Path, key: str) -> list[dict[str, Any]]:
    if isinstance(value, dict):
        value = [value]
    require(isinstance(value, list) and all(isinstance(v, dict) for v in value) and len(value) > 0,
            f"{path}: {key} must be tables ([[{key}]]), got {value!r}")
    return value


def _flags(table: Any, where: str, alternatives: bool = False) -> dict[str, Any]:
    """A table of flags, each a flag of `modcli train` with that flag's type (`modcli.config.check_flag_types`, as a
    --config file's); with `alternatives` (a [[variant]]) a list of such values lists alternatives."""
    require(isinstance(table, dict), f"{where} must be a table of flags")
    flags = {key.replace("-", "_"): value for key, value in table.items()}
    for key in flags:
        if key in SWEEP_SETS:
            raise UserError(f"{where}: {key!r} is set by the sweep per point (budgets and run folders); remove it")
        if key not in flag_types() or key == "preset":  # a run's fields (a variant's options among them), dense
            raise UserError(f"{where}: unknown key {key!r} (keys are the flags of `modcli train`, e.g. d_model, "
                            "router, capacity, lr)")
    check_flag_types(flags, lambda name: f"{where}: {name}", alternatives)
    return flags


def _named(entry: dict[str, Any], where: str, grid_budgets: list[float], alternatives: bool = False
           ) -> tuple[str | None, dict[str, Any], list[float] | None, list[str] | None]:
    """A [[size]] or [[variant]] table -> (name, flags, its budgets or None, its size labels or None)."""
    entry = dict(entry)
    name = entry.pop("name", None)
    require(name is None or (isinstance(name, str) and name and "/" not in name and name.strip() == name),
            f"{where}: name must be a non-empty string without '/', got {name!r}")
    only_budgets = entry.pop("budgets", None)
    if only_budgets is not None:
        require(isinstance(only_budgets, list) and len(only_budgets) > 0 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in only_budgets),
            f"{where}: budgets must be a non-empty list of the grid's budgets, got {only_budgets!r}")
        missing = [b for b in only_budgets if float(b) not in grid_budgets]
        require(not missing, f"{where}: budgets [{', '.join(map(budget_label, missing))}] are not among the grid's "
                f"budgets [{', '.join(map(budget_label, grid_budgets))}]")
        only_budgets = [float(b) for b in only_budgets]
    only_sizes = entry.pop("sizes", None)
    if only_sizes is not None:
        require(isinstance(only_sizes, list) and len(only_sizes) > 0 and all(isinstance(n, str) for n in only_sizes),
                f"{where}: sizes must be a non-empty list of size labels (e.g. \"d32-L4\" or a size's name), "
                f"got {only_sizes!r}")
    flags = _flags(entry, where, alternatives)
    if isinstance(flags.get("seed"), list):
        _check_seeds(flags["seed"], where)
    return name, flags, only_budgets, only_sizes


def _check_seeds(seeds: list[Any], where: str) -> None:
    require(len(seeds) > 0 and all(isinstance(v, int) and not isinstance(v, bool) for v in seeds)
            and len(set(seeds)) == len(seeds),
            f"{where}: seed must be an integer or a list of distinct integers, got {seeds!r}")


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
    check_field_types(cls, table, lambda name: f"{where} {name}")  # "batches = 2.5" or "four": one line, at load
    return cls(**table)


def budget_label(budget: float) -> str:
    """1.5e12 -> "1.5e12" (run folder names)."""
    mantissa, exponent = f"{budget:.3e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def size_label(name: str | None, config: RunConfig) -> str:
    return name or f"d{config.model.d_model}-L{config.model.n_layers}"


SHORT = {"capacity": "c", "route_every": "every", "route_offset": "offset", "route_part": "part", "threshold": "p"}


def variant_label(name: str | None, flags: dict[str, Any], config: RunConfig) -> str:
    """The variant's name, or its router (or dense) and its other flags; never its seed."""
    if name:
        return name
    parts = ["dense" if config.model.dense else config.model.router]
    for key, value in flags.items():
        if key in ("router", "dense", "seed"):
            continue
        text = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) \
            else str(value)
        parts.append(f"{SHORT.get(key, key)}{text}")
    return "-".join(parts)


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A run config as a dict without the fields that do not change what the run computes (and the MoE training
    fields of a model without experts). A config saved before a field existed reads it as loading its checkpoint
    does (`RunConfig.read_saved`), so a newer modcli still resumes it, and a default changed since does not make a
    run trained with the old one pass for a new point."""
    if not isinstance(config, dict):  # a damaged config.json: like no run config at all
        return {}
    try:
        config = RunConfig.read_saved(config).to_dict()
    except (UserError, TypeError, ValueError, AttributeError):
        config = json.loads(json.dumps(config))
    train = config.get("train", {}) if isinstance(config.get("train"), dict) else {}
    for key in IGNORED_WHEN_COMPARING:
        train.pop(key, None)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    if not model.get("experts"):
        for key in EXPERT_TRAIN_FIELDS:
            train.pop(key, None)
    return config


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"--{key.replace('_', '-')} {old[section].get(key)!r} -> {new[section].get(key)!r}"
            for section in new for key in sorted(set(old.get(section, {})) | set(new[section]))
            if old.get(section, {}).get(key) != new[section].get(key)]


RECORD_TYPES: dict[str, Any] = {
    "name": str, "budget": float, "size": str, "variant": str, "dense": bool, "parameters": int, "step_flops": float,
    "config": dict, "seed": int | None, "planned_steps": int, "steps": int, "flops": float, "train_loss": float | None,
    "train_wall_s": float | None, "causal_loss": float | None, "causal_mode": str, "reference_loss": float | None,
    "reference_mode": str | None, "diverged": str | bool | None, "latency": dict | None, "losses": dict,
}
"""The keys of a results.jsonl record that the summary, the analysis and the plots read, and their types."""
RECORD_REQUIRED = ("name", "budget", "size", "variant", "dense", "parameters", "step_flops", "config")
"""Keys of every record (`planned_record`); a finished one (a causal loss) also has FINISHED_REQUIRED."""
FINISHED_REQUIRED = ("steps", "flops", "causal_mode")
LATENCY_TYPES: dict[str, Any] = {f"{prefix}{quantity}_{unit}": float | None for quantity in ("forward", "prefill", "decode")
                                 for prefix, unit in (("", "ms"), ("dense_", "ms"), ("", "ratio"), ("", "ideal_ratio"))}


def record_problem(record: Any) -> str | None:
    """What is wrong with a results.jsonl record (hand-edited or damaged), in words; None when it can be used."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    missing = [key for key in RECORD_REQUIRED if key not in record]
    if record.get("causal_loss") is not None:
        missing += [key for key in FINISHED_REQUIRED if key not in record]
    if missing:
        return f"no {', '.join(missing)}"
    for types_, values, prefix in ((RECORD_TYPES, record, ""), (LATENCY_TYPES, record.get("latency") or {}, "latency.")):
        for key, hint in types_.items():
            if key in values and not value_fits(values[key], hint):
                return f"{prefix}{key} must be {describe_type(hint)}, got {values[key]!r}"
    for key in ("budget", "parameters", "step_flops"):  # the analysis divides by them and takes their logarithms
        if record[key] <= 0:
            return f"{key} must be positive, got {record[key]!r}"
    return None


def read_results(out: Path, notes: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """results.jsonl as name -> object. A line that is no usable record (cut short by an interruption, not UTF-8 or
    JSON, hand-edited into other types: `record_problem`) is skipped, its point run again (or, with --report-only,
    listed unfinished); each such line adds a note naming the file and line to `notes`."""
    path = out / RESULTS
    results: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return results
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            problem = "not a JSON object (cut short, or not text)"
        else:
            problem = record_problem(record)
        if problem is not None:
            if notes is not None:
                notes.append(f"note: {path} line {number} skipped: {problem}")
            continue
        results[record["name"]] = record
    return results


def write_results(out: Path, results: dict[str, dict[str, Any]]) -> None:
    """Rewrite results.jsonl atomically (one object per line)."""
    path = out / RESULTS
    tmp = out / f".{RESULTS}.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(record) + "\n" for record in results.values()))
    os.replace(tmp, path)


def update_results(out: Path, record: dict[str, Any]) -> None:
    """Put one run's record into results.jsonl as it is on disk now, under a lock: several `modcli sweep` processes
    on one folder share the grid's points (each takes the points no other holds) and every record survives."""
    with FileLock(out / f".{RESULTS}.lock"):
        results = read_results(out)
        results[record["name"]] = record
        write_results(out, results)


def is_done(record: dict[str, Any] | None, point: GridPoint, profile: bool) -> bool:
    if record is None or comparable(record.get("config", {})) != comparable(point.config.to_dict()):
        return False
    return not profile or record.get("latency") is not None or bool(record.get("diverged"))


def planned_record(point: GridPoint) -> dict[str, Any]:
    mc = point.config.model
    return {"name": point.name, "budget": point.budget, "size": point.size, "variant": point.variant,
            "run_dir": point.config.train.out, "dense": mc.dense, "router": None if mc.dense else mc.router,
            "capacity": None if mc.dense else mc.capacity, "route_every": None if mc.dense else mc.route_every,
            "seed": point.config.train.seed, "d_model": mc.d_model, "n_layers": mc.n_layers,
            "seq_len": mc.seq_len, "parameters": point.parameters, "planned_steps": point.steps,
            "step_flops": point.step_flops, "config": point.config.to_dict()}


def one_line(record: dict[str, Any]) -> str:
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


def analysis_lines(analysis: dict[str, dict[str, Any]]) -> list[str]:
    """The isoFLOP analysis (modcli.sweep.analysis) in words, one line per curve (what `modcli sweep` prints after
    its table)."""
    lines = []
    for label, entry in analysis.items():
        for variant, curve in entry["curves"].items():
            low = curve["minimum"]
            seeds = (f"{len(low['losses'])} seeds, spread {low['spread']:.4f}" if low["spread"] is not None
                     else "one seed")
            text = (f"budget {label} {variant}: lowest {low['mean']:.4f} at {low['size']} ({low['parameters']:,} "
                    f"parameters; {seeds}); bracketed: {'yes' if curve['bracketed'] else 'no'}")
            fit = curve["fit"]
            if fit is None:
                text += "; too few sizes for a fit"
            elif fit["parameters"] is None:
                text += "; parabola in log N opens downwards (no minimum)"
            else:
                text += (f"; parabola in log N minimum {fit['loss']:.4f} at {fit['parameters']:,.0f} parameters"
                         f"{'' if fit['inside'] else ' (outside the sizes fitted)'}")
            versus = entry["versus_dense"].get(variant)
            if versus is not None:
                text += (f"; vs dense {versus['difference']:+.4f} ({versus['verdict']}), at "
                         f"{versus['parameters_ratio']:.2f}x its parameters and {versus['step_flops_ratio']:.2f}x its "
                         "FLOPs per step")
            lines.append(text)
    return lines


def summary_rows(runs: list[dict[str, Any]], best: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The summary table: one row per run, the best causal loss of each budget marked with *."""
    winners = {entry["overall"]["name"] for entry in best.values() if "overall" in entry}
    rows = []
    for r in runs:
        latency = r.get("latency") or {}
        reference = f"{r['reference_mode']} {r['reference_loss']:.4f}" if r.get("reference_loss") is not None else "-"
        rows.append({
            "budget": budget_label(r["budget"]), "size": r["size"], "variant": r["variant"],
            "seed": str(r.get("seed", "-")),
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
