"""PyG reference models with weights copied from a gcomp Model (tests only; needs torch)."""

from __future__ import annotations

import numpy as np


def _t(a):
    import torch
    return torch.as_tensor(np.asarray(a, dtype=np.float64))


def _set_linear(lin, w, b=None):
    """PyG Linear stores weight as [out, in]; gcomp stores [in, out]."""
    import torch
    with torch.no_grad():
        lin.weight.copy_(_t(w).T)
        if b is not None:
            lin.bias.copy_(_t(b))


def pyg_model(model):
    """A torch module computing the same function as the bundled gcomp ``model`` (float64)."""
    import torch
    from torch_geometric import nn as pnn

    cfg, p = model.config, model.params
    name, L = cfg["model"], cfg["layers"]
    convs = torch.nn.ModuleList()
    for i in range(L):
        pre = f"convs.{i}."
        if name == "gcn":
            w = p[pre + "lin.weight"]
            c = pnn.GCNConv(w.shape[0], w.shape[1])
            _set_linear(c.lin, w)
            with torch.no_grad():
                c.bias.copy_(_t(p[pre + "bias"]))
        elif name == "graphsage":
            w = p[pre + "lin_l.weight"]
            c = pnn.SAGEConv(w.shape[0], w.shape[1], aggr="mean")
            _set_linear(c.lin_l, w, p[pre + "lin_l.bias"])
            _set_linear(c.lin_r, p[pre + "lin_r.weight"])
        elif name == "gin":
            w1, w2 = p[pre + "nn.layers.0.weight"], p[pre + "nn.layers.2.weight"]
            mlp = torch.nn.Sequential(torch.nn.Linear(*w1.shape), torch.nn.ReLU(),
                                      torch.nn.Linear(*w2.shape))
            c = pnn.GINConv(mlp, train_eps=True)  # resets mlp: copy weights after
            _set_linear(mlp[0], w1, p[pre + "nn.layers.0.bias"])
            _set_linear(mlp[2], w2, p[pre + "nn.layers.2.bias"])
            with torch.no_grad():
                c.eps.fill_(float(p[pre + "eps"]))
        elif name == "gat":
            att = p[pre + "att_src"]
            heads, out = att.shape
            w = p[pre + "lin.weight"]
            concat = i < L - 1
            c = pnn.GATConv(w.shape[0], out, heads=heads, concat=concat)
            _set_linear(c.lin, w)
            with torch.no_grad():
                c.att_src.copy_(_t(att).reshape(1, heads, out))
                c.att_dst.copy_(_t(p[pre + "att_dst"]).reshape(1, heads, out))
                c.bias.copy_(_t(p[pre + "bias"]))
        else:
            raise ValueError(name)
        convs.append(c)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = convs

        def forward(self, x, edge_index, edge_weight=None):
            for i, c in enumerate(self.convs):
                x = c(x, edge_index, edge_weight) if edge_weight is not None else c(x, edge_index)
                if i < len(self.convs) - 1:
                    x = torch.nn.functional.elu(x) if name == "gat" else torch.relu(x)
            return x

    return Net().double()


def gcomp_named_tensors(net, model):
    """{gcomp parameter name: (torch parameter, function mapping it to gcomp's layout)}."""
    name = model.config["model"]
    out = {}
    for i, c in enumerate(net.convs):
        pre = f"convs.{i}."
        T = (lambda a: a.T)  # noqa: E731 - torch Linear [out, in] -> gcomp [in, out]
        same = (lambda a: a)  # noqa: E731
        if name == "gcn":
            out[pre + "lin.weight"] = (c.lin.weight, T)
            out[pre + "bias"] = (c.bias, same)
        elif name == "graphsage":
            out[pre + "lin_l.weight"] = (c.lin_l.weight, T)
            out[pre + "lin_l.bias"] = (c.lin_l.bias, same)
            out[pre + "lin_r.weight"] = (c.lin_r.weight, T)
        elif name == "gin":
            out[pre + "nn.layers.0.weight"] = (c.nn[0].weight, T)
            out[pre + "nn.layers.0.bias"] = (c.nn[0].bias, same)
            out[pre + "nn.layers.2.weight"] = (c.nn[2].weight, T)
            out[pre + "nn.layers.2.bias"] = (c.nn[2].bias, same)
            out[pre + "eps"] = (c.eps, lambda a: a.reshape(()))
        elif name == "gat":
            out[pre + "lin.weight"] = (c.lin.weight, T)
            heads, ch = c.heads, c.out_channels
            out[pre + "att_src"] = (c.att_src, lambda a, h=heads, k=ch: a.reshape(h, k))
            out[pre + "att_dst"] = (c.att_dst, lambda a, h=heads, k=ch: a.reshape(h, k))
            out[pre + "bias"] = (c.bias, same)
    return out
