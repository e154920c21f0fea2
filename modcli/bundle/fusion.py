"""onnxruntime's fused operators in an exported graph: its transformer optimizer, run on the file after export.

What it fuses in modcli's graphs is each RMSNorm (Pow, ReduceMean, Add, Sqrt, Div, Mul) into one
`SimplifiedLayerNormalization`, an operator that onnxruntime registers and the ONNX standard (before opset 23)
does not have; so a fused graph runs only in onnxruntime, and `modcli export --opset-only` skips this step for
other runtimes (the manifest's `operators` says which a bundle has). The attention fusions are switched off: the
optimizer's patterns do not match the exporter's attention, and onnxruntime's fused attention operators have no
faster causal CPU kernel (modcli.bundle.attention). Shape inference is skipped (it fails on these graphs), and
with it the residual-add fusion (SkipSimplifiedLayerNormalization), which needs it. An If inside another If (the
decode graph's row-capped branch) is held apart while the optimizer runs, which mishandles it, and put back as
exported; where the optimizer still removed a value such a branch reads, the graph is left as exported (unfused).
Then each RoPE is rewritten into onnxruntime's contrib `RotaryEmbedding` (`modcli.bundle.rotary`), which the
optimizer's own rotary fusion does not match in these graphs.
"""

from __future__ import annotations

from pathlib import Path

from modcli.bundle.onnx_walk import names_read
from modcli.bundle.rotary import ROTARY, fuse_rotary

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
    original = onnx.load(str(path))
    # The optimizer rewrites an If nested in another If wrongly (it drops and rewires values those read), so those
    # are held apart while it runs and put back as exported (their RMSNorms stay unfused).
    nested = _detach_nested(original.graph)
    initializers = [onnx.TensorProto.FromString(tensor.SerializeToString()) for tensor in original.graph.initializer]
    inputs = [onnx.ValueInfoProto.FromString(value.SerializeToString()) for value in original.graph.input]
    model = optimizer.optimize_model(original, model_type="gpt2", num_heads=n_heads, hidden_size=d_model,
                                     opt_level=0, optimization_options=options, use_gpu=False)
    _attach_nested(model.model.graph, nested)
    _restore_initializers(initializers, model.model.graph)
    if len(model.model.graph.input) != len(inputs):  # inputs only a held subgraph reads were dropped as unused
        del model.model.graph.input[:]
        model.model.graph.input.extend(inputs)
    if _missing_reads(model.model.graph, set()):  # the optimizer removed a value a held branch reads: keep the export
        return {}
    rotary = fuse_rotary(model.model)
    if external:
        model.save_model_to_file(str(path), use_external_data_format=True, all_tensors_to_one_file=True)
    else:
        model.save_model_to_file(str(path))
    fused = {name: count for name, count in model.get_fused_operator_statistics().items() if count}
    return {**fused, ROTARY: rotary} if rotary else fused


def _subgraph_attributes(node):
    return [attribute for attribute in node.attribute if attribute.HasField("g")]


def _detach_nested(graph, depth: int = 0) -> dict[tuple[str, str], object]:
    """Take the subgraphs of every node that is itself inside a subgraph out of `graph` (each replaced by an empty
    graph); returns {(node name, attribute name): subgraph} for `_attach_nested`."""
    import onnx

    held: dict[tuple[str, str], object] = {}
    for node in graph.node:
        for attribute in _subgraph_attributes(node):
            if depth >= 1:
                held[node.name, attribute.name] = onnx.GraphProto.FromString(attribute.g.SerializeToString())
                attribute.g.CopyFrom(onnx.GraphProto(name=attribute.g.name))
            else:
                held |= _detach_nested(attribute.g, depth + 1)
    return held


def _attach_nested(graph, held: dict[tuple[str, str], object]) -> None:
    """Put the subgraphs `_detach_nested` took back into the nodes of the same names."""
    for node in graph.node:
        for attribute in _subgraph_attributes(node):
            if (node.name, attribute.name) in held:
                attribute.g.CopyFrom(held.pop((node.name, attribute.name)))
            else:
                _attach_nested(attribute.g, held)


def _restore_initializers(initializers, fused) -> None:
    """Put back the exported graph's `initializers` that the optimizer dropped although a held subgraph reads them
    (the exporter lifts the constants of an If nested in another If, the decode graph's row-capped branch, into
    the main graph's initializers)."""
    kept = {tensor.name for tensor in fused.initializer}
    read = names_read(fused)
    fused.initializer.extend(tensor for tensor in initializers if tensor.name in read and tensor.name not in kept)


def _missing_reads(graph, outer: set[str]) -> set[str]:
    """Names read in `graph` (or its subgraphs) that nothing there or in the enclosing scopes `outer` provides."""
    available = (outer | {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer}
                 | {name for node in graph.node for name in node.output} | {""})
    missing = set()
    for node in graph.node:
        missing.update(name for name in node.input if name not in available)
        for attribute in _subgraph_attributes(node):
            missing |= _missing_reads(attribute.g, available)
    return missing
