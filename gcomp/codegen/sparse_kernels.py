"""Sparse (graph) kernels in TVMScript: segment reduction, gather, edge softmax,
degrees, normalization, edge remapping, argmax routing, dropout.  (Aggregation,
with its many variants, is built in ``aggregate_kernel.py``.)

Python values captured by a TVMScript function are compile-time constants, and
``if`` on them is resolved while parsing: that is how one template covers the
sum / mean / max and weighted variants.  Feature axes are written (head, channel)
so that per-head edge weights (GAT) index ``w[j, h]`` without a division.
"""

from __future__ import annotations

from tvm.script import tirx as T

from gcomp.codegen.aggregate_kernel import _finish
from gcomp.codegen.fastmath import fast_exp
from gcomp.codegen.kernels import definer
from gcomp.codegen.rng_expr import keep

NEG_INF = -3.4028234663852886e38


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
                out[vi, vf] = _finish(reduce, out[vi, vf], indptr[vi + 1] - indptr[vi])
    return k


@definer("take_rows")
def take_rows(F: int, index: str = "int32"):
    """out[j, f] = x[idx[j], f]: lift node values onto edges (idx = indices or rows), or
    put edge values in CSC order (idx = csc_eid, int64)."""

    @T.prim_func(s_tir=True)
    def k(idx_h: T.handle, x_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        m, nnz = T.int64(), T.int64()
        idx = T.match_buffer(idx_h, (nnz,), index, align=4)
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
        # per-row max and sum: function-level scratch (a local buffer in the parallel row
        # loop would be allocated per row)
        stat = T.sblock_alloc_buffer((n1, H, 2), "float32")
        for i, h in T.grid(n1 - 1, H):
            with T.sblock("row"):
                vi, vh = T.axis.remap("SS", [i, h])
                T.reads(indptr[vi:vi + 2], e[0:nnz, vh])
                T.writes(out[0:nnz, vh], stat[vi, vh, 0:2])
                stat[vi, vh, 0] = T.float32(NEG_INF)
                for j in range(indptr[vi], indptr[vi + 1]):
                    stat[vi, vh, 0] = T.max(stat[vi, vh, 0], e[j, vh])
                stat[vi, vh, 1] = T.float32(0)
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[j, vh] = fast_exp(e[j, vh] - stat[vi, vh, 0])
                    stat[vi, vh, 1] = stat[vi, vh, 1] + out[j, vh]
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[j, vh] = out[j, vh] / stat[vi, vh, 1]
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
def sym_norm(weighted: bool, lanes: int = 1):
    """norm[j] = w[j] * deg[i]^-1/2 * deg[indices[j]]^-1/2 for each in-edge j of row i (0
    where a degree is 0).  Rows are walked through ``indptr``, so the per-edge row ids
    (``rows``, 4 bytes an edge: 438 MiB at Reddit size) are never needed.  ``lanes``
    threads share a row, lane l taking edges l, l + lanes, ... (the GPU's 32: a hub row
    of 2M edges is not one thread's walk)."""
    L = lanes
    if weighted:
        @T.prim_func(s_tir=True)
        def k(indptr_h: T.handle, indices_h: T.handle, deg_h: T.handle, w_h: T.handle,
              out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, nnz = T.int64(), T.int64()
            indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
            indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
            deg = T.match_buffer(deg_h, (n,), "float32", align=4)
            w = T.match_buffer(w_h, (nnz,), "float32", align=4)
            out = T.match_buffer(out_h, (nnz,), "float32", align=4)
            for i, lane in T.grid(n, L):
                with T.sblock("norm"):
                    vi, vl = T.axis.remap("SS", [i, lane])
                    T.reads(indptr[vi:vi + 2], indices[0:nnz], deg[0:n], w[0:nnz])
                    T.writes(out[0:nnz])
                    for t in range((indptr[vi + 1] - indptr[vi] - vl + (L - 1)) // L):
                        out[indptr[vi] + vl + t * L] = (
                            _inv_sqrt(deg[vi]) * w[indptr[vi] + vl + t * L]
                            * _inv_sqrt(deg[indices[indptr[vi] + vl + t * L]]))
        return k

    # the same walk without the weight argument
    @T.prim_func(s_tir=True)
    def k(indptr_h: T.handle, indices_h: T.handle, deg_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
        deg = T.match_buffer(deg_h, (n,), "float32", align=4)
        out = T.match_buffer(out_h, (nnz,), "float32", align=4)
        for i, lane in T.grid(n, L):
            with T.sblock("norm"):
                vi, vl = T.axis.remap("SS", [i, lane])
                T.reads(indptr[vi:vi + 2], indices[0:nnz], deg[0:n])
                T.writes(out[0:nnz])
                for t in range((indptr[vi + 1] - indptr[vi] - vl + (L - 1)) // L):
                    out[indptr[vi] + vl + t * L] = (
                        _inv_sqrt(deg[vi]) * _inv_sqrt(deg[indices[indptr[vi] + vl + t * L]]))
    return k


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


@definer("csr_segment_indirect")
def csr_segment_indirect(F: int):
    """out[i, f] = sum_{j in CSC segment i} e[eid[j], f]: edge values summed onto sources."""

    @T.prim_func(s_tir=True)
    def k(indptr_h: T.handle, eid_h: T.handle, e_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        eid = T.match_buffer(eid_h, (nnz,), "int64", align=4)
        e = T.match_buffer(e_h, (nnz, F), "float32", align=4)
        out = T.match_buffer(out_h, (n, F), "float32", align=4)
        for i, f in T.grid(n, F):
            with T.sblock("row"):
                vi, vf = T.axis.remap("SS", [i, f])
                T.reads(indptr[vi:vi + 2], eid[0:nnz], e[0:nnz, vf])
                T.writes(out[vi, vf])
                out[vi, vf] = T.float32(0)
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[vi, vf] = out[vi, vf] + e[eid[j], vf]
    return k


@definer("argmax_rows")
def argmax_rows(F: int, gathered: bool):
    """out[i, f] = the first edge position j of row i maximizing v_j[f], or -1 for an empty row.

    ``gathered``: v_j = x[indices[j]] (aggregate); else v_j = e[j] (scatter of edge values).
    """
    if gathered:
        @T.prim_func(s_tir=True)
        def kg(indptr_h: T.handle, indices_h: T.handle, x_h: T.handle, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = T.int64(), T.int64(), T.int64()
            indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
            indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
            x = T.match_buffer(x_h, (m, F), "float32", align=4)
            out = T.match_buffer(out_h, (n, F), "int32", align=4)
            best = T.sblock_alloc_buffer((n, F), "float32")  # scratch (see edge_softmax)
            for i, f in T.grid(n, F):
                with T.sblock("row"):
                    vi, vf = T.axis.remap("SS", [i, f])
                    T.reads(indptr[vi:vi + 2], indices[0:nnz], x[0:m, vf])
                    T.writes(out[vi, vf], best[vi, vf])
                    best[vi, vf] = T.float32(NEG_INF)
                    out[vi, vf] = -1
                    for j in range(indptr[vi], indptr[vi + 1]):
                        if x[indices[j], vf] > best[vi, vf]:
                            best[vi, vf] = x[indices[j], vf]
                            out[vi, vf] = T.Cast("int32", j)
        return kg

    @T.prim_func(s_tir=True)
    def ke(indptr_h: T.handle, e_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        e = T.match_buffer(e_h, (nnz, F), "float32", align=4)
        out = T.match_buffer(out_h, (n, F), "int32", align=4)
        best = T.sblock_alloc_buffer((n, F), "float32")  # scratch (see edge_softmax)
        for i, f in T.grid(n, F):
            with T.sblock("row"):
                vi, vf = T.axis.remap("SS", [i, f])
                T.reads(indptr[vi:vi + 2], e[0:nnz, vf])
                T.writes(out[vi, vf], best[vi, vf])
                best[vi, vf] = T.float32(NEG_INF)
                out[vi, vf] = -1
                for j in range(indptr[vi], indptr[vi + 1]):
                    if e[j, vf] > best[vi, vf]:
                        best[vi, vf] = e[j, vf]
                        out[vi, vf] = T.Cast("int32", j)
    return ke


@definer("scatter_max_grad")
def scatter_max_grad(F: int):
    """de[j, f] = dy[rows[j], f] if j is its destination's argmax for f, else 0."""

    @T.prim_func(s_tir=True)
    def k(rows_h: T.handle, am_h: T.handle, dy_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        rows = T.match_buffer(rows_h, (nnz,), "int32", align=4)
        am = T.match_buffer(am_h, (n, F), "int32", align=4)
        dy = T.match_buffer(dy_h, (n, F), "float32", align=4)
        out = T.match_buffer(out_h, (nnz, F), "float32", align=4)
        for j, f in T.grid(nnz, F):
            with T.sblock("edge"):
                vj, vf = T.axis.remap("SS", [j, f])
                out[vj, vf] = T.Select(T.Cast("int64", am[rows[vj], vf]) == vj, dy[rows[vj], vf],
                                       T.float32(0))
    return k


@definer("aggregate_max_grad")
def aggregate_max_grad(F: int):
    """dx[s, f] = sum over out-edges (CSC slot k, edge eid[k], destination d) of dy[d, f]
    where the edge is d's argmax for f."""

    @T.prim_func(s_tir=True)
    def k(indptr_h: T.handle, indices_h: T.handle, eid_h: T.handle, am_h: T.handle, dy_h: T.handle,
          out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, m, nnz = T.int64(), T.int64(), T.int64()
        indptr = T.match_buffer(indptr_h, (n + 1,), "int64", align=4)
        indices = T.match_buffer(indices_h, (nnz,), "int32", align=4)
        eid = T.match_buffer(eid_h, (nnz,), "int64", align=4)
        am = T.match_buffer(am_h, (m, F), "int32", align=4)
        dy = T.match_buffer(dy_h, (m, F), "float32", align=4)
        out = T.match_buffer(out_h, (n, F), "float32", align=4)
        for i, f in T.grid(n, F):
            with T.sblock("row"):
                vi, vf = T.axis.remap("SS", [i, f])
                T.reads(indptr[vi:vi + 2], indices[0:nnz], eid[0:nnz], am[0:m, vf], dy[0:m, vf])
                T.writes(out[vi, vf])
                out[vi, vf] = T.float32(0)
                for j in range(indptr[vi], indptr[vi + 1]):
                    out[vi, vf] = out[vi, vf] + T.Select(
                        T.Cast("int64", am[indices[j], vf]) == eid[j], dy[indices[j], vf],
                        T.float32(0))
    return k


@definer("dropout")
def dropout(F: int, p: float, seed: int):
    """out = x * keep / (1 - p); keep from the counter hash of gcomp/ir/rng.py.

    The hash counts elements in the op's canonical order, which ``ids`` gives per row:
    row i of a node tensor is node ids[i] of the user's graph (the runtime may reorder or
    shard nodes); row j of an edge tensor (stored in CSR order) is edge ids[j] of the
    user's edge order (the graph's ``perm``).
    """
    scale = 1.0 / (1.0 - p)

    @T.prim_func(s_tir=True)
    def k(ids_h: T.handle, x_h: T.handle, step_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        ids = T.match_buffer(ids_h, (n,), "int64", align=4)
        x = T.match_buffer(x_h, (n, F), "float32", align=4)
        step = T.match_buffer(step_h, (), "int32", align=4)
        out = T.match_buffer(out_h, (n, F), "float32", align=4)
        for i, f in T.grid(n, F):
            with T.sblock("drop"):
                vi, vf = T.axis.remap("SS", [i, f])
                T.reads(ids[vi], x[vi, vf], step[()])
                T.writes(out[vi, vf])
                out[vi, vf] = T.Select(keep(ids[vi] * F + vf, step[()], seed, p),
                                       x[vi, vf] * T.float32(scale), T.float32(0))
    return k


@definer("dropout_nnz")
def dropout_nnz(F: int, p: float, seed: int):
    """Dropout on the nonzeros of sparse node features (row-major element index row*F+col,
    the same mask as ``dropout`` on the dense features: zeros stay zeros either way)."""
    scale = 1.0 / (1.0 - p)

    @T.prim_func(s_tir=True)
    def k(ids_h: T.handle, rows_h: T.handle, cols_h: T.handle, vals_h: T.handle,
          step_h: T.handle, out_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n, nnz = T.int64(), T.int64()
        ids = T.match_buffer(ids_h, (n,), "int64", align=4)
        rows = T.match_buffer(rows_h, (nnz,), "int32", align=4)
        cols = T.match_buffer(cols_h, (nnz,), "int32", align=4)
        vals = T.match_buffer(vals_h, (nnz, 1), "float32", align=4)
        step = T.match_buffer(step_h, (), "int32", align=4)
        out = T.match_buffer(out_h, (nnz, 1), "float32", align=4)
        for j in range(nnz):
            with T.sblock("drop"):
                vj = T.axis.remap("S", [j])
                T.reads(ids[0:n], rows[vj], cols[vj], vals[vj, 0], step[()])
                T.writes(out[vj, 0])
                out[vj, 0] = T.Select(
                    keep(ids[rows[vj]] * F + T.Cast("int64", cols[vj]), step[()],
                          seed, p), vals[vj, 0] * T.float32(scale), T.float32(0))
    return k
