"""The Graph IR checker: run it after the builder, the parser and every pass.

Checks that names are unique and owned by the graph, nodes are in topological
order, use-lists agree with inputs, every type equals the one inferred from its
inputs, symbolic edge axes name graph values that exist, leaf values have
sensible types, and the graph has outputs.  A failure names the bad node and
shows the lines around it.
"""

from __future__ import annotations

from gcomp.errors import IRError
from gcomp.ir.graph import Graph
from gcomp.ir.ops import Op, infer_type, normalize_attrs
from gcomp.ir.printer import format_node
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType


def _context(order: list, bad, radius: int = 2) -> str:
    i = order.index(bad)
    lines = []
    for j in range(max(0, i - radius), min(len(order), i + radius + 1)):
        mark = ">>" if j == i else "  "
        lines.append(f"{mark} {format_node(order[j])}")
    return "\n".join(lines)


def verify(g: Graph) -> Graph:
    order = g.nodes
    seen = set()
    graphs = set()

    def fail(node, msg):
        raise IRError(f"invalid IR in graph {g.name}: %{node.name}: {msg}\n{_context(order, node)}")

    for n in order:
        if n.graph is not g:
            fail(n, "node belongs to another graph")
        if n.name in seen:
            fail(n, "duplicate name")
        for i in n.inputs:
            if i.name not in seen:
                fail(n, f"input %{i.name} is not defined before its use")
            if n not in i.users:
                fail(n, f"use-list of %{i.name} misses this node")
        for u in n.users:
            if n not in u.inputs:
                fail(n, f"use-list names %{u.name}, which does not use it")
        try:
            if normalize_attrs(n.op, n.attrs) != n.attrs:
                fail(n, f"attributes {n.attrs} are not normalized")
            ty = infer_type(n)
        except IRError as e:
            fail(n, str(e))
        if ty != n.ty:
            fail(n, f"type is {n.ty} but inputs give {ty}")
        if isinstance(n.ty, TensorType):
            for d in n.ty.shape[1:]:
                if not isinstance(d, int) or d < 0:
                    fail(n, f"only axis 0 may be symbolic, got {n.ty}")
            lead = n.ty.shape[0] if n.ty.shape else None
            if isinstance(lead, EdgeDim) and lead.graph not in graphs:
                fail(n, f"edge axis names %{lead.graph}, which is not a graph value defined earlier")
            if isinstance(lead, str) and lead != N:
                fail(n, f"unknown symbolic dimension {lead!r}")
        if n.op == Op.INPUT and isinstance(n.ty, TensorType) and n.ty.is_static and n.ty.rank:
            fail(n, "an input must be a graph, a node tensor [N,...], an edge tensor [E(g),...] "
                    "or a scalar")
        if n.op == Op.PARAM and not (isinstance(n.ty, TensorType) and n.ty.is_static):
            fail(n, f"a parameter must have a static shape, got {n.ty}")
        if n.op == Op.CONST and n.ty != TensorType((), "float32"):
            fail(n, f"a constant is a f32[] scalar, got {n.ty}")
        if isinstance(n.ty, GraphType):
            graphs.add(n.name)
        seen.add(n.name)
    if not g.outputs:
        raise IRError(f"invalid IR in graph {g.name}: it has no outputs")
    for o in g.outputs:
        if o.graph is not g or o.name not in seen:
            raise IRError(f"invalid IR in graph {g.name}: output %{o.name} is not in the graph")
    return g
