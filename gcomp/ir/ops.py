"""The op set of the Graph IR: names, attributes, groups and type rules.

Every stage speaks these ops: the builder and the ONNX importer produce them,
passes rewrite them, the reference interpreter defines their meaning, and code
generation lowers them to kernels.  ``OPS[op]`` holds an op's definition;
``infer_type(node)`` is the single place where result types are computed, so
the builder, the parser and the verifier agree.

Semantics (the interpreter in ``gcomp/ir/interpreter.py`` is normative):

``aggregate(g, x[, w])``  out[i] = reduce over edges (j -> i) of g of w_e * x[j]
``scatter(g, e)``         out[i] = reduce over edges e into i of e[e]
``gather(g, x)``          out[e] = x[src(e)] (side="src") or x[dst(e)] (side="dst")
``edge_softmax(g, e)``    softmax of e over the in-edges of each destination
``attention_aggregate(g, x, s_src, s_dst[, step])``  GAT's attention in one op (made by
                          the ``fuse_attention`` pass): with x [N, H, ...] and scores
                          [N, H], out[i, h] = sum over edges (j -> i) of
                          softmax_j(leaky_relu(s_src[j, h] + s_dst[i, h])) * x[j, h]
                          (``negative_slope`` 1: no leaky_relu); with ``p`` > 0 each
                          coefficient [e, h] is dropped as ``dropout[p, seed](a,
                          step)`` drops element e * H + h of the [E, H] coefficients
``degree(g[, w])``        (weighted) number of in-edges (side="in") or out-edges
``sym_norm(g[, w])``      w_e / sqrt(deg_in(src) * deg_in(dst)), 0 where a degree is 0
``self_loops(g)``         a new graph: mode "add_remaining" removes every self
                          loop and adds one per node (PyG's add_remaining_self_loops),
                          "remove" removes them, "add" adds one per node
``edge_remap(g2, w)``     edge values of g2 taken from w on g2's parent graph; new
                          self loops take the parent's loop value where one
                          existed (the last), else ``fill``
``broadcast_to(x, like)``  x broadcast (numpy rules) to like's shape; with one input,
                          to the ``shape`` attribute ("N" first for node tensors):
                          ``broadcast_to[shape=["N", 3]](const 0)`` is zeros [N, 3]
``slice(x)``              x[start:stop] along ``axis`` (a static axis)
Isolated nodes aggregate to 0 for every reduction (PyG's convention).
``aggregate[flow="out"]`` and ``scatter[side="src"]`` reduce over out-edges
instead (keyed by source; the transposed graph): backward passes use them.

Training ops:
``dropout(x, step)``      x * keep / (1 - p), keep drawn from a counter-based hash of
                          (seed, step, element index): the same step gives the same mask
``cross_entropy(z, y, m)``  sum_i m_i * -log_softmax(z_i)[y_i] / sum_i m_i
Gradient ops (made by autodiff): ``elementwise_grad`` (d op / d input ``wrt``
times dy; with ``of_output`` the derivative is computed from the op's output,
which keeps activations' inputs out of memory), ``cross_entropy_grad``, ``edge_dot``
(out[e] = sum_c x[src(e),..,c] * y[dst(e),..,c]), ``attention_grad_dst`` /
``attention_grad_src`` (the backward of ``attention_aggregate``, below),
``sign_bits(y)`` (int32 [N, ceil(F / 32)] for y [N, F]: bit b of word w is y[i, 32 w + b]
> 0) and ``mask_bits(dy, bits)`` (dy where that bit is set, else 0: a ReLU's gradient from
a sixteenth of the bytes of its bfloat16 output, ``pack_relu_masks``),
``aggregate_argmax`` /
``scatter_argmax`` (the first in-edge in edge order holding the maximum, -1 if
none) and ``aggregate_max_grad`` / ``scatter_max_grad`` (route dy to it).

The backward of ``y = attention_aggregate(g, x, s_src, s_dst)``, with
a_ji = softmax over the in-edges of i of e_ji = leaky_relu(z_ji), z_ji = s_src[j] +
s_dst[i], r_ji = d e_ji / d z_ji (1 or the slope), m_ji the dropout factor (keep / (1
- p), 1 without dropout) and dy given, per head (both take the forward's ``p``, ``seed``
and ``step``):
``attention_grad_dst(g, x, s_src, s_dst, dy[, step])``  f32[N, 4H], per destination i:
                          columns [0, H) d loss / d s_dst[i] = sum_j a_ji r_ji
                          (m_ji dy_i . x_j - D_i); [H, 2H) s_dst[i]; [2H, 3H) the
                          log-sum-exp of e_ji over j; [3H, 4H) D_i = sum_j a_ji m_ji
                          dy_i . x_j (= dy_i . y_i).  0 for a node without in-edges but
                          s_dst.
``attention_grad_src(g, x, s_src, dy, stats[, step])``  f32[N, H*C + H] with stats from
                          ``attention_grad_dst`` (a destination's row holds all the
                          source pass reads of it), per source j over its out-edges:
                          columns [0, H*C) d loss / d x[j] = sum_i a_ji m_ji dy_i (x
                          flattened), [H*C, H*C + H) d loss / d s_src[j] = sum_i a_ji
                          r_ji (m_ji dy_i . x_j - D_i).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from math import prod
from typing import Any, Callable

from gcomp.errors import IRError
from gcomp.ir.types import N, EdgeDim, GraphType, TensorType, Type


class Op(str, Enum):
    # values the caller provides
    INPUT = "input"
    PARAM = "param"
    CONST = "const"
    # graph structure
    SELF_LOOPS = "self_loops"
    EDGE_REMAP = "edge_remap"
    DEGREE = "degree"
    SYM_NORM = "sym_norm"
    # message passing
    GATHER = "gather"
    SCATTER = "scatter"
    AGGREGATE = "aggregate"
    EDGE_SOFTMAX = "edge_softmax"
    ATTENTION_AGGREGATE = "attention_aggregate"
    # dense
    MATMUL = "matmul"
    BIAS_ADD = "bias_add"
    # elementwise binary (numpy broadcasting)
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAXIMUM = "maximum"
    MINIMUM = "minimum"
    # elementwise unary
    RELU = "relu"
    LEAKY_RELU = "leaky_relu"
    ELU = "elu"
    EXP = "exp"
    LOG = "log"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    NEG = "neg"
    SQRT = "sqrt"
    POW = "pow"
    # shape and reductions
    CONCAT = "concat"
    RESHAPE = "reshape"
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    SOFTMAX = "softmax"
    LOG_SOFTMAX = "log_softmax"
    SLICE = "slice"
    BROADCAST_TO = "broadcast_to"
    # training
    DROPOUT = "dropout"
    CROSS_ENTROPY = "cross_entropy"
    # gradients
    ELEMENTWISE_GRAD = "elementwise_grad"
    CROSS_ENTROPY_GRAD = "cross_entropy_grad"
    EDGE_DOT = "edge_dot"
    AGGREGATE_ARGMAX = "aggregate_argmax"
    AGGREGATE_MAX_GRAD = "aggregate_max_grad"
    SCATTER_ARGMAX = "scatter_argmax"
    SCATTER_MAX_GRAD = "scatter_max_grad"
    ATTENTION_GRAD_DST = "attention_grad_dst"
    ATTENTION_GRAD_SRC = "attention_grad_src"
    SIGN_BITS = "sign_bits"
    MASK_BITS = "mask_bits"

    def __str__(self) -> str:
        return self.value


class OpGroup:
    """Named sets of ops, so passes can write ``n.op in OpGroup.Unary``."""

    Leaf = frozenset({Op.INPUT, Op.PARAM, Op.CONST})
    Structure = frozenset({Op.SELF_LOOPS})
    Unary = frozenset({Op.RELU, Op.LEAKY_RELU, Op.ELU, Op.EXP, Op.LOG, Op.SIGMOID, Op.TANH,
                       Op.NEG, Op.SQRT, Op.POW})
    Binary = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM, Op.BIAS_ADD})
    Elementwise = Unary | Binary
    Reduce = frozenset({Op.SUM, Op.MEAN, Op.MAX})
    # ops that move values between node space and edge space
    EdgeOps = frozenset({Op.GATHER, Op.SCATTER, Op.AGGREGATE, Op.EDGE_SOFTMAX, Op.SYM_NORM,
                         Op.ATTENTION_AGGREGATE,
                         Op.EDGE_REMAP, Op.DEGREE, Op.EDGE_DOT, Op.AGGREGATE_ARGMAX,
                         Op.AGGREGATE_MAX_GRAD, Op.SCATTER_ARGMAX, Op.SCATTER_MAX_GRAD,
                         Op.ATTENTION_GRAD_DST, Op.ATTENTION_GRAD_SRC})
    Aggregate = frozenset({Op.AGGREGATE, Op.SCATTER})


REDUCTIONS = ("sum", "mean", "max")


@dataclass(frozen=True)
class AttrSpec:
    default: Any = None
    required: bool = False
    choices: tuple | None = None
    kind: type | tuple = object


@dataclass(frozen=True)
class OpDef:
    op: Op
    arity: tuple[int, int]  # min, max number of inputs (max -1: variadic)
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    infer: Callable[["Node"], Type] | None = None  # None: type is given explicitly  # noqa: F821


def _num(**kw):
    return AttrSpec(kind=(int, float), **kw)


# ---------------------------------------------------------------- type rules
def _fail(node, msg: str):
    raise IRError(f"%{node.name} = {node.op}(...): {msg}")


def _tensor(node, i: int) -> TensorType:
    t = node.inputs[i].ty
    if not isinstance(t, TensorType):
        _fail(node, f"input {i} (%{node.inputs[i].name}) must be a tensor, got {t}")
    return t


def _graph(node, i: int = 0) -> str:
    src = node.inputs[i]
    if not isinstance(src.ty, GraphType):
        _fail(node, f"input {i} (%{src.name}) must be a graph, got {src.ty}")
    return src.name


def _node_tensor(node, i: int) -> TensorType:
    t = _tensor(node, i)
    if not t.is_node:
        _fail(node, f"input {i} (%{node.inputs[i].name}) must be a node tensor [N,...], got {t}")
    return t


def _edge_tensor_of(node, i: int, g: str) -> TensorType:
    t = _tensor(node, i)
    if t.edge_graph != g:
        _fail(node, f"input {i} (%{node.inputs[i].name}) must be an edge tensor of %{g}, got {t}")
    return t


def broadcast_shapes(a: tuple, b: tuple) -> tuple:
    """Numpy broadcasting over static and symbolic dimensions; raises ValueError."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        else:
            raise ValueError(f"cannot broadcast {da} with {db}")
    return tuple(reversed(out))


def _infer_binary(node) -> Type:
    a, b = _tensor(node, 0), _tensor(node, 1)
    try:
        shape = broadcast_shapes(a.shape, b.shape)
    except ValueError as e:
        _fail(node, f"shapes {a} and {b} do not broadcast: {e}")
    return TensorType(shape, a.dtype)


def _infer_bias_add(node) -> Type:
    x, b = _tensor(node, 0), _tensor(node, 1)
    if b.rank != 1 or not x.shape or x.shape[-1] != b.shape[0]:
        _fail(node, f"bias {b} does not match the last axis of {x}")
    return x


def _infer_same(node) -> Type:
    return _tensor(node, 0)


def _infer_matmul(node) -> Type:
    """x @ w (w static [K, M]); trans_b: x @ w.T; trans_a: x.T @ w with both [N, .], and
    with sum_row a last row of w's column sums (a bias gradient beside its weight's)."""
    x, w = _tensor(node, 0), _tensor(node, 1)
    if node.attrs["sum_row"] and not node.attrs["trans_a"]:
        _fail(node, "sum_row needs trans_a (x.T @ w)")
    if node.attrs["trans_a"]:
        if x.rank != 2 or w.rank != 2 or x.shape[0] != w.shape[0]:
            _fail(node, f"x.T @ w needs two 2-D tensors with equal first axes: {x}, {w}")
        return TensorType((x.shape[1] + node.attrs["sum_row"], w.shape[1]), x.dtype)
    if w.rank != 2 or not w.is_static:
        _fail(node, f"weight must be a static 2-D tensor, got {w}")
    k, m = (w.shape[1], w.shape[0]) if node.attrs["trans_b"] else w.shape
    if x.rank < 1 or x.shape[-1] != k:
        _fail(node, f"inner dimensions differ: {x} @ {w}{'.T' if node.attrs['trans_b'] else ''}")
    return TensorType(x.shape[:-1] + (m,), x.dtype)


def _infer_gather(node) -> Type:
    g = _graph(node, 0)
    x = _node_tensor(node, 1)
    return TensorType((EdgeDim(g),) + x.shape[1:], x.dtype)


def _infer_scatter(node) -> Type:
    g = _graph(node, 0)
    e = _edge_tensor_of(node, 1, g)
    if node.attrs["side"] == "src" and node.attrs["reduce"] == "max":
        _fail(node, "max over out-edges is not supported")
    return TensorType((N,) + e.shape[1:], e.dtype)


def _infer_aggregate(node) -> Type:
    g = _graph(node, 0)
    x = _node_tensor(node, 1)
    if node.attrs["flow"] == "out" and node.attrs["reduce"] == "max":
        _fail(node, "max over out-edges is not supported")
    if len(node.inputs) == 3:
        w = _edge_tensor_of(node, 2, g)
        k = w.rank - 1
        if w.shape[1:] != x.shape[1:1 + k] or k >= x.rank:
            _fail(node, f"edge weight {w} must match the leading feature axes of {x}")
    return x


def _attention_dropout(node, arity: int) -> None:
    """A fused attention op's optional dropout: p in [0, 1), a step input iff p > 0."""
    p = node.attrs["p"]
    if not 0.0 <= p < 1.0:
        _fail(node, f"attention dropout probability must be in [0, 1), got {p}")
    if (len(node.inputs) > arity) != (p > 0):
        _fail(node, "a step input comes with attention dropout (p > 0), and only then")
    if p > 0 and node.inputs[arity].ty != TensorType((), "int32"):
        _fail(node, f"the step input must be i32[], got {node.inputs[arity].ty}")


def _infer_attention_aggregate(node) -> Type:
    _graph(node, 0)
    x = _node_tensor(node, 1)
    for k in (2, 3):
        s = _node_tensor(node, k)
        if s.rank != 2 or x.rank < 2 or s.shape[1] != x.shape[1]:
            _fail(node, f"scores {s} must be [N, H] with H = axis 1 of {x}")
    if node.op == Op.ATTENTION_AGGREGATE:
        _attention_dropout(node, 4)
    return x


def _attention_dy(node, x: TensorType, i: int) -> None:
    if _tensor(node, i) != x:
        _fail(node, f"dy {node.inputs[i].ty} must have x's type {x}")


def _infer_attention_grad_dst(node) -> Type:
    x = _infer_attention_aggregate(node)
    _attention_dy(node, x, 4)
    _attention_dropout(node, 5)
    return TensorType((N, 4 * int(x.shape[1])), "float32")


def _infer_attention_grad_src(node) -> Type:
    _graph(node, 0)
    x, s = _node_tensor(node, 1), _node_tensor(node, 2)
    if s.rank != 2 or x.rank < 2 or s.shape[1] != x.shape[1]:
        _fail(node, f"scores {s} must be [N, H] with H = axis 1 of {x}")
    H = int(x.shape[1])
    _attention_dy(node, x, 3)
    if _node_tensor(node, 4).shape[1:] != (4 * H,):
        _fail(node, f"stats {node.inputs[4].ty} must be [N, {4 * H}] (attention_grad_dst)")
    _attention_dropout(node, 5)
    return TensorType((N, int(prod(x.shape[1:])) + H), "float32")


def _infer_edge_softmax(node) -> Type:
    g = _graph(node, 0)
    return _edge_tensor_of(node, 1, g)


def _infer_degree(node) -> Type:
    g = _graph(node, 0)
    if len(node.inputs) == 2:
        w = _edge_tensor_of(node, 1, g)
        if w.rank != 1:
            _fail(node, f"edge weight must be 1-D, got {w}")
    return TensorType((N,), "float32")


def _infer_sym_norm(node) -> Type:
    g = _graph(node, 0)
    if len(node.inputs) == 2:
        w = _edge_tensor_of(node, 1, g)
        if w.rank != 1:
            _fail(node, f"edge weight must be 1-D, got {w}")
    return TensorType((EdgeDim(g),), "float32")


def _infer_self_loops(node) -> Type:
    _graph(node, 0)
    return node.inputs[0].ty


def _infer_edge_remap(node) -> Type:
    g2 = _graph(node, 0)
    parent = node.inputs[0]
    if parent.op != Op.SELF_LOOPS:
        _fail(node, f"%{g2} must be made by self_loops, got {parent.op}")
    w = _edge_tensor_of(node, 1, parent.inputs[0].name)
    return TensorType((EdgeDim(g2),) + w.shape[1:], w.dtype)


def _norm_axis(node, t: TensorType, axis: int) -> int:
    ax = axis + t.rank if axis < 0 else axis
    if not 0 <= ax < t.rank:
        _fail(node, f"axis {axis} out of range for {t}")
    return ax


def _infer_concat(node) -> Type:
    ts = [_tensor(node, i) for i in range(len(node.inputs))]
    ax = _norm_axis(node, ts[0], node.attrs["axis"])
    if ax == 0 and not ts[0].is_static:
        _fail(node, "cannot concatenate along the symbolic axis 0")
    total = 0
    for t in ts:
        if t.rank != ts[0].rank or any(
                t.shape[i] != ts[0].shape[i] for i in range(t.rank) if i != ax):
            _fail(node, f"shapes differ off the concat axis: {', '.join(map(str, ts))}")
        total += t.shape[ax]
    shape = list(ts[0].shape)
    shape[ax] = total
    return TensorType(tuple(shape), ts[0].dtype)


def _infer_reshape(node) -> Type:
    x = _tensor(node, 0)
    target = list(node.attrs["shape"])
    lead = x.shape[0] if x.shape and not isinstance(x.shape[0], int) else None
    if lead is not None:
        if not target or target[0] != "N" and not (isinstance(lead, EdgeDim) and target[0] == "E"):
            _fail(node, f"reshape of {x} must keep the symbolic axis 0 (write \"N\" or \"E\")")
        target[0] = lead
    static_in = 1
    for d in x.shape[1 if lead is not None else 0:]:
        static_in *= d
    rest = target[1 if lead is not None else 0:]
    if sum(1 for d in rest if d == -1) > 1:
        _fail(node, "at most one -1 in a reshape")
    known = 1
    for d in rest:
        if d != -1:
            if not isinstance(d, int) or d <= 0:
                _fail(node, f"bad reshape dimension {d!r}")
            known *= d
    if -1 in rest:
        if static_in % known:
            _fail(node, f"cannot reshape {x} to {node.attrs['shape']}")
        rest = [static_in // known if d == -1 else d for d in rest]
    elif known != static_in:
        _fail(node, f"cannot reshape {x} to {node.attrs['shape']}")
    return TensorType(tuple(target[:1] if lead is not None else []) + tuple(rest), x.dtype)


def _infer_reduce(node) -> Type:
    x = _tensor(node, 0)
    ax = _norm_axis(node, x, node.attrs["axis"])
    shape = list(x.shape)
    if node.attrs["keepdims"]:
        shape[ax] = 1
    else:
        del shape[ax]
    return TensorType(tuple(shape), x.dtype)


def _infer_softmax(node) -> Type:
    x = _tensor(node, 0)
    _norm_axis(node, x, node.attrs["axis"])
    return x


def _infer_dropout(node) -> Type:
    x = _tensor(node, 0)
    if node.inputs[1].ty != TensorType((), "int32"):
        _fail(node, f"the step input must be i32[], got {node.inputs[1].ty}")
    if not 0.0 <= node.attrs["p"] < 1.0:
        _fail(node, f"dropout probability must be in [0, 1), got {node.attrs['p']}")
    return x


def _labels_mask(node, i: int, z: TensorType) -> None:
    y, m = _tensor(node, i), _tensor(node, i + 1)
    if y.shape != (N,) or y.dtype != "int32":
        _fail(node, f"labels must be i32[N], got {y}")
    if m.shape != (N,) or m.dtype != "float32":
        _fail(node, f"mask must be f32[N], got {m}")
    if z.rank != 2 or not z.is_node:
        _fail(node, f"logits must be [N, C], got {z}")


def _infer_cross_entropy(node) -> Type:
    z = _node_tensor(node, 0)
    _labels_mask(node, 1, z)
    return TensorType((), "float32")


def _infer_cross_entropy_grad(node) -> Type:
    if node.inputs[0].ty != TensorType((), "float32"):
        _fail(node, f"dy must be f32[], got {node.inputs[0].ty}")
    z = _node_tensor(node, 1)
    _labels_mask(node, 2, z)
    return z


def _infer_elementwise_grad(node) -> Type:
    fwd = Op(node.attrs["op"])
    if fwd not in OpGroup.Elementwise and fwd != Op.MAX:
        _fail(node, f"{fwd} is not an elementwise op")
    shape = ()
    for i in range(len(node.inputs)):
        try:
            shape = broadcast_shapes(shape, _tensor(node, i).shape)
        except ValueError as e:
            _fail(node, f"inputs do not broadcast: {e}")
    return TensorType(shape, "float32")


BITS = 32  # signs per word of ``sign_bits``


def sign_words(f: int) -> int:
    """Words ``sign_bits`` packs the signs of f features into."""
    return -(-f // BITS)


def _signs_type(node, i: int) -> TensorType:
    """The int32 words of input i's signs; input i must be a float32 [N, F], F static."""
    t = _node_tensor(node, i)
    if t.rank != 2 or not isinstance(t.shape[1], int) or t.dtype != "float32":
        _fail(node, f"needs a float32 node tensor [N, F] with a static F, got {t}")
    return TensorType((t.shape[0], sign_words(t.shape[1])), "int32")


def _infer_sign_bits(node) -> Type:
    return _signs_type(node, 0)


def _infer_mask_bits(node) -> Type:
    want = _signs_type(node, 0)
    dy, bits = _tensor(node, 0), _node_tensor(node, 1)
    if bits != want:
        _fail(node, f"bits {bits} do not match {dy}: expected {want}")
    return dy


def _infer_broadcast_to(node) -> Type:
    x = _tensor(node, 0)
    shape = node.attrs["shape"]
    if (len(node.inputs) == 2) == (shape is not None):
        _fail(node, "takes the target shape from a second input or a shape attribute, one of them")
    if shape is None:
        target = _tensor(node, 1).shape
    else:
        target = tuple(shape)
        if any(not (k == 0 and d == N) and not (type(d) is int and d >= 1)
               for k, d in enumerate(target)):
            _fail(node, f"shape {list(shape)} must be static sizes, with \"N\" allowed first")
    try:
        if broadcast_shapes(x.shape, target) != target:
            raise ValueError("not a broadcast")
    except ValueError:
        _fail(node, f"{x} does not broadcast to {TensorType(target, x.dtype)}")
    return TensorType(target, x.dtype)


def _infer_slice(node) -> Type:
    x = _tensor(node, 0)
    ax = _norm_axis(node, x, node.attrs["axis"])
    a, b = node.attrs["start"], node.attrs["stop"]
    if not isinstance(x.shape[ax], int) or not 0 <= a < b <= x.shape[ax]:
        _fail(node, f"bad slice [{a}:{b}] of axis {ax} of {x}")
    shape = list(x.shape)
    shape[ax] = b - a
    return TensorType(tuple(shape), x.dtype)


def _infer_edge_dot(node) -> Type:
    g = _graph(node, 0)
    x, y = _node_tensor(node, 1), _node_tensor(node, 2)
    if x.shape != y.shape or x.rank < 2:
        _fail(node, f"edge_dot needs equal node tensors of rank >= 2, got {x} and {y}")
    return TensorType((EdgeDim(g),) + x.shape[1:-1], x.dtype)


def _infer_argmax(node) -> Type:
    g = _graph(node, 0)
    if node.op == Op.AGGREGATE_ARGMAX:
        x = _node_tensor(node, 1)
    else:
        x = _edge_tensor_of(node, 1, g)
    return TensorType((N,) + x.shape[1:], "int32")


def _infer_max_grad(node) -> Type:
    g = _graph(node, 0)
    dy, am = _node_tensor(node, 1), _node_tensor(node, 2)
    if am.dtype != "int32" or am.shape != dy.shape:
        _fail(node, f"argmax must be i32 shaped like dy {dy}, got {am}")
    if node.op == Op.AGGREGATE_MAX_GRAD:
        return dy
    return TensorType((EdgeDim(g),) + dy.shape[1:], dy.dtype)


_side = AttrSpec(default="src", choices=("src", "dst"))
_reduce = AttrSpec(default="sum", choices=REDUCTIONS)
_axis = AttrSpec(default=-1, kind=int)
_ATTENTION_ATTRS = {"negative_slope": _num(default=0.2), "p": _num(default=0.0),
                    "seed": AttrSpec(default=0, kind=int)}

OPS: dict[Op, OpDef] = {d.op: d for d in [
    OpDef(Op.INPUT, (0, 0)),
    OpDef(Op.PARAM, (0, 0), {"init": AttrSpec(default="glorot", kind=str)}),
    OpDef(Op.CONST, (0, 0), {"value": _num(required=True)}),
    OpDef(Op.SELF_LOOPS, (1, 1), {"mode": AttrSpec(default="add_remaining",
                                                   choices=("add_remaining", "remove", "add"))},
          _infer_self_loops),
    OpDef(Op.EDGE_REMAP, (2, 2), {"fill": _num(default=1.0)}, _infer_edge_remap),
    OpDef(Op.DEGREE, (1, 2), {"side": AttrSpec(default="in", choices=("in", "out"))},
          _infer_degree),
    OpDef(Op.SYM_NORM, (1, 2), {}, _infer_sym_norm),
    OpDef(Op.GATHER, (2, 2), {"side": _side}, _infer_gather),
    OpDef(Op.SCATTER, (2, 2), {"reduce": _reduce,
                               "side": AttrSpec(default="dst", choices=("dst", "src"))},
          _infer_scatter),
    OpDef(Op.AGGREGATE, (2, 3), {"reduce": _reduce,
                                 "flow": AttrSpec(default="in", choices=("in", "out"))},
          _infer_aggregate),
    OpDef(Op.EDGE_SOFTMAX, (2, 2), {}, _infer_edge_softmax),
    OpDef(Op.ATTENTION_AGGREGATE, (4, 5), _ATTENTION_ATTRS, _infer_attention_aggregate),
    OpDef(Op.MATMUL, (2, 2), {"trans_a": AttrSpec(default=False, kind=bool),
                              "trans_b": AttrSpec(default=False, kind=bool),
                              "sum_row": AttrSpec(default=False, kind=bool)}, _infer_matmul),
    OpDef(Op.BIAS_ADD, (2, 2), {}, _infer_bias_add),
    *[OpDef(op, (2, 2), {}, _infer_binary)
      for op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAXIMUM, Op.MINIMUM)],
    *[OpDef(op, (1, 1), {}, _infer_same)
      for op in (Op.RELU, Op.EXP, Op.LOG, Op.SIGMOID, Op.TANH, Op.NEG, Op.SQRT)],
    OpDef(Op.LEAKY_RELU, (1, 1), {"alpha": _num(default=0.01)}, _infer_same),
    OpDef(Op.ELU, (1, 1), {"alpha": _num(default=1.0)}, _infer_same),
    OpDef(Op.POW, (1, 1), {"exponent": _num(required=True)}, _infer_same),
    OpDef(Op.CONCAT, (1, -1), {"axis": _axis}, _infer_concat),
    OpDef(Op.RESHAPE, (1, 1), {"shape": AttrSpec(required=True, kind=(list, tuple))},
          _infer_reshape),
    *[OpDef(op, (1, 1), {"axis": _axis, "keepdims": AttrSpec(default=False, kind=bool)},
            _infer_reduce) for op in (Op.SUM, Op.MEAN, Op.MAX)],
    OpDef(Op.SOFTMAX, (1, 1), {"axis": _axis}, _infer_softmax),
    OpDef(Op.LOG_SOFTMAX, (1, 1), {"axis": _axis}, _infer_softmax),
    OpDef(Op.SLICE, (1, 1), {"axis": _axis, "start": AttrSpec(required=True, kind=int),
                             "stop": AttrSpec(required=True, kind=int)}, _infer_slice),
    OpDef(Op.BROADCAST_TO, (1, 2), {"shape": AttrSpec(kind=(list, tuple, type(None)))},
          _infer_broadcast_to),
    OpDef(Op.DROPOUT, (2, 2), {"p": _num(default=0.5), "seed": AttrSpec(default=0, kind=int)},
          _infer_dropout),
    OpDef(Op.CROSS_ENTROPY, (3, 3), {}, _infer_cross_entropy),
    OpDef(Op.CROSS_ENTROPY_GRAD, (4, 4), {}, _infer_cross_entropy_grad),
    OpDef(Op.ELEMENTWISE_GRAD, (2, 4), {"op": AttrSpec(required=True, kind=str),
                                         "wrt": AttrSpec(default=0, kind=int),
                                         "of_output": AttrSpec(default=False, kind=bool),
                                         "alpha": _num(default=0.0),
                                         "exponent": _num(default=1.0)},
          _infer_elementwise_grad),
    OpDef(Op.EDGE_DOT, (3, 3), {}, _infer_edge_dot),
    OpDef(Op.AGGREGATE_ARGMAX, (2, 2), {}, _infer_argmax),
    OpDef(Op.SCATTER_ARGMAX, (2, 2), {}, _infer_argmax),
    OpDef(Op.AGGREGATE_MAX_GRAD, (3, 3), {}, _infer_max_grad),
    OpDef(Op.SCATTER_MAX_GRAD, (3, 3), {}, _infer_max_grad),
    OpDef(Op.ATTENTION_GRAD_DST, (5, 6), _ATTENTION_ATTRS, _infer_attention_grad_dst),
    OpDef(Op.ATTENTION_GRAD_SRC, (5, 6), _ATTENTION_ATTRS, _infer_attention_grad_src),
    OpDef(Op.SIGN_BITS, (1, 1), {}, _infer_sign_bits),
    OpDef(Op.MASK_BITS, (2, 2), {}, _infer_mask_bits),
]}


def op_from_name(name: str) -> Op:
    try:
        return Op(name)
    except ValueError:
        raise IRError(f"unknown op {name!r}; known ops: {', '.join(o.value for o in Op)}") from None


def normalize_attrs(op: Op, attrs: dict) -> dict:
    """Check attribute names, kinds and choices; fill in defaults."""
    spec = OPS[op].attrs
    for k in attrs:
        if k not in spec:
            raise IRError(f"{op}: unknown attribute {k!r} (known: {', '.join(spec) or 'none'})")
    out = {}
    for k, s in spec.items():
        if k in attrs:
            v = attrs[k]
            kinds = s.kind if isinstance(s.kind, tuple) else (s.kind,)
            # bool is an int subclass; a numeric attribute must not accept True
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds
                                            and object not in kinds):
                raise IRError(f"{op}: attribute {k}={v!r} has the wrong kind")
            if s.choices is not None and v not in s.choices:
                raise IRError(f"{op}: attribute {k}={v!r} must be one of {', '.join(map(repr, s.choices))}")
            out[k] = list(v) if isinstance(v, tuple) else v
        elif s.required:
            raise IRError(f"{op}: attribute {k!r} is required")
        else:
            out[k] = s.default
    return out


def infer_type(node) -> Type:
    """Result type of ``node`` from its inputs and attributes (IRError if ill-typed)."""
    d = OPS[node.op]
    lo, hi = d.arity
    if len(node.inputs) < lo or (hi >= 0 and len(node.inputs) > hi):
        want = f"{lo}" if lo == hi else f"{lo} to {'any' if hi < 0 else hi}"
        _fail(node, f"takes {want} inputs, got {len(node.inputs)}")
    if d.infer is None:
        if node.ty is None:
            _fail(node, "needs an explicit type")
        return node.ty
    return d.infer(node)
