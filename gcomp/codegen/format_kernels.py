"""Aggregation over the dense, banded and ELL-bucket adjacency formats (CPU loop nests).

CSR aggregation gathers one random source row per edge.  When the adjacency is
dense enough, storing it as dense blocks and multiplying them with the feature
rows is faster: every source row is loaded once per block of destination rows
and used for all of them, and the loops have no indirection.  Three layouts
(``gcomp/runtime/formats.py`` chooses between them and CSR by a cost model):

* ``dense``: A as an n x n matrix (small graphs of high density).
* ``banded``: block tridiagonal, ``band[b, d, r, c]`` = A[b*B + r, (b + d - 1)*B + c]
  for blocks of B rows and d in 0..2: every edge joins rows at most one block
  apart, as after reverse Cuthill-McKee on a graph of small bandwidth, or for a
  batch of small graphs packed one after another (block diagonal).  B is chosen
  for each bound graph (its bandwidth, rounded up to a multiple of ``GROUP``) and
  read from the layout's shape.
* ``ell``: ELL buckets (SparseTIR's hybrid format): rows grouped by degree, each
  padded to the next power of two, so a row's slot loop has a fixed trip count
  (``_ell_agg``).  Packed by ``formats.pack_ell`` (numpy, once per bound graph);
  A.T gets its own layout from the CSC arrays.

``format_pack`` writes a dense or banded layout from the CSR arrays and the edge weights (ones
for an unweighted aggregation); duplicate edges add up, as in the sum over
edges.  ``format_agg`` computes ``out = epilogue(finish(A @ x))`` (or ``A.T @ x``
with ``transpose``, the backward of aggregation) with the same reductions
(sum, mean), epilogues and results as ``csr_agg``.  A block of output rows stays
in cache while the source rows stream past it.

Arguments: pack: indptr (int64, n+1), indices (int32, nnz), [w (float32, nnz x 1)],
layout (dense: n x n; banded: nb x 3 x B x B, nb = ceil(n / B), B a multiple of
GROUP).  Aggregation: layout (ell: work, perm, cols, vals), indptr (n+1: the degrees
of ``mean``), x (n x F), extras..., out (n x F).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.aggregate_kernel import _finish
from gcomp.codegen.cpu_kernels import (PREFETCH_DISTANCE, _features, _if, _prefetch,
                                       _row_sums, _scratch)
from gcomp.codegen.kernels import arg, definer

ROWS = 16  # destination rows per block of the dense layout (their outputs stay in L1)
GROUP = 8  # the banded format's block size is a multiple of this
ELL_UNROLLED = 6  # ELL buckets 1..6 (widths 1..32) get their slot loop unrolled
I64 = "int64"
F32 = "float32"


def _layout_arg(fmt: str, n):
    """The layout buffer, and its block size (banded: a multiple of the row group)."""
    if fmt == "dense":
        return arg("layout", (n, n), F32), None
    nb, B = tirx.Var("nb", I64), tirx.Var("B", I64)
    return arg("layout", (nb, 3, B, B), F32), B


@definer("format_pack", target="llvm")
def format_pack(fmt: str, weight: str):
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(f"pack_{fmt}")
            T.func_attr({"tirx.noalias": True})
            rows1, nnz = (tirx.Var(name, I64) for name in ("rows1", "nnz"))
            indptr = arg("indptr", (rows1,), I64)  # n + 1: a shape that binds n is needed
            n = rows1 - 1
            indices = arg("indices", (nnz,), "int32")
            w = arg("w", (nnz, 1), F32) if weight != "none" else None
            layout, B = _layout_arg(fmt, n)

            def value(j):
                return w[j, 0] if w is not None else tirx.const(1.0, F32)
            if fmt == "dense":
                with T.parallel(0, n) as i:
                    with T.serial(0, n) as k:  # LLVM turns it into a memset
                        T.buffer_store(layout, tirx.const(0.0, F32), [i, k])
                    with T.serial(indptr[i], indptr[i + 1]) as j:
                        s = tirx.Cast(I64, indices[j])
                        T.buffer_store(layout, layout[i, s] + value(j), [i, s])
            else:
                nb = layout.shape[0]
                with T.parallel(0, nb) as b:
                    with T.serial(0, 3 * B) as q:
                        with T.serial(0, B) as c:  # LLVM turns it into a memset
                            T.buffer_store(layout, tirx.const(0.0, F32), [b, q // B, q % B, c])
                    with T.serial(0, B) as r:
                        i = b * B + r
                        with _if(i < n):
                            with T.serial(indptr[i], indptr[i + 1]) as j:
                                s = tirx.Cast(I64, indices[j])
                                d = s // B - b + 1
                                T.buffer_store(layout, layout[b, d, r, s % B] + value(j),
                                               [b, d, r, s % B])
    return ib.get()


def _group(F: int) -> int:
    """Output rows accumulated together in registers: each source row loaded is used
    for all of them (fewer when wide rows would spill the vector registers).  Divides
    GROUP, so it divides every block size."""
    return GROUP if F <= 64 else GROUP // 2


@definer("format_agg", target="llvm")
def format_agg(fmt: str, reduce: str, F: int, transpose: bool, epilogue: tuple = (),
               extras: tuple = ()):
    if fmt == "ell":  # A.T has a layout of its own (packed from CSC): no transposed kernel
        return _ell_agg(reduce, F, epilogue, extras)
    R = _group(F)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(f"{fmt}_agg")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", I64)
            layout, B = _layout_arg(fmt, n)
            indptr = arg("indptr", (n + 1,), I64)
            x = arg("x", (n, F), F32)
            extra = [arg(f"e{k}", epi.shape(kind, n, F), F32) for k, kind in enumerate(extras)]
            out = arg("out", (n, F), F32)
            # blocks of output rows run in parallel: B rows (banded) or ROWS (dense), in
            # groups of R whose sums stay in registers while the source rows stream past
            span = B if fmt == "banded" else ROWS
            with T.parallel(0, (n + span - 1) // span) as b:
                with T.serial(0, span // R) as g:  # B is a multiple of R (GROUP)
                    first = b * span + g * R
                    acc = [_scratch((F,)) for _ in range(R)]
                    for r in range(R):
                        _features(F, lambda f, r=r: T.buffer_store(acc[r], tirx.const(0.0, F32),
                                                                   [f]))

                    def accumulate(weight_of, s):
                        for r in range(R):
                            a = T.Bind(weight_of(r))
                            _features(F, lambda f, r=r: T.buffer_store(
                                acc[r], acc[r][f] + a * x[s, f], [f]))
                    if fmt == "dense":  # every source row, once per group
                        with T.serial(0, n) as s:
                            # rows past n (the last group) repeat row n-1 and are not stored
                            def dense_weight(r, s=s):
                                i = tirx.min(first + r, n - 1)
                                return layout[s, i] if transpose else layout[i, s]
                            accumulate(dense_weight, s)
                    else:  # the source rows of blocks b-1, b, b+1; rows past n have zeros
                        with T.serial(0, 3) as d:
                            src_block = b + 1 - d if transpose else b + d - 1
                            with _if(tirx.all(src_block >= 0, src_block * B < n)):
                                with T.serial(0, tirx.min(B, n - src_block * B)) as k:
                                    def band_weight(r, k=k, d=d, src_block=src_block):
                                        if transpose:
                                            return layout[src_block, d, k, g * R + r]
                                        return layout[b, d, g * R + r, k]
                                    accumulate(band_weight, src_block * B + k)
                    for r in range(R):
                        i = first + r
                        with _if(i < n):
                            def store(f, r=r, i=i):
                                res = _finish(reduce, acc[r][f], indptr[i + 1] - indptr[i])
                                res = epi.apply(epilogue, res,
                                                lambda k: extra[k][epi.index(extras[k], i, f)])
                                T.buffer_store(out, res, [i, f])
                            _features(F, store)
    return ib.get()


def _ell_agg(reduce: str, F: int, epilogue: tuple, extras: tuple):
    """ELL buckets: the rows grouped by degree, bucket k >= 1 padding each row to 2^(k-1)
    slots (bucket 0: rows without edges), so the slot loop of a row has a trip count
    known at compile time (unrolled for the first buckets: the gathers of a row issue
    together, no branch at the row's end).  ``work`` lists (bucket, first position, end
    position, first slot) units of about equal slots, run in parallel; position p holds
    row ``perm[p]``, its slots follow one another.  Padding slots have value 0 and repeat
    a real neighbour of the row (already in cache)."""
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("ell_agg")
            T.func_attr({"tirx.noalias": True})
            n, m, P, S = (tirx.Var(name, I64) for name in ("n", "m", "P", "S"))
            work = arg("work", (P, 4), I64)
            perm = arg("perm", (n,), "int32")
            cols = arg("cols", (S,), "int32")
            vals = arg("vals", (S,), F32)
            indptr = arg("indptr", (n + 1,), I64)
            x = arg("x", (m, F), F32)
            extra = [arg(f"e{k}", epi.shape(kind, n, F), F32) for k, kind in enumerate(extras)]
            out = arg("out", (n, F), F32)
            with T.parallel(0, P) as u:
                k, p0, p1, s0 = (T.Bind(work[u, c]) for c in range(4))

                def rows(width, unrolled: bool):
                    with T.serial(0, p1 - p0) as r:
                        i = T.Bind(tirx.Cast(I64, perm[p0 + r]))
                        first = T.Bind(s0 + r * width)
                        acc, at = _row_sums(out, i, F)
                        _features(F, lambda f: T.buffer_store(acc, tirx.const(0.0, F32), at(f)))

                        def slot(t):
                            _prefetch(x, cols[tirx.min(first + t + PREFETCH_DISTANCE, S - 1)], F)
                            src = T.Bind(cols[first + t])
                            a = T.Bind(vals[first + t])
                            _features(F, lambda f: T.buffer_store(
                                acc, acc[at(f)] + a * x[src, f], at(f)))
                        if unrolled:
                            for t in range(width):
                                slot(t)
                        else:
                            with T.serial(0, width) as t:
                                slot(t)

                        def finish(f):
                            res = _finish(reduce, acc[at(f)], indptr[i + 1] - indptr[i])
                            res = epi.apply(epilogue, res,
                                            lambda q: extra[q][epi.index(extras[q], i, f)])
                            T.buffer_store(out, res, [i, f])
                        if reduce != "sum" or epilogue or acc is not out:
                            _features(F, finish)
                for b in range(ELL_UNROLLED + 1):
                    with _if(k == b):
                        rows(0 if b == 0 else 1 << (b - 1), True)
                with _if(k > ELL_UNROLLED):
                    rows(tirx.const(1, I64) << (k - 1), False)
    return ib.get()
