"""The GPU's hub-row split of aggregations: the task arrays, the split kernel definition
(compiled for the CPU without a schedule, checked against scipy in float64), the plan
rewrite, and the CUDA thread layouts' exact splits."""

import numpy as np
import pytest
import scipy.sparse as sp
import tvm

from gcomp.codegen.kernels import KernelSpec, define
from gcomp.runtime.graph import (HUB_EDGES, MIN_TASKS, GraphStructure, hub_split,
                                 task_edges)
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


def _tasks(deg, size):
    return int(np.sum(-(-deg[deg > size] // size)))


@pytest.mark.parametrize("n,e", [(2000, 14_000), (2000, 1_000_000), (20_000, 2_000_000),
                                 (300, 150_000)])
def test_task_size_keeps_the_partials_within_the_output(n, e):
    # the smallest doubling of HUB_EDGES whose tasks are at most half the rows (or
    # MIN_TASKS), so the partial rows (t x F scratch) take at most half the output's
    # memory on a large graph: a sparse graph (arxiv-like, 7 edges a row) keeps
    # HUB_EDGES, a dense one (Reddit-like, 100 or 500 a row) gets longer tasks, a graph
    # of few rows keeps enough tasks to spread its hubs
    rng = np.random.default_rng(1)
    g = GraphStructure.from_edge_index(power_law_edges(n, e, rng), n)
    deg = np.diff(g.indptr)
    size = task_edges(g.indptr)
    allowed = max(n // 2, MIN_TASKS)
    assert size >= HUB_EDGES and (size & (size - 1)) == 0
    assert _tasks(deg, size) <= allowed
    assert size == HUB_EDGES or _tasks(deg, size // 2) > allowed
    if e / n < 10 or _tasks(deg, HUB_EDGES) <= MIN_TASKS:
        assert size == HUB_EDGES
    if e / n >= 100 and e / HUB_EDGES > 2 * MIN_TASKS:
        assert size > HUB_EDGES
    tasks, rows = g.hub_tasks, g.hub_rows  # what a bound graph hands the kernels
    assert len(tasks) <= allowed and (tasks[:, 1] - tasks[:, 0]).max() <= size
    assert rows[-1] == _tasks(deg, size) or (rows[-1] == 0 and len(tasks) == 1)


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


# over out-edges (True) the graph has a node without out-edges: an empty row
SPLIT_CASES = [("sum", "none", False), ("sum", "edge", False), ("mean", "none", False),
               ("max", "none", False), ("max", "none", True), ("sum", "edge", True)]


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


@pytest.mark.parametrize("reduce,weight,indirect", SPLIT_CASES)
@pytest.mark.parametrize("fewest", [None, "32"])
def test_32_feature_rows_match_scipy(reduce, weight, indirect, fewest, monkeypatch):
    """32-feature rows: by default 8 lanes of float4, four rows a warp, rows of unequal
    lengths side by side (64 features: two rows a warp); with
    ``GCOMP_CUDA_AGG_MIN_LANES=32`` a warp per row, a lane per feature (bench.gpu times
    it beside the default)."""
    from gcomp.schedules.cuda import AGG_MIN_LANES_ENV, agg_vector
    spec = KernelSpec.make("csr_agg", reduce=reduce, H=1, C=32, weight=weight,
                           indirect=indirect, split=True)
    if fewest:
        monkeypatch.setenv(AGG_MIN_LANES_ENV, fewest)
    assert agg_vector(spec) == (1 if fewest else 4)
    for C, vector in ((64, 4), (40, 1), (48, 1)):  # 16 lanes tile a warp; 10 and 12 do not
        wider = KernelSpec.make("csr_agg", reduce=reduce, H=1, C=C, weight=weight,
                                indirect=indirect, split=True)
        assert agg_vector(wider) == (1 if fewest else vector)
    for F in (32, 64) if not fewest else (32,):  # four rows a warp, two rows a warp
        out, ref = _run_split_agg(reduce, weight, indirect, F=F, emulated=True)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knob,value,F", [("GCOMP_CUDA_AGG_COLUMNS", "2", 128),
                                          ("GCOMP_CUDA_AGG_COLUMNS", "4", 128),
                                          ("GCOMP_CUDA_AGG_COLUMNS", "2", 64),
                                          ("GCOMP_CUDA_EDGE_GROUP", "4", 128),
                                          ("GCOMP_CUDA_EDGE_GROUP", "4", 32)])
def test_aggregation_knobs_match_scipy(knob, value, F, monkeypatch):
    """The tuning knobs of the aggregation: column tiles (``agg_columns``: 128 features
    in 2 tiles of 16 lanes or 4 of 8; 64 in 2 would leave 8 lanes, allowed; 32 in 2 would
    leave 4, refused) and 4 edges per step, in the CUDA emulator with hub tasks."""
    from gcomp.schedules.cuda import AGG_COLUMNS_ENV, agg_columns, agg_vector
    monkeypatch.setenv(knob, value)
    spec = KernelSpec.make("csr_agg", reduce="sum", H=1, C=F, weight="edge", split=True)
    if knob == AGG_COLUMNS_ENV:
        assert agg_columns(spec, agg_vector(spec)) == int(value)
        narrow = KernelSpec.make("csr_agg", reduce="sum", H=1, C=32, weight="edge", split=True)
        assert agg_columns(narrow, agg_vector(narrow)) == 1
    for reduce, weight, indirect in (("sum", "edge", False), ("max", "none", False),
                                     ("mean", "edge", True)):
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


@pytest.mark.parametrize("C", [64, 66])
def test_scheduled_split_kernel_with_heads(C):
    """Per-head edge weights over two heads: float4 lanes at 64 channels a head; at 66 a
    vector would straddle the heads, so a lane per feature."""
    from gcomp.debug.cuda_emulator import EmulatedLibrary
    from gcomp.schedules.cuda import agg_vector
    rng = np.random.default_rng(3)
    n, H = 120, 2
    g = GraphStructure.from_edge_index(power_law_edges(n, 1500, rng), n)
    x = rng.standard_normal((n, H * C)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, (g.num_edges, H)).astype(np.float32)
    tasks, rows = hub_split(g.indptr, size=8)
    spec = KernelSpec.make("csr_agg", reduce="sum", H=H, C=C, weight="head", split=True)
    assert agg_vector(spec) == (4 if C == 64 else 1) and len(tasks) > 1
    out = np.full((n, H * C), np.nan, np.float32)
    EmulatedLibrary({"k": spec})["k"](g.indptr, g.indices, w, x, tasks, rows, out)
    dst = np.repeat(np.arange(n), np.diff(g.indptr))
    ref = np.zeros((n, H, C))
    np.add.at(ref, dst, w.astype(np.float64)[:, :, None]
              * x[g.indices].astype(np.float64).reshape(-1, H, C))
    np.testing.assert_allclose(out, ref.reshape(n, H * C), rtol=1e-5, atol=1e-5)


EPILOGUES = [  # (epilogue chain, its extra inputs' kinds): activations whose selects and
    # fast exponentials the float4 lanes vectorize, and every kind of extra input
    ((("add", (), 0, False), ("leaky_relu", (("alpha", 0.2),), None, False)), ("vec",)),
    ((("add", (), ("mul", (), (0, 1)), False), ("elu", (("alpha", 1.0),), None, False)),
     ("scalar", "row")),
    ((("div", (), 0, False), ("sigmoid", (), None, False)), ("col",)),
]


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("epilogue,extras", EPILOGUES)
def test_scheduled_split_kernel_epilogues(reduce, epilogue, extras):
    """Float4 lanes with fused epilogues, over out-edges (a row without edges): the
    emulated CUDA kernel against its definition compiled for the CPU; and nvcc accepts
    the CUDA source (an empty row's constant 0 once reached it as a literal's address)."""
    from gcomp.codegen import cuda_build
    from gcomp.debug.cuda_emulator import EmulatedLibrary
    rng = np.random.default_rng(4)
    n, F = 120, 128
    g = GraphStructure.from_edge_index(power_law_edges(n, 1500, rng), n)
    tasks, rows = hub_split(g.csc_indptr, size=8)
    values = {"vec": rng.standard_normal(F), "row": rng.standard_normal((n, F)),
              "col": rng.uniform(0.5, 2.0, (n, 1)), "scalar": np.array(1.3)}
    args = [g.csc_indptr, g.csc_indices, g.csc_eid,
            rng.uniform(0.5, 2.0, (g.num_edges, 1)), rng.standard_normal((n, F))]
    args = [a.astype(np.float32) if a.dtype == np.float64 else a
            for a in args + [values[k] for k in extras] + [tasks, rows]]
    spec = KernelSpec.make("csr_agg", reduce=reduce, H=1, C=F, weight="edge", indirect=True,
                           epilogue=epilogue, extras=extras, split=True)
    out = np.full((n, F), np.nan, np.float32)
    EmulatedLibrary({"k": spec})["k"](*args, out)
    fn = tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
    ref = tvm.runtime.tensor(np.zeros((n, F), np.float32))
    fn(*[tvm.runtime.tensor(a) for a in args], ref)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=1e-6)
    try:
        cuda_build.find_nvcc()
    except Exception:  # noqa: BLE001 - no CUDA toolkit: the emulator's check stands alone
        return
    mod = cuda_build.schedule_module({"k": spec}, {"kind": "cuda", "arch": "sm_90"})
    lib = tvm.compile(mod, target=cuda_build.tvm_target({"kind": "cuda", "arch": "sm_90"}))
    src = lib.mod.imports[0].inspect_source()
    assert "*(float4*)(x_ptr" in src
    cuda_build.compile_device_code(src, "sm_90")
