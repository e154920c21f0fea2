"""Token selection for Mixture-of-Depths routed blocks, shared by every router kind.

Two ways to pick the tokens a routed block processes:

- full-sequence (`select_topk`, `select_capped`): a fixed number of tokens per sequence from scores over the
  whole sequence. Whether token t is chosen depends on the scores of later tokens, so it cannot be used for
  decoding and its perplexity leaks the future; it keeps shapes static for training, compile and export.
- causal (`select_causal`): a per-token yes/no (a router's sign, a predictor, a threshold). The count differs per
  sequence; the batch is padded to the largest count (never to T), and padded slots are written back unchanged.

Either way the result is indices sorted ascending, so attention among the selected tokens keeps causal order.
`residual_update` is the one place that writes `x + w * f(x)` for the selected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
    give bit-identical router logits at the k-th boundary, so the rule is spelt out, two ways with one result:

    - eager PyTorch: a stable descending sort keeps equal scores in position order, so its first k are the tokens
      the rule chooses (3 operators; the routed block's fixed cost counts at batch 1, docs/profile.md);
    - traced graphs (torch.compile, torch.export, ONNX, where TopK has no stable order): the k-th largest value,
      every score above it, then the tied ones from the left until k (17 operators whose result does not depend on
      how a kernel orders ties).

    Indices come back sorted ascending: causal order among the selected tokens.
    """
    if not torch.compiler.is_compiling():
        return select_topk_sorted(router_logits, k)
    return select_topk_traced(router_logits, k)


def select_topk_sorted(router_logits: Tensor, k: int) -> Selection:
    """`select_topk` by a stable sort: eager PyTorch's path."""
    batch = router_logits.shape[0]
    best = router_logits.sort(dim=1, descending=True, stable=True).indices[:, :k]  # (B, k) ties: lower position first
    counts = torch.full((batch,), k, dtype=torch.long, device=router_logits.device)
    return Selection(best.sort(dim=1).values, None, counts)


def select_topk_traced(router_logits: Tensor, k: int) -> Selection:
    """`select_topk` from operators whose result does not depend on how a kernel orders ties: traced graphs' path."""
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
    compiling = torch.compiler.is_compiling()
    # Compiled, at least one slot (a padding slot when no token is selected: attention kernels need n >= 1); the
    # count stays a size inside the graph (capture_scalar_outputs), not a graph break. Eager, k = 0 skips the block.
    k_max = (counts.max().clamp(min=1) if compiling else counts.max()).item()
    torch._check(k_max >= (1 if compiling else 0))
    torch._check(k_max <= seq_len)
    positions = torch.arange(seq_len, device=decisions.device)
    order_key = torch.where(decisions, positions, positions + seq_len)  # (B, T) selected first, in order
    selected_idx = order_key.topk(k_max, dim=1, largest=False, sorted=True).indices  # (B, k_max)
    slot = torch.arange(k_max, device=decisions.device)
    valid = slot[None, :] < counts[:, None]  # (B, k_max)
    return Selection(selected_idx, valid, counts)


def select_capped(scores: Tensor, decisions: Tensor, cap: int) -> Selection:
    """At most `cap` tokens per sequence: the `cap` best scores (ties to the lower position), of which only those
    with a yes in `decisions` (B, T) count. Static shapes for compile and export; where more than `cap` tokens say
    yes, later scores can push out earlier tokens, so the result is causal only while the cap does not bind."""
    batch, seq_len = scores.shape
    best = select_topk(scores, cap).selected_idx  # (B, cap) ascending
    keep = decisions.gather(1, best)  # (B, cap)
    counts = keep.sum(dim=1)  # (B,)
    slot_key = torch.where(keep, best, best + seq_len)  # (B, cap) kept ones first, in order; all distinct
    ordered = slot_key.topk(cap, dim=1, largest=False, sorted=True).values  # (B, cap)
    selected_idx = torch.where(ordered >= seq_len, ordered - seq_len, ordered)  # back to positions
    valid = torch.arange(cap, device=scores.device)[None, :] < counts[:, None]  # (B, cap)
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


def residual_update(x_selected: Tensor, delta: Tensor, weight: Tensor, keep: Tensor | None = None) -> Tensor:
    """`x + w * f(x)` for the selected tokens: x_selected and delta (..., n, D), weight (..., n, 1).

    Where `keep` (..., n, 1) is False (padding slots, rows that skip), the token stays x bit for bit. The eager
    forward, the cached decode and the export graphs all write the routed update through this function.
    """
    updated = (x_selected + weight * delta).to(x_selected.dtype)
    return updated if keep is None else torch.where(keep, updated, x_selected)


HASH_MODULUS = 2_147_483_647  # 2**31 - 1


def position_hash(layer: int, positions: Tensor) -> Tensor:
    """A uniform-looking integer in [0, HASH_MODULUS) per (layer, position): the same in eager PyTorch, export and
    ONNX, because it uses int64 arithmetic only (no bit operations, no floats, every product below 2**62)."""
    h = (positions.long() + 1) * 48_271 + (layer + 1) * 69_621
    for _ in range(3):
        h = (h % HASH_MODULUS) * 16_807 + h // 65_536
    return h % HASH_MODULUS
