"""Candidate trims of an eager block's fixed cost, A/B against the code as it is, interleaved in one process.

Small preset, batch 1, T 256, no grad, 2 threads. Each variant is patched into `modcli.models.decoder` for its half
of every repeat (the order of A and B alternates); the script first checks that the variant's logits equal the
baseline's bit for bit. Variants (joined with "+"):

- `roll`: RoPE from full-width tables C = [cos, cos], S = [-sin, sin] built once per forward, x * C + roll(x) * S
  (the same products and sums as `apply_rope`, so bit-identical; 5 operators instead of 10);
- `nodrop`: no `nn.Dropout` module calls outside training.

    python bench/eager_trims_ab.py --variant roll+nodrop [--repeats 80] [--block-repeats 600]

Prints the median (and quartiles) of the whole-model forward and causal prefill, MoD and dense, and of one routed and
one dense block called alone. Recorded run: bench/results/speed/eager_trims_ab.txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import modcli.models.decoder as decoder
from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.models.routing.calibration import calibrate_causal_rules

BASELINE = dict(config_rope=decoder.config_rope, apply_rope=decoder.apply_rope, delta=decoder.Block.delta)


def rope_full(config, positions):
    cos, sin = BASELINE["config_rope"](config, positions)
    return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)


def apply_rope_roll(x, c, s):
    xf = x.float()
    c, s = c[:, :, None], s[:, :, None]
    return (xf * c + xf.roll(x.shape[-1] // 2, -1) * s).to(x.dtype)


def delta_no_dropout(self, x, cos, sin, prefill=None, received=None, part="block", token_ids=None):
    drop = self.delta_dropout if self.training else (lambda t: t)
    if part == "mlp":
        return drop(self.mlp(self.mlp_norm(x), token_ids))
    attn_update = drop(self.attn(self.attn_norm(x), cos, sin, prefill, received))
    if part == "attention":
        return attn_update
    return attn_update + drop(self.mlp(self.mlp_norm(x + attn_update), token_ids))


def use(variant: str | None) -> None:
    decoder.config_rope, decoder.apply_rope = BASELINE["config_rope"], BASELINE["apply_rope"]
    decoder.Block.delta = BASELINE["delta"]
    parts = variant.split("+") if variant else []
    if "roll" in parts:
        decoder.config_rope, decoder.apply_rope = rope_full, apply_rope_roll
    if "nodrop" in parts:
        decoder.Block.delta = delta_no_dropout


def interleaved(calls: dict, variant: str, repeats: int) -> dict:
    times = {(side, name): [] for side in "AB" for name in calls}
    for repeat in range(repeats):
        for side in ("A", "B") if repeat % 2 == 0 else ("B", "A"):
            use(variant if side == "B" else None)
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[(side, name)].append(time.perf_counter() - start)
    use(None)
    return times


def report(times: dict, calls: dict) -> None:
    for name in calls:
        line = f"{name:16s}"
        for side in "AB":
            q1, q2, q3 = (v * 1e3 for v in statistics.quantiles(times[(side, name)], n=4))
            line += f"  {side} {q2:8.4f} ms [{q1:.3f}-{q3:.3f}]"
        a, b = (statistics.median(times[(side, name)]) for side in "AB")
        print(f"{line}  B/A {b / a:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="roll+nodrop")
    parser.add_argument("--repeats", type=int, default=80)
    parser.add_argument("--block-repeats", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    mod, dense = build_model(config).eval(), build_model(dataclasses.replace(config, route_every=0)).eval()
    seq_len = config.seq_len
    tokens = torch.randint(0, config.vocab_size, (1, seq_len))
    shares = calibrate_causal_rules(mod, tokens)  # each causal rule keeps 12.5%, as `modcli profile` calibrates
    print(f"prefill shares processed per routed block: {shares}")
    with torch.no_grad():
        baseline = mod(tokens), dense(tokens)
        use(args.variant)
        same = torch.equal(mod(tokens), baseline[0]) and torch.equal(dense(tokens), baseline[1])
        use(None)
    print(f"variant {args.variant}: logits bit-identical to the baseline: {same}")

    def forward(model):
        with torch.no_grad():
            model(tokens)

    def prefill(model, routing):
        cache = DecoderCache.allocate(model.config, 1, seq_len + 8, torch.device("cpu"))
        with torch.no_grad():
            model(tokens, routing, cache=cache)

    models = {"MoD forward": lambda: forward(mod), "dense forward": lambda: forward(dense),
              "MoD prefill": lambda: prefill(mod, "router"), "dense prefill": lambda: prefill(dense, "dense")}
    for call in models.values():
        call()
    times = interleaved(models, args.variant, args.repeats)
    report(times, models)
    for side in "AB":
        med = {name: statistics.median(times[(side, name)]) for name in models}
        print(f"{side}: MoD/dense forward {med['MoD forward'] / med['dense forward']:.4f}, "
              f"prefill {med['MoD prefill'] / med['dense prefill']:.4f}")

    x = torch.randn(1, seq_len, config.d_model)
    routed = next(block for block in mod.blocks if block.routed)
    plain = next(block for block in mod.blocks if not block.routed)

    def block_call(block):
        cos, sin = decoder.config_rope(config, torch.arange(seq_len))
        with torch.no_grad():
            block(x, cos, sin, "topk")

    blocks = {"routed block": lambda: block_call(routed), "dense block": lambda: block_call(plain)}
    report(interleaved(blocks, args.variant, args.block_repeats), blocks)


if __name__ == "__main__":
    main()
