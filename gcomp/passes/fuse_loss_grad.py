"""The loss and its gradient in one kernel.

Expects: a training graph after autodiff: ``%loss = cross_entropy(%z, %y, %m)`` and,
later, its gradient ``cross_entropy_grad(%dy, %z, %y, %m)`` of the same operands.
Guarantees: the same values and nodes; the pair is marked (``with_grad`` on the loss,
``with_loss`` on the gradient) where one kernel can compute both at the gradient's place:
``dy`` is a constant (autodiff's seed, so it does not depend on the loss) and nothing
before the gradient reads the loss.  Lowering then emits one pass over the logits that
writes the loss and the gradient (``cross_entropy_fused``): apart, the loss kernel reads
the logits and the gradient kernel reads them again, with the log-sum-exps, to compute
the same exponentials (arxiv-synth, 40 classes: 27 MB of logits a pass).  Not for CUDA,
whose loss kernels are scheduled apart.

    Before:  %loss = cross_entropy(%z, %y, %m) : f32[]
             %g = cross_entropy_grad(%seed, %z, %y, %m) : f32[N,40]
    After:   %loss = cross_entropy(%z, %y, %m) : f32[]  # with_grad='g'
             %g = cross_entropy_grad(%seed, %z, %y, %m) : f32[N,40]  # with_loss='loss'
"""

from __future__ import annotations

from gcomp.ir.graph import Graph
from gcomp.ir.ops import Op
from gcomp.passes.manager import Pass


class FuseLossGrad(Pass):
    name = "fuse_loss_grad"

    def run(self, graph: Graph, ctx) -> bool:
        if ctx is not None and ctx.target == "cuda":
            return False
        order = {n: k for k, n in enumerate(graph)}
        changed = False
        for g in graph:
            if g.op != Op.CROSS_ENTROPY_GRAD or {"with_loss", "fused"} & g.meta.keys():
                continue
            dy, *operands = g.inputs
            loss = next((u for u in operands[0].users if u.op == Op.CROSS_ENTROPY
                         and list(u.inputs) == operands
                         and not {"with_grad", "fused"} & u.meta.keys()), None)
            if (loss is None or dy.op != Op.CONST or order[loss] > order[g]
                    or any(order[u] < order[g] for u in loss.users)
                    or loss.meta.get("phase", "run") != g.meta.get("phase", "run")):
                continue
            loss.meta["with_grad"] = g.name
            g.meta["with_loss"] = loss.name
            changed = True
        return changed
