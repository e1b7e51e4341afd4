"""The node order chosen when a graph is bound (``runtime/reorder.py``): the CPU's cache
rule and the GPU's block rule, against degrees and gather distances computed here."""

from __future__ import annotations

import numpy as np

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
