"""The README table of bench/families.sh: one markdown row per run from its eval, profile and generate JSON.

    python bench/families_table.py bench/results/families runs/small-moe runs/small-staged ...

Training FLOPs and steps come from the run's metrics.jsonl (its last training record).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def last_training_record(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "step" in r][-1]


def ratio(profile: dict, key: str) -> str:
    entry = profile["results"][0]["ratio"].get(key) or {}
    measured, ideal = entry.get("measured"), entry.get("ideal")
    if measured is None:
        return "-"
    return f"{measured:.2f} ({ideal:.2f})" if ideal is not None else f"{measured:.2f}"


def row(out: Path, run: Path) -> str:
    name = run.name
    evaluation = json.loads((out / f"{name}.eval.json").read_text())
    profile = json.loads((out / f"{name}.profile.json").read_text())
    generated = json.loads((out / f"{name}.generate.json").read_text())
    trained = last_training_record(run)
    causal = [f"{r['routing']} {r['loss']:.4f}" for r in evaluation["results"] if r["causal"]]
    reference = [f"{r['routing']} {r['loss']:.4f}" for r in evaluation["results"] if not r["causal"]]
    model = profile["model"]
    kv = generated["kv_cache_bytes"] / generated["dense_kv_cache_bytes"]
    return " | ".join([
        f"| {model['label']}", f"{trained['flops']:.2e}", str(trained["step"]),
        f"{model['parameters']:,} / {model.get('active_parameters', model['parameters']):,}",
        ", ".join(causal), ", ".join(reference) or "-", ratio(profile, "train_step_latency"),
        ratio(profile, "forward_latency"), ratio(profile, "decode_latency"), f"{kv:.2f} |"])


def main() -> None:
    out, runs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    print("| model | training FLOPs | steps | parameters (total / active) | causal val loss | non-causal (reference) "
          "| training step / dense (ideal) | forward / dense (ideal) | decode step / dense (ideal) | KV stored / dense |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        print(row(out, run))


if __name__ == "__main__":
    main()
