"""Graph IR: printing and parsing, the verifier, use-lists, builder errors."""

import numpy as np
import pytest

import gcomp.models as models
from gcomp.errors import IRError
from gcomp.ir import Graph, Op, TensorType, parse_graph, print_graph, verify
from gcomp.ir.types import N, EdgeDim, GraphType, parse_type
from gcomp.passes import default_pipeline


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_print_parse_round_trip(name):
    m = models.build(name, 9, hidden=5, out_channels=3, layers=3, heads=2)
    for g in (m.graph, default_pipeline()(m.graph.copy())):
        text = print_graph(g)
        again = parse_graph(text)
        assert print_graph(again) == text
        verify(again)


def test_printed_form_is_readable():
    m = models.build("gcn", 4, hidden=3, out_channels=2, layers=1)
    text = print_graph(m.graph)
    assert text.splitlines()[0] == "graph gcn(%x: f32[N,4], %edge_index: graph<coo>) {"
    assert '  %convs.0.graph = self_loops(%edge_index) : graph<coo>' in text  # default mode
    assert text.rstrip().endswith("}")


def test_types_round_trip():
    for t in ["f32[N,16]", "f32[E(g1),4,2]", "f32[]", "i64[3]", "graph<csr>"]:
        assert str(parse_type(t)) == t


def test_parser_checks_written_types():
    text = """graph t(%x: f32[N,4]) {
  %y = relu(%x) : f32[N,5]
  return %y
}"""
    with pytest.raises(IRError, match="written as f32\\[N,5\\] but its type is f32\\[N,4\\]"):
        parse_graph(text)


_ATT = "graph t(%x: f32[N,2,2], %s: f32[N,2], %g: graph<coo>, %k: i32[]) {\n"


@pytest.mark.parametrize("text,msg", [
    ("graph t(%x: f32[N,4]) {\n  %y = relu(%z) : f32[N,4]\n  return %y\n}", "used before"),
    ("graph t(%x: f32[N,4]) {\n  %y = frobnicate(%x) : f32[N,4]\n  return %y\n}", "unknown op"),
    ("graph t(%x: f32[N,4]) {\n  %y = leaky_relu[slope=1](%x) : f32[N,4]\n  return %y\n}",
     "unknown attribute"),
    ("graph t(%x: f32[N,4]) {\n  %y = relu(%x) : f32[N,4]\n  return %y\n", "closing brace"),
    ("graph t(%x: f32[N,4], %g: graph<coo>) {\n  %y = aggregate(%x, %g) : f32[N,4]\n"
     "  return %y\n}", "must be a graph"),
    ("graph t(%x: f32[N,4]) {\n  %y = relu(%x) : f32[N,4]\n  %y = relu(%x) : f32[N,4]\n"
     "  return %y\n}", "duplicate"),
    (_ATT + "  %y = attention_aggregate[p=0.3](%g, %x, %s, %s) : f32[N,2,2]\n  return %y\n}",
     "a step input comes with attention dropout"),
    (_ATT + "  %y = attention_aggregate[p=1.5](%g, %x, %s, %s, %k) : f32[N,2,2]\n"
     "  return %y\n}", "dropout probability must be in"),
])
def test_parser_errors(text, msg):
    with pytest.raises(IRError, match=msg):
        parse_graph(text)


def test_use_lists_follow_input_edits():
    g = Graph("t")
    x = g.create_node(Op.INPUT, ty=TensorType((N, 4)), name="x")
    a = g.create_node(Op.RELU, [x])
    b = g.create_node(Op.EXP, [a])
    g.set_outputs([b])
    assert list(x.users) == [a] and list(a.users) == [b]
    with g.inserting_before(b):
        c = g.create_node(Op.TANH, [x])
    g.replace_all_uses_with(a, c)
    assert b.inputs == (c,) and not a.users and set(x.users) == {a, c}
    assert [n.name for n in g] == ["x", "relu", "tanh", "exp"]
    g.erase_node(a)
    assert list(x.users) == [c]
    with pytest.raises(IRError, match="still used"):
        g.erase_node(c)
    verify(g)


def test_verifier_catches_bad_types_and_order():
    g = Graph("t")
    x = g.create_node(Op.INPUT, ty=TensorType((N, 4)), name="x")
    y = g.create_node(Op.RELU, [x])
    g.set_outputs([y])
    y.ty = TensorType((N, 5))
    with pytest.raises(IRError, match="type is f32\\[N,5\\] but inputs give f32\\[N,4\\]"):
        verify(g)
    y.ty = TensorType((N, 4))
    g._nodes.reverse()  # a topological-order violation
    with pytest.raises(IRError, match="not defined before"):
        verify(g)


def test_edge_tensor_must_belong_to_its_graph():
    g = Graph("t")
    g.create_node(Op.INPUT, ty=GraphType(), name="g1")
    g2 = g.create_node(Op.INPUT, ty=GraphType(), name="g2")
    e = g.create_node(Op.INPUT, ty=TensorType((EdgeDim("g1"), 2)), name="e")
    with pytest.raises(IRError, match="must be an edge tensor of %g2"):
        g.create_node(Op.EDGE_SOFTMAX, [g2, e])


def test_model_checks_parameter_values():
    m = models.build("gcn", 4, hidden=3, out_channels=2, layers=1)
    from gcomp.model import Model
    params = dict(m.params)
    params["convs.0.bias"] = np.zeros(5)
    with pytest.raises(IRError, match="shape"):
        Model(m.graph, params)


def test_builder_rejects_bad_sizes_and_names():
    from gcomp.errors import GcompError
    with pytest.raises(GcompError, match="unknown model"):
        models.build("gnnx", 4)
    with pytest.raises(GcompError, match="hidden must be a positive integer"):
        models.build("gcn", 4, hidden=0)
    # zero-sized inputs and parameters are named at trace time (a kernel divided by 0)
    from gcomp.frontend.builder import (EdgeInput, GraphInput, Linear, Module, NodeInput,
                                        trace)
    with pytest.raises(GcompError, match="holds no values"):
        Linear(0, 2)

    class Agg(Module):
        def forward(self, x, edge_index, w=None):
            return edge_index.aggregate(x)
    with pytest.raises(GcompError, match="NodeInput\\(0,\\) has no features"):
        trace(Agg(), {"x": NodeInput(0), "edge_index": GraphInput()})
    with pytest.raises(GcompError, match="EdgeInput shape \\(0,\\) holds no values"):
        trace(Agg(), {"x": NodeInput(3), "edge_index": GraphInput(),
                      "w": EdgeInput("edge_index", (0,))})

    class TwoEdgeTypes(Module):  # a run binds one graph: both inputs would get it
        def forward(self, x, friends, enemies):
            return friends.aggregate(x) - enemies.aggregate(x)
    with pytest.raises(IRError, match="2 graph inputs \\('friends', 'enemies'\\); gcomp "
                                      "models take one graph"):
        trace(TwoEdgeTypes(), {"x": NodeInput(2), "friends": GraphInput(),
                               "enemies": GraphInput()})


def test_builder_outputs_are_distinct_values():
    """forward() returning one value twice, or an input, gives outputs of their own names
    (results are named by their nodes: a repeat would lose one), with the same values."""
    from gcomp.compiler import compile_model
    from gcomp.frontend.builder import GraphInput, Linear, Module, NodeInput, trace

    class Twice(Module):
        def __init__(self):
            self.lin = Linear(4, 3)

        def forward(self, x, edge_index):
            h = self.lin(x)
            return h, h, x
    m = trace(Twice(), {"x": NodeInput(4), "edge_index": GraphInput()})
    names = [o["name"] for o in m.signature()["outputs"]]
    assert len(set(names)) == 3 and names[0] == "lin.bias_add"
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    from gcomp.runtime.data import GraphData
    g = GraphData("g", 5, np.array([[0, 1], [1, 2]]), x=x)
    h, h2, x2 = compile_model(m).run(g)
    ref = x.astype(np.float64) @ m.params["lin.weight"] + m.params["lin.bias"]
    assert np.abs(h - ref).max() <= 1e-5 and np.array_equal(h, h2) and np.array_equal(x2, x)


def test_builder_names_follow_module_paths():
    m = models.build("sage", 4, hidden=3, out_channels=2, layers=2)
    assert sorted(m.params) == ["convs.0.lin_l.bias", "convs.0.lin_l.weight", "convs.0.lin_r.weight",
                                "convs.1.lin_l.bias", "convs.1.lin_l.weight", "convs.1.lin_r.weight"]


def test_same_seed_same_parameters():
    a = models.build("gat", 4, hidden=3, out_channels=2, seed=7)
    b = models.build("gat", 4, hidden=3, out_channels=2, seed=7)
    c = models.build("gat", 4, hidden=3, out_channels=2, seed=8)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not all(np.array_equal(a.params[k], c.params[k]) for k in a.params)


@pytest.mark.parametrize("fn,msg", [
    (lambda x, p: x[0], "cannot index the symbolic axis 0"),
    (lambda x, p: x[:, ::2], "step 1"),
    (lambda x, p: x[:, 3:3], "non-empty"),
    (lambda x, p: p[5], "index 5 out of range"),
    (lambda x, p: x[:, :, 0], "too many indices"),
    (lambda x, p: x[:, "a"], "ints and slices only"),
    (lambda x, p: x.new_zeros(2, "N"), "static sizes"),
])
def test_builder_indexing_errors(fn, msg):
    from gcomp.frontend.builder import Module, NodeInput, Parameter, trace

    class M(Module):
        def __init__(self):
            self.p = Parameter((5, 4))

        def forward(self, x):
            return fn(x, self.p)

    with pytest.raises(IRError, match=msg):
        trace(M(), {"x": NodeInput(5)})
