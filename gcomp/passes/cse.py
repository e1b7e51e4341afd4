"""Common subexpression elimination: one value for each distinct computation.

Expects: a verified graph.  Guarantees: no two non-leaf values have the same op,
attributes and inputs (e.g. the self-loop graph and GCN normalization that every
GCN layer builds are made once); parameters, inputs and constants are kept as
they are.  Edge tensors of a merged graph value are retyped to the survivor.
"""

from __future__ import annotations

import json

from gcomp.ir.ops import OpGroup
from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import remove_dead


class CommonSubexprElimination(Pass):
    name = "cse"

    def run(self, graph, ctx) -> bool:
        seen: dict[tuple, object] = {}
        changed = False
        for n in graph:
            if n.op in OpGroup.Leaf:
                continue
            key = (n.op, tuple(id(i) for i in n.inputs), json.dumps(n.attrs, sort_keys=True))
            other = seen.get(key)
            if other is None:
                seen[key] = n
                continue
            graph.replace_all_uses_with(n, other)
            changed = True
        if changed:
            for n in graph:  # edge types may name a graph value that was merged away
                graph.retype(n)
            remove_dead(graph)
        return changed
