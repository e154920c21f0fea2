"""Why a token-choice MoE trails dense at equal steps on the tiny preset: routing fluctuation.

`churn RUN` (docs/results.md, "the families against their papers"): between consecutive checkpoints of one MoE run
(`step-00000100/`, ...), the share of the validation tokens (`modcli eval`'s 16 x 8 windows) whose first-choice
expert changed, per MoE block. Four experts assigned at random would give 0.75; a hash-routed run gives 0.

The control, routing that never moves (Hash Layers, Roller et al. 2021: the expert fixed by the input byte), was a
`hash` subcommand of this script that patched `MoEMLP.route`; it is now the option `modcli train --experts 4
--expert-routing hash` (modcli.models.moe).

    python bench/moe_routing.py churn runs/tiny-moe
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from modcli.checkpoint.store import complete_checkpoints, load_model_from
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer
from modcli.models import moe


def _validation(config, checkpoint):
    corpus = load_corpus(config.data, config.model.seq_len, load_tokenizer(config.data.tokenizer, checkpoint.parent))
    return list(evaluation_batches(corpus.val, config.model.seq_len, 8, 16))


@torch.no_grad()
def first_choices(path) -> dict[int, torch.Tensor]:
    """Each MoE block's first-choice expert (N,) over the validation tokens, in the checkpoint at `path`."""
    model, config, checkpoint = load_model_from(path, "cpu")
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [block.mlp.register_forward_hook(
        lambda module, args, output, layer=layer: seen.setdefault(layer, []).append(module.route(*args)[1][..., 0]))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("churn").add_argument("run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(churn(args.run)))


if __name__ == "__main__":
    main()
