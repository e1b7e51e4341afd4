"""CUDA schedules: every kernel kind of ``gcomp/codegen/kernels`` mapped onto GPU threads.

``schedule(sch, spec)`` works like ``gcomp/schedules/cpu.py``: it gets a
``tvm.s_tir.Schedule`` holding one unscheduled kernel and its spec, and binds
its loops.  A kind it does not know raises ``KeyError``; the CUDA build
(``gcomp/codegen/cuda_build.py``) then schedules that kernel with
``tvm.s_tir.dlight.gpu.Fallback``, so a kind added later never breaks ``-t cuda``.

Thread layouts used here:

* **rows x lanes** (``_bind_rows``), for kernels that are a spatial block over
  (row, features) whose body loops over the row's edges (aggregation, segment
  reductions, argmax, edge softmax, GAT's attention): ``lanes`` threads (one per feature
  up to ``THREADS``, ``lanes_for``) cover the feature axis, so neighbouring threads
  read neighbouring floats of one gathered row, and a block holds
  ``THREADS // lanes`` rows.  Each thread accumulates its output element in a
  register (``cache_write`` to ``local``) and stores it once.  Wide float32
  aggregations give a lane 4 neighbouring features instead (``agg_vector``: a float4
  load per gathered row).
* **flat** (``_bind_flat``): elementwise work, all loops fused and split over
  blocks of ``THREADS`` threads.
* **chunked sums to scalars** (``_chunk_sums``): the losses' sums over the symbolic
  row axis run a thread per chunk of rows, then one block of ``SCALAR_THREADS``
  threads adds the chunks' partials by TVM's warp-shuffle tree.  Deterministic: the
  same inputs give the same bits, as every kernel here but one does.
* **scatter** (``_scatter``): the backward aggregations of ``--prefer memory``
  (``csr_scatter``) add each edge's term into its source's row with atomics, in the
  GPU's order: the one layout that is not bit for bit reproducible
  (``--deterministic`` keeps the gathers over the transposed graph).
* reductions over rows into a small static output (``matmul_tn``, ``colsum``) use
  the chunked definitions (partial sums per chunk of rows, then their sum) with
  more chunks on the GPU (``DEFINITION_PARAMS``).
* **shared-memory tiles** (``_stage_in_shared``): the products, ``matmul`` and
  ``matmul_tn``, have GPU definitions that stage zero-padded tiles of both operands;
  all threads of a block copy them, then each thread keeps a register tile.

Aggregation strategies: ``AGG_STRATEGIES`` maps a name to a schedule;
``agg_strategy(spec)`` picks one (today always ``rows``).  Rows longer than
``graph.task_edges`` (128 or more) are not walked by one thread: ``-t cuda`` plans call the split form
of ``csr_agg`` (``gcomp/codegen/hub_split.py``), whose task nest gets the same rows x
lanes layout.  An ELL kernel for low-degree rows would slot in here, as a plan variant
chosen by the bound graph like the sparse-feature variant.

Pitfalls of TVM 0.27's CUDA path (``shared/notes/tvm.md``) this file respects:
static loops are only split by factors that divide them (``lanes_for``); loop kinds
are only chosen here, never written in kernel bodies; no shared memory under a row
predicate (only the scalar reductions and the products' staged tiles use shared
memory, and none has a predicate around it); a function with two thread-bound
nests becomes two kernel launches (``colsum``, ``matmul_tn`` and the losses do
this on purpose, their intermediates are allocated by the host); no block
reduces over a data-dependent loop across threads (edge loops stay serial in
one thread).
"""

from __future__ import annotations

from gcomp.codegen.kernels import env_knob

THREADS = 256  # threads per block

# Extra definer parameters for the CUDA variant of some kernel kinds (their CPU defaults
# keep CPU kernels unchanged).  More row chunks: a GPU wants thousands of threads.
DEFINITION_PARAMS = {
    "colsum": {"gpu": True},
    "cross_entropy": {"gpu": True},
    "cross_entropy_grad": {"gpu": True},
    "matmul": {"gpu": True},
    "matmul_tn": {"gpu": True},
    "sym_norm": {"lanes": 32},  # a warp per row: hub rows of 2M edges on Reddit-size
}


# ---------------------------------------------------------------------- helpers
def _static_extent(sch, loop):
    ext = sch.get(loop).extent
    return int(ext) if hasattr(ext, "value") or isinstance(ext, int) else None


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap``."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def lanes_for(width: int) -> int:
    """Threads across a static axis of ``width``: one per element up to ``THREADS``, else
    the largest divisor of ``width`` up to ``THREADS``.  Always a divisor: TVM 0.27 drops
    the bound check of a register write-back (``cache_write``) under a static loop split
    by a factor that does not divide it, so the stray threads of the last piece stored
    into their neighbours' elements (found on an H100: GAT with 48 channels per head,
    weight gradients of 8 x 3)."""
    return width if width <= THREADS else divisor_at_most(width, THREADS)


def _fuse(sch, loops):
    if not loops:
        return None
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def _write_index(sch, block, name: str) -> int:
    for k, region in enumerate(sch.get(block).writes):
        if region.source.name == name:
            return k
    raise KeyError(f"block {sch.get(block).name_hint} writes no buffer {name!r}")


def _in_register(sch, block, buffer: str, at, vector: int = 1) -> None:
    """Accumulate ``buffer`` of ``block`` in a register, stored once at loop ``at`` (with
    ``vector`` > 1, a lane's ``vector`` elements as one vector store)."""
    cw = sch.cache_write(block, _write_index(sch, block, buffer), "local")
    sch.reverse_compute_at(cw, at)
    if vector > 1:
        sch.vectorize(sch.get_loops(cw)[-1])


def _bind_loops(sch, loops, threads: int = THREADS):
    """Fuse ``loops`` and spread them over blocks of ``threads``; returns the thread loop."""
    loop = _fuse(sch, loops)
    ext = _static_extent(sch, loop)
    if ext is not None and ext <= threads:
        sch.bind(loop, "threadIdx.x")
        return loop
    bx, tx = sch.split(loop, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return tx


def _bind_flat(sch, block, threads: int = THREADS):
    """All loops of ``block`` fused, split over blocks of ``threads``; returns the thread loop."""
    loops = sch.get_loops(block)
    return _bind_loops(sch, loops if loops else [sch.add_unit_loop(block)], threads)


def _bind_rows(sch, block, n_row_loops: int = 1, vector: int = 1, columns: int = 1):
    """Rows x lanes: the first ``n_row_loops`` loops are rows, the rest (static) features;
    with ``vector`` > 1 (dividing the features), each lane takes that many neighbouring
    features as one vector (a float4 load of a gathered row).  With ``columns`` > 1
    (dividing the lanes), the features are cut into that many column tiles, the outer
    grid axis (``blockIdx.y``): every row's first tile is done before any row's second,
    so the gathers of one tile share the cache.

    Returns (row thread loop, feature thread loop or None)."""
    loops = sch.get_loops(block)
    row = _fuse(sch, loops[:n_row_loops])
    feat = _fuse(sch, loops[n_row_loops:])
    if vector > 1:
        feat, fv = sch.split(feat, [None, vector])
    if columns > 1:
        tile, feat = sch.split(feat, [columns, None])
    lanes = lanes_for(_static_extent(sch, feat)) if feat is not None else 1
    rows_per_block = max(1, THREADS // lanes)
    n_rows = _static_extent(sch, row)
    if n_rows is not None:  # a static row axis (chunks) is split exactly too
        rows_per_block = divisor_at_most(n_rows, rows_per_block)
    ro, ri = sch.split(row, [None, rows_per_block])
    sch.bind(ro, "blockIdx.x")
    if columns > 1:
        sch.reorder(tile, ro, ri)
        sch.bind(tile, "blockIdx.y")
    if feat is None:
        sch.bind(ri, "threadIdx.x")
        return ri, None
    sch.bind(ri, "threadIdx.y")
    _, fi = sch.split(feat, [None, lanes])
    sch.bind(fi, "threadIdx.x")
    if vector > 1:
        sch.vectorize(fv)
    return ri, fi


SCALAR_THREADS = 1024  # one block's threads for a sum to a scalar (the loss, mask counts)


def _block_per_output(sch, out_loop, r, threads: int = THREADS) -> None:
    """A reduction over loop ``r`` spread over a block of ``threads`` threads per
    iteration of ``out_loop`` (one block per output element): each thread sums a strided
    share, then TVM's warp-shuffle tree adds the partial sums (deterministic)."""
    ro, ri = sch.split(r, [None, threads])
    sch.reorder(out_loop, ri, ro)
    sch.bind(out_loop, "blockIdx.x")
    sch.bind(ri, "threadIdx.x")


def _single_thread(sch, block) -> None:
    """A block of static, tiny work (the final division of a loss)."""
    _bind_flat(sch, block)


# ---------------------------------------------------------------------- sparse kernels
def _rows_accumulate(sch, block: str, out: str = "out") -> None:
    blk = sch.get_sblock(block)
    ri, fi = _bind_rows(sch, blk)
    _in_register(sch, blk, out, fi if fi is not None else ri)


AGG_VECTOR = 4  # features per lane of wide float32 aggregations: one float4 load per edge
# fewest float4 lanes a row may get: 8, so four 32-feature rows share a warp (four times
# the gathers in flight per warp, against lanes idling past the shortest of its rows).
# On an H200 (2026-11-26) the SpMM at F = 32 took 2.07 ms at Reddit size against 3.48
# with a warp per row, and 0.135 against 0.138 at arxiv size.  $GCOMP_CUDA_AGG_MIN_LANES
# overrides it (32: a warp per row), which bench.gpu's SpMM runs beside the default
AGG_MIN_LANES = 8
WARP = 32  # threads of a warp: narrower rows must tile it exactly
AGG_MIN_LANES_ENV = "GCOMP_CUDA_AGG_MIN_LANES"


def _row_lanes_fit(lanes: int, fewest: int) -> bool:
    """Whether rows of ``lanes`` float4 lanes may be scheduled: at least ``fewest``,
    tiling a warp exactly (never a row across two warps), and a thread split that
    divides them (``lanes_for``)."""
    return (lanes >= fewest and (lanes >= WARP or WARP % lanes == 0)
            and lanes_for(lanes) == lanes)


def agg_vector(spec) -> int:
    """Features per lane of the aggregation ``spec``: ``AGG_VECTOR`` for the split form
    over float32 rows of at least 4 x ``AGG_MIN_LANES`` features (each lane loading a
    float4 of the gathered row, once per edge its index and weight; a warp per row from
    128 features, below that 2 or 4 rows a warp, never a row across two warps: 40
    features keep a lane each, as timed in the epochs), else 1 (a lane per feature).  A
    vector stays within a head (TVM 0.27 cannot vectorize a loop whose vectors straddle
    two heads' channels), and bfloat16 storage keeps a lane per feature (TVM 0.27
    miscompiles a variable bound to a widened bfloat16 load)."""
    p = spec.p
    lanes = p["H"] * p["C"] // AGG_VECTOR
    fewest = env_knob(AGG_MIN_LANES_ENV, AGG_MIN_LANES)
    wide = (p.get("split") and not p.get("bf16") and p["C"] % AGG_VECTOR == 0
            and _row_lanes_fit(lanes, fewest))
    return AGG_VECTOR if wide else 1


AGG_COLUMNS_ENV = "GCOMP_CUDA_AGG_COLUMNS"  # a tuning knob (docs/cuda.md): column tiles


def agg_columns(spec, vector: int) -> int:
    """Column tiles of the vectorized aggregation ``spec``: ``$GCOMP_CUDA_AGG_COLUMNS``
    (default 1) where each tile keeps at least ``AGG_MIN_LANES`` lanes tiling a warp."""
    if vector == 1:
        return 1
    columns = env_knob(AGG_COLUMNS_ENV, 1)
    lanes = spec.p["H"] * spec.p["C"] // vector
    ok = (spec.p["H"] == 1 and lanes % columns == 0
          and _row_lanes_fit(lanes // columns, AGG_MIN_LANES))
    return columns if ok else 1


def _agg_rows(sch, spec) -> None:
    """Baseline aggregation: a warp (or fewer lanes) over a row's features, several rows
    per block; the row's sum lives in registers."""
    vector = agg_vector(spec)
    columns = agg_columns(spec, vector)
    if spec.p.get("split"):  # the hub rows' tasks: the same layout over tasks
        task = sch.get_sblock("task")
        _, fi = _bind_rows(sch, task, vector=vector, columns=columns)
        _in_register(sch, task, "part", fi, vector)
    blk = sch.get_sblock("row")
    _, fi = _bind_rows(sch, blk, vector=vector, columns=columns)
    if any(r.source.name == "total" for r in sch.get(blk).writes):
        # a bfloat16 output's float32 sum (``total``) in a register
        sch.set_scope(blk, _write_index(sch, blk, "total"), "local")
    else:
        _in_register(sch, blk, "out", fi, vector)


AGG_STRATEGIES = {"rows": _agg_rows}


def agg_strategy(spec) -> str:
    """The aggregation schedule for ``spec`` (the only one today: ``rows``)."""
    return "rows"


def _scatter(sch) -> None:
    """The scatter over out-edges (``csr_scatter``): the output initialized flat, then
    the tasks and the rows in the rows x lanes layout, each thread adding its feature of
    every edge straight into global memory (atomics; no register to keep)."""
    _bind_flat(sch, sch.get_sblock("init"))
    _bind_rows(sch, sch.get_sblock("task"))
    _bind_rows(sch, sch.get_sblock("row"))


def _argmax(sch) -> None:
    blk = sch.get_sblock("row")
    sch.set_scope(blk, _write_index(sch, blk, "best"), "local")
    _, fi = _bind_rows(sch, blk)
    _in_register(sch, blk, "out", fi)


def _attention(sch, spec) -> None:
    """GAT's fused attention: rows x lanes like aggregation; every lane keeps the row's
    score maximum, sum (``stat``) and its output element (the split form: in ``stat``)
    in registers.  The hub
    tasks (``split``) get the same layout, their partial row in registers too."""
    if spec.p.get("split"):
        task = sch.get_sblock("task")
        sch.set_scope(task, _write_index(sch, task, "tstat"), "local")
        _, fi = _bind_rows(sch, task, n_row_loops=2)
        _in_register(sch, task, "part", fi)
    blk = sch.get_sblock("row")
    sch.set_scope(blk, _write_index(sch, blk, "stat"), "local")
    _, fi = _bind_rows(sch, blk, n_row_loops=2)
    if not spec.p.get("split"):  # (the split form sums its row in ``stat`` already)
        _in_register(sch, blk, "out", fi)


def _attention_grad(sch, spec) -> None:
    """The two halves of fused attention's backward.  The generic forms: one thread per
    (row, head), its sums (``stat``) in registers.  The GPU forms (``split``): rows x
    lanes over (row, head) and the channels, for the hub tasks and the rows alike, each
    lane's sums in registers; the nest that adds a head's lanes (``finish`` of the
    destination half, ``ds`` of the source half) takes a thread per (row, head)."""
    if not spec.p.get("split"):
        blk = sch.get_sblock("row")
        sch.set_scope(blk, _write_index(sch, blk, "stat"), "local")
        _bind_rows(sch, blk, n_row_loops=2)
        return
    src = spec.kind == "attention_grad_src"
    for name, scratch in (("task", "tacc" if src else "tstat"), ("row", "acc" if src else "stat")):
        blk = sch.get_sblock(name)
        sch.set_scope(blk, _write_index(sch, blk, scratch), "local")
        _bind_rows(sch, blk, n_row_loops=2)
    _bind_rows(sch, sch.get_sblock("ds" if src else "finish"), n_row_loops=2)


def _edge_softmax(sch) -> None:
    """One thread per (row, head); the row's max and sum stay in registers."""
    blk = sch.get_sblock("row")
    sch.set_scope(blk, _write_index(sch, blk, "stat"), "local")
    _bind_rows(sch, blk)


def _degree(sch, weighted: bool) -> None:
    blk = sch.get_sblock("deg")
    tx = _bind_flat(sch, blk)
    if weighted:
        _in_register(sch, blk, "out", tx)


def _edge_dot(sch) -> None:
    """One thread per (edge, head): the dot product's partial sums in registers."""
    out = sch.get_sblock("edge_dot")
    loops = sch.get_loops(out)
    tx = _bind_loops(sch, loops[:2])
    part = sch.get_sblock("part")
    sch.compute_at(part, tx, preserve_unit_loops=True)
    sch.set_scope(part, 0, "local")


# ---------------------------------------------------------------------- dense kernels
def _stage_in_shared(sch, names, at, ny: int, nx: int) -> None:
    """The staging blocks ``names`` (a tile of an operand, zero-padded in the definition)
    in shared memory, copied anew at loop ``at`` by all ``ny`` x ``nx`` threads of the
    block, neighbouring threads on neighbouring floats; each copies whole elements (the
    tile plans make the sizes divide)."""
    for name in names:
        stage = sch.get_sblock(name)
        sch.set_scope(stage, 0, "shared")
        sch.compute_at(stage, at, preserve_unit_loops=True)
        _, fy, fx = sch.split(sch.fuse(*sch.get_loops(stage)[-2:]), [None, ny, nx])
        sch.bind(fy, "threadIdx.y")
        sch.bind(fx, "threadIdx.x")


def _matmul(sch, K: int, M: int, trans_b: bool = False) -> None:
    """GPU definition (``gpu=True``, tiles from ``gpu_mm_tiles``): a block per ``R`` rows;
    per step of ``KT`` columns of x its threads copy the rows' slice of x and ``KT`` rows
    of w into shared memory (neighbouring floats), then each thread adds the products
    into its ``ta`` x ``tb`` register tile; the output block (epilogue, bound check)
    follows each thread's tile.  (The form before gave each thread 4 rows of one column
    straight from global memory: 0.21 ms for 128 -> 32 on arxiv-size rows, 0.76 ms for
    128 -> 128, about 7x the FLOP floor.)  ``trans_b``: w's tile is copied along w's
    columns, its rows in shared memory padded to an odd stride, so the copy's stores
    (a column of the tile per warp) fall in separate banks."""
    from gcomp.codegen.dense_kernels import gpu_mm_tiles
    tl = gpu_mm_tiles(K, M)
    acc = sch.get_sblock("acc")
    b, r, u, v, kt, kk = sch.get_loops(acc)
    ty, a = sch.split(r, [tl.ny, tl.ta])
    sch.reorder(b, ty, v, kt, kk, a, u)
    sch.bind(b, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(v, "threadIdx.x")
    sch.set_scope(acc, 0, "local")
    sch.reverse_compute_at(sch.get_sblock("out"), v)
    _stage_in_shared(sch, ("xs", "ws"), kt, tl.ny, tl.nx)
    if trans_b:
        sch.storage_align(sch.get_sblock("ws"), 0, axis=1, factor=32, offset=1)
    sch.decompose_reduction(acc, kt)


def _colsum(sch, F: int) -> None:
    """GPU definition (``gpu=True``): rows x lanes over (chunk, column) for the partial
    sums, then a block of threads per column adding its chunks' partials, each a strided
    share, then a warp-shuffle tree (``gpu_colsum_chunks`` says why)."""
    part = sch.get_sblock("part")
    _, fi = _bind_rows(sch, part)
    _in_register(sch, part, "part", fi)
    _block_per_output(sch, *sch.get_loops(sch.get_sblock("sum")))


def _matmul_tn(sch, K: int, M: int) -> None:
    """GPU definition (``gpu=True``, tiles from ``gpu_tn_tiles``): a block per (chunk of
    rows, slice of x's columns); per step it copies ``R`` rows of x and y into shared
    memory (all threads, neighbouring floats), then each thread adds their products into
    its ``ta`` x ``tb`` register tile.  The partial sums of the chunks are then added in
    a fixed order, a warp per result element.  (One thread per result element
    looping over its chunk's rows, the form before, read x and y from global memory for
    every product: 0.5 ms for a 128 x 32 gradient on arxiv-size rows on an H100.)"""
    from gcomp.codegen.dense_kernels import GPU_TN_SUM_LANES, gpu_tn_tiles
    tl = gpu_tn_tiles(K, M)
    part = sch.get_sblock("part")
    p, a, u, v, t, r = sch.get_loops(part)
    ao, ay, ai = sch.split(a, [tl.Kp // tl.BK, tl.ny, tl.ta])
    sch.reorder(p, ao, ay, v, t, r, ai, u)
    sch.bind(p, "blockIdx.x")
    sch.bind(ao, "blockIdx.y")
    sch.bind(ay, "threadIdx.y")
    sch.bind(v, "threadIdx.x")
    _in_register(sch, part, "part", v)
    _stage_in_shared(sch, ("xs", "ys"), t, tl.ny, tl.nx)
    sch.decompose_reduction(part, t)
    # a warp per result element adds its chunks' partials, each lane a strided share, then
    # warp shuffles (a fixed order).  With a thread per element walking all P partials one
    # load after another, the arxiv-size 128 x 32 gradient took 0.090 ms on an H200, 0.083
    # with the warps: the chunks' products are most of it.
    a, b, q = sch.get_loops(sch.get_sblock("sum"))
    _block_per_output(sch, sch.fuse(a, b), q, divisor_at_most(tl.P, GPU_TN_SUM_LANES))


def _elementwise(sch, name: str) -> None:
    _bind_flat(sch, sch.get_sblock(name))


def _reduce(sch, p) -> None:
    blk = sch.get_sblock("reduce")
    symbolic_axis = p["shape"][p["axis"]] == "n"
    mean = sch.get_sblock("mean") if p["op"] == "mean" else None
    loops = sch.get_loops(blk)
    n_spatial = len(loops) - 1  # the reduction loop is innermost
    if symbolic_axis:
        # a long reduction: the threads of one block share it (cross-thread reduction),
        # one block per output element
        spatial, r = loops[:n_spatial], loops[n_spatial]
        _block_per_output(sch, _fuse(sch, spatial) if spatial else sch.add_unit_loop(blk), r)
        if mean is not None:
            _bind_flat(sch, mean)
        return
    if mean is not None:  # a short reduction per output element, inside the mean's thread
        tx = _bind_flat(sch, mean)
        sch.compute_at(blk, tx)
        sch.set_scope(blk, 0, "local")
        return
    if n_spatial:
        # a short reduction per output element, in its thread: summed in a register, the
        # loop unrolled so that its loads are in flight together.  GAT's attention scores,
        # a sum over each head's 32 channels, still take about 0.1 ms a call at arxiv
        # size on an H200 (0.11 when added into global memory): each thread reads 128
        # bytes away from its neighbour's.  Lanes sharing the sum would read neighbouring
        # floats, but TVM 0.27 lowers a reduction bound to threadIdx.x under a row
        # predicate as racing stores, not warp shuffles.
        tx = _bind_loops(sch, loops[:n_spatial])
        _in_register(sch, blk, "reduce", tx)
        r_ext = _static_extent(sch, loops[-1])
        if r_ext is not None and r_ext <= 64:
            sch.unroll(loops[-1])
    else:  # a short reduction to a scalar: one thread
        unit = sch.add_unit_loop(blk)
        sch.reorder(unit, *loops)
        sch.bind(unit, "threadIdx.x")


def _softmax(sch) -> None:
    """Thread per row; the row's max and sum in registers."""
    out = sch.get_sblock("softmax")
    loops = sch.get_loops(out)
    tx = _bind_loops(sch, loops[:-1])
    for name in ("rowsum", "rowmax"):
        b = sch.get_sblock(name)
        sch.compute_at(b, tx)
        sch.set_scope(b, 0, "local")


def _row_stats(sch, tx) -> None:
    """Per-row softmax statistics of the loss, computed inside the row's thread: the
    exponentials summed as they are made (not kept in a local array, which lives in
    local memory), the maximum's loop unrolled so that the row's loads are in flight
    together (the sum then reads them from L1)."""
    sch.compute_inline(sch.get_sblock("exp"))
    for name in ("rowsum", "rowmax"):
        b = sch.get_sblock(name)
        sch.compute_at(b, tx)
        sch.set_scope(b, 0, "local")
    sch.unroll(sch.get_loops(sch.get_sblock("rowmax"))[-1])


def _chunk_sums(sch) -> None:
    """The GPU losses' sums (``dense_kernels._chunk_sums``): a thread per (chunk, term)
    summing its rows in a register, then a block of threads per term sharing the chunks'
    partials (a warp-shuffle tree)."""
    part = sch.get_sblock("part")
    tx = _bind_loops(sch, sch.get_loops(part)[:2])
    _in_register(sch, part, "part", tx)
    _block_per_output(sch, *sch.get_loops(sch.get_sblock("sums")), SCALAR_THREADS)


def _cross_entropy(sch) -> None:
    """Thread per row for the log-sum-exp (its max and sum in registers); the masked terms
    and the mask summed by row chunks (``_chunk_sums``)."""
    _row_stats(sch, _bind_flat(sch, sch.get_sblock("lse")))
    _chunk_sums(sch)
    _single_thread(sch, sch.get_sblock("loss"))


def _cross_entropy_grad(sch) -> None:
    _chunk_sums(sch)
    _bind_flat(sch, sch.get_sblock("row"))


# ---------------------------------------------------------------------- dispatch
def schedule(sch, spec) -> None:
    p = spec.p
    kind = spec.kind
    if kind == "csr_agg":
        AGG_STRATEGIES[agg_strategy(spec)](sch, spec)
    elif kind == "csr_scatter":
        _scatter(sch)
    elif kind in ("csr_segment", "csr_segment_indirect", "aggregate_max_grad"):
        _rows_accumulate(sch, "row")
    elif kind == "argmax_rows":
        _argmax(sch)
    elif kind == "edge_softmax":
        _edge_softmax(sch)
    elif kind == "attention_agg":
        _attention(sch, spec)
    elif kind in ("attention_grad_dst", "attention_grad_src"):
        _attention_grad(sch, spec)
    elif kind == "degree":
        _degree(sch, bool(p["weighted"]))
    elif kind == "take_rows":
        _elementwise(sch, "take")
    elif kind == "edge_remap":
        _elementwise(sch, "remap")
    elif kind == "scatter_max_grad":
        _elementwise(sch, "edge")
    elif kind in ("dropout", "dropout_nnz"):
        _elementwise(sch, "drop")
    elif kind == "sym_norm":
        _elementwise(sch, "norm")
    elif kind == "edge_dot":
        _edge_dot(sch)
    elif kind in ("adam", "sgd", "adam_all", "sgd_all"):
        _elementwise(sch, kind.removesuffix("_all"))
    elif kind in ("ewise", "ewise_grad", "ewise_chain", "broadcast", "slice", "transpose",
                  "sign_bits", "mask_bits"):
        _elementwise(sch, "ewise")
    elif kind == "concat":
        _elementwise(sch, "concat")
    elif kind == "matmul":
        _matmul(sch, p["K"], p["M"], p.get("trans_b", False))
    elif kind == "matmul_tn":
        _matmul_tn(sch, p["K"], p["M"])
    elif kind == "colsum":
        _colsum(sch, p["F"])
    elif kind == "reduce":
        _reduce(sch, p)
    elif kind == "softmax":
        _softmax(sch)
    elif kind == "cross_entropy":
        _cross_entropy(sch)
    elif kind == "cross_entropy_grad":
        _cross_entropy_grad(sch)
    else:
        raise KeyError(kind)
