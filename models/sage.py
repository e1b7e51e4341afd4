"""GraphSAGE (Hamilton et al. 2017), as torch_geometric.nn.SAGEConv with mean aggregation."""

from gcomp.frontend.builder import Linear, MessagePassing, Module, dropout, relu


class SAGEConv(MessagePassing):
    """out = lin_l(mean_{j in N(i)} x_j) + lin_r(x_i); no self loops (PyG defaults)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(aggr="mean")
        self.lin_l = Linear(in_channels, out_channels, bias=True)
        self.lin_r = Linear(in_channels, out_channels, bias=False)

    def forward(self, x, graph):
        return self.lin_l(self.propagate(graph, x=x)) + self.lin_r(x)


class GraphSAGE(Module):
    """Layers of SAGEConv with ReLU between; dropout before every layer."""

    def __init__(self, in_channels, hidden, out_channels, layers=2, dropout=0.0):
        sizes = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = [SAGEConv(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(dropout(x, self.dropout), edge_index)
            if i < len(self.convs) - 1:
                x = relu(x)
        return x
