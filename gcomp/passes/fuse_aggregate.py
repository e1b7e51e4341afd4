"""Fuse message passing into sparse aggregation: no per-edge message tensor.

Expects: canonical form (run after ``canonicalize``).
Guarantees: every ``scatter(g, m)`` whose message ``m`` is ``gather(g, x, src)``,
optionally multiplied by an edge tensor ``w`` of g that scales whole feature
blocks (shape [E], [E,1,..], [E,H] or [E,H,1] against x: [N,H,C]), becomes
``aggregate(g, x, w)`` with the same reduction; the E x F gather and product
are then dead and removed.  Sum, mean and max keep their meaning
(max reduces w * x[src]).

    Before:  %m = gather[side="src"](%g, %h) : f32[E(g),16]
             %p = mul(%norm2, %m)              : f32[E(g),16]   # %norm2: f32[E(g),1]
             %y = scatter[reduce="sum"](%g, %p) : f32[N,16]
    After:   %y = aggregate[reduce="sum"](%g, %h, %norm) : f32[N,16]
"""

from __future__ import annotations

from gcomp.ir.ops import Op
from gcomp.ir.types import TensorType
from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import apply_rules, rule


def _src_gather(v, g):
    return v if v.op == Op.GATHER and v.attrs["side"] == "src" and v.inputs[0] is g else None


def _weight_for(w, x_ty: TensorType, g):
    """``w`` as an aggregate weight ([E] or [E,H]) for features ``x_ty``, or None."""
    if w.ty.edge_graph != g.name:
        return None
    dims = list(w.ty.shape[1:])
    while dims and dims[-1] == 1:
        dims.pop()
    feat = list(x_ty.shape[1:])
    if len(dims) >= len(feat) or feat[:len(dims)] != dims:
        return None
    if len(w.ty.shape) - 1 == len(dims):
        return w
    src = w.inputs[0] if w.op == Op.RESHAPE else w  # a reshape of a reshape is one reshape
    if list(src.ty.shape[1:]) == dims:
        return src
    return w.graph.create_node(Op.RESHAPE, [src], {"shape": ["E"] + dims},
                               name=w.graph.fresh_name(w.name + ".w"))


@rule([Op.SCATTER])
def do_fuse(n):
    g, m = n.inputs
    reduce = n.attrs["reduce"]
    name = n.graph.fresh_name(n.name)
    x = _src_gather(m, g)
    if x is not None:
        return n.graph.create_node(Op.AGGREGATE, [g, x.inputs[1]], {"reduce": reduce}, name=name)
    if m.op != Op.MUL:
        return None
    for a, b in ((m.inputs[0], m.inputs[1]), (m.inputs[1], m.inputs[0])):
        x = _src_gather(a, g)
        if x is None or m.ty != x.ty:
            continue
        w = _weight_for(b, x.ty, g)
        if w is not None:
            return n.graph.create_node(Op.AGGREGATE, [g, x.inputs[1], w], {"reduce": reduce},
                                       name=name)
    return None


class FuseAggregate(Pass):
    name = "fuse_aggregate"

    def run(self, graph, ctx) -> bool:
        return apply_rules(graph, [do_fuse])
