"""gcomp: an optimizing compiler for graph neural networks on Apache TVM."""

__version__ = "0.1.0"
