"""The isoFLOP analysis of a sweep's results (numpy; the CLI's summary reads the dict it returns): per budget and
variant the curve of causal validation loss against parameters, its minimum, whether the minimum is bracketed, a
parabola in log N around it, the spread over seeds, and each MoD curve against the dense one."""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from modcli.sweep.grid import budget_label


def isoflop_analysis(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per budget: every curve (variant) as points of loss against parameters, each point the mean causal loss over
    its seeds with their spread (max - min); the curve's lowest point, whether it is bracketed (a smaller and a
    larger size both worse), and a parabola in log10(parameters) through the lowest point and up to two neighbours
    on each side (Chinchilla's Approach 2, kept local because a lopsided grid biases a wide fit); then each MoD
    curve against the dense one: the difference of the minima, whether it exceeds the seed spread (every seed of
    one minimum below every seed of the other), the ratio of parameters and of training FLOPs per step (the paper's
    rule: MoD's best model costs about what the best dense one costs per forward pass)."""
    analysis: dict[str, dict[str, Any]] = {}
    done = [r for r in runs if r.get("causal_loss") is not None]
    for budget in sorted({r["budget"] for r in done}):
        at = [r for r in done if r["budget"] == budget]
        curves: dict[str, dict[str, Any]] = {}
        for variant in dict.fromkeys(r["variant"] for r in at):
            of = [r for r in at if r["variant"] == variant]
            curves[variant] = _curve(of)
        dense = next((c for c in curves.values() if c["dense"]), None)
        versus = {}
        if dense is not None:
            for variant, curve in curves.items():
                if not curve["dense"]:
                    versus[variant] = _versus(curve, dense)
        analysis[budget_label(budget)] = {"budget": budget, "curves": curves, "versus_dense": versus}
    return analysis


def _curve(runs: list[dict[str, Any]]) -> dict[str, Any]:
    points = []
    for size in sorted(dict.fromkeys(r["size"] for r in runs), key=lambda s: min(r["parameters"] for r in runs
                                                                              if r["size"] == s)):
        repeats = sorted((r for r in runs if r["size"] == size), key=lambda r: r.get("seed") or 0)
        losses = [r["causal_loss"] for r in repeats]
        points.append({"size": size, "parameters": repeats[0]["parameters"], "step_flops": repeats[0]["step_flops"],
                       "seeds": [r.get("seed") for r in repeats], "losses": losses, "mean": statistics.fmean(losses),
                       "spread": max(losses) - min(losses) if len(losses) > 1 else None})
    low = min(range(len(points)), key=lambda i: points[i]["mean"])
    return {"dense": runs[0]["dense"], "points": points, "minimum": points[low],
            "bracketed": 0 < low < len(points) - 1, "fit": _parabola(points, low)}


def _parabola(points: list[dict[str, Any]], low: int) -> dict[str, Any] | None:
    """loss = a (log10 N)^2 + b log10 N + c over points[low-2 : low+3]; None below three points."""
    window = points[max(0, low - 2):low + 3]
    if len(window) < 3:
        return None
    x = np.log10([p["parameters"] for p in window])
    a, b, c = np.polyfit(x, [p["mean"] for p in window], 2)
    fit: dict[str, Any] = {"sizes": [p["size"] for p in window], "a": float(a), "b": float(b), "c": float(c),
                           "parameters": None, "loss": None, "inside": False}
    vertex = -b / (2 * a) if a > 0 else math.inf
    if abs(vertex) < 30:  # a minimum at all (a > 0), and one that a float can hold
        fit.update(parameters=float(10 ** vertex), loss=float(c - b * b / (4 * a)),
                   inside=bool(x.min() <= vertex <= x.max()))
    return fit


def _versus(curve: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    mine, theirs = curve["minimum"], dense["minimum"]
    if len(mine["losses"]) > 1 and len(theirs["losses"]) > 1:
        verdict = ("lower beyond the seed spread" if max(mine["losses"]) < min(theirs["losses"])
                   else "higher beyond the seed spread" if min(mine["losses"]) > max(theirs["losses"])
                   else "within the seed spread")
    else:
        verdict = "one seed: spread unknown"
    at_sizes = {p["size"]: p["mean"] - q["mean"] for p in curve["points"] for q in dense["points"]
                if p["size"] == q["size"]}
    return {"difference": mine["mean"] - theirs["mean"], "verdict": verdict,
            "parameters_ratio": mine["parameters"] / theirs["parameters"],
            "step_flops_ratio": mine["step_flops"] / theirs["step_flops"],
            "larger": mine["parameters"] > theirs["parameters"], "at_sizes": at_sizes}
