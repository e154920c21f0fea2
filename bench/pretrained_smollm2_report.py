"""The report of bench/pretrained_smollm2.sh: results.jsonl, table.md and frontier.png from its raw JSON.

    python bench/pretrained_smollm2_report.py bench/results/smollm2 [MORE_RESULTS ...] [--ideal]

Reads RESULTS/raw/ (recipes.txt, run.json, dense.*.json and NAME.MODE.{eval-stdlib,eval-prose,generate,profile}.json
with NAME.train.json; where present NAME.MODE.tasks.json (and dense.tasks.json), multiple-choice accuracy,
NAME.MODE.profile-long.json, the long-context profile, and NAME.export.json with
NAME.runtime.json, the exported bundle and modcli-run's greedy text), then the recipes of each MORE_RESULTS/raw/ (runs
of the script beside or after it, their dense model measured in RESULTS), and writes one JSON object a line per measured
point (the dense model first) to RESULTS/results.jsonl, the Markdown table RESULTS/table.md and the figure
RESULTS/frontier.png (loss increase on both corpora against the decode-step speed-up at the longest profiled length
of the main profile, and beside it, where long-context profiles exist, against the prefill speed-up at the long
length). A speed-up is the dense model's
median latency over the converted model's, both timed interleaved in the same `modcli profile` call.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPORA = ("stdlib", "prose")
GOAL_SPEEDUP = 1.2
GOAL_LOSS_INCREASE_PCT = 1.0
GOAL_KV_CACHE = 0.7


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def recipes(raw: Path) -> list[tuple[str, list[str], str]]:
    """(name, causal modes, train flags) per line "NAME|MODES|FLAGS" of recipes.txt."""
    entries = []
    for line in (raw / "recipes.txt").read_text().splitlines():
        if line.strip():
            name, modes, flags = line.split("|", 2)
            entries.append((name, modes.split(","), flags))
    return entries


def causal_result(evaluation: dict, mode: str | None) -> dict:
    """The eval record of `mode` (the only one for the dense model)."""
    results = evaluation["results"]
    return results[0] if mode is None else next(r for r in results if r["routing"] == mode)


def mean_processed(result: dict) -> float | None:
    fractions = result["processed_fraction"]
    return sum(fractions.values()) / len(fractions) if fractions else None


def quality(prefix: Path, mode: str | None) -> dict:
    row: dict = {}
    for corpus in CORPORA:
        evaluation = read_json(prefix.with_name(f"{prefix.name}.eval-{corpus}.json"))
        result = causal_result(evaluation, mode)
        row[f"loss_{corpus}"] = result["loss"]
        row[f"processed_fraction_{corpus}"] = mean_processed(result)
        row[f"eval_tokens_{corpus}"] = evaluation["tokens"]
    tasks = prefix.with_name(f"{prefix.name}.tasks.json")
    if tasks.is_file():  # TASKS: local multiple-choice accuracy (lm-eval), e.g. bench/tasks' license choice
        row["task_acc"] = {r["task"]: r["metrics"]["acc"] for r in read_json(tasks)["results"]}
    generated = read_json(prefix.with_name(f"{prefix.name}.generate.json"))
    row["greedy_texts"] = generated["texts"]
    row["generate_kv_cache_ratio"] = generated["kv_cache_bytes"] / generated["dense_kv_cache_bytes"]
    return row


def speed(profile: dict) -> dict:
    """Per profiled length: latencies (ms), speed-ups measured and ideal (from counted FLOPs), KV cache ratio."""
    row: dict = {"profile_load_avg": [profile["load_avg_start"], profile["load_avg_end"]]}
    for result in profile["results"]:
        t = result["seq_len"]
        ratio = result["ratio"]
        for part in ("prefill", "decode"):
            row[f"{part}_ms_T{t}"] = result["model"][part]["latency_ms"]
            row[f"dense_{part}_ms_T{t}"] = result["baseline"][part]["latency_ms"]
            row[f"{part}_speedup_T{t}"] = 1.0 / ratio[f"{part}_latency"]["measured"]
            row[f"{part}_speedup_ideal_T{t}"] = 1.0 / ratio[f"{part}_latency"]["ideal"]
        row[f"decode_flops_ratio_T{t}"] = (result["model"]["decode_flops_counted_per_token"]
                                           / result["baseline"]["decode_flops_counted_per_token"])
        row[f"kv_cache_bytes_T{t}"] = result["model"]["kv_cache_bytes"]
        row[f"dense_kv_cache_bytes_T{t}"] = result["baseline"]["kv_cache_bytes"]
        row[f"kv_cache_ratio_T{t}"] = ratio["kv_cache"]["measured"]
        row[f"processed_fraction_profile_T{t}"] = mean_processed({"processed_fraction": result["model"]["processed_fraction"]})
    row["profiled_seq_lens"] = [r["seq_len"] for r in profile["results"]]
    return row


def flag_value(flags: str, name: str, default: str) -> str:
    """The value of the last `name` flag in a recipe's train flags, else `default`."""
    words = flags.split()
    found = [words[i + 1] for i, word in enumerate(words[:-1]) if word == name]
    return found[-1] if found else default


def collect(results: Path, more: list[Path] = ()) -> tuple[dict, list[dict]]:
    raw = results / "raw"
    run = read_json(raw / "run.json")
    run["wall_s_each"] = [run["wall_s"], *(read_json(other / "raw" / "run.json")["wall_s"]
                                           if (other / "raw" / "run.json").is_file() else None for other in more)]
    dense = {"recipe": "dense", "routing": "dense", "flags": "", **quality(raw / "dense", None)}
    rows = [dense]
    for raw, (name, modes, flags) in [(folder / "raw", recipe) for folder in (results, *more)
                                      for recipe in recipes(folder / "raw")]:
        trained = read_json(raw / f"{name}.train.json")
        for mode in modes:
            calibration = (trained.get("calibration") or {}).get(mode)
            row = {"recipe": name, "routing": mode, "flags": flags, "steps": trained["steps"],
                   "objective": flag_value(flags, "--objective", "lm"),
                   "train_wall_s": trained["wall_time_s"], "train_loss": trained["train_loss"],
                   "train_val_loss": trained["val_losses"].get(mode), "init_val_loss": trained["init_val_loss"],
                   "calibrated_processed_fraction": (sum(calibration.values()) / len(calibration)
                                                     if calibration else None)}
            row.update(quality(raw / f"{name}.{mode}", mode))
            for corpus in CORPORA:
                row[f"loss_increase_pct_{corpus}"] = 100 * (row[f"loss_{corpus}"] / dense[f"loss_{corpus}"] - 1)
            profile = raw / f"{name}.{mode}.profile.json"
            row.update(speed(read_json(profile)) if profile.is_file() and profile.stat().st_size else
                       {"profiled_seq_lens": []})  # a run stopped before its profile: quality only
            long_profile = raw / f"{name}.{mode}.profile-long.json"
            if long_profile.is_file():
                long = speed(read_json(long_profile))
                row["long_seq_lens"] = long.pop("profiled_seq_lens")
                row["long_profile_load_avg"] = long.pop("profile_load_avg")
                row.update(long)
            if (raw / f"{name}.export.json").is_file():
                exported = read_json(raw / f"{name}.export.json")
                runtime = read_json(raw / f"{name}.runtime.json")
                row["export_valid"] = exported.get("valid")
                row["runtime_texts"] = runtime["texts"]
                row["runtime_equals_generate"] = runtime["texts"] == row["greedy_texts"]
            t = max(row["profiled_seq_lens"], default=None)
            row["goal_met"] = bool(
                t is not None and row[f"decode_speedup_T{t}"] >= GOAL_SPEEDUP and row[f"prefill_speedup_T{t}"] >= GOAL_SPEEDUP
                and all(row[f"loss_increase_pct_{c}"] <= GOAL_LOSS_INCREASE_PCT for c in CORPORA)
                and row[f"kv_cache_ratio_T{t}"] <= GOAL_KV_CACHE)
            rows.append(row)
    return run, rows


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(run: dict, rows: list[dict]) -> str:
    dense, points = rows[0], rows[1:]
    profiled = [row for row in points if row["profiled_seq_lens"]]
    lengths = profiled[0]["profiled_seq_lens"] if profiled else []
    settings = run["settings"]
    lines = [
        f"SmolLM2-135M-Instruct ({run['gguf']}) converted by {len(points)} recipe/mode points; "
        f"the steps of each (batch {settings['batch']} x {settings['seq_len']} tokens) in the table; "
        f"losses (nats/token) on {settings['eval_windows']} windows of {settings['seq_len']} tokens per corpus, "
        f"causal routing; speed-ups = dense median latency / converted, batch 1, "
        f"{settings['profile_repeats']} repeats, interleaved; script wall time "
        f"{' s and '.join('?' if wall is None else str(wall) for wall in run['wall_s_each'])} s"
        f"{' (one per results folder)' if len(run['wall_s_each']) > 1 else ''}.",
        "",
        f"Dense: stdlib {dense['loss_stdlib']:.4f}, prose {dense['loss_prose']:.4f}"
        + "".join(f"; T {t}: prefill {profiled[0][f'dense_prefill_ms_T{t}']:.0f} ms, decode step "
                  f"{profiled[0][f'dense_decode_ms_T{t}']:.1f} ms" for t in lengths)
        + (" (as timed beside the first profiled point)." if profiled else "."),
        "",
    ]
    header = ["recipe", "mode", "steps (objective), train s", "stdlib loss (Δ)", "prose loss (Δ)", "processed"]
    for t in lengths:
        header += [f"prefill x T{t}", f"decode x T{t}"]
    header += [f"KV T{lengths[-1]}" if lengths else "KV", "goal"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in points:
        cells = [row["recipe"], row["routing"], f"{row['steps']} ({row['objective']}), {row['train_wall_s']:.0f}"]
        for corpus in CORPORA:
            cells.append(f"{row[f'loss_{corpus}']:.4f} ({row[f'loss_increase_pct_{corpus}']:+.1f}%)")
        cells.append(f"{percent(row['processed_fraction_stdlib'])} / {percent(row['processed_fraction_prose'])}")
        for t in lengths:
            if not row["profiled_seq_lens"]:
                cells += ["-", "-"]
                continue
            cells.append(f"{row[f'prefill_speedup_T{t}']:.2f} ({row[f'prefill_speedup_ideal_T{t}']:.2f})")
            cells.append(f"{row[f'decode_speedup_T{t}']:.2f} ({row[f'decode_speedup_ideal_T{t}']:.2f})")
        cells.append(f"{row[f'kv_cache_ratio_T{lengths[-1]}']:.2f}" if row["profiled_seq_lens"] else "-")
        cells.append("yes" if row["goal_met"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Δ: loss increase over the dense model on the same windows. processed: mean share of tokens the routed "
        "blocks process (stdlib / prose, evaluation). Speed-ups: measured (ideal from counted FLOPs). "
        f"KV: converted / dense KV-cache bytes stored after T + {settings['decode_tokens']} tokens. goal: "
        f">= {GOAL_SPEEDUP}x prefill and decode at the longest T, loss within {GOAL_LOSS_INCREASE_PCT:g}% on both "
        f"corpora, KV cache <= {GOAL_KV_CACHE}x.",
        "",
    ]
    long_rows = [row for row in points if row.get("long_seq_lens")]
    if long_rows:
        lines += ["Long context (a second profile, batch 1):", "",
                  "| recipe | mode | T | prefill x | decode x | KV | dense prefill ms | dense decode ms | load avg |",
                  "|" + " --- |" * 9]
        for row in long_rows:
            for t in row["long_seq_lens"]:
                lines.append(
                    f"| {row['recipe']} | {row['routing']} | {t} | {row[f'prefill_speedup_T{t}']:.2f} "
                    f"({row[f'prefill_speedup_ideal_T{t}']:.2f}) | {row[f'decode_speedup_T{t}']:.2f} "
                    f"({row[f'decode_speedup_ideal_T{t}']:.2f}) | {row[f'kv_cache_ratio_T{t}']:.2f} | "
                    f"{row[f'dense_prefill_ms_T{t}']:.0f} | {row[f'dense_decode_ms_T{t}']:.1f} | "
                    f"{row['long_profile_load_avg'][0][0]:.1f} / {row['long_profile_load_avg'][1][0]:.1f} |")
        lines.append("")
    task_rows = [row for row in rows if row.get("task_acc")]
    if task_rows:
        names = sorted({task for row in task_rows for task in row["task_acc"]})
        lines += ["Multiple-choice accuracy (TASKS, lm-eval `acc`, zero-shot):", "",
                  "| recipe | mode | " + " | ".join(names) + " |", "|" + " --- |" * (2 + len(names))]
        for row in task_rows:
            lines.append(f"| {row['recipe']} | {row['routing']} | "
                         + " | ".join(f"{row['task_acc'][n]:.3f}" if n in row["task_acc"] else "-" for n in names)
                         + " |")
        lines.append("")
    for row in points:
        if "export_valid" in row:
            lines += [f"Export of {row['recipe']}: bundle valid {row['export_valid']}; modcli-run's greedy text "
                      f"{'equals' if row['runtime_equals_generate'] else 'differs from'} modcli generate's "
                      f"({row['routing']} routing).", ""]
    lines += [
        "Greedy text (first prompt, then second; newlines as ⏎):",
        "",
        "| recipe | mode | " + " | ".join(f"prompt {i + 1}" for i in range(len(dense["greedy_texts"]))) + " |",
        "|" + " --- |" * (2 + len(dense["greedy_texts"])),
    ]
    for row in rows:
        texts = [text.replace("\n", "⏎").replace("|", "\\|") for text in row["greedy_texts"]]
        lines.append(f"| {row['recipe']} | {row['routing']} | " + " | ".join(f"`{t}`" for t in texts) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: list[dict], path: Path, ideal: bool = False) -> None:
    """Loss increase (both corpora) against the decode-step speed-up at the main profile's longest length; beside
    it, where long-context profiles exist, against the prefill speed-up at the long length. `ideal`: the speed-ups
    from counted FLOPs instead of the measured ones (for profiles taken on a machine too busy to time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    points = [row for row in rows[1:] if row["profiled_seq_lens"]]
    t = max(points[0]["profiled_seq_lens"])
    long_points = [row for row in points if row.get("long_seq_lens")]
    panels = [("decode", t, points)]
    if long_points:
        panels.append(("prefill", max(long_points[0]["long_seq_lens"]), long_points))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 + 4.5 * len(panels), 5.5), squeeze=False)
    number = {id(row): index + 1 for index, row in enumerate(points)}
    y_high = 3 * max(GOAL_LOSS_INCREASE_PCT, *(r[f"loss_increase_pct_{c}"] for r in points for c in CORPORA))
    y_low = min(-1.0, *(r[f"loss_increase_pct_{c}"] for r in points for c in CORPORA))
    for ax, (part, length, shown) in zip(axes[0], panels, strict=True):
        ax.axhline(GOAL_LOSS_INCREASE_PCT, color="green", lw=0.8, ls="--",
                   label=f"goal: loss +{GOAL_LOSS_INCREASE_PCT:g}%")
        ax.axvline(GOAL_SPEEDUP, color="green", lw=0.8, ls=":", label=f"goal: {GOAL_SPEEDUP}x")
        ax.axvline(1.0, color="gray", lw=0.6)
        for row in shown:
            index = number[id(row)]
            color = f"C{(index - 1) % 10}"
            x = row[f"{part}_speedup{'_ideal' if ideal else ''}_T{length}"]
            ys = [row[f"loss_increase_pct_{c}"] for c in CORPORA]
            ax.plot([x, x], ys, color=color, lw=0.8)
            ax.scatter([x], [ys[0]], color=color, marker="o", label=f"{index}: {row['recipe']} ({row['routing']})")
            ax.scatter([x], [ys[1]], color=color, marker="^")
            ax.annotate(str(index), (x, max(ys)), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)
        x_low, x_high = ax.get_xlim()
        x_low, x_high = min(x_low, 0.95), max(x_high, GOAL_SPEEDUP) + 0.1
        ax.add_patch(Rectangle((GOAL_SPEEDUP, y_low), x_high - GOAL_SPEEDUP, GOAL_LOSS_INCREASE_PCT - y_low,
                               color="green", alpha=0.12, label="goal region"))
        ax.set_xlim(x_low, x_high)
        ax.set_ylim(y_low, y_high)
        ax.set_yscale("symlog", linthresh=1.0)
        how = "ideal from counted FLOPs" if ideal else "measured"
        ax.set_xlabel(f"{part} speed-up over dense at T {length} (batch 1, CPU, {how})")
        ax.set_ylabel("validation loss increase over dense, % (causal routing)")
        ax.grid(alpha=0.3)
    first = axes[0][0]  # holds every point: its legend is the figure's
    first.scatter([], [], color="black", marker="o", label="circle: stdlib code")
    first.scatter([], [], color="black", marker="^", label="triangle: prose (common-licenses)")
    axes[0][-1].legend(*first.get_legend_handles_labels(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle("SmolLM2-135M converted to MoD: quality against speed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="bench/results/smollm2", type=Path)
    parser.add_argument("more", nargs="*", type=Path, help="more results folders (their dense model: RESULTS')")
    parser.add_argument("--ideal", action="store_true",
                        help="the figure's speed-ups from counted FLOPs (profiles on a busy machine)")
    args = parser.parse_args()
    results = args.results
    run, rows = collect(results, args.more)
    with (results / "results.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    (results / "table.md").write_text(table(run, rows))
    if any(row.get("profiled_seq_lens") for row in rows[1:]):
        figure(rows, results / "frontier.png", args.ideal)
    print((results / "table.md").read_text())


if __name__ == "__main__":
    main()
