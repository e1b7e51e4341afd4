"""Fuse GAT attention into one op: scores, softmax and aggregation per destination.

Expects: aggregations already fused (run after ``fuse_aggregate``).
Guarantees: every ``aggregate[reduce="sum", flow="in"](g, x, w)`` whose weight is
the softmax over in-edges of ``leaky_relu(gather(s_src, src) + gather(s_dst, dst))``
(the leaky_relu optional; ``w`` possibly reshaped to [E] when there is one head, and
possibly ``dropout`` of the coefficients, which the op then applies per edge and head),
with scores ``s_src``, ``s_dst`` [N, H] matching x [N, H, C] and every edge-space
intermediate used by that chain alone, becomes
``attention_aggregate[negative_slope](g, x, s_src, s_dst)``.  The [E, H] edge
tensors (two gathered scores, their sum, its leaky_relu, the coefficients) are
then dead: the kernel computes each destination's scores, softmax and weighted
sum in one pass over its in-edges (DF-GNN's fusion).  In training it runs
before autodiff, whose rule for the fused op is a fused backward (two passes, no
edge tensor either).  A coefficient that something else reads keeps the unfused
form.

    Before:  %a = gather[side="src"](%g, %s) : f32[E(g),4]
             %b = gather[side="dst"](%g, %d) : f32[E(g),4]
             %e = leaky_relu[alpha=0.2](add(%a, %b)) : f32[E(g),4]
             %w = edge_softmax(%g, %e)        : f32[E(g),4]
             %y = aggregate(%g, %x, %w)       : f32[N,4,8]
    After:   %y = attention_aggregate[negative_slope=0.2](%g, %x, %s, %d) : f32[N,4,8]
"""

from __future__ import annotations

from gcomp.ir.ops import Op
from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import apply_rules, rule


def _only_user(v, user) -> bool:
    return list(v.users) == [user] and v not in v.graph.outputs


def _gathered(v, g, side: str):
    if v.op == Op.GATHER and v.attrs["side"] == side and v.inputs[0] is g:
        return v.inputs[1]
    return None


@rule([Op.AGGREGATE])
def do_fuse(n):
    if len(n.inputs) != 3 or n.attrs["reduce"] != "sum" or n.attrs["flow"] != "in":
        return None
    g, x, w = n.inputs
    chain = [(w, n)]
    if w.op == Op.RESHAPE:
        chain.append((w.inputs[0], w))
        w = w.inputs[0]
    drop = {}
    if w.op == Op.DROPOUT:  # of the coefficients: hashed per edge and head in the kernels
        drop = {"p": w.attrs["p"], "seed": w.attrs["seed"], "step": w.inputs[1]}
        chain.append((w.inputs[0], w))
        w = w.inputs[0]
    if w.op != Op.EDGE_SOFTMAX or w.inputs[0] is not g:
        return None
    e = w.inputs[1]
    chain.append((e, w))
    slope = 1.0
    if e.op == Op.LEAKY_RELU:
        slope = float(e.attrs["alpha"])
        chain.append((e.inputs[0], e))
        e = e.inputs[0]
    if e.op != Op.ADD:
        return None
    for a, b in ((e.inputs[0], e.inputs[1]), (e.inputs[1], e.inputs[0])):
        s_src, s_dst = _gathered(a, g, "src"), _gathered(b, g, "dst")
        if s_src is None or s_dst is None:
            continue
        if not (s_src.ty.rank == s_dst.ty.rank == 2 and s_src.ty == s_dst.ty
                and x.ty.rank >= 2 and x.ty.shape[1] == s_src.ty.shape[1]):
            return None
        if not all(_only_user(v, u) for v, u in chain + [(a, e), (b, e)]):
            return None
        attrs = {"negative_slope": slope}
        inputs = [g, x, s_src, s_dst]
        if drop and drop["p"] > 0:
            attrs.update(p=drop["p"], seed=drop["seed"])
            inputs.append(drop["step"])
        fused = n.graph.create_node(Op.ATTENTION_AGGREGATE, inputs, attrs,
                                    name=n.graph.fresh_name(n.name))
        # for gcomp explain: the edge tensors that no longer exist
        fused.meta["replaces"] = [f"{v.op.value} %{v.name}"
                                  for v, _ in chain[::-1] + [(a, e), (b, e)]
                                  if v.op != Op.RESHAPE]
        return fused
    return None


class FuseAttention(Pass):
    name = "fuse_attention"

    def run(self, graph, ctx) -> bool:
        return apply_rules(graph, [do_fuse])
