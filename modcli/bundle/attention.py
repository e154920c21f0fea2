"""How the exported graphs spell causal attention: a translation of `aten.scaled_dot_product_attention` for the ONNX
exporter that onnxruntime's CPU kernels run fast.

The exporter's own translation masks the future with the lowest float (or -inf) and calls Softmax. onnxruntime's
CPU Softmax and Exp take a slow path for every input below about -87 relative to the row's maximum (measured in
onnxruntime 1.31, 8 x 256 x 256 scores: 0.09 ms when every input is within 87 of the maximum, 2.8 ms when most
are further below), so the masked half of a causal score matrix made Softmax 8-9 times slower than unmasked
(0.82 against 0.09 ms per layer at T 256; 11.8 against 1.6 ms at T 1024) and most of the exported model's time.

`causal_attention` computes the same attention with every Softmax input within `MASK_MARGIN` of its row's
maximum: the future is masked with -inf (an Add of a (T, S) mask), the row maximum over the visible scores is
taken, and the masked scores are raised to `maximum - MASK_MARGIN` (40) before Softmax. A masked key then gets
weight exp(-40) / sum <= 4.2e-18 of its row, far below float32's resolution (1.2e-7) of the sum it is added to, so
the result equals the -inf-masked softmax to float32 rounding (tests/bundle/test_attention.py). The margin is not
larger because weights near exp(-87) ~ 1e-38 turn the products of the next MatMul denormal, which onnxruntime's
CPU matmul runs several times slower (margin 80: the dense forward's MatMuls took 219 ms against 61 ms at
T 1024). Every row has a visible key (the diagonal), so the maximum is finite.

onnxruntime's fused attention operators do not help on the CPU: the contrib `MultiHeadAttention` runs its flash
kernel only without `unidirectional` (causal), and its causal path, `GroupQueryAttention` and the opset-23
`Attention` op materialise and mask the scores like the decomposed graph (measured: 1.28-1.45 ms against 1.30 ms
per layer at T 256, 18.3-19.3 against 18.9 ms at T 1024; docs/export-and-runtime.md).
"""

from __future__ import annotations

import math

import torch

from modcli.decode.graphs import MASK_MARGIN


def causal_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: float | None = None, enable_gqa: bool = False):
    """Translation of aten.scaled_dot_product_attention (onnxscript, trace-only): causal self-attention of query
    (B, H, L, hd) over key/value (B, H, S, hd) without a slow Softmax; any other call (an explicit mask, dropout,
    grouped heads, not causal) takes the exporter's own translation."""
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention

    head_dim = query.shape[-1]
    if not is_causal or attn_mask is not None or dropout_p != 0.0 or enable_gqa or not isinstance(head_dim, int):
        return aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa)
    factor = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    scores = op.MatMul(op.Mul(query, op.CastLike(op.Constant(value_float=factor), query)),
                       op.Transpose(key, perm=[0, 1, 3, 2]))  # (B, H, L, S)
    length = op.Shape(query, start=-2, end=-1)  # [L]
    source = op.Shape(key, start=-2, end=-1)  # [S]
    minus_inf = op.Expand(op.CastLike(op.Constant(value_float=-math.inf), query), op.Concat(length, source, axis=0))
    one = op.Constant(value_int=1)
    future = op.Trilu(minus_inf, one, upper=1)  # (L, S): -inf above the diagonal (a key after the query), else 0
    masked = op.Add(scores, future)  # (B, H, L, S), -inf where a key is in the query's future
    floor = op.Sub(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1),
                   op.CastLike(op.Constant(value_float=MASK_MARGIN), query))  # (B, H, L, 1)
    weights = op.Softmax(op.Max(masked, floor), axis=-1)  # (B, H, L, S)
    return op.MatMul(weights, value)  # (B, H, L, hd)


def translation_table() -> dict:
    """The exporter's custom translations (torch.onnx.export(custom_translation_table=...))."""
    return {torch.ops.aten.scaled_dot_product_attention.default: causal_attention}
