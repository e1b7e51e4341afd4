"""Eval mode: drop training-only behaviour for inference.

Expects: a model graph.  Guarantees: every ``dropout(x, step)`` is replaced by
``x`` and the ``rng_step`` input disappears once nothing uses it, so an
inference artifact takes only the model's real inputs.  Put it first in the
inference pipeline.
"""

from __future__ import annotations

from gcomp.frontend.builder import RNG_STEP
from gcomp.ir.ops import Op
from gcomp.passes.manager import Pass


class EvalMode(Pass):
    name = "eval_mode"

    def run(self, graph, ctx) -> bool:
        changed = False
        for n in graph:
            if n.op == Op.DROPOUT:
                graph.replace_all_uses_with(n, n.inputs[0])
                graph.erase_node(n)
                changed = True
        for n in graph.inputs:
            if n.name == RNG_STEP and not n.users and n not in graph.outputs:
                graph.erase_node(n)
                changed = True
        return changed
