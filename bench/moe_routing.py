"""Why a token-choice MoE trails dense at equal steps on the tiny preset: routing fluctuation.

Two measurements (docs/results.md, "the families against their papers"):

- `churn RUN`: between consecutive checkpoints of one MoE run (`step-00000100/`, ...), the share of the validation
  tokens (`modcli eval`'s 16 x 8 windows) whose first-choice expert changed, per MoE block. Four experts assigned at
  random would give 0.75.
- `hash OUT [--seed S] [--staged]`: train the tiny preset's MoE (E = 4, top-1, capacity factor 4: nothing dropped,
  no balancing loss) with the choice fixed by the input byte instead of the gate (Hash Layers, Roller et al. 2021: a
  fixed random table gives each expert 64 of the 256 byte values), then print its validation loss as `modcli eval`
  computes it (the first causal mode; `--staged`: staged MoDE, the default `topk` MoD routing in front of the MoE).
  The expert weights, the data and everything else are the shipped MoE's; only the choice never changes. This
  patches `MoEMLP.route` inside this process: a diagnostic, not a modcli option.

    python bench/moe_routing.py churn runs/tiny-moe
    python bench/moe_routing.py hash runs/tiny-moe-hash --seed 1337
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from modcli.checkpoint.store import complete_checkpoints, load_model_from
from modcli.config import resolve_run_config
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.models import moe
from modcli.models.decoder import Block, MoDDecoder


def _validation(config, checkpoint):
    corpus = load_corpus(config.data, config.model.seq_len, load_tokenizer(config.data.tokenizer, checkpoint.parent))
    return list(evaluation_batches(corpus.val, config.model.seq_len, 8, 16))


@torch.no_grad()
def first_choices(path) -> dict[int, torch.Tensor]:
    """Each MoE block's first-choice expert (N,) over the validation tokens, in the checkpoint at `path`."""
    model, config, checkpoint = load_model_from(path, "cpu")
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [block.mlp.register_forward_hook(
        lambda module, args, output, layer=layer: seen.setdefault(layer, []).append(module.route(args[0])[1][..., 0]))
        for layer, block in enumerate(model.blocks) if isinstance(block.mlp, moe.MoEMLP)]
    for inputs, _ in _validation(config, checkpoint):
        model(inputs, "dense")
    for hook in hooks:
        hook.remove()
    return {layer: torch.cat(parts).flatten() for layer, parts in seen.items()}


def churn(run: str) -> dict[str, dict[str, float]]:
    """{"STEP_A->STEP_B": {"blockL": share of validation tokens whose expert changed}} over the run's checkpoints."""
    checkpoints = complete_checkpoints(Path(run))
    choices = [first_choices(path) for path in checkpoints]
    return {f"{int(a.name.split('-')[1])}->{int(b.name.split('-')[1])}":
            {f"block{layer}": round(float((before[layer] != after[layer]).float().mean()), 3) for layer in before}
            for a, b, before, after in zip(checkpoints, checkpoints[1:], choices, choices[1:], strict=False)}


def hash_routed(out: str, seed: int, staged: bool) -> dict[str, float]:
    """Train the hash-routed MoE (or staged MoDE) into `out`; its validation loss (mean over `modcli eval`'s windows)
    in the first causal mode."""
    table = torch.randperm(256, generator=torch.Generator().manual_seed(0)) % 4  # (256,) byte -> expert
    tokens: dict[str, torch.Tensor] = {}
    forward, update_selected = MoDDecoder.forward, Block.update_selected

    def remember_tokens(self, ids, *args, **kwargs):
        tokens["ids"] = ids  # (B, T)
        return forward(self, ids, *args, **kwargs)

    def remember_selected(self, x, selection, *args, **kwargs):
        tokens["selected"] = selection.selected_idx  # (B, k): a routed block's MLP sees these positions only
        try:
            return update_selected(self, x, selection, *args, **kwargs)
        finally:
            del tokens["selected"]

    def route(self, x):
        probs = self.gate(x).float().softmax(dim=-1)  # (B, n, E), for the statistics only
        ids = tokens["ids"]
        if "selected" in tokens:
            ids = ids.gather(1, tokens["selected"])  # (B, k)
        choice = table.to(x.device)[ids][..., None]  # (B, n, 1)
        return probs, choice, torch.ones_like(choice, dtype=torch.float32)

    MoDDecoder.forward, Block.update_selected, moe.MoEMLP.route = remember_tokens, remember_selected, route
    from modcli.training.loop import train  # after the patch is in place

    routing = {} if staged else {"route_every": 0}
    config = resolve_run_config("tiny", None, dict(routing, experts=4, expert_capacity_factor=4.0,
                                                   expert_aux_weight=0.0, seed=seed, out=out, device="cpu"))
    train(config, quiet=True)
    model, config, checkpoint = load_model_from(out, "cpu")
    mode = (model.causal_modes() or ("dense",))[0]
    with torch.no_grad():
        losses = [F.cross_entropy(model(inputs, mode).flatten(0, 1), targets.flatten()).item()
                  for inputs, targets in _validation(config, checkpoint)]
    return {"mode": mode, "val_loss": round(sum(losses) / len(losses), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("churn").add_argument("run")
    hashed = commands.add_parser("hash")
    hashed.add_argument("out")
    hashed.add_argument("--seed", type=int, default=1337)
    hashed.add_argument("--staged", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(churn(args.run) if args.command == "churn" else hash_routed(args.out, args.seed, args.staged)))


if __name__ == "__main__":
    main()
