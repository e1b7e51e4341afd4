"""Dense and banded adjacency formats: kernels against numpy, models in each format against
the float64 interpreter, and the cost model that chooses between them and CSR."""

import json
import re
from collections import defaultdict

import numpy as np
import pytest
import tvm
from conftest import ref_inputs, rel_err
from test_training import compiled_vs_interpreted, labelled

import gcomp.models as models
from gcomp.cli import main
from gcomp.codegen.build import build_library, make_target
from gcomp.codegen.kernels import KernelSpec
from gcomp.compiler import compile_model
from gcomp.errors import InputError
from gcomp.ir import interpret
from gcomp.runtime import formats as fmts
from gcomp.runtime.data import GraphData
from gcomp.runtime.executor import decide_layout
from gcomp.runtime.trainer import Trainer

MODELS = ["gcn", "sage", "gin", "gat"]


def band_graph(n=200, edges=1500, reach=12, features=12, shuffle=True, seed=0) -> GraphData:
    """Edges join nodes at most ``reach`` apart (a band), numbered at random when
    ``shuffle`` (reverse Cuthill-McKee recovers a band), with weights and self loops."""
    rng = np.random.default_rng(seed)
    dst = rng.integers(0, n, edges)
    src = np.clip(dst + rng.integers(-reach, reach + 1, edges), 0, n - 1)
    ids = rng.permutation(n) if shuffle else np.arange(n)
    return GraphData("band", n, ids[np.stack([src, dst])],
                     rng.standard_normal((n, features)).astype(np.float32),
                     rng.uniform(0.1, 2.0, edges).astype(np.float32), None)


def dense_graph(n=96, copies=2, features=12, seed=0) -> GraphData:
    """Every ordered pair of nodes joined ``copies`` times: density ``copies``."""
    rng = np.random.default_rng(seed)
    src, dst = np.meshgrid(np.arange(n), np.arange(n))
    ei = np.tile(np.stack([src.ravel(), dst.ravel()]), copies)
    return GraphData("complete", n, ei, rng.standard_normal((n, features)).astype(np.float32),
                     None, None)


# ------------------------------------------------------------------ kernels
@pytest.fixture(scope="module")
def kernels():
    specs = {}
    for fmt in ("dense", "banded"):
        for weight in ("none", "edge"):
            specs[("pack", fmt, weight)] = KernelSpec.make("format_pack", fmt=fmt,
                                                           weight=weight)
        for F in (7, 45):
            for reduce, tr in (("sum", False), ("sum", True), ("mean", False)):
                specs[(fmt, F, reduce, tr)] = KernelSpec.make(
                    "format_agg", fmt=fmt, reduce=reduce, F=F, transpose=tr)
        specs[(fmt, "epilogue")] = KernelSpec.make(
            "format_agg", fmt=fmt, reduce="sum", F=7, transpose=False,
            epilogue=(("add", (), 0, False), ("relu", (), None, False)), extras=("vec",))
    for F in (7, 45):  # ELL: A.T is a layout of its own, one kernel serves both
        for reduce in ("sum", "mean"):
            specs[("ell", F, reduce)] = KernelSpec.make("format_agg", fmt="ell", reduce=reduce,
                                                        F=F, transpose=False)
    specs[("ell", "epilogue")] = KernelSpec.make(
        "format_agg", fmt="ell", reduce="mean", F=7, transpose=False,
        epilogue=(("add", (), 0, False), ("relu", (), None, False)), extras=("vec",))
    lib = tvm.runtime.load_module(str(build_library({s.name: s for s in specs.values()},
                                                    make_target("llvm"))))
    return {k: lib[s.name] for k, s in specs.items()}


@pytest.mark.parametrize("fmt,block", [("dense", 0), ("banded", 8), ("banded", 32),
                                       ("banded", 40)])
@pytest.mark.parametrize("n", [1, 31, 77, 200])
@pytest.mark.parametrize("F", [7, 45])
def test_format_kernels_equal_numpy(kernels, fmt, block, n, F):
    """Sums over in-edges and out-edges (transpose) and means, weighted or not, with
    duplicate edges, rows without edges and a last block shorter than the others; the
    banded kernels take any block size that is a multiple of 8 (from the layout)."""
    rng = np.random.default_rng(n + F)
    E = 6 * n
    dst = np.sort(rng.integers(0, n, E))
    dst[: E // 10] = dst[0]  # one busy row, and some rows left without edges
    reach = block or n
    src = np.clip(dst + rng.integers(-reach, reach + 1, E), 0, n - 1)
    order = np.argsort(dst, kind="stable")
    dst, src = dst[order], src[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))]).astype(np.int64)
    w = rng.uniform(-1, 1, (E, 1)).astype(np.float32)
    x = rng.standard_normal((n, F)).astype(np.float32)
    t = tvm.runtime.tensor
    assert fmt == "dense" or fmts.band_block(np.stack([src, dst])) <= block
    layout = tvm.runtime.empty(fmts.layout_shape(fmt, n, block), "float32")
    for weight in ("none", "edge"):
        a = np.zeros((n, n))
        np.add.at(a, (dst, src), 1.0 if weight == "none" else w[:, 0].astype(np.float64))
        kernels[("pack", fmt, weight)](t(indptr), t(src.astype(np.int32)),
                                       *([t(w)] if weight == "edge" else []), layout)
        deg = np.maximum(np.diff(indptr), 1)[:, None]
        for reduce, tr, want in (("sum", False, a @ x), ("sum", True, a.T @ x),
                                 ("mean", False, a @ x / deg)):
            out = tvm.runtime.empty((n, F), "float32")
            kernels[(fmt, F, reduce, tr)](layout, t(indptr), t(x), out)
            assert rel_err(out.numpy(), want) <= 1e-5, (weight, reduce, tr)


@pytest.mark.parametrize("fmt", ["dense", "banded"])
def test_format_kernels_apply_the_epilogue(kernels, fmt):
    n, F = 40, 7
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, n, (2, 200))
    src = np.clip(dst + (src % 9) - 4, 0, n - 1)
    order = np.argsort(dst, kind="stable")
    dst, src = dst[order], src[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))]).astype(np.int64)
    x = rng.standard_normal((n, F)).astype(np.float32)
    bias = rng.standard_normal(F).astype(np.float32)
    t = tvm.runtime.tensor
    layout = tvm.runtime.empty(fmts.layout_shape(fmt, n, fmts.band_block(np.stack([src, dst]))),
                               "float32")
    kernels[("pack", fmt, "none")](t(indptr), t(src.astype(np.int32)), layout)
    out = tvm.runtime.empty((n, F), "float32")
    kernels[(fmt, "epilogue")](layout, t(indptr), t(x), t(bias), out)
    a = np.zeros((n, n))
    np.add.at(a, (dst, src), 1.0)
    assert rel_err(out.numpy(), np.maximum(a @ x + bias, 0)) <= 1e-5


def _csr(dst, src, n):
    order = np.argsort(dst, kind="stable")
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))]).astype(np.int64)
    return indptr, src[order].astype(np.int32), order


def test_ell_layout_pads_each_row_to_a_power_of_two():
    """Buckets by degree (0: no edges; k: degree in (2^(k-2), 2^(k-1)]), every position in
    exactly one work unit, padding with value 0 repeating a real neighbour."""
    rng = np.random.default_rng(3)
    n = 300
    deg = rng.integers(0, 12, n)
    deg[7], deg[8], deg[9] = 33, 64, 1000  # widths 64, 64 and 1024
    dst = np.repeat(np.arange(n), deg)
    src = rng.integers(0, n, dst.size)
    indptr, indices, _ = _csr(dst, src, n)
    w = rng.uniform(0.5, 1.5, dst.size).astype(np.float32)
    work, perm, cols, vals = fmts.pack_ell(indptr, indices, w, parts=16)
    want_width = np.where(deg > 0, 2 ** np.ceil(np.log2(np.maximum(deg, 1))), 0).astype(int)
    assert cols.size == want_width.sum() == fmts.ell_slots(indptr)
    assert sorted(perm) == list(range(n))
    covered = np.concatenate([np.arange(p0, p1) for _, p0, p1, _ in work])
    assert np.array_equal(np.sort(covered), np.arange(n))
    for k, p0, p1, s0 in work:
        W = 0 if k == 0 else 1 << (k - 1)
        for r, p in enumerate(range(p0, p1)):
            i = perm[p]
            assert want_width[i] == W
            got_c, got_v = cols[s0 + r * W: s0 + (r + 1) * W], vals[s0 + r * W: s0 + (r + 1) * W]
            lo, hi = indptr[i], indptr[i + 1]
            assert np.array_equal(got_c[:hi - lo], indices[lo:hi])
            assert np.array_equal(got_v[:hi - lo], w[lo:hi])
            assert (got_v[hi - lo:] == 0).all() and set(got_c[hi - lo:]) <= set(indices[lo:hi])


@pytest.mark.parametrize("n", [1, 50, 300])
@pytest.mark.parametrize("F", [7, 45])
def test_ell_kernel_equals_numpy(kernels, n, F):
    """Sums and means over in-edges and (from the CSC arrays) out-edges, weighted or not,
    with duplicate edges, rows without edges, and hub rows past the unrolled widths."""
    rng = np.random.default_rng(n + F)
    deg = rng.integers(0, 9, n)
    deg[: min(n, 3)] = [200, 40, 0][: min(n, 3)]
    dst = np.repeat(np.arange(n), deg)
    src = rng.integers(0, n, dst.size)
    src[: dst.size // 10] = 0  # duplicates, and a hub in the transposed graph
    w = rng.uniform(-1, 1, dst.size).astype(np.float32)
    x = rng.standard_normal((n, F)).astype(np.float32)
    t = tvm.runtime.tensor
    for weight in ("none", "edge"):
        we = w if weight == "edge" else None
        a = np.zeros((n, n))
        np.add.at(a, (dst, src), 1.0 if we is None else we.astype(np.float64))
        for reduce, transposed in (("sum", False), ("sum", True), ("mean", False)):
            rows, cols = (src, dst) if transposed else (dst, src)
            indptr, indices, order = _csr(rows, cols, n)
            layout = fmts.pack_ell(indptr, indices, None if we is None else we[order])
            want = (a.T if transposed else a) @ x
            if reduce == "mean":
                want = want / np.maximum(np.diff(indptr), 1)[:, None]
            out = tvm.runtime.empty((n, F), "float32")
            kernels[("ell", F, reduce)](*(t(v) for v in layout), t(indptr), t(x), out)
            assert rel_err(out.numpy(), want) <= 1e-5, (weight, reduce, transposed)


def test_ell_kernel_applies_the_epilogue(kernels):
    n, F = 60, 7
    rng = np.random.default_rng(4)
    dst, src = rng.integers(0, n, (2, 400))
    indptr, indices, _ = _csr(dst, src, n)
    x = rng.standard_normal((n, F)).astype(np.float32)
    bias = rng.standard_normal(F).astype(np.float32)
    t = tvm.runtime.tensor
    out = tvm.runtime.empty((n, F), "float32")
    kernels[("ell", "epilogue")](*(t(v) for v in fmts.pack_ell(indptr, indices, None)),
                                 t(indptr), t(x), t(bias), out)
    a = np.zeros((n, n))
    np.add.at(a, (dst, src), 1.0)
    mean = a @ x / np.maximum(a.sum(1), 1)[:, None]
    assert rel_err(out.numpy(), np.maximum(mean + bias, 0)) <= 1e-5


# ------------------------------------------------------------------ models
@pytest.mark.parametrize("fmt", ["dense", "banded", "ell"])
@pytest.mark.parametrize("name", MODELS)
def test_models_in_each_format_equal_the_interpreter(name, fmt):
    g = band_graph()
    m = models.build(name, 12, hidden=8, out_channels=5, layers=3, heads=3, seed=0,
                     edge_weight=name == "gcn")
    ex = compile_model(m).executor()
    ex.formats = fmt
    if name == "gat":  # attention aggregates in one fused CSR kernel: nothing to force
        with pytest.raises(InputError, match=f"format '{fmt}': no aggregation of this "
                                             "artifact has kernels for it"):
            ex.run(g)
        ex.formats = "auto"
    out = ex.run(g)[0]
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert rel_err(out, ref) <= 1e-4
    chosen = {k: v["chosen"] for k, v in ex._binding.formats.items()}
    if name == "gat":
        assert not chosen
        return
    assert chosen and set(chosen.values()) == {fmt}
    if fmt == "banded":  # the shuffled band only fits after reverse Cuthill-McKee
        assert ex._binding.reorder["chosen"] == "rcm"


@pytest.mark.parametrize("fmt", ["dense", "banded", "ell"])
@pytest.mark.parametrize("name", MODELS)
def test_training_in_each_format_equals_the_interpreter(name, fmt):
    """Forward and backward (aggregation over out-edges) share one packed layout (ELL:
    A and A.T have one each).  GAT's attention and its backward, with attention dropout
    or without, are fused CSR kernels with no format to choose: forcing one is refused."""
    g = labelled(band_graph(features=6, seed=2), 3)
    g.edge_weight = None
    for dropout in ([0.0, 0.3] if name == "gat" else [0.0]):
        m = models.build(name, 6, hidden=8, out_channels=3, layers=3, heads=2, seed=1,
                         dropout=dropout)
        if name == "gat":
            with pytest.raises(InputError, match=f"format '{fmt}': no aggregation"):
                compiled_vs_interpreted(m, g, 3, seed=2, formats=fmt)
        tr = compiled_vs_interpreted(m, g, 3, seed=2,
                                     formats="auto" if name == "gat" else fmt)
        chosen = set(tr._binding.formats[k]["chosen"] for k in tr._binding.formats)
        assert chosen == (set() if name == "gat" else {fmt})


def _scored(F: int):
    """Edge weights computed on every step that no fusion absorbs (a softmax over each
    destination of its sources' scores), in a one-layer model."""
    from gcomp.frontend.builder import GraphInput, Module, NodeInput, Parameter, trace

    class Scored(Module):
        def __init__(self):
            self.w = Parameter((F, 8), "glorot")
            self.out = Parameter((8, 3), "glorot")

        def forward(self, x, edge_index):
            h = x @ self.w
            a = edge_index.edge_softmax(edge_index.gather(h.sum(-1), "src"))
            return edge_index.aggregate(h, "sum", weight=a) @ self.out
    return trace(Scored(), {"x": NodeInput(F), "edge_index": GraphInput()}, seed=1)


@pytest.mark.parametrize("fmt", ["dense", "banded", "ell"])
def test_weights_computed_every_step_in_each_format(fmt):
    """Dense and banded layouts of such weights are packed by a step on every run; ELL,
    packed once per graph, refuses them by name."""
    g = labelled(band_graph(features=6, seed=2), 3)
    g.edge_weight = None
    m = _scored(6)
    if fmt == "ell":
        with pytest.raises(InputError, match="cannot run as ell: its edge weights change "
                                             "every run"):
            Trainer(compile_model(m, train=True), g, formats="ell")
        return
    tr = compiled_vs_interpreted(m, g, 3, seed=2, formats=fmt)
    assert set(tr._binding.formats[k]["chosen"] for k in tr._binding.formats) == {fmt}
    assert any(s["op"] == "format_pack" for s in tr._binding.plan_steps)


def test_graph_without_edges_in_each_format():
    g = band_graph(n=40, edges=10)
    g.edge_index = np.zeros((2, 0), np.int64)
    g.edge_weight = None
    m = models.build("sage", 12, hidden=4, out_channels=2, layers=2)
    ex = compile_model(m).executor()
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    for fmt in ("dense", "banded", "ell"):
        ex.formats, ex._binding = fmt, None
        assert rel_err(ex.run(g)[0], ref) <= 1e-5


# ------------------------------------------------------------------ cost model
def test_measured_costs_choose_dense_for_a_doubly_complete_graph():
    g = dense_graph()
    m = models.build("gin", 12, hidden=16, out_channels=3, layers=2)
    art = compile_model(m)
    out = art.run(g)[0]
    report = art.executor()._binding.formats
    assert [f["chosen"] for f in report.values()] == ["dense"], report
    memory = art.executor()._binding.memory  # the n x n layout counts in the planned memory
    assert memory["layout_bytes"] == 96 * 96 * 4
    assert memory["total_bytes"] >= memory["layout_bytes"] + memory["planned_bytes"]
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert rel_err(out, ref) <= 1e-4


def _plan_with_costs(csr, dense, banded, pack_entry=0.0):
    plan = compile_model(models.build("gin", 12, hidden=16, out_channels=3, layers=2)).plan
    unit = {"csr_edge_ns": csr, "csr_row_ns": 0.0, "ell_slot_ns": 100.0, "ell_row_ns": 0.0,
            "dense_entry_ns": dense, "banded_entry_ns": banded,
            "pack_dense_entry_ns": pack_entry, "pack_banded_entry_ns": pack_entry,
            "pack_dense_edge_ns": 0.0, "pack_banded_edge_ns": 0.0}
    plan.formats = {"costs": {w: dict(unit) for w in plan.formats["costs"]}}
    return plan


def test_band_block_is_the_bandwidth_rounded_up_to_eight():
    assert fmts.band_block(np.array([[0, 5, 9], [3, 5, 1]])) == 8
    assert fmts.band_block(np.array([[0, 17], [17, 0]])) == 24
    assert fmts.band_block(np.zeros((2, 0), np.int64)) == 8
    rng = np.random.default_rng(0)
    for _ in range(20):  # every edge within one block of the other end
        ei = rng.integers(0, 500, (2, 300))
        B = fmts.band_block(ei)
        assert np.abs(ei[0] // B - ei[1] // B).max() <= 1
    # a star's centre has 40 neighbours: no order gives a bandwidth under 20
    star = np.stack([np.zeros(40, np.int64), np.arange(1, 41)])
    assert fmts.narrowest_block(star, 41) == 24
    both_ways = np.concatenate([star, star[::-1], star], axis=1)  # the same 40 neighbours
    assert fmts.narrowest_block(both_ways, 41) == 24


def test_cost_model_picks_the_cheapest_feasible_format():
    g = band_graph(n=256, edges=4000, reach=12, shuffle=False)
    steps = len(fmts.format_steps(_plan_with_costs(1, 1, 1)).popitem()[1])
    E, n = 4000, 256
    # csr: E x 1; dense: n^2 x 0.1; banded: ceil(n / B) x 3B^2 x 0.1
    lay = decide_layout(_plan_with_costs(1.0, 0.1, 0.1), g)
    (entry,) = lay.formats.values()
    B = entry["block"]
    assert B == 16  # reach 12
    assert entry["cost_ms"]["csr"] == pytest.approx(steps * E * 1e-6)
    assert entry["cost_ms"]["dense"] == pytest.approx(steps * n * n * 0.1e-6)
    assert entry["cost_ms"]["banded"] == pytest.approx(steps * n * 3 * B * 0.1e-6)
    assert entry["chosen"] == "banded" and lay.reorder["chosen"] == "given"
    assert list(decide_layout(_plan_with_costs(1.0, 0.01, 1.0), g).chosen.values()) == ["dense"]
    assert list(decide_layout(_plan_with_costs(0.1, 1.0, 1.0), g).chosen.values()) == ["csr"]


def test_cost_model_weighs_ell_slots_and_rows():
    """ELL costs slots (degrees rounded up to powers of two) x c_slot + rows x c_row, and
    must beat CSR by the margin and by ELL_MIN_GAIN_MS per run to be chosen."""
    g = band_graph(n=256, edges=4000, reach=12, shuffle=False)
    plan = _plan_with_costs(100.0, 1000.0, 1000.0)  # per run: tenths of a millisecond
    steps = fmts.format_steps(plan).popitem()[1]
    for c in plan.formats["costs"].values():
        c.update(ell_slot_ns=30.0, ell_row_ns=200.0)
    (entry,) = decide_layout(plan, g).formats.values()
    slots = entry["ell_slots"]
    assert set(slots) == {"forward"}  # inference: no aggregation over A.T
    lay = decide_layout(plan, g)
    csr_edges = lay.structures["edge_index"].num_edges
    assert slots["forward"] == fmts.ell_slots(lay.structures["edge_index"].indptr) > csr_edges
    assert entry["cost_ms"]["ell"] == pytest.approx(
        len(steps) * (slots["forward"] * 30.0 + 256 * 200.0) * 1e-6)
    assert entry["chosen"] == "ell"
    for c in plan.formats["costs"].values():  # predicted 5% faster: within the margin
        c.update(ell_slot_ns=95.0 * csr_edges / slots["forward"], ell_row_ns=0.0)
    assert list(decide_layout(plan, g).chosen.values()) == ["csr"]
    for c in plan.formats["costs"].values():  # 70% faster, but by less than 0.1 ms a run
        c.update(csr_edge_ns=1.0, ell_slot_ns=0.3 * csr_edges / slots["forward"])
    assert list(decide_layout(plan, g).chosen.values()) == ["csr"]


def test_costs_measured_on_a_busy_machine_keep_csr():
    """Where the format costs were measured while other processes held the machine (one
    such fit priced CSR's rows 360x too high and Cora ran dense), auto stays in CSR even
    against a format predicted far faster, and says why; an explicit format still runs."""
    from gcomp.runtime.formats import BUSY_KEY
    g = band_graph(n=256, edges=4000, reach=12)
    plan = _plan_with_costs(1.0, 10.0, 0.1)  # banded predicted far faster
    assert decide_layout(plan, g).reorder["chosen"] == "rcm"
    assert list(decide_layout(plan, g).chosen.values()) == ["banded"]
    for c in plan.formats["costs"].values():
        c[BUSY_KEY] = 1.0
    lay = decide_layout(plan, g)
    (entry,) = lay.formats.values()
    assert entry["chosen"] == "csr" and "busy" in entry["csr_because"]
    assert set(entry["cost_ms"]) >= {"csr", "banded"}  # still predicted, for explain
    assert lay.reorder["chosen"] != "rcm"  # nor reordered for a band it will not use
    assert list(decide_layout(plan, g, formats="banded").chosen.values()) == ["banded"]


def test_reverse_cuthill_mckee_is_tried_only_when_the_band_would_pay():
    g = band_graph(n=256, edges=4000, reach=12)  # shuffled: a wide band in the given order
    cheap_band = decide_layout(_plan_with_costs(1.0, 10.0, 0.1), g)
    assert cheap_band.reorder["chosen"] == "rcm"
    assert list(cheap_band.chosen.values()) == ["banded"]
    assert cheap_band.block < fmts.band_block(g.edge_index)
    assert fmts.band_block(cheap_band.graph.edge_index) == cheap_band.block
    dear_band = decide_layout(_plan_with_costs(1.0, 10.0, 10.0), g)
    assert dear_band.reorder["chosen"] == "given"
    assert list(dear_band.chosen.values()) == ["csr"]
    (entry,) = dear_band.formats.values()
    assert entry["banded_narrowest_ms"] > entry["cost_ms"]["csr"]


def test_weights_computed_every_run_add_the_packing_cost():
    g = band_graph(n=256, edges=4000, shuffle=False)
    plan = compile_model(_scored(12), train=True).train_plan
    unit = {"csr_edge_ns": 1.0, "csr_row_ns": 0.0, "ell_slot_ns": 100.0, "ell_row_ns": 0.0,
            "dense_entry_ns": 0.1, "banded_entry_ns": 0.1,
            "pack_dense_entry_ns": 1.0, "pack_banded_entry_ns": 1.0,
            "pack_dense_edge_ns": 0.0, "pack_banded_edge_ns": 0.0}
    plan.formats = {"costs": {w: dict(unit) for w in plan.formats["costs"]}}
    (entry,) = decide_layout(plan, g).formats.values()
    B = entry["block"]
    steps = fmts.format_steps(plan).popitem()[1]
    weights = {s["formats"]["weights"]["buf"] for s in steps}
    assert len(weights) == 1 and len(steps) == 2  # the weights, forward and backward
    # one pack of n x 3B entries per run for each weights buffer, shared by its steps
    assert entry["cost_ms"]["banded"] == pytest.approx(
        (len(steps) * 0.1 + len(weights) * 1.0) * 256 * 3 * B * 1e-6)
    assert entry["cost_ms"]["banded"] > len(steps) * 0.1 * 256 * 3 * B * 1e-6


def test_formats_that_cannot_hold_the_graph_are_refused_by_name():
    m = models.build("gcn", 12, hidden=8, out_channels=3, layers=2)
    ex = compile_model(m).executor()
    ex.formats, ex.reorder = "banded", "none"  # RCM would narrow this band
    wide = band_graph(n=100_000, edges=100, reach=100_000, shuffle=False)
    with pytest.raises(InputError, match="cannot run as banded: a band of .*-row blocks "
                                         "exceeds 1024 MiB"):
        ex.run(wide)
    ex.formats, ex._binding = "dense", None
    big = band_graph(n=9000, edges=100)
    with pytest.raises(InputError, match="cannot run as dense: a dense matrix of 9000"):
        ex.run(big)
    csr_only = compile_model(m, formats=()).executor()
    assert not any("formats" in s for s in csr_only.plan.steps)
    csr_only.formats = "dense"  # no kernels for it: refused, not run in CSR unasked
    with pytest.raises(InputError, match="format 'dense': no aggregation of this artifact "
                                         "has kernels for it"):
        csr_only.run(band_graph())
    csr_only.formats = "csr"
    assert csr_only.run(band_graph())[0].shape == (200, 3)


def test_forced_csr_is_reported_and_gat_refuses_other_formats(tmp_path, capsys):
    """``--format csr`` names the graph values it put in CSR (it reported none); GAT's
    fused attention has one layout, so a forced dense format is an error, not a silent
    CSR run."""
    g = band_graph(n=60, edges=300, features=8)
    g.y = np.arange(60) % 3
    gpath = tmp_path / "band.npz"
    np.savez(gpath, edge_index=g.edge_index, x=g.x, y=g.y)
    args = ["--graph", str(gpath), "--epochs", "1", "--hidden", "8", "--json"]
    assert main(["train", "gcn", *args, "--format", "csr"]) == 0
    assert json.loads(capsys.readouterr().out)["formats"] == {"convs.0.graph": "csr"}
    assert main(["train", "gat", *args, "--format", "dense"]) == 2
    assert "format 'dense': no aggregation of this artifact has kernels for it" in \
        capsys.readouterr().err
    assert main(["train", "gat", *args, "--format", "csr"]) == 0


def test_explain_counts_as_isolated_only_nodes_without_any_edge(capsys):
    from gcomp.debug.explain import graph_stats
    from gcomp.runtime.data import GraphData
    # 0 -> 1, 2 -> 2; node 3 only sends (3 -> 1), node 4 has no edge
    g = GraphData("five", 5, np.array([[0, 2, 3], [1, 2, 1]]))
    assert graph_stats(g)["in_degree"]["isolated"] == 1


def test_cli_run_and_train_take_a_format(tmp_path, capsys):
    g = band_graph(n=120, edges=900, features=8)
    g.y = np.arange(120) % 3
    gpath = tmp_path / "band.npz"
    np.savez(gpath, edge_index=g.edge_index, x=g.x, y=g.y)
    art = tmp_path / "sage.gcomp"
    assert main(["compile", "sage", "--in", "8", "--hidden", "8", "--out", "3",
                 "-o", str(art)]) == 0
    outs = {}
    for fmt in ("csr", "banded"):
        assert main(["run", str(art), "--graph", str(gpath), "--format", fmt,
                     "--out", str(tmp_path / f"{fmt}.npy")]) == 0
        outs[fmt] = np.load(tmp_path / f"{fmt}.npy")
    assert rel_err(outs["banded"], outs["csr"]) <= 1e-5
    capsys.readouterr()
    assert main(["train", "gcn", "--graph", str(gpath), "--epochs", "2", "--hidden", "8",
                 "--format", "dense", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["formats"].values()) == {"dense"}


def test_explain_shows_the_format_costs(capsys):
    assert main(["explain", "gin", "--in", "1433", "--graph", "cora"]) == 0
    text = capsys.readouterr().out
    assert "adjacency format costs measured on the target" in text
    assert "format of edge_index (2 aggregations; band blocks of " in text
    # Cora is small: CSR or ELL by the costs measured on this machine, dense and banded far off
    assert re.search(r"\): (csr|ell) \(predicted per run: csr [\d.]+ ms, dense [\d.]+ ms, "
                     r"banded [\d.]+ ms, ell [\d.]+ ms; ELL slots forward 13,523", text), text
    assert re.search(r"16 features: csr [\d.]+ ns/edge \+ [\d.]+ ns/row, ell [\d.]+ ns/slot",
                     text)


def test_a_sparse_threshold_timed_under_load_falls_back_to_morphlings(tmp_path, monkeypatch):
    """Timings taken while other processes held the machine (one put Cora's 98.7% zeros on
    the dense kernels) give way to Morphling's 0.80, and say so; a quiet measurement
    stands."""
    from gcomp.codegen import calibrate
    from gcomp.codegen.build import make_target
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_measure_sparse", lambda *a: (1.0, [{"sparsity": 0.99}]))
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(1.0))
    threshold, table = calibrate.calibrate_sparse_threshold(16, 8, make_target("llvm"))
    assert threshold == calibrate.SPARSE_DEFAULT == 0.8
    assert "measured while the machine was busy (measured threshold 1.0)" in table[-1]["note"]
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(0.0))
    assert calibrate.calibrate_sparse_threshold(16, 8, make_target("llvm"))[0] == 1.0


def test_explain_says_when_the_format_costs_were_measured_busy(capsys, tmp_path,
                                                                 monkeypatch):
    from gcomp.codegen import calibrate
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))  # nothing measured quietly before
    monkeypatch.setattr(calibrate, "_FORMAT_COSTS", {})
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(1.0))
    assert main(["explain", "gin", "--in", "1433", "--graph", "cora"]) == 0
    text = capsys.readouterr().out
    assert "adjacency format costs measured on the target (while the machine was busy)" in text
    assert re.search(r"\): csr \(predicted per run: .*; csr since the format costs were "
                     r"measured while other processes kept the machine busy", text), text


# ------------------------------------------------------------------ specialization
def test_compile_for_a_graph_keeps_only_the_kernels_it_runs(tmp_path):
    """``gcomp compile --graph``: the decisions the runtime would make for the graph are
    made at compile time and the variants they rule out are not compiled; the artifact
    still runs any graph (CSR and dense-feature kernels stay)."""
    from gcomp.runtime.data import load_graph
    from gcomp.runtime.synthetic import synthetic_graph
    m = models.build("gcn", 1433, hidden=16, out_channels=7, layers=2)
    cora = load_graph("cora")
    generic = compile_model(m, train=True)
    special = compile_model(m, train=True, graph=cora)
    rec = special.plan.specialized
    assert rec["graph"] == "cora" and list(rec["formats"]) == ["convs.0.graph"]
    assert rec["sparse_features"] == {"sparse:x": True}  # Cora: 98.7% zeros
    for plan in (special.plan, special.train_plan):
        # small and sparse: CSR or ELL by this machine's costs, never dense or banded
        chosen = plan.specialized["formats"]["convs.0.graph"]
        assert chosen in ("csr", "ell")
        kept = [s["formats"] for s in plan.steps if "formats" in s]
        assert all(list(f["kernels"]) == [chosen] for f in kept)
        assert bool(kept) == (chosen == "ell")
    assert len(special.kernels()) < len(generic.kernels())
    for art in (generic, special):  # same decisions when bound, same results
        tr = Trainer(art, labelled(cora, 7), seed=0)
        assert tr._binding.variants == {"sparse:x"}
        assert tr.eval_ex.bind(cora).variants == {"sparse:x"}
    assert special.train_plan.specialized["sparse_features"] == {"sparse:x": True}
    ref = interpret(m.graph, ref_inputs(m.graph, cora), m.params)[0]
    assert rel_err(special.run(cora)[0], ref) <= 1e-4
    dense_x = synthetic_graph(300, 2000, 1433, 7, seed=1)  # another graph: dense features
    ref = interpret(m.graph, ref_inputs(m.graph, dense_x), m.params)[0]
    assert rel_err(special.run(dense_x)[0], ref) <= 1e-4
    # for a graph of dense features, the sparse-feature kernels are left out
    other = compile_model(m, graph=dense_x)
    assert other.plan.specialized["sparse_features"] == {"sparse:x": False}
    assert not other.plan.variants and not any("when" in s for s in other.plan.steps)
    assert rel_err(other.run(cora)[0], interpret(m.graph, ref_inputs(m.graph, cora),
                                                 m.params)[0]) <= 1e-4


def test_compile_for_a_dense_graph_keeps_the_dense_kernels(tmp_path):
    g = dense_graph()
    gpath = tmp_path / "complete.npz"
    np.savez(gpath, edge_index=g.edge_index, x=g.x)
    art = tmp_path / "gin.gcomp"
    assert main(["compile", "gin", "--in", "12", "--hidden", "16", "--out", "3",
                 "--graph", str(gpath), "-o", str(art)]) == 0
    from gcomp.runtime.artifact import load
    a = load(art)
    assert a.info()["specialized"]["formats"] == {"edge_index": "dense"}
    steps = [s for s in a.plan.steps if "formats" in s]
    assert steps and all(list(s["formats"]["kernels"]) == ["dense"] for s in steps)
    m = models.build("gin", 12, hidden=16, out_channels=3, layers=2)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    out = a.run(g)[0]
    assert rel_err(out, ref) <= 1e-4
    assert [f["chosen"] for f in a.executor()._binding.formats.values()] == ["dense"]


class _Load:
    """Stands in for ``CpuMonitor``: other processes keep ``cores`` busy."""

    def __init__(self, cores):
        self._cores = cores

    def cores(self):
        return self._cores


@pytest.mark.parametrize("loads,measured,kept", [([2.0, 0.1], 2, True), ([2.0, 2.0], 2, False),
                                                 ([None], 1, True)])
def test_calibration_under_load_is_taken_again_and_not_kept(tmp_path, monkeypatch, loads,
                                                             measured, kept):
    """Busy during the measurement: measured once more; busy again: used, not stored (the
    next compile measures anew).  No /proc/stat (None): kept."""
    from gcomp.codegen import calibrate
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))
    seq = iter(loads)
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(next(seq)))
    calls = []

    def measure():
        calls.append(1)
        return {"csr_edge_ns": float(len(calls))}
    assert calibrate._cached("formats", tmp_path / "0123abcd.so", [32], measure) == (
        {"csr_edge_ns": float(measured)}, kept)
    assert len(calls) == measured
    assert bool(list((tmp_path / "calibration").glob("*.json"))) == kept


def test_format_costs_taken_under_load_serve_one_compile(tmp_path, monkeypatch):
    """Costs measured on a busy machine are not held for the process either: the next
    compile measures again, and a quiet measurement is then reused."""
    from gcomp.codegen import build, calibrate
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_FORMAT_COSTS", {})
    monkeypatch.setattr(build, "build_library", lambda specs, target: tmp_path / "0123abcd.so")
    monkeypatch.setattr(tvm.runtime, "load_module", lambda path: defaultdict(object))
    loads = iter([1.0, 1.0, 0.0])  # busy twice (first compile), then quiet
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(next(loads)))
    calls = []

    def measure(fn, F, *args):
        calls.append(F)
        return {"csr_edge_ns": float(len(calls))}
    monkeypatch.setattr(calibrate, "_measure_formats", measure)
    target = {"kind": "llvm"}
    assert calibrate.calibrate_formats([32], target) == {
        "32": {"csr_edge_ns": 2.0, fmts.BUSY_KEY: 1.0}}
    assert calibrate.calibrate_formats([32], target) == {"32": {"csr_edge_ns": 3.0}}
    assert calibrate.calibrate_formats([32], target) == {"32": {"csr_edge_ns": 3.0}}
    assert calls == [32, 32, 32]


def test_calibration_is_kept_on_disk(tmp_path, monkeypatch):
    """Measurements are reused for the same kernel library, parameters and machine, and
    taken again for other kernels or parameters, or when the stored entry is damaged."""
    from gcomp.codegen import calibrate
    monkeypatch.setenv("GCOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "CpuMonitor", lambda: _Load(0.0))  # a quiet machine
    calls = []

    def measure():
        calls.append(1)
        return {"csr_edge_ns": 1.5 * len(calls)}
    lib = tmp_path / "0123abcd.so"
    assert calibrate._cached("formats", lib, [32], measure) == ({"csr_edge_ns": 1.5}, True)
    assert calibrate._cached("formats", lib, [32], measure) == ({"csr_edge_ns": 1.5}, True)
    assert len(calls) == 1
    calibrate._cached("formats", tmp_path / "4567ef.so", [32], measure)  # changed kernels
    calibrate._cached("formats", lib, [64], measure)  # another width
    assert len(calls) == 3
    for f in (tmp_path / "calibration").glob("*.json"):
        f.write_text("{damaged")
    assert calibrate._cached("formats", lib, [32], measure) == ({"csr_edge_ns": 6.0}, True)
