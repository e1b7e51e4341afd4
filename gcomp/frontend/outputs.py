"""Model outputs, each a value of its own.

A runtime names its results by their nodes (``gcomp run --out y.npz`` writes one array per
name), so an output list that names one node twice, or an input, would lose a result or
its name: such an output becomes a copy (the value times one) under its own name.
"""

from __future__ import annotations

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import TensorType


def distinct(graph: Graph, nodes: list[Node], names: list[str | None]) -> list[Node]:
    """``nodes`` with each repeat of an earlier one, and each input, replaced by a copy
    named ``names[k]`` (or after the node) made fresh in ``graph``."""
    out: list[Node] = []
    for node, name in zip(nodes, names):
        if node in out or node.op == Op.INPUT:
            base = name or node.name
            one = graph.create_node(Op.CONST, [], {"value": 1.0},
                                    ty=TensorType((), "float32"),
                                    name=graph.fresh_name(f"{base}.one"))
            node = graph.create_node(Op.MUL, [node, one], name=graph.fresh_name(base))
        out.append(node)
    return out
