"""RoPE in an exported graph as onnxruntime's fused `RotaryEmbedding` operator (com.microsoft), for fused bundles.

The exporter spells `modcli.models.decoder.apply_rope` as eight operators per attention: a Split of the rotated
heads into halves x1, x2, four Muls with the cos/sin tables, a Sub, an Add and a Concat
(`concat(x1 cos - x2 sin, x2 cos + x1 sin)`). onnxruntime runs them as eight passes over the heads: 280 us for the
queries' and keys' 16 heads of 32 at T 256, batch 1 (2 threads), against 32 us for its `RotaryEmbedding` kernel
on the same input (outputs equal to 2.4e-7). `fuse_rotary` finds that pattern in a graph and every subgraph and
replaces it with one `RotaryEmbedding` whose caches are the tables the graph already gathered:

- x (B, n, N, hd) is viewed as (B, n, N * hd), the operator's 3D layout (num_heads inferred from the caches);
- the cos/sin tables (B or 1, n, 1, hd/2), per token at its original position (a routed block's are gathered at
  its selected tokens), are broadcast to (B, n, 1, hd/2) and flattened to a (B * n, hd/2) cache;
- position_ids (B, n) are 0 .. B*n - 1 in order, so token (b, j) reads its own row of that cache; a table shared
  by every sequence (batch dim 1 in the graph's shape information, the forward graph's dense blocks) is used as the
  cache directly with a position offset of 0 instead.

The plain-opset graphs (`modcli export --opset-only`) keep the standard operators.
"""

from __future__ import annotations

from modcli.bundle.onnx_walk import names_read, subgraphs

ROTARY = "RotaryEmbedding"
CONTRIB_DOMAIN = "com.microsoft"


def fuse_rotary(model) -> int:
    """Rewrite every RoPE pattern in `model` (an onnx ModelProto) and its subgraphs in place; returns how many."""
    shapes = {value.name: value.type.tensor_type.shape for value in _value_infos(model.graph)}
    fused = _fuse_graph(model.graph, shapes, [0])
    if fused and not any(opset.domain == CONTRIB_DOMAIN for opset in model.opset_import):
        opset = model.opset_import.add()
        opset.domain, opset.version = CONTRIB_DOMAIN, 1
    return fused


def _value_infos(graph):
    yield from graph.value_info
    yield from graph.input
    yield from graph.output
    for node in graph.node:
        for subgraph in subgraphs(node):
            yield from _value_infos(subgraph)


def _fuse_graph(graph, shapes, counter: list[int]) -> int:
    """Fuse the patterns of `graph` and its subgraphs; `counter` numbers the new nodes' names across the model."""
    fused = 0
    for node in graph.node:
        for subgraph in subgraphs(node):
            fused += _fuse_graph(subgraph, shapes, counter)
    producer = {name: node for node in graph.node for name in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for concat in [node for node in graph.node if node.op_type == "Concat"]:
        match = _match(concat, producer)
        if match is None:
            continue
        split, pattern, x, cos, sin = match
        internal = {name for node in pattern for name in node.output if node is not concat}
        # every intermediate is read only inside the pattern (by the graph and by no subgraph)
        inside = sum(1 for node in pattern for name in node.input if name in internal)
        if sum(readers.get(name, 0) for name in internal) != inside or any(
                _read_by_subgraph(graph, name) for name in internal):
            continue
        counter[0] += 1
        nodes = _rotary_nodes(f"rotary_{counter[0]}", x, cos, sin, concat.output[0], _shared_table(cos, shapes))
        for node in pattern[:-1]:  # all but the Concat, which marks where the new nodes go
            graph.node.remove(node)
        position = list(graph.node).index(concat)  # after x's and the tables' producers, before any reader
        graph.node.remove(concat)
        for offset, node in enumerate(nodes):
            graph.node.insert(position + offset, node)
        producer = {name: node for node in graph.node for name in node.output}
        fused += 1
    return fused


def _read_by_subgraph(graph, name: str) -> bool:
    return any(name in names_read(subgraph) for node in graph.node for subgraph in subgraphs(node))


def _attribute(node, name: str, default=None):
    import onnx

    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _match(concat, producer):
    """(split, the pattern's nodes, x, cos, sin) if `concat` ends `concat(x1 cos - x2 sin, x2 cos + x1 sin)`."""
    if len(concat.input) != 2 or _attribute(concat, "axis") not in (-1, 3):
        return None
    sub, add = producer.get(concat.input[0]), producer.get(concat.input[1])
    if sub is None or add is None or sub.op_type != "Sub" or add.op_type != "Add":
        return None
    muls = [producer.get(name) for name in (*sub.input, *add.input)]
    if any(mul is None or mul.op_type != "Mul" for mul in muls):
        return None
    split = None
    halves = []  # per Mul: (which half, the other operand)
    for mul in muls:
        for index in (0, 1):
            source = producer.get(mul.input[index])
            if source is not None and source.op_type == "Split" and len(source.output) == 2:
                split = split or source
                if source is split:
                    halves.append((list(source.output).index(mul.input[index]), mul.input[1 - index]))
                break
        else:
            return None
    if split is None or len(halves) != 4 or _attribute(split, "axis", 0) not in (-1, 3):  # both on x's last axis
        return None
    if len(split.input) > 1 and split.input[1]:  # explicit split sizes: not known to be halves
        return None
    (a_half, cos), (b_half, sin), (c_half, cos_2), (d_half, sin_2) = halves
    add_pairs = {(c_half, cos_2), (d_half, sin_2)}
    if (a_half, b_half) != (0, 1) or add_pairs != {(1, cos), (0, sin)}:
        return None
    return split, [split, *muls, sub, add, concat], split.input[0], cos, sin


def _shared_table(table: str, shapes) -> bool:
    """Whether the graph's shape information says the table's batch dim is 1 (one table for every sequence)."""
    shape = shapes.get(table)
    return shape is not None and len(shape.dim) == 4 and shape.dim[0].HasField("dim_value") and \
        shape.dim[0].dim_value == 1


def _rotary_nodes(prefix: str, x: str, cos: str, sin: str, output: str, shared_table: bool):
    """x (B, n, N, hd), cos/sin (B or 1, n, 1, hd/2) -> output (B, n, N, hd) through one RotaryEmbedding."""
    from onnx import TensorProto, helper

    def name(suffix: str) -> str:
        return f"{prefix}_{suffix}"

    def constant(suffix: str, values: list[int]):
        return helper.make_node("Constant", [], [name(suffix)], name=name(suffix), value=helper.make_tensor(
            name(suffix) + "_value", TensorProto.INT64, [len(values)], values))

    nodes = [constant("to_3d", [0, 0, -1]),
             helper.make_node("Reshape", [x, name("to_3d")], [name("x3")], name=name("x3")),  # (B, n, N * hd)
             helper.make_node("Shape", [x], [name("shape")], name=name("shape"))]  # [B, n, N, hd]
    if shared_table:  # (1, n, 1, hd/2): the table itself is the cache, positions 0.. for every sequence
        nodes += [helper.make_node("Flatten", [table], [name(f"{kind}_cache")], name=name(f"{kind}_cache"), axis=3)
                  for kind, table in (("cos", cos), ("sin", sin))]  # (n, hd/2)
        nodes.append(constant("positions", [0]))
    else:  # (B, n, 1, hd/2) flattened to one cache row per token, token (b, j) reading row b * n + j
        nodes += [helper.make_node("Slice", [name("shape"), name("zero"), name("two")], [name("rows")],
                                   name=name("rows")),  # [B, n]
                  constant("zero", [0]), constant("two", [2]), constant("ones", [1, 1]),
                  helper.make_node("Concat", [name("rows"), name("ones")], [name("broadcast")], name=name("broadcast"),
                                   axis=0),  # [B, n, 1, 1]
                  helper.make_node("ReduceProd", [name("rows")], [name("count")], name=name("count"), keepdims=0),
                  helper.make_node("Range", [name("start"), name("count"), name("step")], [name("flat")],
                                   name=name("flat")),  # (B * n,)
                  helper.make_node("Constant", [], [name("start")], name=name("start"),
                                   value=helper.make_tensor(name("start_value"), TensorProto.INT64, [], [0])),
                  helper.make_node("Constant", [], [name("step")], name=name("step"),
                                   value=helper.make_tensor(name("step_value"), TensorProto.INT64, [], [1])),
                  helper.make_node("Reshape", [name("flat"), name("rows")], [name("positions")],
                                   name=name("positions"))]  # (B, n)
        for kind, table in (("cos", cos), ("sin", sin)):
            nodes += [helper.make_node("Expand", [table, name("broadcast")], [name(f"{kind}_rows")],
                                       name=name(f"{kind}_rows")),  # (B, n, 1, hd/2)
                      helper.make_node("Flatten", [name(f"{kind}_rows")], [name(f"{kind}_cache")],
                                       name=name(f"{kind}_cache"), axis=3)]  # (B * n, hd/2)
        nodes = _ordered(nodes)
    nodes += [helper.make_node(ROTARY, [name("x3"), name("positions"), name("cos_cache"), name("sin_cache")],
                               [name("rotated")], name=name("rotary"), domain=CONTRIB_DOMAIN, interleaved=0),
              helper.make_node("Reshape", [name("rotated"), name("shape")], [output], name=name("output"))]
    return nodes


def _ordered(nodes):
    """`nodes` in an order where each node comes after the producers of its inputs (among `nodes`)."""
    made = {name for node in nodes for name in node.output}
    done: set[str] = set()
    ordered = []
    pending = list(nodes)
    while pending:
        for node in pending:
            if all(name in done or name not in made for name in node.input):
                ordered.append(node)
                done.update(node.output)
                pending.remove(node)
                break
        else:
            raise ValueError("cycle among the rotary nodes")
    return ordered
