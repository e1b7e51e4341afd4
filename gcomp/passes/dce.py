"""Dead code elimination.

Expects: a verified graph.  Guarantees: every non-input value is used by
another value or is an output; inputs always stay (they are the signature).
"""

from __future__ import annotations

from gcomp.passes.manager import Pass
from gcomp.passes.rewrite import remove_dead


class DeadCodeElimination(Pass):
    name = "dce"

    def run(self, graph, ctx) -> bool:
        return remove_dead(graph)
