"""ONNX import: PyG exports compile to models that reproduce PyG; edge cases; errors; CLI.

The committed corpus (``models/onnx``, made by ``models/export_onnx.py``) holds
PyG GCN / GraphSAGE / GIN / GAT exports (2 and 3 layers, opsets 16-18 with
``dynamo=False``, opset 20 with ``dynamo=True``) and PyG's outputs on a fixed
graph: those tests need no torch.  Tests that run PyG itself skip without it.
Hand-built graphs (onnx.helper) check the cases exporters rarely produce, with
onnx's reference evaluator as the oracle.
"""

import functools
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import awkward_graph, rel_err
from corpus import CORPUS, FIX, STEMS, fixed_graph, parse_stem
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import gcomp.models as models
from gcomp.cli import main
from gcomp.compiler import compile_model
from gcomp.errors import ModelImportError
from gcomp.frontend.onnx import import_onnx, import_proto
from gcomp.model import Model
from gcomp.runtime.data import GraphData, load_graph
from gcomp.runtime.trainer import Trainer

@functools.lru_cache(maxsize=None)
def compiled(stem: str):
    model = import_onnx(CORPUS / f"{stem}.onnx")
    return model, compile_model(model)


def test_corpus_covers_every_layer_exporter_and_opset():
    for kind in ("gcn", "sage", "gin", "gat"):
        for layers in (2, 3):
            for opset in (16, 17, 18):
                assert f"{kind}{layers}_opset{opset}" in STEMS
            if kind != "gat":  # torch 2.13's dynamo exporter fails on GATConv
                assert f"{kind}{layers}_dynamo" in STEMS
    assert {"gcn2w_opset18", "gcn2w_dynamo"} <= set(STEMS)


@pytest.mark.parametrize("stem", STEMS)
def test_compiled_export_reproduces_pyg(stem):
    _, art = compiled(stem)
    out = art.run(fixed_graph(stem))[0]
    ref = FIX[f"out.{stem}"]
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)


@pytest.mark.parametrize("stem", [s for s in STEMS if not s.startswith("gat")])
def test_no_per_edge_feature_buffer(stem):
    """sum/mean aggregation is fused: per-edge buffers hold at most one value per edge."""
    _, art = compiled(stem)
    for name, buf in art.plan.buffers.items():
        dims = buf["dims"]
        if any(str(d).startswith("E:") for d in dims):
            assert all(str(d).startswith("E:") or d == 1 for d in dims), (name, dims)


def test_imported_graph_uses_the_ir_graph_ops():
    ops = {n.op.value for n in import_onnx(CORPUS / "gcn2_opset18.onnx").graph}
    assert {"self_loops", "sym_norm", "scatter"} <= ops
    ops = {n.op.value for n in import_onnx(CORPUS / "gat2_opset16.onnx").graph}
    assert "edge_softmax" in ops
    ops = {n.op.value for n in compiled("sage2_dynamo")[1].graphs["inference"]}
    assert "aggregate" in ops and "scatter" not in ops and "gather" not in ops
    ops = {n.op.value for n in import_onnx(CORPUS / "gcn2w_dynamo.onnx").graph}
    assert {"self_loops", "edge_remap", "sym_norm"} <= ops


# ---------------------------------------------------------------------- PyG itself
def _pyg_net(stem):
    """The PyG module the corpus file was exported from (skip if this torch makes others)."""
    pytest.importorskip("torch_geometric", reason="PyG parity needs torch-geometric")
    from gcomp.models.export_onnx import build
    kind, layers, _ = parse_stem(stem)
    net = build(kind, layers)
    if rel_err(_pyg_out(net, fixed_graph(stem)), FIX[f"out.{stem}"]) > 1e-5:
        pytest.skip("this torch version initializes the corpus models differently")
    return net


def _pyg_out(net, g: GraphData):
    import torch
    w = None if g.edge_weight is None else torch.from_numpy(g.edge_weight)
    with torch.no_grad():
        return net(torch.from_numpy(np.asarray(g.x, np.float32)),
                   torch.from_numpy(np.asarray(g.edge_index, np.int64)), w).numpy()


@pytest.mark.parametrize("stem", STEMS)
def test_pyg_parity_on_awkward_and_cora_graphs(stem):
    net = _pyg_net(stem)
    _, art = compiled(stem)
    weighted = parse_stem(stem)[2]
    cora = load_graph("cora")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((cora.num_nodes, 16)).astype(np.float32)
    w = rng.uniform(0.2, 2, cora.edge_index.shape[1]).astype(np.float32) if weighted else None
    graphs = [awkward_graph(num_nodes=70, num_edges=400, num_features=16, seed=s,
                            edge_weight=weighted) for s in (0, 1)]
    graphs.append(GraphData("cora16", cora.num_nodes, cora.edge_index, x, w))
    for g in graphs:
        out, ref = art.run(g)[0], _pyg_out(net, g)
        assert rel_err(out, ref) <= 1e-4, (g.name, rel_err(out, ref))


@pytest.mark.parametrize("kind,opset", [("gcn", 16), ("sage", 17), ("gin", 18), ("gat", 17),
                                        ("gcn", None)])
def test_fresh_export_of_a_cora_model(kind, opset, tmp_path):
    """Export with this torch at Cora's width, as a user would, and compare on Cora."""
    pytest.importorskip("torch_geometric", reason="exporting needs torch-geometric")
    if opset is None:
        pytest.importorskip("onnxscript", reason="dynamo=True exports need onnxscript")
    from gcomp.models import export_onnx as ex
    cora = load_graph("cora")
    x = np.asarray(cora.dense_x(), np.float32)
    old = ex.IN
    ex.IN = x.shape[1]
    try:
        net = ex.build(kind, 2, seed=3)
        path = tmp_path / "m.onnx"
        ex.export(net, x[:30], FIX["edge_index"], path, opset)
    finally:
        ex.IN = old
    art = compile_model(import_onnx(path))
    g = GraphData("cora", cora.num_nodes, cora.edge_index, x)
    assert rel_err(art.run(g)[0], _pyg_out(net, g)) <= 1e-4


def test_a_value_gcomp_cannot_express_names_its_onnx_node(tmp_path):
    """remove_self_loops(edge_index, edge_weight) before a weighted GCNConv: the weights
    of the loop-free edges cannot be placed on the graph's edges; the error names the
    ONNX node and op computing them (it named internal IR values only)."""
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric", reason="exporting needs torch-geometric")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = pyg.nn.GCNConv(4, 3)

        def forward(self, x, edge_index, edge_weight):
            edge_index, edge_weight = pyg.utils.remove_self_loops(edge_index, edge_weight)
            return self.c(x, edge_index, edge_weight)
    g = awkward_graph(num_nodes=20, num_edges=60, num_features=4, seed=1)
    args = (torch.from_numpy(g.dense_x()), torch.from_numpy(g.edge_index.astype(np.int64)),
            torch.rand(g.edge_index.shape[1]))
    path = tmp_path / "m.onnx"
    torch.onnx.export(Net().eval(), args, str(path), input_names=["x", "edge_index", "w"],
                      output_names=["out"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "edge_index": {1: "E"}, "w": {0: "E"}})
    with pytest.raises(ModelImportError, match=r"ONNX node '[^']+' \(\w+\), tensor .*not "
                                               r"supported by gcomp's ONNX importer here"):
        import_onnx(path)


def test_softmax_over_one_dimensional_edge_scores(tmp_path):
    """A user's attention layer scoring each edge with one number (``utils.softmax`` of
    an [E] tensor, the scores squeezed): the exporter wraps its scatters in If nodes and
    sums the exponentials as a 1-D scatter, which was taken for a weighted degree (the
    softmax's max then had no softmax to belong to).  Compared with the module itself on
    a graph with isolated nodes, self loops and repeated edges."""
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric", reason="exporting needs torch-geometric")

    class Att(pyg.nn.MessagePassing):
        def __init__(self):
            super().__init__(aggr="add")
            self.lin = torch.nn.Linear(4, 3)
            self.a = torch.nn.Parameter(torch.randn(6))

        def forward(self, x, edge_index):
            return self.propagate(edge_index, h=self.lin(x))

        def message(self, h_i, h_j, index, ptr, size_i):
            alpha = torch.nn.functional.leaky_relu((torch.cat([h_i, h_j], -1) * self.a).sum(-1),
                                                   0.2)
            return h_j * pyg.utils.softmax(alpha, index, ptr, size_i).unsqueeze(-1)
    torch.manual_seed(0)
    net = Att().eval()
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=2)
    x, ei = torch.from_numpy(g.dense_x()), torch.from_numpy(g.edge_index.astype(np.int64))
    path = tmp_path / "att.onnx"
    torch.onnx.export(net, (x[:10], ei[:, :20] % 10), str(path), input_names=["x", "edge_index"],
                      output_names=["out"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "edge_index": {1: "E"}})
    model = import_onnx(path)
    assert "edge_softmax" in {n.op.value for n in model.graph}
    with torch.no_grad():  # float64 reference
        ref = net.double()(x.double(), ei).numpy()
    assert rel_err(compile_model(model).run(g)[0], ref) <= 1e-5


def test_edges_exported_as_constants_are_named(tmp_path):
    """GCNConv(cached=True) called before the export keeps the normalized edges; the
    exporter then stores them as constants and drops the unread edge_index input.  The
    error says so (it only said to name an edge-index input the model does not have)."""
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric", reason="exporting needs torch-geometric")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = pyg.nn.GCNConv(4, 3, cached=True)

        def forward(self, x, edge_index):
            return self.c(x, edge_index)
    net = Net().eval()
    x, ei = torch.randn(6, 4), torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])
    net(x, ei)
    path = tmp_path / "cached.onnx"
    torch.onnx.export(net, (x, ei), str(path), input_names=["x", "edge_index"],
                      output_names=["out"], opset_version=17, dynamo=False,
                      dynamic_axes={"x": {0: "N"}, "edge_index": {1: "E"}})
    with pytest.raises(ModelImportError, match=r"no edge-index input .*ONNX node '[^']+' "
                                               r"\(ScatterElements\) aggregates over edges "
                                               r"stored in the model as constants.*cached=False"):
        import_onnx(path)


def _ggnn_net(channels: int, in_channels: int):
    """PyG's GatedGraphConv (2 steps, a GRU cell each) with a Linear readout, as a user
    writes a GGNN; ``in_channels`` < ``channels`` pads the features with zeros."""
    import torch
    from torch_geometric import nn as pnn
    torch.manual_seed(in_channels)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = pnn.GatedGraphConv(channels, 2)
            self.lin = torch.nn.Linear(channels, 4)

        def forward(self, x, edge_index, w=None):
            return self.lin(self.conv(x, edge_index))
    return Net().eval()


@pytest.mark.parametrize("in_channels,opset", [(16, 16), (16, 18), (9, 17)])
def test_gated_graph_conv_export(in_channels, opset, tmp_path):
    """The GRU's gates come out of one product through Split; the padding of x to the
    conv's width is ConstantOfShape [N, k] zeros concatenated to it.  Compared with PyG
    on the fixed graph and on Cora's edges, and trained: ten Adam steps follow torch's."""
    pytest.importorskip("torch_geometric", reason="exporting needs torch-geometric")
    import torch
    from gcomp.models import export_onnx as ex
    net = _ggnn_net(16, in_channels)
    x = np.ascontiguousarray(FIX["x"][:, :in_channels])
    path = tmp_path / "ggnn.onnx"
    ex.export(net, x, FIX["edge_index"], path, opset)
    assert "Split" in {n.op_type for n in onnx.load(path).graph.node}
    model = import_onnx(path)
    art = compile_model(model)
    cora = load_graph("cora")
    xc = np.random.default_rng(1).standard_normal((cora.num_nodes, in_channels)).astype(np.float32)
    for g in (GraphData("fixed", x.shape[0], FIX["edge_index"], x),
              GraphData("cora", cora.num_nodes, cora.edge_index, xc)):
        assert rel_err(art.run(g)[0], _pyg_out(net, g)) <= 1e-4, g.name
    g = _labelled(GraphData("cora", cora.num_nodes, cora.edge_index, xc), 4)
    trainer = Trainer(compile_model(model, train=True), g)  # Adam, lr 0.01
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    xt, ei = torch.from_numpy(xc), torch.from_numpy(cora.edge_index)
    m, y = torch.from_numpy(g.train_mask), torch.from_numpy(g.y)
    for step in range(10):
        opt.zero_grad()
        ref = torch.nn.functional.cross_entropy(net(xt, ei)[m], y[m])
        ref.backward()
        opt.step()
        assert abs(trainer.step() - ref.item()) <= 1e-4 * ref.item(), step


# ---------------------------------------------------------------------- training
def _labelled(g: GraphData, classes: int) -> GraphData:
    rng = np.random.default_rng(0)
    g.y = rng.integers(0, classes, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < 0.7
    g.val_mask = g.test_mask = ~g.train_mask
    return g


@pytest.mark.parametrize("stem", ["gcn2_opset18", "sage2_dynamo", "gcn3_dynamo", "sage3_opset16",
                                  "gcn2w_opset18"])
def test_imported_model_trains_like_the_bundled_model(stem):
    imported = import_onnx(CORPUS / f"{stem}.onnx")
    name, layers, weighted = parse_stem(stem)
    bundled = models.build(name, 16, hidden=8, out_channels=4, layers=layers,
                           edge_weight=weighted)
    # the same weights in the bundled model (dynamo keeps torch's [out, in] layout)
    flipped = {n.inputs[1].name for n in imported.graph
               if n.op.value == "matmul" and n.attrs["trans_b"]}
    params = {k: v.T.copy() if k in flipped else v for k, v in imported.params.items()}
    same = Model(bundled.graph, params, bundled.config)
    g = _labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=16, seed=4,
                                edge_weight=weighted), 4)
    a = Trainer(compile_model(imported, train=True), g, seed=0)
    b = Trainer(compile_model(same, train=True), g, seed=0)
    la, lb = a.step(), b.step()
    assert abs(la - lb) <= 1e-5 * abs(lb)
    ga, gb = a.gradients(), b.gradients()
    assert set(ga) == set(gb)
    for k in ga:
        want = gb[k].T if k in flipped else gb[k]
        assert rel_err(ga[k], want) <= 1e-4, k


# ---------------------------------------------------------------------- hand-built graphs
def _vi(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def _const(name, value, dtype=np.int64):
    return helper.make_node("Constant", [], [name],
                            value=numpy_helper.from_array(np.asarray(value, dtype)))


def _proto(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "t", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _rows(ei="edge_index"):
    return [_const("c0", 0), _const("c1", 1),
            helper.make_node("Gather", [ei, "c0"], ["src"], axis=0),
            helper.make_node("Gather", [ei, "c1"], ["dst"], axis=0)]


def _aggregation(F=4, reduction="add", weight=False, opset=18, W=None):
    """out = scatter_<reduction>(x[src] (* w), dst) @ W: the PyG message-passing shape."""
    W = np.random.default_rng(1).standard_normal((F, 3)).astype(np.float32) if W is None else W
    nodes = _rows() + [
        helper.make_node("Gather", ["x", "src"], ["xj"], axis=0),
        _const("ax1", [1]),
        helper.make_node("Shape", ["x"], ["xshape"]),
        helper.make_node("ConstantOfShape", ["xshape"], ["zeros"],
                         value=numpy_helper.from_array(np.zeros(1, np.float32))),
    ]
    msg = "xj"
    if weight:
        nodes += [helper.make_node("Unsqueeze", ["edge_weight", "ax1"], ["w1"]),
                  helper.make_node("Mul", ["xj", "w1"], ["msg"])]
        msg = "msg"
    nodes += [helper.make_node("Unsqueeze", ["dst", "ax1"], ["dst1"]),
              helper.make_node("Shape", [msg], ["mshape"]),
              helper.make_node("Expand", ["dst1", "mshape"], ["idx"]),
              helper.make_node("ScatterElements", ["zeros", "idx", msg], ["agg"], axis=0,
                               reduction=reduction, name="the_scatter"),
              helper.make_node("MatMul", ["agg", "W"], ["out"])]
    inputs = [_vi("x", TensorProto.FLOAT, ["N", F]), _vi("edge_index", TensorProto.INT64, [2, "E"])]
    if weight:
        inputs.append(_vi("edge_weight", TensorProto.FLOAT, ["E"]))
    return _proto(nodes, inputs, [_vi("out", TensorProto.FLOAT, ["N", W.shape[1]])],
                  [numpy_helper.from_array(W, "W")], opset)


def _check_against_onnx(proto, g: GraphData, feeds: dict, tol=1e-4):
    art = compile_model(import_proto(proto))
    ref = ReferenceEvaluator(proto).run(None, feeds)[0]
    out = art.run(g)[0]
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    return art


@pytest.mark.parametrize("reduction", ["add", "max"])
def test_hand_built_scatter(reduction):
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=2)
    _check_against_onnx(_aggregation(reduction=reduction), g,
                        {"x": g.dense_x(), "edge_index": g.edge_index.astype(np.int64)})


@pytest.mark.parametrize("opset", [16, 20])
def test_hand_built_edge_weights(opset):
    proto = _aggregation(weight=True, opset=opset)
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=3, edge_weight=True)
    assert {i["name"]: i["role"] for i in import_proto(proto).signature()["inputs"]} == \
        {"x": "node", "edge_index": "graph", "edge_weight": "edge"}
    _check_against_onnx(proto, g, {"x": g.dense_x(), "edge_index": g.edge_index.astype(np.int64),
                                   "edge_weight": g.edge_weight})


def test_transposed_edge_index():
    """An [E, 2] edge index, rows taken along axis 1."""
    nodes = [_const("c0", 0), _const("c1", 1),
             helper.make_node("Gather", ["ei", "c0"], ["src"], axis=1),
             helper.make_node("Gather", ["ei", "c1"], ["dst"], axis=1),
             helper.make_node("Gather", ["feat", "src"], ["xj"], axis=0),
             helper.make_node("Shape", ["feat"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["z"],
                              value=numpy_helper.from_array(np.zeros(1, np.float32))),
             _const("ax1", [1]),
             helper.make_node("Unsqueeze", ["dst", "ax1"], ["d1"]),
             helper.make_node("Shape", ["xj"], ["ms"]),
             helper.make_node("Expand", ["d1", "ms"], ["idx"]),
             helper.make_node("ScatterElements", ["z", "idx", "xj"], ["out"], axis=0,
                              reduction="add")]
    proto = _proto(nodes, [_vi("feat", TensorProto.FLOAT, ["n", 3]),
                           _vi("ei", TensorProto.INT64, ["e", 2])],
                   [_vi("out", TensorProto.FLOAT, ["n", 3])])
    g = awkward_graph(num_nodes=30, num_edges=100, num_features=3, seed=5)
    _check_against_onnx(proto, g, {"feat": g.dense_x(), "ei": g.edge_index.T.astype(np.int64)})


def test_dense_adjacency_becomes_sparse_aggregation():
    W = np.random.default_rng(0).standard_normal((5, 2)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["adj", "x"], ["ax"]),
             helper.make_node("MatMul", ["ax", "W"], ["h"]),
             helper.make_node("Relu", ["h"], ["out"])]
    proto = _proto(nodes, [_vi("x", TensorProto.FLOAT, ["N", 5]),
                           _vi("adj", TensorProto.FLOAT, ["N", "N"])],
                   [_vi("out", TensorProto.FLOAT, ["N", 2])], [numpy_helper.from_array(W, "W")])
    model = import_proto(proto)
    assert [i["role"] for i in model.signature()["inputs"]] == ["graph", "node"]
    g = awkward_graph(num_nodes=25, num_edges=80, num_features=5, seed=6)
    A = np.zeros((g.num_nodes, g.num_nodes), np.float32)
    np.add.at(A, (g.edge_index[1], g.edge_index[0]), 1.0)  # A[i, j]: edges j -> i
    _check_against_onnx(proto, g, {"x": g.dense_x(), "adj": A})
    ops = {n.op.value for n in compile_model(model).graphs["inference"]}
    assert "aggregate" in ops and "matmul" in ops


def test_identity_outputs_keep_their_names(tmp_path):
    """An output that is an Identity of another output, or of the features input, is a
    value of its own under its ONNX name: the model's outputs, ``art.run`` and ``gcomp
    run --out`` give one array per ONNX output, each the reference evaluator's."""
    proto = _aggregation()
    proto.graph.node.extend([helper.make_node("Identity", ["out"], ["out_copy"]),
                             helper.make_node("Identity", ["x"], ["x_out"])])
    proto.graph.output.extend([_vi("out_copy", TensorProto.FLOAT, ["N", 3]),
                               _vi("x_out", TensorProto.FLOAT, ["N", 4])])
    names = ["out", "out_copy", "x_out"]
    assert [o["name"] for o in import_proto(proto).signature()["outputs"]] == names
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=2)
    feeds = {"x": g.dense_x(), "edge_index": g.edge_index.astype(np.int64)}
    refs = ReferenceEvaluator(proto).run(None, feeds)
    outs = compile_model(import_proto(proto)).run(g)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) <= 1e-5
    onnx.save(proto, tmp_path / "m.onnx")
    np.savez(tmp_path / "g.npz", x=feeds["x"], edge_index=g.edge_index)
    assert main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.gcomp")]) == 0
    assert main(["run", str(tmp_path / "m.gcomp"), "--graph", str(tmp_path / "g.npz"),
                 "--out", str(tmp_path / "y.npz")]) == 0
    y = np.load(tmp_path / "y.npz")
    assert sorted(y.files) == sorted(names)
    for name, r in zip(names, refs):
        assert rel_err(y[name], r) <= 1e-5, name


def test_roles_can_be_named():
    proto = _aggregation()
    for vi, new in zip(proto.graph.input, ("a", "b")):
        for n in proto.graph.node:
            n.input[:] = [new if i == vi.name else i for i in n.input]
        vi.name = new
    proto.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 2
    m = import_proto(proto, roles={"features": "a", "edge_index": "b"})
    assert m.signature()["inputs"][0]["name"] == "b"


# ---------------------------------------------------------------------- errors
def _raises(proto, *words, roles=None):
    with pytest.raises(ModelImportError) as e:
        import_proto(proto, roles)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_unsupported_op_names_node_and_op():
    proto = _aggregation()
    proto.graph.node.append(helper.make_node("Det", ["out"], ["d"], name="my_det"))
    proto.graph.output[0].name = "d"
    proto.graph.output[0].type.tensor_type.shape.ClearField("dim")
    _raises(proto, "my_det", "Det at opset 18 is not supported", "supported: Add, Cast,")


def test_unsupported_opset():
    _raises(_aggregation(opset=13), "opset 13", "16 to 20")


def test_missing_roles():
    proto = _aggregation()
    proto.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 3  # not [2, E]
    _raises(proto, "edge-index input", "--edge-index-input")
    _raises(_aggregation(), "not an input", roles={"edge_index": "nope"})


def test_named_roles_must_fit_their_inputs():
    """An input named for a role it cannot play, or for two roles, is refused naming it
    (it failed later, deep in the import, or said the model had no such input)."""
    _raises(_aggregation(), "input 'x' is named for two roles",
            roles={"features": "x", "edge_weight": "x"})
    _raises(_aggregation(), "the edge_index input x: float[N, 4] is not an integer",
            roles={"edge_index": "x"})
    _raises(_aggregation(), "the features input edge_index: int[2, E] is not a float",
            roles={"features": "edge_index"})
    _raises(_aggregation(), "is not a float [num_edges] vector",
            roles={"edge_weight": "edge_index"})


def test_ambiguous_features():
    proto = _aggregation()
    proto.graph.input.append(_vi("y2", TensorProto.FLOAT, ["N", 4]))
    _raises(proto, "cannot infer the role of input(s) y2")
    proto.graph.input[0].name = "p"
    for n in proto.graph.node:
        n.input[:] = ["p" if i == "x" else i for i in n.input]
    _raises(proto, "which input is the features input", "p, y2", "--features-input")


def test_scatter_along_the_source_is_refused():
    proto = _aggregation()
    for n in proto.graph.node:
        if n.op_type == "Unsqueeze" and n.input[0] == "dst":
            n.input[0] = "src"
    _raises(proto, "the_scatter", "ScatterElements", "target_to_source")


def test_invalid_model_and_missing_file(tmp_path):
    proto = _aggregation()
    proto.graph.node[-1].input[0] = "undefined_tensor"
    with pytest.raises(ModelImportError):
        import_proto(proto)
    with pytest.raises(ModelImportError, match="no such file"):
        import_onnx(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a protobuf \x00\xff")
    with pytest.raises(ModelImportError):
        import_onnx(tmp_path / "junk.onnx")


def test_dropout_exported_in_training_mode_is_refused():
    proto = _aggregation()
    proto.graph.node.extend([_const("ratio", 0.5, np.float32), _const("train", True, np.bool_),
                             helper.make_node("Dropout", ["out", "ratio", "train"], ["d"],
                                              name="the_dropout")])
    proto.graph.output[0].name = "d"
    _raises(proto, "the_dropout", "Dropout", "training mode", "model.eval()")
    proto.graph.node[-2].CopyFrom(_const("train", False, np.bool_))  # eval mode: identity
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=2)
    _check_against_onnx(proto, g, {"x": g.dense_x(), "edge_index": g.edge_index.astype(np.int64)})


def test_empty_file_is_not_an_opset_problem(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ModelImportError, match="not a readable ONNX model: it holds no graph"):
        import_onnx(tmp_path / "empty.onnx")


def test_a_per_node_vector_input_is_not_taken_for_edge_weights():
    proto = _aggregation()
    proto.graph.input.append(_vi("node_scale", TensorProto.FLOAT, ["N"]))
    _raises(proto, "cannot infer the role of input(s) node_scale",
            "node values besides the features")


def test_weights_exported_as_inputs_get_a_hint():
    proto = _aggregation()
    w = proto.graph.initializer.pop()
    proto.graph.input.append(_vi(w.name, TensorProto.FLOAT, list(w.dims)))
    _raises(proto, "cannot infer the role of input(s) W", "export_params=True")


def test_cli_run_writes_every_output_of_a_model_with_several(tmp_path, capsys):
    proto = _aggregation()
    proto.graph.node.append(helper.make_node("Relu", ["agg"], ["h"]))
    proto.graph.node.append(helper.make_node("Relu", ["agg"], ["h2"]))  # cse merges it with h
    proto.graph.output.append(_vi("h", TensorProto.FLOAT, ["N", 4]))
    proto.graph.output.append(_vi("h2", TensorProto.FLOAT, ["N", 4]))
    src = tmp_path / "two.onnx"
    onnx.save(proto, src)
    art = tmp_path / "two.gcomp"
    assert main(["compile", str(src), "-o", str(art)]) == 0
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=4, seed=2)
    gpath = tmp_path / "g.npz"
    np.savez(gpath, edge_index=g.edge_index, x=g.x)
    capsys.readouterr()
    assert main(["run", str(art), "--graph", str(gpath), "--out", str(tmp_path / "y.npy")]) == 2
    assert "3 outputs (out, h, h2): give --out FILE.npz" in capsys.readouterr().err
    assert main(["run", str(art), "--graph", str(gpath), "--out", str(tmp_path / "y.npz")]) == 0
    ref = ReferenceEvaluator(proto).run(None, {"x": g.x, "edge_index": g.edge_index})
    with np.load(tmp_path / "y.npz") as z:
        assert sorted(z.files) == ["h", "h2", "out"]
        for k, name in enumerate(["out", "h", "h2"]):
            assert rel_err(z[name], ref[k]) <= 1e-4, name


def test_compiling_for_a_graph_of_another_feature_width_is_refused():
    from gcomp.errors import CompileError
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=6, seed=2)
    with pytest.raises(CompileError, match="has 6 features per node; the model's input 'x' takes 4"):
        compile_model(import_proto(_aggregation()), graph=g)


# ---------------------------------------------------------------------- CLI
def test_cli_compile_and_explain(tmp_path, capsys):
    out = tmp_path / "m.gcomp"
    assert main(["compile", str(CORPUS / "gin2_opset17.onnx"), "-t", "llvm", "-o", str(out)]) == 0
    assert out.exists()
    assert main(["compile", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "x.gcomp")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cli_train_on_cora(tmp_path, capsys):
    """``gcomp train model.onnx --graph cora``: a hand-built 1433 -> 7 model."""
    W = (np.random.default_rng(0).standard_normal((1433, 7)) * 0.05).astype(np.float32)
    proto = _aggregation(F=1433, W=W)
    path = tmp_path / "cora_model.onnx"
    onnx.save(proto, str(path))
    rc = main(["train", str(path), "--graph", "cora", "--epochs", "5", "--json",
               "--features-input", "x", "--edge-index-input", "edge_index"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["epochs"] == 5 and np.isfinite(result["final_loss"])


def test_fixed_node_count_is_refused():
    proto = _aggregation()
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 30
    _raises(proto, "fixed number of nodes (30)", "dynamic_axes")


def test_truncated_file_and_missing_initializer(tmp_path):
    data = (CORPUS / "gcn2_opset18.onnx").read_bytes()
    (tmp_path / "cut.onnx").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelImportError, match="not a readable ONNX model"):
        import_onnx(tmp_path / "cut.onnx")
    proto = onnx.load(CORPUS / "gcn2_opset18.onnx")
    gone = proto.graph.initializer[0].name
    del proto.graph.initializer[0]
    with pytest.raises(ModelImportError, match=re.escape(gone)):
        import_proto(proto)


def test_unresolvable_shape_is_a_clear_error():
    """A Reshape to a data-dependent shape (NonZero of the features) cannot be resolved."""
    proto = _aggregation()
    g = proto.graph
    g.node.extend([helper.make_node("NonZero", ["x"], ["nz"], name="data_nz"),
                   helper.make_node("Shape", ["nz"], ["nzshape"]),
                   helper.make_node("Reshape", ["out", "nzshape"], ["out2"])])
    g.output[0].name = "out2"
    g.output[0].type.tensor_type.shape.ClearField("dim")
    _raises(proto, "data_nz", "NonZero", "not supported")


# ---------------------------------------------------------------------- fuzzing
FUZZ_STEMS = ["gcn2_opset18", "sage2_dynamo", "gat2_opset17", "gin2_opset16"]


@functools.lru_cache(maxsize=None)
def _corpus_bytes(stem: str) -> bytes:
    return (CORPUS / f"{stem}.onnx").read_bytes()


def _mutate(proto, data):
    """One random edit of the kind a broken exporter or a damaged file produces."""
    from hypothesis import strategies as st
    nodes = proto.graph.node
    kind = data.draw(st.sampled_from(["drop", "duplicate", "attribute", "rewire", "output"]))
    i = data.draw(st.integers(0, len(nodes) - 1))
    if kind == "drop":
        del nodes[i]
    elif kind == "duplicate":
        nodes.insert(i, nodes[i])
    elif kind == "rewire" and nodes[i].input:
        names = sorted({t for n in nodes for t in n.output} | {t.name for t in proto.graph.input})
        k = data.draw(st.integers(0, len(nodes[i].input) - 1))
        nodes[i].input[k] = data.draw(st.sampled_from(names))
    elif kind == "output":
        outs = sorted({t for n in nodes for t in n.output})
        proto.graph.output[0].name = data.draw(st.sampled_from(outs))
    elif nodes[i].attribute:
        a = nodes[i].attribute[data.draw(st.integers(0, len(nodes[i].attribute) - 1))]
        if a.type == onnx.AttributeProto.INT:
            a.i = data.draw(st.integers(-3, 3))
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = data.draw(st.floats(-2, 2, allow_nan=False))
        elif a.type == onnx.AttributeProto.INTS:
            a.ints[:] = data.draw(st.lists(st.integers(-3, 3), max_size=3))
        elif a.type == onnx.AttributeProto.STRING:
            a.s = data.draw(st.sampled_from([b"add", b"max", b"mul", b"none", b""]))
        else:
            nodes[i].attribute.remove(a)
    return proto


def test_fuzzed_models_only_raise_import_errors():
    """Mutated corpus models either import or raise ModelImportError, never anything else."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.sampled_from(FUZZ_STEMS), st.data())
    def edit(stem, data):
        proto = onnx.load_from_string(_corpus_bytes(stem))
        for _ in range(data.draw(st.integers(1, 3))):
            proto = _mutate(proto, data)
        try:
            import_proto(proto)
        except ModelImportError:
            pass

    @hypothesis.settings(max_examples=100, deadline=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.sampled_from(FUZZ_STEMS), st.data())
    def corrupt(stem, data):
        raw = bytearray(_corpus_bytes(stem))
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            del raw[data.draw(st.integers(1, len(raw))):]
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "m.onnx"
            path.write_bytes(bytes(raw))
            try:
                import_onnx(path)
            except ModelImportError:
                pass

    edit()
    corrupt()
