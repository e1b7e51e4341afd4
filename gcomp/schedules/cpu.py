"""CPU (LLVM) schedules: row-parallel, feature-vectorized.

Each function takes a ``tvm.s_tir.Schedule`` holding one kernel (see
``gcomp/codegen/kernels.py``) and its spec.  Aggregation, fused attention and
edge dot products have CPU definitions of their own, loop kinds included
(``gcomp/codegen/cpu_kernels.py``), and are not scheduled here.  The common
shape of the rest: parallelize the outermost (row or edge) loop across threads,
vectorize the innermost static feature loop in chunks the vector unit holds.
Sparse kernels keep their data-dependent edge loop inside the block body, so the
vectorized feature lanes each accumulate one output element.
"""

from __future__ import annotations

VEC = 16  # floats per vectorized chunk: two AVX2 registers, one AVX-512 register
# scope of a per-iteration intermediate: TVM 0.27 keeps a "global" one under 1,024 bytes on
# the stack and allocates a "local" one from its workspace pool in every iteration
# (``cpu_kernels._scratch``; the generic 32 -> 32 product with a ReLU, one row's sums per
# iteration: 9.7 -> 7.0 ms on arxiv-size rows, AMD EPYC Zen 3, interleaved)
STACK = "global"


def _partitions(extent: int) -> bool:
    """Whether ``_vector_split`` must partition a loop of ``extent``: no vector width
    (VEC, 8 or 4, all multiples of 4) divides it."""
    return extent > 1 and extent % 4 != 0


def _vector_split(sch, loop, extent: int) -> bool:
    """Vectorize ``loop`` (static ``extent``) whole if small, else in VEC-wide chunks.
    True when the loop had to be partitioned (its block is then two blocks)."""
    if extent <= 1:
        return False
    if not _partitions(extent):
        if extent <= 2 * VEC:
            sch.vectorize(loop)
        else:
            _, inner = sch.split(loop, [None, next(w for w in (VEC, 8, 4) if extent % w == 0)])
            sch.vectorize(inner)
        return False
    # odd widths (e.g. Cora's 1433 features): a predicated split would run scalar (measured
    # 20x slower), so the loop is partitioned into a divisible part, vectorized, and a tail
    try:
        main, _tail = sch.loop_partition(loop, [extent - extent % VEC, None])
    except Exception:  # noqa: BLE001 - TVM refuses some blocks (nested edge loops): keep one loop
        main = loop
    _, inner = sch.split(main, [None, VEC])
    sch.vectorize(inner)
    return True


def _rows(sch, block: str, feature_extent: int | None):
    blk = sch.get_sblock(block)
    loops = sch.get_loops(blk)
    if feature_extent is not None and len(loops) >= 2:
        _vector_split(sch, loops[-1], feature_extent)
    sch.parallel(loops[0])


def schedule(sch, spec) -> None:
    p = spec.p
    kind = spec.kind
    if kind == "csr_segment":
        _rows(sch, "row", p["F"])
    elif kind == "take_rows":
        _rows(sch, "take", p["F"])
    elif kind == "edge_remap":
        _rows(sch, "remap", p["F"])
    elif kind == "csr_segment_indirect":
        _rows(sch, "row", p["F"])
    elif kind in ("aggregate_max_grad",):
        _rows(sch, "row", p["F"])
    elif kind == "scatter_max_grad":
        _rows(sch, "edge", p["F"])
    elif kind == "dropout":
        _rows(sch, "drop", p["F"])
    elif kind == "dropout_nnz":
        outer, inner = sch.split(sch.get_loops(sch.get_sblock("drop"))[0], [None, 1024])
        sch.parallel(outer)
    elif kind == "argmax_rows":  # data-dependent updates: rows in parallel only
        sch.parallel(sch.get_loops(sch.get_sblock("row"))[0])
    elif kind == "cross_entropy":
        _loss_rows(sch, p["C"])
    elif kind == "cross_entropy_grad":
        _loss_grad_rows(sch, p["C"])
    elif kind == "colsum":
        blk = sch.get_sblock("part")
        p_loop, f_loop = sch.get_loops(blk)
        sch.parallel(p_loop)
        _vector_split(sch, f_loop, spec.p["F"])
    elif kind == "matmul_tn":
        _matmul_tn(sch, p["K"] + int(p.get("sum_row", False)), p["M"])
    elif kind in ("adam", "sgd"):
        _flat_update(sch, kind, p["S"])
    elif kind == "edge_softmax":
        sch.parallel(sch.get_loops(sch.get_sblock("row"))[0])
    elif kind == "degree":
        sch.parallel(sch.get_loops(sch.get_sblock("deg"))[0])
    elif kind == "sym_norm":
        sch.parallel(sch.get_loops(sch.get_sblock("norm"))[0])
    elif kind == "matmul":
        _matmul(sch, p["M"], bool(p.get("epilogue")))
    elif kind in ("ewise", "ewise_grad", "ewise_chain", "broadcast", "slice", "transpose",
                  "sign_bits", "mask_bits"):
        _elementwise(sch, "ewise")
    elif kind == "concat":
        _elementwise(sch, "concat")
    elif kind == "reduce":
        _reduce(sch, p)
    elif kind == "softmax":
        _softmax(sch)
    else:
        raise KeyError(kind)


def _matmul(sch, M: int, epilogue: bool) -> None:
    blk = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(blk)
    io, ii = sch.split(i, [None, 16])
    sch.reorder(io, ii, k, j)
    sch.parallel(io)
    if epilogue:  # applied per row while the row is hot; the sum, an intermediate of
        # scope STACK, is compacted to that row and lives on the stack
        sch.reverse_compute_at(sch.get_sblock("epilogue"), ii)
    partitioned = _vector_split(sch, j, M)
    if epilogue:
        _vector_split(sch, sch.get_loops(sch.get_sblock("epilogue"))[-1], M)
    if not partitioned:  # an odd width split the block in two, each keeping its init
        sch.decompose_reduction(blk, k)


def _matmul_tn(sch, K: int, M: int) -> None:
    """Chunks in parallel; within a chunk, a TA x TB tile of the [K, M] partial sum
    accumulates in registers (vectorized over M) while the chunk's rows stream past: the
    untiled loop loaded and stored the whole partial sum for every input row.  Wide
    outputs are cut into 32-column tiles of 8 rows (at 128 x 128 on arxiv-synth, 75 -> 57
    ms: the 4 x 128 tile did not fit in the registers), narrow ones keep whole rows."""
    blk = sch.get_sblock("part")
    p, a, b, r = sch.get_loops(blk)
    if M > 32 and M % 32 == 0 and K % 8 == 0:
        ta, tb = 8, 32
    else:
        ta, tb = next(t for t in (4, 2, 1) if K % t == 0), M
    a0, a1 = sch.split(a, [None, ta])
    b0, b1 = sch.split(b, [None, tb])
    sch.reorder(p, a0, b0, r, a1, b1)
    sch.parallel(p)
    if _partitions(tb):  # odd widths: partitioning would split the block under the steps below
        return
    acc = sch.cache_write(blk, 0, STACK)
    sch.reverse_compute_at(acc, b0)
    _vector_split(sch, sch.get_loops(acc)[-1], tb)
    sch.unroll(a1)
    _vector_split(sch, b1, tb)
    sch.decompose_reduction(blk, r)
    _vector_split(sch, sch.get_loops(sch.get_sblock("part_init"))[-1], tb)


def _static_extent(sch, loop):
    ext = sch.get(loop).extent
    return int(ext) if hasattr(ext, "value") or isinstance(ext, int) else None


def _elementwise(sch, name: str) -> None:
    blk = sch.get_sblock(name)
    loops = sch.get_loops(blk)
    if not loops:
        return
    if _static_extent(sch, loops[0]) is not None:
        return  # a small static tensor (parameter arithmetic): serial is fastest
    if len(loops) > 1:  # symbolic leading axis: rows in parallel, static rest vectorized
        inner = sch.fuse(*loops[1:]) if len(loops) > 2 else loops[1]
        _vector_split(sch, inner, _static_extent(sch, inner))
    sch.parallel(loops[0])


def _reduce(sch, p) -> None:
    blk = sch.get_sblock("reduce")
    loops = sch.get_loops(blk)
    last = p["shape"][-1]
    rows = _static_extent(sch, loops[0]) is None and p["axis"] % len(p["shape"]) != 0
    if rows and p["axis"] % len(p["shape"]) == len(p["shape"]) - 1 and last % 8 == 0:
        # over the static last axis (GAT's per-head scores): V lanes of partial results
        # (rfactor), vectorized, then combined; the plain loop is scalar (measured 12.5 ->
        # 2.5 ms for [169343, 4, 32] -> [169343, 4])
        _, ri = sch.split(loops[-1], [None, VEC if last % VEC == 0 else 8])
        rf = sch.rfactor(ri, 0)
        sch.vectorize(sch.get_loops(rf)[-1])
        row = sch.get_loops(sch.get_sblock("reduce"))[0]
        sch.compute_at(rf, row)
        sch.parallel(row)
    elif rows:
        sch.parallel(loops[0])
    if p["op"] == "mean":
        mean = sch.get_sblock("mean")
        mloops = sch.get_loops(mean)
        if mloops and _static_extent(sch, mloops[0]) is None:
            sch.parallel(mloops[0])


def _softmax(sch) -> None:
    out = sch.get_sblock("softmax")
    loops = sch.get_loops(out)
    row = loops[0]
    if len(loops) > 2:
        row = sch.fuse(*loops[:-1])
    sch.compute_at(sch.get_sblock("rowsum"), row)
    sch.compute_at(sch.get_sblock("rowmax"), row)
    if _static_extent(sch, sch.get_loops(out)[0]) is None or len(loops) > 2:
        sch.parallel(row)


def _flat_update(sch, block: str, size: int) -> None:
    """Optimizer updates: one loop over a parameter's values, vectorized, threaded when large."""
    loop = sch.get_loops(sch.get_sblock(block))[0]
    width = next((w for w in (VEC, 8, 4) if size % w == 0), None)
    if width is None:
        if size >= 1 << 14:
            sch.parallel(loop)
        return
    outer, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)
    if size >= 1 << 14:
        sch.parallel(outer)


def _loss_rows(sch, C: int) -> None:
    """Loss kernel: each row's max and sum of exps computed inside its log-sum-exp (scalars;
    the exps vectorize over classes), rows in parallel."""
    lse = sch.get_sblock("lse")
    i = sch.get_loops(lse)[0]
    for name in ("rowsum", "exp", "rowmax"):
        sch.compute_at(sch.get_sblock(name), i)
    _vector_split(sch, sch.get_loops(sch.get_sblock("exp"))[-1], C)
    sch.parallel(i)


def _loss_grad_rows(sch, C: int) -> None:
    """Loss gradient: rows in parallel, classes vectorized."""
    i, c = sch.get_loops(sch.get_sblock("row"))
    _vector_split(sch, c, C)
    sch.parallel(i)
