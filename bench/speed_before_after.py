"""The speed table of two revisions on one machine: each revision's own bench/speed_targets.py, alternated.

    python bench/speed_before_after.py --before 0d49c9d --rounds 2 --out bench/results/speed/before-after-issue-25

The "after" side is this working tree; the "before" side is a detached git worktree of --before (in a temporary
folder, removed at the end). For every round and shape, before and after run back to back
(the order flips every round), each in its own process with its own code, so both sides see the same machine and
the same load. Every run's JSON is kept (out/<side>-r<round>/<shape>.json) and table.md lists, per row of the
speed table, the MoD / dense ratio over ideal of both sides: the median over rounds, with the range, and the
MoD and dense times (ms, medians). "Ratio worse" and "MoD slower" say yes only where after's best round is
worse than before's worst.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from speed_targets import NAMES, SHAPES, measured_rows  # noqa: E402


def rows(path: Path) -> dict[tuple[str, str, str], dict]:
    """(shape label, backend, measurement) -> MoD ms, dense ms, ratio over ideal, from one speed_targets JSON."""
    result = json.loads(path.read_text())
    label = SHAPES[path.stem][0]
    return {(label, backend, NAMES[name]): {"mod_ms": mine["latency_ms"], "dense_ms": theirs["latency_ms"],
                                            "over": ratio["measured"] / ratio["ideal"]}
            for _, backend, name, mine, theirs, ratio in measured_rows(result)}


def table(out: Path, rounds: int, shapes: list[str], before: str) -> str:
    sides = {side: [{} for _ in range(rounds)] for side in ("before", "after")}
    for side, per_round in sides.items():
        for i in range(rounds):
            for shape in shapes:
                path = out / f"{side}-r{i + 1}" / f"{shape}.json"
                if path.exists():
                    per_round[i].update(rows(path))
    keys = [k for k in sides["after"][0] if all(k in r for s in sides.values() for r in s)]
    lines = [f"Before: {before}; after: this tree. {rounds} rounds, before and after alternated per shape.", "",
             "| shape | backend | measurement | ratio / ideal before: median [range] | after: median [range] | "
             "MoD ms before | MoD ms after | dense ms before | dense ms after | ratio worse | MoD slower |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        over = {s: [r[key]["over"] for r in sides[s]] for s in sides}
        mod_all = {s: [r[key]["mod_ms"] for r in sides[s]] for s in sides}
        mod = {s: statistics.median(v) for s, v in mod_all.items()}
        dense = {s: statistics.median(r[key]["dense_ms"] for r in sides[s]) for s in sides}
        cell = {s: f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" for s, v in over.items()}
        worse = "yes" if min(over["after"]) > max(over["before"]) else "no"
        slower = "yes" if min(mod_all["after"]) > max(mod_all["before"]) else "no"
        lines.append(f"| {' | '.join(key)} | {cell['before']} | {cell['after']} | {mod['before']:.2f} | "
                     f"{mod['after']:.2f} | {dense['before']:.2f} | {dense['after']:.2f} | {worse} | {slower} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision of the 'before' side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shapes", default="b1,b8,t1024")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    parser.add_argument("--table-only", action="store_true", help="rebuild table.md from the JSON files in --out")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown shape {unknown[0]!r} (choose among {', '.join(SHAPES)})")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.table_only:
        check = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"], cwd=ROOT,
                               capture_output=True, text=True)
        if check.returncode != 0:
            parser.error(f"--before: {args.before!r} is not a commit of this repository")
        tree = Path(tempfile.mkdtemp(prefix=f"modcli-{check.stdout.strip()[:12]}-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for i in range(args.rounds):
                for shape in shapes:
                    order = [("before", tree), ("after", ROOT)]
                    for side, root in order if i % 2 == 0 else order[::-1]:
                        print(f"== round {i + 1}, {shape}, {side}", file=sys.stderr, flush=True)
                        subprocess.run([sys.executable, str(root / "bench" / "speed_targets.py"), "--shapes", shape,
                                        "--repeats", str(args.repeats), "--out", str(out / f"{side}-r{i + 1}")],
                                       cwd=root, check=True, stdout=subprocess.DEVNULL)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
            shutil.rmtree(tree.parent, ignore_errors=True)
    text = table(out, args.rounds, shapes, args.before)
    (out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
