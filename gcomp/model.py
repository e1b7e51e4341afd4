"""A model: a Graph IR graph plus the values of its parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gcomp.errors import IRError
from gcomp.ir.graph import Graph
from gcomp.ir.types import GraphType, TensorType, value_role
from gcomp.ir.verifier import verify


@dataclass
class Model:
    graph: Graph
    params: dict[str, np.ndarray]
    config: dict = field(default_factory=dict)  # how it was made (bundled name, sizes, seed)

    def __post_init__(self):
        verify(self.graph)
        graphs = [n.name for n in self.graph.inputs if isinstance(n.ty, GraphType)]
        if len(graphs) > 1:  # a run binds one GraphData: every graph input would get it
            raise IRError(f"the model has {len(graphs)} graph inputs "
                          f"({', '.join(map(repr, graphs))}); gcomp models take one graph "
                          "(several edge types are not supported)")
        for p in self.graph.params:
            if p.name not in self.params:
                raise IRError(f"parameter {p.name!r} has no value")
            v = np.asarray(self.params[p.name], dtype=np.float32)
            if v.shape != tuple(p.ty.shape):
                raise IRError(f"parameter {p.name!r} has shape {v.shape}, its type says {p.ty}")
            self.params[p.name] = v
        extra = set(self.params) - {p.name for p in self.graph.params}
        if extra:
            raise IRError(f"values given for unknown parameters: {', '.join(sorted(extra))}")

    @property
    def name(self) -> str:
        return self.graph.name

    def signature(self) -> dict:
        """Inputs and outputs as JSON-able dicts: name, role, type."""
        def entry(n):
            return {"name": n.name, "role": value_role(n.ty), "type": str(n.ty)}
        return {"inputs": [entry(n) for n in self.graph.inputs],
                "outputs": [entry(n) for n in self.graph.outputs]}

    def num_parameters(self) -> int:
        return int(sum(v.size for v in self.params.values()))

    def node_feature_inputs(self) -> list:
        return [n for n in self.graph.inputs if isinstance(n.ty, TensorType) and n.ty.is_node]
