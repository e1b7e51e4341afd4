"""One benchmark case: a graph and a bundled gcomp model with fixed weights.

Every system is built from the same ``Workload``: gcomp compiles ``model``; the peers copy
``model.params`` into their own layers, so all of them compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MODELS = ("gcn", "sage", "gin", "gat")
# run when named (--models ggnn): GatedGraphConv pads features to its width, so it needs
# --hidden at least the graph's feature count
EXTRA_MODELS = ("ggnn",)


@dataclass
class Workload:
    model_name: str
    graph_name: str
    layers: int
    hidden: int
    heads: int
    graph: object            # gcomp.runtime.data.GraphData
    x: np.ndarray            # dense float32 node features [N, F]
    y: np.ndarray            # int64 labels [N]
    train_mask: np.ndarray   # bool [N]
    model: object            # gcomp.model.Model (graph IR + params)

    @property
    def key(self) -> str:
        return f"{self.graph_name}/{self.model_name}"

    def describe(self) -> dict:
        g = self.graph
        return {"graph": self.graph_name, "model": self.model_name, "layers": self.layers,
                "hidden": self.hidden, "heads": self.heads if self.model_name == "gat" else None,
                "nodes": g.num_nodes, "edges": g.num_edges, "features": int(self.x.shape[1]),
                "classes": int(self.model.config["out_channels"]),
                "parameters": self.model.num_parameters()}


@lru_cache(maxsize=2)
def load(graph_name: str):
    """(GraphData, dense x, labels, training mask), cached: synthetic graphs take a second to
    make (arxiv size), or minutes (Reddit size); with ``GCOMP_BENCH_GRAPHS=DIR`` they are
    also kept in DIR as ``.npz`` files, so the next process of a run reads them instead."""
    g = _graph(graph_name)
    x = np.ascontiguousarray(g.dense_x(), dtype=np.float32)
    # the training mask gcomp's Trainer uses (the graph's, or its seeded 60/20/20 split), so
    # every system's loss covers the same nodes
    from gcomp.runtime.trainer import masks_of
    y = np.asarray(g.y, np.int64)
    return g, x, y, masks_of(g)[0]


def _graph(graph_name: str):
    import os
    from pathlib import Path

    from gcomp.runtime import synthetic
    from gcomp.runtime.data import load_graph
    cache = os.environ.get("GCOMP_BENCH_GRAPHS")
    if not cache or graph_name not in synthetic.SIZES:
        return load_graph(graph_name)
    path = Path(cache) / f"{graph_name}.npz"
    if path.exists():
        g = load_graph(path)
        g.name = graph_name
        return g
    g = load_graph(graph_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")  # a process killed while writing leaves no cache
    arrays = {k: getattr(g, k) for k in ("edge_index", "x", "y", "train_mask", "val_mask",
                                          "test_mask") if getattr(g, k) is not None}
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return g


def make(model_name: str, graph_name: str, layers: int, hidden: int, heads: int,
         seed: int = 0) -> Workload:
    import gcomp.models
    g, x, y, mask = load(graph_name)
    classes = int(y.max()) + 1
    model = gcomp.models.build(model_name, int(x.shape[1]), hidden=hidden, out_channels=classes,
                               layers=layers, heads=heads, seed=seed)
    return Workload(model_name, graph_name, layers, hidden, heads, g, x, y, mask, model)
