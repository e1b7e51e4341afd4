"""CUDA graph replay of a bound step (``runtime/cuda_graph.py``) without a GPU: the capture
and launch sequence against a recording stand-in for the CUDA runtime, and the executor's
choice of when to capture, launch or capture again.  ``tests/gpu`` and ``bench.gpu
--cuda-graphs`` run the real thing on a GPU."""

import numpy as np
import pytest
import tvm
import tvm_ffi

from gcomp.errors import GcompError
from gcomp.runtime import cuda_graph, executor as executor_mod
from gcomp.runtime.cuda_graph import CudaGraph


class FakeCudart:
    """Records the runtime calls; ``fail``: the call that returns an error."""

    STREAM, GRAPH, EXEC = 0x51, 0x52, 0x53

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def _rec(self, name, *args):
        self.calls.append((name,) + args)
        return 700 if name == self.fail else 0

    def cudaStreamCreate(self, ref):
        ref._obj.value = self.STREAM
        return self._rec("cudaStreamCreate")

    def cudaStreamBeginCapture(self, stream, mode):
        return self._rec("cudaStreamBeginCapture", stream.value, mode)

    def cudaStreamEndCapture(self, stream, ref):
        ref._obj.value = self.GRAPH
        return self._rec("cudaStreamEndCapture", stream.value)

    def cudaGraphInstantiate(self, ref, graph, flags):
        ref._obj.value = self.EXEC
        return self._rec("cudaGraphInstantiate", graph.value)

    def cudaGraphLaunch(self, exec_, stream):
        return self._rec("cudaGraphLaunch", exec_.value, stream)

    def cudaStreamDestroy(self, stream):
        return self._rec("cudaStreamDestroy", stream.value)

    def cudaGraphExecDestroy(self, exec_):
        return self._rec("cudaGraphExecDestroy", exec_.value)

    def cudaGraphDestroy(self, graph):
        return self._rec("cudaGraphDestroy", graph.value)

    def cudaGetErrorString(self, err):
        return b"an error"

    def names(self):
        return [c[0] for c in self.calls]


def _steps(seen, dev):
    def kernel(tag):
        return lambda *args: seen.append((tag, tvm_ffi.get_raw_stream(dev), args))
    return [(kernel("a"), (1, 2)), (kernel("b"), (3,))]


def test_capture_runs_the_kernels_on_its_own_stream_and_launch_replays():
    dev, lib, seen = tvm.cpu(), FakeCudart(), []
    g = CudaGraph(dev, _steps(seen, dev), lib=lib)
    # each kernel launched once, in order, on the capture stream, with its arguments
    assert seen == [("a", FakeCudart.STREAM, (1, 2)), ("b", FakeCudart.STREAM, (3,))]
    assert tvm_ffi.get_raw_stream(dev) != FakeCudart.STREAM  # the stream is restored
    assert lib.names() == ["cudaStreamCreate", "cudaStreamBeginCapture",
                           "cudaStreamEndCapture", "cudaGraphInstantiate", "cudaStreamDestroy"]
    assert lib.calls[1][2] == cuda_graph.CAPTURE_RELAXED
    assert lib.calls[3][1] == FakeCudart.GRAPH
    g.launch()
    g.launch()
    assert len(seen) == 2  # a replay calls no kernel from the host
    # the default stream, so host copies and Device.sync order with the replay
    assert lib.calls[-1] == ("cudaGraphLaunch", FakeCudart.EXEC, None)
    g.close()
    assert lib.names()[-2:] == ["cudaGraphExecDestroy", "cudaGraphDestroy"]
    g.close()  # closing twice destroys nothing twice
    assert lib.names().count("cudaGraphDestroy") == 1


def test_a_failed_call_names_it_and_ends_the_capture():
    dev = tvm.cpu()
    with pytest.raises(GcompError, match="cudaGraphInstantiate failed: CUDA error 700"):
        CudaGraph(dev, _steps([], dev), lib=FakeCudart(fail="cudaGraphInstantiate"))

    def broken(*args):
        raise RuntimeError("launch failed")
    lib = FakeCudart()
    with pytest.raises(RuntimeError, match="launch failed"):
        CudaGraph(dev, [(broken, ())], lib=lib)
    # the capture ended, the partial graph released
    assert lib.names() == ["cudaStreamCreate", "cudaStreamBeginCapture",
                           "cudaStreamEndCapture", "cudaGraphDestroy", "cudaStreamDestroy"]


def test_missing_runtime_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_graph.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(GcompError, match="libcudart"):
        cuda_graph.cudart(names=("libcudart-that-does-not-exist.so",))


class RecordingGraph:
    made: list = []

    def __init__(self, device, steps):
        self.key, self.launches, self.closed = cuda_graph.key_of(steps), 0, False
        RecordingGraph.made.append(self)

    def launch(self):
        self.launches += 1

    def close(self):
        self.closed = True


def test_executor_runs_eagerly_once_then_captures_and_replays(monkeypatch):
    from gcomp.compiler import compile_model
    from gcomp.models import build
    from gcomp.runtime.synthetic import synthetic_graph
    g = synthetic_graph(40, 160, 8, 3, seed=0)
    ex = compile_model(build("gcn", 8, hidden=8, out_channels=3, layers=2, seed=0)).executor()
    b = ex.feed(ex.bind(g), {"x": g.x})
    monkeypatch.setattr(executor_mod, "CudaGraph", RecordingGraph)
    RecordingGraph.made = []
    ex.cuda_graphs, ex.on_cpu = True, False  # a GPU executor's path, on CPU kernels
    ex.execute(b)  # eager: the kernels run and fill the output
    assert RecordingGraph.made == []
    eager = ex.outputs(b)[0]
    assert np.isfinite(eager).all()
    ex.execute(b)
    ex.execute(b)
    assert len(RecordingGraph.made) == 1 and RecordingGraph.made[0].launches == 2
    fn, args = b.steps[0]
    b.steps[0] = (fn, tuple([*args]))  # the steps re-pointed: the graph is stale
    ex.execute(b)
    assert len(RecordingGraph.made) == 2 and RecordingGraph.made[0].closed
    assert RecordingGraph.made[1].launches == 1
    ex.cuda_graphs = False
    ex.execute(b)  # off: eager again
    assert RecordingGraph.made[1].launches == 1
