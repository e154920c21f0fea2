"""How `modcli profile` reports: the ratios of model to baseline, the Rich tables, and the plot.

The JSON (`--json`) is the `ProfileResult` itself (`dataclasses.asdict`); its latencies are in milliseconds
(`latency_ms`, the median; `latency_min_ms`, `latency_max_ms`), for every backend and for the --onnx bundles.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from modcli.models.families import DEFAULT_FAMILY, family
from modcli.profiling.config import ModelProfile, ProfileResult, Ratio, SeqLenProfile, Timing
from modcli.reports.console import human


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def ratios(model: ModelProfile, baseline: ModelProfile | None) -> dict[str, Ratio]:
    """Model / baseline of every measured quantity; each latency beside the ratio its FLOPs predict (ideal)."""
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


def tables(result: ProfileResult) -> list[Table]:
    """One Rich table per sequence length: model, baseline, measured ratio and the ratio the FLOPs predict; with
    more than the eager backend, a speed table of every backend too; with --onnx, the bundles' table last."""
    out = []
    for r in result.results:
        out.append(_table(result, r))
        if len(result.backends) > 1 or result.backends != ["eager"]:
            out.append(speed_table(result, r))
    if result.onnx:
        out.append(onnx_table(result))
    return out


SPEED_ROWS = (("forward", "forward"), ("train_step", "training step"), ("prefill", "causal prefill"),
              ("decode", "decode step"))


def speed_table(result: ProfileResult, r: SeqLenProfile) -> Table:
    """Every backend's latency for every measurement, model and baseline side by side, the measured ratio, the
    counted-FLOP ideal and how far the ratio is from it (ratio / ideal: 1.00 = the saving the FLOPs promise)."""
    compared = result.baseline is not None
    caption = ("compile s: first call (compilation and one run), never timed; onnxruntime has no prefill graph (the "
               "runtime feeds a prompt through the decode graph) and no training")
    if result.onnxruntime:
        caption += "; onnxruntime sessions: " + ", ".join(f"{k} {v}" for k, v in result.onnxruntime.items())
    table = Table(title=f"speed, T = {r.seq_len}, batch {result.batch_size}: median ms per call (decode: per step)",
                  caption=caption)
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


def _backend_timing(profile: ModelProfile | None, backend: str, name: str) -> Timing | None:
    if profile is None:
        return None
    return getattr(profile, name) if backend == "eager" else getattr(profile, backend).get(name)


def _table(result: ProfileResult, r: SeqLenProfile) -> Table:
    compared = result.baseline is not None
    m, b = r.model, r.baseline
    caption = [f"causal routing of prefill and decode: {result.routing}"] if m.decode else []
    decoding_flags = family(result.model.config.get("arch", DEFAULT_FAMILY)).decoding_flags()
    if m.decode and decoding_flags:
        caption.append(f"decode step at full depth: modcli generate {' / '.join(decoding_flags)} measure the family's "
                       "own decoding")
    if result.model.routers_calibrated:
        caption.append(f"untrained routers calibrated at T = {r.seq_len} on separate tokens ({result.routing} rule) "
                       f"to process {result.model.capacity:g} of the tokens")
    kernel = "; nn.Linear: oneDNN prepacked (eager inference)" if result.linear_kernel == "onednn-packed" else ""
    table = Table(title=f"T = {r.seq_len}, batch {result.batch_size}, {result.device_name}, {result.dtype}{kernel}; "
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


def onnx_table(result: ProfileResult) -> Table:
    """onnxruntime latency per --onnx bundle, beside the eager numbers above; ratios against the first bundle."""
    table = Table(title=f"onnxruntime, batch {result.batch_size}: median (min-max) ms of {result.repeats} calls; "
                        "ratio against the first bundle")
    for column in ("bundle", "provider", "T", "forward ms", "forward ratio", "decode step ms", "decode ratio"):
        table.add_column(column, justify="left" if column in ("bundle", "provider") else "right")
    first = {}
    for entry in result.onnx:
        first.setdefault(entry["seq_len"], entry)
        ref = first[entry["seq_len"]]
        cells = [entry["bundle"], entry["provider"], str(entry["seq_len"])]
        for graph in ("forward", "decode"):
            timing, base = entry.get(graph), ref.get(graph)
            cells.append(_milliseconds(timing["latency_ms"], timing["latency_min_ms"], timing["latency_max_ms"])
                         if timing else "-")
            cells.append(f"{timing['latency_ms'] / base['latency_ms']:.3f}" if timing and base else "-")
        table.add_row(*cells)
    return table


def _latency(timing: Timing) -> str:
    return _milliseconds(timing.latency_ms, timing.latency_min_ms, timing.latency_max_ms)


def _milliseconds(median: float, fastest: float, slowest: float) -> str:
    return f"{median:.2f} ({fastest:.2f}-{slowest:.2f})"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
