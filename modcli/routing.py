"""Token selection for Mixture-of-Depths routed blocks.

Two ways to pick the tokens a routed block processes:

- `topk` (training time, non-causal): expert-choice top-k over the whole sequence, k = capacity x T. Whether
  token t is chosen depends on the scores of later tokens, so it cannot be used for decoding and its perplexity
  leaks the future.
- `router` / `predictor` (causal): a per-token yes/no from the sign of the router logit or of the predictor
  logit. The count differs per sequence; the batch is padded to the largest count (never to T), and padded
  slots are written back unchanged.

Either way the result is indices sorted ascending, so attention among the selected tokens keeps causal order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ROUTER_WEIGHT_FUNCTIONS = {
    "sigmoid": torch.sigmoid,
    "identity": lambda logits: logits,
    "none": torch.ones_like,
}


@dataclass
class Selection:
    """Which tokens a routed block processes, per sequence."""

    selected_idx: Tensor
    """(B, k) token positions, ascending within each row."""
    valid: Tensor | None
    """(B, k) bool: False marks padding slots (causal modes only); None when every slot is real."""
    counts: Tensor
    """(B,) number of real selected tokens per sequence."""


def select_topk(router_logits: Tensor, k: int) -> Selection:
    """Expert-choice top-k per sequence; equal scores break ties by position, lower first (the ONNX TopK rule).

    `torch.topk` leaves the order of equal values unspecified, and runs of identical bytes (indentation, triple quotes)
    give bit-identical router logits at the k-th boundary, so the rule is spelt out with operations whose result
    does not depend on how a kernel orders ties: the k-th largest value, every score above it, then the tied ones
    from the left until k are chosen. The same code runs in eager PyTorch, torch.compile, torch.export and ONNX.
    Indices come back sorted ascending (never argsort of the scores): causal order among the selected tokens.
    """
    batch, seq_len = router_logits.shape
    kth = router_logits.topk(k, dim=1).values[:, -1:]  # (B, 1) the k-th largest score (a value: no tie ambiguity)
    above = router_logits > kth  # (B, T)
    tied = router_logits == kth  # (B, T)
    room = k - above.sum(dim=1, keepdim=True)  # (B, 1) tied tokens still needed, >= 1
    chosen = above | (tied & (tied.long().cumsum(dim=1) <= room))  # (B, T), exactly k per row
    positions = torch.arange(seq_len, device=router_logits.device)
    order_key = torch.where(chosen, positions, positions + seq_len)  # (B, T) chosen first, in order; all distinct
    selected_idx = order_key.topk(k, dim=1, largest=False, sorted=True).indices  # (B, k) ascending
    counts = torch.full((batch,), k, dtype=torch.long, device=router_logits.device)
    return Selection(selected_idx, None, counts)


def select_causal(decisions: Tensor) -> Selection:
    """Per-token decisions (B, T) -> the selected positions of each sequence, padded to the largest count.

    Reading the largest count is one host sync per routed block; it is what lets a batch with few processed
    tokens do little work. Padding slots hold unselected positions (after all selected ones, so causal
    attention of real slots never sees them) and are written back unchanged.
    """
    batch, seq_len = decisions.shape
    counts = decisions.sum(dim=1)  # (B,)
    k_max = int(counts.max())
    positions = torch.arange(seq_len, device=decisions.device)
    order_key = torch.where(decisions, positions, positions + seq_len)  # (B, T) selected first, in order
    selected_idx = order_key.topk(k_max, dim=1, largest=False, sorted=True).indices  # (B, k_max)
    slot = torch.arange(k_max, device=decisions.device)
    valid = slot[None, :] < counts[:, None]  # (B, k_max)
    return Selection(selected_idx, valid, counts)


def topk_labels(selected_idx: Tensor, seq_len: int) -> Tensor:
    """(B, k) selected positions -> (B, T) float labels, 1 where top-k chose the token; built per sequence."""
    labels = torch.zeros(selected_idx.shape[0], seq_len, device=selected_idx.device)
    return labels.scatter(1, selected_idx, 1.0)


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """x (B, T, D), idx (B, k) -> (B, k, D)."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def scatter_tokens(x: Tensor, idx: Tensor, updated: Tensor) -> Tensor:
    """Overwrite x (B, T, D) at positions idx (B, k) with updated (B, k, D); every other token is x bit for bit."""
    return x.scatter(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]), updated)
