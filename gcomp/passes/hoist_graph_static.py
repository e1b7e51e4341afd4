"""Mark values that depend only on the graph: computed once when a graph is bound.

Expects: nothing beyond a verified graph.
Guarantees (analysis only, the graph is unchanged): ``meta["phase"]`` is
``"bind"`` for values computable from graph inputs, edge inputs (edge values
are bound with their graph) and constants, e.g. degrees and GCN normalization;
``"run"`` for everything that depends on node features or parameters.  The
runtime runs bind-phase kernels once per bound graph and caches the results.
"""

from __future__ import annotations

from gcomp.ir.ops import Op
from gcomp.ir.types import GraphType
from gcomp.passes.manager import Pass


def _leaf_phase(n) -> str:
    if n.op == Op.CONST:
        return "bind"
    if n.op == Op.INPUT and (isinstance(n.ty, GraphType) or n.ty.edge_graph is not None):
        return "bind"
    return "run"


class HoistGraphStatic(Pass):
    name = "hoist_graph_static"

    def run(self, graph, ctx) -> bool:
        for n in graph:
            if not n.inputs:
                n.meta["phase"] = _leaf_phase(n)
            else:
                static = all(i.meta["phase"] == "bind" for i in n.inputs)
                n.meta["phase"] = "bind" if static else "run"
        return False
