"""The Graph IR: types, ops, the graph container, printer, parser, verifier, interpreter."""

from gcomp.ir.graph import Graph, Node
from gcomp.ir.interpreter import RefGraph, interpret
from gcomp.ir.ops import OPS, Op, OpGroup
from gcomp.ir.parser import parse_graph
from gcomp.ir.printer import print_graph
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType
from gcomp.ir.verifier import verify

__all__ = ["Graph", "Node", "Op", "OpGroup", "OPS", "TensorType", "GraphType", "EdgeDim", "N",
           "parse_graph", "print_graph", "verify", "interpret", "RefGraph"]
