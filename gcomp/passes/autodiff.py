"""Reverse-mode automatic differentiation on the Graph IR.

Expects: a graph whose first output is a scalar loss (``f32[]``), after
``canonicalize`` and ``fuse_aggregate`` (so aggregation is already sparse and
its backward is too).
Guarantees: the graph's outputs become ``[loss, d loss / d p for every
parameter p the loss depends on]`` and ``graph.meta["grads"]`` maps each such
parameter's name to the name of its gradient value; a parameter the loss does not
depend on (one feeding only another output) has none, and the optimizer leaves it as
it is, as PyTorch's optimizers skip a parameter whose ``.grad`` is None.  Only values
on a path from a parameter to the loss are differentiated.  The backward pass of an
aggregation over in-edges is an aggregation over out-edges (the transposed graph;
lowered as a gather over its CSC arrays, or on CUDA with memory preferred as an atomic
scatter); edge weights get ``edge_dot``; fused attention gets ``attention_grad_dst``
and ``attention_grad_src`` (no edge tensors); max reductions route the gradient to the
first maximal edge; dropout reuses its (seed, step) mask; the gradients of slices of
one value are concatenated (zeros fill what no slice reads).

    Before:  %h = aggregate[reduce="sum"](%g, %x, %w) : f32[N,16]
             ... %loss = cross_entropy(%z, %y, %mask) : f32[]
    After:   ... %grad.h = ...
             %grad.x = aggregate[reduce="sum", flow="out"](%g, %grad.h, %w) : f32[N,16]
             %grad.w = edge_dot(%g, %x, %grad.h) : f32[E(g)]
"""

from __future__ import annotations

from math import prod

from gcomp.errors import IRError
from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op, OpGroup
from gcomp.ir.types import N, EdgeDim, TensorType
from gcomp.passes.manager import Pass


class _Builder:
    """Creates gradient nodes at the end of the graph with readable names."""

    def __init__(self, graph: Graph):
        self.g = graph

    def __call__(self, opcode: Op, inputs, hint: str, ty=None, **attrs) -> Node:
        return self.g.create_node(opcode, inputs, attrs, ty=ty, name=self.g.fresh_name(hint))

    def const(self, v: float, hint: str) -> Node:
        return self(Op.CONST, [], hint, ty=TensorType((), "float32"), value=float(v))

    def reshape(self, x: Node, shape: tuple, hint: str) -> Node:
        if tuple(x.ty.shape) == tuple(shape):
            return x
        lead = ["N" if d == N else "E" if not isinstance(d, int) else d for d in shape[:1]]
        return self(Op.RESHAPE, [x], hint, shape=lead + [int(d) for d in shape[1:]])

    def unbroadcast(self, grad: Node, target: TensorType, hint: str) -> Node:
        """Sum ``grad`` over the axes that broadcasting added to ``target``."""
        while grad.ty.rank > target.rank:
            grad = self(Op.SUM, [grad], hint, axis=0, keepdims=False)
        for ax, d in enumerate(target.shape):
            if d == 1 and grad.ty.shape[ax] != 1:
                grad = self(Op.SUM, [grad], hint, axis=ax, keepdims=True)
        return grad

    def unslice(self, x: Node, pieces: list, hint: str) -> Node:
        """d loss / d x from the gradients of slices of x, ``(axis, start, stop, dy)`` each.

        Slices that do not overlap along an axis become one concat with zeros in the
        gaps, so slices that tile x (a GRU's gates, a stack of weights) cost one copy and
        no additions."""
        total = None
        for ax in sorted({p[0] for p in pieces}):
            layers: list[list] = []  # each a run of non-overlapping slices, by start
            for piece in sorted((p for p in pieces if p[0] == ax), key=lambda p: p[1:3]):
                layer = next((run for run in layers if run[-1][2] <= piece[1]), None)
                if layer is None:
                    layers.append([piece])
                else:
                    layer.append(piece)
            for layer in layers:
                parts, off = [], 0
                for _, start, stop, g in layer + [(ax, x.ty.shape[ax], None, None)]:
                    if start > off:
                        parts.append(self.zeros(x, ax, start - off, hint))
                    if g is not None:
                        parts.append(g)
                        off = stop
                g = parts[0] if len(parts) == 1 else self(Op.CONCAT, parts, hint, axis=ax)
                total = g if total is None else self(Op.ADD, [total, g], hint)
        return total

    def zeros(self, like: Node, axis: int, size: int, hint: str) -> Node:
        """Zeros shaped like ``like`` but ``size`` long on ``axis``."""
        shape = list(like.ty.shape)
        if any(isinstance(d, EdgeDim) for d in shape):
            raise IRError(f"%{like.name}: no gradient for a partial slice of an edge tensor")
        shape[axis] = size
        return self(Op.BROADCAST_TO, [self.const(0.0, hint)], hint, shape=shape)

    def inv_degree(self, g: Node, side: str, like: Node, hint: str) -> Node:
        """1 / max(degree, 1), shaped to broadcast against ``like`` ([N, ...])."""
        deg = self(Op.DEGREE, [g], hint, side=side)
        inv = self(Op.DIV, [self.const(1.0, hint), self(Op.MAXIMUM, [deg, self.const(1.0, hint)],
                                                          hint)], hint)
        return self.reshape(inv, (N,) + (1,) * (like.ty.rank - 1), hint)


OF_OUTPUT = frozenset({Op.RELU, Op.LEAKY_RELU, Op.ELU, Op.SIGMOID, Op.TANH, Op.EXP})


def _keep_shape(x: TensorType, axis: int) -> tuple:
    shape = list(x.shape)
    shape[axis % x.rank] = 1
    return tuple(shape)


def _vjp(b: _Builder, n: Node, dy: Node, needs) -> list[tuple[int, Node]]:
    """(input index, gradient) for each input of ``n`` that needs a gradient."""
    op, ins, a = n.op, n.inputs, n.attrs
    h = f"grad.{n.name}"
    out: list[tuple[int, Node]] = []

    def want(i):
        return needs(ins[i])

    if op == Op.MATMUL:
        x, w = ins
        if a["sum_row"]:
            raise IRError(f"%{n.name}: no gradient for a matmul with sum_row (a backward op)")
        if a["trans_a"]:  # y = x.T @ w
            if want(0):
                out.append((0, b(Op.MATMUL, [w, dy], h, trans_b=True)))
            if want(1):
                out.append((1, b(Op.MATMUL, [x, dy], h)))
        elif a["trans_b"]:  # y = x @ w.T
            if want(0):
                out.append((0, b(Op.MATMUL, [dy, w], h)))
            if want(1):
                out.append((1, b(Op.MATMUL, [dy, x], h, trans_a=True)))
        else:
            if want(0):
                out.append((0, b(Op.MATMUL, [dy, w], h, trans_b=True)))
            if want(1):
                out.append((1, b(Op.MATMUL, [x, dy], h, trans_a=True)))
    elif op in (Op.ADD, Op.BIAS_ADD, Op.SUB):
        for i in (0, 1):
            if want(i):
                g = b(Op.NEG, [dy], h) if (op == Op.SUB and i == 1) else dy
                out.append((i, b.unbroadcast(g, ins[i].ty, h)))
    elif op == Op.MUL:
        for i in (0, 1):
            if want(i):
                out.append((i, b.unbroadcast(b(Op.MUL, [dy, ins[1 - i]], h), ins[i].ty, h)))
    elif op in OpGroup.Binary:
        for i in (0, 1):
            if want(i):
                g = b(Op.ELEMENTWISE_GRAD, [dy, ins[0], ins[1]], h, op=op.value, wrt=i)
                out.append((i, b.unbroadcast(g, ins[i].ty, h)))
    elif op == Op.NEG:
        out.append((0, b(Op.NEG, [dy], h)))
    elif op in OF_OUTPUT and a.get("alpha", 1.0) > 0:
        # the derivative from the output: the activation's input need not stay alive,
        # which lets fusion fold it into the producing kernel
        extra = {k: a[k] for k in ("alpha",) if k in a}
        out.append((0, b(Op.ELEMENTWISE_GRAD, [dy, n], h, op=op.value, of_output=True, **extra)))
    elif op in OpGroup.Unary:
        extra = {k: a[k] for k in ("alpha", "exponent") if k in a}
        out.append((0, b(Op.ELEMENTWISE_GRAD, [dy, ins[0]], h, op=op.value, wrt=0, **extra)))
    elif op == Op.RESHAPE:
        out.append((0, b.reshape(dy, ins[0].ty.shape, h)))
    elif op == Op.CONCAT:
        ax = a["axis"] % n.ty.rank
        off = 0
        for i, x in enumerate(ins):
            size = x.ty.shape[ax]
            if want(i):
                out.append((i, b(Op.SLICE, [dy], h, axis=ax, start=off, stop=off + size)))
            off += size
    elif op in (Op.SUM, Op.MEAN):
        x = ins[0]
        keep = _keep_shape(x.ty, a["axis"])
        g = b(Op.BROADCAST_TO, [b.reshape(dy, keep, h), x], h)
        if op == Op.MEAN:
            count = x.ty.shape[a["axis"] % x.ty.rank]
            if not isinstance(count, int):
                raise IRError(f"%{n.name}: no gradient for a mean over all nodes or edges")
            g = b(Op.MUL, [g, b.const(1.0 / count, h)], h)
        out.append((0, g))
    elif op == Op.MAX:
        x = ins[0]
        keep = _keep_shape(x.ty, a["axis"])
        dyb = b(Op.BROADCAST_TO, [b.reshape(dy, keep, h), x], h)
        yb = b(Op.BROADCAST_TO, [b.reshape(n, keep, h), x], h)
        out.append((0, b(Op.ELEMENTWISE_GRAD, [dyb, x, yb], h, op="max", wrt=0)))
    elif op == Op.SOFTMAX:
        ax = a["axis"]
        s = b(Op.SUM, [b(Op.MUL, [dy, n], h)], h, axis=ax, keepdims=True)
        out.append((0, b(Op.MUL, [n, b(Op.SUB, [dy, s], h)], h)))
    elif op == Op.LOG_SOFTMAX:
        s = b(Op.SUM, [dy], h, axis=a["axis"], keepdims=True)
        out.append((0, b(Op.SUB, [dy, b(Op.MUL, [b(Op.EXP, [n], h), s], h)], h)))
    elif op == Op.GATHER:
        g = ins[0]
        out.append((1, b(Op.SCATTER, [g, dy], h, reduce="sum",
                         side="src" if a["side"] == "src" else "dst")))
    elif op == Op.SCATTER:
        g, e = ins
        side = a["side"]
        if a["reduce"] == "max":
            am = b(Op.SCATTER_ARGMAX, [g, e], h)
            out.append((1, b(Op.SCATTER_MAX_GRAD, [g, dy, am], h)))
        else:
            if a["reduce"] == "mean":
                dy = b(Op.MUL, [dy, b.inv_degree(g, "in" if side == "dst" else "out", dy, h)], h)
            out.append((1, b(Op.GATHER, [g, dy], h, side=side)))
    elif op == Op.AGGREGATE:
        g, x = ins[0], ins[1]
        w = ins[2] if len(ins) > 2 else None
        if a["flow"] != "in":
            raise IRError(f"%{n.name}: no gradient for aggregation over out-edges")
        if a["reduce"] == "max" and w is not None:
            # which edge wins depends on w * x[src]: the backward rebuilds those messages
            # (an E x F tensor the fused forward does not have) and routes dy through them
            wb = b.reshape(w, tuple(w.ty.shape) + (1,) * (x.ty.rank - w.ty.rank), h)
            xs = b(Op.GATHER, [g, x], h, side="src")
            m = b(Op.MUL, [wb, xs], h)
            dm = b(Op.SCATTER_MAX_GRAD, [g, dy, b(Op.SCATTER_ARGMAX, [g, m], h)], h)
            if want(1):
                out.append((1, b(Op.SCATTER, [g, b(Op.MUL, [wb, dm], h)], h, reduce="sum",
                                 side="src")))
            if want(2):
                dw = b.unbroadcast(b(Op.MUL, [dm, xs], h), wb.ty, h)
                out.append((2, b.reshape(dw, tuple(w.ty.shape), h)))
        elif a["reduce"] == "max":
            am = b(Op.AGGREGATE_ARGMAX, [g, x], h)
            out.append((1, b(Op.AGGREGATE_MAX_GRAD, [g, dy, am], h)))
        else:
            if a["reduce"] == "mean":
                dy = b(Op.MUL, [dy, b.inv_degree(g, "in", dy, h)], h)
            if want(1):
                out.append((1, b(Op.AGGREGATE, [g, dy] + ([w] if w is not None else []), h,
                                 reduce="sum", flow="out")))
            if w is not None and want(2):
                # dL/dw_e = sum over features (within a head) of x[src] * dy[dst]
                k = w.ty.rank - 1
                heads = x.ty.shape[1:1 + k]
                xs = b.reshape(x, (N,) + tuple(heads) + (int(prod(x.ty.shape[1 + k:])),), h)
                ds = b.reshape(dy, xs.ty.shape, h)
                out.append((2, b(Op.EDGE_DOT, [g, xs, ds], h)))
    elif op == Op.ATTENTION_AGGREGATE:
        # the fused backward: one pass over each destination's in-edges (its softmax
        # statistics and d s_dst), one over each source's out-edges (d x, d s_src); no
        # edge tensor, like the forward
        g, x = ins[0], ins[1]
        H = int(x.ty.shape[1])
        F = int(prod(x.ty.shape[1:]))
        same = dict(a)  # slope and dropout (its step input rides at the end)
        step = list(ins[4:])
        stats = b(Op.ATTENTION_GRAD_DST, [g, x, ins[2], ins[3], dy] + step, f"{h}.dst", **same)
        if want(3):
            out.append((3, b(Op.SLICE, [stats], h, axis=1, start=0, stop=H)))
        if want(1) or want(2):
            both = b(Op.ATTENTION_GRAD_SRC, [g, x, ins[2], dy, stats] + step, f"{h}.src",
                     **same)
            if want(1):
                out.append((1, b.reshape(b(Op.SLICE, [both], h, axis=1, start=0, stop=F),
                                         x.ty.shape, h)))
            if want(2):
                out.append((2, b(Op.SLICE, [both], h, axis=1, start=F, stop=F + H)))
    elif op == Op.EDGE_SOFTMAX:
        g = ins[0]
        s = b(Op.SCATTER, [g, b(Op.MUL, [dy, n], h)], h, reduce="sum")
        out.append((1, b(Op.MUL, [n, b(Op.SUB, [dy, b(Op.GATHER, [g, s], h, side="dst")], h)], h)))
    elif op == Op.DROPOUT:
        out.append((0, b(Op.DROPOUT, [dy, ins[1]], h, p=a["p"], seed=a["seed"])))
    elif op == Op.CROSS_ENTROPY:
        out.append((0, b(Op.CROSS_ENTROPY_GRAD, [dy] + list(ins), h)))
    else:
        raise IRError(f"%{n.name}: no gradient rule for {op} (needed because a parameter "
                      "flows into it)")
    return [(i, g) for i, g in out if want(i)]


class Autodiff(Pass):
    name = "autodiff"

    def run(self, graph: Graph, ctx) -> bool:
        loss = graph.outputs[0] if graph.outputs else None
        if loss is None or loss.ty != TensorType((), "float32"):
            raise IRError("autodiff needs a scalar f32[] loss as the first output")
        params = graph.params
        needs: dict[Node, bool] = {}
        for n in graph:
            needs[n] = n.op == Op.PARAM or any(needs[i] for i in n.inputs)
        order = graph.nodes
        b = _Builder(graph)
        adj: dict[Node, Node] = {loss: b.const(1.0, "grad.seed")}
        # gradients of slices, put together when their input is reached (all its users
        # come later in the graph, so all have been differentiated by then)
        pieces: dict[Node, list] = {}
        for n in reversed(order[:order.index(loss) + 1]):
            if n in pieces:
                g = b.unslice(n, pieces.pop(n), f"grad.{n.name}")
                adj[n] = g if n not in adj else b(Op.ADD, [adj[n], g], f"grad.{n.name}")
            dy = adj.get(n)
            if dy is None or n.op in OpGroup.Leaf or not needs[n]:
                continue
            if n.op == Op.SLICE:
                a = n.attrs
                pieces.setdefault(n.inputs[0], []).append(
                    (a["axis"] % n.ty.rank, a["start"], a["stop"], dy))
                continue
            for i, g in _vjp(b, n, dy, lambda v: needs[v]):
                src = n.inputs[i]
                adj[src] = g if src not in adj else b(Op.ADD, [adj[src], g], f"grad.{src.name}")
        if not any(p in adj for p in params):
            raise IRError("no parameter influences the loss: there is nothing to train")
        grads = {}
        for p in params:
            if p not in adj:  # left untouched by the optimizer
                continue
            g = adj[p]
            if g.ty != p.ty:  # e.g. a scalar parameter whose gradient kept a unit axis
                g = b.reshape(g, p.ty.shape, f"grad.{p.name}")
            if g in grads.values():  # outputs must be distinct values
                g = b(Op.MUL, [g, b.const(1.0, "one")], f"grad.{p.name}")
            if not graph.has(f"grad.{p.name}") and g.op not in OpGroup.Leaf:
                graph.rename(g, f"grad.{p.name}")
            grads[p.name] = g
        graph.set_outputs([loss] + list(grads.values()))
        graph.meta["grads"] = {k: v.name for k, v in grads.items()}
        return True
