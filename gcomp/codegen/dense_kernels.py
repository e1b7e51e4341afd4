"""Dense kernels in TE: matmul, elementwise (with broadcasting), reductions,
softmax, concat.

Shapes in a spec use ``"n"`` for the one symbolic leading axis a kernel sees
(nodes or edges, never both: the IR's types forbid mixing them).
"""

from __future__ import annotations

from tvm import te, tirx

from gcomp.codegen.kernels import definer


def _dims(shape, n):
    return tuple(n if d == "n" else int(d) for d in shape)


def _bcast_index(shape, out_shape, idx):
    """Index into a tensor of ``shape`` broadcast (numpy rules) to ``out_shape``."""
    k = len(out_shape) - len(shape)
    return tuple(0 if (d == 1 and out_shape[k + a] != 1) else idx[k + a]
                 for a, d in enumerate(shape))


def _f32(v):
    return tirx.const(float(v), "float32")


def _apply(op: str, attrs: dict, args):
    x = args[0]
    if op == "relu":
        return tirx.max(x, _f32(0))
    if op == "leaky_relu":
        return tirx.Select(x > _f32(0), x, x * _f32(attrs["alpha"]))
    if op == "elu":
        return tirx.Select(x > _f32(0), x, _f32(attrs["alpha"]) * (tirx.exp(x) - _f32(1)))
    if op == "exp":
        return tirx.exp(x)
    if op == "log":
        return tirx.log(x)
    if op == "sigmoid":
        return tirx.sigmoid(x)
    if op == "tanh":
        return tirx.tanh(x)
    if op == "neg":
        return -x
    if op == "sqrt":
        return tirx.sqrt(x)
    if op == "pow":
        return tirx.power(x, _f32(attrs["exponent"]))
    y = args[1]
    if op in ("add", "bias_add"):
        return x + y
    if op == "sub":
        return x - y
    if op == "mul":
        return x * y
    if op == "div":
        return x / y
    if op == "maximum":
        return tirx.max(x, y)
    if op == "minimum":
        return tirx.min(x, y)
    raise ValueError(op)


@definer("ewise")
def ewise(op: str, attrs: tuple, in_shapes: tuple, out_shape: tuple):
    """out = op(inputs...) with numpy broadcasting."""
    n = tirx.Var("n", "int64")
    attrs = dict(attrs)
    ins = [te.placeholder(_dims(s, n), "float32", name=f"in{i}") for i, s in enumerate(in_shapes)]
    oshape = _dims(out_shape, n)

    def body(*idx):
        vals = [t[_bcast_index(s, out_shape, idx)] if s else t[()] for t, s in zip(ins, in_shapes)]
        return _apply(op, attrs, vals)

    out = te.compute(oshape, body, name="ewise")
    return te.create_prim_func(ins + [out])


@definer("matmul")
def matmul(K: int, M: int):
    """out[i, j] = sum_k x[i, k] * w[k, j] (x: [n, K], w: [K, M])."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, K), "float32", name="x")
    w = te.placeholder((K, M), "float32", name="w")
    k = te.reduce_axis((0, K), name="k")
    out = te.compute((n, M), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="matmul")
    return te.create_prim_func([x, w, out])


@definer("reduce")
def reduce(op: str, shape: tuple, axis: int, keepdims: bool):
    """sum / mean / max of x over one axis."""
    n = tirx.Var("n", "int64")
    x = te.placeholder(_dims(shape, n), "float32", name="x")
    full = _dims(shape, n)
    r = te.reduce_axis((0, full[axis]), name="r")
    oshape = tuple(1 if a == axis else d for a, d in enumerate(full)) if keepdims else \
        tuple(d for a, d in enumerate(full) if a != axis)

    def index(idx):
        idx = list(idx)
        if keepdims:
            idx[axis] = r
        else:
            idx.insert(axis, r)
        return tuple(idx)

    if op == "max":
        red = te.compute(oshape, lambda *i: te.max(x[index(i)], axis=r), name="reduce")
    else:
        red = te.compute(oshape, lambda *i: te.sum(x[index(i)], axis=r), name="reduce")
    if op == "mean":
        cnt = tirx.Cast("float32", full[axis])
        red = te.compute(oshape, lambda *i: red[i] / cnt, name="mean")
    return te.create_prim_func([x, red])


@definer("softmax")
def softmax(shape: tuple, log: bool):
    """(log-)softmax over the last axis."""
    n = tirx.Var("n", "int64")
    x = te.placeholder(_dims(shape, n), "float32", name="x")
    full = _dims(shape, n)
    last = full[-1]
    r1 = te.reduce_axis((0, last), name="r1")
    r2 = te.reduce_axis((0, last), name="r2")
    mx = te.compute(full[:-1], lambda *i: te.max(x[i + (r1,)], axis=r1), name="rowmax")
    sm = te.compute(full[:-1], lambda *i: te.sum(tirx.exp(x[i + (r2,)] - mx[i]), axis=r2),
                    name="rowsum")
    if log:
        out = te.compute(full, lambda *i: x[i] - mx[i[:-1]] - tirx.log(sm[i[:-1]]), name="softmax")
    else:
        out = te.compute(full, lambda *i: tirx.exp(x[i] - mx[i[:-1]]) / sm[i[:-1]], name="softmax")
    return te.create_prim_func([x, out])


@definer("concat")
def concat(shapes: tuple, axis: int):
    """Concatenation along a static axis."""
    n = tirx.Var("n", "int64")
    ins = [te.placeholder(_dims(s, n), "float32", name=f"in{i}") for i, s in enumerate(shapes)]
    sizes = [int(s[axis]) for s in shapes]
    oshape = list(_dims(shapes[0], n))
    oshape[axis] = sum(sizes)

    def body(*idx):
        a = idx[axis]
        offs = sum(sizes[:-1])
        val = ins[-1][idx[:axis] + (a - offs,) + idx[axis + 1:]]
        for t, off, size in reversed(list(zip(ins[:-1], _offsets(sizes), sizes[:-1]))):
            val = tirx.if_then_else(a < off + size, t[idx[:axis] + (a - off,) + idx[axis + 1:]], val)
        return val

    out = te.compute(tuple(oshape), body, name="concat")
    return te.create_prim_func(ins + [out])


def _offsets(sizes):
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
