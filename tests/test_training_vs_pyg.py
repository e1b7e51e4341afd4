"""Training parity with PyG: parameter gradients and 20 Adam steps from the same weights."""

import numpy as np
import pytest
from conftest import awkward_graph, rel_err

import gcomp.models as models
from gcomp.codegen.optimizer import OptimizerConfig
from gcomp.compiler import compile_model
from gcomp.runtime.data import load_graph
from gcomp.runtime.trainer import Trainer

torch = pytest.importorskip("torch", reason="PyG comparison needs torch ([bench] extra)")
pytest.importorskip("torch_geometric", reason="PyG comparison needs torch-geometric ([bench] extra)")
from pyg_ref import gcomp_named_tensors, pyg_model  # noqa: E402

F = torch.nn.functional


def _setup(name, g, C, seed, **kw):
    m = models.build(name, g.num_features, out_channels=C, seed=seed, **kw)
    rng = np.random.default_rng(seed)
    for k, v in m.params.items():  # nonzero biases and eps
        m.params[k] = (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
    net = pyg_model(m).float()
    return m, net


def _pyg_loss(net, g, mask):
    x = torch.tensor(g.dense_x())
    out = net(x, torch.tensor(g.edge_index))
    y = torch.tensor(g.y)
    return F.cross_entropy(out[mask], y[mask])


GRAPHS = {
    "cora": lambda: load_graph("cora"),
    "awkward": lambda: _labelled(awkward_graph(num_nodes=120, num_edges=800, num_features=10,
                                               seed=4)),
}


def _labelled(g):
    rng = np.random.default_rng(0)
    g.y = rng.integers(0, 4, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < 0.5
    g.val_mask = g.test_mask = ~g.train_mask
    return g


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_parameter_gradients_equal_pyg(name, graph):
    g = GRAPHS[graph]()
    C = int(g.y.max()) + 1
    m, net = _setup(name, g, C, 0, hidden=16, layers=2, heads=4)
    tr = Trainer(compile_model(m, train=True), g)
    loss = tr.step()
    ref_loss = _pyg_loss(net, g, torch.tensor(tr.train_mask))
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    grads = tr.gradients()
    for pname, (tensor, to_gcomp) in gcomp_named_tensors(net, m).items():
        ref = to_gcomp(tensor.grad.detach().numpy())
        assert rel_err(grads[pname], ref) <= 1e-4, (pname, rel_err(grads[pname], ref))


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_twenty_adam_steps_follow_pyg(name):
    g = load_graph("cora")
    m, net = _setup(name, g, 7, 1, hidden=16, layers=2, heads=4)
    tr = Trainer(compile_model(m, train=True, optimizer=OptimizerConfig(lr=0.01,
                                                                        weight_decay=5e-4)), g)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=5e-4)
    mask = torch.tensor(tr.train_mask)
    for step in range(20):
        opt.zero_grad()
        ref = _pyg_loss(net, g, mask)
        ref.backward()
        opt.step()
        ours = tr.step()
        assert abs(ours - ref.item()) <= 1e-3, (step, ours, ref.item())
