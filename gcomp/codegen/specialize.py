"""Specialize a plan to one graph (``gcomp compile --graph``): keep the kernels it runs.

An artifact compiled without a graph carries, besides the CSR kernels, every
variant the runtime may choose by the statistics of the graph it is given:
sparse-feature kernels (``plan.variants``) and dense / banded aggregations
(``step["formats"]``).  Given the graph, the same decisions the runtime makes
when binding (``gcomp/runtime/executor.decide_layout``, the sparsity threshold)
are made now, and the variants they rule out are dropped from the plan, so the
library holds only the kernels this graph runs, plus the CSR and dense-feature
kernels that every graph can fall back on.  The decisions are deterministic
(the plan's measured costs and thresholds and the graph's sizes), so binding the
same graph makes them again; another graph still runs, on what is left.
``plan.specialized`` records the graph and the decisions.
"""

from __future__ import annotations

from gcomp.runtime.data import GraphData
from gcomp.runtime.features import sparse_enough
from gcomp.runtime.plan import Plan


def specialize(plan: Plan, graph: GraphData, gpu: bool = False) -> dict:
    """Prune ``plan`` in place for ``graph``; returns the decisions (``plan.specialized``);
    ``gpu``: the plan's kernels are CUDA's (their node order rule)."""
    from gcomp.runtime.executor import decide_layout

    layout = decide_layout(plan, graph, gpu=gpu)
    record = {"graph": graph.name, "nodes": graph.num_nodes, "edges": graph.num_edges,
              "node_order": layout.reorder["chosen"], "formats": dict(layout.chosen),
              "sparse_features": {}}
    for key, v in list(plan.variants.items()):
        # values computed from the features (an aggregation of them) are denser than the
        # features: these decide for both
        on = sparse_enough(graph.x, v["threshold"])
        record["sparse_features"][key] = on
        if on:  # the dense-feature steps stay: another graph may need them
            continue
        del plan.variants[key]
        plan.steps = [s for s in plan.steps if s.get("when") != key]
        plan.bind_steps = [s for s in plan.bind_steps if s.get("when") != key]
        plan.feed_steps = [s for s in plan.feed_steps if s.get("when") != key]
        for s in plan.steps + plan.bind_steps + plan.feed_steps:
            if s.get("unless") == key:
                del s["unless"]
        nnz = f"NNZ:{v['input']}"  # buffers sized by the nonzeros only those steps used
        plan.buffers = {k: b for k, b in plan.buffers.items() if nnz not in b["dims"]}
    for s in plan.steps:
        f = s.get("formats")
        if f is None:
            continue
        fmt = layout.chosen.get(f["graph"], "csr")
        if fmt == "csr":
            del s["formats"]
        else:
            f["kernels"] = {fmt: f["kernels"][fmt]}
            f["pack"] = {k: v for k, v in f["pack"].items() if k == fmt}
    plan.specialized = record
    return record
