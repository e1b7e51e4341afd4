"""The bundled GGNN equals PyG's GatedGraphConv + Linear with copied weights: forward
(compiled and interpreted) and training gradients, with and without zero padding; it
compiles for CUDA; wider inputs than hidden are refused as PyG refuses them."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err
from test_training import compiled_vs_interpreted, labelled

import gcomp.models as models
from gcomp.cli import main
from gcomp.compiler import compile_model
from gcomp.errors import CompileError, GcompError
from gcomp.frontend.builder import GraphInput, NodeInput, trace
from gcomp.ir import RefGraph, interpret, parse_graph, print_graph, verify
from gcomp.models.ggnn import GatedGraphConv
from gcomp.passes import default_pipeline, training_pipeline
from gcomp.runtime.data import GraphData, load_graph
from gcomp.runtime.trainer import Trainer

LAYERS, HIDDEN, CLASSES = 3, 16, 4
WIDTHS = {"padded": 5, "unpadded": HIDDEN}  # input channels


def _graph(kind: str, F: int) -> GraphData:
    """A labelled graph with F standard-normal features: a small awkward one (isolated
    nodes, self loops, duplicate edges) or Cora's edges and split."""
    if kind == "awkward":
        return labelled(awkward_graph(num_nodes=120, num_edges=800, num_features=F, seed=4),
                        CLASSES)
    cora = load_graph("cora")
    x = np.random.default_rng(F).standard_normal((cora.num_nodes, F)).astype(np.float32)
    g = GraphData("cora", cora.num_nodes, cora.edge_index, x, None, cora.y)
    g.train_mask, g.val_mask, g.test_mask = cora.train_mask, cora.val_mask, cora.test_mask
    return g


def _model(F: int, C: int = CLASSES, seed: int = 0, **kw):
    """A GGNN with every parameter perturbed (zero-initialized biases hide mistakes)."""
    m = models.build("ggnn", F, hidden=HIDDEN, out_channels=C, layers=LAYERS, seed=seed, **kw)
    rng = np.random.default_rng(seed + 100)
    for k, v in m.params.items():
        m.params[k] = (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
    return m


def _pyg(model):
    """PyG's GatedGraphConv and a torch Linear in float64 with the model's weights, and
    {gcomp parameter name: (torch parameter, map to gcomp's layout)}."""
    import torch
    from torch_geometric.nn import GatedGraphConv

    p = {k: torch.as_tensor(np.asarray(v, np.float64)) for k, v in model.params.items()}
    conv = GatedGraphConv(HIDDEN, LAYERS, aggr="add").double()
    lin = torch.nn.Linear(HIDDEN, p["lin.bias"].shape[0]).double()
    T = (lambda a: a.T)  # noqa: E731 - torch [out, in] -> gcomp [in, out]
    same = (lambda a: a)  # noqa: E731
    named = {"conv.weight": (conv.weight, same),
             "conv.rnn.weight_ih": (conv.rnn.weight_ih, T),
             "conv.rnn.weight_hh": (conv.rnn.weight_hh, T),
             "conv.rnn.bias_ih": (conv.rnn.bias_ih, same),
             "conv.rnn.bias_hh": (conv.rnn.bias_hh, same),
             "lin.weight": (lin.weight, T), "lin.bias": (lin.bias, same)}
    with torch.no_grad():
        for name, (tensor, to_gcomp) in named.items():
            tensor.copy_(to_gcomp(p[name]))  # both maps are their own inverse

    def forward(x, edge_index):
        return lin(conv(torch.as_tensor(np.asarray(x, np.float64)), torch.as_tensor(edge_index)))
    return forward, named


@pytest.fixture(scope="module")
def torch_geometric():
    pytest.importorskip("torch", reason="PyG comparison needs torch ([bench] extra)")
    return pytest.importorskip("torch_geometric",
                               reason="PyG comparison needs torch-geometric ([bench] extra)")


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("graph", ["awkward", "cora"])
def test_forward_equals_pyg(torch_geometric, graph, width):
    g = _graph(graph, WIDTHS[width])
    m = _model(WIDTHS[width])
    forward, _ = _pyg(m)
    ref = forward(g.x, g.edge_index).detach().numpy()
    interpreted = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert rel_err(interpreted, ref) < 1e-10
    out = compile_model(m).run(g)[0]
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)


@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("graph", ["awkward", "cora"])
def test_training_gradients_equal_torch_autograd(torch_geometric, graph, width):
    """One compiled training step (float32) and the interpreted training graph (float64)
    against torch's float64 autograd of the same masked cross-entropy."""
    import torch
    g = _graph(graph, WIDTHS[width])
    C = int(g.y.max()) + 1
    m = _model(WIDTHS[width], C)
    tr = Trainer(compile_model(m, train=True), g)
    loss = tr.step()
    forward, named = _pyg(m)
    mask = torch.as_tensor(tr.train_mask)
    ref = torch.nn.functional.cross_entropy(forward(g.x, g.edge_index)[mask],
                                            torch.as_tensor(g.y)[mask])
    ref.backward()
    tg = training_pipeline()(m.graph.copy())
    inputs = {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
              "labels": g.y, "train_mask": tr.train_mask.astype(np.float64)}
    outs = interpret(tg, {k: v for k, v in inputs.items() if tg.has(k)}, m.params)
    interpreted = dict(zip(tg.meta["grads"], outs[1:]))
    assert abs(outs[0] - ref.item()) <= 1e-12 * abs(ref.item())
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    grads = tr.gradients()
    for name, (tensor, to_gcomp) in named.items():
        want = to_gcomp(tensor.grad.numpy())
        assert rel_err(interpreted[name], want) < 1e-10, name
        assert rel_err(grads[name], want) <= 1e-4, (name, rel_err(grads[name], want))


@pytest.mark.parametrize("width", sorted(WIDTHS))
def test_compiled_training_with_dropout_equals_the_interpreter(width):
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=WIDTHS[width], seed=3),
                 3)
    compiled_vs_interpreted(_model(WIDTHS[width], 3, seed=1, dropout=0.3), g, 3, seed=2)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_compiles_for_cuda_with_every_kernel_scheduled(train, monkeypatch):
    """The padding, the gate slices and their gradients' concats get CUDA schedules (no
    GPU needed; running them is ``tests/gpu``'s business)."""
    from gcomp.codegen import cuda_build
    try:
        cuda_build.find_nvcc()
    except CompileError as e:
        pytest.skip(f"CUDA compilation needs nvcc: {e}")
    monkeypatch.setenv("GCOMP_CUDA_STRICT", "1")  # a kernel without its schedule fails
    m = _model(WIDTHS["padded"], dropout=0.5 if train else 0.0)
    art = compile_model(m, "cuda", train=train)
    assert art.target == {"kind": "cuda", "arch": "sm_90"}
    assert art.manifest["device_code_format"] == "fatbin"


def test_wider_input_than_hidden_is_a_clear_error(capsys, tmp_path):
    with pytest.raises(GcompError, match="in_channels 17 > hidden 16.*hidden >= 17"):
        models.build("ggnn", 17, hidden=16)
    with pytest.raises(GcompError, match="5 input channels exceed its 4 output channels"):
        trace(GatedGraphConv(4, 1), {"x": NodeInput(5), "graph": GraphInput()})
    out = tmp_path / "g.gcomp"
    assert main(["compile", "ggnn", "--in", "1433", "--hidden", "64", "--out", "7",
                 "-o", str(out)]) == 2
    assert "use hidden >= 1433" in capsys.readouterr().err
    assert not out.exists()


def test_print_parse_round_trip():
    """The zero padding (broadcast_to with a shape) and the slices print and parse back."""
    m = models.build("ggnn", 3, hidden=5, out_channels=2, layers=2)
    for g in (m.graph, default_pipeline()(m.graph.copy())):
        text = print_graph(g)
        assert 'broadcast_to[shape=["N", 2]]' in text
        again = parse_graph(text)
        assert print_graph(again) == text
        verify(again)
