"""`modcli profile`: flags -> ProfileConfig -> modcli.profiling.profile.profile -> one table per sequence length."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from modcli.commands.common import (
    Arch,
    Capacity,
    CapacityMax,
    Device,
    Dtype,
    ExitLossScale,
    ExpertCapacityFactor,
    Experts,
    ExpertTopK,
    Json,
    LayerDropoutMax,
    NoopExperts,
    PredictorHidden,
    RecursionCapacities,
    Recursions,
    RouteEvery,
    RouteLayers,
    RouteOffset,
    RoutePart,
    Router,
    RouterHidden,
    RouterWeight,
    Threshold,
    stdout,
    user_errors,
)
from modcli.errors import UserError


@user_errors
def profile(
    checkpoint: Annotated[Optional[str], typer.Argument(
        help="Run or checkpoint folder; without it a freshly initialised model of --preset/--config/flags.")] = None,
    compare: Annotated[str, typer.Option(
        help="dense (the dense twin: no routing, dense MLP), moe (the same experts without MoD routing or no-op "
             "experts), none, or a run/checkpoint folder.")] = "dense",
    preset: Annotated[Optional[str], typer.Option(help="tiny, small or base (default small).")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", help="TOML file with the same keys as the flags; flags win.")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Model width.")] = None,
    n_layers: Annotated[Optional[int], typer.Option(help="Number of blocks.")] = None,
    n_heads: Annotated[Optional[int], typer.Option(help="Attention heads.")] = None,
    mlp_hidden: Annotated[Optional[int], typer.Option(help="SwiGLU hidden width (0 = 8/3 x d_model).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary size.")] = None,
    capacity: Capacity = None,
    route_every: RouteEvery = None,
    route_offset: RouteOffset = None,
    route_layers: RouteLayers = None,
    router: Router = None,
    router_weight: RouterWeight = None,
    router_hidden: RouterHidden = None,
    threshold: Threshold = None,
    capacity_max: CapacityMax = None,
    route_part: RoutePart = None,
    predictor_hidden: PredictorHidden = None,
    experts: Experts = None,
    expert_top_k: ExpertTopK = None,
    expert_capacity_factor: ExpertCapacityFactor = None,
    noop_experts: NoopExperts = None,
    arch: Arch = None,
    layer_dropout_max: LayerDropoutMax = None,
    exit_loss_scale: ExitLossScale = None,
    recursions: Recursions = None,
    recursion_capacities: RecursionCapacities = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length to profile (default: the model's).")] = None,
    seq_lens: Annotated[Optional[str], typer.Option(help="Sweep, comma-separated, e.g. 256,512,1024,2048.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per call.")] = 8,
    repeats: Annotated[int, typer.Option(help="Timed calls per measurement and model (median, min, max).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed calls before the timed ones.")] = 1,
    measure: Annotated[str, typer.Option(help="Comma-separated: forward, train, decode.")] = "forward,train,decode",
    decode_tokens: Annotated[int, typer.Option(help="Decode steps after prefilling T tokens.")] = 32,
    routing: Annotated[Optional[str], typer.Option(
        help="Causal routing of prefill and decode (topk router: router or predictor); default the router's first.")] = None,
    memory: Annotated[bool, typer.Option(
        "--memory/--no-memory", help="Measure peak memory (one fresh process per measurement).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of fresh weights and of the inputs.")] = 1337,
    plot: Annotated[Optional[str], typer.Option(help="Write latency and FLOPs against T to this PNG.")] = None,
    onnx: Annotated[Optional[list[str]], typer.Option(
        help="Also time this `modcli export` bundle through onnxruntime (repeat: MoD and dense bundles).")] = None,
    device: Device = "auto",
    dtype: Dtype = "float32",
    backends: Annotated[str, typer.Option(help=(
        "Comma-separated paths to time, MoD and baseline interleaved: eager, compiled (torch.compile: forward, "
        "training step, causal prefill, static-shape decode step), onnxruntime (both models exported to ONNX here: "
        "forward and decode step)."))] = "eager",
    compile: Annotated[bool, typer.Option("--compile", help="Same as adding compiled to --backends.")] = False,
    json_output: Json = False,
) -> None:
    """FLOPs, latency, tokens/s, peak memory and KV-cache bytes of an MoD model against its dense twin (or a checkpoint)."""
    from modcli.profiling.profile import ProfileConfig
    from modcli.profiling.profile import profile as run_profile

    model_flags = {k: v for k, v in dict(
        d_model=d_model, n_layers=n_layers, n_heads=n_heads, mlp_hidden=mlp_hidden, vocab_size=vocab_size,
        capacity=capacity, route_every=route_every, route_offset=route_offset, route_layers=route_layers, router=router,
        router_weight=router_weight, router_hidden=router_hidden, threshold=threshold, capacity_max=capacity_max,
        route_part=route_part, predictor_hidden=predictor_hidden, experts=experts, expert_top_k=expert_top_k,
        expert_capacity_factor=expert_capacity_factor, noop_experts=noop_experts, arch=arch,
        layer_dropout_max=layer_dropout_max, exit_loss_scale=exit_loss_scale, recursions=recursions,
        recursion_capacities=recursion_capacities).items() if v is not None}
    model = None
    if checkpoint is None or model_flags or preset or config:
        from modcli.config import resolve_run_config
        model = resolve_run_config(preset or "small", str(config) if config else None, model_flags).model
    if seq_len is not None and seq_lens is not None:
        raise UserError("give --seq-len or --seq-lens, not both")
    lengths = [seq_len] if seq_len is not None else (_int_list(seq_lens, "--seq-lens") if seq_lens else None)
    result = run_profile(ProfileConfig(
        checkpoint=checkpoint, model=model, compare=compare, seq_lens=lengths, batch_size=batch_size,
        repeats=repeats, warmup=warmup, measure=[m.strip() for m in measure.split(",") if m.strip()],
        decode_tokens=decode_tokens, routing=routing, device=device, dtype=dtype, compile=compile, memory=memory,
        backends=[b.strip() for b in backends.split(",") if b.strip()],
        seed=seed, plot=plot, onnx=onnx or []))
    if json_output:
        from modcli.reports.console import print_json
        print_json(dataclasses.asdict(result))
        return
    from rich.console import Console

    out = stdout if stdout.is_terminal else Console(width=120)  # a pipe or file gets whole rows, not 80 columns
    for table in tables(result):
        out.print(table)
    if result.onnx:
        out.print(_onnx_table(result))
    out.print(f"[dim]{result.flops_note}\n{result.memory_method}[/]", highlight=False)


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
    from rich.table import Table

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
    from rich.table import Table

    from modcli.models.families import architecture
    from modcli.reports.console import human

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
    from rich.table import Table

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
