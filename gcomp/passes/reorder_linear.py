"""Aggregate on the narrower side of a linear layer: A(XW) or (AX)W.

Sum and mean aggregation (weighted by edge scalars or not) are linear maps over
nodes, so they commute with a weight matrix applied to features:
aggregate(g, x) @ W == aggregate(g, x @ W).  Aggregation costs in proportion to
edges x width, the matmul the same either way, so aggregation should run at
min(K, M) for W: [K, M].

Expects: fused aggregation (after ``fuse_aggregate``), before autodiff (so the
backward pass inherits the cheaper order).
Guarantees: same values (up to float rounding); every ``matmul(aggregate(g, x), W)``
with M < K becomes ``aggregate(g, matmul(x, W))``, also through a sum of such
terms and scalar factors (GIN's ``((1 + eps) x + sum_j x_j) W``, whose two
products share one ``x @ W``); every ``aggregate(g, matmul(x, W))`` with K < M
becomes ``matmul(aggregate(g, x), W)``.  A rewritten aggregate records
``meta["reorder"] = {"width_before": K or M, "width_after": ...}``; ``gcomp explain``
shows it.  Values with other users are left alone (reordering would compute both).

In a training graph (its first output the cross-entropy loss of ``add_loss``) the
trainer feeds node inputs once and runs many steps, so an aggregation of values
computed from node inputs alone (``hoist_graph_static``'s ``feed`` phase, e.g. the
input features) costs nothing per step: ``matmul(v, W)`` over such a ``v`` is kept
whatever the widths, and ``aggregate(g, matmul(x, W))`` over such an ``x`` becomes
``matmul(aggregate(g, x), W)``; both record ``"hoisted": True``.  Each step then
skips that aggregation forward and its transpose backward (A X W: the weight
gradient is (A X)^T dY).  Not when ``hoist_graph_static`` is disabled: nothing would
then run once per feed, nor with the pass option ``prefer="memory"``
(``gcomp compile --prefer memory``): each such wide aggregation is an [N, K] buffer
kept for the trainer's life (535 MiB for Reddit-size's 602 features).

For ``-t cuda``, a fed aggregation inside a sum also stays wide: GIN's first layer
``(A x + (1 + eps) x) W``, whose eps is trained (so the sum is not fed), becomes
``(A x) W + (1 + eps) (x W)``, with A x once per feed.  On an H200 an arxiv-size
aggregation at 32 features took 0.14 ms a call, a 128 -> 32 product 0.07 ms: the
two aggregations a step (forward and its transpose backward) cost more than the
second product and weight gradient (GIN's epoch 1.91 -> 1.72 ms).  The CPU keeps
``A (x W) + (1 + eps) (x W)``: on the 2-core build machine both forms train GIN's
arxiv-size step in the same time (99.2 and 100.9 ms), and it holds no [N, 128] A x.
"""

from __future__ import annotations

from gcomp.ir.ops import Op
from gcomp.passes.hoist_graph_static import phases
from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import apply_rules, rule


def _linear_agg(v) -> bool:
    return (v.op == Op.AGGREGATE and v.attrs["reduce"] in ("sum", "mean")
            and v.attrs["flow"] == "in" and v.inputs[1].ty.rank == 2
            and (len(v.inputs) < 3 or v.inputs[2].ty.rank == 1))


def _plain_matmul(n) -> bool:
    return n.op == Op.MATMUL and not n.attrs["trans_a"] and not n.attrs["trans_b"]


def _sole(v) -> bool:
    return len(v.users) == 1 and v not in v.graph.outputs


def _matmul(graph, x, w):
    """x @ w, reusing an existing product (GIN's two terms share it)."""
    for u in x.users:
        if _plain_matmul(u) and u.inputs == (x, w):
            return u
    return graph.create_node(Op.MATMUL, [x, w], name=graph.fresh_name(f"{x.name}.lin"))


def _pushable(v, depth: int = 0) -> bool:
    """Can ``v @ W`` be distributed down to aggregations of narrower products?"""
    if not _sole(v) or depth > 8:
        return False
    if _linear_agg(v):
        return True
    if v.op == Op.ADD and v.inputs[0].ty == v.inputs[1].ty:
        return any(_pushable(i, depth + 1) for i in v.inputs)
    return False


def _keep_wide(v, K: int) -> None:
    """Record for gcomp explain that aggregation ``v`` stays at width ``K``, once per feed."""
    v.meta.setdefault("reorder", {"width_before": int(K), "width_after": int(K),
                                  "hoisted": True})


def _distribute(graph, v, w, fed: set):
    """``v @ w`` with the product moved inside aggregations, sums and scalar factors, except
    into the aggregations in ``fed`` (they stay wide: once per feed)."""
    if v in fed:
        _keep_wide(v, w.ty.shape[0])
        return _matmul(graph, v, w)
    if _linear_agg(v) and _sole(v):
        g, x = v.inputs[0], v.inputs[1]
        inner = _matmul(graph, x, w)
        agg = graph.create_node(Op.AGGREGATE, [g, inner] + list(v.inputs[2:]), dict(v.attrs),
                                name=graph.fresh_name(v.name))
        agg.meta["reorder"] = {"width_before": int(x.ty.shape[1]), "width_after": int(w.ty.shape[1])}
        return agg
    if v.op == Op.ADD and _sole(v):
        a, b = (_distribute(graph, i, w, fed) for i in v.inputs)
        return graph.create_node(Op.ADD, [a, b], name=graph.fresh_name(v.name))
    if v.op == Op.MUL and _sole(v):
        s, x = v.inputs if v.inputs[0].ty.rank == 0 else reversed(v.inputs)
        if s.ty.rank == 0:
            return graph.create_node(Op.MUL, [s, _distribute(graph, x, w, fed)],
                                     name=graph.fresh_name(v.name))
    return _matmul(graph, v, w)


def _rules(fed: set, wide_in_sums: bool):
    """The rewrites, given the values that are free to aggregate (fed once, see above), and
    whether a fed aggregation inside a sum stays wide (``-t cuda``)."""
    kept = {v for v in fed if _linear_agg(v)} if wide_in_sums else set()

    @rule([Op.MATMUL])
    def do_push_into_aggregate(n):
        if not _plain_matmul(n):
            return None
        v, w = n.inputs
        K, M = w.ty.shape
        if M >= K or not _pushable(v):
            return None
        if v in fed:
            if _linear_agg(v):
                _keep_wide(v, K)
            return None
        return _distribute(n.graph, v, w, kept)

    @rule([Op.AGGREGATE])
    def do_pull_out_of_aggregate(n):
        v = n.inputs[1]
        if not (_linear_agg(n) and _plain_matmul(v) and _sole(v) and v.inputs[0].ty.rank == 2):
            return None
        x, w = v.inputs
        K, M = w.ty.shape
        hoisted = x in fed and all(i in fed for i in n.inputs[2:])
        if K >= M and not hoisted:
            return None
        graph = n.graph
        agg = graph.create_node(Op.AGGREGATE, [n.inputs[0], x] + list(n.inputs[2:]),
                                dict(n.attrs), name=graph.fresh_name(n.name))
        agg.meta["reorder"] = {"width_before": int(M), "width_after": int(K)}
        if hoisted:
            agg.meta["reorder"]["hoisted"] = True
            fed.add(agg)
        return graph.create_node(Op.MATMUL, [agg, w], name=graph.fresh_name(v.name))

    return [do_push_into_aggregate, do_pull_out_of_aggregate]


def _fed_values(graph) -> set:
    """Values computed once per feed in a training graph (none in an inference graph)."""
    if not graph.outputs or graph.outputs[0].op != Op.CROSS_ENTROPY:
        return set()
    return {n for n, phase in phases(graph).items() if phase != "run"}


class ReorderLinear(Pass):
    name = "reorder_linear"

    def run(self, graph, ctx) -> bool:
        # fed values cost nothing per step only if hoist_graph_static gives them a phase,
        # and they cost a wide buffer
        hoisting = ctx is None or ("hoist_graph_static" not in ctx.disabled
                                   and ctx.option("prefer") == "speed")
        fed = _fed_values(graph) if hoisting else set()
        return apply_rules(graph, _rules(fed, (ctx is not None and ctx.target == "cuda")))
