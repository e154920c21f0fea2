"""Export-friendly views of a trained MoDDecoder: the forward graph and the decode-step graph.

Both wrappers hold the model itself and call its own submodules (embedding, norms, `Block.router`,
`Block.predictor`, `Block.delta`, `Attention._heads`/`proj`, `Block.mlp`, the LM head) and the routing helpers of
modcli.routing, so the exported graphs use the trained weights and the same maths; what they change is only
what a graph cannot express the eager way:

- `ForwardGraph` (training-time top-k routing, non-causal): k = max(1, T * num // den) is computed inside the
  graph with integer arithmetic from T, so one graph serves every T and B. TopK, a sort of the indices into
  causal order, gather, the block on the k tokens, and an overwrite scatter (`x + w * f(x)` written at unique
  positions; no scatter-add).
- `DecodeStepGraph` (causal routing: router or predictor sign): one token per sequence and an explicit KV cache,
  one preallocated (B, H, slots, hd) buffer pair and a (B,) length vector per layer, returned updated. A routed
  block appends K/V only for the tokens it processes. Its work sits inside `torch.cond` (an ONNX `If`): when no
  sequence of the batch processes the token the branch with the attention and MLP is not run at all. For B = 1
  that is a real skip of every skipped token; for B > 1 the work is skipped only when every row skips, and when
  some rows process the token all rows are computed and the skipped rows' results are discarded by a `where`
  (their hidden state and cache stay bit for bit unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.model import Block, MoDDecoder, rope_tables
from modcli.routing import gather_tokens, scatter_tokens, select_topk


def capacity_from_length(positions: Tensor, num: int, den: int):
    """k = max(1, T * num // den) from positions = arange(T), as ModelConfig.capacity_tokens computes it.

    Why a 0-d tensor and `.item()`: Python's `max` (or `torch.sym_max`) on the symbolic T makes torch.export
    guard on the value of k (k != 1, k <= T) and so restrict T; read from a tensor, k is an unbacked size whose
    only facts are the two checks below, and the graph keeps the arithmetic (Mul, Div, Clip) for any T.
    """
    seq_len = positions.shape[0]
    k_tensor = ((positions[-1] + 1) * num // den).clamp(min=1)  # integer arithmetic on a 0-d int64 tensor
    k = k_tensor.item()
    torch._check(k >= 1)
    torch._check(k <= seq_len)
    return k


class ForwardGraph(nn.Module):
    """tokens (B, T) -> logits (B, T, V), then each routed block's selected positions (B, k): top-k routing."""

    def __init__(self, model: MoDDecoder) -> None:
        super().__init__()
        self.model = model
        self.capacity_num, self.capacity_den = model.config.capacity_fraction()

    def forward(self, tokens: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        config = model.config
        seq_len = tokens.shape[1]
        positions = torch.arange(seq_len, device=tokens.device)
        cos, sin = rope_tables(positions, config.head_dim, config.rope_base)  # (T, hd/2)
        k = capacity_from_length(positions, self.capacity_num, self.capacity_den) if not config.dense else 0
        x = model.embed(tokens)  # (B, T, D)
        selected = []
        for block in model.blocks:
            if not block.routed:
                x = x + block.delta(x, cos[None], sin[None])
                continue
            router_logits = block.router(x).squeeze(-1)  # (B, T)
            idx = select_topk(router_logits, k).selected_idx  # (B, k) ascending
            x_selected = gather_tokens(x, idx)  # (B, k, D)
            delta = block.delta(x_selected, cos[idx], sin[idx])  # (B, k, D)
            weight = block.router_weight(router_logits.gather(1, idx)).unsqueeze(-1)  # (B, k, 1)
            x = scatter_tokens(x, idx, (x_selected + weight * delta).to(x.dtype))
            selected.append(idx)
        logits = model.head(model.norm(x))  # (B, T, V)
        return (logits, *selected)


def _decode_delta(block: Block, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                  lengths: Tensor, write: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """f(x) for one token per row x (B, 1, D), with its K/V written at slot lengths[b] of each row's cache.

    `write` (B,) bool: rows whose K/V are stored; the other rows' slot keeps its old content (None: all rows).
    The attention mask covers slots 0..lengths[b], the slot just written included, so no row is fully masked.
    """
    batch, _, d_model = x.shape
    attn = block.attn
    q, k, v = attn._heads(block.attn_norm(x), cos, sin)  # (B, H, 1, hd)
    slot = lengths.view(batch, 1, 1, 1).expand(batch, attn.n_heads, 1, attn.head_dim)  # (B, H, 1, hd)
    k, v = k.to(keys.dtype), v.to(values.dtype)
    if write is not None:
        keep = write.view(batch, 1, 1, 1)
        k = torch.where(keep, k, keys.gather(2, slot))
        v = torch.where(keep, v, values.gather(2, slot))
    keys = keys.scatter(2, slot, k)  # (B, H, L, hd)
    values = values.scatter(2, slot, v)
    visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= lengths[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                         attn_mask=visible[:, None, None, :])  # (B, H, 1, hd)
    attn_update = attn.proj(out.transpose(1, 2).reshape(batch, 1, d_model))  # (B, 1, D)
    delta = attn_update + block.mlp(block.mlp_norm(x + attn_update))
    return delta, keys, values


class DecodeStepGraph(nn.Module):
    """One decode step: tokens (B,), positions (B,), per layer keys/values (B, H, L, hd) and lengths (B,).

    Returns logits (B, V), each layer's updated keys, values and lengths, then for every routed block a (B,)
    bool of the rows that processed the token.
    """

    def __init__(self, model: MoDDecoder, routing: str) -> None:
        super().__init__()
        if routing not in ("router", "predictor"):
            raise ValueError(f"decode routing must be router or predictor, got {routing!r}")
        self.model = model
        self.routing = routing

    def forward(self, tokens: Tensor, positions: Tensor, *cache: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        config = model.config
        x = model.embed(tokens)[:, None]  # (B, 1, D)
        cos, sin = rope_tables(positions[:, None], config.head_dim, config.rope_base)  # (B, 1, hd/2)
        new_cache: list[Tensor] = []
        processed: list[Tensor] = []
        for layer, block in enumerate(model.blocks):
            keys, values, lengths = cache[3 * layer: 3 * layer + 3]
            if not block.routed:
                delta, keys, values = _decode_delta(block, x, cos, sin, keys, values, lengths, None)
                x = x + delta.to(x.dtype)
                new_cache += [keys, values, lengths + 1]
                continue
            router_logits = block.router(x).squeeze(-1)  # (B, 1)
            decisions = block.decisions(x, router_logits, self.routing)[:, 0]  # (B,) causal yes/no

            def process(x, cos, sin, keys, values, lengths, router_logits, decisions, block=block):
                delta, keys, values = _decode_delta(block, x, cos, sin, keys, values, lengths, decisions)
                weight = block.router_weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
                updated = (x + weight * delta).to(x.dtype)
                x = torch.where(decisions[:, None, None], updated, x)  # skipped rows: x bit for bit
                return x, keys, values, lengths + decisions.to(lengths.dtype)

            def skip(x, cos, sin, keys, values, lengths, router_logits, decisions):
                return x.clone(), keys.clone(), values.clone(), lengths.clone()

            x, keys, values, lengths = torch.cond(
                decisions.any(), process, skip, (x, cos, sin, keys, values, lengths, router_logits, decisions))
            new_cache += [keys, values, lengths]
            processed.append(decisions)
        logits = model.head(model.norm(x))[:, 0]  # (B, V)
        return (logits, *new_cache, *processed)
