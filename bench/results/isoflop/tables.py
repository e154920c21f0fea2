"""The Markdown tables of docs/results.md's isoFLOP section from a sweep folder's results.jsonl: per budget, sizes x
variants, each cell the mean causal validation loss over seeds (the seeds in brackets), each curve's lowest point
in bold; then the analysis lines that `modcli sweep` prints.

    python bench/results/isoflop/tables.py bench/results/isoflop
"""

from __future__ import annotations

import sys
from pathlib import Path

from modcli.sweep.analysis import isoflop_analysis
from modcli.sweep.grid import analysis_lines, read_results


def tables(folder: Path) -> str:
    analysis = isoflop_analysis(list(read_results(folder).values()))
    out = []
    for label, entry in analysis.items():
        curves = entry["curves"]
        sizes = sorted({(p["size"], p["parameters"]) for c in curves.values() if c["dense"] for p in c["points"]},
                       key=lambda size: size[1])
        out += [f"**{label} training FLOPs**", "", "| size | parameters (dense) | " + " | ".join(curves) + " |",
                "| --- | --- | " + " | ".join("---" for _ in curves) + " |"]
        for size, parameters in sizes:
            cells = []
            for curve in curves.values():
                point = next((p for p in curve["points"] if p["size"] == size), None)
                if point is None:
                    cells.append("-")
                    continue
                text = f"{point['mean']:.4f}"
                if len(point["losses"]) > 1:
                    text += " (" + " / ".join(f"{loss:.4f}" for loss in point["losses"]) + ")"
                cells.append(f"**{text}**" if curve["minimum"]["size"] == size else text)
            out.append(f"| {size} | {parameters:,} | " + " | ".join(cells) + " |")
        out.append("")
    out += [f"- {line}" for line in analysis_lines(analysis)]
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/isoflop")))
