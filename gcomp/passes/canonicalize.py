"""Canonicalize: put common patterns in one form so later passes match one shape.

Expects: a verified graph.  Guarantees: same values; ``add(x, b)`` with a rank-1
parameter ``b`` matching x's last axis becomes ``bias_add(x, b)``; constant
arithmetic is folded into one ``const``; a reshape of a reshape becomes one
reshape, and a reshape to the same type disappears; a sum, mean or max over an
axis of size 1 (GAT's mean over one head) becomes a reshape, a free view
instead of a copy kernel (and no broadcast kernel in its gradient).
Run it first: fusion and autodiff match the canonical forms.
"""

from __future__ import annotations

from gcomp.ir.ops import Op, OpGroup
from gcomp.ir.types import EdgeDim
from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import apply_rules, rule

_FOLD = {Op.ADD: lambda a, b: a + b, Op.SUB: lambda a, b: a - b, Op.MUL: lambda a, b: a * b,
         Op.DIV: lambda a, b: a / b if b != 0 else None}


@rule([Op.ADD])
def do_bias_add(n):
    for x, b in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
        if (b.op == Op.PARAM and b.ty.rank == 1 and x.ty.rank >= 2 and n.ty == x.ty
                and x.ty.shape[-1] == b.ty.shape[0]):
            return n.graph.create_node(Op.BIAS_ADD, [x, b], name=n.graph.fresh_name(n.name))
    return None


@rule(_FOLD)
def do_fold_consts(n):
    a, b = n.inputs
    if a.op == Op.CONST and b.op == Op.CONST:
        v = _FOLD[n.op](a.attrs["value"], b.attrs["value"])
        if v is not None:
            return n.graph.create_node(Op.CONST, [], {"value": float(v)}, ty=n.ty,
                                       name=n.graph.fresh_name(n.name))
    return None


@rule([Op.RESHAPE])
def do_reshape(n):
    src = n.inputs[0]
    if src.ty == n.ty:
        return src
    if src.op == Op.RESHAPE:
        return n.graph.create_node(Op.RESHAPE, [src.inputs[0]], {"shape": n.attrs["shape"]},
                                   name=n.graph.fresh_name(n.name))
    return None


@rule(OpGroup.Reduce)
def do_unit_reduce(n):
    x = n.inputs[0]
    axis = n.attrs["axis"] % x.ty.rank
    if axis == 0 or x.ty.shape[axis] != 1:  # axis 0 is the node/edge axis: symbolic
        return None
    shape = ["E" if isinstance(d, EdgeDim) else "N" if k == 0 and not isinstance(d, int) else d
             for k, d in enumerate(n.ty.shape)]
    return n.graph.create_node(Op.RESHAPE, [x], {"shape": shape}, name=n.graph.fresh_name(n.name))


class Canonicalize(Pass):
    name = "canonicalize"

    def run(self, graph, ctx) -> bool:
        return apply_rules(graph, [do_bias_add, do_fold_consts, do_reshape, do_unit_reduce])
