"""Export-friendly views of a trained MoDDecoder: the forward graph and the decode-step graph.

Both wrappers hold the model itself and call its own code (the forward pass, `Block.router`, `Block.delta`,
`Attention._heads`/`proj`, `Block.mlp`, the LM head) and `modcli.models.routing.selection.residual_update`, so the
exported graphs use the trained weights and the same maths; what they change is only what a graph cannot express
the eager way:

- `ForwardGraph` (the router's static mode: top-k for topk and random, capped threshold for threshold): the
  number of tokens kept, k = max(1, T * num // den), is computed inside the graph with integer arithmetic from T,
  so one graph serves every T and B; then `MoDDecoder.forward` runs with that k (TopK, indices in causal order,
  gather, the block on the k tokens, an overwrite scatter of `x + w * f(x)`).
- `DecodeStepGraph` (a causal mode): one token per sequence against an explicit, READ-ONLY KV cache, one
  (B, Hkv, slots, hd) buffer pair and a (B,) length vector per layer. It returns only this step's K/V per layer
  (B, Hkv, 1, hd) and, per routed block, which rows processed the token; the caller writes the rows into its
  buffers in place (`write_new_rows` here, `CacheSpec.write_rows` in the runtime), so a step costs nothing in the
  size of the cache beyond attention's own reads. Attention scores the cache and the token's own key separately
  and takes one softmax over both (`attend_cache_and_self`): the cache is never concatenated, scattered or copied.
  A routed block's work sits inside `torch.cond` (an ONNX `If`): when no sequence of the batch processes the token,
  the branch taken returns x unchanged and reads no cache memory. For B = 1 that is a real skip of every skipped
  token; for B > 1 the work is skipped only when every row skips, and when some rows process the token all rows
  are computed and the skipped rows' results are discarded (their hidden state stays bit for bit unchanged and
  their K/V are not stored).

Gemma 3's traits (`ModelConfig.gemma_options` names them) are the model's own code in both graphs: the scaled
embedding (`model.embed`), the norms after each sublayer (`Block.attn_output`, `Block.mlp_update`), the GeGLU MLP and
a local layer's own RoPE base (`Block.own_rope`). A local (--sliding-window) layer's decode step also needs each
cache slot's ORIGINAL position: a routed layer's slot s holds the s-th token it processed, not position s. So every
local layer with a cache has one more input, `slot_positions.L` (B, slots) int64 beside keys.L/values.L, in which
the caller stores the token's position at the slot where it stores its K/V (`write_outputs` here, the runtime's
`CacheSpec.write_rows`); a slot is visible when it is filled (slot < lengths.L[b]) and 0 <= position - its position
< window (`attend_cache_and_self`). Every local layer has the input, dense ones too (where it holds 0, 1, 2, ...):
one rule for every layer, and no reliance on how a caller fills the slots.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from modcli.models.cache import write_new_rows
from modcli.models.decoder import Block, MoDDecoder, config_rope
from modcli.models.routing.block_rule import capacity_tokens_in_graph, keep_first_decisions, route_part
from modcli.models.routing.selection import Selection, residual_update

ROW_CAP_FACTOR = 2
"""A routed block whose processing rows number at most this many times the expected B x capacity gathers and computes
only those rows (`DecodeStepGraph(row_cap=...)`)."""
EXPORT_ROW_CAP_BATCH = 8
"""The batch an exported decode graph's row cap is sized for (its batch is dynamic): at capacity 0.125, 2 rows."""


def row_cap_for(batch: int, capacity: float) -> int:
    """Rows a routed block gathers when few of `batch` process the token: ROW_CAP_FACTOR x batch x capacity, rounded
    up, at least 1."""
    return max(1, math.ceil(ROW_CAP_FACTOR * batch * capacity))


MASK_MARGIN = 40.0
"""The lowest exponent a softmax in the exported graphs takes, relative to its row's maximum: exp(-40) ~ 4.2e-18 is
far below float32's resolution (1.2e-7) of any sum of weights >= 1, and it keeps onnxruntime's CPU kernels on their
fast paths: Exp is slow below about -87, and weights near exp(-87) ~ 1e-38 make denormal products in the matmul
with the values (measured: a margin of 80 made the dense forward's matmuls 3.6x slower at T 1024). A visible score
further below its row's maximum gets weight exp(-40) / sum instead of less; modcli.bundle.attention has the
measurements."""


def capacity_from_length(positions: Tensor, num: int, den: int):
    """k = max(1, T * num // den) from positions = arange(T), as ModelConfig.capacity_tokens computes it.

    Why a 0-d tensor and `.item()`: Python's `max` (or `torch.sym_max`) on the symbolic T makes torch.export
    guard on the value of k (k != 1, k <= T) and so restrict T; read from a tensor, k is an unbacked size whose
    only facts are the two checks below, and the graph keeps the arithmetic (Mul, Div, Clip) for any T.
    """
    seq_len = positions.shape[0]
    k_tensor = capacity_tokens_in_graph(positions[-1] + 1, num, den)  # integer arithmetic on a 0-d int64 tensor
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
        logits, aux = self.model(tokens, self.mode, return_aux=True, k=k)
        records = aux.records
        return (logits, *(selected_positions(record.selection) for record in records))


def attend_cache_and_self(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, key_self: Tensor,
                          value_self: Tensor, window: int = 0, slot_positions: Tensor | None = None,
                          positions: Tensor | None = None) -> Tensor:
    """One decode query per row against a read-only KV cache plus the token's own key/value, one softmax over both.

    q (B, H, 1, hd); keys/values (B, Hkv, S, hd), of which row b's first lengths[b] slots are real; key_self and
    value_self (B, Hkv, 1, hd), the K/V of the token being decoded. Equal to attention over the cache with the new
    token appended, without writing, concatenating or copying the cache: the scores against the cache (slots >=
    lengths[b] masked) and the score against the token's own key share one log-sum-exp, then
    out = probs_cache @ V_cache + p_self * v_self. The cache is read once (attention's own cost) and never copied:
    query heads are grouped onto their key/value head by a reshape of q, not by repeating the cache. Returns
    (B, H, 1, hd).

    A local layer (`window` > 0, --sliding-window) also masks the slots whose original position, slot_positions
    (B, S), is `window` or more before the query's, positions (B,) (the token's own key, at distance 0, stays).
    """
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, slots = keys.shape[1], keys.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    # Query head h reads key/value head h // group (Attention.share_kv's repeat_interleave), so (H, 1) -> (Hkv, G).
    q = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim).to(keys.dtype)  # (B, Hkv, G, hd)
    cache_scores = (q @ keys.transpose(-1, -2)).float() * scale  # (B, Hkv, G, S)
    visible = torch.arange(slots, device=q.device)[None, :] < lengths[:, None]  # (B, S)
    if window:  # keys at distance < window of the query's original position (the eager `window_mask`)
        visible = visible & (slot_positions > (positions[:, None] - window))  # (B, S)
    cache_scores = cache_scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    self_scores = (q.float() * key_self.float()).sum(dim=-1, keepdim=True) * scale  # (B, Hkv, G, 1)
    top = torch.maximum(cache_scores.amax(dim=-1, keepdim=True), self_scores)  # (B, Hkv, G, 1) finite: self is
    # exp of at least -MASK_MARGIN: onnxruntime's CPU Exp is slow below about -87 (modcli.bundle.attention), and a
    # runtime's cache buffers hold many unfilled slots; those are zeroed by the where, weight exactly 0.
    cache_probs = torch.where(visible[:, None, None, :], (cache_scores - top).clamp(min=-MASK_MARGIN).exp(),
                              0.0)  # (B, Hkv, G, S)
    self_probs = (self_scores - top).exp()  # (B, Hkv, G, 1)
    total = cache_probs.sum(dim=-1, keepdim=True) + self_probs  # (B, Hkv, G, 1)
    out = (cache_probs.to(values.dtype) @ values).float() + self_probs * value_self.float()  # (B, Hkv, G, hd)
    return (out / total).reshape(batch, n_heads, 1, head_dim)  # float32


def _decode_delta(block: Block, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor,
                  lengths: Tensor, part: str = "block", token_ids: Tensor | None = None,
                  kv_self: tuple[Tensor, Tensor] | None = None,
                  local: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """f(x) for one token per row x (B, 1, D) against the read-only cache, and the token's K/V (B, Hkv, 1, hd).

    `part` as in `Block.delta`: block (attention and MLP) or attention. `token_ids` (B, 1): the tokens' ids (a
    hash-routed MoE MLP reads them). `kv_self`: the token's K/V, already computed (--keep-skipped-kv: every row's,
    before the routed branch); only the query is computed here then. `local`: a local layer's (slot_positions
    (B, S), positions (B,)), for its window. Nothing is written: the caller stores the returned K/V at slot
    lengths[b] of the rows that keep them (`write_new_rows`, or the runtime).
    """
    batch = x.shape[0]
    attn = block.attn
    if kv_self is None:
        q, key_self, value_self = attn._heads(block.attn_norm(x), cos, sin)  # (B, H, 1, hd), (B, Hkv, 1, hd)
    else:
        q, (key_self, value_self) = attn.queries(block.attn_norm(x), cos, sin), kv_self  # (B, H, 1, hd)
    key_self, value_self = key_self.to(keys.dtype), value_self.to(values.dtype)
    slot_positions, positions = local if local is not None else (None, None)
    out = attend_cache_and_self(q, keys, values, lengths, key_self, value_self, attn.window, slot_positions,
                                positions).to(q.dtype)  # (B, H, 1, hd)
    attn_update = block.attn_output(attn.proj(out.transpose(1, 2).reshape(batch, 1, -1)))  # (B, 1, D)
    if not route_part(part).mlp:
        return attn_update, key_self, value_self
    return attn_update + block.mlp_update(x + attn_update, token_ids), key_self, value_self


def _process_rows(block: Block, part: str, cap: int, x: Tensor, cos: Tensor, sin: Tensor, keys: Tensor,
                  values: Tensor, lengths: Tensor, router_logits: Tensor, decisions: Tensor, token_ids: Tensor,
                  dynamic: bool = False, kv_self: tuple[Tensor, Tensor] | None = None,
                  local: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A routed block on at most `cap` of the B rows (every row that processes the token is among them: the caller
    checked decisions.sum() <= cap): gather those rows and their caches, run the block on (cap, 1, D), write back.
    Returns x (B, 1, D) with skipped rows bit for bit unchanged, and the step's K/V (B, Hkv, 1, hd) (zero for rows
    not computed; their processed flag is false, so nobody stores them). `dynamic`: the batch is an exported graph's
    (symbolic; the caller's branch runs only when it is larger than `cap`): the top-k runs over the B rows and `cap`
    filler slots, so no shape ties the batch to >= cap. `kv_self`: every row's K/V of this step, made before the
    branch (--keep-skipped-kv; `_decode_delta`). `local`: a local layer's (slot_positions, positions)."""
    batch = x.shape[0]
    if dynamic:  # cap filler slots after the B rows keep the top-k's size valid for any batch; never chosen here
        padded = torch.cat([(~decisions).to(x.dtype), x.new_full((cap,), 2.0)])  # (B + cap,)
        rows = padded.topk(cap, largest=False).indices  # (cap,) processing rows first, then skipping ones
    else:
        rows = (~decisions).to(torch.int32).topk(cap, largest=False).indices  # (cap,) processing rows, then filler
    row_kv = None if kv_self is None else (kv_self[0][rows], kv_self[1][rows])  # (cap, Hkv, 1, hd) each
    row_local = None if local is None else (local[0][rows], local[1][rows])  # (cap, S), (cap,)
    delta, new_keys, new_values = _decode_delta(block, x[rows], cos[rows], sin[rows], keys[rows], values[rows],
                                                lengths[rows], part, token_ids[rows],
                                                row_kv, row_local)  # (cap, 1, D), (cap, Hkv, 1, hd)
    weight = block.router.weight(router_logits[rows]).unsqueeze(-1)  # (cap, 1, 1)
    updated = residual_update(x[rows], delta, weight, keep=decisions[rows][:, None, None])  # filler rows: x as is
    x = x.index_put((rows,), updated)
    shape = (batch, *new_keys.shape[1:])
    new_keys = new_keys.new_zeros(shape).index_put((rows,), new_keys)
    new_values = new_values.new_zeros(shape).index_put((rows,), new_values)
    return x, new_keys, new_values


class DecodeStepGraph(nn.Module):
    """One decode step against a read-only KV cache.

    Inputs: tokens (B,), positions (B,), then per layer keys/values (B, Hkv, slots_L, hd) and lengths (B,) (a layer
    whose attention --drop removed has none: `kv_layers`), and for a local layer (--sliding-window: `local_layers`)
    slot_positions (B, slots_L) int64, the original position of the token held in each slot.
    Outputs (`output_names`): logits (B, V); per layer new_keys/new_values (B, Hkv, 1, hd), the K/V of this
    step's token; per routed layer processed (B,) bool. The caller stores the new K/V at slot lengths[b]: for every
    row in `every_row_layers` (dense layers, and routed layers whose K/V cover every token: --route-part mlp or
    --keep-skipped-kv), only for rows with processed[b] in `processed_row_layers` (`kv_is_routed`); `write_outputs` does
    it for torch buffers, the runtime's `CacheSpec.write_rows` for numpy ones; in a local layer the row's position
    goes to the same slot of slot_positions. A skipped routed block (`torch.cond`
    / ONNX `If`, taken when no row processes the token) reads no cache memory: it returns x unchanged and zero K/V,
    which nobody stores because processed is false.
    """

    def __init__(self, model: MoDDecoder, routing: str, branch_free: bool = False, row_cap: int | None = None,
                 export_row_cap: bool = False) -> None:
        """`branch_free`: run a routed block's work on every step (skipped rows still unchanged and not stored)
        instead of inside `torch.cond`; for CUDA graphs, which cannot hold the host-side branch inductor makes of a
        cond, at the price of the skip.

        `row_cap` (a static batch larger than it; not for export, whose batch is dynamic): when at most `row_cap`
        rows process the token, a routed block gathers those rows (and their caches) and computes only them, in
        static shapes; more rows than that take the all-rows branch. With B x capacity rows expected to process,
        a cap of about twice that makes most steps cost what the rows that process cost.

        `export_row_cap` (for export, whose batch is dynamic): the same with the cap of a batch of
        `EXPORT_ROW_CAP_BATCH` rows, taken in the graph only when its batch is larger than the cap (`modcli export`'s
        decode graph).
        """
        super().__init__()
        model.check_routing(routing, causal=True)
        self.model = model
        self.routing = routing
        self.branch_free = branch_free
        self.row_cap = row_cap
        config = model.config
        if export_row_cap and row_cap is None and not config.dense:
            self.row_cap = row_cap_for(EXPORT_ROW_CAP_BATCH, config.capacity)
        self.export_row_cap = export_row_cap
        self.processed_row_layers = tuple(layer for layer in range(config.n_layers) if config.kv_is_routed(layer))
        self.every_row_layers = tuple(layer for layer in range(config.n_layers)
                                      if layer not in self.processed_row_layers)
        self.routed_layers = tuple(config.routed_layers())
        self.kv_layers = tuple(config.kv_layers())  # --drop: a layer without attention has no cache inputs
        # --sliding-window: a local layer's cache also holds each slot's original position (slot_positions.L)
        self.local_layers = tuple(layer for layer in self.kv_layers if config.is_sliding(layer))
        self.cache_kinds = {layer: ("keys", "values", "lengths") + (("slot_positions",) if layer in self.local_layers
                                                                     else ()) for layer in self.kv_layers}
        """Per layer with a cache, its inputs in order (the flat cache of `forward` and `write_outputs`)."""

    def writes_every_row(self, layer: int) -> bool:
        """True when every row stores this step's K/V in `layer`; False when only rows with processed.L do."""
        return layer in self.every_row_layers

    def _branch(self, decisions: Tensor, process, skip, operands: tuple):
        """process(*operands) when any row processes the token, else skip(*operands): `torch.cond`, or always
        process when branch-free (process leaves skipped rows unchanged itself)."""
        if self.branch_free:
            return process(*operands)
        return torch.cond(decisions.any(), process, skip, operands)

    @property
    def input_names(self) -> list[str]:
        return ["tokens", "positions", *[f"{kind}.{layer}" for layer in self.kv_layers
                                         for kind in self.cache_kinds[layer]]]

    def split_cache(self, cache: tuple[Tensor, ...] | list[Tensor]) -> dict[int, tuple[Tensor, ...]]:
        """The flat cache [keys.L, values.L, lengths.L, (slot_positions.L), ...] per layer: (keys, values, lengths,
        slot_positions or None)."""
        layers, start = {}, 0
        for layer in self.kv_layers:
            count = len(self.cache_kinds[layer])
            part = tuple(cache[start:start + count])
            layers[layer] = part if count == 4 else (*part, None)
            start += count
        return layers

    @property
    def output_names(self) -> list[str]:
        return ["logits", *[f"new_{kind}.{layer}" for layer in self.kv_layers for kind in ("keys", "values")],
                *[f"processed.{layer}" for layer in self.routed_layers]]

    def write_outputs(self, outputs: tuple[Tensor, ...], cache: list[Tensor], positions: Tensor | None = None) -> None:
        """Store a step's outputs in the flat cache [keys.0, values.0, lengths.0, ...] in place (lengths too); a
        local layer's slot_positions get the step's `positions` (B,) at the same slots."""
        n_kv = len(self.kv_layers)
        processed = dict(zip(self.routed_layers, outputs[1 + 2 * n_kv:], strict=True))
        for slot, (layer, (keys, values, lengths, slot_positions)) in enumerate(self.split_cache(cache).items()):
            writes = None if self.writes_every_row(layer) else processed[layer]
            new_keys, new_values = outputs[1 + 2 * slot: 3 + 2 * slot]
            if slot_positions is not None:  # the same slot as write_new_rows' (clamped alike), before lengths move
                rows = torch.arange(lengths.shape[0], device=lengths.device)  # (B,)
                slot_positions[rows, lengths.clamp(max=slot_positions.shape[1] - 1)] = positions
            lengths.copy_(write_new_rows(keys, values, lengths, new_keys, new_values, writes))

    def forward(self, tokens: Tensor, positions: Tensor, *cache: Tensor) -> tuple[Tensor, ...]:
        model = self.model
        config = model.config
        x = model.embed(tokens)[:, None]  # (B, 1, D)
        token_ids = tokens[:, None]  # (B, 1): what a hash-routed MoE MLP reads
        global_rope = config_rope(config, positions[:, None])  # (B, 1, hd/2) each
        own_ropes: dict[float, tuple[Tensor, Tensor]] = {}  # --local-rope-base: made once per base and step
        new_rows: list[Tensor] = []
        processed: list[Tensor] = []
        zero_rows: Tensor | None = None  # a skipped routed block's K/V (made at the first routed block)
        caches = self.split_cache(cache)
        for layer, block in enumerate(model.blocks):
            if layer not in caches:  # --drop: no attention and no cache; the MLP if it is kept
                if block.mlp is not None:
                    x = x + block.mlp_update(x, token_ids).to(x.dtype)
                continue
            keys, values, lengths, slot_positions = caches[layer]
            cos, sin = global_rope
            if block.own_rope_base is not None:  # a local layer's own RoPE base
                if block.own_rope_base not in own_ropes:
                    own_ropes[block.own_rope_base] = block.own_rope(positions[:, None])  # (B, 1, hd/2) each
                cos, sin = own_ropes[block.own_rope_base]
            local = (slot_positions, positions) if slot_positions is not None else ()  # operands of the branches
            if not block.routed:
                delta, new_keys, new_values = _decode_delta(block, x, cos, sin, keys, values, lengths, block.kept,
                                                            token_ids=token_ids, local=local or None)
                x = x + delta.to(x.dtype)
                new_rows += [new_keys, new_values]
                continue
            router_logits = block.router.logits(x, positions[:, None])  # (B, 1)
            decisions = block.router.decide(x, router_logits, self.routing, positions[:, None],
                                            config.capacity)[:, 0]  # (B,) causal yes/no
            decisions = keep_first_decisions(decisions, positions, config.keep_first)  # (B,) --keep-first
            rule = route_part(block.part)
            part = rule.name
            if rule.before:  # every row attends and is cached; only the MLP is routed, and its If holds no cache
                attn_update, new_keys, new_values = _decode_delta(block, x, cos, sin, keys, values, lengths,
                                                                  rule.before, local=local or None)
                x = x + attn_update.to(x.dtype)

                def mlp_only(x, router_logits, decisions, token_ids, block=block):
                    weight = block.router.weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
                    return residual_update(x, block.mlp_update(x, token_ids), weight, keep=decisions[:, None, None])

                x_in = x
                x = self._branch(decisions, mlp_only, lambda x, router_logits, decisions, token_ids: x.clone(),
                                 (x, router_logits, decisions, token_ids))
                if block.skip is not None:  # --skip-update linear: the skipped rows' forecast
                    x = x + block.skip(x_in, decisions[:, None])
                new_rows += [new_keys, new_values]
                processed.append(decisions)
                continue

            # --keep-skipped-kv: every row's K/V are made and stored outside the branch; the branch computes the
            # processed rows' queries and the rest of the routed work (its K/V outputs are these, passed through).
            kv_self = ()  # operands of the branches, after zero_rows (then `local`'s)
            if config.keep_skipped_kv:
                kv_self = tuple(kv.to(keys.dtype) for kv in block.attn.keys_values(block.attn_norm(x), cos, sin))
            n_kv = len(kv_self)

            def process(x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids, zero_rows, *rest,
                        block=block, part=part, n_kv=n_kv):
                kv_self, local = rest[:n_kv], rest[n_kv:]
                delta, new_keys, new_values = _decode_delta(block, x, cos, sin, keys, values, lengths, part,
                                                            token_ids, kv_self or None, local or None)
                weight = block.router.weight(router_logits).unsqueeze(-1)  # (B, 1, 1)
                x = residual_update(x, delta, weight, keep=decisions[:, None, None])  # skipped rows: x bit for bit
                # Fresh (B, Hkv, 1, hd) tensors: both branches of a cond must return the same layout, and these are
                # views into the qkv projection.
                return (x, new_keys.clone(memory_format=torch.contiguous_format),
                        new_values.clone(memory_format=torch.contiguous_format))

            def skip(x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids, zero_rows, *rest):
                # No cache input is read here: the step's K/V are the zeros made once per step (a copy: a branch
                # returns no alias of its inputs), so a skipped block runs no operator that builds a shape.
                return x.clone(), zero_rows.clone(), zero_rows.clone()

            if self.row_cap is not None and not self.branch_free and (self.export_row_cap
                                                                      or self.row_cap < x.shape[0]):
                all_rows = process

                def process(x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids, zero_rows,
                            *rest, block=block, part=part, all_rows=all_rows, cap=self.row_cap,
                            dynamic=self.export_row_cap, n_kv=n_kv):
                    def capped(x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids, zero_rows,
                               *rest):
                        kv_self, local = rest[:n_kv], rest[n_kv:]
                        return _process_rows(block, part, cap, x, cos, sin, keys, values, lengths, router_logits,
                                             decisions, token_ids, dynamic, kv_self or None, local or None)

                    few = decisions.sum() <= cap
                    if dynamic:  # the batch is the graph's own: only a batch larger than the cap gathers
                        few = few & (torch.ones_like(decisions, dtype=torch.int64).sum() > cap)
                    return torch.cond(few, capped, all_rows,
                                      (x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids,
                                       zero_rows, *rest))

            if zero_rows is None:  # every layer's K/V rows have one shape and the cache's dtype
                zero_rows = torch.zeros((x.shape[0], config.kv_heads, 1, config.head_dim), dtype=keys.dtype,
                                        device=x.device)
            x_in = x
            x, new_keys, new_values = self._branch(
                decisions, process, skip,
                (x, cos, sin, keys, values, lengths, router_logits, decisions, token_ids, zero_rows, *kv_self,
                 *local))
            if block.skip is not None:  # --skip-update linear: the skipped rows' forecast
                x = x + block.skip(x_in, decisions[:, None])
            if kv_self:  # every row's K/V, stored for every row (`every_row_layers`); the branch's copies unused
                new_keys, new_values = kv_self
            if rule.after:  # only attention was routed; the MLP runs on every row
                x = x + block.mlp_update(x, token_ids)
            new_rows += [new_keys, new_values]
            processed.append(decisions)
        logits = model.head(model.norm(x))[:, 0]  # (B, V)
        return (logits, *new_rows, *processed)
