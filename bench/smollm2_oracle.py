"""How much a pretrained model loses when its blocks skip the tokens whose update is smallest: a reference for the
frontier of bench/pretrained_smollm2.sh that no trained router is needed for.

    python bench/smollm2_oracle.py runs/smollm2/dense [--data /usr/share/common-licenses] [--out FILE.json]

On the dense model (an imported run), each routed block (`--layouts`: all = every block, other = every other block,
1, 3, 5, ...) processes `capacity` of the tokens of each window and writes `x + f(x)` for them (f: the attention
update, the MLP update or the whole block's, `--parts`), every other token passes unchanged, as a routed block with a
unit router weight does. Which tokens, per rule:

- oracle: the k tokens whose own dense update |f(x_t)|^2 (computed on every token of the block's real input, after
  the routed blocks before it) is largest. It reads the work it would save, and ranks over the whole window (like
  top-k), so it is not a router one could deploy; it is what ranking by the size of the update could reach.
- random: k tokens drawn uniformly (seeded), what an untrained router's arbitrary choice costs.
- oracle+kv, random+kv: the same choice, but the skipped tokens still serve as keys and values: each chosen token
  gets its dense update (attention over every token), a skipped one none. Against the rule without "+kv" this
  separates what the skipped tokens' own updates are worth from what their absence from attention costs the others
  (a routed block stores no K/V for a skipped token, which is what saves the KV cache).

Position 0 (the attention sink) is always processed, as with --keep-first 1. The loss (nats/token) is on the same
validation windows as `modcli eval --batches B --batch-size S`, the dense model's alongside; one JSON object on stdout
(and in --out), one line per point on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from modcli.checkpoint.store import load_model_from
from modcli.config import DataConfig
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.models.decoder import config_rope
from modcli.models.routing.selection import gather_tokens, residual_update, scatter_tokens, select_topk
from modcli.training.objective import lm_loss

RULES = ("oracle", "random", "oracle+kv", "random+kv")


def routed_forward(model, tokens: torch.Tensor, part: str, layers: set[int], capacity: float, rule: str,
                   generator: torch.Generator) -> torch.Tensor:
    """tokens (B, T) -> logits (B, T, V) with blocks `layers` processing k = floor(capacity x T) tokens by `rule`."""
    batch, seq_len = tokens.shape
    k = max(1, int(capacity * seq_len))
    cos, sin = config_rope(model.config, torch.arange(seq_len))  # (T, hd/2)
    x = model.embed(tokens)  # (B, T, D)
    for layer, block in enumerate(model.blocks):
        if layer not in layers:
            x = x + block.delta(x, cos[None], sin[None])
            continue
        if part == "mlp":  # attention (and its cache) covers every token; only the MLP is routed
            x = x + block.delta(x, cos[None], sin[None], part="attention")
        full = block.delta(x, cos[None], sin[None], part=part)  # (B, T, D): every token's own update
        scores = (full.pow(2).sum(-1) if rule.startswith("oracle")
                  else torch.rand(batch, seq_len, generator=generator))  # (B, T)
        scores[:, 0] = float("inf")  # the sink, as --keep-first 1
        idx = select_topk(scores, k).selected_idx  # (B, k) ascending
        x_selected = gather_tokens(x, idx)  # (B, k, D)
        # the MLP works token by token, so its update of the k is theirs in `full`; attention (and the whole block)
        # runs again among the k only, as a routed block does, unless "+kv" keeps every token's keys and values
        delta = (gather_tokens(full, idx) if part == "mlp" or rule.endswith("+kv")
                 else block.delta(x_selected, cos[idx], sin[idx], part=part))  # (B, k, D)
        x = scatter_tokens(x, idx, residual_update(x_selected, delta, torch.ones_like(x_selected[..., :1])))
        if part == "attention":  # only attention was routed: the MLP runs on every token
            x = x + block.delta(x, cos[None], sin[None], part="mlp")
    return model.head(model.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--data", default=None, help="corpus (default: the run's)")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--points", default="attention:all:oracle:0.875,0.75,0.5;attention:all:random:0.875,0.5",
                        help="PART:LAYOUT:RULE:CAPACITIES;... (PART attention|mlp|block, LAYOUT all|other, "
                        "RULE oracle|random|oracle+kv|random+kv)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, run_config, checkpoint = load_model_from(args.run, "cpu")
    model.eval()
    seq_len = run_config.model.seq_len
    data = run_config.data if args.data is None else DataConfig(data=args.data, tokenizer=run_config.data.tokenizer)
    corpus = load_corpus(data, seq_len, load_tokenizer(data.tokenizer, checkpoint.parent))
    batches = list(evaluation_batches(corpus.val, seq_len, args.batch_size, args.batches))
    n_layers = run_config.model.n_layers
    layouts = {"all": set(range(n_layers)), "other": set(range(1, n_layers, 2))}

    started = time.monotonic()
    with torch.no_grad():
        dense = sum(lm_loss(model(inputs), targets).item() for inputs, targets in batches) / len(batches)
    print(f"dense: {dense:.4f}", file=sys.stderr)
    points = []
    for spec in args.points.split(";"):
        part, layout, rule, capacities = spec.split(":")
        if part not in ("attention", "mlp", "block") or layout not in layouts or rule not in RULES:
            parser.error(f"--points: {spec!r} is not PART:LAYOUT:RULE:CAPACITIES (see --help)")
        for capacity in (float(c) for c in capacities.split(",")):
            generator = torch.Generator().manual_seed(args.seed)
            total = 0.0
            with torch.no_grad():
                for inputs, targets in batches:
                    logits = routed_forward(model, inputs, part, layouts[layout], capacity, rule, generator)
                    total += lm_loss(logits, targets).item()
            loss = total / len(batches)
            point = dict(part=part, layout=layout, rule=rule, capacity=capacity, loss=loss,
                         loss_increase_pct=100 * (loss / dense - 1))
            points.append(point)
            print(f"{part} {layout} {rule} c {capacity}: {loss:.4f} ({point['loss_increase_pct']:+.1f}%)",
                  file=sys.stderr)
    result = dict(run=str(checkpoint), corpus=corpus.description, windows=len(batches) * args.batch_size,
                  seq_len=seq_len, dense_loss=dense, points=points, wall_s=round(time.monotonic() - started, 1))
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
