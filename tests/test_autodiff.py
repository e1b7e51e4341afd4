"""Autodiff: gradients of the training graph, interpreted in float64, equal central
finite differences of the loss, for every differentiable op and every bundled model."""

import numpy as np
import pytest
from conftest import awkward_graph

import gcomp.models as models
from gcomp.frontend.builder import (GraphInput, Module, NodeInput, Parameter, concat, dropout,
                                    maximum, minimum, trace)
from gcomp.errors import IRError
from gcomp.ir import RefGraph, interpret
from gcomp.passes import PassManager, training_pipeline
from gcomp.passes.add_loss import AddLoss


def loss_inputs(g, C, seed=0, step=3):
    rng = np.random.default_rng(seed)
    return {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
            "labels": rng.integers(0, C, g.num_nodes),
            "train_mask": (rng.random(g.num_nodes) < 0.7).astype(np.float64),
            "rng_step": step}


def check_gradients(model, g, C, n_checks=12, eps=1e-6, tol=1e-5, seed=0):
    train = training_pipeline()(model.graph.copy())
    lossg = PassManager([AddLoss()])(model.graph.copy())
    inputs = loss_inputs(g, C, seed)
    inputs = {k: v for k, v in inputs.items() if train.has(k)}
    params64 = {k: np.array(v, dtype=np.float64) for k, v in model.params.items()}
    outs = interpret(train, inputs, params64)
    grads = dict(zip(train.meta["grads"], outs[1:]))
    loss0 = interpret(lossg, inputs, params64)[0]
    assert np.isclose(outs[0], loss0)
    rng = np.random.default_rng(seed)
    for name, p in params64.items():
        assert grads[name].shape == p.shape, name
        for _ in range(min(n_checks, p.size)):
            idx = tuple(rng.integers(0, s) for s in p.shape)
            up, dn = dict(params64), dict(params64)
            up[name], dn[name] = p.copy(), p.copy()
            up[name][idx] += eps
            dn[name][idx] -= eps
            fd = (interpret(lossg, inputs, up)[0] - interpret(lossg, inputs, dn)[0]) / (2 * eps)
            assert abs(fd - grads[name][idx]) <= tol * max(1.0, abs(fd)), (name, idx, fd,
                                                                         grads[name][idx])


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_bundled_models(name):
    g = awkward_graph(num_nodes=40, num_edges=160, num_features=5, seed=1)
    g.x = g.x.astype(np.float64)
    m = models.build(name, 5, hidden=6, out_channels=3, layers=3, heads=2, seed=2, dropout=0.3)
    rng = np.random.default_rng(0)
    for k, v in m.params.items():  # nonzero biases and eps
        m.params[k] = (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
    check_gradients(m, g, 3)


class Fn(Module):
    def __init__(self, fn, F, H=6, C=3):
        self.fn = fn
        self.w_in = Parameter((F, H), "normal")
        self.w_out = Parameter((H, C), "normal")
        self.b = Parameter((H,), "normal")
        self.s = Parameter((), "normal")

    def forward(self, x, edge_index):
        h = self.fn(x @ self.w_in, edge_index, self)
        return h @ self.w_out


def _fd(fn, seed=0, H=6):
    g = awkward_graph(num_nodes=30, num_edges=120, num_features=4, seed=seed)
    g.x = g.x.astype(np.float64)
    m = trace(Fn(fn, 4, H), {"x": NodeInput(4), "edge_index": GraphInput()}, seed=seed)
    check_gradients(m, g, 3, seed=seed)


def _normalized(h, g2):
    return g2.aggregate(h, "sum", weight=g2.gcn_norm())


def _attention(h, g, p, slope):
    """GAT's attention over 2 heads of 3 channels, on a graph with nodes lacking in-edges
    (no self loops): the training pipeline fuses it and its backward.  (Without a
    leaky_relu the destination scores cancel in the softmax: b also shifts x, so its
    gradient is not 0.)"""
    x = (h + p.b).reshape(-1, 2, 3)
    z = g.gather(x.sum(-1), "src") + g.gather((h * p.b).reshape(-1, 2, 3).sum(-1), "dst")
    e = z.leaky_relu(slope) if slope is not None else z
    return g.aggregate(x, "sum", weight=g.edge_softmax(e)).reshape(-1, 6)


OPS = {
    "relu": lambda h, g, p: h.relu(), "leaky_relu": lambda h, g, p: h.leaky_relu(0.2),
    "elu": lambda h, g, p: h.elu(0.8), "exp": lambda h, g, p: (h * 0.1).exp(),
    "log": lambda h, g, p: (h * h + 1.0).log(), "sigmoid": lambda h, g, p: h.sigmoid(),
    "tanh": lambda h, g, p: h.tanh(), "neg": lambda h, g, p: -h,
    "sqrt": lambda h, g, p: (h * h + 1.0).sqrt(), "pow": lambda h, g, p: (h * h + 1.0).pow(-0.5),
    "add_bias_scalar": lambda h, g, p: h + p.b + p.s, "sub": lambda h, g, p: p.b - h,
    "mul": lambda h, g, p: h * p.b * p.s, "div": lambda h, g, p: h / (p.b * p.b + 1.0),
    "maximum": lambda h, g, p: maximum(h, p.b), "minimum": lambda h, g, p: minimum(h, p.b),
    "concat_reshape": lambda h, g, p: concat([h, h.relu()], 1).reshape(-1, 2, 6).sum(1),
    "mean_max_axis": lambda h, g, p: concat([h.reshape(-1, 3, 2).mean(-1),
                                             h.reshape(-1, 3, 2).max(-1)], 1),
    "softmax": lambda h, g, p: h.softmax() + h.log_softmax(),
    # overlapping slices, a column no slice reads, an indexed and a sliced parameter
    "slices": lambda h, g, p: concat([h[:, 1:3] * h[:, 2:4], h[:, :2] * p.b[2],
                                      h[:, 5:] * p.b[-2:]], 1),
    "pad_with_zeros": lambda h, g, p: g.aggregate(concat([h, h.new_zeros(h.shape[0], 2)], 1),
                                                  "sum")[:, 2:],
    "aggregate_sum": lambda h, g, p: g.aggregate(h, "sum"),
    "aggregate_mean": lambda h, g, p: g.aggregate(h, "mean"),
    "aggregate_max": lambda h, g, p: g.aggregate(h, "max"),
    "aggregate_weighted": lambda h, g, p: g.aggregate(h, "sum", weight=g.gather(h.sum(-1), "src").sigmoid()),
    "aggregate_weighted_mean": lambda h, g, p: g.aggregate(h, "mean", weight=g.gather(h.sum(-1), "dst").tanh()),
    # weighted max: the backward rebuilds the messages w * x[src] to find each winner
    "aggregate_weighted_max": lambda h, g, p: g.aggregate(
        h, "max", weight=g.gather(h.sum(-1), "src").sigmoid()),
    "aggregate_weighted_max_heads": lambda h, g, p: g.aggregate(
        h.reshape(-1, 2, 3), "max",
        weight=g.gather(h.reshape(-1, 2, 3).sum(-1), "dst").tanh()).reshape(-1, 6),
    "scatter_gated_max": lambda h, g, p: g.scatter(  # fuse_aggregate makes it a weighted max
        g.gather(h.sum(-1), "dst").tanh().unsqueeze(-1) * g.gather(h, "src"), "max"),
    "scatter_messages": lambda h, g, p: g.scatter((g.gather(h, "src") - g.gather(h, "dst")).tanh(), "sum"),
    "scatter_mean": lambda h, g, p: g.scatter(g.gather(h, "src") * g.gather(h, "dst"), "mean"),
    "scatter_max": lambda h, g, p: g.scatter(g.gather(h, "src") + g.gather(h, "dst"), "max"),
    "edge_softmax_heads": lambda h, g, p: g.aggregate(
        h.reshape(-1, 2, 3), "sum",
        weight=g.edge_softmax(g.gather(h.reshape(-1, 2, 3).sum(-1), "src").leaky_relu(0.2))
    ).reshape(-1, 6),
    "attention_fused": lambda h, g, p: _attention(h, g, p, 0.2),
    "attention_fused_no_leaky_relu": lambda h, g, p: _attention(h, g, p, None),
    "self_loops_norm": lambda h, g, p: _normalized(h, g.add_self_loops()),
    "dropout": lambda h, g, p: dropout(h, 0.4),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_gradient(op):
    _fd(OPS[op])


@pytest.mark.parametrize("slope", [0.2, None])
def test_attention_backward_is_fused(slope):
    """The attention of ``test_op_gradient[attention_fused*]`` trains through the fused
    ops: no edge softmax, no edge tensor left in the training graph."""
    m = trace(Fn(lambda h, g, p: _attention(h, g, p, slope), 4),
              {"x": NodeInput(4), "edge_index": GraphInput()})
    train = training_pipeline()(m.graph.copy())
    ops = [n.op.value for n in train]
    assert ops.count("attention_aggregate") == 1
    assert ops.count("attention_grad_dst") == ops.count("attention_grad_src") == 1
    assert not [n.name for n in train if getattr(n.ty, "edge_graph", None)]


def test_a_model_input_named_like_the_loss_inputs_is_named():
    class Net(Module):
        def forward(self, x, labels, edge_index):
            return edge_index.aggregate(x * labels)
    m = trace(Net(), {"x": NodeInput(3), "labels": NodeInput(3), "edge_index": GraphInput()})
    with pytest.raises(IRError, match="already has a value named 'labels'.*rename the model's"):
        PassManager([AddLoss()])(m.graph.copy())
