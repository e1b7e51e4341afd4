"""Fuse elementwise work into the kernel that produces its input.

Expects: the graph after every pass that changes values (autodiff included: a
value the backward pass still needs has two users and stays materialized).
Guarantees (analysis only, values unchanged): fusion groups in ``meta``.  A group
has an anchor and a chain of members; each member's chain input is used by that
member alone and is not a graph output, so no intermediate of the group needs to
exist in memory.  ``anchor.meta["fused"]`` lists the members in order;
``member.meta["fused_into"]`` names the anchor.  Lowering emits one kernel for the
whole group, at the position of its last member, writing the last member's value.

Anchors and what they absorb:
* ``aggregate``, ``attention_aggregate`` and ``matmul`` (``x @ w`` or ``x @ w.T``): an
  epilogue of ``bias_add`` with a bias over the flat features, unary activations, and
  binary ops with a scalar or a tensor shaped like the result (e.g. GIN's
  ``(1 + eps) * x`` added after the sum); a ``reshape`` between them is a free view.
  A matmul also absorbs an activation's gradient applied to it (``dy @ W.T`` times
  relu'(y), the backward of a layer), the activation's output or input read per
  element.  (Not an aggregation over out-edges: the distributed runtime adds their
  partial sums across ranks after the epilogue, so it must be additive.)
* any elementwise op (``elementwise_grad`` included): following elementwise ops of
  the same shape, fused into one elementwise kernel.

    Before:  %a = aggregate(%g, %h, %norm) : f32[N,16]
             %b = bias_add(%a, %bias)      : f32[N,16]
             %r = relu(%b)                 : f32[N,16]
    After:   same values; %a.meta["fused"] = ["b", "r"]: one kernel computes %r
"""

from __future__ import annotations

from math import prod

from gcomp.ir.ops import Op, OpGroup
from gcomp.ir.types import TensorType
from gcomp.passes.manager import Pass

UNARY = OpGroup.Unary
CHAINABLE = OpGroup.Elementwise | {Op.ELEMENTWISE_GRAD}


def _flat(t: TensorType) -> int:
    return int(prod(t.shape[1:]))


def _extra_ok(v, out: TensorType) -> bool:
    """Can ``v`` be an extra input of an epilogue producing ``out``?"""
    t = v.ty
    if not isinstance(t, TensorType) or t.dtype != "float32":
        return False
    if t.rank == 0:
        return True
    if t.is_static and t.rank == 1 and t.shape[0] == _flat(out):
        return True  # a bias over the flat features
    return t.shape == out.shape  # a tensor of the same shape


def _materialized(v) -> bool:
    """Does ``v`` have its own buffer?  (Anchors and inner members of groups do not.)"""
    if "fused" in v.meta:
        return False
    return "fused_into" not in v.meta or v.meta.get("tail", False)


def _absorbable_after_kernel(n, prev, anchor) -> bool:
    if n.op == Op.RESHAPE:
        return True
    if n.op in UNARY:
        return True
    if n.op == Op.ELEMENTWISE_GRAD:
        return (anchor.op == Op.MATMUL and len(n.inputs) == 2 and n.inputs[0] is prev
                and n.inputs[1] is not prev and n.ty.shape == prev.ty.shape
                and _extra_ok(n.inputs[1], n.ty) and _materialized(n.inputs[1]))
    if n.op in OpGroup.Binary:
        other = n.inputs[1] if n.inputs[0] is prev else n.inputs[0]
        return (other is not prev and n.ty.shape == prev.ty.shape and _extra_ok(other, n.ty)
                and _materialized(other))
    return False


def _absorbable_elementwise(n, prev, anchor) -> bool:
    return (n.op in CHAINABLE and n.ty.shape == prev.ty.shape
            and sum(i is prev for i in n.inputs) == 1
            and all(_materialized(i) for i in n.inputs if i is not prev))


def _sole_user(v, graph):
    if len(v.users) != 1 or v in graph.outputs:
        return None
    return next(iter(v.users))


class FuseEpilogues(Pass):
    name = "fuse_epilogues"

    def run(self, graph, ctx) -> bool:
        changed = False
        for n in graph:
            for key in ("fused", "fused_into", "tail"):
                n.meta.pop(key, None)
        for n in graph:
            if "fused_into" in n.meta:
                continue
            if n.op in (Op.AGGREGATE, Op.ATTENTION_AGGREGATE) or (n.op == Op.MATMUL
                                                                  and not n.attrs["trans_a"]):
                ok = _absorbable_after_kernel
            elif n.op in CHAINABLE and isinstance(n.ty, TensorType) and not n.ty.is_static:
                ok = _absorbable_elementwise
            else:
                continue
            if n.op in CHAINABLE and not all(_materialized(i) for i in n.inputs):
                continue
            members, prev = [], n
            while True:
                u = _sole_user(prev, graph)
                if (u is None or "fused_into" in u.meta or not ok(u, prev, n)
                        or u.meta.get("phase") != n.meta.get("phase")):
                    break
                members.append(u)
                prev = u
            while members and members[-1].op == Op.RESHAPE:  # a trailing view stays a view
                members.pop()
            if members:
                n.meta["fused"] = [m.name for m in members]
                for m in members:
                    m.meta["fused_into"] = n.name
                members[-1].meta["tail"] = True
                changed = True
        return changed
