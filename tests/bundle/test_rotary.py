"""modcli.bundle.rotary: the exporter's eight RoPE operators rewritten into onnxruntime's RotaryEmbedding, checked
on hand-built graphs of the pattern against numpy, with a table per sequence and one shared by all, and left alone
where a value inside the pattern is read elsewhere."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from modcli.bundle.rotary import ROTARY, fuse_rotary

HEADS, HEAD_DIM = 3, 8


def rope_graph(table_batch: int | str, extra_reader: bool = False, mul_order_swapped: bool = False):
    """x (B, n, 3, 8) and cos/sin (table_batch, n, 1, 4) -> concat(x1 cos - x2 sin, x2 cos + x1 sin) as exported."""
    def mul(a, b, out):
        return helper.make_node("Mul", [b, a] if mul_order_swapped else [a, b], [out])

    nodes = [helper.make_node("Split", ["x"], ["x1", "x2"], axis=3, num_outputs=2),
             mul("x1", "cos", "a"), mul("x2", "sin", "b"), helper.make_node("Sub", ["a", "b"], ["first"]),
             mul("x2", "cos", "c"), mul("x1", "sin", "d"), helper.make_node("Add", ["c", "d"], ["second"]),
             helper.make_node("Concat", ["first", "second"], ["rotated"], axis=-1),
             helper.make_node("Identity", ["rotated"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:  # a pattern value the rest of the graph also reads
        nodes.append(helper.make_node("Identity", ["a"], ["a_out"]))
        outputs.append(helper.make_tensor_value_info("a_out", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", HEADS, HEAD_DIM]),
              *[helper.make_tensor_value_info(name, TensorProto.FLOAT, [table_batch, "n", 1, HEAD_DIM // 2])
                for name in ("cos", "sin")]]
    graph = helper.make_graph(nodes, "rope", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feeds)[0]


def reference(x, cos, sin):
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@pytest.mark.parametrize("shared", [True, False], ids=["table-shared", "table-per-sequence"])
@pytest.mark.parametrize("swapped", [False, True], ids=["x-first", "table-first"])
def test_the_rope_pattern_becomes_one_rotary_embedding_with_the_same_output(shared, swapped):
    rng = np.random.default_rng(0)
    batch, n = 2, 5
    x = rng.standard_normal((batch, n, HEADS, HEAD_DIM)).astype(np.float32)
    angles = rng.uniform(0, 6, (1 if shared else batch, n, 1, HEAD_DIM // 2))  # any per-token angle: gathered tables
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    model = rope_graph(1 if shared else "batch", mul_order_swapped=swapped)
    feeds = {"x": x, "cos": cos, "sin": sin}
    before = run(model, feeds)
    assert fuse_rotary(model) == 1
    ops = [node.op_type for node in model.graph.node]
    assert ops.count(ROTARY) == 1 and not {"Split", "Mul", "Sub", "Add"} & set(ops)
    assert ("Expand" in ops) is not shared  # a shared table is the cache itself, no per-row copy
    assert any(opset.domain == "com.microsoft" for opset in model.opset_import)
    after = run(model, feeds)
    np.testing.assert_allclose(before, reference(x, cos, sin), atol=1e-6, rtol=0)
    np.testing.assert_allclose(after, before, atol=1e-6, rtol=0)


def test_a_pattern_whose_values_are_read_elsewhere_is_left_as_it_is():
    model = rope_graph("batch", extra_reader=True)
    expected = onnx.ModelProto.FromString(model.SerializeToString())
    assert fuse_rotary(model) == 0
    assert model == expected


def test_a_pattern_that_is_not_rope_is_left_as_it_is():
    model = rope_graph("batch")
    model.graph.node[3].op_type = "Add"  # x1 cos + x2 sin: not a rotation
    expected = onnx.ModelProto.FromString(model.SerializeToString())
    assert fuse_rotary(model) == 0
    assert model == expected
