"""GGNN (Li et al. 2016), as torch_geometric.nn.GatedGraphConv with a Linear readout."""

from gcomp.errors import GcompError
from gcomp.frontend.builder import Linear, MessagePassing, Module, Parameter, concat, dropout


class GRUCell(Module):
    """torch.nn.GRUCell(channels, channels) with biases: gates r, z, n in that order,

        r = sigmoid(m W_ir + b_ir + h W_hr + b_hr)
        z = sigmoid(m W_iz + b_iz + h W_hz + b_hz)
        n = tanh(m W_in + b_in + r * (h W_hn + b_hn))
        h' = (1 - z) * n + z * h

    Parameter names are torch's; weights are stored [in, 3 * channels] like gcomp's
    ``Linear``, so ``weight_ih`` here is torch's ``weight_ih.T``.
    """

    def __init__(self, channels: int):
        self.channels = channels
        self.weight_ih = Parameter((channels, 3 * channels), init="glorot")
        self.weight_hh = Parameter((channels, 3 * channels), init="glorot")
        self.bias_ih = Parameter((3 * channels,), init="zeros")
        self.bias_hh = Parameter((3 * channels,), init="zeros")

    def forward(self, m, h):
        C = self.channels
        gi = m @ self.weight_ih + self.bias_ih
        gh = h @ self.weight_hh + self.bias_hh
        r = (gi[:, :C] + gh[:, :C]).sigmoid()
        z = (gi[:, C:2 * C] + gh[:, C:2 * C]).sigmoid()
        n = (gi[:, 2 * C:] + r * gh[:, 2 * C:]).tanh()
        return n + z * (h - n)  # (1 - z) * n + z * h as torch computes it, one product fewer


class GatedGraphConv(MessagePassing):
    """h0 = x padded with zeros to ``out_channels``; then ``num_layers`` times
    m = sum_{j in N(i)} h_j W_l (no self loops, no normalization), h = GRUCell(m, h).

    ``weight`` is [num_layers, out_channels, out_channels] as PyG's; inputs wider than
    ``out_channels`` are an error, as in PyG.
    """

    def __init__(self, out_channels: int, num_layers: int):
        super().__init__(aggr="sum")
        self.out_channels, self.num_layers = out_channels, num_layers
        self.weight = Parameter((num_layers, out_channels, out_channels), init="glorot")
        self.rnn = GRUCell(out_channels)

    def forward(self, x, graph):
        pad = self.out_channels - x.shape[-1]
        if pad < 0:
            raise GcompError(f"GatedGraphConv: {x.shape[-1]} input channels exceed its "
                             f"{self.out_channels} output channels (it pads, never shrinks)")
        if pad:
            x = concat([x, x.new_zeros(x.shape[0], pad)], axis=-1)
        for i in range(self.num_layers):
            x = self.rnn(self.propagate(graph, x=x @ self.weight[i]), x)
        return x


class GGNN(Module):
    """GatedGraphConv(hidden, layers) then a Linear(hidden, out_channels) readout per node;
    dropout before the readout."""

    def __init__(self, in_channels, hidden, out_channels, layers=2, dropout=0.0):
        if in_channels > hidden:
            raise GcompError(f"ggnn: in_channels {in_channels} > hidden {hidden}; GatedGraphConv "
                             "pads node features with zeros up to hidden and cannot shrink them "
                             f"(as in PyG): use hidden >= {in_channels}")
        self.conv = GatedGraphConv(hidden, layers)
        self.lin = Linear(hidden, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):
        return self.lin(dropout(self.conv(x, edge_index), self.dropout))
