"""A bound step's kernel launches captured once as a CUDA graph and replayed by one call.

Expects: a GPU executor's bound steps, each ``fn(*args)`` a TVM kernel whose arguments
are tensors that stay where they are for the binding's life (feeds copy into them,
optimizer state and parameters are updated in place), and the CUDA runtime library that
TVM's CUDA plugin loaded (``libcudart``).
Guarantees: ``launch()`` runs the same kernels on the same tensors in the same order as
calling them one by one, with one ``cudaGraphLaunch`` on the default stream: host
copies (feeds, the step counters, reading the loss) and ``Device.sync`` order with it as
with the kernels they replace.

Why: a step launches each kernel from Python through TVM's function call, one host
round of argument packing and a driver launch per kernel (a 3-layer GCN training step has
26).  On an H200 the replay saved 0-9% of an epoch (arxiv- and pubmed-size graphs,
`bench/results/h200/graphs-20261126.md`): the launches were mostly hidden behind the
kernels, so it is opt-in.  Capture runs on a stream of its own (CUDA cannot capture the
default stream), in relaxed mode, after one eager run, so TVM's workspace pool already
holds every kernel's scratch and the captured pointers stay valid (the pool keeps what it
allocated).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import tvm_ffi

from gcomp.errors import GcompError

CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed
_LIBS = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def cudart(names=_LIBS):
    """The CUDA runtime library (the one TVM's CUDA plugin loaded, by name)."""
    for name in filter(None, [*names, ctypes.util.find_library("cudart")]):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        return lib
    raise GcompError("CUDA graphs need the CUDA runtime library (libcudart), which was not "
                     "found; run without them (Executor.cuda_graphs = False)")


class CudaGraph:
    """The launches of ``steps`` ((fn, args) pairs) captured on ``device``."""

    def __init__(self, device, steps, lib=None):
        self.lib = lib if lib is not None else cudart()
        self.key = key_of(steps)
        self._steps = list(steps)  # keeps the argument tuples (and their ids) alive
        self._graph, self._exec = ctypes.c_void_p(), ctypes.c_void_p()
        stream = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreate(ctypes.byref(stream)), "cudaStreamCreate")
        try:
            with tvm_ffi.use_raw_stream(device, stream.value or 0):
                self._check(self.lib.cudaStreamBeginCapture(stream, CAPTURE_RELAXED),
                            "cudaStreamBeginCapture")
                try:
                    for fn, args in steps:
                        fn(*args)
                finally:  # a failed launch must still end the capture
                    end = self.lib.cudaStreamEndCapture(stream, ctypes.byref(self._graph))
            self._check(end, "cudaStreamEndCapture")
            self._check(self.lib.cudaGraphInstantiate(ctypes.byref(self._exec), self._graph,
                                                      ctypes.c_ulonglong(0)),
                        "cudaGraphInstantiate")
        except BaseException:
            self.close()  # what the capture made so far
            raise
        finally:
            self.lib.cudaStreamDestroy(stream)

    def launch(self) -> None:
        self._check(self.lib.cudaGraphLaunch(self._exec, None), "cudaGraphLaunch")

    def close(self) -> None:
        if self._exec:
            self.lib.cudaGraphExecDestroy(self._exec)
            self._exec = ctypes.c_void_p()
        if self._graph:
            self.lib.cudaGraphDestroy(self._graph)
            self._graph = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have unloaded the library
            pass

    def _check(self, err: int, what: str) -> None:
        if err:
            msg = self.lib.cudaGetErrorString(err)
            raise GcompError(f"{what} failed: CUDA error {err} "
                             f"({msg.decode() if msg else 'unknown'})")


def key_of(steps) -> tuple:
    """What a captured graph depends on: the functions and their argument tuples (a
    binding whose steps were rebuilt or re-pointed needs a new capture)."""
    return tuple((id(fn), id(args)) for fn, args in steps)
