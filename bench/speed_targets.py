"""Issue 13's speed targets on this machine: every backend's MoD / dense latency ratio against its FLOP ideal.

Runs `modcli profile --backends eager,compiled,onnxruntime --json` (fresh small-preset models, routers calibrated,
MoD and dense interleaved, median of --repeats after warm-up; compile time never timed) for the issue's shapes
and writes one JSON per shape plus a markdown table (ratio, ideal, ratio / ideal, target <= 1.10 x ideal, and
"compiled <= eager" / "onnxruntime <= eager" per model):

    python bench/speed_targets.py                      # all shapes, results in bench/results/speed/
    python bench/speed_targets.py --shapes b1 --repeats 5 --out /tmp/speed

Each shape starts once the CPU is quiet (bench/wait_quiet.py). Timings on a shared 2-core machine are noisy; the
table says what the load was.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "b1": ("small preset, batch 1, T 256", ["--preset", "small", "--batch-size", "1", "--seq-len", "256"],
           "forward,train,decode"),
    "b8": ("small preset, batch 8, T 256", ["--preset", "small", "--batch-size", "8", "--seq-len", "256"],
           "forward,train,decode"),
    "t1024": ("d 256, 8 layers, T 1024, batch 1", ["--preset", "small", "--batch-size", "1", "--seq-len", "1024"],
              "forward"),
}
TARGET = 1.10
NAMES = {"forward": "forward", "train_step": "training step", "prefill": "causal prefill", "decode": "decode step"}


def run(shape: str, out: Path, repeats: int, backends: str) -> Path:
    label, flags, measure = SHAPES[shape]
    subprocess.run([sys.executable, str(ROOT / "bench" / "wait_quiet.py"), "--max-wait", "300"], check=False)
    path = out / f"{shape}.json"
    command = [sys.executable, "-m", "modcli", "profile", *flags, "--compare", "dense", "--backends", backends,
               "--measure", measure, "--repeats", str(repeats), "--warmup", "2", "--no-memory", "--json"]
    print(f"== {label}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
    with open(path, "w") as f:
        subprocess.run(command, stdout=f, check=True, cwd=ROOT)
    return path


def measured_rows(result: dict):
    """(result, backend, measurement, MoD timing, dense timing, ratio) for every row a profile JSON measured."""
    for r in result["results"]:
        for backend in result["backends"]:
            for name in NAMES:
                mine = r["model"][name] if backend == "eager" else r["model"].get(backend, {}).get(name)
                theirs = r["baseline"][name] if backend == "eager" else r["baseline"].get(backend, {}).get(name)
                ratio = r["ratio"].get(f"{name}_latency" if backend == "eager" else f"{backend}_{name}_latency")
                if mine and theirs and ratio:
                    yield r, backend, name, mine, theirs, ratio


def table(paths: list[Path]) -> str:
    lines = ["| shape | backend | measurement | MoD ms | dense ms | ratio | FLOP ideal | ratio / ideal | target "
             "(<= 1.10 x ideal) | vs eager (MoD, dense) | compile s (MoD / dense) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for path in paths:
        result = json.loads(path.read_text())
        label = SHAPES[path.stem][0]
        notes.append(f"{label}: threads {result['threads']}, load {result['load_avg_start'][0]:.2f} -> "
                     f"{result['load_avg_end'][0]:.2f}, wall {result['wall_time_s']:.0f} s")
        for r, backend, name, mine, theirs, ratio in measured_rows(result):
            over = ratio["measured"] / ratio["ideal"]
            versus = "-"
            if backend != "eager" and r["model"][name] and r["baseline"][name]:
                faster = [mine["latency_ms"] / r["model"][name]["latency_ms"],
                          theirs["latency_ms"] / r["baseline"][name]["latency_ms"]]
                versus = ", ".join(f"{v:.2f}x" for v in faster)
            compile_s = " / ".join(f"{t['compile_s']:.0f}" for t in (mine, theirs) if t.get("compile_s"))
            lines.append(
                f"| {label} | {backend} | {NAMES[name]} | {mine['latency_ms']:.2f} | {theirs['latency_ms']:.2f} | "
                f"{ratio['measured']:.3f} | {ratio['ideal']:.3f} | {over:.2f} | "
                f"{'met' if over <= TARGET else 'missed'} | {versus} | {compile_s or '-'} |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {note}" for note in notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="b1,b8,t1024", help="comma-separated among " + ", ".join(SHAPES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "speed"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backends", default="eager,compiled,onnxruntime")
    parser.add_argument("--table-only", action="store_true", help="rebuild table.md from the JSON files in --out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r} (choose among {', '.join(SHAPES)})")
    paths = ([out / f"{s}.json" for s in shapes if (out / f"{s}.json").exists()] if args.table_only
             else [run(s, out, args.repeats, args.backends) for s in shapes])
    text = table(paths)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
