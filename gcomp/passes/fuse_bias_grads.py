"""Bias gradients computed by their weight gradient's kernel.

Expects: a training graph after autodiff (and ``hoist_graph_static``, whose phases it
reads and keeps): a layer's weight gradient ``x.T @ dy`` and its bias gradient, the
column sums of the same ``dy``.
Guarantees: the same values up to the order of float additions.  Each such pair in the
run phase becomes one product with an extra row, ``matmul[trans_a, sum_row](x, dy)``
([K + 1, M]: the weight gradient, then the column sums), sliced apart; the slices keep
the gradients' names (the trainer finds gradients by name).  The weight-gradient kernel
reads dy's rows anyway, so the sums cost it one vector add per row, and the bias's
column-sum kernel, another pass over dy (21.7 MB for 32 features on the arxiv-size
graph), is gone.  Not where x is node features or computed from them once per feed: those
products have sparse-feature variants (``codegen/lower.py``); not for CUDA, whose
weight-gradient tiles have no such row, nor where the products run on AMX tiles
(``PassContext.tile_products``): the float32 kernel that has the row took GIN's bfloat16
step on arxiv-size rows from 44.6-45.8 to 52.6-54.2 ms and GraphSAGE's from 40.3-40.4
to 43.5-43.7 (interleaved processes), and a column of ones packed beside x on the tiles
(K = 32 padded to 48) GIN's to 47-50 (Intel Xeon, 2026-11-27).

    Before:  %gw = matmul[trans_a=true](%h, %dy)      : f32[32,40]
             %gb = sum[axis=0](%dy)                    : f32[40]
    After:   %t = matmul[trans_a=true, sum_row=true](%h, %dy) : f32[33,40]
             %gw = slice[axis=0, start=0, stop=32](%t) : f32[32,40]
             %gb = reshape[shape=[40]](slice[axis=0, start=32, stop=33](%t))
"""

from __future__ import annotations

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import TensorType
from gcomp.passes.manager import Pass


def _column_sum(n: Node) -> bool:
    """Is ``n`` the column sums of a float32 [N or E, M] tensor?"""
    if n.op != Op.SUM or n.attrs["axis"] % 2 != 0 or n.attrs["keepdims"]:
        return False
    x = n.inputs[0].ty
    return (isinstance(x, TensorType) and x.rank == 2 and not x.is_static
            and x.dtype == "float32")


def per_feed(x: Node) -> bool:
    """Node features, their dropout, or values computed from them once per feed (products
    of such an x have sparse-feature variants: ``codegen/lower.py``)."""
    if x.op == Op.DROPOUT:
        x = x.inputs[0]
    return x.op == Op.INPUT or x.meta.get("phase") == "feed"


def _weight_grad(s: Node) -> Node | None:
    """The product ``x.T @ dy`` beside column sum ``s`` of dy, if one can take it in."""
    dy = s.inputs[0]
    for u in dy.users:
        if (u.op == Op.MATMUL and u.attrs["trans_a"] and not u.attrs["sum_row"]
                and u.inputs[1] is dy and u.inputs[0] is not dy and not per_feed(u.inputs[0])
                and u.meta.get("phase", "run") == "run" == s.meta.get("phase", "run")
                and u.ty.dtype == "float32"):
            return u
    return None


class FuseBiasGrads(Pass):
    name = "fuse_bias_grads"

    def run(self, graph: Graph, ctx) -> bool:
        if ctx is not None and (ctx.target == "cuda" or ctx.tile_products):
            return False
        changed = False
        # positions in the graph as given: a merge inserts and erases nodes, but the ones
        # left keep their order, which is all the comparison below reads
        order = {n: k for k, n in enumerate(graph)}
        for s in list(graph):
            mm = _weight_grad(s) if _column_sum(s) else None
            if mm is None:
                continue
            first = min(mm, s, key=order.__getitem__)
            if order[mm.inputs[0]] > order[first]:  # no place before both that has x
                continue
            self._merge(graph, mm, s, first)
            changed = True
        return changed

    @staticmethod
    def _merge(graph: Graph, mm: Node, s: Node, first: Node) -> None:
        K, M = int(mm.ty.shape[0]), int(mm.ty.shape[1])
        phase = mm.meta.get("phase")

        def new(op, inputs, hint, **attrs):
            n = graph.create_node(op, inputs, attrs, name=graph.fresh_name(hint))
            if phase is not None:
                n.meta["phase"] = phase
            return n
        with graph.inserting_before(first):
            both = new(Op.MATMUL, list(mm.inputs), f"{mm.name}.with_bias", trans_a=True,
                       sum_row=True)
            w = new(Op.SLICE, [both], f"{mm.name}.rows", axis=0, start=0, stop=K)
            row = new(Op.SLICE, [both], f"{s.name}.row", axis=0, start=K, stop=K + 1)
            b = new(Op.RESHAPE, [row], f"{s.name}.flat", shape=[M])
        for old, done in ((mm, w), (s, b)):
            graph.replace_all_uses_with(old, done)
            name = old.name
            graph.erase_node(old)
            graph.rename(done, name)  # gradients are found by name (meta["grads"])
