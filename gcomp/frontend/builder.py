"""Python builder: write a GNN the way PyG users do, get Graph IR.

Nothing is computed here.  ``trace(module, inputs)`` calls ``module.forward``
with symbolic ``Value`` objects; every operation on them records a node in a
Graph IR graph.  Parameters are declared as attributes (``Parameter``,
``Linear``) and named by their attribute path, like ``torch.nn``.

Message passing keeps PyG's vocabulary (``torch_geometric.nn.MessagePassing``):
``propagate(graph, **kwargs)`` calls ``message(...)`` with ``x_j`` / ``x_i``
arguments lifted onto edges (source / destination side), then
``aggregate(messages, graph)`` with ``self.aggr`` and then ``update(...)``; a
``message`` parameter named ``graph`` receives the graph (for ``edge_softmax``).  The
recorded form is gather -> edge-wise ops -> scatter; the compiler (not the
user) rewrites it into fused sparse aggregation.

    class GCNConv(MessagePassing):
        def __init__(self, cin, cout):
            super().__init__(aggr="sum")
            self.lin = Linear(cin, cout, bias=False)
            self.bias = Parameter((cout,), init="zeros")

        def forward(self, x, graph):
            g = graph.add_self_loops()
            return self.propagate(g, x=self.lin(x), norm=g.gcn_norm()) + self.bias

        def message(self, x_j, norm):
            return norm.unsqueeze(-1) * x_j

    model = trace(GCNConv(16, 4), {"x": NodeInput(16), "edge_index": GraphInput()})
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from gcomp.errors import IRError
from gcomp.frontend.outputs import distinct
from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType
from gcomp.model import Model

_TRACE: "_Tracer | None" = None
RNG_STEP = "rng_step"  # name of the scalar input that drives dropout masks


def _tracer() -> "_Tracer":
    if _TRACE is None:
        raise IRError("builder operations only work inside gcomp.frontend.builder.trace()")
    return _TRACE


# ------------------------------------------------------------------ initializers
def init_array(init: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Parameter initializers (the names PyG and torch use)."""
    shape = tuple(shape)
    if init == "zeros":
        return np.zeros(shape, np.float32)
    if init == "ones":
        return np.ones(shape, np.float32)
    if init == "glorot":
        fan_in, fan_out = (shape[-2], shape[-1]) if len(shape) >= 2 else (1, shape[0])
        a = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-a, a, shape).astype(np.float32)
    if init == "uniform":  # torch.nn.Linear's bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        a = 1.0 / math.sqrt(shape[0])
        return rng.uniform(-a, a, shape).astype(np.float32)
    if init == "normal":
        return rng.standard_normal(shape).astype(np.float32)
    raise IRError(f"unknown initializer {init!r} (zeros, ones, glorot, uniform, normal)")


# ------------------------------------------------------------------ values
class Value:
    """A symbolic tensor produced while tracing; operators record IR nodes."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    @property
    def type(self) -> TensorType:
        return self.node.ty

    @property
    def shape(self) -> tuple:
        return self.node.ty.shape

    def __repr__(self) -> str:
        return f"Value(%{self.node.name}: {self.node.ty})"

    # arithmetic
    def __add__(self, o): return _binary(Op.ADD, self, o)
    def __radd__(self, o): return _binary(Op.ADD, o, self)
    def __sub__(self, o): return _binary(Op.SUB, self, o)
    def __rsub__(self, o): return _binary(Op.SUB, o, self)
    def __mul__(self, o): return _binary(Op.MUL, self, o)
    def __rmul__(self, o): return _binary(Op.MUL, o, self)
    def __truediv__(self, o): return _binary(Op.DIV, self, o)
    def __rtruediv__(self, o): return _binary(Op.DIV, o, self)
    def __neg__(self): return _op(Op.NEG, [self])
    def __matmul__(self, w): return _op(Op.MATMUL, [self, w])

    # elementwise
    def relu(self): return _op(Op.RELU, [self])
    def leaky_relu(self, negative_slope: float = 0.01):
        return _op(Op.LEAKY_RELU, [self], alpha=float(negative_slope))
    def elu(self, alpha: float = 1.0): return _op(Op.ELU, [self], alpha=float(alpha))
    def exp(self): return _op(Op.EXP, [self])
    def log(self): return _op(Op.LOG, [self])
    def sigmoid(self): return _op(Op.SIGMOID, [self])
    def tanh(self): return _op(Op.TANH, [self])
    def sqrt(self): return _op(Op.SQRT, [self])
    def pow(self, exponent: float): return _op(Op.POW, [self], exponent=float(exponent))

    # shapes and reductions
    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        lead = self.shape[0] if self.shape else None
        out = []
        for i, d in enumerate(shape):
            if i == 0 and lead is not None and not isinstance(lead, int) and d == -1:
                out.append("N" if lead == N else "E")  # PyG's view(-1, ...) keeps the symbolic axis
            else:
                out.append(d)
        return _op(Op.RESHAPE, [self], shape=out)
    view = reshape

    def unsqueeze(self, axis: int):
        shape = list(self.shape)
        axis = axis + len(shape) + 1 if axis < 0 else axis
        shape.insert(axis, 1)
        return self.reshape([-1] + shape[1:] if not isinstance(shape[0], int) else shape)

    def sum(self, axis: int = -1, keepdims: bool = False):
        return _op(Op.SUM, [self], axis=axis, keepdims=keepdims)

    def mean(self, axis: int = -1, keepdims: bool = False):
        return _op(Op.MEAN, [self], axis=axis, keepdims=keepdims)

    def max(self, axis: int = -1, keepdims: bool = False):
        return _op(Op.MAX, [self], axis=axis, keepdims=keepdims)

    def softmax(self, axis: int = -1): return _op(Op.SOFTMAX, [self], axis=axis)
    def log_softmax(self, axis: int = -1): return _op(Op.LOG_SOFTMAX, [self], axis=axis)

    def __getitem__(self, index):
        """Basic indexing of static axes, as torch: ``x[:, a:b]`` slices axis 1,
        ``w[i]`` takes row i of axis 0 (a slice, then a reshape dropping the axis)."""
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.shape):
            raise IRError(f"too many indices for {self}")
        out, keep = self, []
        for ax, ix in enumerate(index + (slice(None),) * (len(self.shape) - len(index))):
            d = self.shape[ax]
            if ix == slice(None):
                keep.append(-1 if ax == 0 and not isinstance(d, int) else d)
                continue
            if not isinstance(d, int):
                raise IRError(f"cannot index the symbolic axis {ax} of {self}")
            if isinstance(ix, int) and not isinstance(ix, bool):
                if not -d <= ix < d:
                    raise IRError(f"index {ix} out of range for axis {ax} of {self}")
                start, stop = ix % d, ix % d + 1
            elif isinstance(ix, slice):
                start, stop, step = ix.indices(d)
                if step != 1 or stop <= start:
                    raise IRError(f"slice {ix} of axis {ax} of {self}: gcomp supports "
                                  "non-empty slices with step 1")
                keep.append(stop - start)
            else:
                raise IRError(f"cannot index {self} with {ix!r} (ints and slices only)")
            if (start, stop) != (0, d):
                out = _op(Op.SLICE, [out], axis=ax, start=start, stop=stop)
        return out.reshape(keep) if len(keep) < len(self.shape) else out

    def new_zeros(self, *shape):
        """Zeros of ``shape`` (torch's ``x.new_zeros``): static sizes, the first may be
        ``x.shape[0]``, the symbolic number of nodes."""
        return Value(_tracer().emit(Op.BROADCAST_TO, [_as_node(0.0)], {"shape": list(shape)},
                                    "zeros"))


class GraphValue:
    """A symbolic graph structure (edge index) produced while tracing."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    def __repr__(self) -> str:
        return f"GraphValue(%{self.node.name})"

    def add_self_loops(self, mode: str = "add_remaining") -> "GraphValue":
        """PyG's add_remaining_self_loops (default): drop existing loops, add one per node."""
        return GraphValue(_tracer().emit(Op.SELF_LOOPS, [self.node], {"mode": mode}, "graph"))

    def remove_self_loops(self) -> "GraphValue":
        return self.add_self_loops("remove")

    def remap_edge_values(self, w: Value, fill: float = 1.0) -> Value:
        """Carry edge values of the parent graph onto this derived graph (new loops get ``fill``)."""
        return _op(Op.EDGE_REMAP, [self, w], fill=float(fill))

    def degree(self, weight: Value | None = None, side: str = "in") -> Value:
        return _op(Op.DEGREE, [self] + ([weight] if weight is not None else []), side=side)

    def gcn_norm(self, weight: Value | None = None) -> Value:
        """Symmetric normalization D^-1/2 A D^-1/2 as edge values (in-degrees, as PyG)."""
        return _op(Op.SYM_NORM, [self] + ([weight] if weight is not None else []))

    def gather(self, x: Value, side: str = "src") -> Value:
        return _op(Op.GATHER, [self, x], side=side)

    def scatter(self, e: Value, reduce: str = "sum") -> Value:
        return _op(Op.SCATTER, [self, e], reduce=_reduce_name(reduce))

    def aggregate(self, x: Value, reduce: str = "sum", weight: Value | None = None) -> Value:
        """Fused neighbour aggregation: reduce over in-edges of weight * x[src]."""
        args = [self, x] + ([weight] if weight is not None else [])
        return _op(Op.AGGREGATE, args, reduce=_reduce_name(reduce))

    def edge_softmax(self, e: Value) -> Value:
        return _op(Op.EDGE_SOFTMAX, [self, e])


def _reduce_name(r: str) -> str:
    return {"add": "sum"}.get(r, r)


def _as_node(v: Any) -> Node:
    t = _tracer()
    if isinstance(v, (Value, GraphValue)):
        return v.node
    if isinstance(v, Parameter):
        return t.param_node(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return t.emit(Op.CONST, [], {"value": float(v)}, "c", TensorType((), "float32"))
    raise IRError(f"cannot use {type(v).__name__} {v!r} in a traced GNN")


def _op(op: Op, args: Sequence, **attrs) -> Value:
    return Value(_tracer().emit(op, [_as_node(a) for a in args], attrs))


def _binary(op: Op, a, b) -> Value:
    return _op(op, [a, b])


# free functions, for users who prefer them to methods
def relu(x): return _as_value(x).relu()
def elu(x, alpha: float = 1.0): return _as_value(x).elu(alpha)
def leaky_relu(x, negative_slope: float = 0.01): return _as_value(x).leaky_relu(negative_slope)
def log_softmax(x, axis: int = -1): return _as_value(x).log_softmax(axis)
def concat(xs: Sequence, axis: int = -1) -> Value: return _op(Op.CONCAT, list(xs), axis=axis)


def dropout(x, p: float = 0.5):
    """Training-time dropout (identity when compiled for inference).

    Each call gets its own seed; the mask also depends on the training step, which the
    runtime feeds through the model's ``rng_step`` input.
    """
    if p == 0:
        return _as_value(x)
    t = _tracer()
    return _op(Op.DROPOUT, [x, Value(t.rng_step())], p=float(p), seed=t.next_seed())
def maximum(a, b): return _binary(Op.MAXIMUM, a, b)
def minimum(a, b): return _binary(Op.MINIMUM, a, b)


def _as_value(x) -> Value:
    return x if isinstance(x, Value) else Value(_as_node(x))


# ------------------------------------------------------------------ modules
class Parameter:
    """A learnable tensor, named by its attribute path when traced."""

    def __init__(self, shape: Sequence[int], init: str = "glorot"):
        self.shape = tuple(int(s) for s in shape)
        if any(s < 1 for s in self.shape):  # Linear(0, k) too
            raise IRError(f"a Parameter of shape {self.shape} holds no values; give each "
                          f"dimension at least 1")
        self.init = init

    # a Parameter can be used directly in arithmetic inside forward()
    def __add__(self, o): return _binary(Op.ADD, self, o)
    def __radd__(self, o): return _binary(Op.ADD, o, self)
    def __mul__(self, o): return _binary(Op.MUL, self, o)
    def __rmul__(self, o): return _binary(Op.MUL, o, self)
    def __getitem__(self, index): return _as_value(self)[index]


class Module:
    """Base class of traceable layers (the torch.nn.Module idea, without tensors)."""

    def __call__(self, *args, **kwargs):
        with _tracer().scope(self):
            return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def named_children(self) -> Iterator[tuple[str, Any]]:
        for k, v in vars(self).items():
            if isinstance(v, (Module, Parameter)):
                yield k, v
            elif isinstance(v, (list, tuple)):
                for i, item in enumerate(v):
                    if isinstance(item, (Module, Parameter)):
                        yield f"{k}.{i}", item

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for k, v in self.named_children():
            name = f"{prefix}{k}"
            if isinstance(v, Parameter):
                yield name, v
            else:
                yield from v.named_parameters(name + ".")


class Linear(Module):
    """y = x @ W + b with W stored as [in, out]."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True,
                 weight_init: str = "glorot", bias_init: str = "zeros"):
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = Parameter((in_channels, out_channels), weight_init)
        self.bias = Parameter((out_channels,), bias_init) if bias else None

    def forward(self, x):
        y = _op(Op.MATMUL, [x, self.weight])
        return _op(Op.BIAS_ADD, [y, self.bias]) if self.bias is not None else y


class Sequential(Module):
    def __init__(self, *layers):
        self.layers = list(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ReLU(Module):
    def forward(self, x):
        return relu(x)


class MessagePassing(Module):
    """PyG's MessagePassing: propagate = message -> aggregate -> update."""

    def __init__(self, aggr: str = "sum", flow: str = "source_to_target"):
        self.aggr = _reduce_name(aggr)
        if self.aggr not in ("sum", "mean", "max"):
            raise IRError(f"aggr={aggr!r}: gcomp supports 'sum' ('add'), 'mean' and 'max'")
        if flow != "source_to_target":
            raise IRError(f"flow={flow!r}: gcomp supports flow='source_to_target'")
        self.flow = flow

    def propagate(self, graph: GraphValue, **kwargs):
        params = inspect.signature(self.message).parameters
        args = {}
        for name in params:
            if name.endswith("_j") and name[:-2] in kwargs:
                args[name] = graph.gather(_as_value(kwargs[name[:-2]]), side="src")
            elif name.endswith("_i") and name[:-2] in kwargs:
                args[name] = graph.gather(_as_value(kwargs[name[:-2]]), side="dst")
            elif name in kwargs:
                args[name] = kwargs[name]
            elif name == "graph":  # the graph being propagated over (for edge_softmax)
                args[name] = graph
            elif params[name].default is inspect.Parameter.empty:
                raise IRError(f"{type(self).__name__}.message needs {name!r}; pass it to propagate()")
        out = self.aggregate(self.message(**args), graph)
        return self.update(out)

    def message(self, x_j):
        return x_j

    def aggregate(self, inputs: Value, graph: GraphValue) -> Value:
        return graph.scatter(inputs, reduce=self.aggr)

    def update(self, aggr_out):
        return aggr_out


# ------------------------------------------------------------------ tracing
@dataclass(frozen=True)
class NodeInput:
    """Node features [N, *shape]."""
    features: int | tuple = 1


@dataclass(frozen=True)
class GraphInput:
    """A graph structure (edge index)."""


@dataclass(frozen=True)
class EdgeInput:
    """Values on the edges of the graph input named ``graph`` ([E, *shape])."""
    graph: str
    shape: tuple = ()


class _Tracer:
    def __init__(self, name: str, seed: int):
        self.graph = Graph(name)
        self.rng = np.random.default_rng(seed)
        self.params: dict[str, np.ndarray] = {}
        self.param_names: dict[int, str] = {}
        self.param_nodes: dict[int, Node] = {}
        self.scopes: list[str] = []
        self.module_names: dict[int, str] = {}
        self.seed = seed
        self.dropouts = 0
        self._step: Node | None = None

    def rng_step(self) -> Node:
        """The scalar step counter that dropout masks depend on (created on first use)."""
        if self._step is None:
            self._step = self.graph.create_node(Op.INPUT, ty=TensorType((), "int32"),
                                                name=RNG_STEP)
        return self._step

    def next_seed(self) -> int:
        self.dropouts += 1
        return (self.seed * 1000003 + self.dropouts) & 0x7FFFFFFF

    def name_modules(self, root: Module) -> None:
        def walk(m: Module, prefix: str):
            self.module_names[id(m)] = prefix
            for k, v in m.named_children():
                full = f"{prefix}.{k}" if prefix else k
                if isinstance(v, Parameter):
                    self.param_names.setdefault(id(v), full)
                else:
                    walk(v, full)
        walk(root, "")

    def scope(self, module: Module):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.scopes.append(self.module_names.get(id(module), type(module).__name__.lower()))
            try:
                yield
            finally:
                self.scopes.pop()
        return cm()

    def hint(self, base: str) -> str:
        scope = next((s for s in reversed(self.scopes) if s), "")
        return f"{scope}.{base}" if scope else base

    def emit(self, op: Op, inputs: list, attrs: dict, hint: str | None = None, ty=None) -> Node:
        name = self.graph.fresh_name(self.hint(hint or op.value))
        return self.graph.create_node(op, inputs, attrs, ty=ty, name=name)

    def param_node(self, p: Parameter) -> Node:
        node = self.param_nodes.get(id(p))
        if node is None:
            name = self.param_names.get(id(p))
            if name is None:
                raise IRError("a Parameter must be an attribute of the traced module tree")
            node = self.graph.create_node(Op.PARAM, [], {"init": p.init},
                                          ty=TensorType(p.shape, "float32"), name=name)
            self.params[name] = init_array(p.init, p.shape, self.rng)
            self.param_nodes[id(p)] = node
        return node


def trace(module: Module, inputs: dict, name: str = "model", seed: int = 0,
          config: dict | None = None) -> Model:
    """Record ``module.forward(**inputs)`` as Graph IR; return the model with initial parameters.

    ``inputs`` maps names to ``NodeInput``, ``GraphInput`` or ``EdgeInput`` and is passed to
    ``forward`` as keyword arguments.  Parameters are initialized from ``seed`` in the order
    they are declared (so the same seed gives the same values whatever the trace order).
    """
    global _TRACE
    if _TRACE is not None:
        raise IRError("trace() cannot be nested")
    t = _TRACE = _Tracer(name, seed)
    try:
        t.name_modules(module)
        # materialize in declaration order so values do not depend on use order
        for pname, p in module.named_parameters():
            t.param_node(p)
        args = {}
        for k, spec in inputs.items():
            if isinstance(spec, GraphInput):
                args[k] = GraphValue(t.graph.create_node(Op.INPUT, ty=GraphType("coo"), name=k))
            elif isinstance(spec, NodeInput):
                feats = spec.features if isinstance(spec.features, tuple) else (spec.features,)
                if any(int(f) < 1 for f in feats):
                    raise IRError(f"input {k!r}: NodeInput{feats} has no features; each "
                                  f"node needs at least one value")
                ty = TensorType((N,) + tuple(int(f) for f in feats), "float32")
                args[k] = Value(t.graph.create_node(Op.INPUT, ty=ty, name=k))
            elif isinstance(spec, EdgeInput):
                if spec.graph not in args or not isinstance(args[spec.graph], GraphValue):
                    raise IRError(f"edge input {k!r} names graph {spec.graph!r}, declare it first")
                if any(int(d) < 1 for d in spec.shape):
                    raise IRError(f"input {k!r}: EdgeInput shape {tuple(spec.shape)} holds "
                                  f"no values; give each dimension at least 1")
                ty = TensorType((EdgeDim(spec.graph),) + tuple(spec.shape), "float32")
                args[k] = Value(t.graph.create_node(Op.INPUT, ty=ty, name=k))
            else:
                raise IRError(f"input {k!r}: expected NodeInput, GraphInput or EdgeInput")
        with t.scope(module):
            out = module.forward(**args)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for o in outs:
            if not isinstance(o, Value):
                raise IRError(f"forward() must return Values, got {type(o).__name__}")
        t.graph.set_outputs(distinct(t.graph, [o.node for o in outs], [None] * len(outs)))
        _drop_unused_params(t)
        return Model(t.graph, t.params, dict(config or {}))
    finally:
        _TRACE = None


def _drop_unused_params(t: _Tracer) -> None:
    for p in t.graph.params:
        if not p.users:
            t.graph.erase_node(p)
            del t.params[p.name]
