"""A Mixture-of-Depths decoder exported by `modcli export --hf`, for `AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`. Self-contained: torch and transformers only (modcli is not imported).

Every routed block decides token by token, from the token alone (its causal routing mode): a router logit above a
cut, a predictor logit above 0, or a hash of the position below the capacity. It gathers the tokens it picked
(ascending, original positions kept for RoPE and the causal mask), computes the pre-norm block's update f(x) for
them only and writes back x + w * f(x); every other token leaves the block unchanged and costs no attention or MLP
work. The KV cache (`RoutedCache`) holds, per layer and row, only the tokens that layer processed, so a row's cache
in a routed layer is really shorter. Left-padded batches (the attention mask) work: padding is never processed,
and each row's positions count its own tokens from 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_modcli import ModcliConfig

HASH_MODULUS = 2_147_483_647  # 2**31 - 1
HASH_SCALE = 256
_OUTPUT_FIELDS = CausalLMOutputWithPast.__dataclass_fields__
CACHE_FIELD = "cache" if "cache" in _OUTPUT_FIELDS else "past_key_values"  # transformers 5 renamed it


ROUTE_PARTS = {"block": (True, True), "attention": (True, False), "mlp": (False, True)}
"""--route-part -> (attention is routed, MLP is routed): the sublayers a skipped token skips; a sublayer not routed
runs on every token (attention before the routed update, the MLP after it). Restates modcli's routed-block rule
(modcli.models.routing.block_rule, which this file cannot import); tests/models/test_block_rule.py checks the two."""


def keep_first_decisions(chosen: Tensor, positions: Tensor, keep_first: int) -> Tensor:
    """--keep-first: positions 0..keep_first-1 are always processed (restates modcli's block_rule)."""
    return chosen | (positions < keep_first) if keep_first else chosen


def unit_weight(logits: Tensor) -> Tensor:
    weight = torch.sigmoid(logits)
    return weight - weight.detach() + 1.0  # value 1, the sigmoid's gradient


ROUTER_WEIGHTS = {"sigmoid": torch.sigmoid, "identity": lambda logits: logits, "none": torch.ones_like,
                  "unit": unit_weight}


def position_hash(layer: int, positions: Tensor) -> Tensor:
    """A uniform-looking integer in [0, HASH_MODULUS) per (layer, position), int64 arithmetic only."""
    h = (positions.long() + 1) * 48_271 + (layer + 1) * 69_621
    for _ in range(3):
        h = (h % HASH_MODULUS) * 16_807 + h // 65_536
    return h % HASH_MODULUS


def rope_tables(positions: Tensor, head_dim: int, base: float, scaling: dict | None) -> tuple[Tensor, Tensor]:
    """positions (...,) -> cos, sin (..., head_dim/2) in float32; `scaling`: Llama-3 frequency scaling."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    if scaling is not None:
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
        ramp = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        middle = (wavelength <= original / low) & (wavelength >= original / high)
        inv_freq = torch.where(middle, ramp, scaled)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (r, H, k, hd); cos/sin (r, k, hd/2) at each token's own position."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]  # (r, 1, k, hd/2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Picked:
    """The tokens one block processes: rows with any (r,), their positions idx (r, k) ascending, valid (r, k)
    (False: a padding slot after the row's picked tokens, whose result is discarded) and counts (r,)."""

    def __init__(self, chosen: Tensor) -> None:
        """chosen (B, n) bool; rows that picked nothing are left out altogether (one host sync)."""
        n = chosen.shape[1]
        counts = chosen.sum(dim=1)  # (B,)
        self.rows = counts.nonzero().squeeze(1)  # (r,)
        self.every_row = self.rows.numel() == chosen.shape[0]
        self.empty = self.rows.numel() == 0
        k = int(counts.max()) if not self.empty else 0
        positions = torch.arange(n, device=chosen.device)
        order_key = torch.where(chosen[self.rows], positions, positions + n)  # (r, n) picked first, in order
        self.idx = order_key.topk(k, dim=1, largest=False, sorted=True).indices  # (r, k)
        self.counts = counts[self.rows]  # (r,)
        self.valid = torch.arange(k, device=chosen.device)[None, :] < self.counts[:, None]  # (r, k)

    def gather(self, x: Tensor) -> Tensor:
        """x (B, n, ...) -> (r, k, ...)."""
        rows = x if self.every_row else x[self.rows]
        index = self.idx.view(*self.idx.shape, *([1] * (x.dim() - 2))).expand(*self.idx.shape, *x.shape[2:])
        return rows.gather(1, index)

    def scatter(self, x: Tensor, updated: Tensor) -> Tensor:
        """x (B, n, D) with updated (r, k, D) written at the picked positions; everything else is x bit for bit."""
        index = self.idx[..., None].expand(-1, -1, x.shape[-1])
        if self.every_row:
            return x.scatter(1, index, updated)
        return x.index_put((self.rows,), x[self.rows].scatter(1, index, updated))


class LayerCache:
    """One layer's K/V for a batch: (B, Hkv, slots, hd) buffers, written by slot, and each row's length (B,)."""

    def __init__(self, batch: int, heads: int, head_dim: int, device, dtype) -> None:
        self.keys = torch.zeros(batch, heads, 16, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,)
        self.max_length = 0  # host-side upper bound of the lengths: attention reads this many slots

    def write_and_read(self, picked: Picked, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store the picked tokens' K/V (r, Hkv, k, hd) after each row's cached ones, then return the K/V to attend
        to (r, Hkv, L, hd) and a mask (r, 1, k, L): token i of a row sees its cached slots and picked tokens 0..i."""
        k = keys.shape[2]
        needed = self.max_length + k
        if needed > self.keys.shape[2]:  # grow by doubling
            grow = max(needed, 2 * self.keys.shape[2]) - self.keys.shape[2]
            pad = self.keys.new_zeros(*self.keys.shape[:2], grow, self.keys.shape[3])
            self.keys, self.values = torch.cat([self.keys, pad], dim=2), torch.cat([self.values, pad], dim=2)
        rows = picked.rows
        start = self.lengths[rows]  # (r,)
        slots = start[:, None] + torch.arange(k, device=keys.device)  # (r, k)
        valid = picked.valid
        row_of = rows[:, None].expand_as(slots)  # (r, k)
        self.keys[row_of[valid], :, slots[valid]] = keys.transpose(1, 2)[valid].to(self.keys.dtype)  # (m, Hkv, hd)
        self.values[row_of[valid], :, slots[valid]] = values.transpose(1, 2)[valid].to(self.values.dtype)
        self.lengths[rows] = start + picked.counts
        self.max_length = needed
        span = self.max_length
        if picked.every_row:
            cached_keys, cached_values = self.keys[:, :, :span], self.values[:, :, :span]
        else:
            cached_keys, cached_values = self.keys[rows, :, :span], self.values[rows, :, :span]
        mask = torch.arange(span, device=keys.device)[None, None, :] <= slots[:, :, None]  # (r, k, L)
        return cached_keys, cached_values, mask[:, None]

    def reorder(self, beam_idx: Tensor) -> None:
        self.keys, self.values = self.keys[beam_idx], self.values[beam_idx]
        self.lengths = self.lengths[beam_idx]


class RoutedCache:
    """The KV cache of every layer (each holds only the tokens it processed, or every token where skipped tokens keep
    their K/V: keep_skipped_kv) and each row's next position."""

    is_compileable = False

    def __init__(self, config: ModcliConfig, batch: int, device, dtype) -> None:
        self.layers = [LayerCache(batch, config.num_key_value_heads, config.head_dim, device, dtype)
                       for _ in range(config.num_hidden_layers)]
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) next position of each row
        self.seen = 0  # tokens fed per row, padding included (what generate slices input_ids by)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: Tensor) -> None:
        for layer in self.layers:
            layer.reorder(beam_idx)
        self.positions = self.positions[beam_idx]


class Attention(nn.Module):
    def __init__(self, config: ModcliConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        self.sizes = [self.n_heads * self.head_dim] + 2 * [self.n_kv_heads * self.head_dim]  # q, k, v
        self.qkv = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.qkv_bias)
        self.proj = nn.Linear(self.sizes[0], config.hidden_size, bias=False)
        # qk_norm (Qwen3): each query and key head RMS-normalised over its own width before RoPE
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None

    def normed(self, heads: Tensor, norm: nn.RMSNorm | None) -> Tensor:
        """q or k heads (r, H, k, hd) through their per-head RMSNorm, where the model has one."""
        return heads if norm is None else norm(heads)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, picked: Picked, cache: LayerCache,
                positions: Tensor | None = None) -> Tensor:
        """x (r, k, D) the picked tokens, cos/sin (r, k, hd/2) -> the attention update (r, k, D). With `positions`
        (r, k) (keep_skipped_kv: the cache already holds every token's K/V, `store`), queries only: `attend_cache`."""
        if positions is not None:
            return self.attend_cache(x, cos, sin, picked, positions, cache)
        r, k, _ = x.shape
        q, keys, values = (t.view(r, k, size // self.head_dim, self.head_dim).transpose(1, 2)
                           for t, size in zip(self.qkv(x).split(self.sizes, dim=-1), self.sizes, strict=True))
        q = apply_rope(self.normed(q, self.q_norm), cos, sin)  # (r, H, k, hd)
        keys = apply_rope(self.normed(keys, self.k_norm), cos, sin)  # (r, Hkv, k, hd)
        keys, values, mask = cache.write_and_read(picked, keys, values)  # (r, Hkv, L, hd), (r, 1, k, L)
        if self.n_kv_heads != self.n_heads:  # each key/value head serves n_heads / n_kv_heads query heads
            keys = keys.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            values = values.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)  # (r, H, k, hd)
        return self.proj(out.transpose(1, 2).reshape(r, k, self.sizes[0]))

    def store(self, x: Tensor, cos: Tensor, sin: Tensor, every: Picked, cache: LayerCache) -> None:
        """keep_skipped_kv: the K/V of the tokens x (r, k, D) (every real token) into the cache, no queries."""
        r, k, _ = x.shape
        keys, values = (t.view(r, k, self.n_kv_heads, self.head_dim).transpose(1, 2)
                        for t in self.qkv(x)[..., self.sizes[0]:].split(self.sizes[1:], dim=-1))
        cache.write_and_read(every, apply_rope(self.normed(keys, self.k_norm), cos, sin), values)

    def attend_cache(self, x: Tensor, cos: Tensor, sin: Tensor, picked: Picked, positions: Tensor,
                     cache: LayerCache) -> Tensor:
        """keep_skipped_kv: the picked tokens x (r, k, D) at positions (r, k) attend to their row's cache (every
        token's K/V, stored by `store`: slot = position), keys at or before their position -> (r, k, D)."""
        r, k, _ = x.shape
        q = self.qkv(x)[..., :self.sizes[0]].view(r, k, self.n_heads, self.head_dim).transpose(1, 2)  # (r, H, k, hd)
        q = apply_rope(self.normed(q, self.q_norm), cos, sin)
        span = cache.max_length
        keys, values = cache.keys[picked.rows, :, :span], cache.values[picked.rows, :, :span]  # (r, Hkv, L, hd)
        if self.n_kv_heads != self.n_heads:
            keys = keys.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            values = values.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        mask = torch.arange(span, device=x.device)[None, None, :] <= positions.clamp(min=0)[:, :, None]  # (r, k, L)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None])
        return self.proj(out.transpose(1, 2).reshape(r, k, self.sizes[0]))


class SwiGLU(nn.Module):
    def __init__(self, config: ModcliConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, ids: Tensor | None = None) -> Tensor:
        """x (..., D) -> (..., D); `ids` is the MoE MLP's argument, unused here."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoEMLP(nn.Module):
    """Token-choice top-k over the real experts and `noop_experts` that do nothing; a token's update is the sum of
    its chosen real experts' outputs times their gate probabilities (softmax over all experts, not renormalised), or
    times 1 where the run trained with `expert_weight = "unit"`. With `expert_routing = "hash"` there is no gate: a
    token's one expert is `hash_table[its id]` (a table saved with the weights), at weight 1.
    Each real expert runs on exactly the tokens that chose it; a token whose choices are all no-op skips the MLP."""

    def __init__(self, config: ModcliConfig, noop_experts: int) -> None:
        super().__init__()
        d_model, hidden = config.hidden_size, config.intermediate_size
        self.experts, self.top_k, self.pool = config.experts, config.expert_top_k, config.experts + noop_experts
        self.unit_weight = config.expert_weight == "unit"
        self.hashed = config.expert_routing == "hash"
        if self.hashed:
            self.register_buffer("hash_table", torch.zeros(config.vocab_size, dtype=torch.long))  # (vocab,)
        else:
            self.gate = nn.Linear(d_model, self.pool, bias=False)
        self.gate_up = nn.Parameter(torch.zeros(config.experts, d_model, 2 * hidden))  # (E, D, 2H)
        self.down = nn.Parameter(torch.zeros(config.experts, hidden, d_model))  # (E, H, D)

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        """x (..., D) and the ids of its tokens (...) -> the MLP update (..., D)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, D)
        if self.hashed:
            choice = self.hash_table[ids.reshape(-1)][:, None]  # (N, 1)
            weight = torch.ones(choice.shape, device=x.device)
        else:
            weight, choice = self.gate(tokens).float().softmax(dim=-1).topk(self.top_k, dim=-1)  # (N, K)
        if self.unit_weight:
            weight = torch.ones_like(weight)
        flat_choice, flat_weight = choice.reshape(-1), weight.reshape(-1)  # (N K,)
        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.top_k)  # (N K,)
        order = flat_choice.argsort(stable=True)  # choices grouped by expert, no-op experts last
        counts = torch.bincount(flat_choice, minlength=self.pool)[:self.experts].tolist()
        out = torch.zeros_like(tokens)
        start = 0
        for e, count in enumerate(counts):
            if count:
                picked = order[start:start + count]
                rows = token_of[picked]
                gate, up = (tokens[rows] @ self.gate_up[e]).chunk(2, dim=-1)
                update = ((F.silu(gate) * up) @ self.down[e]) * flat_weight[picked, None].to(x.dtype)  # (count, D)
                out = out.index_add(0, rows, update)
            start += count
        return out.view(shape)


class Router(nn.Module):
    """A routed block's causal rule and the weight of its update. The rule is the one modcli's router exported
    (modcli.models.routing.base.ExportedRule, which this file cannot import): its name (config.route_decision) picks
    one implementation of `rules`, its cut is config.route_cut, and config.route_score says whether the block has the
    scoring network whose logit gives the weight (else the weight is 1)."""

    def __init__(self, config: ModcliConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.decision, self.cut = layer, config.route_decision, config.route_cut
        d_model, hidden = config.hidden_size, config.router_hidden
        self.score = None
        if config.route_score:
            self.score = (nn.Sequential(nn.Linear(d_model, hidden), nn.SiLU(), nn.Linear(hidden, 1)) if hidden
                          else nn.Linear(d_model, 1))
        self.predictor = None
        if config.predictor_hidden:
            self.predictor = nn.Module()
            self.predictor.net = nn.Sequential(nn.Linear(d_model, config.predictor_hidden), nn.SiLU(),
                                               nn.Linear(config.predictor_hidden, 1))
        self.weight_function = ROUTER_WEIGHTS[config.router_weight]
        self.rules = {"score": self._by_score, "predictor": self._by_predictor, "position_hash": self._by_hash}
        if self.decision not in self.rules:
            raise ValueError(f"route_decision {self.decision!r} is not one of {', '.join(self.rules)}: this folder's "
                             "modeling_modcli.py is older than the modcli that wrote its config.json")

    def logits(self, x: Tensor) -> Tensor | None:
        return None if self.score is None else self.score(x).squeeze(-1)  # (B, n)

    def decide(self, x: Tensor, logits: Tensor | None, positions: Tensor) -> Tensor:
        """x (B, n, D), positions (B, n) -> (B, n) bool: which tokens the block processes."""
        return self.rules[self.decision](x, logits, positions)

    def _by_score(self, x: Tensor, logits: Tensor, positions: Tensor) -> Tensor:
        return logits > (-math.inf if self.cut is None else self.cut)

    def _by_predictor(self, x: Tensor, logits: Tensor | None, positions: Tensor) -> Tensor:
        return self.predictor.net(x).squeeze(-1) > 0

    def _by_hash(self, x: Tensor, logits: Tensor | None, positions: Tensor) -> Tensor:
        return (position_hash(self.layer, positions) // HASH_SCALE).float() < self.cut

    def weight(self, logits: Tensor | None, picked: Picked) -> Tensor | None:
        """The factor of the picked tokens' update (r, k, 1); None: 1."""
        if logits is None:
            return None
        return self.weight_function(picked.gather(logits)).unsqueeze(-1)


class SkipForecast(nn.Module):
    """A skipped token's low-rank forecast of the routed update: U(D(x))."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))


class Block(nn.Module):
    def __init__(self, config: ModcliConfig, layer: int) -> None:
        super().__init__()
        self.config = config
        # a static drop removes the sublayer (no weights, no work, no cache); a block with a drop is never routed
        self.has_attention = layer not in getattr(config, "dropped_attention", [])
        self.has_mlp = layer not in getattr(config, "dropped_mlp", [])
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.has_attention else None
        self.attn = Attention(config) if self.has_attention else None
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.has_mlp else None
        noop = config.noop_experts if layer in config.noop_layers else 0
        self.mlp = (MoEMLP(config, noop) if config.experts else SwiGLU(config)) if self.has_mlp else None
        self.routed = layer in config.routed_layers
        parts = getattr(config, "route_parts", None) or {}  # per block (--route-part attention:1-9,mlp:20-25)
        self.part = parts.get(str(layer), config.route_part) if self.routed else "block"
        self.routes_attention, self.routes_mlp = ROUTE_PARTS[self.part]
        # skipped tokens still store their K/V (no query, no update): picked tokens attend to every earlier token
        self.keeps_kv = self.routed and self.routes_attention and getattr(config, "keep_skipped_kv", False)
        self.router = Router(config, layer) if self.routed else None
        rank = getattr(config, "skip_rank", 0)  # the skipped tokens' low-rank forecast of the update (0: none)
        self.skip = SkipForecast(config.hidden_size, rank) if self.routed and rank else None

    def rope(self, positions: Tensor, picked: Picked) -> tuple[Tensor, Tensor]:
        config = self.config
        return rope_tables(picked.gather(positions), config.head_dim, config.rope_base, config.llama3_rope_scaling)

    def forward(self, x: Tensor, positions: Tensor, real: Tensor, cache: LayerCache, ids: Tensor) -> Tensor:
        """x (B, n, D), positions (B, n), real (B, n) bool (False: padding), ids (B, n) the token ids (what a
        hash-routed MoE MLP reads) -> (B, n, D)."""
        if not (self.has_attention and self.has_mlp):  # a static drop: what is left runs on every token
            every = Picked(real)
            if self.has_attention and not every.empty:
                h = every.gather(x)
                x = every.scatter(x, h + self.attn(self.attn_norm(h), *self.rope(positions, every), every, cache))
            if self.has_mlp:
                x = x + self.mlp(self.mlp_norm(x), ids)
            return x
        logits, chosen = None, real
        if self.routed:
            logits = self.router.logits(x)  # (B, n) or None
            chosen = self.router.decide(x, logits, positions)
            chosen = keep_first_decisions(chosen, positions, self.config.keep_first) & real
        if not self.routes_attention:  # every token attends and is cached; only the MLP is routed
            every = Picked(real)
            if not every.empty:
                h = every.gather(x)
                x = every.scatter(x, h + self.attn(self.attn_norm(h), *self.rope(positions, every), every, cache))
        if self.keeps_kv:  # every real token's K/V into the cache, before any picked token attends
            every = Picked(real)
            if not every.empty:
                self.attn.store(self.attn_norm(every.gather(x)), *self.rope(positions, every), every, cache)
        x_in = x  # what the skipped tokens' forecast reads
        picked = Picked(chosen)
        if not picked.empty:  # no row picked any token: the block costs nothing
            h = picked.gather(x)  # (r, k, D)
            picked_ids = picked.gather(ids) if getattr(self.mlp, "hashed", False) else None  # (r, k): hash routing's
            if not self.routes_attention:
                delta = self.mlp(self.mlp_norm(h), picked_ids)
            else:
                query_positions = picked.gather(positions) if self.keeps_kv else None  # (r, k)
                attn_update = self.attn(self.attn_norm(h), *self.rope(positions, picked), picked, cache,
                                        query_positions)
                delta = (attn_update if not self.routes_mlp
                         else attn_update + self.mlp(self.mlp_norm(h + attn_update), picked_ids))
            weight = self.router.weight(logits, picked) if self.routed else None
            updated = (h + delta if weight is None else h + weight * delta).to(h.dtype)
            x = picked.scatter(x, torch.where(picked.valid[..., None], updated, h))
        if self.skip is not None:  # the skipped real tokens: x + U(D(x))
            x = x + torch.where((chosen | ~real)[..., None], 0.0, self.skip(x_in)).to(x.dtype)
        if not self.routes_mlp:  # only attention was routed; the MLP runs on every token
            x = x + self.mlp(self.mlp_norm(x), ids)
        return x


class ModcliPreTrainedModel(PreTrainedModel):
    config_class = ModcliConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, MoEMLP):
            nn.init.normal_(module.gate_up, std=0.02)
            nn.init.normal_(module.down, std=0.02)


class ModcliForCausalLM(ModcliPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"head.weight": "embed.weight"}

    def __init__(self, config: ModcliConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own RoutedCache: a routed layer's rows hold different token counts

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: RoutedCache | None = None,
                use_cache: bool | None = None, labels: Tensor | None = None, logits_to_keep: int = 0,
                return_dict: bool | None = None, **kwargs) -> CausalLMOutputWithPast:
        """input_ids (B, n) after the tokens already in `cache`; attention_mask (B, n) or (B, cached + n), 0 for
        left padding. A new RoutedCache is made when none is given; it is returned with use_cache."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        batch, n = input_ids.shape
        device = input_ids.device
        if cache is None:
            cache = RoutedCache(self.config, batch, device, self.embed.weight.dtype)
        real = (torch.ones(batch, n, dtype=torch.bool, device=device) if attention_mask is None
                else attention_mask[:, -n:].bool())  # (B, n)
        positions = cache.positions[:, None] + real.long().cumsum(dim=1) - 1  # (B, n) each row counts its own tokens
        x = self.embed(input_ids)  # (B, n, D)
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block(x, positions, real, layer_cache, input_ids)
        cache.positions = cache.positions + real.sum(dim=1)
        cache.seen += n
        kept = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.head(self.norm(x[:, kept]))  # (B, n, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: RoutedCache | None = None,
                                      attention_mask: Tensor | None = None, **kwargs) -> dict:
        """Only the tokens the cache has not seen go to forward."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache,
                "use_cache": kwargs.get("use_cache", True), "logits_to_keep": kwargs.get("logits_to_keep", 0)}

    def _reorder_cache(self, cache: RoutedCache, beam_idx: Tensor) -> RoutedCache:
        cache.reorder_cache(beam_idx)
        return cache
