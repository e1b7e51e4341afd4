"""The aggregation kernels, built with TVM's IR builder: every variant, one definition
(and GAT's fused attention, ``attention_agg``, its sibling).

    out[i, h, c] = epilogue(finish(reduce_{j in segment i} w[j, h] * x[indices[j], h, c]))

Variants, all static: the reduction (sum / mean / max), per-edge or per-head
weights or none, ``indirect`` (segments are CSC slots of the transposed graph and
edge values stay in CSR order, read through ``eid``: aggregation over out-edges,
the backward of aggregation), and an epilogue (``gcomp/codegen/epilogue.py``:
bias, activation, ... folded in by the ``fuse_epilogues`` pass).  The IR builder
(unlike TVMScript templates) lets the parameter list follow the variant.

The block is spatial over (row, head, channel) and the edge loop accumulates
straight into the output element, so vectorizing the channel axis keeps a row of
accumulators in vector registers (a separate local accumulator would be shared
across lanes by TVM's vectorizer).

Arguments: indptr (int64, n+1), indices (int32, nnz), [eid (int64, nnz)],
[w (float32, nnz x WH)], x (float32, m x H*C), extras..., out (float32, n x H*C).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.fastmath import fast_exp
from gcomp.codegen.kernels import definer

NEG_INF = -3.4028234663852886e38


def _finish(reduce: str, acc, deg):
    """Applied to an accumulated row: mean scaling, and 0 (not -inf) for an empty max."""
    if reduce == "mean":
        return acc / tirx.Cast("float32", tirx.max(deg, tirx.const(1, "int64")))
    if reduce == "max":
        return tirx.Select(deg > tirx.const(0, "int64"), acc, tirx.const(0.0, "float32"))
    return acc


def arg(name: str, shape, dtype: str):
    """A buffer argument of the PrimFunc being built, named ``name``."""
    buf = T.match_buffer(T.arg(name, T.handle()), shape, dtype, align=4)
    IRBuilder.name(name, buf)
    return buf


@definer("csr_agg")
def csr_agg(reduce: str, H: int, C: int, weight: str, indirect: bool = False,
            epilogue: tuple = (), extras: tuple = ()):
    F = H * C
    WH = H if weight == "head" else 1
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("csr_agg")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = (tirx.Var(name, "int64") for name in ("n", "m", "nnz"))

            indptr = arg("indptr", (n + 1,), "int64")
            indices = arg("indices", (nnz,), "int32")
            eid = arg("eid", (nnz,), "int64") if indirect and weight != "none" else None
            w = arg("w", (nnz, WH), f32) if weight != "none" else None
            x = arg("x", (m, F), f32)
            extra = [arg(f"e{k}", epi.shape(kind, n, F), f32)
                     for k, kind in enumerate(extras)]
            out = arg("out", (n, F), f32)
            with T.grid(n, H, C) as (i, h, c):
                IRBuilder.name_many(["i", "h", "c"], [i, h, c])
                with T.sblock("row"):
                    vi = T.axis.spatial(n, i)
                    vh = T.axis.spatial(H, h)
                    vc = T.axis.spatial(C, c)
                    IRBuilder.name_many(["vi", "vh", "vc"], [vi, vh, vc])
                    f = vh * C + vc
                    reads = [indptr[vi:vi + 2], indices[0:nnz], x[0:m, f]]
                    if w is not None:
                        reads.append(w[0:nnz, 0:WH])
                    if eid is not None:
                        reads.append(eid[0:nnz])
                    T.reads(*reads)
                    T.writes(out[vi, f])
                    init = NEG_INF if reduce == "max" else 0.0
                    T.buffer_store(out, tirx.const(init, f32), [vi, f])
                    with T.serial(indptr[vi], indptr[vi + 1]) as j:
                        IRBuilder.name("j", j)
                        val = x[indices[j], f]
                        if w is not None:
                            e = eid[j] if eid is not None else j
                            val = w[e, vh if weight == "head" else 0] * val
                        acc = out[vi, f]
                        new = tirx.max(acc, val) if reduce == "max" else acc + val
                        T.buffer_store(out, new, [vi, f])
                    res = _finish(reduce, out[vi, f], indptr[vi + 1] - indptr[vi])
                    res = epi.apply(epilogue, res, lambda k: extra[k][epi.index(extras[k], vi, f)])
                    T.buffer_store(out, res, [vi, f])
    return ib.get()


def leaky(v, slope: float):
    """leaky_relu(v); slope 1 is the identity."""
    if slope == 1.0:
        return v
    return tirx.Select(v > tirx.const(0.0, "float32"), v, v * tirx.const(slope, "float32"))


@definer("attention_agg")
def attention_agg(H: int, C: int, slope: float, epilogue: tuple = (), extras: tuple = ()):
    """GAT attention in one kernel (the ``attention_aggregate`` op):

        e_j = leaky_relu(s_src[indices[j], h] + s_dst[i, h])   for in-edges j of row i
        out[i, h, c] = epilogue(sum_j exp(e_j - max e) * x[indices[j], h, c] / sum_j exp(...))

    Two sweeps over the row's in-edges: the maximum score, then the exponentials, their
    sum and the weighted sum of source rows; no per-edge buffer.  The block is spatial
    over (row, head, channel) like ``csr_agg`` (GPU lanes share a row); the row's
    statistics live in ``stat``, which a schedule puts in registers.

    Arguments: indptr, indices, s_src (m x H), s_dst (n x H), x (m x H*C), extras...,
    out (n x H*C).
    """
    F = H * C
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_agg")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = (tirx.Var(name, "int64") for name in ("n", "m", "nnz"))

            indptr = arg("indptr", (n + 1,), "int64")
            indices = arg("indices", (nnz,), "int32")
            s_src = arg("s_src", (m, H), f32)
            s_dst = arg("s_dst", (n, H), f32)
            x = arg("x", (m, F), f32)
            extra = [arg(f"e{k}", epi.shape(kind, n, F), f32)
                     for k, kind in enumerate(extras)]
            out = arg("out", (n, F), f32)
            stat = T.sblock_alloc_buffer((n, H, C, 2), f32)
            IRBuilder.name("stat", stat)
            with T.grid(n, H, C) as (i, h, c):
                with T.sblock("row"):
                    vi = T.axis.spatial(n, i)
                    vh = T.axis.spatial(H, h)
                    vc = T.axis.spatial(C, c)
                    f = vh * C + vc
                    T.reads(indptr[vi:vi + 2], indices[0:nnz], s_src[0:m, vh], s_dst[vi, vh],
                            x[0:m, f])
                    T.writes(out[vi, f], stat[vi, vh, vc, 0:2])

                    def score(j):
                        return leaky(s_src[indices[j], vh] + s_dst[vi, vh], slope)
                    T.buffer_store(stat, tirx.const(NEG_INF, f32), [vi, vh, vc, 0])
                    with T.serial(indptr[vi], indptr[vi + 1]) as j:
                        T.buffer_store(stat, tirx.max(stat[vi, vh, vc, 0], score(j)),
                                       [vi, vh, vc, 0])
                    T.buffer_store(stat, tirx.const(0.0, f32), [vi, vh, vc, 1])
                    T.buffer_store(out, tirx.const(0.0, f32), [vi, f])
                    with T.serial(indptr[vi], indptr[vi + 1]) as j:
                        p = fast_exp(score(j) - stat[vi, vh, vc, 0])
                        T.buffer_store(stat, stat[vi, vh, vc, 1] + p, [vi, vh, vc, 1])
                        T.buffer_store(out, out[vi, f] + p * x[indices[j], f], [vi, f])
                    total = stat[vi, vh, vc, 1]
                    res = tirx.Select(total > tirx.const(0.0, f32), out[vi, f] / total,
                                      tirx.const(0.0, f32))
                    res = epi.apply(epilogue, res, lambda k: extra[k][epi.index(extras[k], vi, f)])
                    T.buffer_store(out, res, [vi, f])
    return ib.get()
