"""Dense products on Intel AMX tiles, for bfloat16 activations (``--precision bf16``).

A CPU with AMX-BF16 (Intel Sapphire Rapids and later) multiplies a 16 x 32 bfloat16
tile by a 32 x 16 one into 16 x 16 float32 sums in one instruction (``tdpbf16ps``):
the 32-wide products of a GNN layer stop being compute bound.  The row-group kernel of
``cpu_kernels.matmul`` widens each bfloat16 value and multiplies in float32; on tiles,
arxiv-size rows read from memory (2 threads, ``python -m bench.amx``), 32 -> 32 takes
1.0 ms instead of 2.0 and 128 -> 32 2.5 instead of 6.4.  Here: that product (``matmul_amx``), the weight gradient
``x.T @ y`` for long x rows (``matmul_tn_amx``), and the feed-time rounding of the node
features that lets the first layer's products use the tiles too (``round_rows``).

The weight is rounded to bfloat16 for the product (as PyTorch's autocast does); sums
stay float32, and the epilogue runs on the float32 sums.  The product kernel:

* per range of rows (``CHUNKS`` in parallel): configures the tiles (``ldtilecfg``), and
  packs the float32 weight into bfloat16 pairs along k (the layout the instruction reads:
  ``wp[k // 2, 2 j + k % 2] = w[k, j]``, columns padded to a multiple of 16 with zeros);
* per group of 16 rows and block of columns: for each k range of up to 32, loads the
  rows' x tile and, for each 16 columns, the weight tile, multiplied into that column
  tile's sums; stores the sums to a local [16, M] block, then applies the epilogue row by
  row;
* rows past the last full group (fewer than 16) are multiplied in vector registers.

Tiles: one x and one weight tile per k range shape (32, and the rest when 32 does not
divide K), and the rest of the hardware's eight for sums, 16 output columns each: wider
outputs are multiplied in column blocks of that many tiles, the group's x tiles loaded
again (from L1) per block.
Linux grants the tile state per process on request (``runtime/cpu_features.py``), which
the artifact does when it loads a library built with AMX.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.cpu_kernels import _features, _if, _prefetch_share, _row_range
from gcomp.codegen.bf16_pairs import pack_weight_pairs, product_args
from gcomp.codegen.kernels import arg, bound, definer, stored_bf16

ROWS = 16      # rows of an x tile and of a sums tile
COLS = 16      # float32 columns of a sums tile
KMAX = 32      # bfloat16 values of one x tile row (64 bytes)
MAX_TILES = 8
CHUNKS = 16    # row ranges in parallel (>= threads, for balance)


def k_ranges(K: int) -> list[tuple[int, int]]:
    """(first k, width) of the k ranges one tile each covers."""
    return [(k, min(KMAX, K - k)) for k in range(0, K, KMAX)]


def supported(K: int, M: int) -> bool:
    """Whether the tiles hold a K -> M product: K even (values pair up along k)."""
    return K >= 2 and K % 2 == 0 and M >= 1


def _column_blocks(K: int, M: int) -> list[tuple[int, int]]:
    """(first sums tile, tiles) of the column blocks a group of rows is multiplied in:
    the tiles an x and a weight tile per k range shape leave for sums (at most 8 in all)."""
    MT = -(-M // COLS)
    per = min(MT, MAX_TILES - 2 * len({w for _, w in k_ranges(K)}))
    return [(b, min(per, MT - b)) for b in range(0, MT, per)]


def _intrin(name: str, *args) -> None:
    T.evaluate(tirx.call_llvm_intrin("void", name, *args))


def _tile(t: int):
    return tirx.const(t, "int8")


def matmul_amx(K: int, M: int, epilogue: tuple, extras: tuple):
    """out = epilogue(x @ w) with x stored as bfloat16 (see the module docstring).  (A
    float32 x rounded into a tile 16 rows at a time took as long as the float32 kernel,
    7.2 ms for 128 -> 32 on arxiv-size rows: the rounding, not the product, bounds it.)"""
    f32, u16 = "float32", "uint16"
    MT = -(-M // COLS)          # sums tiles
    MP = MT * COLS              # padded columns of the packed weight and the sums block
    ranges = k_ranges(K)
    widths = sorted({w for _, w in ranges}, reverse=True)
    blocks = _column_blocks(K, M)
    CB = blocks[0][1]           # sums tiles, numbered from 0
    x_tile = {w: CB + 2 * s for s, w in enumerate(widths)}   # tile numbers per k width
    w_tile = {w: CB + 2 * s + 1 for s, w in enumerate(widths)}
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul")
            T.func_attr({"tirx.noalias": True})
            n, ((x, w, _),), extra, out = product_args(K, M, extras)
            # the tile loads read raw bfloat16 bits: an alias of x's data as uint16 keeps
            # TVM's bfloat16 legalization away from the pointer arithmetic
            xb = T.decl_buffer((n, K), u16, data=x.data)
            groups = T.Bind(n // ROWS)
            with T.parallel(0, CHUNKS) as p:
                wp = pack_weight_pairs(w, K, M, MP)
                wpb = T.decl_buffer((K // 2, 2 * MP), u16, data=wp.data)
                sums = T.alloc_buffer((ROWS, MP), f32, scope="local")
                shapes = {t: (ROWS, 4 * COLS) for t in range(CB)}
                shapes.update({t: (ROWS, 2 * kw) for kw, t in x_tile.items()})
                shapes.update({t: (kw // 2, 4 * COLS) for kw, t in w_tile.items()})
                _load_tile_config(shapes)
                lo, hi = _row_range(groups, p, CHUNKS)
                with T.serial(0, hi - lo) as gi:
                    row0 = (lo + gi) * ROWS
                    for b0, nb in blocks:  # the x tiles are reloaded from L1 per block
                        for t in range(nb):
                            _intrin("llvm.x86.tilezero", _tile(t))
                        for k0, kw in ranges:
                            _intrin("llvm.x86.tileloadd64", _tile(x_tile[kw]),
                                    xb.access_ptr("r", offset=row0 * K + k0),
                                    tirx.const(2 * K, "int64"))
                            for t in range(nb):
                                _intrin("llvm.x86.tileloadd64", _tile(w_tile[kw]),
                                        wpb.access_ptr("r", offset=(k0 // 2) * 2 * MP
                                                       + 2 * COLS * (b0 + t)),
                                        tirx.const(4 * MP, "int64"))
                                _intrin("llvm.x86.tdpbf16ps", _tile(t), _tile(x_tile[kw]),
                                        _tile(w_tile[kw]))
                        for t in range(nb):
                            _intrin("llvm.x86.tilestored64", _tile(t),
                                    sums.access_ptr("w", offset=COLS * (b0 + t)),
                                    tirx.const(4 * MP, "int64"))
                    with T.serial(0, ROWS) as r:
                        _store_row(out, extra, extras, epilogue, row0 + r, M,
                                   lambda j, r=r: sums[r, j])
                _intrin("llvm.x86.tilerelease")
                with T.If(p == CHUNKS - 1):  # the last rows, fewer than a group
                    with T.Then():
                        with T.serial(0, n - groups * ROWS) as r:
                            i = groups * ROWS + r
                            row = T.alloc_buffer((MP,), f32, scope="local")
                            _features(MP, lambda j: T.buffer_store(row, tirx.const(0.0, f32),
                                                                   [j]))
                            with T.serial(0, K) as k:
                                _features(MP, lambda j, k=k: T.buffer_store(
                                    row, row[j] + tirx.Cast(f32, x[i, k])
                                    * tirx.Cast(f32, wp[k // 2, 2 * j + k % 2]), [j]))
                            _store_row(out, extra, extras, epilogue, i, M, lambda j: row[j])
    return ib.get()


def _load_tile_config(shapes: dict) -> None:
    """Configure this thread's tiles (``ldtilecfg``): the 64-byte configuration, palette 1,
    with each tile's (rows, bytes per row) from ``shapes`` (tile -> shape)."""
    cfg = T.alloc_buffer((64,), "uint8", scope="local")
    with T.serial(0, 64) as b:
        T.buffer_store(cfg, tirx.const(0, "uint8"), [b])
    T.buffer_store(cfg, tirx.const(1, "uint8"), [0])
    for t, (rows, colsb) in shapes.items():
        T.buffer_store(cfg, tirx.const(colsb & 255, "uint8"), [16 + 2 * t])
        T.buffer_store(cfg, tirx.const(colsb >> 8, "uint8"), [17 + 2 * t])
        T.buffer_store(cfg, tirx.const(rows, "uint8"), [48 + t])
    _intrin("llvm.x86.ldtilecfg", cfg.access_ptr("r"))


def _store_row(out, extra, extras, epilogue, i, M: int, value) -> None:
    """out[i, :] = epilogue(value(j)), vectorized over the columns."""
    def store(j):
        res = epi.apply(epilogue, value(j), lambda e: extra[e][epi.index(extras[e], i, j)])
        T.buffer_store(out, res, [i, j])
    _features(M, store)


# ---------------------------------------------------------------- weight gradients
SUPER = 128    # rows packed at a time by the weight-gradient kernel


LANES = 16     # uint32 lanes of one AVX-512 gather


def _gather(flat, first, stride: int):
    """``flat[first + stride * lane]`` for 16 lanes (``vpgatherdd``), as uint32."""
    lanes = tirx.Ramp(tirx.const(0, "int32"), tirx.const(stride, "int32"), LANES)
    v = tirx.call_llvm_intrin(f"int32x{LANES}", "llvm.x86.avx512.mask.gather.dpi.512",
                              tirx.Broadcast(tirx.const(0, "int32"), LANES),
                              tirx.address_of(flat[first]), lanes,
                              tirx.Broadcast(tirx.const(True, "bool"), LANES),
                              tirx.const(4, "int32"))
    return tirx.reinterpret(f"uint32x{LANES}", v)


def gathers_y(M: int) -> bool:
    """Whether the weight gradient being defined packs y.T by gathers
    (``_pack_transposed``): y stored as bfloat16, its columns in uint32 pairs."""
    return stored_bf16("y") and M % 2 == 0


def _pack_transposed(ypk, y, p, r0, n, M: int, Q: int) -> None:
    """``ypk[p, m, q]`` = rows r0 + 2q and r0 + 2q + 1 of bfloat16 ``y`` at column m (the
    first low), for the 2Q rows from r0, all of them rows of y; M even.  Read as uint32
    column pairs, 16 row pairs at a time: the two gathers of a column pair's low and high
    rows give both columns' pairs with four bit operations.  Written one pair at a time
    (two scalar loads, shifts and a store each), y.T made the tiles slower than the
    float32 kernel for short x rows (``tn_shape``)."""
    u32 = "uint32"
    flat = T.decl_buffer((n * (M // 2),), u32, data=y.data)
    low16 = tirx.Broadcast(tirx.const(0xFFFF, u32), LANES)
    shift = tirx.Broadcast(tirx.const(16, u32), LANES)
    with T.serial(0, Q // LANES) as g:
        with T.serial(0, M // 2) as c:
            row = r0 + 2 * LANES * g
            lo_rows = T.Bind(_gather(flat, row * (M // 2) + c, M))
            hi_rows = T.Bind(_gather(flat, (row + 1) * (M // 2) + c, M))
            lanes = tirx.Ramp(g * LANES, tirx.const(1, "int64"), LANES)
            T.buffer_store(ypk, (lo_rows & low16) | (hi_rows << shift), [p, 2 * c, lanes])
            T.buffer_store(ypk, (lo_rows >> shift) | (hi_rows & (low16 << shift)),
                           [p, 2 * c + 1, lanes])


def tn_shape(K: int, M: int, gathered: bool = False) -> tuple[int, int, int] | None:
    """(padded M, padded K, k columns per pass) of the weight-gradient kernel, or None
    where its tiles do not fit or it is slower: out.T = y.T @ x is computed, y.T in M / 16
    row tiles and the sums of KC columns in (M / 16) x (KC / 16) tiles, with one x tile:
    at most 8.  ``gathered``: x and y are both stored as bfloat16 and M is even, so y.T is
    packed by gathers (``_pack_transposed``).  Packing the rows costs about as much
    whatever K is, so short x rows stay with the float32 kernel unless y is gathered
    (arxiv-size rows, Intel Xeon, 2 threads: 128 x 32 both bfloat16 7.5 -> 3.7 ms, x
    float32 8.6 -> 6.6; y packed one value at a time, 32 x 32 1.7 -> 2.4 and 32 x 40
    with y float32 3.6 -> 4.0; gathered, 32 x 32 1.53 -> 0.84 and 32 x 40 3.04 -> 1.09)."""
    if K < (32 if gathered else 64):
        return None
    MP, KP = -(-M // COLS) * COLS, -(-K // COLS) * COLS
    rows = MP // COLS
    for KC in (64, 48, 32, 16):
        if KP % KC == 0 and rows + 1 + rows * (KC // COLS) <= MAX_TILES:
            return MP, KP, KC
    return None


def tn_tiles(K: int, M: int) -> tuple[int, int, int] | None:
    """``tn_shape`` for the weight gradient being defined, by how its operands are
    stored."""
    return tn_shape(K, M, stored_bf16("x") and gathers_y(M))


def _bits(buf, raw, i, j, valid):
    """The bfloat16 bits of buf[i, j] as uint32 (0 where ``valid`` fails): read from
    ``raw`` (buf's data as uint16) where buf is stored as bfloat16, else the float32 value
    rounded to nearest even."""
    u32 = "uint32"
    if raw is not None:
        v = tirx.Cast(u32, raw[i, j])
    else:
        u = tirx.reinterpret(u32, buf[i, j])
        v = (u + tirx.const(0x7FFF, u32) + ((u >> tirx.const(16, u32)) & tirx.const(1, u32))) \
            >> tirx.const(16, u32)
    return tirx.if_then_else(valid, v, tirx.const(0, u32))


def _pair(buf, raw, i, j, hi, n, width: int):
    """Rows i and i + 1 of buf at column j as one uint32 of two bfloat16 (row i low), zero
    past row ``hi`` or column ``width``; reads clamp to the last row and column."""
    u32 = "uint32"
    col = tirx.min(j, width - 1)
    lo_ = _bits(buf, raw, tirx.min(i, n - 1), col, (i < hi) & (j < width))
    hi_ = _bits(buf, raw, tirx.min(i + 1, n - 1), col, (i + 1 < hi) & (j < width))
    return lo_ | (hi_ << tirx.const(16, u32))


def _pack_y(ypk, y, yr, p, r0, hi, n, M: int, MP: int, Q: int, gather: bool) -> None:
    """y.T for the ``2 Q`` rows from r0 into ``ypk[p]``: rows m < M, pairs of rows of y
    (rows past ``hi`` zero); by gathers where ``gather`` and all the rows are y's."""
    def one_by_one():
        with T.serial(0, Q) as q:
            with T.serial(0, MP) as m:
                T.buffer_store(ypk, _pair(y, yr, r0 + 2 * q, m, hi, n, M), [p, m, q])
    if not gather:
        one_by_one()
        return
    with T.If(r0 + 2 * Q <= hi):
        with T.Then():
            _pack_transposed(ypk, y, p, r0, n, M, Q)
        with T.Else():
            one_by_one()


def _pack_x(xpk, x, xr, p, q, i, hi, n, K: int, KP: int) -> None:
    """``xpk[p, q]`` = rows i and i + 1 of x interleaved (zeros past ``hi`` and K).  Both
    rows in range, bfloat16 and no padding: two vector loads and a shift, without the
    clamps and zero fills (128 x 32 on arxiv-size rows, 2.11 -> 1.98 ms)."""
    u32 = "uint32"

    def checked():
        with T.vectorized(0, KP) as k:
            T.buffer_store(xpk, _pair(x, xr, i, k, hi, n, K), [p, q, k])
    if xr is None or K != KP:
        checked()
        return
    with T.If(i + 1 < hi):
        with T.Then():
            with T.vectorized(0, KP) as k:
                T.buffer_store(xpk, tirx.Cast(u32, xr[i, k])
                               | (tirx.Cast(u32, xr[i + 1, k]) << tirx.const(16, u32)),
                               [p, q, k])
        with T.Else():
            checked()


def matmul_tn_amx(K: int, M: int, chunks: int):
    """out = x.T @ y (x: [n, K], y: [n, M]; either stored as bfloat16 or rounded to it) on
    tiles.  The reduction runs over rows, which the tile instruction wants paired along its
    rows: per ``SUPER`` rows of its range, a thread packs y.T (pairs of rows of y, each
    column a row of the packed block; by gathers, ``_pack_transposed``, where y is
    bfloat16) and x (pairs of rows interleaved), zeros past the range; then for each KC
    columns of the result it loads that part of its partial sum (out.T, in tiles), adds
    the packed rows 32 at a time and stores it back, asking meanwhile, a share per 32
    rows, for the next SUPER rows' lines into L2 (the tiles leave the load ports idle; the
    packing then reads from L2: arxiv-size rows read from memory, Intel Xeon, 2 threads,
    32 x 32 1.44 -> 1.08 ms, 32 x 40 1.81 -> 1.39, 128 x 32 3.40 -> 3.24; prefetching two
    or four blocks ahead, or into L1, did no better).  The ranges' partial sums are added
    up at the end, transposed (deterministic)."""
    f32, u32 = "float32", "uint32"
    MP, KP, KC = tn_tiles(K, M)
    NA, NK = MP // COLS, KC // COLS    # y.T row tiles; sums tiles per row tile
    b_tile = NA + NA * NK             # tiles: sums 0 .. NA*NK-1, y.T, then x
    P, Q = chunks, SUPER // 2
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul_tn")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            x = arg("x", (n, K), f32)
            y = arg("y", (n, M), f32)
            out = arg("out", (K, M), f32)
            xr, yr = (T.decl_buffer(b.shape, "uint16", data=b.data) if stored_bf16(name)
                      else None for b, name in ((x, "x"), (y, "y")))
            part = T.alloc_buffer((P, MP, KP), f32)
            ypk = T.alloc_buffer((P, MP, Q), u32)   # y.T, pairs of rows
            xpk = T.alloc_buffer((P, Q, KP), u32)   # x, pairs of rows
            with T.parallel(0, P) as p:
                lo, hi = _row_range(n, p, P)
                _load_tile_config({t: (ROWS, 4 * COLS) for t in range(b_tile + 1)})
                with T.grid(MP, KP) as (a, b):
                    T.buffer_store(part, tirx.const(0.0, f32), [p, a, b])
                gather = gathers_y(M)
                if gather:  # y.T's padding rows: zero once, the gathers never write them
                    with T.grid(MP - M, Q) as (m, q):
                        T.buffer_store(ypk, tirx.const(0, u32), [p, M + m, q])
                with T.serial(0, (hi - lo + SUPER - 1) // SUPER) as sb:
                    r0 = lo + sb * SUPER
                    _pack_y(ypk, y, yr, p, r0, hi, n, M, MP, Q, gather)
                    with T.serial(0, Q) as q:
                        _pack_x(xpk, x, xr, p, q, r0 + 2 * q, hi, n, K, KP)
                    with T.serial(0, KP // KC) as kc:
                        for a in range(NA):
                            for c in range(NK):
                                _intrin("llvm.x86.tileloadd64", _tile(a * NK + c),
                                        part.access_ptr("r", offset=(p * MP + a * COLS) * KP
                                                        + kc * KC + c * COLS),
                                        tirx.const(4 * KP, "int64"))
                        for sub in range(SUPER // 32):
                            _prefetch_share([(x, K), (y, M)], r0 + SUPER, SUPER, n,
                                            kc * (SUPER // 32) + sub,
                                            (KP // KC) * (SUPER // 32), locality=2)
                            for a in range(NA):
                                _intrin("llvm.x86.tileloadd64", _tile(NA * NK + a),
                                        ypk.access_ptr("r", offset=(p * MP + a * COLS) * Q
                                                       + sub * ROWS),
                                        tirx.const(4 * Q, "int64"))
                            for c in range(NK):
                                _intrin("llvm.x86.tileloadd64", _tile(b_tile),
                                        xpk.access_ptr("r", offset=(p * Q + sub * ROWS) * KP
                                                       + kc * KC + c * COLS),
                                        tirx.const(4 * KP, "int64"))
                                for a in range(NA):
                                    _intrin("llvm.x86.tdpbf16ps", _tile(a * NK + c),
                                            _tile(NA * NK + a), _tile(b_tile))
                        for a in range(NA):
                            for c in range(NK):
                                _intrin("llvm.x86.tilestored64", _tile(a * NK + c),
                                        part.access_ptr("w", offset=(p * MP + a * COLS) * KP
                                                        + kc * KC + c * COLS),
                                        tirx.const(4 * KP, "int64"))
                _intrin("llvm.x86.tilerelease")
            with T.parallel(0, K) as k:
                _features(M, lambda m: T.buffer_store(out, part[0, m, k], [k, m]))
                with T.serial(1, P) as q:
                    _features(M, lambda m: T.buffer_store(out, out[k, m] + part[q, m, k],
                                                          [k, m]))
    return ib.get()


@definer("round_rows", target="llvm")
def round_rows(F: int, x_order: bool = False):
    """out = x, stored as its spec says (bfloat16: rounded once): the node features'
    bfloat16 copy that the tile products read, made when features are fed
    (``precision._round_features``).  Rows in parallel; any 4-byte alignment of x, so
    the caller's array is read where it is.  ``x_order``: x [nx, F] in another row
    order, its row j being row ``rows[j]`` of out (none where that is n or more), as
    ``cpu_kernels.matmul``'s (``caller_order.py``)."""
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("round_rows")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            nx = tirx.Var("nx", "int64") if x_order else n
            x = arg("x", (nx, F), "float32")
            out = arg("out", (n, F), "float32")
            rows = arg("rows", (nx,), "int64") if x_order else None
            with T.parallel(0, CHUNKS) as p:
                lo, hi = _row_range(nx, p, CHUNKS)
                with T.serial(0, hi - lo) as r:
                    j = lo + r
                    if rows is None:
                        _features(F, lambda f: T.buffer_store(out, x[j, f], [j, f]))
                    else:
                        i = bound(rows[j])
                        with _if(i < n):
                            _features(F, lambda f: T.buffer_store(out, x[j, f], [i, f]))
    return ib.get()
