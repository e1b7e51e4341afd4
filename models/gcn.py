"""GCN (Kipf & Welling 2017), as torch_geometric.nn.GCNConv / models.GCN."""

from gcomp.frontend.builder import Linear, MessagePassing, Module, Parameter, dropout, relu


class GCNConv(MessagePassing):
    """out = D^-1/2 (A + I) D^-1/2 X W + b, self loops as PyG's add_remaining_self_loops."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(aggr="sum")
        self.lin = Linear(in_channels, out_channels, bias=False)
        self.bias = Parameter((out_channels,), init="zeros")

    def forward(self, x, graph, edge_weight=None):
        g = graph.add_self_loops()
        if edge_weight is not None:
            edge_weight = g.remap_edge_values(edge_weight, fill=1.0)
        norm = g.gcn_norm(edge_weight)
        return self.propagate(g, x=self.lin(x), norm=norm) + self.bias

    def message(self, x_j, norm):
        return norm.unsqueeze(-1) * x_j


class GCN(Module):
    """Layers of GCNConv with ReLU between; dropout before every layer (PyG's gcn.py)."""

    def __init__(self, in_channels, hidden, out_channels, layers=2, dropout=0.0):
        sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = [GCNConv(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.dropout = dropout

    def forward(self, x, edge_index, edge_weight=None):
        for i, conv in enumerate(self.convs):
            x = conv(dropout(x, self.dropout), edge_index, edge_weight)
            if i < len(self.convs) - 1:
                x = relu(x)
        return x
