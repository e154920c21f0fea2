"""Walking an ONNX graph with the subgraphs of its control-flow nodes (If branches, Loop/Scan bodies) at any depth."""

from __future__ import annotations

from collections.abc import Iterator


def subgraphs(node) -> list:
    """The subgraphs a node's attributes hold (an If's two branches, a Loop's body)."""
    found = []
    for attribute in node.attribute:
        if attribute.HasField("g"):
            found.append(attribute.g)
        found.extend(attribute.graphs)
    return found


def all_nodes(graph) -> Iterator:
    """Every node of `graph` and of every subgraph in it, at any depth, outer nodes before their subgraphs' nodes."""
    for node in graph.node:
        yield node
        for subgraph in subgraphs(node):
            yield from all_nodes(subgraph)


def op_types(graph) -> set[str]:
    """The operator types of every node in `graph`, subgraphs included."""
    return {node.op_type for node in all_nodes(graph)}


def names_read(graph) -> set[str]:
    """Every value name a node of `graph` or of any subgraph in it reads."""
    return {name for node in all_nodes(graph) for name in node.input}
