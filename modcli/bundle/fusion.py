"""onnxruntime's fused operators in an exported graph: its transformer optimizer, run on the file after export.

What it fuses in modcli's graphs is each RMSNorm (Pow, ReduceMean, Add, Sqrt, Div, Mul) into one
`SimplifiedLayerNormalization`, an operator that onnxruntime registers and the ONNX standard (before opset 23)
does not have; so a fused graph runs only in onnxruntime, and `modcli export --opset-only` skips this step for
other runtimes (the manifest's `operators` says which a bundle has). The attention fusions are switched off: the
optimizer's patterns do not match the exporter's attention, and onnxruntime's fused attention operators have no
faster causal CPU kernel (modcli.bundle.attention). Shape inference is skipped (it fails on these graphs), and
with it the residual-add fusion (SkipSimplifiedLayerNormalization), which needs it.
"""

from __future__ import annotations

from pathlib import Path

FUSED = "onnxruntime"
"""manifest `operators` of a fused graph: standard ONNX plus operators only onnxruntime has."""
PLAIN = "onnx"
"""manifest `operators` of an --opset-only graph: standard ONNX operators only."""


def fuse_graph(path: Path, n_heads: int, d_model: int) -> dict[str, int]:
    """Rewrite the ONNX file at `path` with onnxruntime's fusions in place; returns {fused operator: count}."""
    import onnx
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    # A graph whose weights the exporter wrote apart (over protobuf's 2 GB) is written back the same way.
    external = any(tensor.data_location == onnx.TensorProto.EXTERNAL
                   for tensor in onnx.load(str(path), load_external_data=False).graph.initializer)

    options = FusionOptions("gpt2")
    options.enable_attention = False
    options.enable_rotary_embeddings = False
    options.enable_embed_layer_norm = False
    options.enable_gelu = options.enable_bias_gelu = options.enable_qordered_matmul = False
    options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = False  # these need shape inference
    options.enable_shape_inference = False
    model = optimizer.optimize_model(str(path), model_type="gpt2", num_heads=n_heads, hidden_size=d_model,
                                     opt_level=0, optimization_options=options, use_gpu=False)
    if external:
        model.save_model_to_file(str(path), use_external_data_format=True, all_tensors_to_one_file=True)
    else:
        model.save_model_to_file(str(path))
    return {name: count for name, count in model.get_fused_operator_statistics().items() if count}
