"""Passes over the Graph IR, one per file, and the default pipelines."""

from gcomp.passes.add_loss import AddLoss
from gcomp.passes.autodiff import Autodiff
from gcomp.passes.canonicalize import Canonicalize
from gcomp.passes.cse import CommonSubexprElimination
from gcomp.passes.dce import DeadCodeElimination
from gcomp.passes.elide_broadcasts import ElideBroadcasts
from gcomp.passes.eval_mode import EvalMode
from gcomp.passes.fuse_aggregate import FuseAggregate
from gcomp.passes.fuse_attention import FuseAttention
from gcomp.passes.fuse_bias_grads import FuseBiasGrads
from gcomp.passes.fuse_epilogues import FuseEpilogues
from gcomp.passes.fuse_loss_grad import FuseLossGrad
from gcomp.passes.hoist_graph_static import HoistGraphStatic
from gcomp.passes.manager import Instrument, Pass, PassContext, PassError, PassManager
from gcomp.passes.pack_relu_masks import PackReluMasks
from gcomp.passes.rematerialize import Rematerialize
from gcomp.passes.reorder_linear import ReorderLinear
from gcomp.passes.split_concat import SplitConcatProducts


PASSES = {p.name: p for p in (EvalMode, Canonicalize, CommonSubexprElimination, FuseAggregate,
                              FuseAttention,
                              ReorderLinear, DeadCodeElimination, HoistGraphStatic,
                              FuseEpilogues, AddLoss, Autodiff, ElideBroadcasts,
                              SplitConcatProducts, Rematerialize, PackReluMasks,
                              FuseBiasGrads, FuseLossGrad)}


def default_pipeline() -> PassManager:
    """The inference pipeline, top to bottom."""
    return PassManager([
        EvalMode(),            # dropout is the identity at inference
        Canonicalize(),        # bias adds, folded constants, single reshapes
        CommonSubexprElimination(),  # e.g. one self-loop graph and norm for all GCN layers
        FuseAggregate(),       # gather -> edge-wise -> scatter becomes sparse aggregation
        FuseAttention(),       # GAT: scores, softmax and aggregation in one op
        ReorderLinear(),       # aggregate on the narrower side of each weight matrix
        DeadCodeElimination(), # drop what fusion left behind
        HoistGraphStatic(),    # degrees and norms: once per bound graph
        FuseEpilogues(),       # bias, activations, elementwise chains: into their producer
    ])


def training_pipeline() -> PassManager:
    """Forward + loss + backward, top to bottom."""
    return PassManager([
        AddLoss(),             # masked cross-entropy of the logits
        Canonicalize(),
        CommonSubexprElimination(),
        FuseAggregate(),       # before autodiff: the backward of a fused aggregation is fused
        FuseAttention(),       # ... and GAT's attention gets its fused backward
        ReorderLinear(),       # ... and the backward of a narrower aggregation is narrower
        Autodiff(),            # reverse mode: outputs become [loss, gradients]
        ElideBroadcasts(),     # a sum's gradient read broadcast, not copied
        SplitConcatProducts(), # a GRU's gate gradients read as parts, not concatenated
        Rematerialize(),       # cheap elementwise values recomputed, not kept for backward
        PackReluMasks(),       # --prefer memory: a ReLU's gradient reads its signs, 32 a word
        DeadCodeElimination(),
        HoistGraphStatic(),    # degrees and norms of both directions: once per bound graph
        FuseBiasGrads(),       # a bias's column sums in its weight gradient's kernel
        FuseEpilogues(),
        FuseLossGrad(),        # the loss and its gradient: one pass over the logits
    ])


__all__ = ["PASSES", "default_pipeline", "training_pipeline", "Instrument", "Pass",
           "PassContext", "PassError", "PassManager", "AddLoss", "Autodiff", "Canonicalize",
           "CommonSubexprElimination", "DeadCodeElimination", "ElideBroadcasts", "EvalMode",
           "FuseAggregate", "FuseAttention", "FuseBiasGrads", "FuseEpilogues", "FuseLossGrad",
           "HoistGraphStatic", "PackReluMasks", "Rematerialize", "ReorderLinear",
           "SplitConcatProducts"]
