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

Long sequences take a blocked path: above `LONG_BLOCK` query rows (and only for self-attention, L = S) an If
chooses `LONG_BLOCKS` blocks of queries, the last `LONG_BLOCK` rows, the `LONG_BLOCK` before them, ..., the first
block taking whatever is left, and each block attends only to the keys up to its last row. That skips most of the
masked upper triangle (a causal score matrix is half future) and keeps each block's scores small enough for the
caches; the materialised score matrix grows with T^2 and onnxruntime's passes over it slowed faster than T^2
(13.1 ms per layer at T 1024 against 2.5 ms at T 512). Measured, one layer of 8 heads x 32, 2 threads, ONNX
Runtime 1.31 CPU: T 512 2.53 -> 2.18 ms, T 1024 13.1 -> 7.1 ms, T 2048 65.9 -> 26.6 ms; the small preset's dense
forward graph 189 -> 138 ms at T 1024 and the same at T 256 (26.8 / 26.9 ms at batch 1, 197 / 196 ms at batch 8:
the If costs about 0.02 ms per layer). Building the If reads the exporter's tracer (torch.onnx's internals); where
that is not there, the graph has the single-block path only.

A local (--sliding-window, Gemma 3) layer's attention in the forward graph comes with an explicit boolean mask
(`Attention.local_mask`: causal by slot, within the window by original position), as does --keep-skipped-kv's
(queries against every token's keys), and takes the exporter's own translation
(`_aten_scaled_dot_product_attention_bool_mask_onnx`): Where(mask, 0, float32 min) added to the scores, Softmax, and
a Where(IsNaN) for fully masked rows (none here: a token always sees itself). That is exact (float32 min added to a
finite score underflows its weight to 0) but not fast: the masked scores, most of a T x T matrix when T is many
windows long, take onnxruntime's slow Softmax/Exp path described above (8-9x the Softmax time of an unmasked row),
the keys are transposed by a copy, and there is no blocked long-sequence path, so a local layer's forward costs
the full T x T scores however small the window. The decode graph does not use this translation: its attention is
`attend_cache_and_self`, whose window mask is a Where to weight exactly 0 after a clamped Exp.
"""

from __future__ import annotations

import itertools
import math

import torch

from modcli.decode.graphs import MASK_MARGIN

LONG_BLOCK = 256
"""Query rows per block of the long-sequence path; sequences of at most this many rows take the single block."""
LONG_BLOCKS = 8
"""Blocks of the long-sequence path (the first takes every row before the last LONG_BLOCKS - 1 blocks)."""

_branch_names = itertools.count()


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
    length = op.Shape(query, start=-2, end=-1)  # [L]
    source = op.Shape(key, start=-2, end=-1)  # [S]
    zero = op.Constant(value_ints=[0])

    def attend(rows_query, rows_key, rows_value, first_row, rows, keys):
        """Softmax attention of queries first_row.. (B, H, rows, hd) over keys 0..keys-1, the future masked. The
        scale, the key's transpose and the MatMul stay together in each branch: onnxruntime fuses them into one
        FusedMatMul (a Transpose outside the If would be a copy of the keys per layer: +3.6% at batch 8, T 256)."""
        scores = op.MatMul(op.Mul(rows_query, op.CastLike(op.Constant(value_float=factor), query)),
                           op.Transpose(rows_key, perm=[0, 1, 3, 2]))  # (B, H, rows, keys)
        minus_inf = op.Expand(op.CastLike(op.Constant(value_float=-math.inf), query), op.Concat(rows, keys, axis=0))
        # (rows, keys): -inf where the key comes after the query (key > first_row + row), else 0
        future = op.Trilu(minus_inf, op.Squeeze(op.Add(first_row, op.Constant(value_ints=[1]))), upper=1)
        masked = op.Add(scores, future)  # (B, H, rows, keys)
        floor = op.Sub(op.ReduceMax(masked, op.Constant(value_ints=[-1]), keepdims=1),
                       op.CastLike(op.Constant(value_float=MASK_MARGIN), query))  # (B, H, rows, 1)
        return op.MatMul(op.Softmax(op.Max(masked, floor), axis=-1), rows_value)  # (B, H, rows, hd)

    def single_block():
        return attend(query, key, value, zero, length, source)

    def blocks():
        bounds = [zero, *[op.Max(zero, op.Sub(length, op.Constant(value_ints=[(LONG_BLOCKS - i) * LONG_BLOCK])))
                          for i in range(1, LONG_BLOCKS)], length]  # row bounds, ascending; early blocks may be empty
        axis = op.Constant(value_ints=[2])
        outputs = []
        for first, end in zip(bounds, bounds[1:], strict=False):
            last = end is length  # the last block sees every key: no slice to copy
            rows_key = key if last else op.Slice(key, zero, end, axis)  # (B, H, end, hd)
            rows_value = value if last else op.Slice(value, zero, end, axis)  # (B, H, end, hd)
            outputs.append(attend(op.Slice(query, first, end, axis), rows_key, rows_value, first,
                                  op.Sub(end, first), end))
        return op.Concat(*outputs, axis=2)  # (B, H, L, hd)

    tracer = _exporter_tracer()
    if tracer is None:
        return single_block()
    from onnxscript import ir
    from torch.onnx._internal.exporter._torchlib.ops.hop import call_op

    long = op.And(op.Greater(op.Squeeze(length), op.Constant(value_int=LONG_BLOCK)),
                  op.Equal(op.Squeeze(length), op.Squeeze(source)))
    return call_op("If", long, then_branch=_branch(tracer, ir, blocks, "blocks"),
                   else_branch=_branch(tracer, ir, single_block, "single_block"))[0]


def _exporter_tracer():
    """torch.onnx's recorder of the nodes being translated (an internal of torch 2.13's exporter), or None."""
    try:
        from torch.onnx._internal.exporter import _core
        from torch.onnx._internal.exporter._torchlib.ops import hop  # noqa: F401 (call_op builds the If)
    except ImportError:
        return None
    tracer = getattr(_core, "current_tracer", None)
    return tracer if isinstance(getattr(tracer, "nodes", None), list) else None


def _branch(tracer, ir, build, tag: str):
    """The nodes `build()` records, as an If branch (a subgraph reading the enclosing graph's values). Every node
    and value gets a name of its own: the exporter names a subgraph's values apart from the main graph's, and
    clashing names make onnxruntime reject the model."""
    outer, tracer.nodes = tracer.nodes, []
    try:
        output = build()
        nodes = tracer.nodes
    finally:
        tracer.nodes = outer
    prefix = f"causal_attention_{tag}_{next(_branch_names)}"
    for index, node in enumerate(nodes):
        node.name = f"{prefix}_node{index}"
        for out_index, value in enumerate(node.outputs):
            value.name = f"{prefix}_{index}_{out_index}"
    return ir.Graph((), [output], nodes=nodes, name=prefix)


def translation_table() -> dict:
    """The exporter's custom translations (torch.onnx.export(custom_translation_table=...))."""
    return {torch.ops.aten.scaled_dot_product_attention.default: causal_attention}
