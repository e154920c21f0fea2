"""onnxruntime's thread spinning inside `modcli profile`: spinning off against spinning within a call and stopped
when it returns (`session.force_spinning_stop`), alternated run by run on one machine.

Each run is `modcli profile --preset small --batch-size B --seq-len 256 --compare dense --backends
eager,onnxruntime --measure forward,decode --repeats 7 --warmup 2 --no-memory --json` in a process of its own with
`modcli.profiling.onnx`'s two settings set as named, so the eager calls timed beside onnxruntime show whether the
threads slow them:

    python bench/ort_spinning_ab.py --rounds 3 --out bench/results/speed/spinning
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {"off": (False, False), "stop": (True, True)}
"""mode -> (SESSION_SPINNING, SESSION_STOP_SPINNING)."""
COLUMNS = [("eager", "forward"), ("eager", "decode"), ("onnxruntime", "forward"), ("onnxruntime", "decode")]


def run(mode: str, batch: int, path: Path) -> None:
    spinning, stop = MODES[mode]
    code = (f"import sys, modcli.profiling.onnx as po\npo.SESSION_SPINNING = {spinning}\n"
            f"po.SESSION_STOP_SPINNING = {stop}\nfrom modcli.cli import main\n"
            f"sys.argv = ['modcli', 'profile', '--preset', 'small', '--batch-size', '{batch}', '--seq-len', '256', "
            "'--compare', 'dense', '--backends', 'eager,onnxruntime', '--measure', 'forward,decode', '--repeats', "
            "'7', '--warmup', '2', '--no-memory', '--json']\nmain()\n")
    with open(path, "w") as f:
        subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.DEVNULL, check=True, cwd=ROOT)


def times(path: Path) -> list[float]:
    """MoD then dense: eager forward, eager decode, onnxruntime forward, onnxruntime decode (ms)."""
    result = json.loads(path.read_text())["results"][0]
    return [(result[who] if backend == "eager" else result[who][backend])[name]["latency_ms"]
            for who in ("model", "baseline") for backend, name in COLUMNS]


def table(paths: list[Path]) -> str:
    lines = ["| mode | run | MoD eager fwd | MoD eager decode | MoD ORT fwd | MoD ORT decode | dense eager fwd | "
             "dense eager decode | dense ORT fwd | dense ORT decode |", "|---" * 10 + "|"]
    medians = {}
    for path in paths:
        mode, _, run_name = path.stem.split("_")
        values = times(path)
        medians.setdefault(mode, []).append(values)
        lines.append(f"| {mode} | {run_name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    for mode, rows in medians.items():
        columns = zip(*rows, strict=True)
        lines.append(f"| {mode} | median | " + " | ".join(f"{statistics.median(c):.2f}" for c in columns) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speed" / "spinning")
    parser.add_argument("--table-only", action="store_true", help="rebuild table.md from the JSONs in --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for round_index in range(1, args.rounds + 1):
            for mode in MODES:
                print(f"== round {round_index}: {mode}", file=sys.stderr, flush=True)
                run(mode, args.batch_size, args.out / f"{mode}_b{args.batch_size}_r{round_index}.json")
    paths = sorted(args.out.glob("*_b*_r*.json"))
    (args.out / "table.md").write_text(table(paths))
    print(table(paths))


if __name__ == "__main__":
    main()
