"""Sparse (graph) kernels in TVMScript: aggregation, segment reduction, gather,
edge softmax, degrees, normalization, edge remapping.

Python values captured by a TVMScript function are compile-time constants, and
``if`` on them is resolved while parsing: that is how one template covers the
sum / mean / max and weighted variants.  Feature axes are written (head, channel)
so that per-head edge weights (GAT) index ``w[j, h]`` without a division.
"""

from __future__ import annotations

from tvm.script import tirx as T

from gcomp.codegen.kernels import definer

NEG_INF = -3.4028234663852886e38


def _finish(reduce: str, acc, vi, indptr):
    """Expression applied to an accumulated row (mean scaling, empty-row zero for max)."""
    deg = indptr[vi + 1] - indptr[vi]
    if reduce == "mean":
        return acc / T.Cast("float32", T.max(deg, T.int64(1)))
    if reduce == "max":
        return T.Select(deg > T.int64(0), acc, T.float32(0))
    return acc


@definer("csr_agg")
def csr_agg(reduce: str, H: int, C: int, weight: str):
    """out[i, h, c] = reduce_{j in row i} w[j, h] * x[indices[j], h, c] (x, out viewed [., H*C]).

    ``weight``: "none", "edge" (w: [nnz, 1]) or "head" (w: [nnz, H]).
    """
    init = T.float32(NEG_INF) if reduce == "max" else T.float32(0)
    is_max = reduce == "max"
    WH = H if weight == "head" else 1
    PH = 1 if weight == "head" else 0
    F = H * C

    if weight == "none":
        @T.prim_func(s_tir=True)
        def k(indptr_h: T.handle, indices_h: T.handle, x_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = T.int64(), T.int64(), T.int64()
            indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
            indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
            x = T.match_buffer(x_h, (m, F), "float32", align=4)
            out = T.match_buffer(out_h, (n, F), "float32", align=4)
            for i, h, c in T.grid(n, H, C):
                with T.sblock("row"):
                    vi, vh, vc = T.axis.remap("SSS", [i, h, c])
                    T.reads(indptr[vi:vi + 2], indices[0:nnz], x[0:m, vh * C + vc])
                    T.writes(out[vi, vh * C + vc])
                    out[vi, vh * C + vc] = init
                    for j in range(indptr[vi], indptr[vi + 1]):
                        if is_max:
                            out[vi, vh * C + vc] = T.max(out[vi, vh * C + vc],
                                                         x[indices[j], vh * C + vc])
                        else:
                            out[vi, vh * C + vc] = out[vi, vh * C + vc] + x[indices[j], vh * C + vc]
                    out[vi, vh * C + vc] = _finish(reduce, out[vi, vh * C + vc], vi, indptr)
        return k

    @T.prim_func(s_tir=True)
    def kw(indptr_h: T.handle, indices_h: T.handle, w_h: T.handle, x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, m, nnz = T.int64(), T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
        w = T.match_buffer(w_h, (nnz, WH), "float32", align=4)
        x = T.match_buffer(x_h, (m, F), "float32", align=4)
        out = T.match_buffer(out_h, (n, F), "float32", align=4)
        for i, h, c in T.grid(n, H, C):
            with T.sblock("row"):
                vi, vh, vc = T.axis.remap("SSS", [i, h, c])
                T.reads(indptr[vi:vi + 2], indices[0:nnz], w[0:nnz, 0:WH], x[0:m, vh * C + vc])
                T.writes(out[vi, vh * C + vc])
                out[vi, vh * C + vc] = init
                for j in range(indptr[vi], indptr[vi + 1]):
                    if is_max:
                        out[vi, vh * C + vc] = T.max(out[vi, vh * C + vc],
                                                     w[j, vh * PH] * x[indices[j], vh * C + vc])
                    else:
                        out[vi, vh * C + vc] = (out[vi, vh * C + vc]
                                                + w[j, vh * PH] * x[indices[j], vh * C + vc])
                out[vi, vh * C + vc] = _finish(reduce, out[vi, vh * C + vc], vi, indptr)
    return kw


@definer("csr_segment")
def csr_segment(reduce: str, F: int):
    """out[i, f] = reduce_{j in row i} e[j, f]: scatter of edge values (in CSR order) to nodes."""
    init = T.float32(NEG_INF) if reduce == "max" else T.float32(0)
    is_max = reduce == "max"

    @T.prim_func(s_tir=True)
    def k(indptr_h: T.handle, e_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        e = T.match_buffer(e_h, (nnz, F), "float32", align=4)
        out = T.match_buffer(out_h, (n, F), "float32", align=4)
        for i, f in T.grid(n, F):
            with T.sblock("row"):
                vi, vf = T.axis.remap("SS", [i, f])
                T.reads(indptr[vi:vi + 2], e[0:nnz, vf])
                T.writes(out[vi, vf])
                out[vi, vf] = init
                for j in range(indptr[vi], indptr[vi + 1]):
                    if is_max:
                        out[vi, vf] = T.max(out[vi, vf], e[j, vf])
                    else:
                        out[vi, vf] = out[vi, vf] + e[j, vf]
                out[vi, vf] = _finish(reduce, out[vi, vf], vi, indptr)
    return k


@definer("take_rows")
def take_rows(F: int):
    """out[j, f] = x[idx[j], f]: lift node values onto edges (idx = indices or rows)."""

    @T.prim_func(s_tir=True)
    def k(idx_h: T.handle, x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        m, nnz = T.int64(), T.int64()
        idx = T.match_buffer(idx_h, (nnz,), "int32", align=4)
        x = T.match_buffer(x_h, (m, F), "float32", align=4)
        out = T.match_buffer(out_h, (nnz, F), "float32", align=4)
        for j, f in T.grid(nnz, F):
            with T.sblock("take"):
                vj, vf = T.axis.remap("SS", [j, f])
                out[vj, vf] = x[idx[vj], vf]
    return k


@definer("edge_softmax")
def edge_softmax(H: int):
    """Softmax of e[:, h] over each destination's in-edges (max-subtracted)."""

    @T.prim_func(s_tir=True)
    def k(indptr_h: T.handle, e_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        # n is only known as indptr's length minus one (no buffer has n rows)
        n1, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n1,), "int64", align=4)
        e = T.match_buffer(e_h, (nnz, H), "float32", align=4)
        out = T.match_buffer(out_h, (nnz, H), "float32", align=4)
        for i, h in T.grid(n1 - 1, H):
            with T.sblock("row"):
                vi, vh = T.axis.remap("SS", [i, h])
                T.reads(indptr[vi:vi + 2], e[0:nnz, vh])
                T.writes(out[0:nnz, vh])
                mx = T.alloc_buffer((1,), "float32", scope="local")
                sm = T.alloc_buffer((1,), "float32", scope="local")
                mx[0] = T.float32(NEG_INF)
                for j in range(indptr[vi], indptr[vi + 1]):
                    mx[0] = T.max(mx[0], e[j, vh])
                sm[0] = T.float32(0)
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[j, vh] = T.exp(e[j, vh] - mx[0])
                    sm[0] = sm[0] + out[j, vh]
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[j, vh] = out[j, vh] / sm[0]
    return k


@definer("degree")
def degree(weighted: bool, indirect: bool):
    """deg[i] = number (or weight sum) of the edges in segment i of ``indptr``.

    ``indirect``: the segments are CSC slots and ``eid`` maps a slot to the
    CSR position of its edge (out-degrees of edge-weighted graphs).
    """
    if not weighted:
        @T.prim_func(s_tir=True)
        def k(indptr_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
            out = T.match_buffer(out_h, (n,), "float32", align=4)
            for i in range(n):
                with T.sblock("deg"):
                    vi = T.axis.remap("S", [i])
                    out[vi] = T.Cast("float32", indptr[vi + 1] - indptr[vi])
        return k

    if not indirect:
        @T.prim_func(s_tir=True)
        def kw(indptr_h: T.handle, w_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, nnz = T.int64(), T.int64()
            indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
            w = T.match_buffer(w_h, (nnz,), "float32", align=4)
            out = T.match_buffer(out_h, (n,), "float32", align=4)
            for i in range(n):
                with T.sblock("deg"):
                    vi = T.axis.remap("S", [i])
                    T.reads(indptr[vi:vi + 2], w[0:nnz])
                    T.writes(out[vi])
                    out[vi] = T.float32(0)
                    for j in range(indptr[vi], indptr[vi + 1]):
                        out[vi] = out[vi] + w[j]
        return kw

    @T.prim_func(s_tir=True)
    def ki(indptr_h: T.handle, eid_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        eid = T.match_buffer(eid_h, (nnz,), "int64", align=4)
        w = T.match_buffer(w_h, (nnz,), "float32", align=4)
        out = T.match_buffer(out_h, (n,), "float32", align=4)
        for i in range(n):
            with T.sblock("deg"):
                vi = T.axis.remap("S", [i])
                T.reads(indptr[vi:vi + 2], eid[0:nnz], w[0:nnz])
                T.writes(out[vi])
                out[vi] = T.float32(0)
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[vi] = out[vi] + w[eid[j]]
    return ki


def _inv_sqrt(d):
    # PyG's gcn_norm: deg ** -0.5 with inf (deg == 0) replaced by 0
    return T.Select(d == T.float32(0), T.float32(0), T.float32(1) / T.sqrt(d))


@definer("sym_norm")
def sym_norm(weighted: bool):
    """norm[j] = w[j] * deg[rows[j]]^-1/2 * deg[indices[j]]^-1/2 (0 where a degree is 0)."""
    if not weighted:
        @T.prim_func(s_tir=True)
        def k(rows_h: T.handle, indices_h: T.handle, deg_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, nnz = T.int64(), T.int64()
            rows = T.match_buffer(rows_h, (nnz,), "int32", align=4)
            indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
            deg = T.match_buffer(deg_h, (n,), "float32", align=4)
            out = T.match_buffer(out_h, (nnz,), "float32", align=4)
            for j in range(nnz):
                with T.sblock("norm"):
                    vj = T.axis.remap("S", [j])
                    out[vj] = _inv_sqrt(deg[rows[vj]]) * _inv_sqrt(deg[indices[vj]])
        return k

    @T.prim_func(s_tir=True)
    def kw(rows_h: T.handle, indices_h: T.handle, deg_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        rows = T.match_buffer(rows_h, (nnz,), "int32", align=4)
        indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
        deg = T.match_buffer(deg_h, (n,), "float32", align=4)
        w = T.match_buffer(w_h, (nnz,), "float32", align=4)
        out = T.match_buffer(out_h, (nnz,), "float32", align=4)
        for j in range(nnz):
            with T.sblock("norm"):
                vj = T.axis.remap("S", [j])
                out[vj] = _inv_sqrt(deg[rows[vj]]) * w[vj] * _inv_sqrt(deg[indices[vj]])
    return kw


@definer("edge_remap")
def edge_remap(F: int, fill: float):
    """out[j, f] = w[origin[j], f], or ``fill`` where origin[j] < 0 (a new self loop)."""

    @T.prim_func(s_tir=True)
    def k(origin_h: T.handle, w_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        nnz, nnz_in = T.int64(), T.int64()
        origin = T.match_buffer(origin_h, (nnz,), "int64", align=4)
        w = T.match_buffer(w_h, (nnz_in, F), "float32", align=4)
        out = T.match_buffer(out_h, (nnz, F), "float32", align=4)
        for j, f in T.grid(nnz, F):
            with T.sblock("remap"):
                vj, vf = T.axis.remap("SS", [j, f])
                out[vj, vf] = T.Select(origin[vj] >= T.int64(0),
                                       w[T.max(origin[vj], T.int64(0)), vf], T.float32(fill))
    return k
