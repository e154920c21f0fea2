"""The floor of the eager batch-1 forward: MoD with its routed blocks reduced to the work the FLOP ideal counts.

Issue 25 asks the eager forward of the small preset at batch 1, T 256 to come within 1.10x of its FLOP ideal
ratio. This measures how close any implementation of the routed block that calls PyTorch's own kernels could
come. Forwards of fresh models (no grad, 2 threads), interleaved call by call over --rounds by the harness of
`modcli profile` (`modcli_runtime.timing.interleaved`: the order flipped every round, the garbage collector off),
medians:

- dense: the dense twin's forward;
- floor: the MoD model, every dense block as it is, every routed block reduced to exactly the operators whose
  FLOPs the ideal counts, on its own weights and in model order: the router's linear on all T tokens, then on k
  tokens (a view, no gather) the QKV matmul, causal attention (SDPA), the output projection, the gate/up and down
  matmuls, added into k rows in place. No RMSNorm, RoPE, top-k, gather, SiLU, router weight or scatter: what a
  perfectly fused kernel around the same matmul and attention kernels would add to nothing;
- "+ selection", "+ norms", "+ RoPE, SiLU": the ladder from the floor back to the block's whole computation
  (`STAGES`; the last is checked against the real forward's logits, to 1e-4);
- MoD: the MoD model's own forward (training-mode top-k routing, k = 32 of 256 tokens);
- with --packed-linears, every call above runs with both models' nn.Linear modules on oneDNN's packed kernel, as
  CPU inference in `modcli profile`, eval and generate does (the ladder calls the modules, so its matmuls take the
  same kernel as the real block's);
- with --compiled-block, "compiled block": the ladder's last stage compiled by torch.compile (one region per routed
  block, called from the eager forward; compile time untimed): whether Inductor's fusion is the kernel the floor
  leaves room for.

Prints each forward's median and quartiles, the ratios to dense, the FLOP ideal (FlopCounterMode on the real
forwards) and each ratio over it. A floor over 1.10 of the ideal means the goal cannot be met by fusing the
routed block's other operators; under it, it tells how much room a fused kernel would have, and the ladder where
the rest goes.

    python bench/routed_block_floor.py [--rounds 60] [--batch-size 1] [--packed-linears] [--compiled-block]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from modcli_runtime.timing import interleaved, timed

from modcli import packed_linear
from modcli.config import resolve_run_config
from modcli.models.build import build_model
from modcli.models.decoder import apply_rope, config_rope
from modcli.models.flops import counted_flops
from modcli.models.routing.selection import gather_tokens, residual_update, scatter_tokens, select_topk
from modcli.packed_linear import PackedLinears

STAGES = ("floor", "+ selection", "+ norms", "+ RoPE, SiLU")
"""The ladder from the floor to the real block: each stage adds real operators of the routed block to the one
before (the real MoD forward adds the rest: the dropout modules' identity calls, the Python of Block.forward)."""


def ladder_routed_block(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: int,
                        stage: int) -> torch.Tensor:
    """A routed block at `stage` of STAGES. Stage 0, the floor: only the counted work (the router's linear on every
    token, then on the first k tokens, a view, the four matmuls and causal attention, added into those rows in place).
    1: the real top-k of the router logits, gather, router weight and scatter. 2: the two RMSNorms and the residual
    between attention and MLP. 3: RoPE on queries and keys, SiLU(gate) x up: the block's whole computation."""
    attn, mlp = block.attn, block.mlp
    logits = block.router.score(x).squeeze(-1)  # (B, T): the router's linear, as the real block runs it
    batch = x.shape[0]
    if stage == 0:
        selected = x[:, :k]  # (B, k, D) a view: a fused kernel would read the selected rows where they are
    else:
        idx = select_topk(logits, k).selected_idx  # (B, k)
        selected = gather_tokens(x, idx)
    attn_input = block.attn_norm(selected) if stage >= 2 else selected
    heads = attn.qkv(attn_input).view(
        batch, k, attn.n_heads + 2 * attn.n_kv_heads, attn.head_dim)
    if stage >= 3:
        rotated = attn.n_heads + attn.n_kv_heads
        query_key = apply_rope(heads[:, :, :rotated], cos[idx], sin[idx]).transpose(1, 2)
        q, key = query_key.split([attn.n_heads, attn.n_kv_heads], dim=1)
        value = heads[:, :, rotated:].transpose(1, 2)
    else:
        q, key, value = heads.transpose(1, 2).split([attn.n_heads, attn.n_kv_heads, attn.n_kv_heads], dim=1)
    out = F.scaled_dot_product_attention(q, attn.share_kv(key), attn.share_kv(value), is_causal=True)
    attn_update = attn.proj(out.transpose(1, 2).reshape(batch, k, attn.sizes[0]))
    normed = block.mlp_norm(selected + attn_update) if stage >= 2 else attn_update
    hidden = mlp.down.weight.shape[1]
    gate_up = mlp.gate_up(normed)  # (B, k, 2 hidden)
    if stage >= 3:
        gate, up = gate_up.chunk(2, dim=-1)
        inner = F.silu(gate) * up
    else:
        inner = gate_up[..., :hidden]  # no SiLU or product: counted FLOPs only
    mlp_update = mlp.down(inner)
    if stage == 0:
        selected += mlp_update
        return x
    delta = attn_update + mlp_update if stage >= 2 else mlp_update
    weight = block.router.weight(logits.gather(1, idx)).unsqueeze(-1)  # (B, k, 1)
    return scatter_tokens(x, idx, residual_update(selected, delta, weight))


def ladder_forward(model, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: int,
                   stage: int, routed_block=ladder_routed_block) -> torch.Tensor:
    x = model.embed(tokens)
    for block in model.blocks:
        x = routed_block(block, x, cos, sin, k, stage) if block.routed else block(x, cos, sin, "topk")[0]
    return model.head(model.norm(x))


def summary(times: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(times, n=4)
    return f"{median * 1e3:.2f} ms (quartiles {q1 * 1e3:.2f}-{q3 * 1e3:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--packed-linears", action="store_true",
                        help="every nn.Linear of both models on oneDNN's packed kernel (modcli.packed_linear), as "
                             "modcli profile, eval and generate run CPU inference")
    parser.add_argument("--compiled-block", action="store_true",
                        help="also time the ladder's whole block compiled by torch.compile inside the eager forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = resolve_run_config("small", None, {"device": "cpu"}).model
    mod, dense = build_model(config).eval(), build_model(config.dense_twin()).eval()
    seq_len = config.seq_len
    k = next(block.router for block in mod.blocks if block.routed).static_tokens(seq_len, config.capacity)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, seq_len))
    cos, sin = config_rope(config, torch.arange(seq_len))
    calls = {"dense": lambda: dense(tokens)}
    for stage, name in enumerate(STAGES):
        calls[name] = lambda stage=stage: ladder_forward(mod, tokens, cos, sin, k, stage)
    if args.compiled_block:  # the whole block's computation as one compiled region, every other block eager
        compiled = torch.compile(ladder_routed_block, dynamic=False)
        calls["compiled block"] = lambda: ladder_forward(mod, tokens, cos, sin, k, len(STAGES) - 1, compiled)
    calls["MoD"] = lambda: mod(tokens, "topk")
    with torch.no_grad():  # FlopCounterMode counts aten's matmuls, not the packed kernel's: count on nn.Linear
        mod_flops = sum(counted_flops(lambda: mod(tokens, "topk")).values())
        ideal = mod_flops / sum(counted_flops(lambda: dense(tokens)).values())
        floor_flops = sum(counted_flops(lambda: ladder_forward(mod, tokens, cos, sin, k, 0)).values())
    linears = contextlib.ExitStack()
    if args.packed_linears:
        if not packed_linear.available():
            raise SystemExit("--packed-linears: this PyTorch build has no oneDNN packed linear kernel")
        linears.enter_context(PackedLinears(mod))
        linears.enter_context(PackedLinears(dense))
    with torch.no_grad(), linears:
        reference = mod(tokens, "topk")
        whole = ladder_forward(mod, tokens, cos, sin, k, len(STAGES) - 1)
        # the ladder's top is the real block to rounding (MKL's sums at these shapes vary from call to call by a few
        # ulps: logits 4.6e-6 apart in 3 of 6 runs, none with the packed kernel)
        gap = (whole - reference).abs().max().item()
        if gap > 1e-4:
            raise SystemExit(f"the ladder's last stage differs from the real forward by {gap:.2e}: the bench is out "
                             "of date")
        samples = interleaved({name: timed("forward", run) for name, run in calls.items()}, 5, args.rounds)
    times = {name: quantities["forward"] for name, quantities in samples.items()}
    medians = {name: statistics.median(values) for name, values in times.items()}
    kernel = "oneDNN packed linears" if args.packed_linears else "nn.Linear (MKL)"
    print(f"small preset, batch {args.batch_size}, T {seq_len}, k {k}, {args.threads} threads, {kernel}, "
          f"{args.rounds} rounds interleaved; FLOP ideal (MoD / dense, FlopCounterMode) {ideal:.3f}; the floor's counted FLOPs "
          f"{floor_flops / mod_flops:.3f} of MoD's")
    for name, values in times.items():
        line = f"  {name:14s} {summary(values)}"
        if name != "dense":
            ratio = medians[name] / medians["dense"]
            line += f"; / dense {ratio:.3f}, ratio / ideal {ratio / ideal:.2f}"
        print(line)


if __name__ == "__main__":
    main()
