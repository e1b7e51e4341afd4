"""DGL peer (full graph), float32, with the weights of the workload's gcomp model.

Graph preparation happens once, in setup (``setup_s["graph_s"]``), as gcomp's bind does:

GCN   self loops: existing ones removed, one per node added (PyG's add_remaining_self_loops).
      ``GraphConv(norm='both')`` normalizes sources by their *out*-degree, PyG / gcomp by the
      in-degree; the two agree when every node's in- and out-degree are equal (symmetric
      graphs such as cora).  Otherwise the harness passes PyG's normalization as edge weights
      to ``GraphConv(norm='none')`` -- the same function, through DGL's u_mul_e kernel.
SAGE  ``SAGEConv('mean')`` on the graph as given.
GIN   ``GINConv(aggregator_type='sum', learn_eps=True)``.
GAT   ``GATConv`` on the graph with self loops replaced as for GCN (what PyG's GATConv does).
GGNN  DGL's ``GatedGraphConv`` shares one message weight across its steps (PyG and gcomp
      have one per step), so the peer is what it runs, with a weight per step: the zero
      padding, ``update_all(copy_u, sum)`` of ``h W_l`` and ``torch.nn.GRUCell``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.env import import_dgl
from bench.torch_common import t32, torch_runner

dgl = import_dgl()
from dgl import nn as dnn  # noqa: E402


def _set_linear(lin, w, b=None):
    with torch.no_grad():
        lin.weight.copy_(t32(w).T)
        if b is not None:
            lin.bias.copy_(t32(b))


class Net(torch.nn.Module):
    def __init__(self, convs, kind, edge_weight=None):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)
        self.kind = kind
        self.edge_weight = edge_weight

    def forward(self, g, x):
        last = len(self.convs) - 1
        for i, c in enumerate(self.convs):
            if self.kind == "gcn":
                x = c(g, x, edge_weight=self.edge_weight)
            else:
                x = c(g, x)
            if self.kind == "gat":  # [N, heads, out]: concat hidden heads, average the last
                x = x.mean(1) if i == last else x.flatten(1)
            if i < last:
                x = torch.nn.functional.elu(x) if self.kind == "gat" else torch.relu(x)
        return x


def prepare_graph(kind: str, edge_index: np.ndarray, num_nodes: int):
    """(DGLGraph, edge weights or None, note)."""
    src, dst = torch.from_numpy(edge_index[0]), torch.from_numpy(edge_index[1])
    g = dgl.graph((src, dst), num_nodes=num_nodes)
    if kind not in ("gcn", "gat"):
        return g, None, None
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    if kind == "gat":
        return g, None, None
    deg_in, deg_out = g.in_degrees(), g.out_degrees()
    if torch.equal(deg_in, deg_out):
        return g, None, "GraphConv(norm='both'): in- and out-degrees agree on this graph"
    s, d = g.edges()
    dinv = deg_in.float().clamp(min=1).pow(-0.5)
    w = dinv[s] * dinv[d]
    return g, w, ("GraphConv(norm='none') with PyG's in-degree normalization as edge weights "
                  "(directed graph: norm='both' would use out-degrees for sources)")


class GGNN(torch.nn.Module):
    """GatedGraphConv with one weight per step, then the Linear readout."""

    def __init__(self, p: dict, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(t32(p["conv.weight"]).clone())  # [steps, h, h]
        self.rnn = torch.nn.GRUCell(hidden, hidden)
        with torch.no_grad():
            for k in ("weight_ih", "weight_hh"):  # gcomp stores [in, 3 out]
                getattr(self.rnn, k).copy_(t32(p[f"conv.rnn.{k}"]).T)
            for k in ("bias_ih", "bias_hh"):
                getattr(self.rnn, k).copy_(t32(p[f"conv.rnn.{k}"]))
        w = p["lin.weight"]
        self.lin = torch.nn.Linear(*w.shape)
        _set_linear(self.lin, w, p["lin.bias"])

    def forward(self, g, x):
        h = torch.nn.functional.pad(x, (0, self.weight.shape[1] - x.shape[1]))
        for w in self.weight:
            with g.local_scope():
                g.srcdata["m"] = h @ w
                g.update_all(dgl.function.copy_u("m", "msg"), dgl.function.sum("msg", "a"))
                h = self.rnn(g.dstdata["a"], h)
        return self.lin(h)


def build_module(model, edge_weight) -> torch.nn.Module:
    cfg, p = model.config, model.params
    name, L = cfg["model"], cfg["layers"]
    if name == "ggnn":
        return GGNN(p, cfg["hidden"])
    convs = []
    for i in range(L):
        pre = f"convs.{i}."
        if name == "gcn":
            w = p[pre + "lin.weight"]  # [in, out], as DGL stores it
            c = dnn.GraphConv(w.shape[0], w.shape[1], norm="none" if edge_weight is not None
                              else "both")
            with torch.no_grad():
                c.weight.copy_(t32(w))
                c.bias.copy_(t32(p[pre + "bias"]))
        elif name == "graphsage":
            w = p[pre + "lin_l.weight"]
            c = dnn.SAGEConv(w.shape[0], w.shape[1], "mean")
            _set_linear(c.fc_neigh, w)
            _set_linear(c.fc_self, p[pre + "lin_r.weight"], p[pre + "lin_l.bias"])
        elif name == "gin":
            w1, w2 = p[pre + "nn.layers.0.weight"], p[pre + "nn.layers.2.weight"]
            mlp = torch.nn.Sequential(torch.nn.Linear(*w1.shape), torch.nn.ReLU(),
                                      torch.nn.Linear(*w2.shape))
            _set_linear(mlp[0], w1, p[pre + "nn.layers.0.bias"])
            _set_linear(mlp[2], w2, p[pre + "nn.layers.2.bias"])
            c = dnn.GINConv(mlp, "sum", init_eps=float(p[pre + "eps"]), learn_eps=True)
        elif name == "gat":
            att = p[pre + "att_src"]
            heads, out = att.shape
            w = p[pre + "lin.weight"]
            c = dnn.GATConv(w.shape[0], out, heads)
            _set_linear(c.fc, w)
            with torch.no_grad():
                c.attn_l.copy_(t32(att).reshape(1, heads, out))   # source side
                c.attn_r.copy_(t32(p[pre + "att_dst"]).reshape(1, heads, out))
                c.bias.copy_(t32(p[pre + "bias"]))
        else:
            raise ValueError(f"no DGL equivalent for gcomp model {name!r}")
        convs.append(c)
    return Net(convs, "gcn" if name == "gcn" else "gat" if name == "gat" else name,
               edge_weight)


def make(workload, mode: str):
    setup, notes = {}, []
    t0 = time.perf_counter()
    kind = workload.model.config["model"]
    g, w, note = prepare_graph(kind, workload.graph.edge_index, workload.graph.num_nodes)
    g.create_formats_()  # build CSR / CSC now rather than inside the first timed call
    setup["graph_s"] = time.perf_counter() - t0
    if note:
        notes.append(note)
    t0 = time.perf_counter()
    module = build_module(workload.model, w)
    setup["build_s"] = time.perf_counter() - t0
    x = torch.from_numpy(workload.x)
    return torch_runner("dgl", module, lambda: module(g, x), workload, mode, setup, notes)
