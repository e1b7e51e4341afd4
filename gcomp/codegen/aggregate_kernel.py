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
[w (float32, nnz x WH)], x (float32, m x H*C), extras..., [tasks, hub (the GPU's hub
split)], out (float32, n x H*C).
"""

from __future__ import annotations

from contextlib import contextmanager

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.fastmath import fast_exp
from gcomp.codegen.kernels import arg, bound, definer, env_knob, stored_bf16
from gcomp.codegen.rng_expr import keep

NEG_INF = -3.4028234663852886e38
# Edges per step of the GPU aggregation's loop (the split form of csr_agg:
# ``edge_groups``).  With one edge per step,
# nvcc unrolled the loop by 4 and left up to 3 edges to a remainder loop whose every
# edge waited for its index load and then its row load: the remainder was most of an
# arxiv-size row's work (7 edges on average).  A group keeps the loads of its edges in
# flight together; the group's padding rereads the last edge, cached.  8 rather than 4:
# the hub tasks' kernel (128-edge tasks) 0.039 -> 0.029 ms at 32 features, 0.042 ->
# 0.034 at 128, on an H200 (2026-11-27, arxiv-size SpMM); 16 was slower than 8.
EDGE_GROUP = 8
EDGE_GROUP_ENV = "GCOMP_CUDA_EDGE_GROUP"  # a tuning knob (docs/cuda.md): edges per step
# Partials per step of a hub row's merge (csr_agg's split form), for rows narrower than
# ``WIDE_ROW`` features.  One per step, each waited for its load from L2: the
# arxiv-size hub of 22,897 edges merged its 179 partials in most of the row kernel's
# 0.053 ms at 32 features (0.127 ms with 358, at 64-edge tasks); 8 a step took it to
# 0.030.  At 128 features (a warp per row) the merge hid behind the row kernel's other
# traffic, and grouping it made the kernel slower (0.089 -> 0.106 ms), so wide rows
# merge one partial a step.
MERGE_GROUP = 8
WIDE_ROW = 128


def _finish(reduce: str, acc, deg):
    """Applied to an accumulated row: mean scaling, and 0 (not -inf) for an empty max.
    The mean multiplies by the degree's reciprocal, one scalar division per row, where
    dividing each value put vector divisions between the row's sums and its store (CPU,
    32-wide bfloat16 rows of arxiv-synth, AMD EPYC Zen 4, interleaved: 2.44 -> 2.16 ms and
    2.91 -> 2.57; float32 3.52 -> 3.36; inside a GraphSAGE step, whose aggregations read
    rows just written, no difference showed); within a rounding of the quotient."""
    if reduce == "mean":
        return acc * (tirx.const(1.0, "float32")
                      / tirx.Cast("float32", tirx.max(deg, tirx.const(1, "int64"))))
    if reduce == "max":
        return tirx.Select(deg > tirx.const(0, "int64"), acc, tirx.const(0.0, "float32"))
    return acc


def edge_groups(lo, hi, load, fold, group: int | None = None) -> None:
    """The GPU forms' edge loop over edges lo..hi, ``group`` (default ``EDGE_GROUP``) at a
    time: ``load(u, j)`` for every edge of a group first (storing what it reads into
    registers; j is clamped to the last edge, so loads past the end reread it and no branch
    guards them), then ``fold(u, valid)`` for each in edge order (``valid``: the edge is
    one of lo..hi)."""
    if group is None:
        group = env_knob(EDGE_GROUP_ENV, EDGE_GROUP)
    with T.serial(0, (hi - lo + group - 1) // group) as g:
        IRBuilder.name("g", g)
        edges = [lo + g * group + u for u in range(group)]
        for u, j in enumerate(edges):
            load(u, tirx.min(j, hi - 1))
        for u, j in enumerate(edges):
            fold(u, j < hi)


def merge_partials(lo, hi, load, add, F: int) -> None:
    """``add(load(q))`` for a hub row's partials q = lo..hi in order: ``MERGE_GROUP``
    loads in flight at a time, or one a step for rows of ``WIDE_ROW`` features or more."""
    if F >= WIDE_ROW:
        with T.serial(lo, hi) as q:
            add(load(q))
        return
    parts = {}

    def load_part(u, q):
        parts[u] = T.Bind(load(q))

    def fold(u, ok):
        with T.If(ok):
            with T.Then():
                add(parts[u])
    edge_groups(lo, hi, load_part, fold, MERGE_GROUP)


@definer("csr_agg")
def csr_agg(reduce: str, H: int, C: int, weight: str, indirect: bool = False,
            epilogue: tuple = (), extras: tuple = (), split: bool = False):
    """``split`` (the GPU's form, ``gcomp/codegen/hub_split.py``): two more arguments
    before ``out``, ``tasks`` (int64, t x 3: edge ranges of at most ``graph.task_edges``
    edges cut from the rows longer than that, and their row) and ``hub`` (int64, n+1: row i's tasks are
    hub[i] .. hub[i+1], none for the other rows).  A first nest reduces each task's
    edges into a partial row (``part``, t x F); the row nest then reduces a hub row's
    partials, and the edges of every other row itself, so a hub's work is spread over
    many threads instead of serializing one warp (arxiv-size power-law graphs have rows
    of 22,897 edges).  Fixed tasks, fixed order: still deterministic.  Its edge loops
    take ``EDGE_GROUP`` edges per step."""
    F = H * C
    WH = H if weight == "head" else 1
    f32 = "float32"
    init = tirx.const(NEG_INF if reduce == "max" else 0.0, f32)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("csr_agg")
            T.func_attr({"tirx.noalias": True})
            n, m, nnz, t = (tirx.Var(name, "int64") for name in ("n", "m", "nnz", "t"))

            indptr = arg("indptr", (n + 1,), "int64")
            indices = arg("indices", (nnz,), "int32")
            eid = arg("eid", (nnz,), "int64") if indirect and weight != "none" else None
            w = arg("w", (nnz, WH), f32) if weight != "none" else None
            x = arg("x", (m, F), f32)
            extra = [arg(f"e{k}", epi.shape(kind, n, F), f32)
                     for k, kind in enumerate(extras)]
            if split:
                tasks = arg("tasks", (t, 3), "int64")
                hub = arg("hub", (n + 1,), "int64")
            out = arg("out", (n, F), f32)

            def edge_reads(f):
                reads = [indices[0:nnz], x[0:m, f]]
                if w is not None:
                    reads.append(w[0:nnz, 0:WH])
                if eid is not None:
                    reads.append(eid[0:nnz])
                return reads

            def edge_value(j, vh, f):
                val = x[indices[j], f]
                if w is not None:
                    e = eid[j] if eid is not None else j
                    val = w[e, vh if weight == "head" else 0] * val
                return val

            def add(buf, idx, val):
                acc = buf[idx]
                T.buffer_store(buf, tirx.max(acc, val) if reduce == "max" else acc + val, idx)

            def reduce_edges(buf, idx, f, vh, lo, hi):
                if not split:
                    with T.serial(lo, hi) as j:
                        IRBuilder.name("j", j)
                        add(buf, idx, edge_value(j, vh, f))
                    return
                # the group's values bound to variables, not stored in a local array: a
                # schedule that vectorizes the features widens a variable to a vector, a
                # local array it does not (its lanes all stored into one element)
                vals = {}

                def load(u, j):
                    vals[u] = bound(edge_value(j, vh, f))

                def fold(u, ok):  # a branch around registers only, no load in it
                    with T.If(ok):
                        with T.Then():
                            add(buf, idx, vals[u])
                edge_groups(lo, hi, load, fold)

            if split:
                part = T.sblock_alloc_buffer((t, F), f32)
                IRBuilder.name("part", part)
                with lanes_block("task", t, H, C, row="k") as (vk, vh, _, f):
                    T.reads(tasks[vk, 0:2], *edge_reads(f))
                    T.writes(part[vk, f])
                    T.buffer_store(part, init, [vk, f])
                    reduce_edges(part, [vk, f], f, vh, tasks[vk, 0], tasks[vk, 1])
            total = out
            if split and stored_bf16("out"):
                total = T.sblock_alloc_buffer((n, F), f32)
                IRBuilder.name("total", total)
            with lanes_block("row", n, H, C) as (vi, vh, _, f):
                reads = [indptr[vi:vi + 2], *edge_reads(f)]
                # the row sums into its output element, which the schedules keep in
                # registers (the CPU's vectorized rows, the GPU's cache_write); the GPU's
                # output stored as bfloat16 sums into a float32 scratch its schedule keeps
                # in a register instead, so that it is rounded once
                if split:
                    reads += [hub[vi:vi + 2], part[0:t, f]]
                T.reads(*reads)
                T.writes(out[vi, f], *([total[vi, f]] if total is not out else []))
                T.buffer_store(total, init, [vi, f])
                end = indptr[vi + 1]
                if split:  # a hub row sums its tasks' partials and none of its edges
                    merge_partials(hub[vi], hub[vi + 1], lambda q: part[q, f],
                                   lambda v: add(total, [vi, f], v), F)
                    end = tirx.Select(hub[vi + 1] > hub[vi], indptr[vi], end)
                reduce_edges(total, [vi, f], f, vh, indptr[vi], end)
                deg = indptr[vi + 1] - indptr[vi]
                if reduce == "max":  # an empty row's max is 0 (-0.0): its initial value
                    # times 0, not _finish's select, whose condition a vectorizing schedule
                    # broadcasts (TVM 0.27 declares a broadcast condition of CUDA's vectors
                    # with the wrong type); nor a branch storing a constant 0, which TVM
                    # folds into the epilogue as CUDA that takes a literal's address
                    res = total[vi, f] * tirx.Cast(f32, tirx.min(deg, tirx.const(1, "int64")))
                else:
                    res = _finish(reduce, total[vi, f], deg)
                res = epi.apply(epilogue, res, lambda k: extra[k][epi.index(extras[k], vi, f)])
                T.buffer_store(out, res, [vi, f])
    return ib.get()


def cells(buf, idx: list):
    """An accessor of the values ``buf[*idx, k]`` in the kernel being built: ``st(k)``
    loads one, ``st(k, v)`` stores v (the attention kernels' register scratch and partial
    rows)."""
    def st(k, v=None):
        if v is None:
            return buf[(*idx, k)]
        T.buffer_store(buf, v, [*idx, k])
    return st


def drop_factor(perm, j, h, H: int, step, p: float, seed: int):
    """Fused attention's dropout factor of coefficient (edge j, head h): keep / (1 - p)
    from the hash of the element id perm[j] * H + h (``dropout`` of an [E, H] tensor);
    None without dropout."""
    if not p:
        return None
    f32 = "float32"
    return tirx.Select(keep(perm[j] * H + h, step[()], seed, p),
                       tirx.const(1.0 / (1.0 - p), f32), tirx.const(0.0, f32))


def times(v, factor):
    """v * factor, or v when there is no factor."""
    return v if factor is None else v * factor


@contextmanager
def lanes_block(name: str, rows, H: int, C: int, row: str = "i"):
    """A block spatial over (row, head, channel), the nests of the aggregation kernels
    (``rows``: the rows, or the hub tasks, ``row="k"``): yields the axes (row, head,
    channel) and the feature index."""
    with T.grid(rows, H, C) as (i, h, c):
        IRBuilder.name_many([row, "h", "c"], [i, h, c])
        with T.sblock(name):
            vi = T.axis.spatial(rows, i)
            vh = T.axis.spatial(H, h)
            vc = T.axis.spatial(C, c)
            IRBuilder.name_many(["v" + row, "vh", "vc"], [vi, vh, vc])
            yield vi, vh, vc, vh * C + vc


def head_sums(name: str, n, H: int, C: int, lanes, K: int, writes: list, finish) -> None:
    """The last nest of the GPU attention forms: a block per (row, head) adds the K values
    its C lanes left in ``lanes`` [n, F, K] into a local ``tot`` and calls
    ``finish(row, head, tot)``."""
    f32 = "float32"
    with T.grid(n, H) as (i, h):
        with T.sblock(name):
            vi = T.axis.spatial(n, i)
            vh = T.axis.spatial(H, h)
            T.reads(lanes[vi, vh * C:vh * C + C, 0:K])
            T.writes(*writes(vi, vh))
            tot = T.sblock_alloc_buffer((K,), f32, scope="local")
            IRBuilder.name("tot", tot)
            for q in range(K):
                T.buffer_store(tot, tirx.const(0.0, f32), [q])
            with T.serial(0, C) as c:
                for q in range(K):
                    T.buffer_store(tot, tot[q] + lanes[vi, vh * C + c, q], [q])
            finish(vi, vh, tot)


def attention_spec(kind: str, n, m, nnz, H: int, C: int, p: float, extras: tuple = (),
                   t=None) -> list:
    """The arguments of fused attention kernel ``kind``, in order, as (name, shape, dtype):
    ``attention_agg`` and ``attention_grad_dst`` walk in-edges (CSR: ``m`` source rows),
    ``attention_grad_src`` out-edges (CSC: ``m`` destination rows); with dropout (p > 0)
    the edges' canonical ids follow the graph arrays and the step counter the tensors.
    With ``t`` (the GPU's hub split, ``hub_split.py``) the hub tasks (t x 3) and each
    row's tasks (n + 1) come before the output."""
    F, f32 = H * C, "float32"
    by_src = kind == "attention_grad_src"
    spec = [("indptr", (n + 1,), "int64"), ("indices", (nnz,), "int32")]
    spec += [("csc_perm" if by_src else "perm", (nnz,), "int64")] if p else []
    if by_src:
        spec += [("s_src", (n, H), f32), ("x", (n, F), f32), ("dy", (m, F), f32),
                 ("stats", (m, 4 * H), f32)]
    else:
        spec += [("s_src", (m, H), f32), ("s_dst", (n, H), f32), ("x", (m, F), f32)]
        spec += [("dy", (n, F), f32)] if kind == "attention_grad_dst" else []
    spec += [("step", (), "int32")] if p else []
    spec += [(f"e{k}", epi.shape(e, n, F), f32) for k, e in enumerate(extras)]
    spec += [("tasks", (t, 3), "int64"), ("hub", (n + 1,), "int64")] if t is not None else []
    width = {"attention_agg": F, "attention_grad_dst": 4 * H, "attention_grad_src": F + H}
    return spec + [("out", (n, width[kind]), f32)]


def attention_buffers(kind: str, H: int, C: int, p: float, extras: tuple = (),
                      split: bool = False):
    """Declare fused attention kernel ``kind``'s arguments (``attention_spec``) in the
    PrimFunc being built: (buffers by name, n, m, nnz); with ``split``, the number of hub
    tasks ``t`` is the buffers' entry ``"t"``."""
    n, m, nnz, t = (tirx.Var(name, "int64") for name in ("n", "m", "nnz", "t"))
    bufs = {name: arg(name, shape, dt) for name, shape, dt in attention_spec(
        kind, n, m, nnz, H, C, p, extras, t if split else None)}
    if split:
        bufs["t"] = t
    return bufs, n, m, nnz


def leaky(v, slope: float):
    """leaky_relu(v); slope 1 is the identity."""
    if slope == 1.0:
        return v
    return tirx.Select(v > tirx.const(0.0, "float32"), v, v * tirx.const(slope, "float32"))


@definer("attention_agg")
def attention_agg(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0,
                  epilogue: tuple = (), extras: tuple = (), split: bool = False):
    """GAT attention in one kernel (the ``attention_aggregate`` op):

        e_j = leaky_relu(s_src[indices[j], h] + s_dst[i, h])   for in-edges j of row i
        out[i, h, c] = epilogue(sum_j exp(e_j - max e) m_j x[indices[j], h, c] / sum_j exp(...))

    with m_j the dropout factor of the coefficient (1 without dropout).

    Two sweeps over the row's in-edges: the maximum score, then the exponentials, their
    sum and the weighted sum of source rows; no per-edge buffer.  The block is spatial
    over (row, head, channel) like ``csr_agg`` (GPU lanes share a row); the row's
    statistics live in ``stat``, which a schedule puts in registers.

    ``split`` (the GPU's hub split, as ``csr_agg``'s): a first nest runs the same two
    sweeps over each hub task's edges into a partial row with its own maximum and sum
    (``part``, ``pstat``); a hub row then merges its tasks' partials, each rescaled by
    exp(its maximum - the row's), as split-K attention does.

    Arguments: indptr, indices, [perm (nnz), with dropout], s_src (m x H), s_dst (n x H),
    x (m x H*C), [step, with dropout], extras..., [tasks, hub], out (n x H*C).
    """
    f32 = "float32"
    neg_inf, zero = tirx.const(NEG_INF, f32), tirx.const(0.0, f32)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_agg")
            T.func_attr({"tirx.noalias": True})
            b, n, m, nnz = attention_buffers("attention_agg", H, C, p, extras, split)
            indptr, indices, s_src, s_dst, x, out = (b[k] for k in (
                "indptr", "indices", "s_src", "s_dst", "x", "out"))
            perm, step = b.get("perm"), b.get("step")
            extra = [b[f"e{k}"] for k in range(len(extras))]
            drop_reads = [perm[0:nnz], step[()]] if p else []

            def sweeps(i, h, f, lo, hi, st, acc, merge=None):
                """The two sweeps over edges lo..hi of destination i into the maximum
                ``st(0)``, the sum ``st(1)`` and the weighted row ``acc(f)``; ``merge``:
                (partials' range, their maximum, sum and row at q) merged in first."""
                def score(j):
                    return leaky(s_src[indices[j], h] + s_dst[i, h], slope)
                st(0, neg_inf)
                if merge is not None:
                    qlo, qhi, pmax, psum, prow = merge
                    with T.serial(qlo, qhi) as q:
                        st(0, tirx.max(st(0), pmax(q)))
                # one edge per step: the grouped loop of csr_agg's GPU form (edge_groups)
                # made this kernel slower on an H200 (0.62 -> 0.99 ms a call, arxiv-size,
                # bench/results/h200), where it left csr_agg's time unchanged
                with T.serial(lo, hi) as j:
                    st(0, tirx.max(st(0), score(j)))
                st(1, zero)
                acc(f, zero)
                if merge is not None:
                    with T.serial(qlo, qhi) as q:
                        scale = fast_exp(pmax(q) - st(0))
                        st(1, st(1) + psum(q) * scale)
                        acc(f, acc(f) + prow(q) * scale)
                with T.serial(lo, hi) as j:
                    e = fast_exp(score(j) - st(0))
                    st(1, st(1) + e)
                    w = times(e, drop_factor(perm, j, h, H, step, p, seed))
                    acc(f, acc(f) + w * x[indices[j], f])

            merge = None
            if split:
                t, tasks, hub = b["t"], b["tasks"], b["hub"]
                part = T.sblock_alloc_buffer((t, H * C), f32)
                pstat = T.sblock_alloc_buffer((t, H * C, 2), f32)  # per lane: max, sum
                tstat = T.sblock_alloc_buffer((t, H, C, 2), f32)
                for buf, name in ((part, "part"), (pstat, "pstat"), (tstat, "tstat")):
                    IRBuilder.name(name, buf)
                with lanes_block("task", t, H, C, row="k") as (vk, vh, vc, f):
                    T.reads(tasks[vk, 0:3], indices[0:nnz], s_src[0:m, vh],
                            s_dst[0:n, vh], x[0:m, f], *drop_reads)
                    T.writes(part[vk, f], pstat[vk, f, 0:2], tstat[vk, vh, vc, 0:2])
                    st = cells(tstat, [vk, vh, vc])
                    sweeps(tasks[vk, 2], vh, f, tasks[vk, 0], tasks[vk, 1], st,
                           cells(part, [vk]))
                    T.buffer_store(pstat, st(0), [vk, f, 0])
                    T.buffer_store(pstat, st(1), [vk, f, 1])
            # the row's maximum and sum; the GPU's form (split) sums its weighted row there
            # too, a float32 register, so an output stored as bfloat16 is rounded once
            stat = T.sblock_alloc_buffer((n, H, C, 3 if split else 2), f32)
            IRBuilder.name("stat", stat)
            with lanes_block("row", n, H, C) as (vi, vh, vc, f):
                reads = [indptr[vi:vi + 2], indices[0:nnz], s_src[0:m, vh], s_dst[vi, vh],
                         x[0:m, f], *drop_reads]
                end = indptr[vi + 1]
                if split:  # a hub row merges its tasks' partials and walks no edges
                    reads += [hub[vi:vi + 2], part[0:t, f], pstat[0:t, f, 0:2]]
                    merge = (hub[vi], hub[vi + 1], lambda q: pstat[q, f, 0],
                             lambda q: pstat[q, f, 1], lambda q: part[q, f])
                    end = tirx.Select(hub[vi + 1] > hub[vi], indptr[vi], end)
                T.reads(*reads)
                T.writes(out[vi, f], stat[vi, vh, vc, 0:3 if split else 2])
                st = cells(stat, [vi, vh, vc])
                row = cells(out, [vi])
                if split:
                    def row(_f, v=None, st=st):
                        return st(2, v)
                sweeps(vi, vh, f, indptr[vi], end, st, row, merge)
                total = st(1)
                res = tirx.Select(total > zero, row(f) / total, zero)
                res = epi.apply(epilogue, res, lambda k: extra[k][epi.index(extras[k], vi, f)])
                T.buffer_store(out, res, [vi, f])
    return ib.get()


def slope_factor(z, slope: float):
    """d leaky_relu(z) / dz: 1 above 0, else the slope (at 0 too, as autodiff's rule)."""
    one = tirx.const(1.0, "float32")
    return one if slope == 1.0 else tirx.Select(z > tirx.const(0.0, "float32"), one,
                                                tirx.const(slope, "float32"))


@definer("attention_grad_dst")
def attention_grad_dst(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0,
                       split: bool = False):
    """The destination half of fused attention's backward (``attention_grad_dst``): per
    (row i, head h), a sweep over the in-edges for the maximum score, then one that sums
    p_j = exp(e_j - max), p_j g_j, p_j g_j r_j and p_j r_j with g_j = dy_i . x_j, from
    which out[i] holds d s_dst = (sum p g r - D sum p r) / l, s_dst, the log-sum-exp of
    the scores and D = sum p g / l (l = sum p; zeros but s_dst for a row without
    in-edges).  With dropout, g_j is m_j dy_i . x_j (m_j: the coefficient's dropout factor).

    ``split``: the GPU's form, ``_attention_grad_dst_lanes``.

    Arguments: indptr, indices, [perm], s_src (m x H), s_dst (n x H), x (m x H*C), dy (n x
    H*C), [step], [tasks, hub], out (n x 4H)."""
    if split:
        return _attention_grad_dst_lanes(H, C, slope, p, seed)
    f32 = "float32"
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_grad_dst")
            T.func_attr({"tirx.noalias": True})
            b, n, m, nnz = attention_buffers("attention_grad_dst", H, C, p)
            indptr, indices, s_src, s_dst, x, dy, out = (b[k] for k in (
                "indptr", "indices", "s_src", "s_dst", "x", "dy", "out"))
            perm, step = b.get("perm"), b.get("step")
            # per (row, head): max, l, sum p g, sum p g r, sum p r, the dot product
            stat = T.sblock_alloc_buffer((n, H, 6), f32)
            IRBuilder.name("stat", stat)
            with T.grid(n, H) as (i, h):
                with T.sblock("row"):
                    vi = T.axis.spatial(n, i)
                    vh = T.axis.spatial(H, h)
                    T.reads(indptr[vi:vi + 2], indices[0:nnz], s_src[0:m, vh], s_dst[vi, vh],
                            x[0:m, vh * C:vh * C + C], dy[vi, vh * C:vh * C + C],
                            *([perm[0:nnz], step[()]] if p else []))
                    T.writes(out[vi, vh], out[vi, H + vh], out[vi, 2 * H + vh],
                             out[vi, 3 * H + vh], stat[vi, vh, 0:6])

                    def z_of(j):
                        return s_src[indices[j], vh] + s_dst[vi, vh]

                    def put(k, v):
                        T.buffer_store(stat, v, [vi, vh, k])
                    put(0, tirx.const(NEG_INF, f32))
                    with T.serial(indptr[vi], indptr[vi + 1]) as j:
                        put(0, tirx.max(stat[vi, vh, 0], leaky(z_of(j), slope)))
                    for k in range(1, 5):
                        put(k, tirx.const(0.0, f32))
                    with T.serial(indptr[vi], indptr[vi + 1]) as j:
                        put(5, tirx.const(0.0, f32))
                        with T.serial(0, C) as c:
                            put(5, stat[vi, vh, 5] + dy[vi, vh * C + c] * x[indices[j], vh * C + c])
                        put(5, times(stat[vi, vh, 5], drop_factor(perm, j, vh, H, step, p, seed)))
                        e = fast_exp(leaky(z_of(j), slope) - stat[vi, vh, 0])
                        r = slope_factor(z_of(j), slope)
                        put(1, stat[vi, vh, 1] + e)
                        put(2, stat[vi, vh, 2] + e * stat[vi, vh, 5])
                        put(3, stat[vi, vh, 3] + e * stat[vi, vh, 5] * r)
                        put(4, stat[vi, vh, 4] + e * r)
                    finish_attention_stats(out, vi, vh, H, s_dst[vi, vh],
                                           lambda k: stat[vi, vh, k])
    return ib.get()


def _attention_grad_dst_lanes(H: int, C: int, slope: float, p: float, seed: int):
    """The GPU's ``attention_grad_dst``: a thread per (row, head, channel).  The per-edge
    dot products leave the edge loop, as sums over edges of x_j are linear:

        sum_j p m g = dy_i . A_i,  A_i = sum_j p m x_j;   sum_j p m g r = dy_i . B_i,
        B_i = sum_j p m r x_j

    so each lane sums its channel of A and B and, redundantly across a head's lanes, the
    maximum, l and sum p r.  Lane c stores dy_i[c] A_i[c] and dy_i[c] B_i[c] (``g``),
    lane 0 the head's scalars (``sc``), and a last nest adds a head's C products and
    finishes the statistics.  Hub tasks sum relative to their own maximum into partials
    that a hub row merges rescaled by exp(task maximum - row maximum)."""
    F = H * C
    f32 = "float32"
    zero = tirx.const(0.0, f32)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_grad_dst")
            T.func_attr({"tirx.noalias": True})
            b, n, m, nnz = attention_buffers("attention_grad_dst", H, C, p, split=True)
            indptr, indices, s_src, s_dst, x, dy, out, t, tasks, hub = (b[k] for k in (
                "indptr", "indices", "s_src", "s_dst", "x", "dy", "out", "t", "tasks", "hub"))
            perm, step = b.get("perm"), b.get("step")
            edge_reads = [indices[0:nnz], s_src[0:m, 0:H], x[0:m, 0:F],
                          *([perm[0:nnz], step[()]] if p else [])]

            def sums(i, h, f, lo, hi, st, merge=None):
                """Edges lo..hi of destination i into st: 0 the maximum score, 1 l, 2 sum
                p r, 3 A, 4 B (channel f); ``merge``: (partials' range, partial k at q)."""
                def z_of(j):
                    return s_src[indices[j], h] + s_dst[i, h]
                st(0, tirx.const(NEG_INF, f32))
                if merge is not None:
                    qlo, qhi, part = merge
                    with T.serial(qlo, qhi) as q:
                        st(0, tirx.max(st(0), part(q, 0)))
                with T.serial(lo, hi) as j:
                    st(0, tirx.max(st(0), leaky(z_of(j), slope)))
                for k in range(1, 5):
                    st(k, zero)
                if merge is not None:
                    with T.serial(qlo, qhi) as q:
                        scale = fast_exp(part(q, 0) - st(0))
                        for k in range(1, 5):
                            st(k, st(k) + part(q, k) * scale)
                with T.serial(lo, hi) as j:
                    e = fast_exp(leaky(z_of(j), slope) - st(0))
                    r = slope_factor(z_of(j), slope)
                    em = times(e, drop_factor(perm, j, h, H, step, p, seed))
                    st(1, st(1) + e)
                    st(2, st(2) + e * r)
                    st(3, st(3) + em * x[indices[j], f])
                    st(4, st(4) + em * r * x[indices[j], f])

            part = T.sblock_alloc_buffer((t, F, 5), f32)
            tstat = T.sblock_alloc_buffer((t, H, C, 5), f32)
            stat = T.sblock_alloc_buffer((n, H, C, 5), f32)
            g = T.sblock_alloc_buffer((n, F, 2), f32)
            sc = T.sblock_alloc_buffer((n, H, 3), f32)
            for buf, name in ((part, "part"), (tstat, "tstat"), (stat, "stat"), (g, "g"),
                              (sc, "sc")):
                IRBuilder.name(name, buf)
            with lanes_block("task", t, H, C, row="k") as (vk, vh, vc, f):
                T.reads(tasks[vk, 0:3], s_dst[0:n, vh], *edge_reads)
                T.writes(part[vk, f, 0:5], tstat[vk, vh, vc, 0:5])
                st = cells(tstat, [vk, vh, vc])
                sums(tasks[vk, 2], vh, f, tasks[vk, 0], tasks[vk, 1], st)
                for q in range(5):
                    T.buffer_store(part, st(q), [vk, f, q])
            with lanes_block("row", n, H, C) as (vi, vh, vc, f):
                T.reads(indptr[vi:vi + 2], hub[vi:vi + 2], part[0:t, f, 0:5], s_dst[vi, vh],
                        dy[vi, f], *edge_reads)
                T.writes(g[vi, f, 0:2], sc[vi, vh, 0:3], stat[vi, vh, vc, 0:5])
                st = cells(stat, [vi, vh, vc])
                end = tirx.Select(hub[vi + 1] > hub[vi], indptr[vi], indptr[vi + 1])
                sums(vi, vh, f, indptr[vi], end, st,
                     (hub[vi], hub[vi + 1], lambda q, k: part[q, f, k]))
                T.buffer_store(g, dy[vi, f] * st(3), [vi, f, 0])
                T.buffer_store(g, dy[vi, f] * st(4), [vi, f, 1])
                with T.If(vc == 0):
                    with T.Then():
                        for q in range(3):
                            T.buffer_store(sc, st(q), [vi, vh, q])
            # sums(k) as finish_attention_stats reads them: max, l, sum p g, sum p g r,
            # sum p r
            head_sums("finish", n, H, C, g, 2, lambda vi, vh: [
                out[vi, vh], out[vi, H + vh], out[vi, 2 * H + vh], out[vi, 3 * H + vh]],
                lambda vi, vh, tot: finish_attention_stats(
                    out, vi, vh, H, s_dst[vi, vh], lambda k: (
                        sc[vi, vh, 0], sc[vi, vh, 1], tot[0], tot[1], sc[vi, vh, 2])[k]))
    return ib.get()


def finish_attention_stats(out, i, h, H: int, s_dst, sums) -> None:
    """out[i, (h, H + h, 2H + h, 3H + h)] = d s_dst, s_dst, log-sum-exp, D of row i and
    head h, from its sums ``sums(k)``: k = 0 the maximum score, 1 l = sum p, 2 sum p g,
    3 sum p g r, 4 sum p r."""
    f32 = "float32"
    zero = tirx.const(0.0, f32)
    has = sums(1) > zero
    l1 = tirx.max(sums(1), tirx.const(1.0, f32))  # l >= 1 where a row has edges (its max: e^0)
    d = sums(2) / l1
    T.buffer_store(out, tirx.Select(has, (sums(3) - d * sums(4)) / l1, zero), [i, h])
    T.buffer_store(out, s_dst, [i, H + h])
    T.buffer_store(out, tirx.Select(has, sums(0) + tirx.log(l1), zero), [i, 2 * H + h])
    T.buffer_store(out, tirx.Select(has, d, zero), [i, 3 * H + h])


@definer("attention_grad_src")
def attention_grad_src(H: int, C: int, slope: float, p: float = 0.0, seed: int = 0,
                       split: bool = False):
    """The source half of fused attention's backward (``attention_grad_src``): per (source
    row j, head h), a sweep over its out-edges (CSC: ``indices`` holds destinations i)
    that recomputes each coefficient a = exp(e - lse_i) from the statistics row of
    ``attention_grad_dst`` (s_dst, lse, D) and accumulates d x[j] = sum a dy_i and
    d s_src[j] = sum a r (dy_i . x_j - D_i) (with dropout: sum a m dy_i and sum a r (m dy_i
    . x_j - D_i)).

    ``split``: the GPU's form, ``_attention_grad_src_lanes``.

    Arguments: indptr, indices (CSC), [csc_perm: the canonical id of each CSC slot's edge],
    s_src (n x H), x (n x H*C), dy (m x H*C), stats (m x 4H), [step], [tasks, hub], out (n x
    H*C + H)."""
    if split:
        return _attention_grad_src_lanes(H, C, slope, p, seed)
    F = H * C
    f32 = "float32"
    zero = tirx.const(0.0, f32)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_grad_src")
            T.func_attr({"tirx.noalias": True})
            b, n, m, nnz = attention_buffers("attention_grad_src", H, C, p)
            indptr, indices, s_src, x, dy, stats, out = (b[k] for k in (
                "indptr", "indices", "s_src", "x", "dy", "stats", "out"))
            perm, step = b.get("csc_perm"), b.get("step")
            stat = T.sblock_alloc_buffer((n, H, 2), f32)  # d s_src, the dot product
            IRBuilder.name("stat", stat)
            with T.grid(n, H) as (i, h):
                with T.sblock("row"):
                    vj = T.axis.spatial(n, i)
                    vh = T.axis.spatial(H, h)
                    T.reads(indptr[vj:vj + 2], indices[0:nnz], s_src[vj, vh],
                            x[vj, vh * C:vh * C + C], dy[0:m, vh * C:vh * C + C],
                            stats[0:m, 0:4 * H], *([perm[0:nnz], step[()]] if p else []))
                    T.writes(out[vj, vh * C:vh * C + C], out[vj, F + vh], stat[vj, vh, 0:2])
                    T.buffer_store(stat, zero, [vj, vh, 0])
                    with T.serial(0, C) as c:
                        T.buffer_store(out, zero, [vj, vh * C + c])
                    with T.serial(indptr[vj], indptr[vj + 1]) as k:
                        d = indices[k]
                        z = s_src[vj, vh] + stats[d, H + vh]
                        a = fast_exp(leaky(z, slope) - stats[d, 2 * H + vh])
                        mk = drop_factor(perm, k, vh, H, step, p, seed)
                        T.buffer_store(stat, zero, [vj, vh, 1])
                        with T.serial(0, C) as c:
                            f = vh * C + c
                            T.buffer_store(stat, stat[vj, vh, 1] + dy[d, f] * x[vj, f],
                                           [vj, vh, 1])
                            T.buffer_store(out, out[vj, f] + times(a, mk) * dy[d, f], [vj, f])
                        T.buffer_store(stat, stat[vj, vh, 0] + a * slope_factor(z, slope) * (
                            times(stat[vj, vh, 1], mk) - stats[d, 3 * H + vh]), [vj, vh, 0])
                    T.buffer_store(out, stat[vj, vh, 0], [vj, F + vh])
    return ib.get()


def _attention_grad_src_lanes(H: int, C: int, slope: float, p: float, seed: int):
    """The GPU's ``attention_grad_src``: a thread per (row, head, channel), so a warp's
    lanes read neighbouring floats of dy_i, and no edge needs a sum across channels.  The
    per-edge dot product moves out of the edge loop:

        d s_src[j] = sum_k a r (m dy_i . x_j - D_i) = x_j . B_j - E_j,
        B_j = sum_k a r m dy_i (per channel),  E_j = sum_k a r D_i

    so each lane sums d x, B and E over the out-edges; lane c stores x_j[c] B_j[c] (lane 0
    less E_j) into ``bx`` and a last nest adds a head's C values.  Hub tasks (``tasks``,
    ``hub``) sum their share of the three into partials a hub row adds instead of walking
    its edges."""
    F = H * C
    f32 = "float32"
    zero = tirx.const(0.0, f32)
    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("attention_grad_src")
            T.func_attr({"tirx.noalias": True})
            b, n, m, nnz = attention_buffers("attention_grad_src", H, C, p, split=True)
            indptr, indices, s_src, x, dy, stats, out, t, tasks, hub = (b[k] for k in (
                "indptr", "indices", "s_src", "x", "dy", "stats", "out", "t", "tasks", "hub"))
            perm, step = b.get("csc_perm"), b.get("step")
            edge_reads = [indices[0:nnz], dy[0:m, 0:F], stats[0:m, 0:4 * H],
                          *([perm[0:nnz], step[()]] if p else [])]

            def accumulate(j, h, f, lo, hi, acc):
                """Out-edges lo..hi of source j into acc(0) d x, acc(1) B, acc(2) E."""
                with T.serial(lo, hi) as k:
                    d = indices[k]
                    z = s_src[j, h] + stats[d, H + h]
                    a = fast_exp(leaky(z, slope) - stats[d, 2 * H + h])
                    mk = drop_factor(perm, k, h, H, step, p, seed)
                    ar = a * slope_factor(z, slope)
                    acc(0, acc(0) + times(a, mk) * dy[d, f])
                    acc(1, acc(1) + times(ar, mk) * dy[d, f])
                    acc(2, acc(2) + ar * stats[d, 3 * H + h])

            part = T.sblock_alloc_buffer((t, F, 3), f32)  # a task's d x, B, E per lane
            tacc = T.sblock_alloc_buffer((t, H, C, 3), f32)
            acc_ = T.sblock_alloc_buffer((n, H, C, 3), f32)
            bx = T.sblock_alloc_buffer((n, F, 1), f32)
            for buf, name in ((part, "part"), (tacc, "tacc"), (acc_, "acc"), (bx, "bx")):
                IRBuilder.name(name, buf)
            with lanes_block("task", t, H, C, row="k") as (vk, vh, vc, f):
                T.reads(tasks[vk, 0:3], s_src[0:n, vh], *edge_reads)
                T.writes(part[vk, f, 0:3], tacc[vk, vh, vc, 0:3])
                acc = cells(tacc, [vk, vh, vc])
                for q in range(3):
                    acc(q, zero)
                accumulate(tasks[vk, 2], vh, f, tasks[vk, 0], tasks[vk, 1], acc)
                for q in range(3):
                    T.buffer_store(part, acc(q), [vk, f, q])
            with lanes_block("row", n, H, C) as (vj, vh, vc, f):
                T.reads(indptr[vj:vj + 2], hub[vj:vj + 2], part[0:t, f, 0:3],
                        s_src[vj, vh], x[vj, f], *edge_reads)
                T.writes(out[vj, f], bx[vj, f, 0], acc_[vj, vh, vc, 0:3])
                acc = cells(acc_, [vj, vh, vc])
                for q in range(3):
                    acc(q, zero)
                with T.serial(hub[vj], hub[vj + 1]) as q:
                    for r in range(3):
                        acc(r, acc(r) + part[q, f, r])
                end = tirx.Select(hub[vj + 1] > hub[vj], indptr[vj], indptr[vj + 1])
                accumulate(vj, vh, f, indptr[vj], end, acc)
                T.buffer_store(out, acc(0), [vj, f])
                T.buffer_store(bx, x[vj, f] * acc(1) - tirx.Select(vc == 0, acc(2), zero),
                               [vj, f, 0])
            head_sums("ds", n, H, C, bx, 1, lambda vj, vh: [out[vj, F + vh]],
                      lambda vj, vh, tot: T.buffer_store(out, tot[0], [vj, F + vh]))
    return ib.get()
