"""gcomp: an optimizing compiler for graph neural networks on Apache TVM."""

from gcomp.runtime import threads as _threads

__version__ = "0.1.0"

_threads.configure()  # before TVM's thread pool starts: it reads the count once
