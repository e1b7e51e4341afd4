"""PyG peers, float32, with the weights of the workload's gcomp model.

``pyg``          edge_index input (gather / scatter per edge)
``pyg-csr``      sparse CSR ``adj_t`` input (``ToSparseTensor(layout=torch.sparse_csr)``): SpMM
``pyg-compile``  ``torch.compile`` of the edge_index model; its first call (compilation) is
                 reported as ``setup_s["compile_s"]``, then the usual warm-ups follow

GCNConv uses ``cached=True`` (PyG's own examples do for full-graph work): the self loops and
normalization are computed on the first call and reused, as gcomp does once at bind time.
GATConv removes / adds self loops on every call (it has no cache); so does PyG in practice.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch
from torch_geometric import nn as pnn

from bench.torch_common import t32, torch_runner


def _set_linear(lin, w, b=None):
    """torch Linear stores weight as [out, in]; gcomp stores [in, out]."""
    with torch.no_grad():
        lin.weight.copy_(t32(w).T)
        if b is not None:
            lin.bias.copy_(t32(b))


class Net(torch.nn.Module):
    def __init__(self, convs, act):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)
        self.act = act

    def forward(self, x, edge):
        for i, c in enumerate(self.convs):
            x = c(x, edge)
            if i < len(self.convs) - 1:
                x = self.act(x)
        return x


class GGNN(torch.nn.Module):
    """GatedGraphConv then the Linear readout (gcomp's bundled ``ggnn``)."""

    def __init__(self, conv, lin):
        super().__init__()
        self.conv, self.lin = conv, lin

    def forward(self, x, edge):
        return self.lin(self.conv(x, edge))


def _ggnn(p: dict, hidden: int, steps: int) -> GGNN:
    conv = pnn.GatedGraphConv(hidden, steps, aggr="add")
    with torch.no_grad():
        conv.weight.copy_(t32(p["conv.weight"]))
        for k in ("weight_ih", "weight_hh"):  # gcomp stores [in, 3 out], torch [3 out, in]
            getattr(conv.rnn, k).copy_(t32(p[f"conv.rnn.{k}"]).T)
        for k in ("bias_ih", "bias_hh"):
            getattr(conv.rnn, k).copy_(t32(p[f"conv.rnn.{k}"]))
    w = p["lin.weight"]
    lin = torch.nn.Linear(*w.shape)
    _set_linear(lin, w, p["lin.bias"])
    return GGNN(conv, lin)


def build_module(model, csr: bool = False) -> torch.nn.Module:
    """A PyG module computing the same function as the bundled gcomp ``model`` (float32).
    ``csr``: the layer options that go with the adjacency of ``csr_input``."""
    cfg, p = model.config, model.params
    name, L = cfg["model"], cfg["layers"]
    if name == "ggnn":
        return _ggnn(p, cfg["hidden"], L)
    convs = []
    for i in range(L):
        pre = f"convs.{i}."
        if name == "gcn":
            w = p[pre + "lin.weight"]
            c = pnn.GCNConv(w.shape[0], w.shape[1], cached=True, normalize=not csr)
            _set_linear(c.lin, w)
            with torch.no_grad():
                c.bias.copy_(t32(p[pre + "bias"]))
        elif name == "graphsage":
            w = p[pre + "lin_l.weight"]
            c = pnn.SAGEConv(w.shape[0], w.shape[1], aggr="sum" if csr else "mean")
            _set_linear(c.lin_l, w, p[pre + "lin_l.bias"])
            _set_linear(c.lin_r, p[pre + "lin_r.weight"])
        elif name == "gin":
            w1, w2 = p[pre + "nn.layers.0.weight"], p[pre + "nn.layers.2.weight"]
            mlp = torch.nn.Sequential(torch.nn.Linear(*w1.shape), torch.nn.ReLU(),
                                      torch.nn.Linear(*w2.shape))
            c = pnn.GINConv(mlp, train_eps=True)  # resets mlp: copy the weights after
            _set_linear(mlp[0], w1, p[pre + "nn.layers.0.bias"])
            _set_linear(mlp[2], w2, p[pre + "nn.layers.2.bias"])
            with torch.no_grad():
                c.eps.fill_(float(p[pre + "eps"]))
        elif name == "gat":
            att = p[pre + "att_src"]
            heads, out = att.shape
            w = p[pre + "lin.weight"]
            c = pnn.GATConv(w.shape[0], out, heads=heads, concat=i < L - 1, add_self_loops=not csr)
            _set_linear(c.lin, w)
            with torch.no_grad():
                c.att_src.copy_(t32(att).reshape(1, heads, out))
                c.att_dst.copy_(t32(p[pre + "att_dst"]).reshape(1, heads, out))
                c.bias.copy_(t32(p[pre + "bias"]))
        else:
            raise ValueError(f"no PyG equivalent for gcomp model {name!r}")
        convs.append(c)
    return Net(convs, torch.nn.functional.elu if name == "gat" else torch.relu)


def csr_adj_t(edge_index, num_nodes: int, values=None, coalesce: bool = True) -> torch.Tensor:
    """adj_t[target, source] as a torch sparse CSR tensor.

    ``coalesce``: one entry per (target, source) pair holding the sum of the edges' values
    (the multiplicity when ``values`` is None) -- a valid CSR matrix, and on a simple graph
    exactly what ``ToSparseTensor(layout=torch.sparse_csr)`` makes.  ``ToSparseTensor`` itself
    drops the multiplicity of repeated edges, so on a multigraph (the synthetic graphs) it
    describes another graph.  Without ``coalesce`` every edge keeps its own entry.
    """
    src, dst = (np.asarray(a, np.int64) for a in edge_index)
    vals = np.ones(len(src), np.float32) if values is None else np.asarray(values, np.float32)
    key = dst * num_nodes + src
    if coalesce:
        key, inv = np.unique(key, return_inverse=True)
        vals = np.bincount(inv, weights=vals, minlength=len(key)).astype(np.float32)
    else:
        order = np.argsort(key, kind="stable")
        key, vals = key[order], vals[order]
    rows, cols = key // num_nodes, key % num_nodes
    crow = np.zeros(num_nodes + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=num_nodes), out=crow[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(torch.from_numpy(crow), torch.from_numpy(cols),
                                       torch.from_numpy(vals), (num_nodes, num_nodes))


def csr_input(kind: str, edge_index: np.ndarray, num_nodes: int):
    """The adj_t input of the ``pyg-csr`` configuration (and how it was made), for the module
    of ``build_module(model, csr=True)``.  Each form computes the edge_index model's function,
    on multigraphs too (the harness checks):
    gcn   values = PyG's gcn_norm of the edge index (self loops, in-degree normalization), and
          GCNConv(normalize=False): the normalization cached=True would compute, made up front
    gin   values = edge multiplicities; the sum aggregation is one SpMM (ggnn: the same)
    sage  values = multiplicity / in-degree and SAGEConv(aggr="sum"): the mean over the
          multigraph (torch's reduce="mean" SpMM divides by the number of stored entries)
    gat   one entry per edge (repeated edges kept: attention weighs each edge), self loops
          replaced as GATConv does, GATConv(add_self_loops=False).  Repeated column indices
          break torch's CSR invariants (not checked by default); GATConv only reads the
          entries back as an edge list, and the output check confirms the result
    """
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import add_self_loops, remove_self_loops
    ei = torch.from_numpy(edge_index)
    if kind == "gcn":
        ei2, w = gcn_norm(ei, None, num_nodes, add_self_loops=True)
        return csr_adj_t(ei2.numpy(), num_nodes, w.numpy()), "adj_t = gcn_norm'd CSR, normalize=False"
    if kind in ("gin", "ggnn"):
        return csr_adj_t(edge_index, num_nodes), "adj_t = CSR with edge multiplicities"
    if kind == "graphsage":
        deg = np.bincount(edge_index[1], minlength=num_nodes).astype(np.float32)
        return (csr_adj_t(edge_index, num_nodes, 1.0 / deg[edge_index[1]]),
                "adj_t = CSR with multiplicity / in-degree, SAGEConv aggr='sum' (= mean)")
    if kind == "gat":
        ei2, _ = add_self_loops(remove_self_loops(ei)[0], num_nodes=num_nodes)
        return (csr_adj_t(ei2.numpy(), num_nodes, coalesce=False),
                "adj_t = CSR, one entry per edge (repeats kept), self loops added up front, "
                "add_self_loops=False")
    raise ValueError(kind)


def make(config: str, workload, mode: str):
    setup, notes = {}, []
    t0 = time.perf_counter()
    module = build_module(workload.model, csr=config == "pyg-csr")
    x = torch.from_numpy(workload.x)
    ei = torch.from_numpy(workload.graph.edge_index)
    if config == "pyg-csr":
        edge, how = csr_input(workload.model.config["model"], workload.graph.edge_index,
                              workload.graph.num_nodes)
        notes.append(how)
    else:
        edge = ei
    setup["build_s"] = time.perf_counter() - t0
    fn = module
    if config == "pyg-compile":
        if workload.model_name == "gcn":
            with torch.no_grad():
                module(x, edge)  # fill GCNConv's cache eagerly, so dynamo traces the cached path
        fn = torch.compile(module)
        notes.append("torch.compile(default mode); compile_s = first call, compilation included")
    if workload.model_name == "gcn" and config != "pyg-csr":
        notes.append("GCNConv(cached=True): normalization computed on the first call")
    return torch_runner(config, module, lambda: fn(x, edge), workload, mode, setup, notes,
                        compile_first=config == "pyg-compile")
