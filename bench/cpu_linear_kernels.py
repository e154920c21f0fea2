"""nn.Linear on the CPU: PyTorch's default BLAS (aten: MKL in the x86 wheels) against oneDNN's prepacked kernel
(`modcli.packed_linear`, what generate, eval and profile use for float32 CPU inference), A/B in one run.

1. Products: the weight matrices of the small preset and of SmolLM2-135M at 1, 2, 32 and 256 rows: median time of
   each kernel (the two interleaved by the same harness), GFLOP/s, the speed-up, and whether
   `modcli.packed_linear.pays` packs that product.
2. Models: the eager forward (B x T), the causal prefill and the decode step (mean of --decode-tokens steps) of the
   small preset's MoD model and its dense twin (fresh weights), and with --run of any modcli run or checkpoint (e.g.
   SmolLM2-135M after `modcli import`), each with both kernels, interleaved call by call over --rounds by
   `modcli profile`'s harness (`modcli_runtime.timing.interleaved`), medians.

    python bench/cpu_linear_kernels.py [--rounds 15] [--run runs/smollm2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from modcli_runtime.timing import interleaved, timed

from modcli.checkpoint.store import load_model_from
from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.packed_linear import PackedLinears, pays
from modcli.profiling.calls import decode_call, forward_call, input_tokens
from modcli.profiling.config import ProfileConfig
from modcli.profiling.subjects import calibrate_routers

MATRICES = {  # name: (in, out)
    "small qkv": (256, 768), "small attention out": (256, 256), "small gate+up": (256, 1408),
    "small down": (704, 256), "SmolLM2 qkv": (576, 960), "SmolLM2 gate+up": (576, 3072),
    "SmolLM2 down": (1536, 576), "SmolLM2 head": (576, 49152),
}
ROWS = (1, 2, 32, 256)


def medians_s(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, interleaved by the one harness after 3 warm-up calls."""
    samples = interleaved({name: timed("call", call) for name, call in calls.items()}, 3, repeats)
    return {name: statistics.median(samples[name]["call"]) for name in calls}


def products() -> None:
    print("| matrix (in x out) | rows | aten ms | GFLOP/s | packed ms | GFLOP/s | aten / packed | packed by `pays` |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (fan_in, fan_out) in MATRICES.items():
        weight = torch.randn(fan_out, fan_in) / fan_in**0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        for rows in ROWS:
            x = torch.randn(1, rows, fan_in)
            repeats = 30 if fan_out * rows > 1 << 22 else 200
            medians = medians_s({
                "aten": lambda x=x, weight=weight: F.linear(x, weight),
                "onednn": lambda x=x, packed=packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            }, repeats)
            aten, onednn = medians["aten"], medians["onednn"]
            gflop = 2 * rows * fan_in * fan_out / 1e9
            print(f"| {name} ({fan_in} x {fan_out}) | {rows} | {aten * 1e3:.3f} | {gflop / aten:.0f} | "
                  f"{onednn * 1e3:.3f} | {gflop / onednn:.0f} | {aten / onednn:.2f} | "
                  f"{'yes' if pays(rows, fan_in * fan_out) else 'no'} |")


def models(args: argparse.Namespace) -> None:
    cpu = torch.device("cpu")
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    torch.manual_seed(0)
    mod = build_model(config).eval()
    calibrate_routers(mod, ProfileConfig(model=config, routing="router"), cpu, args.seq_len)  # as profile does
    subjects = {"small MoD": (mod, "router"), "small dense": (build_model(config.dense_twin()).eval(), "dense")}
    if args.run:
        model = load_model_from(args.run, cpu)[0].eval()
        subjects[args.run] = (model, (model.causal_modes() or ("dense",))[0])
    calls = {}
    for name, (model, routing) in subjects.items():
        tokens = input_tokens(model.config, args.batch_size, args.seq_len, 1337, cpu)
        packed = PackedLinears(model)
        for kernel, linears in (("aten", None), ("packed", packed)):
            calls[name, kernel, "forward"] = forward_call(model, tokens, cpu, "float32", linears)
            calls[name, kernel, "decode"] = decode_call(model, tokens, args.decode_tokens, routing, cpu, "float32",
                                                        linears=linears)
    samples = interleaved(calls, 2, args.rounds)
    print(f"\nbatch {args.batch_size}, T {args.seq_len}, {args.decode_tokens} decode steps, {args.rounds} rounds "
          f"interleaved, {torch.get_num_threads()} threads: median ms (aten / packed)")
    print("| model | forward aten | forward packed | x | prefill aten | prefill packed | x | decode step aten | "
          "decode step packed | x |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in subjects:
        cells = []
        for what, quantity in (("forward", "forward"), ("decode", "prefill"), ("decode", "decode")):
            aten, packed = (statistics.median(samples[name, kernel, what][quantity]) * 1e3
                            for kernel in ("aten", "packed"))
            cells += [f"{aten:.2f}", f"{packed:.2f}", f"{aten / packed:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    mod, dense = ({quantity: {kernel: statistics.median(samples[name, kernel, what][quantity])
                              for kernel in ("aten", "packed")}
                   for what, quantity in (("forward", "forward"), ("decode", "prefill"), ("decode", "decode"))}
                  for name in ("small MoD", "small dense"))
    print("\nsmall MoD / dense, each kernel: " + "; ".join(
        f"{quantity} {mod[quantity]['aten'] / dense[quantity]['aten']:.3f} (aten), "
        f"{mod[quantity]['packed'] / dense[quantity]['packed']:.3f} (packed)" for quantity in mod))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--run", help="also a modcli run or checkpoint folder (e.g. SmolLM2-135M after modcli import)")
    parser.add_argument("--skip-products", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    with torch.no_grad():
        if not args.skip_products:
            products()
        models(args)


if __name__ == "__main__":
    main()
