"""Analytic FLOP counts that follow what the model really computes.

A matmul of (m x n) by (n x p) costs 2 m n p FLOPs. A routed block runs attention and MLP on its k selected
tokens only (k x k attention scores; with --keep-skipped-kv every token's K/V projection and k x T scores); the
router runs on every token. Attention is counted in full (k x k, as
`scaled_dot_product_attention` and `torch.utils.flop_counter` count it), not halved for causality nor cut by a
--sliding-window (a masked kernel computes every score). Element-wise work (norms, --qk-norm's and
--sandwich-norm's too, RoPE, softmax, SiLU or GELU, residual adds, gather/scatter) and the embedding lookup and its
--scale-embeddings are not counted: they are a few percent at these sizes and FlopCounterMode does not count them either.

A routed block is counted at its capacity: k = max(1, floor(capacity x T)) tokens. That is exactly what the
full-sequence modes of `topk` and `random` process; a `threshold` router's share is learnt (the capacity is what
its regulariser aims at), so for it the count is the target, and `modcli profile` measures the real one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from modcli.config import ModelConfig
from modcli.models.moe import expert_capacity
from modcli.models.routing.registry import router_class


@dataclass
class FlopBreakdown:
    """Forward FLOPs of one sequence, by part."""

    attention_proj: int = 0
    attention_scores: int = 0
    mlp: int = 0
    router: int = 0
    predictor: int = 0
    head: int = 0

    @property
    def total(self) -> int:
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def block_tokens(config: ModelConfig, layer: int, seq_len: int) -> tuple[int, int]:
    """(attention, MLP) tokens a block processes in a forward pass of `seq_len` tokens at the configured capacity
    (the family's rule, modcli.models.families); a sublayer removed by --drop processes none."""
    attention, mlp = config.family.block_tokens(config, layer, seq_len)
    return (0 if config.attention_dropped(layer) else attention, 0 if config.mlp_dropped(layer) else mlp)


def mlp_flops(config: ModelConfig, layer: int, tokens: int, training: bool = False, batch: int = 1) -> tuple[int, int]:
    """(MLP, MoE gate) FLOPs of `batch` sequences of `tokens` tokens each through a block's MLP.

    A dense MLP: every token. An MoE MLP (modcli.models.moe): the gate scores every token over E + N experts; in training
    each real expert does its static capacity of C slots over the batch (whoever fills them), otherwise each token
    does top-k experts, of which E / (E + N) are real at the balanced share the load-balancing loss aims at (the
    real share is learnt: `modcli profile` counts what the experts really did). Hash routing has no gate (a table
    lookup)."""
    per_token = 2 * config.d_model * 2 * config.hidden + 2 * config.hidden * config.d_model  # SwiGLU gate+up, down
    tokens *= batch
    if not config.experts:
        return tokens * per_token, 0

    pool = config.experts + config.noop_experts_of(layer)
    gate = 0 if config.expert_routing == "hash" else 2 * tokens * config.d_model * pool
    if training:
        slots = config.experts * expert_capacity(tokens, config.expert_top_k, pool, config.expert_capacity_factor)
    else:
        slots = round(tokens * config.expert_top_k * config.experts / batch / pool) * batch
    return slots * per_token, gate


def skip_flops(config: ModelConfig, layer: int, tokens: int) -> int:
    """--skip-update linear: the skip forecast U(D(x)) of a routed block, computed for all `tokens` (the processed
    ones' is masked out); counted with the router's FLOPs."""
    if config.skip_update != "linear" or not config.is_routed(layer):
        return 0
    return tokens * 2 * 2 * config.d_model * config.skip_rank


def flops(config: ModelConfig, seq_len: int, include_predictor: bool = False, training: bool = False,
          batch: int = 1) -> FlopBreakdown:
    """Forward FLOPs of `batch` sequences of `seq_len` tokens (per sequence by default), routed blocks at their
    capacity; `training`: the forward of a training step (MoE experts at their static capacity over the batch, see
    `mlp_flops`; the only count that is not `batch` x one sequence's)."""
    d = config.d_model
    q_width, kv_width = config.n_heads * config.head_dim, config.kv_heads * config.head_dim  # GQA: fewer k, v heads
    out = FlopBreakdown()
    for layer in range(config.n_layers):
        n, n_mlp = block_tokens(config, layer, seq_len)
        # a family with layer dropout skips the block for a sequence with probability p (the expected count)
        kept = 1.0 - config.family.layer_dropout(config, layer) if training else 1.0
        keys = n  # tokens with K/V: --keep-skipped-kv gives every token of a routed attention its K/V
        if config.keep_skipped_kv and config.attention_is_routed(layer) and not config.attention_dropped(layer):
            keys = seq_len
        out.attention_proj += batch * round(kept * (2 * n * d * q_width + 2 * keys * d * 2 * kv_width
                                                    + 2 * n * q_width * d))
        out.attention_scores += batch * round(kept * 2 * 2 * n * keys * q_width)  # q k^T, (scores) v: n x keys
        mlp, gate = mlp_flops(config, layer, n_mlp, training, batch)
        out.mlp += round(kept * mlp)
        out.router += gate
        if config.has_router_at(layer):
            router, predictor = router_class(config.router).flops(config, seq_len, include_predictor)
            out.router += batch * (router + skip_flops(config, layer, seq_len))
            out.predictor += batch * predictor
    out.head += batch * 2 * seq_len * d * config.vocab_size
    if training:  # exits through the shared norm and head (early exit's exit losses)
        out.head += batch * config.family.extra_head_passes(config) * 2 * seq_len * d * config.vocab_size
    return out


def training_flops(config: ModelConfig, seq_len: int, batch: int = 1) -> int:
    """FLOPs of a training micro-batch of `batch` sequences (one by default): forward + backward, as
    torch.utils.flop_counter counts them. Only an MoE's static capacity (counted over the whole batch) makes it
    other than `batch` x one sequence's.

    A matmul's backward costs twice its forward (gradients of both operands), so about 3 x forward (predictor
    included), with two corrections: attention's backward costs 2.5 x its forward (the fused kernels recompute the
    q k^T scores), and the predictor reads a stop-gradient copy of the block input, so its first layer computes no
    gradient for its input.
    """
    forward = flops(config, seq_len, include_predictor=True, training=True, batch=batch)
    predictor_input_grad = batch * 2 * seq_len * config.d_model * config.predictor_hidden * config.router_count()
    # A dense block feeding an A-MoD router computes its attention explicitly (two plain matmuls): no recompute.
    explicit = 0
    if not config.dense and router_class(config.router).reads_previous_attention:
        explicit = batch * sum(2 * 2 * seq_len * seq_len * config.n_heads * config.head_dim
                               for layer in range(config.n_layers - 1)
                               if not config.is_routed(layer) and config.is_routed(layer + 1))
    attention_recompute = (forward.attention_scores - explicit) // 2
    return 3 * forward.total + attention_recompute - (predictor_input_grad if forward.predictor else 0)


def decode_step_flops(config: ModelConfig, batch: int, layer_work: dict[int, tuple[int, int]],
                      routing: str = "router") -> FlopBreakdown:
    """FLOPs of one decode step (one new token for each of `batch` sequences), as `MoDDecoder.decode_step` runs it.

    `layer_work[layer] = (rows, slots)`: how many rows the layer processed the token for, and how many cache slots
    their attention reads (the cache's longest row including the new token: rows attend over one padded span); with
    --route-part attention or mlp, `(attention_rows, slots, mlp_rows)`. A routed layer's router runs for every row
    (its logit is the decision or the weight), its predictor only with `routing="predictor"`. With
    --keep-skipped-kv every row of a routed attention projects its K/V; only the processed rows their queries.
    """
    d = config.d_model
    q_width, kv_width = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    out = FlopBreakdown()
    for layer in range(config.n_layers):
        rows, slots, *mlp_rows = layer_work[layer]
        mlp_rows = [0] if config.mlp_dropped(layer) else mlp_rows or [rows]  # --drop: no MLP
        if config.attention_dropped(layer):  # --drop: no attention
            rows = slots = 0
        kv_rows = rows
        if config.keep_skipped_kv and config.attention_is_routed(layer) and not config.attention_dropped(layer):
            kv_rows = batch
        out.attention_proj += rows * (2 * d * q_width + 2 * q_width * d) + kv_rows * 2 * d * 2 * kv_width
        out.attention_scores += rows * 2 * 2 * slots * q_width
        mlp, gate = mlp_flops(config, layer, mlp_rows[0])
        out.mlp += mlp
        out.router += gate
        if config.has_router_at(layer):
            router, predictor = router_class(config.router).flops(config, batch, routing == "predictor")
            out.router += router + skip_flops(config, layer, batch)
            out.predictor += predictor
    out.head += batch * 2 * d * config.vocab_size
    return out


def counted_flops(run_forward) -> dict[str, int]:
    """FLOPs that `torch.utils.flop_counter.FlopCounterMode` counts while `run_forward()` runs, by operator.

    FlopCounterMode counts matmuls and attention only. Its registry lacks PyTorch's CPU flash-attention kernels
    (forward and backward), so they are mapped here to the formulas the counter uses for the CUDA attention kernels.
    Every FLOP count in modcli goes through this function.
    """

    def cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                                **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flops,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_sdpa_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        run_forward()
    return {str(op).split(".")[-1]: int(n) for op, n in counter.get_flop_counts()["Global"].items()}
