"""Dense kernels in TE: matmul, elementwise (with broadcasting), reductions,
softmax, concat.

Shapes in a spec use ``"n"`` for the one symbolic leading axis a kernel sees
(nodes or edges, never both: the IR's types forbid mixing them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import te, tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as IB

from gcomp.codegen import epilogue as epi
from gcomp.codegen.fastmath import fast_exp, fast_tanh, lanes_of, like
from gcomp.codegen.kernels import arg, definer, env_knob, stored_bf16
from gcomp.errors import CompileError
from gcomp.ir.ops import BITS, sign_words


def _input(shape, name: str):
    """A float32 input, or bfloat16 where the spec stores it so (``kernels.arg``)."""
    return te.placeholder(shape, "bfloat16" if stored_bf16(name) else "float32", name=name)


def _load(t, idx):
    """``t[idx]`` widened to float32: the expressions below mix it with float32 values."""
    v = t[idx]
    return tirx.Cast("float32", v) if t.dtype == "bfloat16" else v


def _result(shape, body, name: str):
    """``te.compute(shape, body)``, rounded once to bfloat16 where the spec stores it so."""
    if stored_bf16(name):
        return te.compute(shape, lambda *i: tirx.Cast("bfloat16", body(*i)), name=name)
    return te.compute(shape, body, name=name)


def _dims(shape, n):
    return tuple(n if d == "n" else int(d) for d in shape)


def _bcast_index(shape, out_shape, idx):
    """Index into a tensor of ``shape`` broadcast (numpy rules) to ``out_shape``."""
    k = len(out_shape) - len(shape)
    return tuple(0 if (d == 1 and out_shape[k + a] != 1) else idx[k + a]
                 for a, d in enumerate(shape))


def _f32(v):
    return tirx.const(float(v), "float32")


def _is_nan(x):
    """Whether float32 ``x`` (scalar or vector) is a NaN, from its bits: LLVM may fold a
    comparison of x with itself away (the kernels' float arithmetic assumes no NaN)."""
    lanes = lanes_of(x)
    i32 = "int32" + (f"x{lanes}" if lanes > 1 else "")
    return (tirx.reinterpret(i32, x) & 0x7FFFFFFF) > 0x7F800000


def _apply(op: str, attrs: dict, args):
    x = args[0]
    if op == "elementwise_grad":  # x is the incoming gradient (fused into its producer)
        return _grad_expr(attrs["op"], attrs["wrt"], attrs, x, args[1:])
    if op == "relu":  # a NaN stays NaN (as torch's): max(x, 0) would give 0
        return tirx.Select(x < _f32(0), like(x, 0.0), x)
    if op == "leaky_relu":
        return tirx.Select(x > _f32(0), x, x * _f32(attrs["alpha"]))
    if op == "elu":
        return tirx.Select(x > _f32(0), x, _f32(attrs["alpha"]) * (fast_exp(x) - _f32(1)))
    if op == "exp":
        return fast_exp(x)
    if op == "log":
        return tirx.log(x)
    if op == "sigmoid":
        return _f32(1) / (_f32(1) + fast_exp(-x))
    if op == "tanh":
        return fast_tanh(x)
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
    if op in ("maximum", "minimum"):  # NaN in either gives NaN, as torch.maximum
        lanes = max(lanes_of(x), lanes_of(y))
        x, y = (v if lanes_of(v) == lanes else tirx.Broadcast(v, lanes) for v in (x, y))
        wins = x > y if op == "maximum" else x < y
        return tirx.Select(tirx.Or(wins, _is_nan(x)), x, y)
    raise ValueError(op)


@definer("ewise")
def ewise(op: str, attrs: tuple, in_shapes: tuple, out_shape: tuple):
    """out = op(inputs...) with numpy broadcasting."""
    n = tirx.Var("n", "int64")
    attrs = dict(attrs)
    ins = [_input(_dims(s, n), f"in{i}") for i, s in enumerate(in_shapes)]
    oshape = _dims(out_shape, n)

    def body(*idx):
        vals = [_load(t, _bcast_index(s, out_shape, idx) if s else ()) for t, s in
                zip(ins, in_shapes)]
        return _apply(op, attrs, vals)

    out = _result(oshape, body, "ewise")
    return te.create_prim_func(ins + [out])


@definer("matmul")
def matmul(K: int, M: int, epilogue: tuple = (), extras: tuple = (), gpu: bool = False,
           trans_b: bool = False):
    """out[i, j] = epilogue(sum_k x[i, k] * w[k, j]) (x: [n, K], w: [K, M]).  ``gpu``:
    the tiled form of ``_matmul_gpu``.  ``trans_b``: given w as [M, K] (a backward's
    ``dy @ W.T``), read transposed (the GPU's plans; the CPU's transpose w first, so
    the vector loop runs along its rows)."""
    if gpu:
        return _matmul_gpu(K, M, epilogue, extras, gpu_mm_tiles(K, M), trans_b)
    n = tirx.Var("n", "int64")
    x = _input((n, K), "x")
    w = te.placeholder((M, K) if trans_b else (K, M), "float32", name="w")
    k = te.reduce_axis((0, K), name="k")
    # a reduction's output stays float32 (a cast would be a block the schedule lacks)
    out = te.compute((n, M), lambda i, j: te.sum(
        _load(x, (i, k)) * (w[j, k] if trans_b else w[k, j]), axis=k), name="matmul")
    if not epilogue:
        return te.create_prim_func([x, w, out])
    ext = [_input(epi.shape(kind, n, M), f"e{i}") for i, kind in enumerate(extras)]
    res = _result((n, M), lambda i, j: epi.apply(
        epilogue, out[i, j], lambda e: _load(ext[e], epi.index(extras[e], i, j))), "epilogue")
    return te.create_prim_func([x, w] + ext + [res])


@dataclass(frozen=True)
class MmTiles:
    """How the GPU form of ``matmul`` cuts its work (``gpu_mm_tiles``): a block of ``ny`` x
    ``nx`` threads owns ``R = ny * ta`` rows of the output, each thread ``ta`` rows by
    ``tb`` columns (columns ``nx`` apart); per step the block stages ``KT`` columns of its
    rows of x and ``KT`` rows of w in shared memory.  K and M are padded to ``Kp`` and
    ``Mp`` (multiples of KT and of tb * nx): the padding reads as zero and is never
    stored."""
    ta: int
    tb: int
    nx: int
    ny: int
    KT: int
    Kp: int
    Mp: int

    @property
    def R(self) -> int:
        return self.ny * self.ta


def gpu_mm_tiles(K: int, M: int) -> MmTiles:
    """The tiling of the GPU ``matmul`` for [n, K] @ [K, M]: every thread split divides its
    (padded) axis (``gpu_tn_tiles`` says why), each thread copies whole elements of both
    staged tiles; preferred: 128 threads or more, then up to ``$GCOMP_CUDA_MM_RESULTS``
    (16) results per thread less the padding, then more threads, then longer k steps
    (fewer synchronizations).  A block takes at most ``$GCOMP_CUDA_MM_ROWS`` rows (64; 0:
    no limit).  Timed on the H200 as knobs (``bench.gpu --knob``, GIN's arxiv-size
    products, 2026-11-26 19:27): without a row limit the 128 -> 32 product ran 1,323
    blocks of 128 rows (1.25 waves at 8 blocks an SM); 64 rows a block (2,646 blocks of
    128 threads) took GIN's 12 products from 0.370 to 0.349 ms, 8 of their 9 kernels
    faster (128 -> 32 with its epilogue 0.062 -> 0.057 ms), one slower (40 -> 40 with a
    bias, 0.033 -> 0.038).  32 results a thread without a row limit (an 8 x 4 tile: 12
    shared loads per 32 multiply-adds, where 8 x 2 makes 10 per 16) made them slower,
    0.370 -> 0.418."""
    most_results = env_knob(MM_RESULTS_ENV, 16)
    most_rows = env_knob(MM_ROWS_ENV, 64, least=0) or None
    best = None
    for tb, nx, Mp in _column_tiles(M):
        for ta in range(1, 9):
            for ny in {1, 2, 4, 8, 16, 32, 64, 128, 256}:
                threads = nx * ny
                if threads > GPU_TN_THREADS or (most_rows and ny * ta > most_rows):
                    continue
                for KT in (32, 16, 8):
                    R, Kp = ny * ta, _round_up(K, KT)
                    if (R * KT) % threads or (KT * Mp) % threads:
                        continue
                    if (R * KT + KT * Mp) * 4 > GPU_TN_SHARED:
                        continue
                    useful = K * M / (Kp * Mp)
                    key = (min(threads, 128), round(min(ta * tb, most_results) * useful, 1),
                           threads, KT)
                    if best is None or key > best[0]:
                        best = (key, MmTiles(ta, tb, nx, ny, KT, Kp, Mp))
    if best is None:
        raise ValueError(f"no GPU tiling of a product into {M} columns from {K}")
    return best[1]


def _matmul_gpu(K: int, M: int, epilogue: tuple, extras: tuple, tl: MmTiles,
                trans_b: bool = False):
    """The GPU's ``matmul``: staged copies ``xs`` (the block's rows of x, zero past the
    last row and column) and ``ws`` (w, zero-padded), the product ``acc`` over padded
    blocks of rows [blocks, R, Mp / nx, nx] (a thread's columns, ``nx`` apart, form an
    exact box: its register tile), and the output block over the same domain, which
    stores only the elements inside [n, M] (after the epilogue)."""
    f32 = "float32"
    zero = tirx.const(0.0, f32)
    R, KT, nx, Kp, Mp = tl.R, tl.KT, tl.nx, tl.Kp, tl.Mp
    with IRBuilder() as ib:
        with IB.prim_func(s_tir=True):
            IB.func_name("matmul")
            IB.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            x = arg("x", (n, K), f32)
            w = arg("w", (M, K) if trans_b else (K, M), f32)
            ext = [arg(f"e{i}", epi.shape(kind, n, M), f32) for i, kind in enumerate(extras)]
            # named as the generic form names its output: the precision pass retypes
            # arguments by name
            out = arg("epilogue" if epilogue else "matmul", (n, M), f32)
            nb = (n + R - 1) // R
            xs = IB.sblock_alloc_buffer((nb, Kp // KT, R, KT), f32)
            ws = IB.sblock_alloc_buffer((Kp // KT, KT, Mp), f32)
            acc = IB.sblock_alloc_buffer((nb, R, Mp // nx, nx), f32)
            for buf, name in ((xs, "xs"), (ws, "ws"), (acc, "acc")):
                IRBuilder.name(name, buf)
            with IB.grid(nb, Kp // KT, R, KT) as (b, kt, r, kk):
                with IB.sblock("xs"):
                    vb, vt, vr, vk = IB.axis.remap("SSSS", [b, kt, r, kk])
                    row, col = vb * R + vr, vt * KT + vk
                    IB.reads(x[row, col])
                    IB.writes(xs[vb, vt, vr, vk])
                    IB.buffer_store(xs, tirx.if_then_else(
                        tirx.all(row < n, col < K), _load(x, (row, col)), zero), [vb, vt, vr, vk])
            # w's tile, its copy walking w's rows (given transposed: its columns), so
            # that neighbouring threads read neighbouring floats of w (32 separate
            # sectors a warp otherwise: GIN's five backward products 0.04 ms slower)
            with IB.grid(Kp // KT, *((Mp, KT) if trans_b else (KT, Mp))) as (kt, c1, c2):
                with IB.sblock("ws"):
                    if trans_b:
                        vt, vj, vk = IB.axis.remap("SSS", [kt, c1, c2])
                    else:
                        vt, vk, vj = IB.axis.remap("SSS", [kt, c1, c2])
                    at = (vj, vt * KT + vk) if trans_b else (vt * KT + vk, vj)
                    IB.reads(w[at])
                    IB.writes(ws[vt, vk, vj])
                    IB.buffer_store(ws, tirx.if_then_else(
                        tirx.all(vt * KT + vk < K, vj < M), w[at], zero), [vt, vk, vj])
            with IB.grid(nb, R, Mp // nx, nx, Kp // KT, KT) as (b, r, u, v, kt, kk):
                with IB.sblock("acc"):
                    vb, vr, vu, vv, vt, vk = IB.axis.remap("SSSSRR", [b, r, u, v, kt, kk])
                    IB.reads(xs[vb, vt, vr, vk], ws[vt, vk, vu * nx + vv])
                    IB.writes(acc[vb, vr, vu, vv])
                    with IB.init():
                        IB.buffer_store(acc, zero, [vb, vr, vu, vv])
                    IB.buffer_store(acc, acc[vb, vr, vu, vv]
                                    + xs[vb, vt, vr, vk] * ws[vt, vk, vu * nx + vv],
                                    [vb, vr, vu, vv])
            with IB.grid(nb, R, Mp // nx, nx) as (b, r, u, v):
                with IB.sblock("out"):
                    vb, vr, vu, vv = IB.axis.remap("SSSS", [b, r, u, v])
                    row, col = vb * R + vr, vu * nx + vv
                    IB.reads(acc[vb, vr, vu, vv],
                             *[e[epi.index(kind, row, col)] for e, kind in zip(ext, extras)])
                    IB.writes(out[row, col])
                    with IB.If(tirx.all(row < n, col < M)):
                        with IB.Then():
                            IB.buffer_store(out, epi.apply(
                                epilogue, acc[vb, vr, vu, vv],
                                lambda k: _load(ext[k], epi.index(extras[k], row, col))),
                                [row, col])
    return ib.get()


def _tree(expr, leaves, idx, out_shape):
    """Evaluate a fused elementwise expression tree at index ``idx`` of its ``out_shape``.
    A ``slice`` or ``reshape`` in the tree maps the index into its input's shape
    (``in_shape``), so a column range or a regrouping of a stored tensor is read in place."""
    if expr[0] == "in":
        t, shape = leaves[expr[1]]
        return _load(t, _bcast_index(shape, out_shape, idx) if shape else ())
    op, attrs, args = expr
    attrs = dict(attrs)
    if op == "slice":
        src = list(idx)
        src[attrs["axis"]] = src[attrs["axis"]] + attrs["start"]
        return _tree(args[0], leaves, tuple(src), attrs["in_shape"])
    if op == "reshape":  # the leading (node or edge) axis stays; the rest is regrouped
        dims = [int(d) for d in out_shape[1:]]
        flat = 0
        for i, d in zip(idx[1:], dims):
            flat = flat * d + i
        src = (idx[0],) + _unflatten(flat, [int(d) for d in attrs["in_shape"][1:]])
        return _tree(args[0], leaves, src, attrs["in_shape"])
    vals = [_tree(a, leaves, idx, out_shape) for a in args]
    if op == "elementwise_grad":
        return _grad_expr(attrs["op"], attrs["wrt"], attrs, vals[0], vals[1:])
    return _apply(op, attrs, vals)


@definer("ewise_chain")
def ewise_chain(expr: tuple, in_shapes: tuple, out_shape: tuple):
    """A fused chain of elementwise ops: one pass over memory instead of one per op."""
    n = tirx.Var("n", "int64")
    ins = [_input(_dims(s, n), f"in{i}") for i, s in enumerate(in_shapes)]
    leaves = list(zip(ins, in_shapes))
    out = _result(_dims(out_shape, n), lambda *i: _tree(expr, leaves, i, out_shape), "ewise")
    return te.create_prim_func(ins + [out])


def _operand(shape: tuple, n, expr: tuple | None, in_shapes: tuple | None):
    """The inputs of a kernel reading one tensor of ``shape``, and an element accessor: the
    tensor itself, or a fused elementwise ``expr`` over ``in_shapes`` evaluated in place."""
    if expr is None:
        x = _input(_dims(shape, n), "x")
        return [x], lambda idx: _load(x, idx)
    ins = [_input(_dims(s, n), f"in{i}") for i, s in enumerate(in_shapes)]
    leaves = list(zip(ins, in_shapes))
    return ins, lambda idx: _tree(expr, leaves, idx, shape)


@definer("reduce")
def reduce(op: str, shape: tuple, axis: int, keepdims: bool, expr: tuple | None = None,
           in_shapes: tuple | None = None):
    """sum / mean / max over one axis of x, or of a fused elementwise ``expr`` of shape
    ``shape`` (never stored)."""
    n = tirx.Var("n", "int64")
    ins, x = _operand(shape, n, expr, in_shapes)
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
        red = te.compute(oshape, lambda *i: te.max(x(index(i)), axis=r), name="reduce")
    else:
        red = te.compute(oshape, lambda *i: te.sum(x(index(i)), axis=r), name="reduce")
    if op == "mean":
        cnt = tirx.Cast("float32", full[axis])
        red = te.compute(oshape, lambda *i: red[i] / cnt, name="mean")
    return te.create_prim_func(ins + [red])


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
    sm = te.compute(full[:-1], lambda *i: te.sum(fast_exp(x[i + (r2,)] - mx[i]), axis=r2),
                    name="rowsum")
    if log:
        out = te.compute(full, lambda *i: x[i] - mx[i[:-1]] - tirx.log(sm[i[:-1]]), name="softmax")
    else:
        out = te.compute(full, lambda *i: fast_exp(x[i] - mx[i[:-1]]) / sm[i[:-1]], name="softmax")
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


def _grad_expr(op: str, wrt: int, attrs: dict, dy, xs):
    """dy * d op(xs) / d xs[wrt]: the meaning of ``elementwise_grad`` (see the interpreter)."""
    x = xs[0]
    zero, one = _f32(0), _f32(1)
    if attrs.get("of_output"):  # x is the op's output y
        d = {"relu": lambda: tirx.Select(x > zero, one, zero),
             "leaky_relu": lambda: tirx.Select(x > zero, one, _f32(attrs["alpha"])),
             "elu": lambda: tirx.Select(x > zero, one, x + _f32(attrs["alpha"])),
             "sigmoid": lambda: x * (one - x),
             "tanh": lambda: one - x * x,
             "exp": lambda: x}[op]()
        return dy * d
    if op == "relu":
        d = tirx.Select(x > zero, one, zero)
    elif op == "leaky_relu":
        d = tirx.Select(x > zero, one, _f32(attrs["alpha"]))
    elif op == "elu":
        d = tirx.Select(x > zero, one, _f32(attrs["alpha"]) * fast_exp(tirx.min(x, zero)))
    elif op == "exp":
        d = fast_exp(x)
    elif op == "log":
        d = one / x
    elif op == "sigmoid":
        s = _f32(1) / (_f32(1) + fast_exp(-x))
        d = s * (one - s)
    elif op == "tanh":
        t = fast_tanh(x)
        d = one - t * t
    elif op == "sqrt":
        d = _f32(0.5) / tirx.sqrt(x)
    elif op == "pow":
        d = _f32(attrs["exponent"]) * tirx.power(x, _f32(attrs["exponent"] - 1.0))
    elif op == "div":
        d = one / xs[1] if wrt == 0 else -xs[0] / (xs[1] * xs[1])
    elif op in ("maximum", "minimum"):
        p, q = (xs[0], xs[1]) if wrt == 0 else (xs[1], xs[0])
        wins = p > q if op == "maximum" else p < q
        d = tirx.Select(wins, one, tirx.Select(p == q, _f32(0.5), zero))
    elif op == "max":
        d = tirx.Select(xs[0] == xs[1], one, zero)
    else:
        raise ValueError(f"no gradient expression for {op}")
    return dy * d


@definer("ewise_grad")
def ewise_grad(op: str, wrt: int, attrs: tuple, in_shapes: tuple, out_shape: tuple):
    """out = dy * d op / d input[wrt], inputs (dy, *forward inputs) broadcast to out."""
    n = tirx.Var("n", "int64")
    attrs = dict(attrs)
    ins = [_input(_dims(s, n), f"in{i}") for i, s in enumerate(in_shapes)]

    def body(*idx):
        vals = [_load(t, _bcast_index(s, out_shape, idx) if s else ()) for t, s in
                zip(ins, in_shapes)]
        return _grad_expr(op, wrt, attrs, vals[0], vals[1:])

    out = _result(_dims(out_shape, n), body, "ewise")
    return te.create_prim_func(ins + [out])


@definer("sign_bits")
def sign_bits(F: int):
    """The signs of x [n, F] packed 32 to an int32 word (``Op.SIGN_BITS``): bit b of word w
    is x[i, 32 w + b] > 0; bits past F are 0 (their loads are clamped into the row)."""
    n = tirx.Var("n", "int64")
    x = _input((n, F), "x")

    def body(i, w):
        word = tirx.const(0, "int32")
        for b in range(BITS):
            f = w * BITS + b
            on = tirx.And(f < F, _load(x, (i, tirx.min(f, F - 1))) > _f32(0))
            word = word | tirx.Select(on, tirx.const(-(1 << b) if b == BITS - 1 else 1 << b,
                                                     "int32"), tirx.const(0, "int32"))
        return word

    out = te.compute((n, sign_words(F)), body, name="ewise")
    return te.create_prim_func([x, out])


@definer("mask_bits")
def mask_bits(F: int):
    """dy [n, F] where the bit ``sign_bits`` packed for the element is set, else 0."""
    n = tirx.Var("n", "int64")
    dy = _input((n, F), "dy")
    bits = te.placeholder((n, sign_words(F)), "int32", name="bits")

    def body(i, j):
        bit = tirx.Cast("int32", tirx.floormod(j, BITS))
        on = (bits[i, tirx.floordiv(j, BITS)] >> bit) & tirx.const(1, "int32")
        return tirx.Select(on != tirx.const(0, "int32"), _load(dy, (i, j)), _f32(0))

    out = _result((n, F), body, "ewise")
    return te.create_prim_func([dy, bits, out])


@definer("broadcast")
def broadcast(in_shape: tuple, out_shape: tuple):
    n = tirx.Var("n", "int64")
    x = _input(_dims(in_shape, n), "x")
    out = _result(_dims(out_shape, n),
                  lambda *i: _load(x, _bcast_index(in_shape, out_shape, i) if in_shape else ()),
                  "ewise")
    return te.create_prim_func([x, out])


@definer("slice")
def slice_(shape: tuple, axis: int, start: int, stop: int):
    n = tirx.Var("n", "int64")
    x = _input(_dims(shape, n), "x")
    oshape = list(_dims(shape, n))
    oshape[axis] = stop - start
    out = _result(tuple(oshape),
                  lambda *i: _load(x, i[:axis] + (i[axis] + start,) + i[axis + 1:]), "ewise")
    return te.create_prim_func([x, out])


@definer("transpose")
def transpose(K: int, M: int):
    w = te.placeholder((K, M), "float32", name="w")
    out = te.compute((M, K), lambda i, j: w[j, i], name="ewise")
    return te.create_prim_func([w, out])


CHUNKS = 16  # partial sums for reductions over the symbolic axis (>= threads, for balance)


@definer("matmul_tn")
def matmul_tn(K: int, M: int, gpu: bool = False, chunks: int = CHUNKS, sum_row: bool = False):
    """out = x.T @ y (x: [n, K], y: [n, M]): weight gradients; with ``sum_row`` a last row
    of y's column sums (the bias gradient, ``passes/fuse_bias_grads.py``; CPU only).

    The rows are cut into ``chunks`` contiguous ranges reduced in parallel into partial
    [K, M] sums, then added up: no atomics, deterministic.  The CPU form is a reduction
    block over each chunk's rows that the CPU schedule tiles so a few rows of the [K, M]
    partial sum stay in vector registers.  ``gpu``: the tiled form of ``_matmul_tn_gpu``
    (its chunks come from ``gpu_tn_tiles``).
    """
    if gpu:
        if sum_row:
            raise CompileError("matmul_tn with a sum row has no GPU form")
        return _matmul_tn_gpu(K, M, gpu_tn_tiles(K, M))
    P, R = chunks, K + int(sum_row)
    n = te.var("n", "int64")
    x = te.placeholder((n, K), "float32", name="x")
    y = te.placeholder((n, M), "float32", name="y")
    rows = (n + P - 1) // P  # rows per chunk; the last chunk's overhang reads as zero
    r = te.reduce_axis((0, rows), name="r")

    def xv(i, a):  # x's row, and a 1 past its end for the sum row
        if not sum_row:
            return x[i, a]
        return tirx.if_then_else(a < K, x[i, tirx.min(a, K - 1)], _f32(1))
    part = te.compute(
        (P, R, M),
        lambda p, a, b: te.sum(tirx.if_then_else(p * rows + r < n,
                                                  xv(p * rows + r, a) * y[p * rows + r, b],
                                                  _f32(0)), axis=r),
        name="part")
    q = te.reduce_axis((0, P), name="q")
    out = te.compute((R, M), lambda a, b: te.sum(part[q, a, b], axis=q), name="sum")
    return te.create_prim_func([x, y, out])


@dataclass(frozen=True)
class TnTiles:
    """How the GPU form of ``matmul_tn`` cuts its work (``gpu_tn_tiles``): a thread block
    of ``ny`` x ``nx`` threads owns a [BK, Mp] slice of one chunk's partial sum, each
    thread ``ta`` rows by ``tb`` columns of it (columns ``nx`` apart, so a warp reads
    neighbouring floats); the block stages ``R`` rows of x and y at a time in shared
    memory; ``P`` chunks of rows.  The partial sums are padded to [Kp, Mp] (multiples of
    BK and of tb * nx): padding reads as zero and is never summed into the result."""
    ta: int
    tb: int
    nx: int
    ny: int
    BK: int
    R: int
    P: int
    Kp: int
    Mp: int


GPU_TN_THREADS = 256  # threads per block at most
GPU_TN_GRID = 528 * 256  # threads in flight to aim for: four full blocks per H100 SM
GPU_TN_PARTIALS = 1 << 21  # floats of chunk partials at most (8 MiB)
GPU_TN_SHARED = 40 * 1024  # bytes of staged rows per block (the static limit is 48 KiB)
GPU_TN_SUM_LANES = 32  # threads (a warp) adding one result element's chunk partials
TN_ROWS_ENV = "GCOMP_CUDA_TN_ROWS"  # fewest rows of x and y a weight-gradient block stages
TN_WAVES_ENV = "GCOMP_CUDA_TN_WAVES"  # weight-gradient threads in flight, in GPU_TN_GRIDs
MM_RESULTS_ENV = "GCOMP_CUDA_MM_RESULTS"  # most results per thread of a product
MM_ROWS_ENV = "GCOMP_CUDA_MM_ROWS"  # most rows per block of a product (0: no limit)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _column_tiles(M: int):
    """(tb, nx, Mp) for the GPU products' columns: ``nx`` threads each owning ``tb`` of
    ``Mp = tb * nx >= M`` columns; a tb that needs as many threads as a smaller one (only
    more padding) is skipped."""
    for tb in range(1, 9):
        nx = -(-M // tb)
        if nx <= GPU_TN_THREADS and not (tb > 1 and -(-M // (tb - 1)) == nx):
            yield tb, nx, tb * nx


def _thread_rows(K: int, ta: int, nx: int) -> set[int]:
    """Candidate rows of threads: as many as fit beside ``nx`` columns (or K needs), and
    the powers of two below (fewer rows let a narrow y tile be copied whole)."""
    most = max(1, min(GPU_TN_THREADS // nx, -(-K // ta)))
    return {most} | {d for d in (1, 2, 4, 8, 16, 32, 64, 128) if d < most}


def gpu_tn_tiles(K: int, M: int) -> TnTiles:
    """The tiling of the GPU ``matmul_tn`` for a [K, M] result.  Every split divides its
    (padded) axis exactly: TVM 0.27 drops the bound check of a register write-back under a
    split that does not divide.  Preferred: at least 128 threads per block where the
    result has that many elements, then up to 16 results per thread (each staged value of
    x feeds ``tb`` products, each of y ``ta``) less the work spent on padding, then more
    threads.  Rows staged per step: at least ``$GCOMP_CUDA_TN_ROWS`` (16), a knob
    (``bench.gpu --knob``): more put more bytes in flight per synchronization (the kernel
    waits on memory: 1.45 TB/s for 128 x 32 on the H200, one wave of blocks), but 32 timed
    the same as 16 there (0.075 ms, 2026-11-26): a block computes as long as it waits, so
    the share of waiting is the same.  ``$GCOMP_CUDA_TN_WAVES`` (1), another knob, scales
    the chunks (blocks) and the partial sums' budget, so more blocks of an SM can wait
    while others compute."""
    rows = env_knob(TN_ROWS_ENV, 16)
    waves = env_knob(TN_WAVES_ENV, 1)
    best = None
    for tb, nx, Mp in _column_tiles(M):
        for ta, ny in ((ta, ny) for ta in range(1, 9) for ny in _thread_rows(K, ta, nx)):
            threads, BK = nx * ny, ta * ny
            Kp = _round_up(K, BK)
            # staged rows: each thread copies whole elements of both tiles
            R = math.lcm(threads // math.gcd(threads, BK), threads // math.gcd(threads, Mp))
            R *= -(-rows // R) if R < rows else 1
            if R * (BK + Mp) * 4 > GPU_TN_SHARED:
                continue
            useful = K * M / (Kp * Mp)
            key = (min(threads, 128), round(min(ta * tb, 16) * useful, 1), threads)
            if best is None or key > best[0]:
                best = (key, (ta, tb, nx, ny, BK, R, Kp, Mp))
    if best is None:
        raise ValueError(f"no GPU tiling of a {K} x {M} weight gradient")
    ta, tb, nx, ny, BK, R, Kp, Mp = best[1]
    P = max(1, min(1024 * waves, waves * GPU_TN_GRID // (nx * ny) // (Kp // BK),
                   waves * GPU_TN_PARTIALS // (Kp * Mp)))
    if P >= GPU_TN_SUM_LANES:  # the chunks' sum splits them over a warp exactly
        P -= P % GPU_TN_SUM_LANES
    return TnTiles(ta, tb, nx, ny, BK, R, P, Kp, Mp)


def _matmul_tn_gpu(K: int, M: int, tiles: TnTiles):
    """Chunk p of the rows is walked ``R`` rows at a time (``t``); the staged copies
    ``xs`` and ``ys`` read zero past the last row and the last column, so the product
    needs no bound check.  The partial sums are laid out [P, Kp, Mp / nx, nx] so that
    the columns one thread owns (``nx`` apart) form an exact box: its register tile is
    written back whole."""
    P, R, nx, Kp, Mp = tiles.P, tiles.R, tiles.nx, tiles.Kp, tiles.Mp
    n = te.var("n", "int64")
    x, y = _input((n, K), "x"), _input((n, M), "y")
    steps = (n + P * R - 1) // (P * R)  # staged tiles per chunk

    def row(p, t, r):
        return (p * steps + t) * R + r

    def staged(src, width, padded, name):
        return te.compute((P, steps, R, padded), lambda p, t, r, a: tirx.if_then_else(
            tirx.all(row(p, t, r) < n, a < width), _load(src, (row(p, t, r), a)), _f32(0)),
            name=name)
    xs, ys = staged(x, K, Kp, "xs"), staged(y, M, Mp, "ys")
    t = te.reduce_axis((0, steps), name="t")
    r = te.reduce_axis((0, R), name="r")
    part = te.compute((P, Kp, Mp // nx, nx), lambda p, a, u, v: te.sum(
        xs[p, t, r, a] * ys[p, t, r, u * nx + v], axis=[t, r]), name="part")
    q = te.reduce_axis((0, P), name="q")
    out = te.compute((K, M), lambda a, b: te.sum(part[q, a, b // nx, b % nx], axis=q),
                     name="sum")
    return te.create_prim_func([x, y, out])


GPU_COLSUM_PARTS = 1 << 17  # chunks x columns of a GPU column sum's partials (512 KiB)


def gpu_colsum_chunks(F: int) -> int:
    """Row chunks of a column sum on the GPU: a power of two from 256 to 4,096, so that
    chunks x F threads stay near ``GPU_COLSUM_PARTS`` (F = 32: 4,096 chunks, 41 rows
    each on an arxiv-size graph, 512 blocks; the 256 chunks before gave 32 blocks of
    threads walking 661 rows each, and one thread per column then added the 256
    partials: 0.08 ms per bias gradient on an H100)."""
    P = 256
    while P < 4096 and 2 * P * F <= GPU_COLSUM_PARTS:
        P *= 2
    return P


@definer("colsum")
def colsum(F: int, chunks: int = CHUNKS, gpu: bool = False, expr: tuple | None = None,
           in_shapes: tuple | None = None, shape: tuple | None = None):
    """out[f] = sum_i x[i, f] over the symbolic rows (bias and attention-vector
    gradients): ``chunks`` parallel partial sums, then their sum; deterministic, no
    atomics.  With ``expr``, x is a fused elementwise expression over ``in_shapes`` of
    shape ``shape`` (flattened to [n, F]), evaluated as it is summed and never stored.
    ``gpu``: ``gpu_colsum_chunks(F)`` chunks, and the final sum a reduction block over
    the chunks, so a GPU schedule spreads it over a block of threads (a fixed tree: still
    deterministic)."""
    P = gpu_colsum_chunks(F) if gpu else chunks
    f32 = "float32"
    with IRBuilder() as ib:
        with IB.prim_func(s_tir=True):
            IB.func_name("colsum")
            IB.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            value, bufs = colsum_rows(F, n, expr, in_shapes, shape)
            out = arg("out", (F,), f32)
            part = IB.sblock_alloc_buffer((P, F), f32)
            IRBuilder.name("part", part)
            with IB.grid(P, F) as (p, f):
                with IB.sblock("part"):
                    vp = IB.axis.spatial(P, p)
                    vf = IB.axis.spatial(F, f)
                    IRBuilder.name_many(["p", "f", "vp", "vf"], [p, f, vp, vf])
                    IB.reads(*([bufs[0][0:n, vf]] if expr is None else
                               [b[tuple(slice(0, d) for d in b.shape)] for b in bufs]))
                    IB.writes(part[vp, vf])
                    IB.buffer_store(part, tirx.const(0.0, f32), [vp, vf])
                    with IB.serial(vp * n // P, (vp + 1) * n // P) as i:
                        IRBuilder.name("i", i)
                        IB.buffer_store(part, part[vp, vf] + value(i, vf), [vp, vf])
            if gpu:
                with IB.grid(F, P) as (f, q):
                    with IB.sblock("sum"):
                        vf = IB.axis.spatial(F, f)
                        vq = IB.axis.reduce(P, q)
                        IRBuilder.name_many(["f", "q", "vf", "vq"], [f, q, vf, vq])
                        IB.reads(part[vq, vf])
                        IB.writes(out[vf])
                        with IB.init():
                            IB.buffer_store(out, tirx.const(0.0, f32), [vf])
                        IB.buffer_store(out, out[vf] + part[vq, vf], [vf])
            else:
                with IB.serial(0, F) as f:
                    with IB.sblock("sum"):
                        vf = IB.axis.spatial(F, f)
                        IRBuilder.name_many(["f", "vf"], [f, vf])
                        IB.buffer_store(out, tirx.const(0.0, f32), [vf])
                        with IB.serial(0, P) as q:
                            IRBuilder.name("q", q)
                            IB.buffer_store(out, out[vf] + part[q, vf], [vf])
    return ib.get()


def colsum_rows(F: int, n, expr: tuple | None, in_shapes: tuple | None,
                shape: tuple | None):
    """Declare a column sum's inputs in the PrimFunc being built: ``x`` [n, F], or the
    leaves of a fused ``expr`` of ``shape`` (flattened to [n, F]).  Returns (value(i, f),
    the buffers)."""
    f32 = "float32"
    if expr is None:
        x = arg("x", (n, F), f32)
        return (lambda i, f: x[i, f]), [x]
    ins = [arg(f"in{k}", _dims(sh, n), f32) for k, sh in enumerate(in_shapes)]
    leaves, dims = list(zip(ins, in_shapes)), [int(d) for d in shape[1:]]
    return (lambda i, f: _tree(expr, leaves, (i,) + _unflatten(f, dims), shape)), ins


def _unflatten(f, dims: list) -> tuple:
    """Row-major indices into ``dims`` of flat index ``f``."""
    if not dims:
        return ()
    idx = []
    for k in range(len(dims) - 1, 0, -1):
        idx.append(tirx.floormod(f, dims[k]))
        f = tirx.floordiv(f, dims[k])
    return (f,) + tuple(reversed(idx))


def _softmax_stats(z, C: int, n):
    """Per-row max, exp(z - max) and the sum of exps (TE; the exps vectorize over classes)."""
    r1 = te.reduce_axis((0, C), name="r1")
    r2 = te.reduce_axis((0, C), name="r2")
    mx = te.compute((n,), lambda i: te.max(z[i, r1], axis=r1), name="rowmax")
    ex = te.compute((n, C), lambda i, c: fast_exp(z[i, c] - mx[i]), name="exp")
    sm = te.compute((n,), lambda i: te.sum(ex[i, r2], axis=r2), name="rowsum")
    return mx, ex, sm


def _valid(m, y, i):
    return tirx.all(m[i] != _f32(0), y[i] >= 0)


GPU_LOSS_CHUNKS = 16384  # interleaved row chunks of a loss's sums on the GPU (64 blocks;
#                          an arxiv-size graph's threads walk 11 rows each)


def _chunk_sums(terms, n, P: int):
    """sum_i terms[j](i) for each j, on the GPU: ``P`` chunk partials (chunk p sums rows
    p, p + P, p + 2P, ..., so neighbouring threads read neighbouring rows), then a
    reduction over the chunks that one block of threads shares.  A fixed order: still
    deterministic.  (With one block of 1,024 threads walking the rows, the arxiv-size loss
    and its gradient took 0.079 and 0.058 ms on an H200; 0.067 and 0.051 with the chunks,
    timed the same way.)"""
    L = (n + P - 1) // P
    k = te.reduce_axis((0, L), name="k")

    def term(p, j):
        i = k * P + p
        v = terms[-1](i)
        for t in range(len(terms) - 2, -1, -1):
            v = tirx.Select(j == t, terms[t](i), v)
        return te.sum(tirx.if_then_else(i < n, v, _f32(0)), axis=k)

    part = te.compute((P, len(terms)), term, name="part")
    q = te.reduce_axis((0, P), name="q")
    return te.compute((len(terms),), lambda j: te.sum(part[q, j], axis=q), name="sums")


@definer("cross_entropy")
def cross_entropy(C: int, gpu: bool = False):
    """loss = sum_i m_i * (lse_i - z_i[y_i]) / sum_i m_i (rows with y < 0 skipped), where
    lse_i = logsumexp(z_i) is also written: the gradient kernel reads it (rows with m != 0
    and y >= 0) instead of computing each row's max and sum again.  ``gpu``: both sums by
    row chunks (``_chunk_sums``)."""
    n = tirx.Var("n", "int64")
    z = te.placeholder((n, C), "float32", name="z")
    y = te.placeholder((n,), "int32", name="y")
    m = te.placeholder((n,), "float32", name="m")
    mx, ex, sm = _softmax_stats(z, C, n)
    lse = te.compute((n,), lambda i: mx[i] + tirx.log(sm[i]), name="lse")

    def term(i):
        return tirx.Select(_valid(m, y, i), m[i] * (lse[i] - z[i, tirx.max(y[i], 0)]),
                           _f32(0))
    if gpu:
        sums = _chunk_sums([term, lambda i: m[i]], n, GPU_LOSS_CHUNKS)
        out = te.compute((), lambda: sums[0] / sums[1], name="loss")
        return te.create_prim_func([z, y, m, lse, out])
    row = te.compute((n,), term, name="row")
    r = te.reduce_axis((0, n), name="r")
    total = te.compute((), lambda: te.sum(row[r], axis=r), name="total")
    q = te.reduce_axis((0, n), name="q")
    count = te.compute((), lambda: te.sum(m[q], axis=q), name="count")
    out = te.compute((), lambda: total[()] / count[()], name="loss")
    return te.create_prim_func([z, y, m, lse, out])


@definer("cross_entropy_grad")
def cross_entropy_grad(C: int, gpu: bool = False):
    """dz = dy * (softmax(z) - onehot(y)) * m / sum(m), softmax(z_i) = exp(z_i - lse_i) with
    the loss kernel's lse.  ``gpu``: sum(m) by row chunks (``_chunk_sums``)."""
    n = tirx.Var("n", "int64")
    dy = te.placeholder((), "float32", name="dy")
    z = te.placeholder((n, C), "float32", name="z")
    y = te.placeholder((n,), "int32", name="y")
    m = te.placeholder((n,), "float32", name="m")
    lse = te.placeholder((n,), "float32", name="lse")
    if gpu:
        count = _chunk_sums([lambda i: m[i]], n, GPU_LOSS_CHUNKS)[0]
    else:
        q = te.reduce_axis((0, n), name="q")
        count = te.compute((), lambda: te.sum(m[q], axis=q), name="count")[()]
    out = te.compute((n, C), lambda i, c: tirx.Select(
        _valid(m, y, i),
        (fast_exp(z[i, c] - lse[i]) - tirx.Select(y[i] == c, _f32(1), _f32(0))) * m[i] * dy[()]
        / count, _f32(0)), name="row")
    return te.create_prim_func([dy, z, y, m, lse, out])


def _adam_moment(g, p, m, beta, wd, square: bool):
    """beta * m + (1 - beta) * g' (or g'^2), g' = g + wd * p (L2 decay, as torch's Adam).

    Built as one expression in Python: a named intermediate in TVMScript becomes a local
    scalar, which the vectorizer would share across lanes.
    """
    gi = g + wd * p
    return beta * m + (T.float32(1) - beta) * (gi * gi if square else gi)


def _adam_updates(p, g, m, v, hp, t, i):
    """Adam's in-place stores into element ``i``, as (buffer, value) in order (p's update
    loads the moments just stored)."""
    tf = T.Cast("float32", t[()])
    return [(m, _adam_moment(g[i], p[i], m[i], hp[1], hp[4], False)),
            (v, _adam_moment(g[i], p[i], v[i], hp[2], hp[4], True)),
            (p, p[i] - hp[0] / (T.float32(1) - T.pow(hp[1], tf)) * m[i]
             / (T.sqrt(v[i]) / T.sqrt(T.float32(1) - T.pow(hp[2], tf)) + hp[3]))]


def _sgd_updates(p, g, b, hp, t, i):
    """SGD's in-place stores into element ``i``; torch's first step's buffer is the
    gradient itself (no dampening)."""
    return [(b, T.Select(t[()] <= 1, g[i] + hp[3] * p[i],
                         hp[1] * b[i] + (T.float32(1) - hp[2]) * (g[i] + hp[3] * p[i]))),
            (p, p[i] - hp[0] * T.Select(hp[4] != T.float32(0),
                                        g[i] + hp[3] * p[i] + hp[1] * b[i], b[i]))]


def _update_all(kind: str, sizes: tuple, moments: tuple, updates):
    """One kernel updating every parameter in place: a loop over all their values one
    after another, each value's parameter found by comparing its index with the
    parameters' offsets.  Arguments: each parameter's value, gradient and ``moments``
    (flat), then hp and t.  The GPU plan's choice (``codegen/optimizer.py``): one launch
    instead of one a parameter."""
    f32 = "float32"
    total = sum(sizes)
    with IRBuilder() as ib:
        with IB.prim_func(s_tir=True):
            IB.func_name(f"{kind}_all")
            IB.func_attr({"tirx.noalias": True})
            groups = [[arg(f"{name}{j}", (S,), f32) for name in ("p", "g", *moments)]
                      for j, S in enumerate(sizes)]
            hp = arg("hp", (5,), f32)
            t = arg("t", (), "int32")
            with IB.grid(total) as i:
                with IB.sblock(kind):
                    vi = IB.axis.spatial(total, i)
                    # in place: every gradient read, every value and moment written
                    IB.reads(*[bufs[1][0:S] for bufs, S in zip(groups, sizes)], hp[0:5], t[()])
                    IB.writes(*[b[0:S] for bufs, S in zip(groups, sizes)
                                for k, b in enumerate(bufs) if k != 1])
                    start = 0
                    for bufs, S in zip(groups, sizes):
                        with IB.If(tirx.all(start <= vi, vi < start + S)):
                            with IB.Then():
                                for buf, value in updates(*bufs, hp, t, vi - start):
                                    IB.buffer_store(buf, value, [vi - start])
                        start += S
    return ib.get()


def _update_one(kind: str, S: int, moments: tuple, updates):
    """In-place update of one flattened parameter of S values: its value ``p``, gradient
    ``g`` and ``moments``, then hp and t.  The block reads and writes element by element:
    declaring only those (not whole buffers) keeps it "complete", so the CPU schedule may
    vectorize and parallelize it (``schedules/cpu.py``)."""
    f32 = "float32"
    with IRBuilder() as ib:
        with IB.prim_func(s_tir=True):
            IB.func_name(kind)
            IB.func_attr({"tirx.noalias": True})
            bufs = [arg(name, (S,), f32) for name in ("p", "g", *moments)]
            hp = arg("hp", (5,), f32)
            t = arg("t", (), "int32")
            with IB.grid(S) as i:
                with IB.sblock(kind):
                    vi = IB.axis.spatial(S, i)
                    IB.reads(bufs[1][vi], hp[0:5], t[()])
                    IB.writes(*[b[vi] for k, b in enumerate(bufs) if k != 1])
                    for buf, value in updates(*bufs, hp, t, vi):
                        IB.buffer_store(buf, value, [vi])
    return ib.get()


@definer("adam")
def adam(S: int):
    """In-place torch.optim.Adam step on a flattened parameter of S values.

    hp = [lr, beta1, beta2, eps, weight_decay]; t = the step (1-based).  Weight decay is
    L2 added to the gradient, as torch's Adam (not AdamW).
    """
    return _update_one("adam", S, ("m", "v"), _adam_updates)


@definer("sgd")
def sgd(S: int):
    """In-place torch.optim.SGD step; hp = [lr, momentum, dampening, weight_decay, nesterov]."""
    return _update_one("sgd", S, ("b",), _sgd_updates)


@definer("adam_all")
def adam_all(sizes: tuple):
    """``adam`` on every parameter (of ``sizes`` values each) in one kernel."""
    return _update_all("adam", sizes, ("m", "v"), _adam_updates)


@definer("sgd_all")
def sgd_all(sizes: tuple):
    """``sgd`` on every parameter in one kernel."""
    return _update_all("sgd", sizes, ("b",), _sgd_updates)


def _lanes(C: int) -> int:
    return next((v for v in (8, 4, 2) if C % v == 0), 1)


@definer("edge_dot")
def edge_dot(H: int, C: int):
    """out[j, h] = sum_c x[indices[j], h, c] * y[rows[j], h, c]: per-edge dot products
    (the gradient of aggregation weights).  Written as V vector lanes of partial sums
    (``part``) added at the end, so the products vectorize.  Edge-parallel: ``indptr``
    is an argument only for the row-walking CPU definition (``cpu_kernels.py``)."""
    n, m, nnz = (tirx.Var(v, "int64") for v in ("n", "m", "nnz"))
    V = _lanes(C)
    indptr = te.placeholder((n + 1,), "int64", name="indptr")
    idx = te.placeholder((nnz,), "int32", name="indices")
    rows = te.placeholder((nnz,), "int32", name="rows")
    x = te.placeholder((m, H * C), "float32", name="x")
    y = te.placeholder((n, H * C), "float32", name="y")
    co = te.reduce_axis((0, C // V), name="co")
    part = te.compute((nnz, H, V), lambda j, h, ci: te.sum(
        x[idx[j], h * C + co * V + ci] * y[rows[j], h * C + co * V + ci], axis=co), name="part")
    ci = te.reduce_axis((0, V), name="ci")
    out = te.compute((nnz, H), lambda j, h: te.sum(part[j, h, ci], axis=ci), name="edge_dot")
    return te.create_prim_func([indptr, idx, rows, x, y, out])
