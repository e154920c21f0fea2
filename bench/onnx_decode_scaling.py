"""How an onnxruntime decode step scales with the KV cache: the read-only decode graph (bundle format 2).

    python bench/wait_quiet.py --max-wait 120 && python bench/onnx_decode_scaling.py

Exports freshly initialised MoD models shaped like the tiny preset (d 128, 4 layers, every other block routed,
capacity 0.125) to decode-only bundles, the routers' output bias set so that the routed blocks skip every token
("skip") or process every token ("process"), and times one onnxruntime decode step through modcli_runtime's
`time_bundle` (batch 1, one intra-op thread, OMP_NUM_THREADS=1; the graph plus the in-place row write, warm-up
calls first, the median of --repeats calls per round, rounds alternating the settings so that a shared machine
disturbs them alike). Settings: the routed layers' cache at 64 / 4096 / 32768 tokens with the dense layers at 64,
and the whole cache at 64 / 4096. With --run DIR its newest checkpoint is exported instead and its own routing
decides (the share of calls in which each routed block did its work is reported).

For comparison it also exports the format-1 decode graph (modcli/decode/graphs.py at --old-commit, which returned
every layer's whole updated cache) of the "skip" model, and times it and the format-2 graph alone (session.run on
the same fixed caches, no runtime around them, nothing written back). Skip that with --no-old.

Writes bench/results/onnx_decode_scaling.json (--out) and prints a Markdown table. The target: a step with 4096
tokens in the routed layers (their blocks skipping) within 1.2x of one with 64.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch / onnxruntime start their thread pools

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [(64, 64), (64, 4096), (64, 32768), (4096, 4096)]
"""(dense layers' cached tokens, routed layers' cached tokens)."""
OLD_COMMIT = "3a977b5"
"""The last commit whose decode graph returned the whole updated cache (bundle format 1)."""


def fresh_checkpoint(root: Path, router_bias: float) -> Path:
    from modcli.checkpoint.store import save_checkpoint
    from modcli.config import ModelConfig, RunConfig, TrainConfig
    from modcli.models.decoder import MoDDecoder

    torch.manual_seed(0)
    config = ModelConfig(d_model=128, n_layers=4, n_heads=4, seq_len=128, capacity=0.125, route_every=2)
    model = MoDDecoder(config).eval()
    with torch.no_grad():
        for block in model.blocks:
            if block.router is not None:
                block.router.score.bias.fill_(router_bias)  # causal rule "router logit > 0": all skip or all process
    run = RunConfig(model=config, train=TrainConfig(out=str(root)))
    return save_checkpoint(root, 1, model, None, run, {"step": 1}, keep=1)


def export_decode(checkpoint: str | Path, out: Path) -> Path:
    from modcli.bundle.writer import ExportConfig, export

    result = export(ExportConfig(checkpoint=str(checkpoint), out=str(out), provider="cpu", graphs=["decode"],
                                 decode_steps=4, force=True))
    if not result.valid:
        raise SystemExit(f"export of {checkpoint} failed validation: {result.failures}")
    return out


def time_new(bundle: Path, dense: int, routed: int, repeats: int, warmup: int, seed: int) -> dict:
    from modcli_runtime import time_bundle

    decode = time_bundle(bundle, batch=1, seq_len=1, cache_tokens=dense, routed_cache_tokens=routed,
                         repeats=repeats, warmup=warmup, threads=1, seed=seed)["decode"]
    return {key: decode[key] for key in ("latency_ms", "latency_min_ms", "latency_max_ms", "calls_with_block_work")}


# ----------------------------------------------------------------------------------------------- the format-1 graph


def old_decode_onnx(checkpoint: Path, out: Path, commit: str) -> Path | None:
    """The format-1 DecodeStepGraph (whole cache in, whole updated cache out) of `checkpoint` as ONNX."""
    try:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:modcli/decode/graphs.py"], check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"note: no format-1 comparison (git show {commit} failed: {exc})", file=sys.stderr)
        return None
    from torch.export import Dim

    from modcli.bundle.lowering import GraphSpec, export_onnx, export_program
    from modcli.checkpoint.store import load_model_from

    old = types.ModuleType("old_export_graphs")  # registered: torch.compile (inside torch.cond) imports it by name
    sys.modules[old.__name__] = old
    exec(compile(source, f"{commit}:modcli/decode/graphs.py", "exec"), old.__dict__)
    model, _, _ = load_model_from(checkpoint)
    config = model.config
    routing = model.causal_modes()[0]
    batch = Dim("batch", min=1)
    cache, shapes, names, outputs = [], [], ["tokens", "positions"], ["logits"]
    for layer in range(config.n_layers):
        shape = (2, config.kv_heads, 13 + 2 * layer, config.head_dim)
        cache += [torch.randn(shape), torch.randn(shape), torch.tensor([4, 7])]
        slots = Dim(f"slots_{layer}", min=1)
        shapes += [{0: batch, 2: slots}, {0: batch, 2: slots}, {0: batch}]
        names += [f"{kind}.{layer}" for kind in ("keys", "values", "lengths")]
        outputs += [f"next_{kind}.{layer}" for kind in ("keys", "values", "lengths")]
    outputs += [f"processed.{layer}" for layer in config.routed_layers()]
    spec = GraphSpec("decode", old.DecodeStepGraph(model, routing).eval(),
                     (torch.tensor([1, 2]), torch.tensor([9, 12]), *cache), ({0: batch}, {0: batch}, tuple(shapes)),
                     names, outputs, {}, {}, routing, True, "format 1")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_v1.onnx"
    export_onnx(spec, export_program(spec), path, 18)
    return path


def time_graph(path: Path, n_layers: int, routed_layers: list[int], kv_heads: int, head_dim: int, dense: int,
             routed: int, repeats: int, warmup: int, seed: int) -> dict:
    """One decode graph alone through onnxruntime (no runtime around it, nothing written), on fixed caches, timed
    as `time_bundle` times (modcli_runtime.timing)."""
    import onnxruntime as ort
    from modcli_runtime.timing import interleaved, latency_stats

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {"positions": np.array([dense])}
    for layer in range(n_layers):
        tokens = routed if layer in routed_layers else dense
        shape = (1, kv_heads, tokens + 1, head_dim)
        feeds[f"keys.{layer}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"values.{layer}"] = rng.standard_normal(shape).astype(np.float32)
        feeds[f"lengths.{layer}"] = np.array([tokens])
    def step() -> dict[str, float]:
        feeds["tokens"] = rng.integers(0, 256, 1)
        start = time.perf_counter()
        session.run(None, feeds)
        return {"decode": time.perf_counter() - start}

    return latency_stats(interleaved({"decode": step}, warmup, repeats)["decode"]["decode"], 1)


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a run folder (its newest checkpoint) instead of fresh skip/process models")
    parser.add_argument("--repeats", type=int, default=60, help="timed calls per setting per round (median)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-commit", default=OLD_COMMIT)
    parser.add_argument("--no-old", action="store_true", help="skip the format-1 comparison")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "onnx_decode_scaling.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "export"))

    work = Path(tempfile.mkdtemp(prefix="onnx-decode-scaling-"))
    try:
        measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args: argparse.Namespace, work: Path) -> None:
    checkpoints = ({"run": Path(args.run)} if args.run else
                   {"skip": fresh_checkpoint(work / "skip", -30.0), "process": fresh_checkpoint(work / "process", 30.0)})
    bundles = {}
    for name, checkpoint in checkpoints.items():
        print(f"exporting the {name} model", file=sys.stderr)
        bundles[name] = export_decode(checkpoint, work / f"{name}-bundle")
    old_path = None
    if not args.no_old and "skip" in checkpoints:
        print(f"exporting the format-1 decode graph of {args.old_commit} (skip model)", file=sys.stderr)
        old_path = old_decode_onnx(checkpoints["skip"], work / "v1", args.old_commit)

    from modcli_runtime import load_bundle

    spec = load_bundle(next(iter(bundles.values()))).cache_spec
    jobs = [("v2", name, dense, routed) for name in bundles for dense, routed in SETTINGS]
    graphs = {}
    if old_path is not None:
        graphs = {"v2 graph": bundles["skip"] / "decode.onnx", "v1 graph": old_path}
        jobs += [(graph, "skip", dense, routed) for graph in graphs for dense, routed in SETTINGS]
    rounds: dict[tuple, list[dict]] = {job: [] for job in jobs}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr)
        for job in jobs:
            graph, name, dense, routed = job
            if graph == "v2":
                rounds[job].append(time_new(bundles[name], dense, routed, args.repeats, args.warmup, round_index))
            else:
                rounds[job].append(time_graph(graphs[graph], spec.n_layers, spec.routed_layers, spec.n_heads, spec.head_dim,
                                            dense, routed, args.repeats, args.warmup, round_index))
    rows = []
    for (graph, name, dense, routed), results in rounds.items():
        label = {"v2": "format 2 (runtime step)", "v2 graph": "format 2 (graph only)",
                 "v1 graph": "format 1 (graph only)"}[graph]
        rows.append({"graph": label, "routed_blocks": name, "dense_cache_tokens": dense,
                     "routed_cache_tokens": routed,
                     "latency_ms": statistics.median(r["latency_ms"] for r in results),
                     "min_ms": min(r["latency_min_ms"] for r in results),
                     "round_medians_ms": [round(r["latency_ms"], 4) for r in results],
                     "calls_with_block_work": results[-1].get("calls_with_block_work")})

    def latency(graph: str, name: str, dense: int, routed: int) -> float | None:
        return next((r["latency_ms"] for r in rows if (r["graph"], r["routed_blocks"], r["dense_cache_tokens"],
                                                         r["routed_cache_tokens"]) == (graph, name, dense, routed)),
                    None)

    name = "skip" if "skip" in bundles else "run"
    at_64 = latency("format 2 (runtime step)", name, 64, 64)
    at_4096 = latency("format 2 (runtime step)", name, 64, 4096)
    ratio = at_4096 / at_64
    import onnxruntime

    payload = {
        "command": "python bench/onnx_decode_scaling.py " + " ".join(sys.argv[1:]),
        "model": ("fresh, d_model 128, 4 layers (1 and 3 routed), 4 heads, capacity 0.125, router bias -30 (skip) "
                  "or +30 (process)") if not args.run else f"--run {args.run}",
        "timing": {"batch": 1, "threads": 1, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                   "repeats": args.repeats, "warmup": args.warmup, "rounds": args.rounds,
                   "latency_ms": "median over rounds of each round's median",
                   "format 2 (runtime step)": "modcli_runtime.time_bundle: the graph plus CacheSpec.write_rows",
                   "format 2 (graph only)": "the read-only decode graph alone, session.run on fixed caches",
                   "format 1 (graph only)": f"the decode graph of {args.old_commit} alone (it returned the whole "
                                            "cache), session.run on fixed caches"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "onnxruntime": onnxruntime.__version__, "torch": torch.__version__},
        "rows": rows,
        "target": {"what": f"format 2 runtime step, routed blocks {name}, dense cache 64: step at 4096 routed "
                           "tokens / at 64",
                   "ratio": ratio, "within_1.2x": ratio <= 1.2},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")

    print("| graph | routed blocks | dense layers' cache | routed layers' cache | step ms (median) | min ms |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['graph']} | {r['routed_blocks']} | {r['dense_cache_tokens']} | {r['routed_cache_tokens']} | "
              f"{r['latency_ms']:.3f} | {r['min_ms']:.3f} |")
    print(f"\n4096 vs 64 routed tokens ({name}): {ratio:.2f}x (target <= 1.2x) -> {args.out}")


if __name__ == "__main__":
    main()
