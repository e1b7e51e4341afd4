"""Mark when each value can be computed: once per graph, once per fed input, or every run.

Expects: nothing beyond a verified graph.
Guarantees (analysis only: the ops are unchanged, the annotations set): ``meta["phase"]`` is

* ``"bind"`` for values computable from graph inputs, edge inputs (edge values
  are bound with their graph) and constants, e.g. degrees and GCN normalization:
  the runtime computes them once per bound graph and caches them;
* ``"feed"`` for values computable from those and node inputs (features,
  labels, masks) alone, e.g. the aggregation of the input features: computed
  once each time node inputs are fed.  A trainer feeds once and runs many
  steps, so ``reorder_linear`` counts these as free in a training graph;
* ``"run"`` for everything that depends on parameters or step counters (and so
  on dropout's random masks).
"""

from __future__ import annotations

from gcomp.ir.ops import Op
from gcomp.ir.types import GraphType
from gcomp.passes.manager import Pass

PHASES = ("bind", "feed", "run")  # in order: a value is computable in its inputs' latest


def _leaf_phase(n) -> str:
    if n.op == Op.CONST:
        return "bind"
    if n.op == Op.INPUT:
        if isinstance(n.ty, GraphType) or n.ty.edge_graph is not None:
            return "bind"
        if n.ty.is_node:
            return "feed"
    return "run"  # parameters, step counters


def phases(graph) -> dict:
    """The phase of every node (see the module docstring)."""
    out = {}
    for n in graph:
        out[n] = (max((out[i] for i in n.inputs), key=PHASES.index) if n.inputs
                  else _leaf_phase(n))
    return out


class HoistGraphStatic(Pass):
    name = "hoist_graph_static"

    def run(self, graph, ctx) -> bool:
        """Changed: whether an annotation did (the instruments report it so)."""
        changed = False
        for n, phase in phases(graph).items():
            changed |= n.meta.get("phase") != phase
            n.meta["phase"] = phase
        return changed
