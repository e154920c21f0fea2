"""Figures of `modcli sweep` (isoFLOP curves, the speed-quality frontier) and `modcli plot` (training curves).

matplotlib is imported inside each function (Agg backend, no display), so importing this module costs nothing.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from modcli.errors import UserError
from modcli.reports.console import read_metrics_file, stderr_console

OFF_SCALE_NATS = 0.4
"""isoflop.png leaves out of a panel's axis range a curve whose lowest point is this far above the budget's best."""
MARKERS = ["o", "^", "s", "D", "v", "P", "X", "<", ">", "h"]
DPI = 110


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _variants(runs: list[dict[str, Any]]) -> list[str]:
    """Variant names, dense ones first, in grid order."""
    names = list(dict.fromkeys(r["variant"] for r in runs))
    dense = {r["variant"] for r in runs if r["dense"]}
    return [n for n in names if n in dense] + [n for n in names if n not in dense]


def _budget_colours(budgets: list[float]) -> dict[float, Any]:
    plt = _pyplot()
    cmap = plt.get_cmap("viridis")
    n = max(1, len(budgets) - 1)
    return {budget: cmap(0.1 + 0.75 * i / n) for i, budget in enumerate(sorted(budgets))}


def isoflop_plot(analysis: dict[str, dict[str, Any]], path: str | Path) -> str:
    """Causal validation loss against parameters, one panel per training-FLOP budget, one colour and marker per
    variant (dense solid, MoD dashed), from `modcli.sweep.grid.isoflop_analysis`: each point the mean over its
    seeds with a bar from the lowest to the highest seed, the lowest point of each curve edged in black, the local
    parabola in log N dotted with its minimum as a cross, the lowest point of each budget starred."""
    plt = _pyplot()
    labels = list(analysis)
    if not labels:
        raise UserError("no run of the sweep has a validation loss yet")
    variants = list(dict.fromkeys(v for entry in analysis.values() for v in entry["curves"]))
    dense = {v for entry in analysis.values() for v, c in entry["curves"].items() if c["dense"]}
    variants = [v for v in variants if v in dense] + [v for v in variants if v not in dense]
    colours = plt.get_cmap("tab10")
    style = {v: (colours(i % 10), MARKERS[i % len(MARKERS)]) for i, v in enumerate(variants)}
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels) + 1.5, 4.8), squeeze=False)
    off_scale: dict[str, float] = {}
    for ax, label in zip(axes[0], labels, strict=True):
        curves = analysis[label]["curves"]
        best = min((c["minimum"] for c in curves.values()), key=lambda p: p["mean"])
        # A curve whose lowest point is far above the budget's best would squash the others: it is left out of the
        # axis range and named in the legend.
        shown = {v: c for v, c in curves.items() if c["minimum"]["mean"] <= best["mean"] + OFF_SCALE_NATS}
        for variant, curve in curves.items():
            if variant not in shown:
                off_scale[variant] = min(off_scale.get(variant, curve["minimum"]["mean"]), curve["minimum"]["mean"])
        top = max(max(p["losses"]) for c in shown.values() for p in c["points"])
        span = top - best["mean"]
        ax.set_ylim(best["mean"] - 0.08 * span - 1e-3, top + 0.08 * span + 1e-3)
        for variant, curve in shown.items():
            colour, marker = style[variant]
            points = curve["points"]
            xs, ys = [p["parameters"] for p in points], [p["mean"] for p in points]
            low = [[p["mean"] - min(p["losses"]) for p in points], [max(p["losses"]) - p["mean"] for p in points]]
            ax.errorbar(xs, ys, yerr=low, color=colour, marker=marker, markersize=5, capsize=2,
                        linestyle="-" if curve["dense"] else "--", linewidth=1.5 if curve["dense"] else 1.1)
            lowest = curve["minimum"]
            ax.plot([lowest["parameters"]], [lowest["mean"]], marker=marker, markersize=9, color=colour,
                    markeredgecolor="black", markeredgewidth=1.5, linestyle="none")
            fit = curve["fit"]
            if fit is not None:
                fitted = [p for p in points if p["size"] in fit["sizes"]]
                grid = np.linspace(np.log10(fitted[0]["parameters"]), np.log10(fitted[-1]["parameters"]), 50)
                ax.plot(10 ** grid, fit["a"] * grid ** 2 + fit["b"] * grid + fit["c"], color=colour, linestyle=":",
                        linewidth=1)
                if fit["parameters"] is not None and fit["inside"]:
                    ax.plot([fit["parameters"]], [fit["loss"]], marker="x", color=colour, markersize=8,
                            linestyle="none")
        ax.plot([best["parameters"]], [best["mean"]], marker="*", markersize=16, color="gold",
                markeredgecolor="black", linestyle="none", zorder=5)
        ax.set_xscale("log")
        ticks = sorted({p["parameters"] for c in shown.values() for p in c["points"] if c["dense"]}
                       or {p["parameters"] for c in shown.values() for p in c["points"]})
        ax.set_xticks(ticks, [f"{n / 1000:.0f}k" if n < 10**6 else f"{n / 10**6:.1f}M" for n in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("parameters")
        ax.set_title(f"{analysis[label]['budget']:.3g} training FLOPs", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("validation loss, causal routing (nats/token)")
    handles = [plt.Line2D([], [], color=style[v][0], marker=style[v][1], linestyle="-" if v in dense else "--",
                          label=v if v not in off_scale else f"{v} (off the scale: lowest {off_scale[v]:.3f})")
               for v in variants]
    handles += [plt.Line2D([], [], marker="*", color="gold", markeredgecolor="black", markersize=12, linestyle="none",
                           label="lowest of the budget"),
                plt.Line2D([], [], marker="o", color="white", markeredgecolor="black", markersize=8, linestyle="none",
                           label="lowest of its curve"),
                plt.Line2D([], [], color="gray", linestyle=":", marker="x", label="parabola in log N, its minimum")]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    fig.suptitle("isoFLOP curves (bars: lowest to highest seed)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


def relative_latency(runs: list[dict[str, Any]], quantity: str) -> tuple[dict[str, float], str | None]:
    """Each run's `quantity` latency (forward, decode) relative to the dense model of the largest size.

    A run's own ratio against its dense twin was timed interleaved, call by call (exact to the noise of one
    measurement); the size factor (the dense twin of its size against the dense model of the largest size) is the
    median over every measurement of those dense shapes in the sweep, which were taken at different times.
    Returns (run name -> relative latency, the reference size)."""
    timed = [r for r in runs if r.get("latency") and r["latency"].get(f"{quantity}_ms")]
    if not timed:
        return {}, None
    by_size: dict[str, list[float]] = {}
    params: dict[str, int] = {}
    for r in timed:
        by_size.setdefault(r["size"], []).append(r["latency"][f"dense_{quantity}_ms"])
        if r["dense"]:
            params[r["size"]] = r["parameters"]
        else:
            params.setdefault(r["size"], r["parameters"])
    reference = max(by_size, key=lambda size: params[size])
    reference_ms = statistics.median(by_size[reference])
    out = {}
    for r in timed:
        ratio = r["latency"].get(f"{quantity}_ratio")
        if ratio is not None:
            out[r["name"]] = ratio * statistics.median(by_size[r["size"]]) / reference_ms
    return out, reference


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower-left envelope: points no other point beats in both latency and loss."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def frontier_plot(runs: list[dict[str, Any]], path: str | Path) -> str:
    """Causal validation loss against measured latency (forward and decode panels), relative to the dense model of
    the largest size; one colour per budget, one marker per variant, each budget's Pareto frontier drawn."""
    plt = _pyplot()
    runs = [r for r in runs if r.get("causal_loss") is not None and r.get("latency")]
    if not runs:
        raise UserError("no run has latency measurements (run the sweep with --profile)")
    budgets = sorted({r["budget"] for r in runs})
    colours = _budget_colours(budgets)
    variants = _variants(runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    for ax, quantity in zip(axes, ("forward", "decode"), strict=True):
        x, reference = relative_latency(runs, quantity)
        for budget in budgets:
            at = [r for r in runs if r["budget"] == budget and r["name"] in x]
            for i, variant in enumerate(variants):
                pts = [r for r in at if r["variant"] == variant]
                ax.scatter([x[r["name"]] for r in pts], [r["causal_loss"] for r in pts], marker=MARKERS[i % len(MARKERS)],
                           color=colours[budget], edgecolor="black" if pts and pts[0]["dense"] else "none", s=42, zorder=3)
            front = _pareto([(x[r["name"]], r["causal_loss"]) for r in at])
            if front:
                ax.plot(*zip(*front, strict=True), color=colours[budget], linewidth=1.2, alpha=0.8, drawstyle="steps-post")
        ax.set_xlabel(f"{quantity} latency relative to the dense {reference}")
        ax.set_title(f"{quantity} ({'whole sequence' if quantity == 'forward' else 'one token, causal routing'})")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("validation loss, causal routing (nats/token)")
    handles = [plt.Line2D([], [], color=colours[b], linewidth=3, label=f"{b:.3g} FLOPs") for b in budgets]
    handles += [plt.Line2D([], [], color="gray", marker=MARKERS[i % len(MARKERS)], linestyle="none", label=v)
                for i, v in enumerate(variants)]
    axes[1].legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle("speed-quality frontier (lines: each budget's Pareto front; none where one run is both fastest and best)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


# --- modcli plot ---------------------------------------------------------------------------------------------------


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """A run folder's metrics.jsonl (what `modcli train` writes), one dict per step: a damaged last line is dropped
    with a note on stderr, a damaged line before it is a UserError naming it (`read_metrics_file`)."""
    path = Path(run) / "metrics.jsonl"
    if not Path(run).is_dir():
        raise UserError(f"no such run folder: {run}")
    if not path.is_file():
        raise UserError(f"{run} has no metrics.jsonl: not a run folder of `modcli train` or `modcli sweep`")
    records, note = read_metrics_file(path)  # a last line cut short (a run killed or still writing) is dropped
    if note:
        stderr_console.print(note, highlight=False, soft_wrap=True)
    if not records:
        raise UserError(f"{path} is empty: the run has not trained a step yet")
    return records


def _smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def curves_plot(runs: list[str], path: str | Path, smooth: int = 10, labels: list[str] | None = None) -> dict[str, Any]:
    """Training loss (moving average over `smooth` steps) and validation loss in the causal routing mode against
    training FLOPs, one colour per run; returns what was drawn per run."""
    plt = _pyplot()
    data = [(label, read_metrics(run)) for label, run in zip(labels or [Path(r).name for r in runs], runs, strict=True)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = plt.get_cmap("tab10")
    drawn = {}
    for i, (label, records) in enumerate(data):
        colour = colours(i % 10)
        train = [(r["flops"], r["loss"]) for r in records if "loss" in r and "flops" in r]
        val = [(r["flops"], r["val_loss"]) for r in records if "val_loss" in r and "flops" in r]
        if train:
            xs, ys = zip(*train, strict=True)
            left.plot(xs, _smooth(list(ys), smooth), color=colour, label=label, linewidth=1.3)
        if val:
            xs, ys = zip(*val, strict=True)
            right.plot(xs, ys, color=colour, marker="o", markersize=3, label=label, linewidth=1.3)
        drawn[label] = {"steps": len(train), "evaluations": len(val),
                        "final_train_loss": train[-1][1] if train else None,
                        "final_val_loss": val[-1][1] if val else None, "flops": train[-1][0] if train else None}
    for ax, title in ((left, f"training loss ({smooth}-step mean)" if smooth > 1 else "training loss"),
                      (right, "validation loss, causal routing (dense: the only one)")):
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return drawn
