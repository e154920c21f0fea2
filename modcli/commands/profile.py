"""`modcli profile`: flags -> ProfileConfig -> modcli.profile -> one table per sequence length."""

from __future__ import annotations

import dataclasses

import typer
from rich.console import Console
from rich.table import Table

import modcli
from modcli.commands import options
from modcli.commands.common import stdout, subcommand
from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.families import architecture
from modcli.reports.console import human, print_json

MODEL_FIELDS = frozenset(field.name for field in dataclasses.fields(ModelConfig)) - {"seq_len"}
"""The flags that shape a fresh model; profile's --seq-len is the length measured, not the model's context."""


@subcommand
def profile(
    ctx: typer.Context,
    checkpoint: options.Checkpoint = None,
    compare: options.Compare = None,
    preset: options.Preset = None,
    config: options.ConfigFile = None,
    d_model: options.DModel = None,
    n_layers: options.NLayers = None,
    n_heads: options.NHeads = None,
    mlp_hidden: options.MlpHidden = None,
    vocab_size: options.VocabSize = None,
    capacity: options.Capacity = None,
    route_every: options.RouteEvery = None,
    route_offset: options.RouteOffset = None,
    route_layers: options.RouteLayers = None,
    router: options.Router = None,
    router_weight: options.RouterWeight = None,
    router_hidden: options.RouterHidden = None,
    threshold: options.Threshold = None,
    capacity_max: options.CapacityMax = None,
    route_part: options.RoutePart = None,
    predictor_hidden: options.PredictorHidden = None,
    experts: options.Experts = None,
    expert_top_k: options.ExpertTopK = None,
    expert_capacity_factor: options.ExpertCapacityFactor = None,
    noop_experts: options.NoopExperts = None,
    arch: options.Arch = None,
    layer_dropout_max: options.LayerDropoutMax = None,
    exit_loss_scale: options.ExitLossScale = None,
    recursions: options.Recursions = None,
    recursion_capacities: options.RecursionCapacities = None,
    seq_len: options.SeqLen = None,
    seq_lens: options.SeqLens = None,
    batch_size: options.BatchSize = None,
    repeats: options.Repeats = None,
    warmup: options.Warmup = None,
    measure: options.Measure = None,
    decode_tokens: options.DecodeTokens = None,
    routing: options.Routing = None,
    memory: options.Memory = None,
    seed: options.Seed = None,
    plot: options.Plot = None,
    onnx: options.OnnxBundles = None,
    device: options.Device = None,
    dtype: options.Dtype = None,
    backends: options.Backends = None,
    compile: options.Compile = None,
    json_output: options.Json = False,
) -> None:
    """FLOPs, latency, tokens/s, peak memory and KV-cache bytes of an MoD model against its dense twin (or a
    checkpoint). Without CHECKPOINT, a freshly initialised model of --preset (default small), --config and the model
    flags."""
    values = options.given(ctx)
    model_flags = {name: value for name, value in values.items() if name in MODEL_FIELDS}
    model = None
    if checkpoint is None or model_flags or preset or config:
        model = modcli.resolve_run_config(preset or "small", str(config) if config else None, model_flags).model
    if seq_len is not None and seq_lens is not None:
        raise UserError("give --seq-len or --seq-lens, not both")
    lengths = [seq_len] if seq_len is not None else (_int_list(seq_lens, "--seq-lens") if seq_lens else None)
    result = modcli.profile(options.build(modcli.ProfileConfig, {
        **values, "model": model, "seq_lens": lengths,
        "measure": _text_list(measure) if measure is not None else None,
        "backends": _text_list(backends) if backends is not None else None}))
    if json_output:
        print_json(dataclasses.asdict(result))
        return
    out = stdout if stdout.is_terminal else Console(width=120)  # a pipe or file gets whole rows, not 80 columns
    for table in tables(result):
        out.print(table)
    if result.onnx:
        out.print(_onnx_table(result))
    out.print(f"[dim]{result.flops_note}\n{result.memory_method}[/]", highlight=False)


def _text_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


def tables(result) -> list:
    """One Rich table per sequence length: model, baseline, measured ratio and the ratio the FLOPs predict; with
    more than the eager backend (or a baseline), a speed table of every backend too."""
    out = []
    for r in result.results:
        out.append(_table(result, r))
        if len(result.backends) > 1 or result.backends != ["eager"]:
            out.append(speed_table(result, r))
    return out


SPEED_ROWS = (("forward", "forward"), ("train_step", "training step"), ("prefill", "causal prefill"),
              ("decode", "decode step"))


def speed_table(result, r):
    """Every backend's latency for every measurement, model and baseline side by side, the measured ratio, the
    counted-FLOP ideal and how far the ratio is from it (ratio / ideal: 1.00 = the saving the FLOPs promise)."""
    compared = result.baseline is not None
    table = Table(title=f"speed, T = {r.seq_len}, batch {result.batch_size}: median ms per call (decode: per step)",
                  caption="compile s: first call (compilation and one run), never timed; onnxruntime has no "
                          "prefill graph (the runtime feeds a prompt through the decode graph) and no training")
    columns = ["backend", "measurement", result.model.label]
    if compared:
        columns += [result.baseline.label, "ratio", "FLOP ideal", "ratio / ideal"]
    columns.append("compile s")
    for column in columns:
        table.add_column(column, justify="left" if column in ("backend", "measurement") else "right")
    for backend in result.backends:
        for name, label in SPEED_ROWS:
            mine = _backend_timing(r.model, backend, name)
            if mine is None:
                continue
            theirs = _backend_timing(r.baseline, backend, name) if compared else None
            cells = [backend, label, f"{mine.latency_ms:.2f}"]
            if compared:
                ratio = r.ratio.get(f"{name}_latency" if backend == "eager" else f"{backend}_{name}_latency")
                measured, ideal = (ratio.measured, ratio.ideal) if ratio else (None, None)
                cells += [f"{theirs.latency_ms:.2f}" if theirs else "-", _ratio(measured), _ratio(ideal),
                          _ratio(measured / ideal if measured and ideal else None)]
            compile_s = [t.compile_s for t in (mine, theirs) if t is not None and t.compile_s is not None]
            cells.append(" / ".join(f"{v:.1f}" for v in compile_s) or "-")
            table.add_row(*cells)
    return table


def _backend_timing(profile, backend: str, name: str):
    if profile is None:
        return None
    return getattr(profile, name) if backend == "eager" else getattr(profile, backend).get(name)


def _table(result, r):
    compared = result.baseline is not None
    m, b = r.model, r.baseline
    caption = [f"causal routing of prefill and decode: {result.routing}"] if m.decode else []
    if m.decode and architecture(result.model.config.get("arch", "mod")).exit_decoding:
        caption.append("decode step at full depth (no exit): modcli generate --exit-threshold / --speculative "
                       "measure decoding with exits")
    if result.model.routers_calibrated:
        caption.append(f"untrained routers calibrated at T = {r.seq_len} on separate tokens ({result.routing} rule) "
                       f"to process {result.model.capacity:g} of the tokens")
    table = Table(title=f"T = {r.seq_len}, batch {result.batch_size}, {result.device_name}, {result.dtype}; "
                        f"median of {result.repeats} (min-max), interleaved",
                  caption="\n".join(caption) or None)
    table.add_column("metric")
    table.add_column(result.model.label + (" (calibrated)" if result.model.routers_calibrated else ""),
                     justify="right")
    if compared:
        table.add_column(result.baseline.label, justify="right")
        table.add_column("ratio", justify="right")
        table.add_column("ideal (FLOPs)", justify="right")

    def row(label: str, mine, theirs, fmt, ratio_key: str | None = None) -> None:
        cells = [label, fmt(mine) if mine is not None else "-"]
        if compared:
            ratio = r.ratio.get(ratio_key) if ratio_key else None
            cells += [fmt(theirs) if theirs is not None else "-", _ratio(ratio.measured if ratio else None),
                      _ratio(ratio.ideal if ratio else None)]
        table.add_row(*cells)

    def get(obj, name: str):
        return None if obj is None else getattr(obj, name)

    row("parameters", result.model.parameters, get(result.baseline, "parameters"), lambda n: f"{n:,}")
    if result.model.active_parameters != result.model.parameters or (
            compared and result.baseline.active_parameters != result.baseline.parameters):
        row("active parameters per token", result.model.active_parameters, get(result.baseline, "active_parameters"),
            lambda n: f"{n:,}")
    row("forward FLOPs/seq (analytic)", m.forward_flops_per_seq, get(b, "forward_flops_per_seq"), human)
    row("forward FLOPs/seq (counted)", m.forward_flops_counted_per_seq, get(b, "forward_flops_counted_per_seq"),
        human, "forward_flops")
    row("training FLOPs/seq (analytic)", m.train_flops_per_seq, get(b, "train_flops_per_seq"), human)
    row("training FLOPs/seq (counted)", m.train_flops_counted_per_seq, get(b, "train_flops_counted_per_seq"), human,
        "train_flops")
    row("decode FLOPs/token (counted)", m.decode_flops_counted_per_token, get(b, "decode_flops_counted_per_token"),
        human)
    for name, label in (("forward", "forward"), ("train_step", "training step"),
                        ("prefill", f"prefill ({result.routing})"), ("decode", "decode step")):
        mine, theirs = getattr(m, name), get(b, name)
        if mine is None:
            continue
        row(f"{label} latency ms", mine, theirs, _latency, f"{name}_latency")
        row(f"{label} tok/s", mine.tokens_per_s, get(theirs, "tokens_per_s"), lambda v: f"{v:,.0f}")
    for name, label in (("forward", "forward"), ("train_step", "training step"), ("decode", "prefill + decode")):
        mine, theirs = getattr(m, name), get(b, name)
        if mine is not None and mine.peak_mem_bytes is not None:
            row(f"peak memory MiB, {label}", mine.peak_mem_bytes, get(theirs, "peak_mem_bytes"), _mib,
                f"{name}_peak_mem")
    if m.kv_cache_bytes is not None:
        tokens = f"{r.seq_len}+{result.decode_tokens}"
        row(f"KV cache MiB stored ({tokens} tokens)", m.kv_cache_bytes, get(b, "kv_cache_bytes"), _mib, "kv_cache")
        row(f"KV cache MiB allocated ({tokens})", m.kv_cache_allocated_bytes, get(b, "kv_cache_allocated_bytes"),
            _mib, "kv_cache_allocated")
        if m.processed_fraction:
            share = sum(m.processed_fraction.values()) / len(m.processed_fraction)
            row("processed share per routed block (causal)", share, None, lambda v: f"{v:.3f}")
    return table


def _onnx_table(result):
    """onnxruntime latency per bundle, beside the eager numbers above; ratios against the first bundle."""
    table = Table(title=f"onnxruntime, batch {result.batch_size}; median (min) ms; ratio against the first bundle")
    for column in ("bundle", "provider", "T", "forward ms", "forward ratio", "decode step ms", "decode ratio"):
        table.add_column(column, justify="left" if column in ("bundle", "provider") else "right")
    first = {}
    for entry in result.onnx:
        first.setdefault(entry["seq_len"], entry)
        ref = first[entry["seq_len"]]
        cells = [entry["bundle"], entry["provider"], str(entry["seq_len"])]
        for graph in ("forward", "decode"):
            timing, base = entry.get(graph), ref.get(graph)
            cells.append(f"{timing['latency_ms']:.2f} ({timing['min_ms']:.2f})" if timing else "-")
            cells.append(f"{timing['latency_ms'] / base['latency_ms']:.3f}" if timing and base else "-")
        table.add_row(*cells)
    return table


def _latency(timing) -> str:
    return f"{timing.latency_ms:.2f} ({timing.latency_min_ms:.2f}-{timing.latency_max_ms:.2f})"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
