"""Export-friendly views of a trained MoDDecoder: the forward graph and the decode-step graph.

Both wrappers hold the model itself and call its own code (the forward pass, `Block.router`, `Block.delta`,
`Attention._heads`/`proj`, `Block.mlp`, the LM head) and `modcli.routing.selection.residual_update`, so the
exported graphs use the trained weights and the same maths; what they change is only what a graph cannot express
the eager way:

- `ForwardGraph` (the router's static mode: top-k for topk and random, capped threshold for threshold): the
  number of tokens kept, k = max(1, T * num // den), is computed inside the graph with integer arithmetic from T,
  so one graph serves every T and B; then `MoDDecoder.forward` runs with that k (TopK, indices in causal order,
  gather, the block on the k tokens, an overwrite scatter of `x + w * f(x)`).
- `DecodeStepGraph` (a causal mode): one token per sequence and an explicit KV cache, one preallocated
  (B, H, slots, hd) buffer pair and a (B,) length vector per layer, returned updated. A routed block appends K/V
  only for the tokens it processes. Its work sits inside `torch.cond` (an ONNX `If`): when no sequence of the batch
  processes the token the branch with the attention and MLP is not run at all. For B = 1 that is a real skip of
  every skipped token; for B > 1 the work is skipped only when every row skips, and when some rows process the
  token all rows are computed and the skipped rows' results are discarded (their hidden state and cache stay bit
  for bit unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modcli.model import Block, MoDDecoder, config_rope
from modcli.routing.selection import Selection, residual_update


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


def selected_positions(selection: Selection) -> Tensor:
    """The forward graph's routing output (B, k): selected positions, ascending, -1 in padding slots."""
    if selection.valid is None:
        return selection.selected_idx
    return torch.where(selection.valid, selection.selected_idx, torch.full_like(selection.selected_idx, -1))


class ForwardGraph(nn.Module):
    """tokens (B, T) -> logits (B, T, V), then each routed block's selected positions (B, k) in the router's static
    mode (`RouterCapabilities.static_mode`)."""

    def __init__(self, model: MoDDecoder) -> None:
        super().__init__()
        self.model = model
        self.mode = model.capabilities.static_mode if not model.config.dense else "dense"
        routers = [block.router for block in model.blocks if block.router is not None]
        self.num, self.den = routers[0].static_fraction(model.config.capacity) if routers else (1, 1)

    def forward(self, tokens: Tensor) -> tuple[Tensor, ...]:
        if self.model.config.dense:
            return (self.model(tokens),)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        k = capacity_from_length(positions, self.num, self.den)
        logits, records = self.model(tokens, self.mode, return_records=True, k=k)
        return (logits, *(selected_positions(record.selection) for record in records))


def _decode_delta(block: Block, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                  lengths: Tensor, write: Tensor | None, part: str = "block") -> tuple[Tensor, Tensor, Tensor]:
    """f(x) for one token per row x (B, 1, D), with its K/V written at slot lengths[b] of each row's cache.

    `write` (B,) bool: rows whose K/V are stored; the other rows' slot keeps its old content (None: all rows).
    The attention mask covers slots 0..lengths[b], the slot just written included, so no row is fully masked.
    `part` as in `Block.delta`: block (attention and MLP), attention, or mlp (no cache access).
    """
    if part == "mlp":
        return block.mlp(block.mlp_norm(x)), keys, values
    batch = x.shape[0]
    attn = block.attn
    q, k, v = attn._heads(block.attn_norm(x), cos, sin)  # (B, H, 1, hd), k and v (B, Hkv, 1, hd)
    slot = lengths.view(batch, 1, 1, 1).expand(batch, attn.n_kv_heads, 1, attn.head_dim)  # (B, Hkv, 1, hd)
    k, v = k.to(keys.dtype), v.to(values.dtype)
    if write is not None:
        keep = write.view(batch, 1, 1, 1)
        k = torch.where(keep, k, keys.gather(2, slot))
        v = torch.where(keep, v, values.gather(2, slot))
    keys = keys.scatter(2, slot, k)  # (B, H, L, hd)
    values = values.scatter(2, slot, v)
    visible = torch.arange(keys.shape[2], device=x.device)[None, :] <= lengths[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(q, attn.share_kv(keys.to(q.dtype)), attn.share_kv(values.to(q.dtype)),
                                         attn_mask=visible[:, None, None, :])  # (B, H, 1, hd)
    attn_update = attn.proj(out.transpose(1, 2).reshape(batch, 1, -1))  # (B, 1, D)
    if part == "attention":
        return attn_update, keys, values
    delta = attn_update + block.mlp(block.mlp_norm(x + attn_update))
    return delta, keys, values


class DecodeStepGraph(nn.Module):
    """One decode step: tokens (B,), positions (B,), per layer keys/values (B, H, L, hd) and lengths (B,).

    Returns logits (B, V), each layer's updated keys, values and lengths, then for every routed block a (B,)
    bool of the rows that processed the token.
    """

    def __init__(self, model: MoDDecoder, routing: str) -> None:
        super().__init__()
        model.check_routing(routing, causal=True)
        self.model = model
        self.routing = routing

    def forward(self, tokens: Tensor, positions: Tensor, *cache: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        config = model.config
        x = model.embed(tokens)[:, None]  # (B, 1, D)
        cos, sin = config_rope(config, positions[:, None])  # (B, 1, hd/2)
        new_cache: list[Tensor] = []
        processed: list[Tensor] = []
        for layer, block in enumerate(model.blocks):
            keys, values, lengths = cache[3 * layer: 3 * layer + 3]
            if not block.routed:
                delta, keys, values = _decode_delta(block, x, cos, sin, keys, values, lengths, None)
                x = x + delta.to(x.dtype)
                new_cache += [keys, values, lengths + 1]
                continue
            router_logits = block.router.logits(x, positions[:, None])  # (B, 1)
            decisions = block.router.decide(x, router_logits, self.routing, positions[:, None],
                                            config.capacity)[:, 0]  # (B,) causal yes/no
            part = config.route_part
            if part == "mlp":  # every row attends and is cached; only the MLP is routed, and its If holds no cache
                attn_update, keys, values = _decode_delta(block, x, cos, sin, keys, values, lengths, None, "attention")
                x, lengths = x + attn_update.to(x.dtype), lengths + 1

                def mlp_only(x, router_logits, decisions, block=block):
                    weight = block.router.weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
                    return residual_update(x, block.mlp(block.mlp_norm(x)), weight, keep=decisions[:, None, None])

                x = torch.cond(decisions.any(), mlp_only, lambda x, router_logits, decisions: x.clone(),
                               (x, router_logits, decisions))
                new_cache += [keys, values, lengths]
                processed.append(decisions)
                continue

            def process(x, cos, sin, keys, values, lengths, router_logits, decisions, block=block, part=part):
                delta, keys, values = _decode_delta(block, x, cos, sin, keys, values, lengths, decisions, part)
                weight = block.router.weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
                x = residual_update(x, delta, weight, keep=decisions[:, None, None])  # skipped rows: x bit for bit
                return x, keys, values, lengths + decisions.to(lengths.dtype)

            def skip(x, cos, sin, keys, values, lengths, router_logits, decisions):
                return x.clone(), keys.clone(), values.clone(), lengths.clone()

            x, keys, values, lengths = torch.cond(
                decisions.any(), process, skip, (x, cos, sin, keys, values, lengths, router_logits, decisions))
            if part == "attention":  # only attention was routed; the MLP runs on every row
                x = x + block.mlp(block.mlp_norm(x))
            new_cache += [keys, values, lengths]
            processed.append(decisions)
        logits = model.head(model.norm(x))[:, 0]  # (B, V)
        return (logits, *new_cache, *processed)
