"""The Mixture-of-Depths decoder. One block class; the dense model is the same code with routing off.

A routed block computes, for the tokens it selects (sorted ascending, original positions kept for RoPE and the
causal mask), the delta f(x) = attn + mlp of a pre-norm block, and writes back x + w * f(x) with w the router
weight. Every other token leaves the block bit for bit unchanged, and costs no attention or MLP work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from modcli.config import ModelConfig
from modcli.errors import UserError
from modcli.models.cache import DecoderCache, LayerKVCache
from modcli.models.moe import ExpertStats, MoEMLP
from modcli.models.routing.base import Router, RouterCapabilities, RoutingRecord
from modcli.models.routing.block_rule import keep_first_decisions, keep_first_scores, route_part
from modcli.models.routing.registry import ROUTER_KINDS, AttentionOptions, router_class
from modcli.models.routing.selection import Selection, gather_tokens, residual_update, scatter_tokens, select_causal


@dataclass
class ForwardAux:
    """What a forward pass returns beside the logits (`return_aux=True`) for the training objective and metrics.
    Each family fills the fields its declared auxiliary losses read (modcli.models.families: `aux_losses`)."""

    records: list[RoutingRecord] = field(default_factory=list)
    """Each routed block's (or recursion step's) RoutingRecord, in order."""
    experts: dict[int, ExpertStats] = field(default_factory=dict)
    """Each MoE block's statistics of this pass (load-balancing loss, load, dropped and no-op shares), by layer."""
    exit_logits: Tensor | None = None
    """(L-1, B, T, V): early exit's exits after blocks 0..L-2 in a training-mode pass; None otherwise."""
    exit_weights: Tensor | None = None
    """(L-1,): the weight of each exit's loss (early exit)."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """Anything else a family's own auxiliary loss reads (a family registered outside modcli, say), by name."""


def rope_tables(positions: Tensor, head_dim: int, base: float,
                scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """Positions (...,) -> cos, sin (..., head_dim/2) in float32; `scaling`: Llama-3 frequency scaling."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., hd/2)
    return angles.cos(), angles.sin()


def config_rope(config: ModelConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """`rope_tables` with the model's head size, base and scaling."""
    return rope_tables(positions, config.head_dim, config.rope_base, config.rope_scaling)


def decode_rope(config: ModelConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The RoPE tables of one decode step: positions (B,) -> cos, sin (B, 1, hd/2). A decode step makes them once
    and hands them to every block: 8 operators a block saved, the small preset's eager decode step 3-6% faster at
    batch 1 and 1-6% at batch 8 on a 2-core AMD EPYC (bench/decode_rope_ab.py at bfa1954), logits bit for bit the same."""
    return config_rope(config, positions[:, None])


def llama3_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Llama 3.1's RoPE scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    middle = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(middle, ramp, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, n, heads, hd), heads after the tokens (the queries' and keys' heads in one tensor, so one rotation
    serves both); cos/sin (B, n, hd/2) at each token's original position."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]  # (B, n, 1, hd/2)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)


def received_attention(probs: Tensor, rule: str = "neutral", standardise: bool = True) -> Tensor:
    """A-MoD's score from causal attention probabilities (B, H, n, n): what each token received (B, n), neutral to
    its position (`rule` neutral, --attention-score), or as before (seen-by: the sum over the n - j queries that
    see token j divided by their number, averaged over heads; runs saved before the option).

    Raw received attention is biased by position twice over in a causal decoder: token j is seen only by the n - j
    queries at or after it, each query i spreads its weight over i + 1 tokens, and trained heads attend mostly to
    recent tokens, so a late token is seen only by the near queries that favour it. Each weight is therefore
    compared with what is usual for its place: query i's row is divided by its uniform share 1 / (i + 1), then
    each ratio by the mean ratio of its head at its query-key distance i - j (over the batch and the queries), and
    token j's score is the mean over the n - j queries that see it and over the heads. With `standardise` (a
    training forward) and more than one sequence, each position's scores are then standardised over the batch (a
    late token's mean is over few queries, so it spreads wider, and top-k would favour its extremes); an
    evaluation or exported forward leaves that out (its top-k then depends on the other sequences only through
    the per-distance means, and the exported graphs match eager top-k, tested). Uniform
    attention scores every token alike, and a head's habit of attending to recent tokens no longer decides the
    ranking (the histogram of selected positions of a trained model: docs/results.md).
    """
    batch, heads, n, _ = probs.shape
    position = torch.arange(n, device=probs.device)  # (n,)
    if rule == "seen-by":
        return probs.sum(dim=2).mean(dim=1) / (n - position)  # (B, n)
    distance = position[:, None] - position[None, :]  # (n, n) query - key
    causal = distance >= 0
    relative = probs.float() * (position + 1)[:, None]  # (B, H, n, n) each query row over its uniform share
    index = distance.clamp(min=0).expand(heads, n, n).reshape(heads, -1)  # (H, n n)
    per_distance = relative.sum(dim=0).masked_fill(~causal, 0.0).reshape(heads, -1)  # (H, n n)
    totals = torch.zeros(heads, n, device=probs.device).scatter_add(1, index, per_distance)  # (H, n) by distance
    usual = (totals / (batch * (n - position)).float()).clamp(min=torch.finfo(torch.float32).tiny)  # (H, n) by distance
    ratio = (relative / usual[:, distance.clamp(min=0)]).masked_fill(~causal, 0.0)  # (B, H, n, n)
    score = ratio.sum(dim=2).mean(dim=1) / (n - position).float()  # (B, n)
    # A late token's score is a mean over few queries, so it spreads wider and top-k would favour its extremes: each
    # position's scores are standardised over the batch's sequences, where they spread at all (not for one
    # sequence; no branch on the batch size, so an exported graph with a dynamic batch does the same).
    if standardise:
        spread = score.std(dim=0, correction=0)  # (n,)
        standard = (score - score.mean(dim=0)) / spread.clamp(min=1e-6)  # (B, n)
        score = torch.where(spread > 1e-6, standard, score)
    return score


class HeadNorm(nn.Module):
    """RMSNorm of each attention head over its own width (--qk-norm: Qwen3's q_norm and k_norm): x (..., heads, hd)
    normalised in float32, times the weight (hd,) every head shares, in x's dtype. Written out rather than
    nn.RMSNorm, which torch.export cannot trace on a 4-D input whose token count is data-dependent (the tokens a
    routed block selects, in the exported graphs)."""

    def __init__(self, head_dim: int, eps: float | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps  # None: the dtype's machine epsilon, as nn.RMSNorm

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * self.weight.float()).to(x.dtype)


def window_mask(query_positions: Tensor, key_positions: Tensor, window: int) -> Tensor:
    """Local causal attention (--sliding-window): query_positions (..., n), key_positions (..., L) -> (..., n, L),
    True where the key is at or before the query and at distance < window (transformers' sliding-window mask:
    key > query - window)."""
    distance = query_positions[..., :, None] - key_positions[..., None, :]  # (..., n, L)
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int = 0) -> None:
        super().__init__()
        self.window = window  # --sliding-window on this layer: keys at distance < window only; 0 = every earlier key
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.sizes = [config.n_heads * config.head_dim] + 2 * [config.kv_heads * config.head_dim]  # q, k, v
        self.qkv = nn.Linear(config.d_model, sum(self.sizes), bias=config.qkv_bias)
        self.proj = nn.Linear(self.sizes[0], config.d_model, bias=False)
        # --qk-norm (Qwen3): each query and key head RMS-normalised over its own width before RoPE
        self.q_norm = HeadNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = HeadNorm(config.head_dim, config.norm_eps) if config.qk_norm else None
        self.dropout = config.dropout
        scoring = config.router_options  # A-MoD's --attention-score, when the model's router reads attention
        self.attention_score = scoring.attention_score if isinstance(scoring, AttentionOptions) else None

    def _heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, n, hd) and k, v (B, Hkv, n, hd), RoPE applied to q and k."""
        batch, n, _ = x.shape
        rotated_heads = self.n_heads + self.n_kv_heads  # q's heads, then k's
        # explicit head counts, never -1: a compiled causal prefill's n may be 0, and -1 cannot be inferred then
        heads = self.qkv(x).view(batch, n, rotated_heads + self.n_kv_heads, self.head_dim)  # (B, n, H + 2 Hkv, hd)
        rotated = heads[:, :, :rotated_heads]  # (B, n, H + Hkv, hd)
        if self.q_norm is not None:
            rotated = torch.cat([self.q_norm(rotated[:, :, :self.n_heads]), self.k_norm(rotated[:, :, self.n_heads:])],
                                dim=2)  # (B, n, H + Hkv, hd)
        q, k = apply_rope(rotated, cos, sin).transpose(1, 2).split(
            [self.n_heads, self.n_kv_heads], dim=1)  # (B, H, n, hd), (B, Hkv, n, hd)
        return q, k, heads[:, :, rotated_heads:].transpose(1, 2)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, n, hd) of the n tokens x (B, n, D), RoPE applied to k: the K/V rows of the fused projection
        only (--keep-skipped-kv: every token's keys and values, no queries)."""
        batch, n, _ = x.shape
        q_width = self.sizes[0]
        bias = self.qkv.bias[q_width:] if self.qkv.bias is not None else None
        heads = F.linear(x, self.qkv.weight[q_width:], bias).view(batch, n, 2 * self.n_kv_heads,
                                                                   self.head_dim)  # (B, n, 2 Hkv, hd)
        k = heads[:, :, :self.n_kv_heads]  # (B, n, Hkv, hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k, cos, sin).transpose(1, 2)  # (B, Hkv, n, hd)
        return k, heads[:, :, self.n_kv_heads:].transpose(1, 2)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """q (B, H, n, hd) of the n tokens x (B, n, D), RoPE applied: the query rows of the fused projection only."""
        batch, n, _ = x.shape
        q_width = self.sizes[0]
        bias = self.qkv.bias[:q_width] if self.qkv.bias is not None else None
        q = F.linear(x, self.qkv.weight[:q_width], bias).view(batch, n, self.n_heads, self.head_dim)  # (B, n, H, hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin).transpose(1, 2)

    def local_mask(self, positions: Tensor, n: int) -> Tensor:
        """The attention mask of n tokens in ascending order at `positions` (B, n) or (n,) on a local layer: causal by
        slot (a routed block's padding slots come after its selected tokens, at unselected positions, and must stay
        unseen) and within the window by original position -> (B, 1, n, n) or (n, n)."""
        causal = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()  # (n, n) slot >= key slot
        local = window_mask(positions, positions, self.window) & causal  # (B, n, n) or (n, n)
        return local[:, None] if local.dim() == 3 else local

    def share_kv(self, kv: Tensor) -> Tensor:
        """(B, Hkv, L, hd) -> (B, H, L, hd): each key/value head serves n_heads / n_kv_heads query heads."""
        return kv if self.n_kv_heads == self.n_heads else kv.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                prefill: tuple[LayerKVCache, Tensor, Tensor] | None = None, received: dict | None = None,
                context: tuple[Tensor, Tensor, Tensor] | None = None, positions: Tensor | None = None) -> Tensor:
        """Causal attention among the n given tokens (B, n, D), which are in ascending original order.

        With `prefill = (cache, rows, counts)` their K/V are also written to the cache. With a `received` dict, the
        attention probabilities are computed explicitly (no fused kernel) and `received["scores"]` is set to the
        attention each token receives (B, n), position-neutral (A-MoD's score; no gradient; `received_attention`).
        With `context = (keys, values, positions)` (--keep-skipped-kv: keys/values (B, Hkv, T, hd) of every token,
        positions (B, n) the original positions of x's tokens), x's tokens are queries only and attend to every key
        at or before their own position. `positions` (B, n): the original positions of x's tokens (None: 0..n-1),
        which a local layer's window is measured in.
        """
        batch, n, d_model = x.shape
        dropout = self.dropout if self.training else 0.0
        if self.window and positions is None and context is None:
            positions = torch.arange(n, device=x.device)  # (n,)
        if context is not None:
            keys, values, positions = context
            q = self.queries(x, cos, sin)  # (B, H, n, hd)
            key_positions = torch.arange(keys.shape[2], device=x.device)  # (T,)
            visible = key_positions[None, None, :] <= positions[:, :, None]  # (B, n, T) key <= query position
            if self.window:
                visible = window_mask(positions, key_positions.expand(batch, -1), self.window)  # (B, n, T)
            out = F.scaled_dot_product_attention(q, self.share_kv(keys), self.share_kv(values),
                                                 attn_mask=visible[:, None], dropout_p=dropout)  # (B, H, n, hd)
            return self.proj(out.transpose(1, 2).reshape(batch, n, self.sizes[0]))
        q, k, v = self._heads(x, cos, sin)
        if prefill is not None:
            cache, rows, counts = prefill
            cache.write_prefix(rows, k, v, counts, positions)
        k, v = self.share_kv(k), self.share_kv(v)  # (B, H, n, hd); the cache above holds the Hkv heads only
        if received is None and self.window:
            local = self.local_mask(positions, n)  # (B, 1, n, n) or (n, n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=local, dropout_p=dropout)  # (B, H, n, hd)
        elif received is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)  # (B, H, n, hd)
        else:
            scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, n, n)
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()  # (n, n) query >= key
            if self.window:
                causal = self.local_mask(positions, n)  # (B, 1, n, n) or (n, n)
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # (B, H, n, n)
            received["scores"] = received_attention(probs.detach(), self.attention_score, self.training)  # (B, n)
            out = F.dropout(probs, dropout, self.training).to(v.dtype) @ v  # (B, H, n, hd)
        return self.proj(out.transpose(1, 2).reshape(batch, n, self.sizes[0]))

    def decode(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerKVCache, rows: Tensor,
               context: tuple[Tensor, Tensor, Tensor | None] | None = None,
               positions: Tensor | None = None) -> Tensor:
        """One new token per row (n, 1, D): append its K/V to the cache rows, attend to the row's cache. With
        `context = (keys, values, mask)` (--keep-skipped-kv: the rows' cache, this step's K/V already appended, as
        `LayerKVCache.append` returns it), only the query is computed and nothing is written. `positions` (n,):
        the tokens' positions, which a local layer's cache needs (`LayerKVCache.append`)."""
        n = x.shape[0]
        if context is None:
            q, k, v = self._heads(x, cos, sin)
            keys, values, mask = cache.append(rows, k, v, positions)  # (n, Hkv, L, hd), (n, 1, 1, L)
        else:
            q = self.queries(x, cos, sin)  # (n, H, 1, hd)
            keys, values, mask = context
        keys, values = self.share_kv(keys.to(q.dtype)), self.share_kv(values.to(q.dtype))  # (n, H, L, hd)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(n, 1, -1))


class SwiGLU(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or, with --mlp-activation gelu-tanh, the
    tanh-approximated GELU (GeGLU: Gemma 3's gelu_pytorch_tanh)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.hidden, bias=False)
        self.down = nn.Linear(config.hidden, config.d_model, bias=False)
        self.gelu = config.mlp_activation == "gelu-tanh"

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """x (..., D) -> (..., D); `token_ids` is the MoE MLP's argument (hash routing), unused here."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(activated * up)


def dropped_weight(config: ModelConfig, name: str) -> bool:
    """`name` (a state-dict key, "blocks.L.attn.qkv.weight") is a weight of a sublayer --drop removes from `config`'s
    model: a whole model's checkpoint loads into a dropped one without it."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "blocks" or not parts[1].isdigit():
        return False
    layer, module = int(parts[1]), parts[2]
    return ((module in ("attn", "attn_norm", "attn_post_norm") and config.attention_dropped(layer))
            or (module in ("mlp", "mlp_norm", "mlp_post_norm") and config.mlp_dropped(layer)))


class LowRankSkip(nn.Module):
    """--skip-update linear: a skipped token's forecast update U(D(x)) (D: d_model -> rank, U: rank -> d_model, no
    biases). U starts at zero, so the block starts as the identity for skipped tokens, as without it."""

    def __init__(self, d_model: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False)
        self.up = nn.Linear(rank, d_model, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: Tensor, processed: Tensor) -> Tensor:
        """The forecast for the tokens of x (..., n, D) that `processed` (..., n) says were skipped, 0 for the rest."""
        return torch.where(processed.unsqueeze(-1), 0.0, self.up(self.down(x))).to(x.dtype)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        # --drop: a dropped sublayer has no modules (no weights, no work); `kept` is what the block computes
        self.kept = config.kept_part(layer)
        has_attention, has_mlp = self.kept in ("block", "attention"), self.kept in ("block", "mlp")
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if has_attention else None
        window = config.sliding_window if config.is_sliding(layer) else 0
        self.attn = Attention(config, window) if has_attention else None
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if has_mlp else None
        # --sandwich-norm (Gemma 3): each sublayer's output is RMS-normalised too, before the residual add
        sandwich = config.sandwich_norm
        self.attn_post_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if sandwich and has_attention else None
        self.mlp_post_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if sandwich and has_mlp else None
        # --local-rope-base: a local layer's own RoPE base (the model hands every block the global tables)
        base = config.rope_base_at(layer)
        self.own_rope_base = base if base != config.rope_base else None
        self.mlp = None
        if has_mlp:
            self.mlp = (MoEMLP(config.d_model, config.hidden, config.experts, config.expert_top_k,
                               config.expert_capacity_factor, config.noop_experts_of(layer), config.expert_weight,
                               config.expert_routing, config.vocab_size)
                        if config.experts else SwiGLU(config))
        self.delta_dropout = nn.Dropout(config.dropout)
        # Only a hash-routed MoE MLP reads token ids: other blocks gather none (an operator per routed block saved)
        self.mlp_reads_ids = isinstance(self.mlp, MoEMLP) and self.mlp.hashed
        self.routed = config.is_routed(layer)
        self.part = config.route_part_at(layer) if self.routed else "block"  # what the router skips (--route-part)
        self.router: Router | None = router_class(config.router)(config, layer) if self.routed else None
        self.skip = (LowRankSkip(config.d_model, config.skip_rank)
                     if self.routed and config.skip_update == "linear" else None)
        # A dense block before a block whose router reads attention maps (A-MoD) hands on what each token received,
        # in the router's full-sequence modes (its causal modes decide without them).
        self.feeds_router = (not self.routed and config.is_routed(layer + 1) and layer + 1 < config.n_layers
                             and ROUTER_KINDS[config.router].reads_previous_attention)
        self.next_causal_modes = router_class(config.router).capabilities.causal_modes if self.feeds_router else ()

    def mlp_update(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """The MLP sublayer's update of x (..., D): norm, MLP and, with --sandwich-norm, the norm after it."""
        update = self.mlp(self.mlp_norm(x), token_ids)
        return update if self.mlp_post_norm is None else self.mlp_post_norm(update)

    def attn_output(self, update: Tensor) -> Tensor:
        """The attention sublayer's output as the residual receives it (--sandwich-norm: normalised)."""
        return update if self.attn_post_norm is None else self.attn_post_norm(update)

    def own_rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """This local layer's RoPE tables at `positions` (--local-rope-base; no frequency scaling: Gemma 3 scales
        only its global layers)."""
        return rope_tables(positions, self.config.head_dim, self.own_rope_base)

    def delta(self, x: Tensor, cos: Tensor, sin: Tensor, prefill=None, received: dict | None = None,
              part: str = "block", token_ids: Tensor | None = None, context=None,
              positions: Tensor | None = None) -> Tensor:
        """f(x) of a pre-norm block without the residual: the attention update plus the MLP update (part "block"),
        or only the attention update ("attention") or only the MLP update ("mlp"), as `route_part` names them.
        `token_ids` (B, n): the ids of x's tokens, which a hash-routed MoE MLP reads. `context`: every token's K/V
        and x's positions (--keep-skipped-kv; `Attention.forward`). `positions` (B, n): x's original positions
        (a local layer's window; None: 0..n-1). With --sandwich-norm each update is normalised before it is
        added, so the routed block's x + w * f(x) holds with the post-norms inside f."""
        sublayers = route_part(part)
        if not sublayers.attention:
            return self.delta_dropout(self.mlp_update(x, token_ids))
        attn_update = self.delta_dropout(self.attn_output(
            self.attn(self.attn_norm(x), cos, sin, prefill, received, context, positions)))
        if not sublayers.mlp:
            return attn_update
        mlp_update = self.delta_dropout(self.mlp_update(x + attn_update, token_ids))
        return attn_update + mlp_update

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, routing: str, want_predictor: bool = False,
                cache: LayerKVCache | None = None, cache_rows: Tensor | None = None, lengths: Tensor | None = None,
                capacity: float | None = None, k: int | None = None, previous_attention: Tensor | None = None,
                token_ids: Tensor | None = None) -> tuple[Tensor, RoutingRecord | Tensor | None]:
        """x (B, T, D), cos/sin (T, hd/2) -> (B, T, D), and: a routed block's RoutingRecord; for a dense block that
        feeds an attention-reading router (A-MoD) in a full-sequence mode, the attention each token received (B, T),
        which the model hands to the next block as `previous_attention`; else None.

        `routing` is one of the router's modes: a causal one decides token by token, a full-sequence one keeps a
        fixed number of tokens, `k` (default from `capacity`, default the configured one). `lengths` (B,): rows
        are right-padded after their first `lengths` tokens (causal routing only). Padding is never selected by a
        routed block, and a dense block's cache counts only the real tokens, so the padded slots lie beyond each
        row's length and decode appends overwrite them. `token_ids` (B, T): the input ids (a hash-routed MoE MLP
        reads them; a routed block hands its MLP those of the tokens it selected).
        """
        batch, seq_len, _ = x.shape
        if self.own_rope_base is not None:  # a local layer's own RoPE base: its tables at 0..T-1
            cos, sin = self.own_rope(torch.arange(seq_len, device=x.device))  # (T, hd/2)
        every_token = None  # a prefill that caches every (real) token
        if cache is not None:
            counts = lengths if lengths is not None else torch.full((batch,), seq_len, device=x.device,
                                                                     dtype=torch.long)  # (B,)
            every_token = (cache, cache_rows, counts)
        if not self.routed:
            if self.kept is None:  # --drop: both sublayers removed, the block is the identity
                return x, None
            received = {} if self.feeds_router and routing not in self.next_causal_modes else None
            x = x + self.delta(x, cos[None], sin[None], every_token, received, part=self.kept, token_ids=token_ids)
            return x, (received["scores"] if received else None)

        router = self.router
        capacity = self.config.capacity if capacity is None else capacity
        positions = torch.arange(seq_len, device=x.device)  # (T,)
        router_logits = router.logits(x, positions, previous_attention)  # (B, T)
        predictor_logits = router.predictor_logits(x) if want_predictor or routing == "predictor" else None
        keep_first = self.config.keep_first  # positions 0..keep_first-1 are always processed (--keep-first)
        if router.capabilities.is_causal(routing):
            decisions = router.decide(x, router_logits, routing, positions, capacity, predictor_logits)  # (B, T)
            decisions = keep_first_decisions(decisions, positions, keep_first)
            if lengths is not None:  # padding comes after each row's tokens: never processed, never cached
                decisions = decisions & (positions[None, :] < lengths[:, None])
            selection = select_causal(decisions)
        else:
            scores = keep_first_scores(router_logits, positions, keep_first)
            selection = router.select(scores, routing, k if k is not None else router.static_tokens(seq_len, capacity))
        record = RoutingRecord(self.layer, routing, router, router_logits, predictor_logits, selection, capacity)
        rule = route_part(self.part)
        if rule.before:  # attention (and the KV cache) covers every token; only the MLP is routed
            x = x + self.delta(x, cos[None], sin[None], every_token, part=rule.before)
            cache = None
        x = self.update_selected(x, selection, router_logits, cos, sin, cache, cache_rows, token_ids, every_token)
        if rule.after:  # only attention was routed; the MLP runs on every token
            x = x + self.delta(x, cos[None], sin[None], part=rule.after, token_ids=token_ids)
        return x, record

    def update_selected(self, x: Tensor, selection: Selection, router_logits: Tensor, cos: Tensor, sin: Tensor,
                        cache: LayerKVCache | None = None, cache_rows: Tensor | None = None,
                        token_ids: Tensor | None = None, every_token=None) -> Tensor:
        """Run the routed part of the block (--route-part) on the selected tokens only and write `x + w * f(x)` back
        at their positions; every other token (and every padding slot) stays x bit for bit. With `cache`, their
        K/V are written to it (prefill). `token_ids` (B, T): the ids of x's tokens; the MLP gets the selected ones.

        --keep-skipped-kv (routed attention): every token's K/V are computed (and, with `every_token = (cache, rows,
        counts)`, cached like a dense layer's), and the selected tokens' queries attend to every key at or before
        their position; the rest of the routed work is still the selected tokens' only."""
        idx = selection.selected_idx  # (B, k)
        if self.skip is not None:  # --skip-update linear: the skipped tokens' forecast, added after the routed work
            valid = torch.ones_like(idx, dtype=x.dtype) if selection.valid is None else selection.valid.to(x.dtype)
            processed = torch.zeros(x.shape[:2], dtype=x.dtype, device=x.device).scatter_add(1, idx, valid) > 0
            forecast = self.skip(x, processed)  # (B, T, D)
            return self._update_selected(x, selection, router_logits, cos, sin, cache, cache_rows, token_ids,
                                         every_token) + forecast
        return self._update_selected(x, selection, router_logits, cos, sin, cache, cache_rows, token_ids, every_token)

    def _update_selected(self, x: Tensor, selection: Selection, router_logits: Tensor, cos: Tensor, sin: Tensor,
                         cache: LayerKVCache | None, cache_rows: Tensor | None, token_ids: Tensor | None,
                         every_token) -> Tensor:
        idx = selection.selected_idx  # (B, k)
        context = None
        if self.config.keep_skipped_kv and route_part(self.part).attention:
            keys, values = self.attn.keys_values(self.attn_norm(x), cos[None], sin[None])  # (B, Hkv, T, hd) each
            if every_token is not None:
                layer_cache, rows, counts = every_token
                layer_cache.write_prefix(rows, keys, values, counts)  # slot = position
            context = (keys, values, idx)
            cache = None  # stored above, every token
        if guard_or_false(idx.shape[1] == 0):  # compiled with k unknown: the general path handles k = 0 too
            if cache is not None:
                cache.forget(cache_rows)
            return x  # no sequence processed any token: the block costs nothing
        x_selected = gather_tokens(x, idx)  # (B, k, D)
        prefill = (cache, cache_rows, selection.counts) if cache is not None else None
        selected_ids = token_ids.gather(1, idx) if token_ids is not None and self.mlp_reads_ids else None  # (B, k)
        delta = self.delta(x_selected, cos[idx], sin[idx], prefill, part=self.part,
                           token_ids=selected_ids, context=context, positions=idx)  # (B, k, D)
        weight = self.router.weight(router_logits.gather(1, idx)).unsqueeze(-1)  # (B, k, 1)
        keep = None if selection.valid is None else selection.valid.unsqueeze(-1)  # (B, k, 1)
        return scatter_tokens(x, idx, residual_update(x_selected, delta, weight, keep))

    def decode(self, x: Tensor, positions: Tensor, routing: str, cache: LayerKVCache,
               token_ids: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """One token per sequence: x (B, 1, D), positions (B,), token_ids (B, 1) its id (for a hash-routed MoE
        MLP). A skipped token does no attention/MLP work. `rope`: the RoPE tables (cos, sin) (B, 1, hd/2) of
        `positions`, made once per step by the caller (`decode_rope`) and shared by every block; None: made here."""
        batch = x.shape[0]
        if self.own_rope_base is not None:  # a local layer's own RoPE base
            rope = self.own_rope(positions[:, None])  # (B, 1, hd/2) each
        if not self.routed:
            if self.kept is None:  # --drop: the identity
                return x
            rows = torch.arange(batch, device=x.device)
            cos, sin = rope if rope is not None else decode_rope(self.config, positions)
            return x + self._decode_delta(x, cos, sin, cache, rows, self.kept, token_ids, **self._local(positions))
        router, rule = self.router, route_part(self.part)
        part = rule.name
        router_logits = router.logits(x, positions[:, None])  # (B, 1)
        decisions = router.decide(x, router_logits, routing, positions[:, None], self.config.capacity)  # (B, 1)
        decisions = keep_first_decisions(decisions, positions[:, None], self.config.keep_first)
        if rule.before:  # every row attends and is cached; only the MLP is routed
            rows = torch.arange(batch, device=x.device)
            cos, sin = rope if rope is not None else decode_rope(self.config, positions)
            x = x + self._decode_delta(x, cos, sin, cache, rows, rule.before, **self._local(positions))  # no ids
        context = None
        x_in = x  # what the skip forecast reads (--skip-update linear)
        if rule.attention and self.config.keep_skipped_kv:  # every row stores its K/V; only processed rows attend
            every_row = torch.arange(batch, device=x.device)
            cos, sin = rope if rope is not None else decode_rope(self.config, positions)  # (B, 1, hd/2)
            new_keys, new_values = self.attn.keys_values(self.attn_norm(x), cos, sin)  # (B, Hkv, 1, hd)
            # (B, Hkv, L, hd) x2, mask (B, 1, 1, L) | None
            context = cache.append(every_row, new_keys, new_values, positions)
        # `nonzero` is a host sync, one per routed block per step: it is what lets a skipped token skip the
        # attention and MLP work in eager PyTorch (a later issue replaces it with torch.cond / CUDA graphs).
        rows = decisions[:, 0].nonzero().squeeze(1)  # (n,) processed rows
        processed = rows.numel()
        if processed == batch:
            # Every row processes the token (each processed step at batch 1): the whole tensors, with no row reads
            # and no indexed write back (6 operators fewer); the same values as the general path below.
            cos, sin = rope if rope is not None else decode_rope(self.config, positions)  # (B, 1, hd/2)
            weight = router.weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
            ids = token_ids if self.mlp_reads_ids else None  # (B, 1)
            delta = self._decode_delta(x, cos, sin, cache, rows, part, ids, context, **self._local(positions))
            x = residual_update(x, delta, weight)
        elif processed:
            x_rows = x[rows]  # (n, 1, D)
            if rope is None:
                cos, sin = decode_rope(self.config, positions[rows])  # (n, 1, hd/2)
            else:  # the step's tables at the processed rows: the same values (cos and sin are elementwise)
                cos, sin = rope[0][rows], rope[1][rows]  # (n, 1, hd/2)
            weight = router.weight(router_logits[rows]).unsqueeze(-1)  # (n, 1, 1)
            row_ids = token_ids[rows] if token_ids is not None and self.mlp_reads_ids else None  # (n, 1)
            if context is not None:  # the processed rows' caches
                keys, values, mask = context
                context = (keys[rows], values[rows], mask[rows] if mask is not None else None)
            delta = self._decode_delta(x_rows, cos, sin, cache, rows, part, row_ids, context,
                                       **self._local(positions[rows]))  # (n, 1, D)
            x = x.index_put((rows,), residual_update(x_rows, delta, weight))
        if self.skip is not None:
            x = x + self.skip(x_in, decisions)  # decisions (B, 1): the skipped rows' forecast
        if rule.after:  # only attention was routed; the MLP runs on every row
            x = x + self.mlp_update(x, token_ids)
        return x

    def _local(self, positions: Tensor) -> dict[str, Tensor]:
        """`_decode_delta`'s positions argument where a local layer's cache needs the rows' positions, else none."""
        return {"positions": positions} if self.attn is not None and self.attn.window else {}

    def _decode_delta(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerKVCache, rows: Tensor,
                      part: str = "block", token_ids: Tensor | None = None, context=None,
                      positions: Tensor | None = None) -> Tensor:
        """f(x) of one token per row (n, 1, D) with the KV cache, `token_ids` (n, 1) their ids; `part` as in
        `delta`; `context`: the rows' cache with this step's K/V already stored (`Attention.decode`); `positions`
        (n,): the rows' positions (a local layer's cache keeps them)."""
        sublayers = route_part(part)
        if not sublayers.attention:
            return self.mlp_update(x, token_ids)
        attn_update = self.attn_output(self.attn.decode(self.attn_norm(x), cos, sin, cache, rows, context, positions))
        if not sublayers.mlp:
            return attn_update
        return attn_update + self.mlp_update(x + attn_update, token_ids)


class ScaledEmbedding(nn.Embedding):
    """--scale-embeddings (Gemma 3): the looked-up rows times sqrt(d_model), the factor rounded to the weight's dtype
    first as transformers' Gemma3TextScaledWordEmbedding does (in bfloat16, sqrt(640) = 25.30 becomes 25.25)."""

    def forward(self, tokens: Tensor) -> Tensor:
        scale = torch.tensor(self.embedding_dim ** 0.5, device=self.weight.device).to(self.weight.dtype)
        return super().forward(tokens) * scale


class MoDDecoder(nn.Module):
    """Decoder-only transformer with Mixture-of-Depths blocks (every `route_every`-th one)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Looked up once: the registry's import lookup would break a torch.compile graph at every call.
        self._capabilities = None if config.dense else router_class(config.router).capabilities
        self.embed = (ScaledEmbedding(config.vocab_size, config.d_model) if config.scale_embeddings
                      else nn.Embedding(config.vocab_size, config.d_model))
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self._add_head_and_initialise(self.blocks)

    def _add_head_and_initialise(self, blocks) -> None:
        """The final norm and LM head (tied to the embedding unless configured otherwise), then every weight's
        initialisation: N(0, 0.02), the residual projections of `blocks` scaled by 1 / sqrt(2 x n_layers)."""
        config = self.config
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in blocks:
            if block.attn is not None:  # --drop leaves no module
                nn.init.normal_(block.attn.proj.weight, std=residual_std)
            if block.mlp is not None:
                down = block.mlp.down
                nn.init.normal_(down if isinstance(down, nn.Parameter) else down.weight, std=residual_std)
            if block.skip is not None:  # --skip-update linear starts as the identity path
                nn.init.zeros_(block.skip.up.weight)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # --- routing: what the router kind offers, asked by every command instead of comparing names -----------------

    @property
    def capabilities(self) -> RouterCapabilities | None:
        """The router kind's capabilities; None for a dense model (nothing is routed)."""
        return self._capabilities

    def routing_modes(self) -> tuple[str, ...]:
        """The routing modes of a full forward pass this model offers, its training mode first; () when dense."""
        routers = [block.router for block in self.blocks if block.router is not None]
        return routers[0].modes() if routers else ()

    def causal_modes(self) -> tuple[str, ...]:
        """The modes prefill and decoding can use (each token decided from itself and the tokens before it)."""
        caps = self.capabilities
        return tuple(mode for mode in self.routing_modes() if caps.is_causal(mode))

    @property
    def training_mode(self) -> str:
        return self.routing_modes()[0] if not self.config.dense else "dense"

    def check_routing(self, routing: str, causal: bool = False) -> None:
        """A UserError naming the router and what it offers, unless `routing` is one of its (causal) modes."""
        if self.config.dense:
            return  # nothing is routed: every mode is the same dense model
        offered = self.causal_modes() if causal else self.routing_modes()
        if routing in offered:
            return
        kind = self.config.router
        why = ""
        if routing in self.capabilities.needs_predictor:
            why = " (this model has no predictor: it was trained with --predictor-hidden 0)"
        elif causal and routing in self.routing_modes():
            why = f" ({routing} is not causal: it sees the future and cannot decode)"
        raise UserError(f"--routing {routing}: the {kind} router offers {', '.join(offered)}{why}")

    def forward(self, tokens: Tensor, routing: str | None = None, *, return_aux: bool = False,
                cache: DecoderCache | None = None, cache_rows: Tensor | None = None, lengths: Tensor | None = None,
                capacity: float | None = None, k: int | None = None):
        """tokens (B, T) -> logits (B, T, V); with `return_aux`, (logits, ForwardAux): each routed block's
        RoutingRecord and each MoE block's statistics.

        `routing`: one of `routing_modes()` (default the training mode), e.g. topk (training-time, non-causal),
        router or predictor (causal) for the topk router. With `cache` the K/V of the tokens each block processes
        are written to rows `cache_rows` of the cache (prefill). `lengths` (B,) right-pads row b after its first
        lengths[b] tokens (causal routing only): padding is never processed by a routed block nor counted in the
        cache, each row's next position is its length, and the logits at padded positions mean nothing (take row
        b's at lengths[b] - 1). `capacity` overrides the configured capacity (--capacity-warmup); `k` fixes the
        number of tokens of the full-sequence modes (the export graph computes it from T inside the graph).
        """
        routing = self.training_mode if routing is None else routing
        self.check_routing(routing)
        caps = self.capabilities
        if lengths is not None and caps is not None and not caps.is_causal(routing):
            raise ValueError(f"padded rows (lengths) need causal routing: {routing} would rank the padding")
        batch, seq_len = tokens.shape
        positions = torch.arange(seq_len, device=tokens.device)
        cos, sin = config_rope(self.config, positions)  # (T, hd/2)
        x = self.embed(tokens)  # (B, T, D)
        records = []
        if cache is not None and cache_rows is None:
            cache_rows = torch.arange(batch, device=tokens.device)
        previous_attention = None
        for layer, block in enumerate(self.blocks):
            layer_cache = cache.layers[layer] if cache is not None else None
            x, out = block(x, cos, sin, routing, return_aux, layer_cache, cache_rows, lengths, capacity, k,
                           previous_attention, tokens)
            previous_attention = out if isinstance(out, Tensor) else None  # (B, T) for an A-MoD router next
            if isinstance(out, RoutingRecord):
                records.append(out)
        if cache is not None:
            cache.positions[cache_rows] = seq_len if lengths is None else lengths
        logits = self.head(self.norm(x))  # (B, T, V)
        return (logits, ForwardAux(records, self.expert_stats())) if return_aux else logits

    def expert_stats(self) -> dict[int, ExpertStats]:
        """The statistics each MoE block computed in the forward pass just run, by layer."""
        return {layer: block.mlp.stats for layer, block in enumerate(self.blocks)
                if isinstance(block.mlp, MoEMLP) and block.mlp.stats is not None}

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, cache: DecoderCache, routing: str | None = None) -> Tensor:
        """tokens (B,) at each sequence's next position -> logits (B, V); updates the cache.

        `routing`: one of `causal_modes()`, default the first."""
        if routing is None:
            routing = (self.causal_modes() or ("dense",))[0]
        self.check_routing(routing, causal=True)
        x = self.embed(tokens)[:, None]  # (B, 1, D)
        rope = decode_rope(self.config, cache.positions)  # (B, 1, hd/2) each, shared by every block
        for layer, block in enumerate(self.blocks):
            x = block.decode(x, cache.positions, routing, cache.layers[layer], tokens[:, None], rope)
        cache.positions += 1
        return self.head(self.norm(x))[:, 0]  # (B, V)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the experts it does not choose (top-k of E real experts; no-op
        experts at their uniform share N / (E + N), the share the load-balancing loss aims at)."""
        total = self.num_parameters()
        for block in self.blocks:
            if isinstance(block.mlp, MoEMLP):
                moe = block.mlp
                per_expert = moe.gate_up[0].numel() + moe.down[0].numel()
                used = moe.top_k * moe.experts / moe.pool
                total -= round((moe.experts - used) * per_expert)
        return total

    def moe_blocks(self) -> list[MoEMLP]:
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoEMLP)]
