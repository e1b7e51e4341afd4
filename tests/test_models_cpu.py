"""Every bundled model compiled for llvm equals the float64 reference interpreter."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err

import gcomp.models as models
from gcomp.compiler import compile_model
from gcomp.ir import interpret
from gcomp.runtime.data import load_graph
from gcomp.runtime.synthetic import synthetic_graph

MODELS = ["gcn", "sage", "gin", "gat"]


def check(model, graph, tol=1e-4):
    art = compile_model(model)
    out = art.run(graph)[0]
    ref = interpret(model.graph, ref_inputs(model.graph, graph), model.params)[0]
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    return art


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_awkward_graphs(name, seed):
    g = awkward_graph(num_nodes=80, num_edges=500, num_features=12, seed=seed)
    m = models.build(name, 12, hidden=8, out_channels=5, layers=3, heads=3, seed=seed)
    check(m, g)


@pytest.mark.parametrize("heads,hidden", [(3, 8), (2, 20), (1, 5)])
def test_gat_attention_is_one_kernel_and_equals_the_unfused_model(heads, hidden):
    """The fused attention (scores, softmax, weighted sum per destination) equals the
    interpreter and the unfused kernels, isolated nodes (no in-edges) included."""
    from gcomp.passes import PassContext
    g = awkward_graph(num_nodes=90, num_edges=450, num_features=7, seed=heads)
    m = models.build("gat", 7, hidden=hidden, out_channels=4, layers=2, heads=heads, seed=1)
    art = check(m, g)
    kernels = [s["kernel"] for s in art.plan.steps]
    assert sum(k.startswith("gc_attention_agg") for k in kernels) == 2, kernels
    assert not any(k.startswith(("gc_edge_softmax", "gc_take_rows")) for k in kernels), kernels
    unfused = compile_model(m, ctx=PassContext(disabled=frozenset({"fuse_attention"})))
    assert any(s["kernel"].startswith("gc_edge_softmax") for s in unfused.plan.steps)
    assert rel_err(art.run(g)[0], unfused.run(g)[0]) <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_power_law_graph(name):
    g = synthetic_graph(3000, 30000, 20, 4, seed=3)
    m = models.build(name, 20, hidden=32, out_channels=4, layers=2, heads=2)
    check(m, g)


@pytest.mark.parametrize("dataset", ["cora", "citeseer"])
@pytest.mark.parametrize("name", MODELS)
def test_planetoid(name, dataset):
    g = load_graph(dataset)
    m = models.build(name, g.num_features, hidden=16, out_channels=int(g.y.max()) + 1, layers=2,
                     heads=4)
    check(m, g)


def test_gcn_edge_weights_with_existing_self_loops():
    g = awkward_graph(num_nodes=50, num_edges=200, num_features=6, edge_weight=True)
    m = models.build("gcn", 6, hidden=8, out_channels=3, layers=2, edge_weight=True)
    check(m, g)


@pytest.mark.parametrize("name", MODELS)
def test_graph_without_edges(name):
    g = awkward_graph(num_nodes=10, num_edges=20, num_features=4)
    g.edge_index = np.zeros((2, 0), np.int64)
    m = models.build(name, 4, hidden=4, out_channels=2, layers=2, heads=2)
    check(m, g)


def test_one_artifact_serves_graphs_of_any_size():
    m = models.build("gcn", 8, hidden=8, out_channels=3, layers=2)
    art = compile_model(m)
    for n, e in [(5, 3), (200, 1500), (1000, 50)]:
        g = synthetic_graph(n, e, 8, 3, seed=n)
        ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
        assert rel_err(art.run(g)[0], ref) <= 1e-4


def test_rebinding_after_another_graph_gives_fresh_results():
    m = models.build("sage", 8, hidden=8, out_channels=3, layers=2)
    art = compile_model(m)
    g1, g2 = synthetic_graph(100, 400, 8, 3, seed=1), synthetic_graph(150, 900, 8, 3, seed=2)
    y1 = art.run(g1)[0]
    art.run(g2)
    assert np.array_equal(art.run(g1)[0], y1)
