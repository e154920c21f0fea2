"""Candidate trims of an eager block's fixed cost, A/B against the code as it is, interleaved in one process.

Small preset, batch 1, T 256, no grad, 2 threads. Each variant is patched into `modcli.models.decoder` for its half
of every repeat (the order of A and B alternates); the script first checks that the variant's logits equal the
baseline's bit for bit. Variants (joined with "+"):

- `roll`: RoPE from full-width tables C = [cos, cos], S = [-sin, sin] built once per forward, x * C + roll(x) * S
  (the same products and sums as `apply_rope`, so bit-identical; 5 operators instead of 10);
- `nodrop`: no `nn.Dropout` module calls outside training;
- `flat`: the selected tokens read and written as whole rows of the flattened (B T, D) view (`index_select` and
  `index_copy_` on a copy) in place of `gather` / `scatter` with an expanded index;
- `lean`: every routed block of a no-grad top-k forward (route part "block", no cache) computed by one function that
  keeps only the operators the block needs: the router's linear, the stable sort, flat row reads and writes, the RoPE
  rows of the selected positions read once, `F.rms_norm`, the four products, SDPA, SiLU(gate) x up, the router
  weight and `x + w f(x)`; no module calls besides the linears, no dropout, no dataclasses, no dtype conversions. The
  most a rewrite of the block in Python could take off (a bound, not a proposal: a second copy of the block).

    python bench/eager_trims_ab.py --variant roll+nodrop [--repeats 80] [--block-repeats 600] [--packed-linears]

Prints the median (and quartiles) of the whole-model forward and causal prefill, MoD and dense, and of one routed and
one dense block called alone. Recorded run: bench/results/speed/eager_trims_ab.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import torch

import modcli.models.decoder as decoder
from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.models.cache import DecoderCache
from modcli.models.routing.calibration import calibrate_causal_rules
from modcli.packed_linear import PackedLinears

BASELINE = dict(config_rope=decoder.config_rope, apply_rope=decoder.apply_rope, delta=decoder.Block.delta,
                gather_tokens=decoder.gather_tokens, scatter_tokens=decoder.scatter_tokens, forward=decoder.Block.forward)


def flat_rows(idx, seq_len):
    """(B, k) positions -> (B k,) rows of the (B T, D) view."""
    if idx.shape[0] == 1:
        return idx[0]
    return (idx + torch.arange(0, idx.shape[0] * seq_len, seq_len, device=idx.device)[:, None]).reshape(-1)


def gather_flat(x, idx):
    batch, seq_len, width = x.shape
    return x.reshape(batch * seq_len, width).index_select(0, flat_rows(idx, seq_len)).view(batch, -1, width)


def scatter_flat(x, idx, updated):
    batch, seq_len, width = x.shape
    out = x.clone()
    out.view(batch * seq_len, width).index_copy_(0, flat_rows(idx, seq_len), updated.reshape(-1, width))
    return out


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


def lean_routed_block(block, x, cos, sin):
    """`lean`: a routed block of a no-grad top-k forward with only the operators it needs (same values, bit for bit)."""
    batch, seq_len, width = x.shape
    attn, mlp = block.attn, block.mlp
    k = block.router.static_tokens(seq_len, block.config.capacity)
    logits = block.router.score(x).squeeze(-1)  # (B, T)
    idx = logits.sort(dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values  # (B, k)
    rows = flat_rows(idx, seq_len)  # (B k,)
    selected = x.reshape(batch * seq_len, width).index_select(0, rows).view(batch, k, width)
    positions = idx.reshape(-1)
    c = cos.index_select(0, positions).view(batch, k, 1, -1)
    s = sin.index_select(0, positions).view(batch, k, 1, -1)
    rotated = attn.n_heads + attn.n_kv_heads
    heads = attn.qkv(torch.nn.functional.rms_norm(selected, (width,), block.attn_norm.weight, block.attn_norm.eps))
    heads = heads.view(batch, k, rotated + attn.n_kv_heads, attn.head_dim)
    x1, x2 = heads[:, :, :rotated].chunk(2, dim=-1)
    q, key = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).transpose(1, 2).split(
        [attn.n_heads, attn.n_kv_heads], dim=1)
    value = heads[:, :, rotated:].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, attn.share_kv(key), attn.share_kv(value), is_causal=True)
    attn_update = attn.proj(out.transpose(1, 2).reshape(batch, k, attn.sizes[0]))
    normed = torch.nn.functional.rms_norm(selected + attn_update, (width,), block.mlp_norm.weight, block.mlp_norm.eps)
    gate, up = mlp.gate_up(normed).chunk(2, dim=-1)
    mlp_update = mlp.down(torch.nn.functional.silu(gate) * up)
    weight = block.router.weight(logits.gather(1, idx)).unsqueeze(-1)  # (B, k, 1)
    out = x.clone()
    out.view(batch * seq_len, width).index_copy_(0, rows, (selected + weight * (attn_update + mlp_update)).view(-1, width))
    return out


def forward_lean(self, x, cos, sin, routing, want_predictor=False, cache=None, cache_rows=None, lengths=None,
                 capacity=None, k=None, previous_attention=None, token_ids=None):
    if (self.routed and routing == "topk" and not self.training and not torch.is_grad_enabled() and not want_predictor
            and cache is None and lengths is None and capacity is None and k is None and not self.mlp_reads_ids
            and self.config.route_part == "block" and not self.config.keep_first):
        return lean_routed_block(self, x, cos, sin), None  # no RoutingRecord: a forward without aux drops it
    return BASELINE["forward"](self, x, cos, sin, routing, want_predictor, cache, cache_rows, lengths, capacity, k,
                               previous_attention, token_ids)


def use(variant: str | None) -> None:
    decoder.config_rope, decoder.apply_rope = BASELINE["config_rope"], BASELINE["apply_rope"]
    decoder.Block.delta, decoder.Block.forward = BASELINE["delta"], BASELINE["forward"]
    decoder.gather_tokens, decoder.scatter_tokens = BASELINE["gather_tokens"], BASELINE["scatter_tokens"]
    parts = variant.split("+") if variant else []
    if "roll" in parts:
        decoder.config_rope, decoder.apply_rope = rope_full, apply_rope_roll
    if "nodrop" in parts:
        decoder.Block.delta = delta_no_dropout
    if "flat" in parts:
        decoder.gather_tokens, decoder.scatter_tokens = gather_flat, scatter_flat
    if "lean" in parts:
        decoder.Block.forward = forward_lean


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
    parser.add_argument("--packed-linears", action="store_true", help="run both models on oneDNN's packed kernel")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    mod, dense = build_model(config).eval(), build_model(dataclasses.replace(config, route_every=0)).eval()
    seq_len = config.seq_len
    tokens = torch.randint(0, config.vocab_size, (1, seq_len))
    shares = calibrate_causal_rules(mod, tokens)  # each causal rule keeps 12.5%, as `modcli profile` calibrates
    print(f"prefill shares processed per routed block: {shares}")
    linears = contextlib.ExitStack()
    if args.packed_linears:
        linears.enter_context(PackedLinears(mod))
        linears.enter_context(PackedLinears(dense))
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
    linears.close()


if __name__ == "__main__":
    main()
