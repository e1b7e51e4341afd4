"""Bundled GNN models, importable as ``gcomp.models``.

Each model follows the PyG layer of the same name (same math, same self-loop
handling), so that weights copied from PyG give the same outputs.  ``build``
returns a traced :class:`gcomp.model.Model`.
"""

from __future__ import annotations

from gcomp.errors import GcompError
from gcomp.models.gat import GAT
from gcomp.models.gcn import GCN
from gcomp.models.ggnn import GGNN
from gcomp.models.gin import GIN
from gcomp.models.sage import GraphSAGE

REGISTRY = {"gcn": GCN, "sage": GraphSAGE, "graphsage": GraphSAGE, "gin": GIN, "gat": GAT,
            "ggnn": GGNN}


def build(name: str, in_channels: int, hidden: int = 16, out_channels: int = 7, layers: int = 2,
          heads: int = 4, seed: int = 0, edge_weight: bool = False, dropout: float = 0.0):
    """Trace the bundled model ``name`` (gcn, sage, gin, gat, ggnn) with the given sizes."""
    from gcomp.frontend.builder import EdgeInput, GraphInput, NodeInput, trace

    key = name.lower()
    if key not in REGISTRY:
        raise GcompError(f"unknown model {name!r}; bundled models: gcn, sage, gin, gat, ggnn")
    for what, v in (("in_channels", in_channels), ("hidden", hidden), ("out_channels", out_channels),
                    ("layers", layers), ("heads", heads)):
        if not isinstance(v, int) or v < 1:
            raise GcompError(f"{what} must be a positive integer, got {v!r}")
    cls = REGISTRY[key]
    if not 0.0 <= dropout < 1.0:
        raise GcompError(f"dropout must be in [0, 1), got {dropout!r}")
    kwargs = dict(in_channels=in_channels, hidden=hidden, out_channels=out_channels, layers=layers,
                  dropout=float(dropout))
    if cls is GAT:
        kwargs["heads"] = heads
    if edge_weight and cls is not GCN:
        raise GcompError(f"model {name!r} takes no edge weights (only gcn does)")
    module = cls(**kwargs)
    inputs = {"x": NodeInput(in_channels), "edge_index": GraphInput()}
    if edge_weight:
        inputs["edge_weight"] = EdgeInput("edge_index")
    config = {"model": cls.__name__.lower(), **kwargs, "seed": seed, "edge_weight": edge_weight}
    return trace(module, inputs, name=key if key != "graphsage" else "sage", seed=seed,
                 config=config)
