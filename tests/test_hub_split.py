"""The GPU's hub-row split of aggregations: the task arrays, the split kernel definition
(compiled for the CPU without a schedule, checked against scipy in float64), the plan
rewrite, and the CUDA thread layouts' exact splits."""

import numpy as np
import pytest
import scipy.sparse as sp
import tvm

from gcomp.codegen.kernels import KernelSpec, define
from gcomp.runtime.graph import GraphStructure, hub_split
from gcomp.runtime.synthetic import power_law_edges


def test_tasks_cover_exactly_the_long_rows():
    rng = np.random.default_rng(0)
    g = GraphStructure.from_edge_index(power_law_edges(300, 4000, rng), 300)
    tasks, rows = hub_split(g.indptr, size=16)
    deg = np.diff(g.indptr)
    assert rows.shape == (301,) and (deg > 16).any()
    for i in range(300):
        mine = tasks[rows[i]:rows[i + 1]]
        if deg[i] <= 16:
            assert len(mine) == 0
            continue
        assert mine[0, 0] == g.indptr[i] and mine[-1, 1] == g.indptr[i + 1]
        assert (mine[1:, 0] == mine[:-1, 1]).all()  # contiguous, in edge order
        assert ((mine[:, 1] - mine[:, 0]) <= 16).all() and ((mine[:, 1] > mine[:, 0])).all()
        assert (mine[:, 2] == i).all()  # the row each piece belongs to
    # no long row: one empty task, so the task nest still launches a block
    t, r = hub_split(np.array([0, 1, 3], np.int64), size=16)
    assert t.tolist() == [[0, 0, 0]] and r.tolist() == [0, 0, 0]


def _run_split_agg(reduce, weight, indirect, size=8, seed=0, F=6, emulated=False):
    """The split kernel's output and its float64 reference; ``emulated``: the kernel as
    ``-t cuda`` schedules it, run by the CUDA emulator (else its definition on the CPU)."""
    rng = np.random.default_rng(seed)
    n = 120
    ei = power_law_edges(n, 1500, rng)
    g = GraphStructure.from_edge_index(ei, n)
    x = rng.standard_normal((n, F)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, (g.num_edges, 1)).astype(np.float32)
    if indirect:  # over out-edges: CSC slots, edge values read in CSR order through eid
        indptr, indices, seg = g.csc_indptr, g.csc_indices, g.csc_indptr
    else:
        indptr, indices, seg = g.indptr, g.indices, g.indptr
    tasks, rows = hub_split(seg, size=size)
    assert len(tasks) > 1
    spec = KernelSpec.make("csr_agg", reduce=reduce, H=1, C=F, weight=weight,
                           indirect=indirect, split=True)
    args = [indptr, indices]
    if indirect and weight != "none":
        args.append(g.csc_eid)
    if weight != "none":
        args.append(w)
    args += [x, tasks, rows]
    if emulated:
        from gcomp.debug.cuda_emulator import EmulatedLibrary
        out = np.full((n, F), np.nan, np.float32)
        EmulatedLibrary({"k": spec})["k"](*[np.ascontiguousarray(a) for a in args], out)
    else:
        fn = tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
        out = tvm.runtime.tensor(np.zeros((n, F), np.float32))
        fn(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args], out)
        out = out.numpy()
    # reference: float64, from the edge list
    src, dst = (g.rows, g.indices) if indirect else (g.indices, g.rows)
    vals = w[:, 0].astype(np.float64) if weight != "none" else np.ones(g.num_edges)
    if indirect:
        vals = vals[g.csc_eid]
        src, dst = g.csc_indices, np.repeat(np.arange(n), np.diff(g.csc_indptr))
    else:
        dst = np.repeat(np.arange(n), np.diff(g.indptr))
    if reduce == "max":
        ref = np.full((n, F), -np.inf)
        np.maximum.at(ref, dst, vals[:, None] * x[src].astype(np.float64))
        ref[np.isinf(ref)] = 0.0
    else:
        a = sp.csr_matrix((vals, (dst, src)), shape=(n, n))
        ref = a @ x.astype(np.float64)
        if reduce == "mean":
            ref /= np.maximum(np.bincount(dst, minlength=n), 1)[:, None]
    return out, ref


SPLIT_CASES = [("sum", "none", False), ("sum", "edge", False), ("mean", "none", False),
               ("max", "none", False), ("sum", "edge", True)]


@pytest.mark.parametrize("reduce,weight,indirect", SPLIT_CASES)
def test_split_kernel_matches_scipy(reduce, weight, indirect):
    out, ref = _run_split_agg(reduce, weight, indirect)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("F", [6, 128])
@pytest.mark.parametrize("reduce,weight,indirect", SPLIT_CASES)
def test_scheduled_split_kernel_matches_scipy(reduce, weight, indirect, F):
    """The split kernel as ``-t cuda`` schedules it, in the CUDA emulator: a lane per
    feature at 6 features, a float4 of features per lane at 128 (``agg_vector``)."""
    from gcomp.schedules.cuda import agg_vector
    spec = KernelSpec.make("csr_agg", reduce=reduce, H=1, C=F, weight=weight,
                           indirect=indirect, split=True)
    assert agg_vector(spec) == (4 if F == 128 else 1)
    out, ref = _run_split_agg(reduce, weight, indirect, F=F, emulated=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_cuda_plans_call_the_split_kernel():
    import gcomp.models as models
    from gcomp.codegen.hub_split import split_hub_rows
    from gcomp.codegen.lower import lower
    from gcomp.passes import training_pipeline
    m = models.build("sage", 8, hidden=8, out_channels=3, layers=2)
    plan, specs = lower(training_pipeline()(m.graph.copy()), ())
    before = [(s["kernel"], len(s["args"]), s["args"][-1]) for s in plan.steps]
    split_hub_rows([plan], specs)
    aggs = [s for s in plan.steps if specs[s["kernel"]].kind == "csr_agg"]
    over_graph = [s for s in aggs if "graph" in s["args"][0]]
    assert over_graph and all(bool(specs[s["kernel"]].p.get("split")) == ("graph" in s["args"][0])
                              for s in aggs)  # not those over sparse node features
    for s, (_, nargs, out) in zip(plan.steps, before):
        if s in over_graph:  # two graph arrays before the output, which stays last
            assert len(s["args"]) == nargs + 2 and s["args"][-1] == out
            pre = "csc_" if s["args"][0]["array"].startswith("csc_") else ""
            assert [a["array"] for a in s["args"][-3:-1]] == [pre + "hub_tasks", pre + "hub_rows"]


@pytest.mark.parametrize("width", [1, 3, 7, 32, 48, 200, 256, 257, 602, 1312, 4096])
def test_cuda_thread_splits_divide(width):
    from gcomp.schedules.cuda import THREADS, lanes_for
    lanes = lanes_for(width)
    assert width % lanes == 0 and 1 <= lanes <= THREADS
    assert lanes == width or width > THREADS
