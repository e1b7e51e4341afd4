"""What the ONNX importer knows about each tensor, and how a tensor becomes Graph IR.

The importer interprets an ONNX graph abstractly (``onnx_ops`` holds the
transfer function of every ONNX op).  Each ONNX tensor gets one of these
values:

``Known``       a compile-time array (numpy; dtype ``object`` when entries are
                symbolic sizes); initializer-derived floats remember their name
``Fill``        a constant-filled tensor whose shape is symbolic (ones over edges)
``NodeIds``     ``arange(N)`` laid along one axis (PyG builds self loops from it)
``GraphIndex``  the ``[2, E]`` edge index of a graph (``[E, 2]`` when transposed)
``Row``         its source or destination row, possibly reshaped/broadcast
``EdgeMask``    ``src == dst`` (or its negation) per edge
``EdgeIds``     ids of the edges that are (not) self loops: ``NonZero`` of a mask
``LoopNodes``   the node of each self-loop edge
``InfMask``     ``t == inf`` for a float tensor ``t``
``Adjacency``   a dense ``[N, N]`` adjacency input, bound as a graph
``Tensor``      a float tensor the compiled model computes: a node tensor
                ``[N, ...]``, an edge tensor ``[E(g), ...]`` or a static one

A ``Tensor`` is lazy: ``pat`` says how to build it, and IR is emitted only for
tensors an output needs, so recognized patterns (``DegreeExpr``, ``Product``,
``ScatterRed`` ...) can be rewritten into ``degree``/``sym_norm``/``scatter``/
``edge_softmax`` before anything is materialized.  ``tag`` records facts that
only recognition uses (the steps of a softmax: ``Shifted``, ``ExpShifted``,
``SumExp``).  A value that only feeds recognized patterns (PyG's scatter-max
start value, self-loop weights alone) has an ``Unavailable``-style pattern that
explains itself if an output needs it after all.

Graphs are ``GraphDesc`` values, interned by structure: removing self loops
and adding one per node is the same graph as PyG's add_remaining_self_loops,
however an exporter spelled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gcomp.errors import GcompError, ModelImportError
from gcomp.frontend.onnx_dims import Dim, Lin, fmt, is_static, same
from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import N as IR_N
from gcomp.ir.types import EdgeDim, TensorType

N_ATOM = "N"


# ====================================================================== graphs
@dataclass(eq=False)
class GraphDesc:
    """A graph structure: an input, or self loops removed from / added to another graph."""

    key: str                      # structural identity, e.g. "ar(edge_index)"
    kind: str                     # input | remove | add | add_remaining
    parent: "GraphDesc | None"
    num_edges: Dim
    ir: Node | None = None

    @property
    def loop_free(self) -> bool:
        return self.kind == "remove"

    def __repr__(self) -> str:
        return f"graph {self.key}"


# ====================================================================== values
class Value:
    """Base of abstract values: an ONNX tensor's shape, coarse dtype and meaning."""

    dtype = "float"  # float | int | bool
    shape: tuple = ()
    origin: str = ""  # the ONNX tensor this value was computed for (names IR values)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        return f"{type(self).__name__.lower()} {fmt(self.shape)}"


class Known(Value):
    """A value known while importing.  ``param`` = (initializer name, layout ops) for floats
    that come from an initializer through layout-only ops, so they stay parameters."""

    def __init__(self, arr, dtype: str | None = None, param: tuple | None = None, origin: str = ""):
        self.arr = np.asarray(arr)
        if dtype is None:
            k = self.arr.dtype.kind
            dtype = "float" if k in "fc" else "bool" if k == "b" else "int"
        self.dtype = dtype
        self.shape = tuple(int(d) for d in self.arr.shape)
        self.param = param
        self.origin = origin

    def uniform(self):
        """The single value of all elements, or None."""
        if self.arr.size == 0 or self.arr.dtype == object:
            return None
        flat = self.arr.reshape(-1)
        return flat[0].item() if np.all(flat == flat[0]) else None


class Fill(Value):
    def __init__(self, value, shape: tuple, dtype: str, origin: str = ""):
        self.value, self.shape, self.dtype, self.origin = value, tuple(shape), dtype, origin


class NodeIds(Value):
    """Element [..., i, ...] (i at ``axis``) is i, for i < N."""

    dtype = "int"

    def __init__(self, shape: tuple, axis: int, origin: str = ""):
        self.shape, self.axis, self.origin = tuple(shape), axis, origin


class GraphIndex(Value):
    dtype = "int"

    def __init__(self, gd: GraphDesc, transposed: bool = False, origin: str = ""):
        self.gd, self.transposed, self.origin = gd, transposed, origin
        self.shape = (gd.num_edges, 2) if transposed else (2, gd.num_edges)


class Row(Value):
    """Element [e, ...] is src(e) or dst(e) of ``gd``; trailing axes are broadcast copies."""

    dtype = "int"

    def __init__(self, gd: GraphDesc, side: str, shape: tuple, origin: str = ""):
        self.gd, self.side, self.shape, self.origin = gd, side, tuple(shape), origin


class EdgeMask(Value):
    dtype = "bool"

    def __init__(self, gd: GraphDesc, loop: bool, origin: str = ""):
        self.gd, self.loop, self.shape, self.origin = gd, loop, (gd.num_edges,), origin


class EdgeIds(Value):
    """Ids of ``gd``'s self-loop edges (``loop``) or other edges, in order, laid along ``axis``."""

    dtype = "int"

    def __init__(self, gd: GraphDesc, loop: bool, shape: tuple, axis: int, origin: str = ""):
        self.gd, self.loop, self.shape, self.axis, self.origin = gd, loop, tuple(shape), axis, origin


class LoopNodes(Value):
    """The node of each self-loop edge of ``gd`` (in edge order); trailing unit axes."""

    dtype = "int"

    def __init__(self, gd: GraphDesc, shape: tuple, origin: str = ""):
        self.gd, self.shape, self.origin = gd, tuple(shape), origin


class InfMask(Value):
    dtype = "bool"

    def __init__(self, t: "Tensor", origin: str = ""):
        self.t, self.shape, self.origin = t, t.shape, origin


class Adjacency(Value):
    """A dense adjacency input: A[i, j] = number of edges j -> i of graph ``gd``."""

    def __init__(self, gd: GraphDesc, n: Dim, origin: str = ""):
        self.gd, self.shape, self.origin = gd, (n, n), origin


class Tensor(Value):
    """A float tensor of the compiled model, built lazily from ``pat``.

    ``view_of``: the tensor this one only reshapes (unit axes) or broadcasts along
    trailing axes, so recognizers can look through PyG's view/expand steps.
    """

    def __init__(self, pat: "Pattern", shape: tuple, origin: str = "", tag: Any = None,
                 view_of: "Tensor | None" = None):
        self.pat, self.shape, self.origin, self.tag = pat, tuple(shape), origin, tag
        self.view_of = view_of
        self.ir: Node | None = None


def unview(t: Value) -> Value:
    while isinstance(t, Tensor) and t.view_of is not None:
        t = t.view_of
    return t


# ====================================================================== patterns
class Pattern:
    """How to build a Tensor's IR.  ``emit`` returns a node whose shape broadcasts to the
    tensor's (equal, or with unit/missing axes for a virtual broadcast)."""

    def emit(self, ctx: "Emitter", t: Tensor) -> Node:
        raise NotImplementedError


@dataclass(eq=False)
class FromIR(Pattern):
    node: Node

    def emit(self, ctx, t):
        return self.node


@dataclass(eq=False)
class Generic(Pattern):
    """One IR op over the IR of ``args`` (Tensors or Known scalars/parameters)."""

    op: Op
    args: list
    attrs: dict = field(default_factory=dict)
    full_args: bool = False  # args must have exactly their ONNX shape (no virtual broadcast)

    def emit(self, ctx, t):
        ins = [ctx.full(a) if self.full_args else ctx.ir(a) for a in self.args]
        return ctx.node(self.op, ins, self.attrs, t)


@dataclass(eq=False)
class Reshape(Pattern):
    src: Tensor

    def emit(self, ctx, t):
        x = ctx.full(self.src)
        lead = t.shape[0] if t.shape else None
        if lead is not None and not is_static(lead):
            kind = "N" if same(lead, Lin.atom(N_ATOM)) else "E"
            target = [kind] + [int(d) for d in t.shape[1:]]
        else:
            target = [int(d) for d in t.shape]
        return ctx.node(Op.RESHAPE, [x], {"shape": target}, t)


@dataclass(eq=False)
class Bcast(Pattern):
    """Expand: the IR stays the source's; binary ops broadcast it (``Emitter.full`` if needed)."""

    src: Tensor

    def emit(self, ctx, t):
        return ctx.ir(self.src)


@dataclass(eq=False)
class Unavailable(Pattern):
    """A value that only feeds recognized patterns and has no IR of its own."""

    why: str

    def emit(self, ctx, t):
        raise ModelImportError(self.why)


@dataclass(eq=False)
class DegreeExpr(Pattern):
    """scale * (in- or out-) degree of ``gd`` weighted by ``w``, then clamped below by
    ``clamp``, raised to ``exponent``, with inf replaced by 0 when ``masked``."""

    gd: GraphDesc
    w: Tensor | None
    side: str = "in"
    scale: float = 1.0
    clamp: float | None = None
    exponent: float = 1.0
    masked: bool = False

    def but(self, **kw) -> "DegreeExpr":
        d = dict(self.__dict__)
        d.update(kw)
        return DegreeExpr(**d)

    def is_count_clamped(self) -> bool:
        """max(number of in-edges, 1): the divisor of PyG's mean aggregation."""
        return (self.w is None and self.side == "in" and self.scale == 1.0
                and self.clamp == 1.0 and self.exponent == 1.0 and not self.masked)

    def emit(self, ctx, t):
        args = [ctx.graph_ir(self.gd)] + ([ctx.full(self.w)] if self.w is not None else [])
        v = ctx.node(Op.DEGREE, args, {"side": self.side}, t, suffix="deg")
        if self.scale != 1.0:
            v = ctx.node(Op.MUL, [ctx.scalar(self.scale), v], {}, t, suffix="scaled")
        if self.clamp is not None:
            v = ctx.node(Op.MAXIMUM, [v, ctx.scalar(self.clamp)], {}, t, suffix="clamped")
        if self.exponent != 1.0:
            v = ctx.node(Op.POW, [v], {"exponent": float(self.exponent)}, t, suffix="pow")
        # a degree can be 0, so deg ** negative gives inf, which ONNX then masked to 0
        if self.masked and self.exponent < 0 and not (self.clamp is not None and self.clamp > 0):
            raise ModelImportError(
                "the degree power with inf replaced by 0 (PyG's deg.pow(-0.5) masked_fill) is "
                "only supported inside the symmetric normalization deg^-1/2[src] * w * "
                "deg^-1/2[dst]; the IR has no select op to express it alone")
        return v


@dataclass(eq=False)
class Gathered(Pattern):
    """x[src(e)] or x[dst(e)] for the edges of ``gd``."""

    x: Tensor
    gd: GraphDesc
    side: str

    def emit(self, ctx, t):
        return ctx.node(Op.GATHER, [ctx.graph_ir(self.gd), ctx.full(self.x)],
                        {"side": self.side}, t)


@dataclass(eq=False)
class Product(Pattern):
    """The product of 1-D edge tensors of one graph; emitted with sym_norm recognized."""

    factors: list

    def emit(self, ctx, t):
        fs = list(self.factors)
        norm = _find_sym_norm(fs)
        out = None
        if norm is not None:
            gd, w, used = norm
            args = [ctx.graph_ir(gd)] + ([ctx.full(w)] if w is not None else [])
            out = ctx.node(Op.SYM_NORM, args, {}, t, suffix="norm")
            fs = [f for f in fs if not any(f is u for u in used)]
        for f in fs:
            out = ctx.ir(f) if out is None else ctx.node(Op.MUL, [out, ctx.ir(f)], {}, t)
        return out


def _find_sym_norm(fs: list):
    """(graph, weight, factors used) if ``fs`` holds deg^-1/2[src] * w * deg^-1/2[dst]."""
    def dinv(f, side):
        p = f.pat if isinstance(f, Tensor) else None
        if not (isinstance(p, Gathered) and p.side == side):
            return None
        d = p.x.pat
        ok = (isinstance(d, DegreeExpr) and d.gd is p.gd and d.side == "in" and d.scale == 1.0
              and d.clamp is None and d.exponent == -0.5 and d.masked)
        return d if ok else None

    for a in fs:
        da = dinv(a, "src")
        if da is None:
            continue
        for b in fs:
            db = dinv(b, "dst")
            if db is None or db.gd is not da.gd or db.w is not da.w:
                continue
            if da.w is None:
                return da.gd, None, [a, b]
            for c in fs:
                if c is da.w:
                    return da.gd, da.w, [a, b, c]
    return None


@dataclass(eq=False)
class ScatterRed(Pattern):
    """out[i] = reduce over edges e into i of msg[e]; ``init`` is the ONNX data a max starts
    from (sum and mean start from zeros)."""

    gd: GraphDesc
    reduce: str
    msg: Tensor
    init: Value | None = None

    def emit(self, ctx, t):
        out = ctx.node(Op.SCATTER, [ctx.graph_ir(self.gd), ctx.full(self.msg)],
                       {"reduce": self.reduce}, t, suffix="scatter" if self.reduce == "max" else "")
        if self.reduce != "max":
            return out
        # the IR's scatter-max gives isolated nodes 0; ONNX starts every node at ``init``
        v = self.init.value if isinstance(self.init, Fill) else None
        if isinstance(self.init, Known) and self.init.uniform() is not None:
            v = self.init.uniform()
        if v is not None and v >= 0:  # max(init, scatter_max) also covers isolated nodes
            return ctx.node(Op.MAXIMUM, [out, ctx.scalar(v)], {}, t, suffix="init")
        raise ModelImportError(
            "a scatter-max that starts from a negative or data-dependent value is only "
            "supported inside a softmax (exp(e - max[dst]) / sum[dst])")


@dataclass(eq=False)
class EdgeSoftmax(Pattern):
    gd: GraphDesc
    e: Tensor

    def emit(self, ctx, t):
        return ctx.node(Op.EDGE_SOFTMAX, [ctx.graph_ir(self.gd), ctx.full(self.e)], {}, t)


@dataclass(eq=False)
class Remap(Pattern):
    """Values of ``w`` (an edge tensor of gd's parent) carried onto the derived graph ``gd``;
    a self loop ``gd`` adds takes the parent's (last) loop value, else ``fill``."""

    gd: GraphDesc
    w: Tensor
    fill: float = 1.0

    def emit(self, ctx, t):
        return ctx.node(Op.EDGE_REMAP, [ctx.graph_ir(self.gd), ctx.full(self.w)],
                        {"fill": float(self.fill)}, t)


@dataclass(eq=False)
class LoopVals(Pattern):
    """w on the self-loop edges of ``gd``: only PyG's add_remaining_self_loops reads it."""

    gd: GraphDesc
    w: Tensor

    def emit(self, ctx, t):
        raise ModelImportError("edge values of the self loops alone are only supported as "
                               "PyG's add_remaining_self_loops uses them")


@dataclass(eq=False)
class LoopFill(Pattern):
    """[N]: ``fill``, overwritten by w on each node's (last) self loop of ``gd``."""

    gd: GraphDesc
    w: Tensor
    fill: float

    def emit(self, ctx, t):
        raise ModelImportError("per-node self-loop values are only supported when they are "
                               "appended to the edge values (PyG's add_remaining_self_loops)")


@dataclass(eq=False)
class DenseAggregate(Pattern):
    """A @ x for a dense adjacency input A bound as the graph ``gd``: a sum aggregation."""

    gd: GraphDesc
    x: Tensor

    def emit(self, ctx, t):
        return ctx.node(Op.AGGREGATE, [ctx.graph_ir(self.gd), ctx.full(self.x)],
                        {"reduce": "sum"}, t)


# ---------------------------------------------------------------- recognition tags
@dataclass(eq=False)
class Shifted:
    """e - m[dst] for a node tensor m: the exponent of a softmax numerator."""

    gd: GraphDesc
    e: Tensor
    s: Tensor


@dataclass(eq=False)
class ExpShifted:
    gd: GraphDesc
    e: Tensor
    s: Tensor


@dataclass(eq=False)
class SumExp:
    """sum over in-edges of exp(e - m[dst]) (plus at most a tiny epsilon)."""

    gd: GraphDesc
    e: Tensor
    s: Tensor


# ====================================================================== emitter
class Emitter:
    """Owns the IR graph being built and turns abstract values into IR nodes."""

    def __init__(self, graph: Graph, node_count: Lin):
        self.graph = graph
        self.params: dict[str, np.ndarray] = {}
        self.n = node_count
        self.graphs: dict[str, GraphDesc] = {}
        self._param_nodes: dict[tuple, Node] = {}
        self._scalars: dict[float, Node] = {}
        # ONNX tensor name -> "ONNX node 'name' (Op)" that computes it: values are emitted
        # after the nodes ran, so an emission error names its node through this
        self.producers: dict[str, str] = {}

    # ------------------------------------------------------------ graphs
    def intern(self, key: str, kind: str, parent: GraphDesc | None, num_edges: Dim) -> GraphDesc:
        gd = self.graphs.get(key)
        if gd is None:
            gd = self.graphs[key] = GraphDesc(key, kind, parent, num_edges)
        return gd

    def remove_loops(self, g: GraphDesc) -> GraphDesc:
        if g.loop_free:
            return g
        if g.kind in ("add", "add_remaining"):
            # removing every loop of (parent + loops) leaves the parent's non-loop edges, in order
            return self.remove_loops(g.parent)
        key = f"rm({g.key})"
        return self.intern(key, "remove", g, Lin.atom(f"E[{key}]"))

    def add_loops(self, g: GraphDesc) -> GraphDesc:
        if g.kind == "remove":  # PyG's add_remaining_self_loops: one IR op
            return self.intern(f"ar({g.parent.key})", "add_remaining", g.parent,
                               g.num_edges + self.n)
        return self.intern(f"add({g.key})", "add", g, g.num_edges + self.n)

    def graph_of_dim(self, d) -> GraphDesc | None:
        if is_static(d):
            return None
        for gd in self.graphs.values():
            if same(gd.num_edges, d):
                return gd
        return None

    def graph_ir(self, gd: GraphDesc) -> Node:
        if gd.ir is None:
            if gd.kind == "input":
                raise ModelImportError(f"graph {gd.key} has no IR input")  # set at creation
            parent = self.graph_ir(gd.parent)
            mode = {"remove": "remove", "add": "add", "add_remaining": "add_remaining"}[gd.kind]
            name = self.graph.fresh_name(f"{parent.name}.{'loops' if mode != 'remove' else 'noloops'}")
            gd.ir = self._create(Op.SELF_LOOPS, [parent], {"mode": mode}, name=name)
        return gd.ir

    # ------------------------------------------------------------ dims
    def ir_dim(self, d):
        if is_static(d):
            return int(d)
        if same(d, self.n):
            return IR_N
        gd = self.graph_of_dim(d)
        if gd is None:
            raise ModelImportError(f"the size {d} is neither the node count nor the edge count "
                                   "of a graph the model uses")
        return EdgeDim(self.graph_ir(gd).name)

    def ir_shape(self, shape: tuple) -> tuple:
        return tuple(self.ir_dim(d) for d in shape)

    # ------------------------------------------------------------ nodes
    def _create(self, op, inputs, attrs, name, ty=None) -> Node:
        try:
            return self.graph.create_node(op, inputs, attrs, ty=ty, name=name)
        except GcompError as e:
            raise ModelImportError(str(e)) from None

    def node(self, op: Op, inputs: list, attrs: dict, t: Value | None, suffix: str = "") -> Node:
        hint = clean_name(t.origin if t is not None else "") or op.value
        if suffix:
            hint = f"{hint}.{suffix}"
        return self._create(op, inputs, attrs, self.graph.fresh_name(hint))

    def scalar(self, v: float) -> Node:
        v = float(v)
        key = v if v == v else "nan"
        if key not in self._scalars:
            self._scalars[key] = self._create(Op.CONST, [], {"value": v},
                                              self.graph.fresh_name("c"),
                                              ty=TensorType((), "float32"))
        return self._scalars[key]

    def known_ir(self, k: Known) -> Node:
        if k.arr.dtype == object or k.arr.dtype.kind not in "biuf":
            raise ModelImportError(f"{k.origin or 'a constant'} holds sizes or non-numbers and "
                                   "cannot be used as a float tensor")
        if k.param is None:
            u = k.uniform()
            if u is not None and k.arr.ndim <= 1 and k.arr.size == 1:
                return self.scalar(u)
        key = k.param if k.param is not None else ("const", k.origin, k.arr.shape,
                                                    k.arr.tobytes())
        node = self._param_nodes.get(key)
        if node is None:
            base = clean_name(k.param[0]) if k.param is not None else f"const.{clean_name(k.origin)}"
            name = self.graph.fresh_name(base or "const")
            arr = np.ascontiguousarray(k.arr, dtype=np.float32)
            node = self._create(Op.PARAM, [], {}, name,
                                ty=TensorType(tuple(arr.shape), "float32"))
            self.params[name] = arr
            self._param_nodes[key] = node
        return node

    def ir(self, v: Value) -> Node:
        """IR of ``v``; its shape broadcasts to ``v.shape``."""
        if isinstance(v, Known):
            return self.known_ir(v)
        if isinstance(v, Fill):
            if v.dtype != "float":
                raise ModelImportError(f"{v.origin}: an integer fill cannot be a float tensor")
            return self.scalar(v.value)
        if not isinstance(v, Tensor):
            raise ModelImportError(f"{v.origin or 'a value'} ({v.describe()}) is graph structure "
                                   "or an index, not a float tensor the compiled model computes")
        if v.ir is None:
            try:
                node = v.pat.emit(self, v)
            except ModelImportError as e:
                msg = str(e)
                if msg.startswith("%"):  # the IR refused what was built: gcomp's limit
                    msg = f"not supported by gcomp's ONNX importer here ({msg})"
                if v.origin and not msg.startswith(("tensor ", "ONNX node")):
                    where = self.producers.get(v.origin)
                    msg = f"{where + ', ' if where else ''}tensor {v.origin!r}: {msg}"
                raise ModelImportError(msg) from None
            self._check(node, v)
            v.ir = node
        return v.ir

    def full(self, v: Value) -> Node:
        """IR of ``v`` with exactly ``v.shape`` (a virtual broadcast is made real)."""
        node = self.ir(v)
        want = self.ir_shape(v.shape)
        have = node.ty.shape
        if tuple(have) == want:
            return node
        if have and want and have[0] == want[0] and all(is_static(d) for d in v.shape[1:]):
            # x + zeros[rest] broadcasts x to [lead, rest] without changing it
            zeros = Known(np.zeros(tuple(int(d) for d in v.shape[1:]), np.float32),
                          origin=f"{v.origin}.zeros")
            return self.node(Op.ADD, [node, self.known_ir(zeros)], {}, v, suffix="bcast")
        if (want and want[0] == IR_N and all(is_static(d) for d in v.shape[1:])
                and all(h == 1 for h in have)):
            # a value per element (ConstantOfShape [N, k]: GatedGraphConv's zero padding)
            return self.node(Op.BROADCAST_TO, [node], {"shape": list(want)}, v, suffix="bcast")
        raise ModelImportError(f"tensor {v.origin!r}: cannot materialize the broadcast of "
                               f"{node.ty} to {fmt(v.shape)}")

    def _check(self, node: Node, v: Tensor) -> None:
        want = self.ir_shape(v.shape)
        have = tuple(node.ty.shape)
        if len(have) > len(want):
            bad = True
        else:
            pad = (1,) * (len(want) - len(have)) + have
            bad = any(h != w and h != 1 for h, w in zip(pad, want))
        if bad:
            raise ModelImportError(f"tensor {v.origin!r}: built IR of type {node.ty} where ONNX "
                                   f"says {fmt(v.shape)}")


def clean_name(s: str) -> str:
    """A readable IR name from an ONNX tensor name (``/convs.0/Add_output_0`` -> ``convs.0.Add``)."""
    s = s.strip("/").replace("/", ".").replace("::", "_")
    if s.endswith("_output_0"):
        s = s[: -len("_output_0")]
    return s
