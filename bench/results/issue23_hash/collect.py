"""Collect the hash-routing runs of docs/results.md (issue 23) into runs.jsonl: each run's command, training wall
time, `modcli eval` causal losses and the dropped share of expert choices per step (metrics.jsonl's
`expert_dropped`).

    python bench/results/issue23_hash/collect.py runs logs > bench/results/issue23_hash/runs.jsonl

(The `--hash-table balanced` runs were collected from their own folders and appended with `>>`; runs made before
the option have the random table, `"hash_table": "random"`.)

It also copies each run's `modcli eval --json` output and its last checkpoint's config.json next to runs.jsonl
(NAME.eval.json, NAME.config.json).

`runs/NAME/` is the run folder, `logs/NAME.{train,eval,time}.json` the `--json` outputs of `modcli train` and
`modcli eval` and the wall time of `modcli train`, `logs/NAME.command.txt` the `modcli train` command (each then
evaluated with `modcli eval runs/NAME --batches 16 --batch-size 8 --device cpu --json`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def dropped(metrics: Path) -> dict | None:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    shares = {row["step"]: row["expert_dropped"] for row in rows if "expert_dropped" in row}
    if not shares:
        return None
    late = [share for step, share in shares.items() if step >= 10]
    return {"per_step": [round(shares[step], 4) for step in sorted(shares)],
            "at_step": {str(step): round(shares[step], 4) for step in (1, 10, 20, 50, 100, 200, 300)
                        if step in shares},
            "steps_10_on": {"mean": round(sum(late) / len(late), 4), "max": round(max(late), 4),
                            "steps_above_0.1": sum(share > 0.1 for share in late), "steps": len(late)}}


def main() -> None:
    runs, logs = Path(sys.argv[1]), Path(sys.argv[2])
    for time_file in sorted(logs.glob("*.time.json")):
        name = time_file.name.removesuffix(".time.json")
        eval_file = logs / f"{name}.eval.json"
        if not eval_file.exists():
            continue
        train = json.loads((logs / f"{name}.train.json").read_text())
        evaluation = json.loads(eval_file.read_text())
        config_file = sorted((runs / name).glob("step-*/config.json"))[-1]
        config = json.loads(config_file.read_text())
        here = Path(__file__).resolve().parent
        (here / f"{name}.eval.json").write_text(eval_file.read_text())
        (here / f"{name}.config.json").write_text(config_file.read_text())
        print(json.dumps({
            "run": name, "command": (logs / f"{name}.command.txt").read_text().strip(),
            "model": {key: config["model"].get(key, "random" if key == "hash_table" else None)
                      for key in ("experts", "expert_routing", "hash_table", "expert_capacity_factor",
                                  "route_every", "router", "d_model", "n_layers")},
            "seed": config["train"]["seed"], "steps": train["steps"], "train_flops": train["flops"],
            "train_wall_s": json.loads(time_file.read_text())["train_s"], "tokens_per_s": round(train["tokens_per_s"]),
            "eval": {r["routing"]: round(r["loss"], 4) for r in evaluation["results"]},
            "expert_dropped": dropped(runs / name / "metrics.jsonl"),
        }))


if __name__ == "__main__":
    main()
