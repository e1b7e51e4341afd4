"""Execute a plan with compiled kernels.  Needs the TVM runtime only.

``Executor(plan, lib, params)`` owns the parameter tensors.  ``bind(graph)``
prepares everything that depends on one graph, once: graph arrays, buffers
sized for its node and edge counts, views, edge inputs, and the bind-phase
kernels (degrees, normalizations); the result is cached per graph object.
``run(binding, features)`` copies node features in and calls the run-phase
kernels in order; no allocation happens there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import tvm

from gcomp.errors import InputError
from gcomp.runtime.data import GraphData, check_edge_values, check_features
from gcomp.runtime.graph import GraphStructure
from gcomp.runtime.plan import Plan


@dataclass
class Binding:
    graph: GraphData
    structures: dict[str, GraphStructure]
    dims: dict[str, int]
    buffers: dict[str, object]
    steps: list = field(default_factory=list)  # (function, args) in order
    bind_time_s: float = 0.0


class Executor:
    def __init__(self, plan: Plan, lib, params: dict[str, np.ndarray], device=None):
        self.plan = plan
        self.lib = lib
        self.device = device or tvm.cpu()
        self.functions = {}
        for k in plan.kernels():
            try:
                self.functions[k] = lib[k]
            except Exception as e:  # noqa: BLE001 - a library without a kernel is corrupt
                raise InputError(f"compiled library lacks kernel {k}: {e}") from None
        self.params = {}
        for name in plan.params:
            self.params[name] = self._tensor(params[name])
        for name, value in plan.consts.items():
            self.params[name] = self._tensor(np.asarray(value, np.float32))
        self._bindings: dict[int, Binding] = {}

    def _tensor(self, a: np.ndarray):
        t = tvm.runtime.empty(a.shape, "float32", self.device)
        t.copyfrom(np.array(a, dtype=np.float32, order="C"))  # keeps 0-d shapes
        return t

    def set_param(self, name: str, value: np.ndarray) -> None:
        self.params[name].copyfrom(np.array(value, dtype=np.float32, order="C"))

    # ------------------------------------------------------------------ binding
    def _resolve(self, dims: list, sizes: dict[str, int]) -> tuple:
        return tuple(sizes[d] if isinstance(d, str) else int(d) for d in dims)

    def bind(self, graph: GraphData) -> Binding:
        cached = self._bindings.get(id(graph))
        if cached is not None and cached.graph is graph:
            return cached
        t0 = time.perf_counter()
        structures: dict[str, GraphStructure] = {}
        for gspec in self.plan.graphs:
            if gspec["parent"] is None:
                structures[gspec["name"]] = GraphStructure.from_edge_index(graph.edge_index,
                                                                          graph.num_nodes)
            else:
                structures[gspec["name"]] = structures[gspec["parent"]].derive(gspec["mode"])
        sizes = {"N": graph.num_nodes}
        sizes.update({f"E:{k}": s.num_edges for k, s in structures.items()})
        buffers: dict[str, object] = dict(self.params)
        for name, b in self.plan.buffers.items():  # roots first, then views of them
            if name not in buffers and "alias" not in b:
                buffers[name] = tvm.runtime.empty(self._resolve(b["dims"], sizes), "float32",
                                                  self.device)
        for name, b in self.plan.buffers.items():
            if "alias" in b:
                buffers[name] = buffers[b["alias"]]._create_view(self._resolve(b["dims"], sizes))
        arrays: dict[tuple, object] = {}

        def graph_array(gname: str, array: str):
            key = (gname, array)
            if key not in arrays:
                arrays[key] = tvm.runtime.tensor(structures[gname].array(array), self.device)
            return arrays[key]

        def args_of(step):
            out = []
            for a in step["args"]:
                if "graph" in a:
                    out.append(graph_array(a["graph"], a["array"]))
                elif "view" in a:
                    out.append(buffers[a["buf"]]._create_view(self._resolve(a["view"], sizes)))
                else:
                    out.append(buffers[a["buf"]])
            return tuple(out)

        b = Binding(graph, structures, sizes, buffers)
        for inp in self.plan.inputs:
            if inp["role"] == "edge":
                w = self._edge_input(graph, inp)
                buffers[inp["name"]].copyfrom(structures[inp["graph"]].to_csr_order(w))
        for step in self.plan.bind_steps:
            self.functions[step["kernel"]](*args_of(step))
        b.steps = [(self.functions[s["kernel"]], args_of(s)) for s in self.plan.steps]
        b.bind_time_s = time.perf_counter() - t0
        self._bindings = {id(graph): b}  # keep one binding: buffers are sized per graph
        return b

    @staticmethod
    def _edge_input(graph: GraphData, inp: dict) -> np.ndarray:
        if graph.edge_weight is None:
            raise InputError(f"the model needs edge values {inp['name']!r}, and graph "
                             f"{graph.name!r} has no edge_weight")
        w = check_edge_values(graph.edge_weight, graph.num_edges, f"{graph.name}: edge_weight")
        want = tuple(inp["dims"][1:])
        if w.shape[1:] != want:
            raise InputError(f"edge values {inp['name']!r} must have shape (E, {', '.join(map(str, want))}), "
                             f"got {w.shape}")
        return w

    # ------------------------------------------------------------------ running
    def feed(self, binding: Binding, features: dict[str, np.ndarray]) -> None:
        for inp in self.plan.inputs:
            if inp["role"] != "node":
                continue
            if inp["name"] not in features:
                raise InputError(f"missing node input {inp['name']!r}")
            x = check_features(features[inp["name"]], binding.graph.num_nodes, inp["name"])
            want = self._resolve(inp["dims"], binding.dims)
            if hasattr(x, "todense"):
                x = np.asarray(x.todense(), dtype=np.float32)
            if x.shape != want:
                raise InputError(f"input {inp['name']!r}: the model expects {want[1]} features per "
                                 f"node, got {x.shape[1]}")
            binding.buffers[inp["name"]].copyfrom(x.reshape(want))

    def execute(self, binding: Binding) -> None:
        for fn, args in binding.steps:
            fn(*args)

    def outputs(self, binding: Binding) -> list[np.ndarray]:
        outs = []
        for o in self.plan.outputs:
            v = binding.buffers[o["buffer"]].numpy()
            if o["role"] == "edge":
                v = binding.structures[o["graph"]].from_csr_order(v)
            outs.append(v)
        return outs

    def run(self, graph: GraphData, features: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """Bind ``graph`` (cached), feed node inputs (default: the graph's own ``x``), run."""
        binding = self.bind(graph)
        if features is None:
            names = [i["name"] for i in self.plan.inputs if i["role"] == "node"]
            features = {n: graph.dense_x() for n in names}
        self.feed(binding, features)
        self.execute(binding)
        return self.outputs(binding)
