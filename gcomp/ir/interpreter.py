"""Reference interpreter: the meaning of every op, in numpy/scipy float64.

This is the oracle every test compares compiled code against.  It is written
for clarity, not speed: it materializes per-edge messages and keeps edges in the
order the user gave them (derived graphs append their new self loops at the
end, as PyG does).  It shares no code with code generation or the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gcomp.errors import InputError
from gcomp.ir.graph import Graph
from gcomp.ir.ops import BITS, Op, sign_words
from gcomp.ir.rng import keep_mask
from gcomp.ir.types import GraphType


@dataclass
class RefGraph:
    """A graph as the interpreter sees it: edge list in a fixed order."""

    num_nodes: int
    src: np.ndarray
    dst: np.ndarray
    origin: np.ndarray | None = None  # for derived graphs: parent edge id or -1

    @staticmethod
    def from_edge_index(edge_index, num_nodes: int) -> "RefGraph":
        ei = np.asarray(edge_index, dtype=np.int64)
        return RefGraph(int(num_nodes), ei[0].copy(), ei[1].copy())

    @property
    def num_edges(self) -> int:
        return len(self.src)


def _self_loops(g: RefGraph, mode: str) -> RefGraph:
    n = g.num_nodes
    loop = g.src == g.dst
    keep = np.ones(len(g.src), bool) if mode == "add" else ~loop
    ids = np.nonzero(keep)[0]
    if mode == "remove":
        return RefGraph(n, g.src[ids], g.dst[ids], ids)
    loop_origin = np.full(n, -1, np.int64)
    if mode == "add_remaining":
        for e in np.nonzero(loop)[0]:  # the last existing loop of a node wins
            loop_origin[g.src[e]] = e
    ar = np.arange(n, dtype=np.int64)
    return RefGraph(n, np.concatenate([g.src[ids], ar]), np.concatenate([g.dst[ids], ar]),
                    np.concatenate([ids, loop_origin]))


def _scatter(g: RefGraph, e: np.ndarray, reduce: str, key: np.ndarray | None = None) -> np.ndarray:
    """Reduce edge values onto ``key`` nodes (default: destinations)."""
    key = g.dst if key is None else key
    out_shape = (g.num_nodes,) + e.shape[1:]
    if reduce == "max":
        out = np.full(out_shape, -np.inf)
        np.maximum.at(out, key, e)
        out[np.isneginf(out)] = 0.0  # isolated nodes
        return out
    out = np.zeros(out_shape)
    np.add.at(out, key, e)
    if reduce == "mean":
        cnt = np.bincount(key, minlength=g.num_nodes).astype(np.float64)
        out /= np.maximum(cnt, 1).reshape((-1,) + (1,) * (e.ndim - 1))
    return out


def _argmax_edges(g: RefGraph, e: np.ndarray) -> np.ndarray:
    """Per destination and feature: the first in-edge (in edge order) holding the maximum."""
    out = np.full((g.num_nodes,) + e.shape[1:], -1, np.int64)
    best = np.full(out.shape, -np.inf)
    for k in range(g.num_edges):
        d = g.dst[k]
        better = e[k] > best[d]
        best[d] = np.where(better, e[k], best[d])
        out[d] = np.where(better, k, out[d])
    return out


def _route_max(g: RefGraph, dy: np.ndarray, argmax: np.ndarray) -> np.ndarray:
    """Per edge: dy of its destination where the edge is that destination's argmax, else 0."""
    ids = np.arange(g.num_edges).reshape((-1,) + (1,) * (dy.ndim - 1))
    return np.where(argmax[g.dst] == ids, dy[g.dst], 0.0)


def _derivative_of_output(op: Op, a: dict, y):
    """d op / dx written with y = op(x) (valid for the ops autodiff uses it for)."""
    if op == Op.RELU:
        return (y > 0).astype(np.float64)
    if op == Op.LEAKY_RELU:  # alpha > 0 keeps the sign
        return np.where(y > 0, 1.0, a["alpha"])
    if op == Op.ELU:  # alpha > 0: y + alpha = alpha * exp(x) for x <= 0
        return np.where(y > 0, 1.0, y + a["alpha"])
    if op == Op.SIGMOID:
        return y * (1.0 - y)
    if op == Op.TANH:
        return 1.0 - y * y
    if op == Op.EXP:
        return y
    raise NotImplementedError(f"no output-based derivative for {op}")


def _elementwise_grad(op: Op, wrt: int, a: dict, dy, xs):
    """dy * d op(xs) / d xs[wrt] (before reducing broadcast axes)."""
    x = xs[0]
    if a.get("of_output"):
        return dy * _derivative_of_output(op, a, x)
    if op == Op.RELU:
        d = (x > 0).astype(np.float64)
    elif op == Op.LEAKY_RELU:
        d = np.where(x > 0, 1.0, a["alpha"])
    elif op == Op.ELU:
        d = np.where(x > 0, 1.0, a["alpha"] * np.exp(np.minimum(x, 0.0)))
    elif op == Op.EXP:
        d = np.exp(x)
    elif op == Op.LOG:
        d = 1.0 / x
    elif op == Op.SIGMOID:
        s = 1.0 / (1.0 + np.exp(-x))
        d = s * (1.0 - s)
    elif op == Op.TANH:
        d = 1.0 - np.tanh(x) ** 2
    elif op == Op.NEG:
        d = -np.ones_like(x)
    elif op == Op.SQRT:
        d = 0.5 / np.sqrt(x)
    elif op == Op.POW:
        d = a["exponent"] * np.power(x, a["exponent"] - 1.0)
    elif op in (Op.ADD, Op.BIAS_ADD):
        d = np.ones(np.broadcast_shapes(xs[0].shape, xs[1].shape))
    elif op == Op.SUB:
        d = np.full(np.broadcast_shapes(xs[0].shape, xs[1].shape), 1.0 if wrt == 0 else -1.0)
    elif op == Op.MUL:
        d = np.broadcast_to(xs[1 - wrt], np.broadcast_shapes(xs[0].shape, xs[1].shape))
    elif op == Op.DIV:
        d = 1.0 / xs[1] if wrt == 0 else -xs[0] / xs[1] ** 2
    elif op in (Op.MAXIMUM, Op.MINIMUM):
        p, q = (xs[0], xs[1]) if wrt == 0 else (xs[1], xs[0])
        wins = p > q if op == Op.MAXIMUM else p < q
        d = wins + 0.5 * (p == q)  # ties split the gradient, as torch does
    elif op == Op.MAX:  # xs: (x, max broadcast back): every maximal element receives dy
        d = (xs[0] == xs[1]).astype(np.float64)
    else:
        raise NotImplementedError(f"no gradient rule for {op}")
    return dy * d


def _expand_weight(w: np.ndarray, x_ndim: int) -> np.ndarray:
    return w.reshape(w.shape + (1,) * (x_ndim - w.ndim))


def _attention(g: RefGraph, s_src, s_dst, a: dict, step=None):
    """GAT's coefficients a [E, H], d e / d z [E, H] (e = leaky_relu(z)) and the
    dropout factors m [E, H] (keep / (1 - p), as ``dropout`` of the coefficients)."""
    slope = a["negative_slope"]
    z = s_src[g.src] + s_dst[g.dst]
    m = np.ones(z.shape)
    if a["p"] > 0:
        m = keep_mask(a["seed"], int(step), z.shape, a["p"]) / (1.0 - a["p"])
    return _edge_softmax(g, np.where(z > 0, z, slope * z)), np.where(z > 0, 1.0, slope), m


def _attention_grad(op: Op, a: dict, g: RefGraph, x, s_src, s_dst, dy, step=None):
    """The two halves of attention's backward, from per-edge tensors (see ops.py)."""
    alpha, r, m = _attention(g, s_src, s_dst, a, step)
    slope = a["negative_slope"]
    n, H = s_src.shape
    xs, dys = x.reshape(n, H, -1), dy.reshape(n, H, -1)
    dot = m * (dys[g.dst] * xs[g.src]).sum(-1)             # m dy_i . x_j   [E, H]
    D = _scatter(g, alpha * dot, "sum", g.dst)             # dy_i . y_i      [N, H]
    dz = alpha * r * (dot - D[g.dst])                      # d loss / d z_ji [E, H]
    if op == Op.ATTENTION_GRAD_DST:
        z = s_src[g.src] + s_dst[g.dst]
        e = np.where(z > 0, z, slope * z)
        mx = np.full((n, H), -np.inf)
        np.maximum.at(mx, g.dst, e)
        has = np.isfinite(mx)
        mx = np.where(has, mx, 0.0)
        lse = np.zeros((n, H))
        np.add.at(lse, g.dst, np.exp(e - mx[g.dst]))
        lse = np.where(has, mx + np.log(np.where(has, lse, 1.0)), 0.0)
        return np.concatenate([_scatter(g, dz, "sum", g.dst), s_dst, lse, D], axis=1)
    dx = _scatter(g, dys[g.dst] * (alpha * m)[..., None], "sum", g.src).reshape(n, -1)
    return np.concatenate([dx, _scatter(g, dz, "sum", g.src)], axis=1)


def _degree(g: RefGraph, w, side: str) -> np.ndarray:
    idx = g.dst if side == "in" else g.src
    w = np.ones(g.num_edges) if w is None else w
    out = np.zeros(g.num_nodes)
    np.add.at(out, idx, w)
    return out


def _edge_softmax(g: RefGraph, e: np.ndarray) -> np.ndarray:
    mx = np.full((g.num_nodes,) + e.shape[1:], -np.inf)
    np.maximum.at(mx, g.dst, e)
    ex = np.exp(e - mx[g.dst])
    s = np.zeros_like(mx)
    np.add.at(s, g.dst, ex)
    return ex / s[g.dst]


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    ex = np.exp(x - x.max(axis=axis, keepdims=True))
    return ex / ex.sum(axis=axis, keepdims=True)


_UNARY = {
    Op.RELU: lambda x, a: np.maximum(x, 0.0),
    Op.LEAKY_RELU: lambda x, a: np.where(x > 0, x, a["alpha"] * x),
    Op.ELU: lambda x, a: np.where(x > 0, x, a["alpha"] * np.expm1(np.minimum(x, 0.0))),
    Op.EXP: lambda x, a: np.exp(x),
    Op.LOG: lambda x, a: np.log(x),
    Op.SIGMOID: lambda x, a: 1.0 / (1.0 + np.exp(-x)),
    Op.TANH: lambda x, a: np.tanh(x),
    Op.NEG: lambda x, a: -x,
    Op.SQRT: lambda x, a: np.sqrt(x),
    Op.POW: lambda x, a: np.power(x, a["exponent"]),
}
_BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
    Op.MAXIMUM: np.maximum, Op.MINIMUM: np.minimum, Op.BIAS_ADD: np.add,
}
_REDUCE = {Op.SUM: np.sum, Op.MEAN: np.mean, Op.MAX: np.max}


def sign_bits(y: np.ndarray) -> np.ndarray:
    """int32 [N, ceil(F / 32)]: bit b of word w is y[:, 32 w + b] > 0."""
    n, f = y.shape
    pos = np.zeros((n, sign_words(f) * BITS), dtype=np.uint64)
    pos[:, :f] = y > 0
    words = (pos.reshape(n, -1, BITS) << np.arange(BITS, dtype=np.uint64)).sum(axis=2)
    return words.astype(np.uint32).view(np.int32)


def unpack_bits(bits: np.ndarray, f: int) -> np.ndarray:
    """The [N, f] booleans ``sign_bits`` packed."""
    words = bits.astype(np.int32).view(np.uint32).astype(np.uint64)
    flat = (words[:, :, None] >> np.arange(BITS, dtype=np.uint64)) & 1
    return flat.reshape(len(bits), -1)[:, :f].astype(bool)


def evaluate_node(n, args: list, num_nodes: int):
    """Value of node ``n`` given the values of its inputs."""
    a = n.attrs
    op = n.op
    if op == Op.SELF_LOOPS:
        return _self_loops(args[0], a["mode"])
    if op == Op.EDGE_REMAP:
        g2, w = args
        out = np.full((g2.num_edges,) + w.shape[1:], float(a["fill"]))
        has = g2.origin >= 0
        out[has] = w[g2.origin[has]]
        return out
    if op == Op.DEGREE:
        return _degree(args[0], args[1] if len(args) > 1 else None, a["side"])
    if op == Op.SYM_NORM:
        g = args[0]
        w = args[1] if len(args) > 1 else np.ones(g.num_edges)
        deg = _degree(g, w, "in")
        with np.errstate(divide="ignore"):
            dinv = deg ** -0.5
        dinv[np.isinf(dinv)] = 0.0
        return dinv[g.src] * w * dinv[g.dst]
    if op == Op.GATHER:
        g, x = args
        return x[g.src if a["side"] == "src" else g.dst]
    if op == Op.SCATTER:
        g = args[0]
        return _scatter(g, args[1], a["reduce"], g.dst if a["side"] == "dst" else g.src)
    if op == Op.AGGREGATE:
        g, x = args[0], args[1]
        frm, to = (g.src, g.dst) if a["flow"] == "in" else (g.dst, g.src)
        msg = x[frm]
        if len(args) == 3:
            msg = msg * _expand_weight(args[2], x.ndim)
        return _scatter(g, msg, a["reduce"], to)
    if op == Op.EDGE_DOT:
        g, x, y = args
        return (x[g.src] * y[g.dst]).sum(axis=-1)
    if op == Op.AGGREGATE_ARGMAX:
        g, x = args
        return _argmax_edges(g, x[g.src])
    if op == Op.SCATTER_ARGMAX:
        return _argmax_edges(args[0], args[1])
    if op == Op.SCATTER_MAX_GRAD:
        return _route_max(*args)
    if op == Op.AGGREGATE_MAX_GRAD:
        g, dy, am = args
        return _scatter(g, _route_max(g, dy, am), "sum", g.src)
    if op == Op.DROPOUT:
        x, step = args
        keep = keep_mask(a["seed"], int(step), x.shape, a["p"])
        return np.where(keep, x / (1.0 - a["p"]), 0.0)
    if op == Op.CROSS_ENTROPY:
        z, y, m = args
        lp = _log_softmax(z, -1)[np.arange(len(y)), y.astype(np.int64)]
        return -(m * lp).sum() / m.sum()
    if op == Op.CROSS_ENTROPY_GRAD:
        dy, z, y, m = args
        p = _softmax(z, -1)
        p[np.arange(len(y)), y.astype(np.int64)] -= 1.0
        return dy * p * (m / m.sum())[:, None]
    if op == Op.ELEMENTWISE_GRAD:
        return _elementwise_grad(Op(a["op"]), a["wrt"], a, args[0], args[1:])
    if op == Op.SIGN_BITS:
        return sign_bits(args[0])
    if op == Op.MASK_BITS:
        dy, bits = args
        return np.where(unpack_bits(bits, dy.shape[1]), dy, 0.0)
    if op == Op.BROADCAST_TO:
        shape = (args[1].shape if a["shape"] is None
                 else [num_nodes if d == "N" else d for d in a["shape"]])
        return np.broadcast_to(args[0], shape).copy()
    if op == Op.SLICE:
        idx = [slice(None)] * args[0].ndim
        idx[a["axis"]] = slice(a["start"], a["stop"])
        return args[0][tuple(idx)]
    if op == Op.EDGE_SOFTMAX:
        return _edge_softmax(args[0], args[1])
    if op == Op.ATTENTION_AGGREGATE:
        g, x, s_src, s_dst = args[:4]
        alpha, _, m = _attention(g, s_src, s_dst, a, *args[4:])
        return _scatter(g, x[g.src] * _expand_weight(alpha * m, x.ndim), "sum", g.dst)
    if op == Op.ATTENTION_GRAD_DST:
        return _attention_grad(op, a, *args)
    if op == Op.ATTENTION_GRAD_SRC:  # s_dst from the statistics
        g, x, s_src, dy, stats = args[:5]
        H = s_src.shape[1]
        return _attention_grad(op, a, g, x, s_src, stats[:, H:2 * H], dy, *args[5:])
    if op == Op.MATMUL:
        x, w = args
        if a["sum_row"]:
            return np.vstack([x.T @ w, w.sum(0, keepdims=True)])
        return (x.T @ w) if a["trans_a"] else x @ (w.T if a["trans_b"] else w)
    if op in _UNARY:
        return _UNARY[op](args[0], a)
    if op in _BINARY:
        return _BINARY[op](args[0], args[1])
    if op == Op.CONCAT:
        return np.concatenate(args, axis=a["axis"])
    if op == Op.RESHAPE:
        x = args[0]
        shape = [x.shape[0] if d in ("N", "E") else d for d in a["shape"]]
        return x.reshape(shape)
    if op in _REDUCE:
        return _REDUCE[op](args[0], axis=a["axis"], keepdims=a["keepdims"])
    if op == Op.SOFTMAX:
        return _softmax(args[0], a["axis"])
    if op == Op.LOG_SOFTMAX:
        return _log_softmax(args[0], a["axis"])
    raise NotImplementedError(f"interpreter has no rule for {op}")


def interpret(g: Graph, inputs: dict, params: dict, *, return_env: bool = False):
    """Run ``g`` in float64.

    ``inputs`` maps input names to arrays (node features in node order, edge
    values in the graph's edge order) or ``RefGraph`` values; ``params`` maps
    parameter names to arrays.  Returns the list of outputs (and the map of all
    values when ``return_env``).
    """
    env: dict[str, object] = {}
    num_nodes = None
    for n in g.inputs:
        if n.name not in inputs:
            raise InputError(f"missing input {n.name!r}")
        v = inputs[n.name]
        if isinstance(n.ty, GraphType):
            if not isinstance(v, RefGraph):
                raise InputError(f"input {n.name!r} must be a RefGraph")
            num_nodes = v.num_nodes if num_nodes is None else num_nodes
        elif n.ty.dtype == "int32":
            v = np.asarray(v, dtype=np.int64)
        else:
            v = np.asarray(v, dtype=np.float64)
        env[n.name] = v
    for n in g:
        if n.op == Op.INPUT:
            continue
        if n.op == Op.PARAM:
            env[n.name] = np.asarray(params[n.name], dtype=np.float64)
        elif n.op == Op.CONST:
            env[n.name] = np.float64(n.attrs["value"])
        else:
            env[n.name] = evaluate_node(n, [env[i.name] for i in n.inputs], num_nodes)
    outs = [env[o.name] for o in g.outputs]
    return (outs, env) if return_env else outs
