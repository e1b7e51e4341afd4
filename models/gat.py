"""GAT (Velickovic et al. 2018), as torch_geometric.nn.GATConv."""

from gcomp.frontend.builder import Linear, MessagePassing, Module, Parameter, dropout, elu


class GATConv(MessagePassing):
    """Multi-head attention: alpha_ij = softmax_j(LeakyReLU(a_src.x_j + a_dst.x_i)).

    Self loops as PyG: existing loops removed, one added per node.  Heads are
    concatenated (``concat=True``) or averaged; the bias is added last.
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0):
        super().__init__(aggr="sum")
        self.heads, self.out_channels, self.concat = heads, out_channels, concat
        self.negative_slope = negative_slope
        self.dropout = dropout  # on the attention coefficients, as PyG
        self.lin = Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = Parameter((heads, out_channels), init="glorot")
        self.att_dst = Parameter((heads, out_channels), init="glorot")
        self.bias = Parameter((heads * out_channels if concat else out_channels,), init="zeros")

    def forward(self, x, graph):
        h = self.lin(x).reshape(-1, self.heads, self.out_channels)
        a_src = (h * self.att_src).sum(-1)
        a_dst = (h * self.att_dst).sum(-1)
        g = graph.add_self_loops()
        out = self.propagate(g, x=h, a_src=a_src, a_dst=a_dst)
        if self.concat:
            out = out.reshape(-1, self.heads * self.out_channels)
        else:
            out = out.mean(axis=1)
        return out + self.bias

    def message(self, x_j, a_src_j, a_dst_i, graph):
        alpha = graph.edge_softmax((a_src_j + a_dst_i).leaky_relu(self.negative_slope))
        return x_j * dropout(alpha, self.dropout).unsqueeze(-1)


class GAT(Module):
    """Hidden layers: `heads` concatenated heads + ELU; last layer: one head (mean).
    Dropout before every layer and on attention coefficients (PyG's gat.py)."""

    def __init__(self, in_channels, hidden, out_channels, layers=2, heads=4, dropout=0.0):
        self.convs = []
        cin = in_channels
        for _ in range(layers - 1):
            self.convs.append(GATConv(cin, hidden, heads=heads, concat=True, dropout=dropout))
            cin = hidden * heads
        self.convs.append(GATConv(cin, out_channels, heads=1, concat=False, dropout=dropout))
        self.dropout = dropout

    def forward(self, x, edge_index):
        for i, conv in enumerate(self.convs):
            x = conv(dropout(x, self.dropout), edge_index)
            if i < len(self.convs) - 1:
                x = elu(x)
        return x
