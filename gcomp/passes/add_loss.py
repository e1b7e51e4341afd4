"""Add the training loss: masked cross-entropy of the model's logits.

Expects: a model graph whose first output is node logits ``f32[N,C]``.
Guarantees: new inputs ``labels: i32[N]`` and ``train_mask: f32[N]`` (1 for
nodes that count, 0 otherwise); the only output is
``loss = cross_entropy(logits, labels, train_mask)``, the mean over masked
nodes of -log softmax(logits)[label] (``torch.nn.functional.cross_entropy`` on
the masked rows).  Run it first in the training pipeline, before autodiff.
"""

from __future__ import annotations

from gcomp.errors import IRError
from gcomp.ir.ops import Op
from gcomp.ir.types import N, TensorType
from gcomp.passes.manager import Pass

LABELS = "labels"
TRAIN_MASK = "train_mask"


class AddLoss(Pass):
    name = "add_loss"

    def run(self, graph, ctx) -> bool:
        logits = graph.outputs[0]
        if not (isinstance(logits.ty, TensorType) and logits.ty.is_node and logits.ty.rank == 2):
            raise IRError(f"training needs node logits [N, C] as the first output, got {logits.ty}")
        for name in (LABELS, TRAIN_MASK):
            if graph.has(name):
                raise IRError(f"the model already has a value named {name!r}; the training "
                              f"step's own inputs are {LABELS!r} and {TRAIN_MASK!r}: rename "
                              "the model's")
        y = graph.create_node(Op.INPUT, ty=TensorType((N,), "int32"), name=LABELS)
        m = graph.create_node(Op.INPUT, ty=TensorType((N,), "float32"), name=TRAIN_MASK)
        loss = graph.create_node(Op.CROSS_ENTROPY, [logits, y, m], name=graph.fresh_name("loss"))
        graph.set_outputs([loss])
        return True
