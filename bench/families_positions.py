"""Where in the window a trained model's routed blocks pick their tokens (the full-sequence top-k mode), on the
validation batches `modcli eval` uses: per routed block, the share of selections in each bucket of positions over
the bucket's uniform share (1.0 = no position bias). A-MoD's goal: no bucket above 2.0. With a predictor, also its
recall of the top-k choice when its threshold is calibrated to the capacity (the batch's (1 - c) quantile of its
logits, what `modcli profile` calibrates to) beside `modcli eval`'s recall at logit 0.

    python bench/families_positions.py RUN [--buckets 16] [--batches 16] [--batch-size 8] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from modcli.checkpoint.store import load_model_from
from modcli.data.corpus import evaluation_batches, load_corpus
from modcli.data.tokenizer import load_tokenizer


@torch.no_grad()
def position_shares(run: str, buckets: int, batches: int, batch_size: int) -> dict[str, dict]:
    """{"position_shares": routed block -> per bucket of positions, its share of the selections over the bucket's
    uniform share; "calibrated_predictor_recall": routed block -> the predictor's recall at the calibrated
    threshold}."""
    model, config, checkpoint = load_model_from(run, "cpu")
    model.train()  # the selection training makes (A-MoD standardises its scores over the batch in training only)
    seq_len = config.model.seq_len
    corpus = load_corpus(config.data, seq_len, load_tokenizer(config.data.tokenizer, checkpoint.parent))
    counts: dict[str, torch.Tensor] = {}
    hits: dict[str, list[float]] = {}
    for inputs, _ in evaluation_batches(corpus.val, seq_len, batch_size, batches):
        _, aux = model(inputs, model.training_mode, return_aux=True)
        for record in aux.records:
            bucket = record.selection.selected_idx.flatten() * buckets // seq_len  # (B k,)
            key = f"block{record.layer}"
            counts[key] = counts.get(key, torch.zeros(buckets)) + torch.bincount(bucket, minlength=buckets)
            if record.predictor_logits is not None:
                chosen = torch.zeros_like(record.predictor_logits, dtype=torch.bool).scatter(
                    1, record.selection.selected_idx, True)  # (B, T)
                logits = record.predictor_logits.float()
                predicted = logits >= torch.quantile(logits.flatten(), 1 - record.capacity)
                hits.setdefault(key, []).append(float((predicted & chosen).sum() / chosen.sum()))
    shares = {key: [round(float(c) / float(total.sum()) * buckets, 3) for c in total] for key, total in counts.items()}
    recall = {key: round(sum(values) / len(values), 4) for key, values in hits.items()}
    return {"position_shares": shares, "calibrated_predictor_recall": recall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = position_shares(args.run, args.buckets, args.batches, args.batch_size)
    if args.json:
        print(json.dumps(result))
        return
    for key, row in result["position_shares"].items():
        recall = result["calibrated_predictor_recall"].get(key)
        print(f"{key}: max {max(row):.2f}x, min {min(row):.2f}x of the uniform share; by bucket "
              + " ".join(f"{v:.2f}" for v in row) + ("" if recall is None else f"; calibrated predictor recall {recall}"))


if __name__ == "__main__":
    main()
