"""GIN (Xu et al. 2019), as torch_geometric.nn.GINConv(train_eps=True) / models.GIN."""

from gcomp.frontend.builder import (Linear, MessagePassing, Module, Parameter, ReLU, Sequential,
                                    dropout, relu)


class GINConv(MessagePassing):
    """out = nn((1 + eps) * x_i + sum_{j in N(i)} x_j) with a learnable eps (initially 0)."""

    def __init__(self, nn: Module):
        super().__init__(aggr="sum")
        self.nn = nn
        self.eps = Parameter((), init="zeros")

    def forward(self, x, graph):
        return self.nn(self.propagate(graph, x=x) + (1.0 + self.eps) * x)


class GIN(Module):
    """Each layer's MLP is Linear -> ReLU -> Linear (PyG's GIN with no normalization);
    ReLU between layers, dropout before every layer."""

    def __init__(self, in_channels, hidden, out_channels, layers=2, dropout=0.0):
        sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = [GINConv(Sequential(Linear(a, b), ReLU(), Linear(b, b)))
                      for a, b in zip(sizes[:-1], sizes[1:])]
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(dropout(x, self.dropout), edge_index)
            if i < len(self.convs) - 1:
                x = relu(x)
        return x
