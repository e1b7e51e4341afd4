"""The reference interpreter runs the bundled models exactly as PyG does (float64)."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err

import gcomp.models as models
from gcomp.ir import interpret
from gcomp.runtime.data import load_graph

torch = pytest.importorskip("torch", reason="PyG comparison needs torch ([bench] extra)")
pytest.importorskip("torch_geometric", reason="PyG comparison needs torch-geometric ([bench] extra)")
from pyg_ref import pyg_model  # noqa: E402


def perturbed(name, F, seed, **kw):
    """Bundled model with every parameter nonzero (zero-initialized biases hide mistakes)."""
    m = models.build(name, F, seed=seed, **kw)
    rng = np.random.default_rng(seed + 100)
    for k, v in m.params.items():
        m.params[k] = (v + 0.3 * rng.standard_normal(v.shape)).astype(np.float32)
    return m


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_pyg_on_awkward_graphs(name, seed):
    g = awkward_graph(num_nodes=70, num_edges=350, num_features=7, seed=seed)
    m = perturbed(name, 7, seed, hidden=6, out_channels=4, layers=3, heads=3)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    out = pyg_model(m)(torch.tensor(g.x, dtype=torch.float64), torch.tensor(g.edge_index))
    assert rel_err(ref, out.detach().numpy()) < 1e-10


def test_weighted_gcn_matches_pyg():
    g = awkward_graph(num_nodes=50, num_edges=250, num_features=5, edge_weight=True)
    m = perturbed("gcn", 5, 0, hidden=4, out_channels=3, layers=2, edge_weight=True)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    out = pyg_model(m)(torch.tensor(g.x, dtype=torch.float64), torch.tensor(g.edge_index),
                       torch.tensor(g.edge_weight, dtype=torch.float64))
    assert rel_err(ref, out.detach().numpy()) < 1e-10


@pytest.mark.parametrize("name", ["gcn", "gat"])
def test_matches_pyg_on_cora(name):
    g = load_graph("cora")
    m = perturbed(name, g.num_features, 0, hidden=8, out_channels=7, layers=2, heads=2)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    out = pyg_model(m)(torch.tensor(g.dense_x(), dtype=torch.float64), torch.tensor(g.edge_index))
    assert rel_err(ref, out.detach().numpy()) < 1e-10
