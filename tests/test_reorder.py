"""The node order chosen when a graph is bound (``runtime/reorder.py``): the CPU's cache
rule and the GPU's block rule, against degrees and gather distances computed here."""

from __future__ import annotations

import numpy as np
import pytest

import gcomp.models as models
from gcomp.cli import main
from gcomp.compiler import compile_model
from gcomp.runtime.data import GraphData, load_graph
from gcomp.runtime.executor import decide_layout
from gcomp.runtime.reorder import SKEW_CV, choose_order


def _graph(edge_index: np.ndarray, n: int) -> GraphData:
    return GraphData("g", n, edge_index.astype(np.int64), None, None, None, None, None, None)


def _cv(g: GraphData) -> float:
    deg = np.bincount(g.edge_index.ravel(), minlength=g.num_nodes).astype(np.float64)
    return deg.std() / deg.mean()


def test_gpu_orders_a_skewed_graph_by_degree():
    g = load_graph("pubmed-synth")
    assert _cv(g) >= SKEW_CV
    order, report = choose_order(g, 512, gpu=True)
    assert report["chosen"] == "degree" and "cache_bytes" not in report
    deg = np.bincount(g.edge_index.ravel(), minlength=g.num_nodes)
    assert np.all(np.diff(deg[order]) <= 0)  # the longest rows first
    assert np.isclose(report["degree_cv"], _cv(g))
    # the CPU keeps the given order: degree order does not halve the gather distance there
    assert choose_order(g, 512)[1]["chosen"] == "given"


def test_gpu_keeps_the_order_of_alike_degrees():
    g = load_graph("cora")
    assert _cv(g) < SKEW_CV
    order, report = choose_order(g, 512, gpu=True)
    assert order is None and report["chosen"] == "given" and "alike" in report["reason"]


def test_gpu_keeps_a_given_order_with_locality():
    """Skewed degrees, but every edge joins nearby rows: degree order would move the hubs
    away from their neighbours, so the given order stays."""
    n = 4000
    src = [np.arange(n - 1)]
    dst = [np.arange(1, n)]
    for hub in range(100, n, 400):  # hubs gather from a window around themselves
        window = np.arange(max(hub - 150, 0), min(hub + 150, n))
        src.append(window)
        dst.append(np.full(window.size, hub))
    g = _graph(np.stack([np.concatenate(src), np.concatenate(dst)]), n)
    assert _cv(g) >= SKEW_CV
    order, report = choose_order(g, 512, gpu=True)
    assert report["mean_distance"]["degree"] > report["mean_distance"]["given"]
    assert order is None and report["chosen"] == "given" and "spread" in report["reason"]


def test_explicit_orders_hold_on_a_gpu():
    g = load_graph("cora")
    assert choose_order(g, 512, "degree", gpu=True)[1]["chosen"] == "degree"
    assert choose_order(g, 512, "none", gpu=True)[0] is None


def test_cuda_plans_bind_skewed_graphs_in_degree_order(capsys):
    g = load_graph("pubmed-synth")
    art = compile_model(models.build("gcn", g.x.shape[1], hidden=16, out_channels=3), "cuda")
    gpu, cpu = decide_layout(art.plan, g, gpu=True), decide_layout(art.plan, g)
    assert gpu.reorder["chosen"] == "degree" and cpu.reorder["chosen"] == "given"
    # the bound graph is the relabelled one: row i holds the user's node order[i] (its
    # features are put in that order when fed, not copied here)
    np.testing.assert_array_equal(gpu.graph.y, g.y[gpu.order])
    assert gpu.graph.x is None
    assert main(["explain", "gcn", "--in", str(g.x.shape[1]), "-t", "cuda", "--graph",
                 "pubmed-synth"]) == 0
    out = capsys.readouterr().out
    assert "node order: degree (GPU, degrees' CV" in out


# ------------------------------------------------------------------ bind-time arithmetic
def test_stable_groups_is_numpys_stable_argsort():
    """The counting sort that builds CSR (and CSC) orders edges exactly as numpy's stable
    argsort of their keys does, with the group sizes bincount gives."""
    from gcomp.runtime.graph import GraphStructure, stable_groups
    rng = np.random.default_rng(0)
    for n, e in [(0, 0), (5, 0), (1, 7), (40, 1000), (1000, 300)]:
        for dtype in (np.int64, np.int32):
            keys = rng.integers(0, max(n, 1), e).astype(dtype) if n else np.zeros(0, dtype)
            indptr, order = stable_groups(keys, n)
            assert indptr.dtype == np.int64 and order.dtype == np.int64
            np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
            np.testing.assert_array_equal(np.diff(indptr), np.bincount(keys, minlength=n))
    ei = rng.integers(0, 50, (2, 600))
    st = GraphStructure.from_edge_index(ei, 50)
    ref = np.argsort(ei[1], kind="stable")
    np.testing.assert_array_equal(st.perm, ref)
    np.testing.assert_array_equal(st.indices, ei[0][ref])
    np.testing.assert_array_equal(st.csc_eid, np.argsort(st.indices, kind="stable"))
    np.testing.assert_array_equal(st.csc_indices, st.rows[st.csc_eid])


def test_gaps_summed_in_chunks_equal_the_whole_arrays(monkeypatch):
    """Mean gather distance and bandwidth, computed a chunk of edges at a time (and in an
    order given by positions), against float64 numpy on the whole arrays."""
    import gcomp.runtime.formats as fmts
    import gcomp.runtime.reorder as ro
    monkeypatch.setattr(ro, "GAP_CHUNK", 97)  # chunks that do not divide the edges
    rng = np.random.default_rng(1)
    ei = rng.integers(0, 3000, (2, 1000))
    pos = rng.permutation(3000)
    for position in (None, pos):
        s, d = ei if position is None else position[ei]
        gaps = np.abs(s.astype(np.float64) - d)
        assert ro.mean_distance(ei, position) == pytest.approx(gaps.mean(), rel=1e-12)
        assert fmts.band_block(ei, position) == fmts.band_block(np.stack([s, d]))
        assert fmts.band_block(ei, position) == -(-int(gaps.max()) // 8) * 8


def _long_edges_band(n=256, edges=4000, reach=12):
    """A band numbered in order but for a few edges across the whole graph: the given
    order has the smallest mean gather distance, and its band is as wide as the graph."""
    rng = np.random.default_rng(0)
    dst = rng.integers(0, n, edges)
    src = np.clip(dst + rng.integers(-reach, reach + 1, edges), 0, n - 1)
    src[:4], dst[:4] = [0, 1, n - 1, n - 2], [n - 1, n - 2, 0, 1]
    return GraphData("band", n, np.stack([src, dst]),
                     rng.standard_normal((n, 12)).astype(np.float32),
                     rng.uniform(0.1, 2.0, edges).astype(np.float32), None)


def test_rcm_for_the_band_is_computed_once_and_kept_only_where_the_band_fits(monkeypatch):
    """A graph whose feature rows miss the cache gets RCM from the node-order model; when
    the banded format would pay, the same order is tried for the band, not computed again.
    It is kept where it narrows the band enough for the banded format to fit, and the
    graph stays as given where it narrows the band but not enough (the structures are
    then built once, in the given order)."""
    import gcomp.runtime.executor as ex
    import gcomp.runtime.formats as fmts
    import gcomp.runtime.reorder as ro
    from tests.test_formats import _plan_with_costs
    calls, patterns = [], []

    def counted(*a):
        calls.append(a)
        return rcm(*a)

    def pattern(*a):
        patterns.append(a)
        return symmetric(*a)
    rcm, symmetric = ro.rcm_order, ro.symmetric_pattern
    monkeypatch.setattr(ro, "rcm_order", counted)
    monkeypatch.setattr(ex, "rcm_order", counted)
    for mod in (ro, fmts):
        monkeypatch.setattr(mod, "symmetric_pattern", pattern)
    monkeypatch.setattr(ro, "CACHE_BYTES", 0)  # the rows miss the cache: orders compared
    g = _long_edges_band()
    plan = _plan_with_costs(1.0, 10.0, 0.1)  # banded predicted far faster than CSR
    lay = decide_layout(plan, g)
    # one RCM and one symmetrized graph, for the order model, the band and the narrowest
    assert len(calls) == 1 and len(patterns) == 1
    assert lay.reorder["mean_distance"]["rcm"] > 0.5 * lay.reorder["mean_distance"]["given"]
    assert lay.reorder["chosen"] == "rcm" and "band" in lay.reorder["reason"]
    assert list(lay.chosen.values()) == ["banded"]
    assert lay.block < fmts.band_block(g.edge_index)
    # a banded layout that fits only in a band narrower than RCM's: the given order stays
    monkeypatch.setattr(fmts, "BAND_MAX_BYTES", g.num_nodes * 3 * (lay.block - 8) * 4)
    built = []
    structures = ex.structures_of
    monkeypatch.setattr(ex, "structures_of", lambda *a: built.append(a) or structures(*a))
    calls.clear()
    kept = decide_layout(plan, g)
    assert len(calls) == 1 and len(built) == 1
    assert kept.reorder["chosen"] == "given" and kept.order is None
    (entry,) = kept.formats.values()  # the band would pay in the narrowest band: RCM tried
    assert entry["banded_narrowest_ms"] < entry["cost_ms"]["csr"]
    # the narrowest band, from the shared pattern: half the most distinct neighbours
    # (either direction, self loops not counted) any node has, rounded up to 8
    near = [set() for _ in range(g.num_nodes)]
    for s, d in g.edge_index.T:
        if s != d:
            near[s].add(d)
            near[d].add(s)
    assert entry["narrowest_block"] == -(-((max(map(len, near)) + 1) // 2) // 8) * 8
    assert list(kept.chosen.values()) == ["csr"]
