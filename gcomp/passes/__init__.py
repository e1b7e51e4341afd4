"""Passes over the Graph IR, one per file, and the default pipelines."""

from gcomp.passes.canonicalize import Canonicalize
from gcomp.passes.dce import DeadCodeElimination
from gcomp.passes.fuse_aggregate import FuseAggregate
from gcomp.passes.hoist_graph_static import HoistGraphStatic
from gcomp.passes.manager import Instrument, Pass, PassContext, PassError, PassManager


def default_pipeline() -> PassManager:
    """The inference pipeline, top to bottom."""
    return PassManager([
        Canonicalize(),        # bias adds, folded constants, single reshapes
        FuseAggregate(),       # gather -> edge-wise -> scatter becomes sparse aggregation
        DeadCodeElimination(), # drop what fusion left behind
        HoistGraphStatic(),    # degrees and norms: once per bound graph
    ])


__all__ = ["Pass", "PassContext", "PassManager", "PassError", "Instrument", "default_pipeline",
           "Canonicalize", "FuseAggregate", "DeadCodeElimination", "HoistGraphStatic"]
