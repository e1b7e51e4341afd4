"""CPU definitions of the gather-bound sparse kernels, written as loop nests.

Aggregation (``csr_agg``), GAT's fused attention (``attention_agg``) and the
per-edge dot product (``edge_dot``, the gradient of attention weights) spend their time fetching the feature rows of
random neighbours.  The hardware prefetcher cannot predict an indirect address,
so each row fetch was a cache miss the core waited on.  These definitions walk
one destination row at a time (rows cut into ranges of equal work, in parallel:
``_balanced_rows``) and, for each in-edge, issue a
software prefetch for the neighbour row ``PREFETCH_DISTANCE`` edges ahead, so
the misses overlap; the feature loop is vectorized in chunks the vector unit
holds.  Measured on arxiv-synth (169k nodes, 1.34M edges, 2 threads): weighted
sum aggregation at 32 features 7.5 -> 5.5 ms, edge dot products at 4 heads x 32
channels 136 -> 42 ms (half of it from walking rows: each destination row is
read once instead of once per edge).  Sweeping the rows once per tile of
columns, so that one tile of every source row would stay in cache, was slower
(Intel Xeon, 2 threads, ``bench.memory_floor`` at 128 features: 17.8 ms whole rows,
22.2 / 33.6 / 43.3 in tiles of 64 / 32 / 16 columns; 2026-11-27): the misses are
paid per line fetched, and tiles fetch the same lines.

The dense kernels here are those whose scheduled generic form left time on the
table: the matmul in groups of rows (``matmul``), weight gradients in row blocks
against register tiles (``matmul_tn``), the loss and its gradient in row ranges
(``cross_entropy``, ``cross_entropy_grad``), and the one-pass check and copy of
node features (``feed_rows``).  Each says where it measured faster; a definer
returns None for parameters where the generic kernel stays.

The loop kinds (parallel, vectorized) are part of the definition, so the CPU
schedule leaves these kernels as they are (``gcomp/schedules/cpu.py``); other
targets keep the generic definitions (``aggregate_kernel.py``,
``dense_kernels.py``).  Same arguments and results as the generic kernels.
"""

from __future__ import annotations

from contextlib import contextmanager

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen import stream_stores
from gcomp.codegen.aggregate_kernel import (NEG_INF, _finish, attention_buffers,
                                            drop_factor, finish_attention_stats, leaky,
                                            slope_factor, times)
from gcomp.codegen.bf16_pairs import product_args
from gcomp.codegen.dense_kernels import CHUNKS, _lanes, colsum_rows
from gcomp.codegen.fastmath import fast_exp
from gcomp.codegen.kernels import arg, bound, definer, stored_bf16
from gcomp.runtime.plan import FEED_PARTS, NONFINITE

PARTS = 256             # row ranges of equal work (in-edges + rows) shared out to threads
PREFETCH_DISTANCE = 32  # edges ahead: measured best of 16 / 32 / 64 / 128 at 32 features
# rows of 8 lines and more (128 floats): prefetched into L2 only, further ahead, so the
# core's few L1 fill buffers are not all held by lines asked for early.  arxiv-size
# aggregation at 128 features, Intel Xeon, 2 threads, interleaved medians of 25: 18.5 ->
# 17.6 ms (rows on a cache line), 20.8 -> 18.7 (rows 16 bytes past one); L2 at 32 edges
# 20.2 / 20.8, all levels at 64 edges 20.0 / 21.0.  At 32 features L2 was slower (3.0 ->
# 4.1 ms), so narrower rows keep the defaults.
WIDE_ROW_LINES = 8
WIDE_PREFETCH_DISTANCE = 64
PREFETCH_LINES = 8      # cache lines prefetched per row (longer rows: the stream prefetcher)
VEC = 16                # floats per vector chunk
MM_AHEAD_BYTES = 2048   # how far ahead (bytes of x) the row-group matmul prefetches
MM_SHARE_K = 8          # k steps of the row-group matmul between two shares of prefetches
# locality of a product's input rows as the row groups prefetch them (and the dot-product
# kernel's, ``dot_bf16_kernels``): 0, non-temporal, so that rows read once do not push out
# of the last-level cache the rows written just before, which the next kernel (an
# aggregation gathering them, the backward's next product) reads again.  AMD EPYC Zen 4,
# arxiv-synth training steps, saved artifacts of both compiles interleaved in a process,
# medians of 21-25: bf16 GraphSAGE 41.4 -> 40.6 ms (faster in 21 of 25 rounds; its
# aggregations 0.1-0.3 ms each faster, the products unchanged), GCN 28.6 -> 28.1 (20/25),
# GIN 43.5 -> 42.9 (18/25); float32 GraphSAGE 69.5 -> 66.6 (17/21), GCN 45.4 -> 44.8
# (16/21); losses bitwise equal.  Again 41 rounds later, the VM noisier: GraphSAGE 42.6
# -> 41.7 (31/41), GCN 28.7 -> 28.6 (26/41).  The weight gradients' reads stay at 3:
# non-temporal there too, the bf16 GraphSAGE step lost the gain (43.7 vs 43.6).  Only the
# ``default`` tuning (AMD's AVX-512 cores) was measured; the others keep 3.
MM_INPUT_LOCALITY = {"default": 0}
# tunings under which an aggregation whose output only products read (``stream_out``,
# ``lower.stream_in_order_outputs``) writes it past the caches (``stream_stores``; rows of
# whole cache lines only).  AMD EPYC Zen 4, arxiv-synth, 2 threads, 21-25 interleaved
# rounds: the weighted sum alone, float32, 32 features 4.23 -> 3.95 ms, 128 features 18.49
# -> 12.15 (the output's write-allocate reads gone, the gathered rows kept in L3); bf16
# 32-wide mean 2.22 -> 2.12.  Training steps, saved artifacts interleaved (medians; the
# aggregations' sums): bf16 GraphSAGE 43.8 -> 41.1 ms (10.8 -> 10.0), GIN 43.1 -> 42.4
# (13.9 -> 13.3), GCN 31.4 -> 31.2 (12.8 -> 12.3); float32 GraphSAGE 66.6 -> 65.0 (15.0
# -> 12.8), GCN 45.8 -> 44.7 (17.8 -> 16.8), GIN 79.3 -> 76.5 (30.8 -> 27.2).  Intel's
# tunings unmeasured: they store through the caches.
AGG_STREAM_TUNINGS = {"default"}
# rows per block of the weight-gradient product (x and y rows in L1).  AMD EPYC Zen 3,
# arxiv-size rows, 2 threads, interleaved, with the next block's prefetches spread over
# the tiles: 32 x 32 3.2 ms at 32 rows (3.5 at 64, 4.4 at 128), 40 x 32 4.9 (5.3, 5.4),
# 128 x 32 11.7 (11.7 at 64, 15.1 at 96), 128 x 128 47.0 (59.3 at 64)
TN_BLOCK = 32
# rows of a tile between two shares of the next block's prefetches.  Intel Xeon, arxiv-size
# rows read from memory, 2 threads, 15 interleaved calls (a share per tile before): 128 x
# 32 6.7 -> 6.2 ms, 40 x 40 3.5 -> 3.3, 32 x 40 2.7 -> 2.4, 32 x 32 2.2 -> 2.0, 128 x 128
# 18.2 either way; a share every 8 rows made 128 x 128 6% slower
TN_SHARE_ROWS = 16
# floats of row-group sums a matmul keeps in registers under the ``avx2`` tuning (16
# registers of 8 floats; groups of at most 4 rows; 8 rows of at most 16 columns where x
# rows hold 256 values or more).  AMD EPYC Zen 3, arxiv-size rows, 2 threads, interleaved runs:
# 128 -> 32 22.2 -> 12.2 ms with groups of 2 rows, 128 -> 128 72.8 -> 39.9 with 4 rows in
# 16-column tiles, 40 -> 384 34.4 -> 15.5 (50k rows) likewise, 500 -> 16 12.9 -> 5.9
# with 8, 128 -> 130 42.3 -> 35.2 one row at a time (``_matmul_rows``: short rows too)
AVX2_ACC_FLOATS = 80


def _row_range(n, p, parts: int):
    """Rows [lo, hi) of range ``p`` of ``parts`` contiguous ranges of about n / parts rows
    (each bound once, as a local scalar)."""
    i64 = "int64"
    return (T.Bind(n * tirx.Cast(i64, p) // tirx.const(parts, i64)),
            T.Bind(n * tirx.Cast(i64, p + 1) // tirx.const(parts, i64)))


def _features(width: int, emit) -> None:
    """Call ``emit(f)`` under vectorized loops covering 0..width: one loop when it is
    narrow, else VEC-wide chunks and a vectorized tail."""
    if width <= 2 * VEC:
        with T.vectorized(0, width) as f:
            emit(f)
        return
    main = width - width % VEC
    with T.serial(0, main // VEC) as fo:
        with T.vectorized(0, VEC) as fi:
            emit(fo * VEC + fi)
    if main < width:
        with T.vectorized(0, width - main) as ft:
            emit(main + ft)


@contextmanager
def _balanced_rows(indptr, n, name: str = "i", after=None):
    """``for i in rows``, the rows cut into PARTS contiguous ranges of equal work, in
    parallel.  Work of rows [0, i) is ``indptr[i] - indptr[0] + i`` (their in-edges plus a
    per-row cost), increasing in i, so each range's ends are found by binary search on indptr
    inside the kernel; no per-graph array is needed.  TVM hands the parts out in equal
    blocks, so a thread that got a power-law graph's hubs no longer finishes last.
    ``after()``, if given, runs at the end of each range."""
    i64 = "int64"
    total = indptr[n] - indptr[0] + n  # indptr may be a view of some rows (distributed)
    with T.parallel(0, PARTS) as t:
        span = _scratch((2,), i64)

        def first_row_at(k):
            """The first i whose rows before it hold total * (t + k) / PARTS of the work."""
            goal = total * tirx.Cast(i64, t + k) // tirx.const(PARTS, i64)
            T.buffer_store(span, tirx.const(0, i64), [0])
            T.buffer_store(span, n, [1])
            with T.While(span[0] < span[1]):
                mid = (span[0] + span[1]) // tirx.const(2, i64)
                with T.If(indptr[mid] - indptr[0] + mid < goal):
                    with T.Then():
                        T.buffer_store(span, mid + tirx.const(1, i64), [0])
                    with T.Else():
                        T.buffer_store(span, mid, [1])
            return span[0]
        lo = T.Bind(first_row_at(0))
        hi = T.Bind(first_row_at(1))
        # a loop from 0, not from lo: TVM 0.27 shifted only some uses of a loop variable
        # starting at a computed value when an inner loop's bounds read it (wrong rows)
        with T.serial(0, hi - lo) as r:
            IRBuilder.name(name, r)
            yield lo + r
        if after is not None:
            after()


@contextmanager
def _if(cond):
    """``with _if(c):`` runs its body only where ``c`` holds."""
    with T.If(cond):
        with T.Then():
            yield


def _scratch(shape, dtype: str = "float32"):
    """A small buffer of the loop iteration that allocates it (a row's sums, a head's
    scores).  Scope "global", not "local": TVM 0.27 keeps a "global" allocation of a
    constant size under 1,024 bytes on the stack (LowerTVMBuiltin), where LLVM holds it in
    registers, and turns any "local" one into a TVMBackendAllocWorkspace call and its free
    in every iteration (the row-group matmul 32 -> 32 on arxiv-size rows, AMD EPYC Zen 3:
    5.6 -> 3.3 ms).  Larger ones still go to the workspace pool: callers that keep a tile
    of several rows allocate a buffer per row."""
    return T.alloc_buffer(shape, dtype, scope="global")


def _prefetch_line(x, row, col, write: bool = False, locality: int = 3) -> None:
    """Prefetch the cache line holding ``x[row, col]`` (``write``: for writing,
    ``prefetchw``) into all cache levels, or with ``locality`` 2 into L2 and beyond."""
    addr = tirx.address_of(x[row, col])
    T.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr,
                                     tirx.const(int(write), "uint32"),
                                     tirx.const(locality, "uint32"), tirx.const(1, "uint32")))


def _per_line(x) -> int:
    """Values of ``x`` in a 64-byte cache line."""
    return 32 if str(x.dtype) == "bfloat16" else VEC


def _gather_ahead(j, nnz, x, width: int):
    """(edge index to prefetch for edge ``j``, locality) for gathered rows of ``width``
    values of ``x`` (``WIDE_ROW_LINES``)."""
    if -(-width // _per_line(x)) >= WIDE_ROW_LINES:
        return tirx.min(j + WIDE_PREFETCH_DISTANCE, nnz - 1), 2
    return tirx.min(j + PREFETCH_DISTANCE, nnz - 1), 3


def _prefetch(x, row, width: int, locality: int = 3) -> None:
    """Prefetch the first lines of ``x[row, :width]``: one per 16 floats (32 bfloat16),
    and for float32 the line of its last value, for a row that does not start on a cache
    line spans one more (numpy aligns arrays to 16 bytes, and the kernels read the
    caller's features in place; bfloat16 values are always gcomp's own, on lines: a
    32-wide bfloat16 row is one line, which three prefetches asked for before; GCN's bf16
    aggregations on arxiv-synth, Intel Xeon, repeated calls 1.99-2.08 -> 1.93-2.04 ms).
    Weighted sum over arxiv-synth, rows 16 bytes past a line, AMD EPYC Zen 3, interleaved:
    32 floats 10.3 -> 8.0 ms (aligned rows: 6.1-6.4 either way), 40 floats 15.4 -> 14.0;
    128 floats unchanged."""
    per = _per_line(x)
    lines = -(-width // per)
    for q in range(min(lines, PREFETCH_LINES)):
        _prefetch_line(x, row, q * per, locality=locality)
    if lines <= PREFETCH_LINES and width > 1 and per == VEC:
        _prefetch_line(x, row, width - 1, locality=locality)


def _prefetch_share(arrays, first, rows: int, n, share, shares: int,
                    locality: int = 3) -> None:
    """Prefetch part ``share`` of ``shares`` of the lines of rows ``first .. first + rows -
    1`` of each (array, width[, write[, locality[, index]]]) in ``arrays`` (rows past ``n -
    1`` clamp to it; ``write``: for writing; ``locality`` as ``_prefetch_line``'s, the
    array's own or the argument's; ``index``: a function giving the array's row of each
    row, for an array written or read in another row order).  Called once per share
    while the work before those rows runs, it spreads their prefetches over that work:
    all of a block's lines asked for at once overran the core's queue of outstanding
    misses and most were dropped (the weight gradient 128 x 32 on arxiv-size rows, AMD
    EPYC Zen 3: 21.1 -> 11.7 ms; 32 x 32 5.1 -> 3.2; the row-group matmul below on the
    Intel Xeon)."""
    per_row = [(a[0], -(-a[1] // _per_line(a[0])), len(a) > 2 and a[2],
                a[3] if len(a) > 3 else locality, a[4] if len(a) > 4 else None)
               for a in arrays]
    row_lines = sum(lines for _, lines, _, _, _ in per_row)
    each = -(-rows * row_lines // shares)
    with T.serial(0, each) as u:
        line = share * each + u
        row = tirx.min(first + line // row_lines, n - 1)
        q = line % row_lines
        with _if(line < rows * row_lines):
            start = 0
            for a, lines, write, loc, index in per_row:
                with _if(tirx.all(start <= q, q < start + lines)):
                    _prefetch_line(a, row if index is None else index(row),
                                   (q - start) * _per_line(a), write, loc)
                start += lines


def _row_sums(out, i, F: int, scratch: bool = False):
    """Where a row's sums of aggregated edges go, and its index map: a bfloat16 output, or
    one ``scratch`` says is stored from a row of its own (``stream_stores``), is
    summed in a float32 row and stored once; else a float32 one in place, in row ``i`` of
    ``out`` (a local row measured 7-9% slower, 32 and 128 features)."""
    if scratch or stored_bf16("out"):
        return _scratch((F,)), lambda f: [f]
    return out, lambda f: [i, f]


def _args(spec):
    return [arg(name, shape, dtype) for name, shape, dtype in spec]


@definer("csr_agg", target="llvm")
def csr_agg(reduce: str, H: int, C: int, weight: str, indirect: bool = False,
            epilogue: tuple = (), extras: tuple = (), dot_bf16: bool = False,
            stream_out: bool = False, tuning: str = "default"):
    """``stream_out``: the plan's hint that only products (or the caller) read the
    output, in order, so it may be written past the caches (``stream_stores``; under
    the tunings of ``AGG_STREAM_TUNINGS``, for rows of whole cache lines)."""
    F = H * C
    WH = H if weight == "head" else 1
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("csr_agg")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = (tirx.Var(name, "int64") for name in ("n", "m", "nnz"))
            spec = [("indptr", (n + 1,), "int64"), ("indices", (nnz,), "int32")]
            if indirect and weight != "none":
                spec.append(("eid", (nnz,), "int64"))
            if weight != "none":
                spec.append(("w", (nnz, WH), f32))
            spec.append(("x", (m, F), f32))
            spec += [(f"e{k}", epi.shape(kind, n, F), f32)
                     for k, kind in enumerate(extras)]
            spec.append(("out", (n, F), f32))
            bufs = dict(zip([s[0] for s in spec], _args(spec)))
            indptr, indices, x, out = bufs["indptr"], bufs["indices"], bufs["x"], bufs["out"]
            w, eid = bufs.get("w"), bufs.get("eid")
            extra = [bufs[f"e{k}"] for k in range(len(extras))]
            init = tirx.const(NEG_INF if reduce == "max" else 0.0, f32)
            rounds = dot_bf16 and stored_bf16("out")
            # streaming stores need whole-line rows; a bfloat16 one is rounded by the CPU
            stream = stream_out and tuning in AGG_STREAM_TUNINGS and stream_stores.streams(
                F, stored_bf16("out")) and (rounds or not stored_bf16("out"))
            with dot_bf16_kernels.importing_round(rounds and not stream), \
                    stream_stores.importing(stream), \
                    _balanced_rows(indptr, n, after=stream_stores.fence if stream else None) as i:
                acc, at = _row_sums(out, i, F, scratch=stream)
                _features(F, lambda f: T.buffer_store(acc, init, at(f)))
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    IRBuilder.name("j", j)
                    ahead, locality = _gather_ahead(j, nnz, x, F)
                    _prefetch(x, indices[ahead], F, locality)
                    if eid is not None:  # CSC order reads CSR-ordered weights at random too
                        _prefetch(w, eid[ahead], 1)
                    src = indices[j]
                    for h in range(H):
                        def edge(c, h=h):
                            val = x[src, h * C + c]
                            if w is not None:
                                e = eid[j] if eid is not None else j
                                val = w[e, h if weight == "head" else 0] * val
                            old = acc[at(h * C + c)]
                            new = tirx.max(old, val) if reduce == "max" else old + val
                            T.buffer_store(acc, new, at(h * C + c))
                        _features(C, edge)
                deg = indptr[i + 1] - indptr[i]

                def finish(f):
                    res = _finish(reduce, acc[at(f)], deg)
                    return epi.apply(epilogue, res,
                                     lambda k: extra[k][epi.index(extras[k], i, f)])
                if stream:
                    stream_stores.store_row(out, i, acc, F, finish, stored_bf16("out"))
                elif rounds:  # the row finished in its float32 sums, rounded by the CPU
                    dot_bf16_kernels.store_rounded(out, i, acc, F, finish)
                elif reduce != "sum" or epilogue or acc is not out:
                    _features(F, lambda f: T.buffer_store(out, finish(f), [i, f]))
    return ib.get()


@definer("edge_dot", target="llvm")
def edge_dot(H: int, C: int):
    """out[j, h] = sum_c x[indices[j], h, c] * y[i, h, c] for each in-edge j of row i;
    V lanes of partial sums per (edge, head), added at the end."""
    F = H * C
    V = _lanes(C)
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("edge_dot")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz = (tirx.Var(name, "int64") for name in ("n", "m", "nnz"))
            indptr, indices, _rows, x, y, out = _args([
                ("indptr", (n + 1,), "int64"), ("indices", (nnz,), "int32"),
                ("rows", (nnz,), "int32"), ("x", (m, F), f32), ("y", (n, F), f32),
                ("out", (nnz, H), f32)])
            with _balanced_rows(indptr, n) as i:
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    IRBuilder.name("j", j)
                    _prefetch(x, indices[tirx.min(j + PREFETCH_DISTANCE, nnz - 1)], F)
                    src = indices[j]
                    with T.serial(0, H) as h:
                        part = _scratch((V,))
                        T.buffer_store(out, _head_dots(part, V, C, h, lambda f: x[src, f],
                                                       lambda f: y[i, f]), [j, h])
    return ib.get()


@definer("attention_agg", target="llvm")
def attention_agg(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0,
                  epilogue: tuple = (), extras: tuple = ()):
    """GAT attention per destination row (see the generic ``attention_agg``): a sweep over
    the in-edges for each head's maximum score, then one for the exponentials and their
    sums (vectorized over heads; with dropout, the weights times their dropout factors)
    and the weighted sum of the prefetched source rows (vectorized over channels).  All
    heads share a sweep: each source row and score row is fetched once per edge."""
    F = H * C
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("attention_agg")
            T.func_attr({"tirx.noalias": True})
            bufs, n, m, nnz = attention_buffers("attention_agg", H, C, p, extras)
            indptr, indices, x, out = bufs["indptr"], bufs["indices"], bufs["x"], bufs["out"]
            s_src, s_dst = bufs["s_src"], bufs["s_dst"]
            perm, step = bufs.get("perm"), bufs.get("step")
            extra = [bufs[f"e{k}"] for k in range(len(extras))]
            with _balanced_rows(indptr, n) as i:
                top = _scratch((H,))
                total = _scratch((H,))
                wt = _scratch((H,))

                def score(j, h):
                    return leaky(s_src[indices[j], h] + s_dst[i, h], slope)
                _features(F, lambda f: T.buffer_store(out, tirx.const(0.0, f32), [i, f]))
                _features(H, lambda h: (T.buffer_store(top, tirx.const(NEG_INF, f32), [h]),
                                        T.buffer_store(total, tirx.const(0.0, f32), [h])))
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    _prefetch(s_src, indices[tirx.min(j + PREFETCH_DISTANCE, nnz - 1)], H)
                    _features(H, lambda h: T.buffer_store(top, tirx.max(top[h], score(j, h)),
                                                          [h]))
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    _prefetch(x, indices[tirx.min(j + PREFETCH_DISTANCE, nnz - 1)], F)

                    def weigh(h):
                        T.buffer_store(wt, fast_exp(score(j, h) - top[h]), [h])
                        T.buffer_store(total, total[h] + wt[h], [h])
                        if p:
                            T.buffer_store(wt, wt[h] * drop_factor(perm, j, h, H, step, p, seed),
                                           [h])
                    _features(H, weigh)
                    src = indices[j]
                    for h in range(H):
                        _features(C, lambda c, h=h: T.buffer_store(
                            out, out[i, h * C + c] + wt[h] * x[src, h * C + c], [i, h * C + c]))

                def finish(f):
                    t = total[f // C]
                    res = tirx.Select(t > tirx.const(0.0, f32), out[i, f] / t,
                                      tirx.const(0.0, f32))
                    res = epi.apply(epilogue, res,
                                    lambda k: extra[k][epi.index(extras[k], i, f)])
                    T.buffer_store(out, res, [i, f])
                _features(F, finish)
    return ib.get()


def _fold(v, lanes: int, op):
    """``op`` over the ``lanes`` lanes of vector ``v``, halving it in registers (a fold
    through a local buffer stalls at each step, reading back half of a vector it has just
    stored)."""
    odd = []
    while lanes > 1:
        if lanes % 2:
            odd.append(tirx.Shuffle([v], [tirx.const(lanes - 1, "int32")]))
            lanes -= 1
        half = lanes // 2
        v = op(tirx.Shuffle([v], [tirx.const(k, "int32") for k in range(half)]),
               tirx.Shuffle([v], [tirx.const(k, "int32") for k in range(half, lanes)]))
        lanes = half
    for lane in odd:
        v = op(v, lane)
    return v


def _head_dots(part, V: int, C: int, h: int, a, b) -> tirx.PrimExpr:
    """sum_c a(h * C + c) * b(h * C + c), in V vector lanes of partial sums (``part``, read
    and written whole: a register) folded in registers (``_fold``; added up one lane at a
    time from the buffer, they made a chain of V - 1 dependent adds per edge and head:
    ``edge_dot`` at 4 heads x 32 channels on arxiv-size graphs 27.6 -> 26.0 ms)."""
    f32 = "float32"
    with T.vectorized(0, V) as v:
        T.buffer_store(part, tirx.const(0.0, f32), [v])
    with T.serial(0, C // V) as co:
        with T.vectorized(0, V) as v:
            f = h * C + co * V + v
            T.buffer_store(part, part[v] + a(f) * b(f), [v])
    if V == 1:
        return part[0]
    return _fold(part[tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), V)], V,
                 lambda x, y: x + y)


@definer("attention_grad_dst", target="llvm")
def attention_grad_dst(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0):
    """The destination half of attention's backward per row (see the generic
    ``attention_grad_dst``), all heads in each sweep over the in-edges like the forward:
    the maxima, then per edge the heads' dot products dy_i . x_j of the prefetched source
    row and the four sums (vectorized over heads)."""
    F = H * C
    V = _lanes(C)
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("attention_grad_dst")
            T.func_attr({"tirx.noalias": True})
            bufs, n, m, nnz = attention_buffers("attention_grad_dst", H, C, p)
            indptr, indices, s_src, s_dst, x, dy, out = (bufs[k] for k in (
                "indptr", "indices", "s_src", "s_dst", "x", "dy", "out"))
            perm, step = bufs.get("perm"), bufs.get("step")
            with _balanced_rows(indptr, n) as i:
                # rows: max score, l, sum p g, sum p g r, sum p r, then g and p of one edge
                acc = _scratch((7, H))
                part = _scratch((V,))

                def z(j, h):
                    return s_src[indices[j], h] + s_dst[i, h]

                def init(h):
                    T.buffer_store(acc, tirx.const(NEG_INF, f32), [0, h])
                    for k in range(1, 5):
                        T.buffer_store(acc, tirx.const(0.0, f32), [k, h])
                _features(H, init)
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    _prefetch(s_src, indices[tirx.min(j + PREFETCH_DISTANCE, nnz - 1)], H)
                    _features(H, lambda h: T.buffer_store(
                        acc, tirx.max(acc[0, h], leaky(z(j, h), slope)), [0, h]))
                with T.serial(indptr[i], indptr[i + 1]) as j:
                    ahead = indices[tirx.min(j + PREFETCH_DISTANCE, nnz - 1)]
                    _prefetch(x, ahead, F)
                    _prefetch(s_src, ahead, H)
                    src = indices[j]
                    for h in range(H):
                        g = _head_dots(part, V, C, h, lambda f: dy[i, f], lambda f: x[src, f])
                        T.buffer_store(acc, times(g, drop_factor(perm, j, h, H, step, p, seed)),
                                       [5, h])

                    def weigh(h):
                        T.buffer_store(acc, fast_exp(leaky(z(j, h), slope) - acc[0, h]), [6, h])
                        e, g, r = acc[6, h], acc[5, h], slope_factor(z(j, h), slope)
                        T.buffer_store(acc, acc[1, h] + e, [1, h])
                        T.buffer_store(acc, acc[2, h] + e * g, [2, h])
                        T.buffer_store(acc, acc[3, h] + e * g * r, [3, h])
                        T.buffer_store(acc, acc[4, h] + e * r, [4, h])
                    _features(H, weigh)
                with T.serial(0, H) as h:
                    finish_attention_stats(out, i, h, H, s_dst[i, h], lambda k: acc[k, h])
    return ib.get()


@definer("attention_grad_src", target="llvm")
def attention_grad_src(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0):
    """The source half of attention's backward per source row (see the generic
    ``attention_grad_src``): for each out-edge, the heads' coefficients (vectorized over
    heads) from the prefetched statistics row of the destination, which holds all it
    gives (s_dst, lse, D: one cache line for 4 heads), then per head the dot product
    dy_i . x_j (x_j stays in cache across the row's edges) for d s_src[j] and d x[j] +=
    a dy_i (vectorized over channels).  Accumulating a r dy_i for one dot product per
    row instead measured no faster (arxiv-synth, 4 heads x 32)."""
    F = H * C
    V = _lanes(C)
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("attention_grad_src")
            T.func_attr({"tirx.noalias": True})
            bufs, n, m, nnz = attention_buffers("attention_grad_src", H, C, p)
            indptr, indices, s_src, x, dy, stats, out = (bufs[k] for k in (
                "indptr", "indices", "s_src", "x", "dy", "stats", "out"))
            perm, step = bufs.get("csc_perm"), bufs.get("step")
            with _balanced_rows(indptr, n, name="j") as j:
                # a, a r, d s_src, and with dropout the coefficient's factor m
                coef = _scratch((4 if p else 3, H))

                def m_of(h):
                    return coef[3, h] if p else None
                part = _scratch((V,))
                _features(F, lambda f: T.buffer_store(out, tirx.const(0.0, f32), [j, f]))
                _features(H, lambda h: T.buffer_store(coef, tirx.const(0.0, f32), [2, h]))
                with T.serial(indptr[j], indptr[j + 1]) as k:
                    ahead = indices[tirx.min(k + PREFETCH_DISTANCE, nnz - 1)]
                    _prefetch(dy, ahead, F)
                    _prefetch(stats, ahead, 4 * H)
                    d = indices[k]

                    def weigh(h):
                        zz = s_src[j, h] + stats[d, H + h]
                        T.buffer_store(coef, fast_exp(leaky(zz, slope) - stats[d, 2 * H + h]),
                                       [0, h])
                        T.buffer_store(coef, coef[0, h] * slope_factor(zz, slope), [1, h])
                        if p:
                            T.buffer_store(coef, drop_factor(perm, k, h, H, step, p, seed),
                                           [3, h])
                    _features(H, weigh)
                    for h in range(H):
                        g = _head_dots(part, V, C, h, lambda f: x[j, f], lambda f: dy[d, f])
                        T.buffer_store(coef, coef[2, h] + coef[1, h] * (
                            times(g, m_of(h)) - stats[d, 3 * H + h]), [2, h])
                        _features(C, lambda c, h=h: T.buffer_store(
                            out, out[j, h * C + c] + times(coef[0, h], m_of(h)) * dy[d, h * C + c],
                            [j, h * C + c]))
                _features(H, lambda h: T.buffer_store(out, coef[2, h], [j, F + h]))
    return ib.get()


def _matmul_rows(K: int, M: int, tuning: str) -> int | None:
    """Rows per group of the row-group matmul, or None where the scheduled row-at-a-time
    kernel (``schedules/cpu.py``) was faster (``tuning``: ``kernels.cpu_tuning``).
    ``avx512`` (Intel Xeon, 2 threads, arxiv-size inputs, 11 interleaved runs): a group's
    sums fill 16 of the 32 vector registers, and groups win from K = 32 (128 -> 32 8.3 ->
    5.0 ms in cache, 13.6 -> 6.4 read from memory with the prefetch; 40 -> 32 1.9 -> 1.4;
    128 -> 128 34 -> 21; 1433 -> 16 124 -> 38 with 16 rows); rows at a time for shorter
    rows (16 -> 32 0.65 vs 0.79 ms) and outputs of 16 vectors or more (128 -> 256).
    ``default`` (AMD EPYC Zen 4, arxiv-size rows read from memory, 2 threads, 7 to 9
    interleaved calls, 2026-11-28): groups for every shape but the shortest rows, 8 rows
    into at most 32 columns, 4 below 64, 2 from there: 128 -> 32 10.5 -> 6.2 ms (R = 4 6.4,
    16 8.3), 32 -> 32 2.24 -> 1.59, 32 -> 40 2.67 -> 2.03 (R = 4), 40 -> 32 2.75 -> 2.12,
    16 -> 32 1.30 -> 1.08, 32 -> 16 2.10 -> 1.70, 128 -> 64 16.6 -> 12.5 (R = 2), 128 -> 128
    58.0 -> 26.4 (R = 2; 4 44.4), 32 -> 128 8.6 -> 6.6 (R = 2); rows at a time for 4 -> 32
    (1.37 vs 1.42 with R = 4).  ``avx2`` (AMD EPYC Zen 3, arxiv-size rows, interleaved): groups
    for every shape since their sums stay on the stack (``_scratch``): 32 -> 32 4.8 ->
    3.4 ms, 32 -> 40 5.2 -> 3.9, 40 -> 32 5.4 -> 3.7, 16 -> 40 3.7 -> 2.4, 128 -> 32 14.2
    -> 9.7, all with groups of 2; 128 -> 128 73.7 -> 40.3 with 4 in 16-column tiles.  The
    ``avx512`` rules were measured while a group's sums were allocated from TVM's
    workspace pool in every group."""
    if tuning == "avx512":
        if K < 32 and M % 8 == 0:
            return None
        vectors = -(-_matmul_cols(M, tuning) // VEC)
        R = 16 if vectors == 1 and K >= 128 else 8
        while R * vectors > 16:
            R //= 2
        return R if R >= 2 else None
    if tuning == "avx2":
        floats = -(-_matmul_cols(M, tuning) // 8) * 8
        if K >= 256 and floats <= 16:
            return 8
        return max(1, min(4, AVX2_ACC_FLOATS // floats))
    if K < 8 and M % 8 == 0:
        return None
    return 8 if M <= 32 else 4 if M < 64 else 2


def _matmul_cols(M: int, tuning: str) -> int:
    """Columns per tile of the row-group matmul: all M, or for outputs wider than 4 vectors
    (avx512; groups would shrink to two rows or one) tiles of 64 that a group of four rows
    sweeps in turn, its x rows staying in L1.  arxiv-synth rows, 2 threads: GGNN's GRU
    products 128 -> 384 107 ms (the scheduled row-at-a-time kernel) -> 60, their gradient
    384 -> 128 79 (groups of two rows) -> 63, 128 -> 128 28.7 -> 27.3."""
    if tuning == "avx512" and M > 4 * VEC and M % 64 == 0:
        return 64
    if tuning == "avx2" and M > 40 and M % 16 == 0:
        return 16
    return M


@definer("matmul", target="llvm")
def matmul(K: int, M: int, epilogue: tuple = (), extras: tuple = (),
           tuning: str = "default", amx: bool = False, dot_bf16: bool = False, K2: int = 0,
           x_order: bool = False, round_x: bool = False):
    """out[i, j] = epilogue(sum_k x[i, k] * w[k, j]), R rows at a time: each row of w
    loaded serves R rows of x, whose sums stay in registers (the row-at-a-time schedule
    loads a row of w per multiply-add).  Rows past n in the last group repeat row n - 1
    and are not stored.  The rows of the group ``MM_AHEAD_BYTES`` ahead (in x) are
    prefetched, x's to read (``MM_INPUT_LOCALITY``) and the output's to write (a group
    stores its rows in a burst after its sums, and each store missed waiting for its
    line), a share of their lines every ``MM_SHARE_K`` steps of k (``_prefetch_share``).
    Asked for all at once before a group's sums, 8 KB ahead, they were partly dropped:
    arxiv-size rows, Intel Xeon, 2 threads, 15 interleaved calls each after 256 MB of
    other writes, 128 -> 32 7.2 -> 5.8 ms (read back to back 6.1 -> 4.4, MKL's GEMM rate),
    128 -> 128 24.0 -> 17.5, 128 -> 384 66 -> 50, 32 -> 32 2.2 -> 2.1, 32 -> 40 and 40 ->
    32 4% less; no prefetches: 10.2 for 128 -> 32.  Training steps there took as long as
    before (a step's inputs stay in that VM's 480 MB L3).  Prefetching no output line took
    32 -> 32 2.7 -> 1.9 ms before.
    None (the generic kernel, scheduled) where that is faster.  With x stored as bfloat16
    on a CPU with AMX tiles: the tile kernel (``amx_kernels.py``), on one with AVX-512
    BF16 but no tiles the dot-product kernel (``dot_bf16_kernels.py``); both name their
    arguments as this one does (the precision pass asks for them by name).  ``round_x``
    (``--precision bf16`` with ``--prefer memory``): x stays float32 and the dot-product
    kernel rounds its rows as it reads them, as a bfloat16 copy of x would have been
    rounded; elsewhere the float32 product.

    ``K2``: a second product ``x2 @ w2`` (x2 [n, K2], w2 [K2, M]) summed into the same
    registers before the epilogue (``passes/fuse_epilogues.py``: GraphSAGE's
    ``lin_l(mean) + lin_r(x)``), so neither product's rows are stored and read back; None
    where the row groups do not take either product (lowering then runs them apart).

    ``x_order`` (float32, one product): x [nx, K] holds its rows in another order, node
    features where the caller keeps them (``caller_order.py``): row j of x is row
    ``rows[j]`` of the product (none where that is n or more), so x is read in order and
    the narrower output rows are written out of it (gathering x's rows instead took
    128 -> 32 on arxiv-size rows, the training mask's 60% first, 6.7 -> 9.0 ms on the AMD
    EPYC Zen 4: the hardware's prefetches fetched the rows skipped in each part); in
    groups of one row where groups do not pay (the scheduled kernel reads no index)."""
    R = _matmul_rows(K, M, tuning)
    if x_order and not K2:
        R = R or 1
    if R is None or K2 and (x_order or _matmul_rows(K2, M, tuning) is None):
        return None
    if amx and not K2 and not x_order and stored_bf16("x") and amx_kernels.supported(K, M):
        return amx_kernels.matmul_amx(K, M, epilogue, extras)
    if (dot_bf16 and not x_order and (stored_bf16("x") or round_x)
            and dot_bf16_kernels.supported(K, M)
            and (not K2 or stored_bf16("x2") and dot_bf16_kernels.supported(K2, M))):
        return dot_bf16_kernels.matmul_dot(K, M, epilogue, extras, K2,
                                           MM_INPUT_LOCALITY.get(tuning, 3))
    TM = _matmul_cols(M, tuning)
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul")
            T.func_attr({"tirx.noalias": True})
            nx = tirx.Var("nx", "int64") if x_order else None
            n, products, extra, out = product_args(K, M, extras, K2, nx)
            rows = arg("rows", (nx,), "int64") if x_order else None
            nx = n if nx is None else nx
            ahead = max(1, MM_AHEAD_BYTES // (R * (K + K2) * 4))  # groups
            steps = [Kp // min(MM_SHARE_K, Kp) for _, _, Kp in products]  # shares per tile
            shares = (M // TM) * sum(steps)
            loc = MM_INPUT_LOCALITY.get(tuning, 3)
            reads = [(x, Kp, False, loc) for x, _, Kp in products]
            written = (out, M, True) if rows is None else \
                (out, M, True, 3, lambda j: tirx.max(tirx.min(rows[j], n - 1), 0))
            with T.parallel(0, (nx + R - 1) // R) as g:
                acc = [_scratch((TM,)) for _ in range(R)]

                def k_step(x, w, k, t):
                    for r in range(R):
                        a = bound(x[tirx.min(g * R + r, nx - 1), k])
                        _features(TM, lambda j, r=r, a=a: T.buffer_store(
                            acc[r], acc[r][j] + a * w[k, t * TM + j], [j]))
                with T.serial(0, M // TM) as t:
                    for r in range(R):
                        _features(TM, lambda j, r=r: T.buffer_store(acc[r], tirx.const(0.0, f32),
                                                                    [j]))
                    first = 0  # this product's first share of the tile's
                    for (x, w, Kp), count in zip(products, steps):
                        KS = min(MM_SHARE_K, Kp)
                        with T.serial(0, count) as s:
                            _prefetch_share(reads + [written], (g + ahead) * R, R, nx,
                                            t * sum(steps) + first + s, shares)
                            with T.serial(0, KS) as k:
                                k_step(x, w, s * KS + k, t)
                        if Kp % KS:
                            with T.serial(Kp - Kp % KS, Kp) as k:
                                k_step(x, w, k, t)
                        first += count
                    for r in range(R):
                        with _if(g * R + r < nx):
                            i = g * R + r if rows is None else bound(rows[g * R + r])

                            def store(j, r=r, i=i):
                                c = t * TM + j
                                res = epi.apply(epilogue, acc[r][j],
                                                lambda e: extra[e][epi.index(extras[e], i, c)])
                                T.buffer_store(out, res, [i, c])
                            if rows is None:
                                _features(TM, store)
                            else:
                                with _if(i < n):  # a row past the product's (loss rows)
                                    _features(TM, store)
    return ib.get()


# weight-gradient register tiles per tuning: (widest result kept whole, column tiles of
# wider ones, floats per vector register, accumulator registers a tile may hold)
_TN_TILES = {"default": (64, (64, 32), VEC, 16), "avx2": (40, (32, 16), 8, 10)}


def _matmul_tn_tile(K: int, M: int, tuning: str = "default") -> tuple[int, int] | None:
    """(rows, columns) of the [K, M] result a register tile holds, dividing K and M, or
    None where the scheduled generic kernel is kept (wide outputs no 64 or 32 columns
    divide).  With 32 vector registers, sixteen 16-float accumulators: 8 x 32 or 4 x 64
    columns at 128 x 128.  ``avx2`` (16 registers of 8 floats), at most ten 8-float
    accumulators (AMD EPYC Zen 3, arxiv-size rows, 2 threads, interleaved runs: 128 x 32
    32.6 -> 19.7 ms with 2 x 32 (the 8 x 32 tile spilled), 32 x 32 16.2 -> 5.7, 32 x 40
    15.6 -> 5.5 with 2 x 40, 128 x 128 135 -> 69 with 2 x 32)."""
    whole, tiles, width, accumulators = _TN_TILES["avx2" if tuning == "avx2" else "default"]
    TB = M if M <= whole else next((t for t in tiles if M % t == 0), None)
    if TB is None:
        return None
    vectors = -(-TB // width)  # accumulators per result row
    return next(t for t in (8, 4, 2, 1) if K % t == 0 and t * vectors <= accumulators), TB


@definer("matmul_tn", target="llvm")
def matmul_tn(K: int, M: int, gpu: bool = False, chunks: int = 16, amx: bool = False,
              tuning: str = "default", sum_row: bool = False, dot_bf16: bool = False,
              x_order: bool = False):
    """out = x.T @ y (x: [n, K], y: [n, M]), weight gradients: ``chunks`` row ranges in
    parallel, each into its own partial [K, M] sum, added up at the end (deterministic).
    A range is walked in blocks of ``TN_BLOCK`` rows; for each TA x TB tile of the result,
    the block's rows stream past an accumulator held in registers, so the block (in L1) is
    read from memory once, not once per tile: the scheduled generic kernel swept each
    range's rows once per tile (128 x 32 on arxiv-synth: 14.6 ms).  The next block's rows
    are prefetched while one is added, each tile asking for its share of their lines
    every ``TN_SHARE_ROWS`` rows (``_prefetch_share``).  With x or y stored as bfloat16 on
    a CPU with AMX tiles: the tile kernel (``amx_kernels.py``), which has no ``sum_row``;
    on one with AVX-512 BF16 but no tiles, the dot-product kernel
    (``dot_bf16_kernels.py``).
    ``sum_row``: a last row of y's column sums (a bias gradient), added while the block is
    in L1.  ``x_order``: x [nx, K] holds its rows in another order, row j of x being row
    ``rows[j]`` of y (none where that is n or more), as ``matmul``'s; x is read in order,
    y's narrower rows out of it; with the register tiles only."""
    if gpu:
        return None
    if dot_bf16 and not x_order and (stored_bf16("x") or stored_bf16("y")):  # any shape
        return dot_bf16_kernels.matmul_tn_dot(K, M, chunks, sum_row)
    tile = _matmul_tn_tile(K, M, tuning)
    if tile is None:
        return None
    if (amx and not sum_row and not x_order and (stored_bf16("x") or stored_bf16("y"))
            and amx_kernels.tn_tiles(K, M)):
        return amx_kernels.matmul_tn_amx(K, M, chunks)
    TA, TB = tile
    f32, i64 = "float32", "int64"
    P, R = chunks, K + int(sum_row)
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul_tn")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", i64)
            nx = tirx.Var("nx", i64) if x_order else n
            x, y, out = _args([("x", (nx, K), f32), ("y", (n, M), f32), ("out", (R, M), f32)])
            index = arg("rows", (nx,), i64) if x_order else None

            def y_rows(j, body):
                """``body(i)`` for row i of y of x's row j, where it has one."""
                if index is None:
                    body(j)
                    return
                i = bound(index[j])
                with _if(i < n):
                    body(i)
            part = T.alloc_buffer((P, R, M), f32)
            with T.parallel(0, P) as p:
                lo, hi = _row_range(nx, p, P)
                with T.serial(0, R) as a:
                    _features(M, lambda j: T.buffer_store(part, tirx.const(0.0, f32), [p, a, j]))
                y_row = None if index is None else \
                    (lambda j: tirx.max(tirx.min(index[j], n - 1), 0))

                def tiles(first, rows, ahead=None):
                    """Add rows first .. first + rows - 1 into the partial sum, tile by tile,
                    prefetching the ``TN_BLOCK`` rows from ``ahead`` on."""
                    with T.grid(K // TA, M // TB) as (a0, b0):
                        acc = [_scratch((TB,)) for _ in range(TA)]
                        for t in range(TA):
                            _features(TB, lambda j, t=t: T.buffer_store(
                                acc[t], part[p, a0 * TA + t, b0 * TB + j], [j]))

                        def add_row(xi):
                            def add(i):
                                for t in range(TA):
                                    v = bound(x[xi, a0 * TA + t])
                                    _features(TB, lambda j, t=t, v=v: T.buffer_store(
                                        acc[t], acc[t][j] + v * y[i, b0 * TB + j], [j]))
                            y_rows(xi, add)
                        if ahead is None:
                            with T.serial(0, rows) as r:
                                add_row(first + r)
                        else:
                            per = TN_BLOCK // TN_SHARE_ROWS
                            with T.serial(0, per) as c:
                                _prefetch_share([(x, K), (y, M, False, 3, y_row)], ahead,
                                                TN_BLOCK, nx,
                                                (a0 * (M // TB) + b0) * per + c,
                                                (K // TA) * (M // TB) * per)
                                with T.serial(0, TN_SHARE_ROWS) as r:
                                    add_row(first + c * TN_SHARE_ROWS + r)
                        for t in range(TA):
                            _features(TB, lambda j, t=t: T.buffer_store(
                                part, acc[t][j], [p, a0 * TA + t, b0 * TB + j]))
                    if sum_row:
                        with T.serial(0, M // TB) as b0:
                            acc = _scratch((TB,))
                            _features(TB, lambda j: T.buffer_store(acc, part[p, K, b0 * TB + j],
                                                                   [j]))
                            with T.serial(0, rows) as r:
                                y_rows(first + r, lambda i: _features(TB, lambda j: T.buffer_store(
                                    acc, acc[j] + y[i, b0 * TB + j], [j])))
                            _features(TB, lambda j: T.buffer_store(part, acc[j],
                                                                   [p, K, b0 * TB + j]))
                full = T.Bind((hi - lo) // TN_BLOCK)
                with T.serial(0, full) as blk:
                    tiles(lo + blk * TN_BLOCK, TN_BLOCK, ahead=lo + (blk + 1) * TN_BLOCK)
                tiles(lo + full * TN_BLOCK, hi - lo - full * TN_BLOCK)
            with T.parallel(0, R) as a:
                _features(M, lambda j: T.buffer_store(out, part[0, a, j], [a, j]))
                with T.serial(1, P) as q:
                    _features(M, lambda j: T.buffer_store(out, out[a, j] + part[q, a, j], [a, j]))
    return ib.get()




@definer("colsum", target="llvm")
def colsum(F: int, chunks: int = CHUNKS, gpu: bool = False, expr: tuple | None = None,
           in_shapes: tuple | None = None, shape: tuple | None = None):
    """out[f] = sum_i x[i, f] over the rows, or of a fused elementwise ``expr`` (as the
    generic kernel): ``chunks`` row ranges in parallel, each row added whole into its
    range's vector accumulator, so rows are read once and in order; the generic kernel,
    scheduled, walks each range once per vector of columns (arxiv-synth, three interleaved
    runs: 128 columns 6.0-9.9 -> 2.2-3.5 ms, GAT's sum(ds * h, 0) over [N, 4, 32] 6.0-6.6
    -> 2.1-3.2 ms, 32 columns the same)."""
    if gpu:
        return None
    P, f32, i64 = chunks, "float32", "int64"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("colsum")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", i64)
            value, _ = colsum_rows(F, n, expr, in_shapes, shape)
            out = arg("out", (F,), f32)
            part = T.alloc_buffer((P, F), f32)
            with T.parallel(0, P) as p:
                lo, hi = _row_range(n, p, P)
                _features(F, lambda f: T.buffer_store(part, tirx.const(0.0, f32), [p, f]))
                with T.serial(0, hi - lo) as r:
                    i = lo + r
                    _features(F, lambda f, i=i: T.buffer_store(part, part[p, f] + value(i, f),
                                                               [p, f]))
            _features(F, lambda f: T.buffer_store(out, part[0, f], [f]))
            with T.serial(1, P) as q:
                _features(F, lambda f: T.buffer_store(out, out[f] + part[q, f], [f]))
    return ib.get()


@definer("feed_rows", target="llvm")
def feed_rows(F: int):
    """out = x, for node features handed over as the caller's array (read in place: any
    4-byte alignment, which the generic kernels do not accept), and in ``bad[p]`` the
    largest exponent field over row range p: NONFINITE (all its bits) exactly when
    the range holds a NaN or an infinity (integer bits, so no floating-point rewrite
    can fold the test away).  The features' check and copy in one parallel pass."""
    return _scan_rows("feed_rows", F, copy=True)


@definer("check_rows", target="llvm")
def check_rows(F: int):
    """``feed_rows`` without the copy: the check of features the kernels then read in the
    caller's array itself (one read of them instead of a read, a write and a read)."""
    return _scan_rows("check_rows", F, copy=False)


def _scan_rows(name: str, F: int, copy: bool):
    f32, i32, i64 = "float32", "int32", "int64"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name(name)
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", i64)
            out_arg = [("out", (n, F), f32)] if copy else []
            x, *out, bad = _args([("x", (n, F), f32), *out_arg, ("bad", (FEED_PARTS,), i32)])
            exponent = tirx.const(NONFINITE, i32)
            with T.parallel(0, FEED_PARTS) as p:
                acc = _scratch((F,), i32)
                _features(F, lambda f: T.buffer_store(acc, tirx.const(0, i32), [f]))
                lo, hi = _row_range(n, p, FEED_PARTS)
                with T.serial(0, hi - lo) as r:
                    def scan(f, i=lo + r):
                        if copy:
                            T.buffer_store(out[0], x[i, f], [i, f])
                        bits = tirx.reinterpret(i32, x[i, f]) & exponent
                        T.buffer_store(acc, tirx.max(acc[f], bits), [f])
                    _features(F, scan)
                T.buffer_store(bad, tirx.const(0, i32), [p])
                with T.serial(0, F) as f:
                    T.buffer_store(bad, tirx.max(bad[p], acc[f]), [p])
    return ib.get()


@definer("zero_rows", target="llvm")
def zero_rows(F: int):
    """out[i, :] = 0 for the rows i >= l past ``head``'s (l, F): ``head`` is a view of
    ``out``'s first l rows, passed for its length only (never read).  A gradient computed
    on the rows the loss reads is zero on the others (``codegen/loss_rows.py``)."""
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("zero_rows")
            l, n = (tirx.Var(name, "int64") for name in ("l", "n"))
            _, out = _args([("head", (l, F), "float32"), ("out", (n, F), "float32")])
            zero = tirx.const(0.0, out.dtype)
            with T.parallel(0, FEED_PARTS) as p:
                lo, hi = _row_range(n - l, p, FEED_PARTS)
                with T.serial(0, hi - lo) as r:
                    _features(F, lambda f, i=l + lo + r: T.buffer_store(out, zero, [i, f]))
    return ib.get()


@definer("match_rows", target="llvm")
def match_rows(F: int):
    """Whether x still holds the nonzeros the sparse-feature kernels were bound with
    (``indptr``, ``indices``, ``values``: CSR of x at bind time, nonzero values): 1 in
    ``flags[P + p]`` unless every bound entry of row range p holds its value in x and x
    has no other nonzero there (its count of nonzeros equals theirs), and in
    ``flags[p]`` the largest exponent field as in ``feed_rows`` (NONFINITE: a NaN or an
    infinity).  One read of x, with the work of the check alone plus a gather of the
    bound positions from the row just read."""
    f32, i32, i64 = "float32", "int32", "int64"
    P = FEED_PARTS
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("match_rows")
            T.func_attr({"tirx.noalias": True})
            n, nnz = tirx.Var("n", i64), tirx.Var("nnz", i64)
            x, indptr, indices, values, flags = _args([
                ("x", (n, F), f32), ("indptr", (n + 1,), i64), ("indices", (nnz,), i32),
                ("values", (nnz, 1), f32), ("flags", (2 * P,), i32)])
            exponent = tirx.const(NONFINITE, i32)
            zero, one = tirx.const(0, i32), tirx.const(1, i32)
            with T.parallel(0, P) as p:
                acc = _scratch((F,), i32)
                count = _scratch((F,), i32)
                diff = _scratch((1,), i32)
                total = _scratch((1,), i64)
                _features(F, lambda f: T.buffer_store(acc, zero, [f]))
                _features(F, lambda f: T.buffer_store(count, zero, [f]))
                T.buffer_store(diff, zero, [0])
                lo, hi = _row_range(n, p, P)
                with T.serial(0, hi - lo) as r:
                    i = lo + r

                    def scan(f):
                        v = tirx.Cast(f32, x[i, f])  # x may be stored as bfloat16
                        bits = tirx.reinterpret(i32, v) & exponent
                        T.buffer_store(acc, tirx.max(acc[f], bits), [f])
                        T.buffer_store(count, count[f] + tirx.Select(
                            v != tirx.const(0.0, f32), one, zero), [f])
                    _features(F, scan)
                    with T.serial(indptr[i], indptr[i + 1]) as k:
                        T.buffer_store(diff, tirx.max(diff[0], tirx.Select(
                            tirx.Cast(f32, x[i, indices[k]]) != values[k, 0], one, zero)), [0])
                T.buffer_store(total, tirx.const(0, i64), [0])
                T.buffer_store(flags, zero, [p])
                with T.serial(0, F) as f:
                    T.buffer_store(flags, tirx.max(flags[p], acc[f]), [p])
                    T.buffer_store(total, total[0] + tirx.Cast(i64, count[f]), [0])
                T.buffer_store(flags, tirx.max(diff[0], tirx.Select(
                    total[0] != indptr[hi] - indptr[lo], one, zero)), [P + p])
    return ib.get()


CE_PARTS = 64      # row ranges of the loss kernels, each with its own partial sums
CE_PARALLEL = 1 << 16  # logits from which the ranges run in parallel: below, waking the
                       # thread pool cost more than the rows (Cora: 0.03 -> 0.10 ms)
KEEP_CLASSES = 256  # the fused loss keeps a row's exponentials on the stack up to here
CE_MIN_CLASSES = VEC  # fewer classes fill a fraction of the vector lanes: the generic
                      # kernels win there (Cora's 7, 0.02 vs 0.07 ms)


def _softmax_row(z, i, C: int, acc, keep=None):
    """Max and sum of exp(z[i] - max) of row i, in vector registers: ``acc`` (a local
    buffer of VEC floats, only ever read and written whole, which LLVM keeps in a
    register) combines the VEC-wide pieces lane-wise, then it and the narrower tail are
    folded (``_fold``).  Arxiv-size logits, 40 classes, Intel Xeon: the loss kernel took
    1.98 ms folding through a local buffer, 1.66 in registers.  ``keep`` (a local buffer
    of C floats): the exponentials are also stored there, as they are summed."""
    main = C - C % VEC
    whole = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), VEC)
    # bfloat16 logits widened by hand from their bits: TVM's legalization of a widened
    # bfloat16 vector load gave wrong values here
    raw = T.decl_buffer(z.shape, "uint16", data=z.data) if stored_bf16("z") else None

    def columns(c0, lanes):
        """Column c0, or the ``lanes`` columns from c0 as one vector index."""
        return c0 if lanes == 1 else tirx.Ramp(tirx.Cast("int64", c0), tirx.const(1, "int64"),
                                               lanes)

    def load(c0, lanes):
        x = "" if lanes == 1 else f"x{lanes}"
        at = columns(c0, lanes)
        if raw is None:
            return z[i, at]
        bits = tirx.Cast("uint32" + x, raw[i, at]) << tirx.const(16, "uint32")
        return tirx.reinterpret("float32" + x, bits)

    def over(value, op):
        parts = []
        if main:
            T.buffer_store(acc, value(0, VEC), [whole])
            with T.serial(1, main // VEC) as k:
                T.buffer_store(acc, op(acc[whole], value(k * VEC, VEC)), [whole])
            parts.append(_fold(acc[whole], VEC, op))
        if main < C:
            parts.append(_fold(value(main, C - main), C - main, op))
        out = parts[0]
        for v in parts[1:]:
            out = op(out, v)
        return T.Bind(out)

    def exps(c0, lanes):
        e = fast_exp(load(c0, lanes) - (mx if lanes == 1 else tirx.Broadcast(mx, lanes)))
        if keep is None:
            return e
        at = columns(c0, lanes)
        T.buffer_store(keep, e, [at])
        return keep[at]
    mx = over(load, tirx.max)
    sm = over(exps, lambda a, b: a + b)
    return mx, sm


def _rows_in_parts(n, C: int, body) -> None:
    """``body(p, i, acc)`` for every row i, in CE_PARTS row ranges p in parallel when there
    are many logits, else in one range (p = 0); ``acc`` is the range's VEC-float local
    buffer for ``_softmax_row``."""
    i64 = "int64"

    def rows(p, lo, hi):
        acc = _scratch((VEC,))
        with T.serial(0, hi - lo) as r:
            body(p, lo + r, acc)
    with T.If(n * tirx.const(C, i64) >= tirx.const(CE_PARALLEL, i64)):
        with T.Then():
            with T.parallel(0, CE_PARTS) as p:
                rows(p, *_row_range(n, p, CE_PARTS))
        with T.Else():
            rows(0, tirx.const(0, i64), n)


def _valid(m, y, i):
    return tirx.all(m[i] != tirx.const(0.0, "float32"), y[i] >= 0)


@definer("cross_entropy", target="llvm")
def cross_entropy(C: int):
    """The masked mean cross-entropy and each counted row's log-sum-exp (as the generic
    kernel), rows in parallel ranges: each row's max and sum of exponentials in vector
    registers (``_softmax_row``)."""
    if C < CE_MIN_CLASSES:
        return None
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("cross_entropy")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            z, y, m, lse, out = _args([("z", (n, C), f32), ("y", (n,), "int32"),
                                       ("m", (n,), f32), ("lse", (n,), f32), ("out", (), f32)])
            loss = T.alloc_buffer((CE_PARTS,), f32)
            count = T.alloc_buffer((CE_PARTS,), f32)
            with T.serial(0, CE_PARTS) as q:
                T.buffer_store(loss, tirx.const(0.0, f32), [q])
                T.buffer_store(count, tirx.const(0.0, f32), [q])

            def row(p, i, acc):
                T.buffer_store(count, count[p] + m[i], [p])
                with _if(_valid(m, y, i)):
                    mx, sm = _softmax_row(z, i, C, acc)
                    T.buffer_store(lse, mx + tirx.log(sm), [i])
                    T.buffer_store(loss, loss[p] + m[i] * (lse[i] - z[i, y[i]]), [p])
            _rows_in_parts(n, C, row)
            total = T.alloc_buffer((2,), f32)
            T.buffer_store(total, tirx.const(0.0, f32), [0])
            T.buffer_store(total, tirx.const(0.0, f32), [1])
            with T.serial(0, CE_PARTS) as q:
                T.buffer_store(total, total[0] + loss[q], [0])
                T.buffer_store(total, total[1] + count[q], [1])
            T.buffer_store(out, total[0] / total[1], [])
    return ib.get()


def _mask_sum(m, n):
    """A local buffer holding sum(m) over the n rows (one pass over n floats: cheaper than
    a thread launch)."""
    f32 = "float32"
    count = T.alloc_buffer((1,), f32)
    T.buffer_store(count, tirx.const(0.0, f32), [0])
    with T.serial(0, n) as i:
        T.buffer_store(count, count[0] + m[i], [0])
    return count


def _gradient_row(out, z, y, i, C: int, top, s) -> None:
    """Row i of the loss gradient, (exp(z[i] - top) - onehot(y[i])) * s."""
    if stored_bf16("out"):  # rounded once: the label's 1 subtracted first
        one = tirx.const(1.0, "float32")
        _features(C, lambda c: T.buffer_store(out, (fast_exp(z[i, c] - top) - tirx.Select(
            c == y[i], one, one * 0)) * s, [i, c]))
    else:
        _features(C, lambda c: T.buffer_store(out, fast_exp(z[i, c] - top) * s, [i, c]))
        T.buffer_store(out, out[i, y[i]] - s, [i, y[i]])


def _zero_row(out, i, C: int) -> None:
    """Row i of the loss gradient where the loss does not count the row."""
    zero = tirx.const(0.0, "float32")
    if stored_bf16("out"):  # TVM 0.27 cannot store a bfloat16 constant
        with T.serial(0, C) as c:  # vector: a scalar loop, for LLVM
            T.buffer_store(out, zero, [i, c])
    else:
        _features(C, lambda c: T.buffer_store(out, zero, [i, c]))


@definer("cross_entropy_grad", target="llvm")
def cross_entropy_grad(C: int):
    """dz = dy * (exp(z - lse) - onehot(y)) * m / sum(m) (as the generic kernel), rows in
    parallel ranges: one pass of exponentials over the logits, no row max or sum."""
    if C < CE_MIN_CLASSES:
        return None
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("cross_entropy_grad")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            dy, z, y, m, lse, out = _args([("dy", (), f32), ("z", (n, C), f32),
                                           ("y", (n,), "int32"), ("m", (n,), f32),
                                           ("lse", (n,), f32), ("out", (n, C), f32)])
            scale = T.Bind(dy[()] / _mask_sum(m, n)[0])

            def row(p, i, _acc):
                with T.If(_valid(m, y, i)):
                    with T.Then():
                        _gradient_row(out, z, y, i, C, bound(lse[i]), T.Bind(m[i] * scale))
                    with T.Else():
                        _zero_row(out, i, C)
            _rows_in_parts(n, C, row)
    return ib.get()


@definer("cross_entropy_fused", target="llvm")
def cross_entropy_fused(C: int, dot_bf16: bool = False):
    """The masked mean cross-entropy and its gradient dz = dy * (softmax(z) - onehot(y)) *
    m / sum(m) in one pass over the logits (``passes/fuse_loss_grad.py``): each counted
    row's max, then its exponentials, kept in a local row as they are summed
    (``_softmax_row``), its loss term, then its gradient, the kept exponentials scaled.
    Apart, the two kernels read the logits twice, the log-sum-exps once more, and computed
    the exponentials twice (arxiv-synth, 40 classes, AMD EPYC, medians of 25: 5.4 -> 3.1
    ms).  Beyond KEEP_CLASSES classes the exponentials are computed again for the
    gradient, as the gradient kernel does.  A bfloat16 gradient's values are rounded once,
    the label's share subtracted first (bfloat16 logits and gradient, arxiv-synth, Intel
    Xeon, medians of 30: 3.0 ms computing the exponentials again, 2.05 keeping them).  The
    gradient may be written over the logits (lowering offers them in place) although LLVM
    is told the arguments do not alias, so a row is read whole, its label's logit
    included, before anything is written to it (a version that kept the exponentials in
    the gradient's row and read the label's logit later got it overwritten).  On a CPU
    with AVX-512 BF16 (``dot_bf16``) the kept row is scaled in place and rounded by the
    CPU's conversion instruction (``dot_bf16_kernels.store_rounded``)."""
    f32 = "float32"
    keep = C <= KEEP_CLASSES
    rounds = dot_bf16 and keep and stored_bf16("out")
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("cross_entropy_fused")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            dy, z, y, m, loss_out, out = _args([
                ("dy", (), f32), ("z", (n, C), f32), ("y", (n,), "int32"), ("m", (n,), f32),
                ("loss", (), f32), ("out", (n, C), f32)])
            count = _mask_sum(m, n)
            scale = T.Bind(dy[()] / count[0])
            loss = T.alloc_buffer((CE_PARTS,), f32)
            with T.serial(0, CE_PARTS) as q:
                T.buffer_store(loss, tirx.const(0.0, f32), [q])

            def row(p, i, acc):
                e = _scratch((C,)) if keep else None
                with T.If(_valid(m, y, i)):
                    with T.Then():
                        mx, sm = _softmax_row(z, i, C, acc, keep=e)
                        top = T.Bind(mx + tirx.log(sm))
                        # the label's logit is read, and the row's loss term added, before
                        # the row is written: the gradient may be written over the logits
                        T.buffer_store(loss, loss[p] + m[i] * (top - z[i, y[i]]), [p])
                        s = T.Bind(m[i] * scale)
                        if e is None:
                            _gradient_row(out, z, y, i, C, top, s)
                        elif stored_bf16("out"):  # rounded once: the label's s first
                            r = T.Bind(s / sm)
                            label = T.Bind(y[i])

                            def grad(c):
                                return e[c] * r - tirx.Select(c == label, s, s * 0)
                            if rounds:
                                dot_bf16_kernels.store_rounded(out, i, e, C, grad)
                            else:
                                _features(C, lambda c: T.buffer_store(out, grad(c), [i, c]))
                        else:
                            r = T.Bind(s / sm)
                            _features(C, lambda c: T.buffer_store(out, e[c] * r, [i, c]))
                            T.buffer_store(out, out[i, y[i]] - s, [i, y[i]])
                    with T.Else():
                        _zero_row(out, i, C)
            with dot_bf16_kernels.importing_round(rounds):
                _rows_in_parts(n, C, row)
            total = T.alloc_buffer((1,), f32)
            T.buffer_store(total, tirx.const(0.0, f32), [0])
            with T.serial(0, CE_PARTS) as q:
                T.buffer_store(total, total[0] + loss[q], [0])
            T.buffer_store(loss_out, total[0] / count[0], [])
    return ib.get()


# the tile kernels the products above hand over to build on this module's helpers
from gcomp.codegen import amx_kernels, dot_bf16_kernels  # noqa: E402
