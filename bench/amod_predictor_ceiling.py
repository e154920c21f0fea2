"""How well can anything causal predict A-MoD's top-k choice? On a trained `--router attention` run, per routed
block (all numbers are recall of the top-k choice at the capacity's share of positives, i.e. a threshold
calibrated so that as many tokens are predicted as top-k keeps; precision is then equal):

- `label_agreement_batch`: the training labels themselves depend on the batch (each position's scores are
  standardised over the batch's sequences): the same validation windows labelled within two different batches of
  the same size, the recall of one labelling by the other. No rule that sees one sequence can beat it by much.
- `label_agreement_eval`: training labels against the evaluation forward's labels (no standardisation).
- `trained_predictor`: the run's own predictor (`--predictor-hidden`), on the block inputs of the validation
  windows.
- `refit_hidden_H`: a fresh predictor of H hidden units fitted offline (AdamW, `--fit-steps` steps of
  `--fit-batch` tokens, balanced BCE) on the frozen model's block inputs and training labels of `--train-batches`
  training batches, then judged on the validation windows: what more predictor capacity and more steps on fixed
  labels give.

    python bench/amod_predictor_ceiling.py RUN [--train-batches 60] [--fit-steps 3000] [--hidden 32,256] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from modcli.checkpoint.store import load_model_from
from modcli.data.corpus import BatchSampler, evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer


def calibrated_recall(logits: torch.Tensor, chosen: torch.Tensor) -> float:
    """Recall of `chosen` (bool, any shape) by the top share of `logits` with as many positives as `chosen` has."""
    flat, labels = logits.flatten().float(), chosen.flatten()
    predicted = torch.zeros_like(labels).index_fill(0, flat.topk(int(labels.sum())).indices, True)
    return float((predicted & labels).sum() / labels.sum())


@torch.no_grad()
def block_inputs_and_labels(model, inputs: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per routed block: its input (B, T, D) and the top-k labels (B, T) of the model's training-mode forward."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [block.register_forward_pre_hook(lambda module, args, layer=layer: captured.__setitem__(layer, args[0]))
             for layer, block in enumerate(model.blocks) if block.routed]
    _, aux = model(inputs, model.training_mode, return_aux=True)
    for hook in hooks:
        hook.remove()
    out = {}
    for record in aux.records:
        labels = torch.zeros_like(record.router_logits, dtype=torch.bool).scatter(1, record.selection.selected_idx, True)
        out[record.layer] = (captured[record.layer], labels)
    return out


def fit_predictor(features: torch.Tensor, labels: torch.Tensor, hidden: int, steps: int, batch: int,
                  seed: int) -> nn.Module:
    """A predictor MLP (as modcli's: Linear, SiLU, Linear) fitted by balanced BCE on (N, D) features, (N,) labels."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(features.shape[1], hidden), nn.SiLU(), nn.Linear(hidden, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    positive_weight = (labels.numel() - labels.sum()) / labels.sum()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(0, features.shape[0], (batch,), generator=generator)
        logits = net(features[rows]).squeeze(-1)
        loss = F.binary_cross_entropy_with_logits(logits, labels[rows].float(), pos_weight=positive_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return net.eval()


def ceiling(run: str, train_batches: int, fit_steps: int, fit_batch: int, hidden: list[int], val_batches: int,
            seed: int) -> dict[str, dict[str, float]]:
    model, config, checkpoint = load_model_from(run, "cpu")
    model.train()  # the training selection: A-MoD standardises each position's scores over the batch
    seq_len, batch_size = config.model.seq_len, config.train.batch_size
    corpus = load_corpus(config.data, seq_len, load_tokenizer(config.data.tokenizer, checkpoint.parent))
    val = torch.cat([inputs for inputs, _ in evaluation_batches(corpus.val, seq_len, batch_size, val_batches)])
    # The same windows in two batchings: in order, and shuffled across batches.
    order = torch.randperm(val.shape[0], generator=torch.Generator().manual_seed(seed))
    first: dict[int, list] = {}
    second: dict[int, torch.Tensor] = {}
    for start in range(0, val.shape[0], batch_size):
        for layer, pair in block_inputs_and_labels(model, val[start:start + batch_size]).items():
            first.setdefault(layer, []).append(pair)
    shuffled: dict[int, list] = {}
    for start in range(0, val.shape[0], batch_size):
        for layer, (_, labels) in block_inputs_and_labels(model, val[order[start:start + batch_size]]).items():
            shuffled.setdefault(layer, []).append(labels)
    for layer, parts in shuffled.items():
        second[layer] = torch.empty_like(torch.cat(parts)).index_copy_(0, order, torch.cat(parts))
    model.eval()
    evaluation = {layer: torch.cat([block_inputs_and_labels(model, val[start:start + batch_size])[layer][1]
                                    for start in range(0, val.shape[0], batch_size)]) for layer in first}
    model.train()
    sampler = BatchSampler(corpus.train, seq_len, batch_size, seed=seed)
    train: dict[int, list] = {}
    train_eval_labels: dict[int, list] = {}
    for _ in range(train_batches):
        inputs, _ = sampler.next()
        for layer, pair in block_inputs_and_labels(model, inputs).items():
            train.setdefault(layer, []).append(pair)
        model.eval()
        for layer, (_, labels) in block_inputs_and_labels(model, inputs).items():
            train_eval_labels.setdefault(layer, []).append(labels)
        model.train()
    result = {}
    for layer, parts in first.items():
        features = torch.cat([x for x, _ in parts])  # (N_val, T, D)
        labels = torch.cat([y for _, y in parts])  # (N_val, T)
        router = model.blocks[layer].router
        with torch.no_grad():
            own = router.predictor(features)
        row = {"label_agreement_batch": calibrated_recall(second[layer].float(), labels),
               "label_agreement_eval": calibrated_recall(evaluation[layer].float(), labels),
               "trained_predictor": calibrated_recall(own, labels),
               "trained_predictor_at_0": float(((own > 0) & labels).sum() / labels.sum())}
        train_x = torch.cat([x for x, _ in train[layer]]).flatten(0, 1)  # (N, D)
        train_y = torch.cat([y for _, y in train[layer]]).flatten()  # (N,)
        for width in hidden:
            net = fit_predictor(train_x, train_y, width, fit_steps, fit_batch, seed)
            with torch.no_grad():
                fitted = net(features).squeeze(-1)
            train_fit = net(train_x).squeeze(-1).detach()
            row[f"refit_hidden_{width}"] = calibrated_recall(fitted, labels)
            row[f"refit_hidden_{width}_train"] = calibrated_recall(train_fit, train_y)
            net = fit_predictor(train_x, torch.cat(train_eval_labels[layer]).flatten(), width, fit_steps, fit_batch,
                                seed)
            with torch.no_grad():
                row[f"refit_eval_labels_hidden_{width}"] = calibrated_recall(net(features).squeeze(-1),
                                                                             evaluation[layer])
        result[f"block{layer}"] = {key: round(value, 4) for key, value in row.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--train-batches", type=int, default=60)
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches of the run's batch size")
    parser.add_argument("--fit-steps", type=int, default=3000)
    parser.add_argument("--fit-batch", type=int, default=512)
    parser.add_argument("--hidden", default="32,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = ceiling(args.run, args.train_batches, args.fit_steps, args.fit_batch,
                     [int(h) for h in args.hidden.split(",")], args.val_batches, args.seed)
    if args.json:
        print(json.dumps(result))
        return
    for block, row in result.items():
        print(block + ": " + ", ".join(f"{key} {value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
