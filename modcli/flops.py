"""Analytic FLOP counts that follow what the model really computes.

A matmul of (m x n) by (n x p) costs 2 m n p FLOPs. A routed block runs attention and MLP on its k selected
tokens only (k x k attention scores); the router runs on every token. Attention is counted in full (k x k, as
`scaled_dot_product_attention` and `torch.utils.flop_counter` count it), not halved for causality. Element-wise
work (norms, RoPE, softmax, SiLU, residual adds, gather/scatter) and the embedding lookup are not counted:
they are a few percent at these sizes and FlopCounterMode does not count them either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from modcli.config import ModelConfig


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


def block_tokens(config: ModelConfig, layer: int, seq_len: int) -> int:
    """Tokens a block processes in a top-k forward pass of `seq_len` tokens."""
    return config.capacity_tokens(seq_len) if config.is_routed(layer) else seq_len


def flops(config: ModelConfig, seq_len: int, include_predictor: bool = False) -> FlopBreakdown:
    """Forward FLOPs per sequence of `seq_len` tokens with training-time (top-k) routing."""
    d, hidden = config.d_model, config.hidden
    out = FlopBreakdown()
    for layer in range(config.n_layers):
        n = block_tokens(config, layer, seq_len)
        out.attention_proj += 2 * n * d * 3 * d + 2 * n * d * d  # qkv and output projections
        out.attention_scores += 2 * 2 * n * n * d  # q k^T and (scores) v, over all heads
        out.mlp += 2 * n * d * 2 * hidden + 2 * n * hidden * d  # SwiGLU gate+up, down
        if config.is_routed(layer):
            out.router += 2 * seq_len * d
            if include_predictor and config.predictor_hidden:
                out.predictor += 2 * seq_len * d * config.predictor_hidden + 2 * seq_len * config.predictor_hidden
    out.head += 2 * seq_len * d * config.vocab_size
    return out


def training_flops(config: ModelConfig, seq_len: int) -> int:
    """FLOPs of one training sequence: forward + backward = 3 x forward (predictor included)."""
    return 3 * flops(config, seq_len, include_predictor=True).total


def counted_flops(run_forward) -> dict[str, int]:
    """FLOPs that `torch.utils.flop_counter.FlopCounterMode` counts while `run_forward()` runs, by operator.

    FlopCounterMode counts matmuls and attention only. Its registry lacks PyTorch's CPU flash-attention kernel,
    so that kernel is mapped here to the same formula the counter uses for the CUDA attention kernels.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        run_forward()
    return {str(op).split(".")[-1]: int(n) for op, n in counter.get_flop_counts()["Global"].items()}
