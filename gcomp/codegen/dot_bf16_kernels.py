"""Dense products on AVX-512 BF16 dot products, for bfloat16 activations on a CPU
without AMX tiles (``--precision bf16`` on AMD Zen 4 and later).

``vdpbf16ps`` multiplies 16 pairs of bfloat16 values by 16 other pairs and adds each
pair's two products to one of 16 float32 sums: 32 multiply-adds per instruction where a
float32 ``vfmadd`` does 16.  The row-group kernel of ``cpu_kernels.matmul`` widens each
bfloat16 value and multiplies in float32, slower than float32 itself; here the pairs go
to the instruction as they are.

TVM 0.27 cannot call the instruction: its LLVM intrinsic takes vectors of LLVM's
``bfloat`` type, and TVM passes bfloat16 vectors as 16-bit integers, which LLVM's
verifier refuses.  So the kernels import small LLVM functions (``DOT_LL``, through
TVM's ``pragma_import_llvm``) that take pointers, convert the types LLVM-side and are
always inlined: a kernel calls ``DOT`` by name (``call_extern``) on the addresses of a
row's sums, an x pair and a packed weight vector, and after inlining the sums stay in
registers (one ``vbroadcastss`` of the x pair per row, one ``vdpbf16ps`` per 16
columns); ``PAIR`` functions interleave two rows into pairs for the weight gradient;
``ROUND`` functions round float32 sums to a bfloat16 output (``store_rounded``).

``matmul_dot``: out = epilogue(x @ w) with x stored as bfloat16 (the same arguments as
``cpu_kernels.matmul``).  The weight is rounded to bfloat16 (as on AMX tiles and under
PyTorch's autocast) and packed in pairs along k, ``wp[k // 2, 2 j + k % 2] = w[k, j]``,
columns padded to 16 with zeros, by each of ``CHUNKS`` row ranges run in parallel; a
range multiplies a group of rows at a time, each row's sums for a tile of up to 64
columns in registers (whole tiles in a loop, then the rest: ``_tiles``), and prefetches
the rows ahead as the row-group kernel does.  Sums are float32, the epilogue runs on them, and a bfloat16 output is
rounded once.

``matmul_tn_dot``: the weight gradient x.T @ y with x or y (or both) stored as
bfloat16, in pairs of rows (its docstring).

Measured (AMD EPYC Zen 4, arxiv-size rows, 2 threads, interleaved calls after 256 MB of
other writes; float32 kernel / bfloat16 widened to float32 / these): x @ W 128 -> 32 6.3 /
6.4 / 3.4 ms, 32 -> 32 1.6 / 1.8 / 1.0, 32 -> 40 2.0 / 2.6 / 1.4, 128 -> 128 26.4 / 25.2 /
12.7; x.T @ dY 128 x 32 6.9 / 7.1 / 3.7-3.9, 32 x 32 1.9 / 1.9 / 1.0, 32 x 40 2.1 / 3.0
/ 1.6-1.9 (1.45 since its tiles hold 4 rows: ``TN_ACCUMULATORS``), 128 x 128 24.5 / 26.7
/ 13.6.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.cpu_kernels import (MM_AHEAD_BYTES, MM_SHARE_K, _features, _if,
                                       _prefetch_share, _row_range, _scratch)
from gcomp.codegen.bf16_pairs import pack_weight_pairs, product_args
from gcomp.codegen.kernels import arg, importing_llvm, stored_bf16

LANES = 16       # float32 sums per instruction
TILE = 64        # columns of sums a group of rows keeps in registers at a time
ACCUMULATORS = 24  # of the 32 vector registers, for sums (the rest: weights, x pairs)
# at most this many in a weight gradient's tile: tiles of 8 rows x 3 vectors (24 sums)
# were slower than 4 x 3 although a block is then read twice as often (AMD EPYC Zen 4,
# arxiv-size rows, 2 threads, interleaved cold calls: x.T @ dY 32 x 40 1.84-1.87 -> 1.46-
# 1.47 ms, with the bias row 2.00 -> 1.50; 64 x 48 2.90 -> 2.76; 128 x 40 unchanged);
# 8 x 2 (32 x 32: 1.04 ms, 4 x 2 1.11) and 8 x 1 stay.  The float32 kernel's tiles
# (``cpu_kernels._TN_TILES``) hold 16 too.
TN_ACCUMULATORS = 16
CHUNKS = 16      # row ranges in parallel (>= threads, for balance)
DOT = "gcomp_dpbf16"  # the imported function, and how a kernel is recognized as using it

PAIR = "gcomp_pair_"  # dst[2 c + e] = bfloat16 of (a, b)[e][c], c < 16: two rows interleaved
_INTERLEAVE = ", ".join(f"i32 {c + 16 * e}" for c in range(LANES) for e in range(2))
# acc[0:16] += pairs of the bfloat16 pair at x (broadcast) times the 32 bfloat16 at w
DOT_LL = f"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
define linkonce_odr void @{DOT}(ptr %acc, ptr %x, ptr %w) alwaysinline {{
  %a = load <16 x float>, ptr %acc, align 4
  %p = load i32, ptr %x, align 2
  %p1 = insertelement <16 x i32> poison, i32 %p, i64 0
  %ps = shufflevector <16 x i32> %p1, <16 x i32> poison, <16 x i32> zeroinitializer
  %xb = bitcast <16 x i32> %ps to <32 x bfloat>
  %wb = load <32 x bfloat>, ptr %w, align 2
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %a, <32 x bfloat> %xb, <32 x bfloat> %wb)
  store <16 x float> %r, ptr %acc, align 4
  ret void
}}
define linkonce_odr void @{PAIR}bf16(ptr %dst, ptr %a, ptr %b) alwaysinline {{
  %va = load <16 x i16>, ptr %a, align 2
  %vb = load <16 x i16>, ptr %b, align 2
  %r = shufflevector <16 x i16> %va, <16 x i16> %vb, <32 x i32> <{_INTERLEAVE}>
  store <32 x i16> %r, ptr %dst, align 2
  ret void
}}
define linkonce_odr void @{PAIR}float32(ptr %dst, ptr %a, ptr %b) alwaysinline {{
  %va = load <16 x float>, ptr %a, align 4
  %vb = load <16 x float>, ptr %b, align 4
  %ta = fptrunc <16 x float> %va to <16 x bfloat>
  %tb = fptrunc <16 x float> %vb to <16 x bfloat>
  %r = shufflevector <16 x bfloat> %ta, <16 x bfloat> %tb, <32 x i32> <{_INTERLEAVE}>
  store <32 x bfloat> %r, ptr %dst, align 2
  ret void
}}
"""


# dst[0:L] = src[0:L] (float32) rounded to bfloat16, L = 16 or 8: LLVM's ``fptrunc``, one
# ``vcvtneps2bf16`` on these CPUs, where TVM rounds with integer operations (``store_rounded``)
ROUND = "gcomp_round"
ROUND_LL = "".join(f"""
define linkonce_odr void @{ROUND}{w}(ptr %dst, ptr %src) alwaysinline {{
  %v = load <{w} x float>, ptr %src, align 4
  %b = fptrunc <{w} x float> %v to <{w} x bfloat>
  store <{w} x bfloat> %b, ptr %dst, align 2
  ret void
}}""" for w in (16, 8))


def importing_round(active: bool = True):
    """The body it wraps may call ``store_rounded`` (nothing imported when not ``active``)."""
    return importing_llvm(ROUND_LL if active else "")


def store_rounded(out, i, row, C: int, value, c0: int | tirx.PrimExpr = 0) -> None:
    """out[i, c0 + c] = value(c) for c < C: the values computed into ``row`` (a float32
    scratch of at least C), then rounded to bfloat16 by the CPU's conversion instruction,
    16 and then 8 values at a time, a last few by TVM's rounding; inside
    ``importing_round``.  Round to nearest even, as TVM's; values below float32's
    normal range (under 1.2e-38 in magnitude) may become zero.  Used by the products here,
    the aggregations (``cpu_kernels.csr_agg``) and the fused loss on these CPUs.  AMD EPYC
    Zen 4, arxiv-synth: the loss's bfloat16 gradient (40 classes, the kernel alone,
    interleaved) 3.18 -> 2.89 ms with every row counted, 2.39-2.40 -> 2.22-2.23 with 60%;
    per-kernel medians of bf16 training steps, saved artifacts interleaved (25-31
    rounds): the loss 2.49 -> 2.23 ms, each product 0.10-0.17 ms faster (128 -> 32 3.33
    -> 3.19, 32 -> 32 1.01 -> 0.89), each 32-wide aggregation up to 0.2 ms; GraphSAGE's
    steps 41.8 -> 40.7 ms; losses bitwise equal."""
    _features(C, lambda c: T.buffer_store(row, value(c), [c]))
    raw = T.decl_buffer(out.shape, "uint16", data=out.data)
    _rounded(C, lambda width, c: (raw[i, c0 + c], row[c]),
             lambda c: T.buffer_store(out, row[c], [i, c0 + c]))


def _rounded(C: int, where, rest) -> None:
    """Round C float32 values to bfloat16 by ``ROUND`` calls, 16 and then 8 at a time:
    ``where(width, c)`` gives the (destination bits, source) elements at which the call
    for values c .. c + width - 1 starts; ``rest(c)`` stores each last value."""
    def call(width: int, c):
        dst, src = where(width, c)
        T.evaluate(tirx.call_extern("void", f"{ROUND}{width}", tirx.address_of(dst),
                                    tirx.address_of(src)))
    with T.serial(0, C // 16) as k:
        call(16, k * 16)
    done = C - C % 16
    if C - done >= 8:
        call(8, done)
        done += 8
    for c in range(done, C):
        rest(c)


def supported(K: int, M: int) -> bool:
    """Whether the kernel takes a K -> M product: K even (x's values pair up along k;
    an odd K's last pair would read past a row)."""
    return K >= 2 and K % 2 == 0 and M >= 1


def uses_dot(script: str) -> bool:
    """Whether a kernel's TVMScript calls the dot product."""
    return DOT in script


def _tiles(total: int, size: int, first: int = 0) -> list[tuple[int, int, int]]:
    """(first, tiles, width) of the tile groups covering ``total`` from ``first``: whole
    tiles of ``size`` (a loop) and the rest, so that a kernel's nests do not grow with its
    shape (a weight gradient of 1,433 rows unrolled tile by tile took LLVM minutes)."""
    groups = [(first, total // size, size)] if total >= size else []
    if total % size:
        groups.append((first + total - total % size, 1, total % size))
    return groups


def _padded(width: int) -> int:
    return -(-width // LANES) * LANES


def matmul_dot(K: int, M: int, epilogue: tuple, extras: tuple, K2: int = 0,
               locality: int = 3):
    """out = epilogue(x @ w [+ x2 @ w2]), x (and x2) stored as bfloat16, or x float32
    and rounded to bfloat16 as it is read (see the module docstring; ``K2`` as
    ``cpu_kernels.matmul``'s; ``locality``: of x's prefetched rows,
    ``cpu_kernels.MM_INPUT_LOCALITY``).  A float32 x's rows are rounded a group at a
    time into a buffer of the row range, 16 values per ``ROUND`` call, where the
    pairs are then read as from a bfloat16 x: the features under ``--prefer memory``,
    which keeps no bfloat16 copy of them (``precision.py``).  A group multiplies 8 rows at a time,
    4 when a tile has 64 columns (AMD EPYC Zen 4, arxiv-size rows, 2 threads,
    interleaved: 32 -> 128 9.3 ms with 2 rows, 3.7 with 4, 3.9 with 6, 4.7 with 8; 128 ->
    32 4.7, 3.5, 3.4, 3.4; 32 -> 40 1.43 with 4, 1.35 with 8; 32 -> 16 1.56 with 4, 0.73
    with 8)."""
    u16 = "uint16"
    MP = _padded(M)
    tiles = _tiles(M, TILE)
    R = 8 if 8 * (_padded(tiles[0][2]) // LANES) <= ACCUMULATORS else 4
    ahead = max(1, MM_AHEAD_BYTES // (R * (K + K2) * 2))  # groups
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul")
            T.func_attr({"tirx.noalias": True})
            n, args, extra, out = product_args(K, M, extras, K2)
            groups = T.Bind((n + R - 1) // R)
            rounds = stored_bf16("out") or not stored_bf16("x")
            with importing_llvm(DOT_LL + (ROUND_LL if rounds else "")):
                with T.parallel(0, CHUNKS) as p:
                    products = []
                    for x, w, Kp in args:
                        wp = pack_weight_pairs(w, Kp, M, MP)
                        # the pairs are read as raw bits: an alias of x's data as uint16
                        # keeps TVM's bfloat16 legalization away from the addresses
                        xb = T.decl_buffer((n * Kp,), u16, data=x.data) \
                            if str(x.dtype) == "bfloat16" else None
                        products.append(_Product(
                            x, xb, Kp, T.decl_buffer((Kp // 2 * 2 * MP,), u16, data=wp.data),
                            T.alloc_buffer((R * Kp,), u16, scope="local") if xb is None
                            else None))
                    per_tile = sum(q.shares for q in products)
                    shares = sum(count for _, count, _ in tiles) * per_tile
                    lo, hi = _row_range(groups, p, CHUNKS)
                    with T.serial(0, hi - lo) as gi:
                        g = lo + gi
                        for first, count, width in tiles:
                            with T.serial(0, count) as t:
                                _row_group(products, out, extra, extras, epilogue, n, g, R, M,
                                           MP, first + t * width, width,
                                           (first // TILE + t) * per_tile, shares, ahead,
                                           locality)
    return ib.get()


class _Product:
    """One product of ``matmul_dot``: x, its bits (``xb``; None for a float32 x), K, the
    packed weight's bits, and for a float32 x the buffer its group's rows are rounded
    into (``xs``, R rows of K)."""

    def __init__(self, x, xb, K: int, wpb, xs=None):
        self.x, self.xb, self.K, self.wpb, self.xs = x, xb, K, wpb, xs
        self.KS = min(MM_SHARE_K // 2, K // 2)  # pairs between two shares of prefetches
        self.shares = (K // 2) // self.KS


def _row_group(products, out, extra, extras, epilogue, n, g, R: int, M: int, MP: int, c0,
               width: int, share0, shares: int, ahead: int, locality: int) -> None:
    """Rows g * R .. g * R + R - 1 of ``matmul_dot``'s output, columns c0 .. c0 + width - 1,
    each row's sums of every product in registers (padded to whole vectors); prefetches
    its shares of the rows ``ahead`` groups on, from share ``share0``."""
    f32 = "float32"
    V = _padded(width) // LANES
    acc = [_scratch((V * LANES,)) for _ in range(R)]
    for r in range(R):
        _features(V * LANES, lambda j, r=r: T.buffer_store(acc[r], tirx.const(0.0, f32), [j]))
    reads = [(q.x, q.K, False, locality) for q in products] + [(out, M, True)]

    def k_step(q, kp):
        for r in range(R):
            pair = q.xs[r * q.K + 2 * kp] if q.xb is None else \
                q.xb[tirx.min(g * R + r, n - 1) * q.K + 2 * kp]
            for v in range(V):
                T.evaluate(tirx.call_extern(
                    "void", DOT, tirx.address_of(acc[r][v * LANES]), tirx.address_of(pair),
                    tirx.address_of(q.wpb[(kp * MP + c0 + v * LANES) * 2])))
    for q in products:
        if q.xb is None:
            for r in range(R):
                _round_row(q.xs, r * q.K, q.x, tirx.min(g * R + r, n - 1), q.K)
        KP, KS = q.K // 2, q.KS
        with T.serial(0, q.shares) as s:  # the rows ahead, a share every KS pairs
            _prefetch_share(reads, (g + ahead) * R, R, n, share0 + s, shares)
            with T.serial(0, KS) as k:
                k_step(q, s * KS + k)
        if KP % KS:
            with T.serial(KP - KP % KS, KP) as kp:
                k_step(q, kp)
        share0 = share0 + q.shares
    for r in range(R):
        i = g * R + r
        with _if(i < n):
            def result(j, r=r, i=i):
                return epi.apply(epilogue, acc[r][j],
                                 lambda e: extra[e][epi.index(extras[e], i, c0 + j)])
            if stored_bf16("out"):  # the row finished in its sums, rounded by the CPU
                store_rounded(out, i, acc[r], width, result, c0)
            else:
                _features(width, lambda j, i=i, f=result: T.buffer_store(out, f(j),
                                                                         [i, c0 + j]))


def _round_row(dst, base, x, i, K: int) -> None:
    """dst[base + c] = bits of x[i, c] (float32) rounded to bfloat16, c < K: 16 and then 8
    values per ``ROUND`` call, the last few by TVM's rounding (inside ``importing_round``)."""
    db = T.decl_buffer(dst.shape, "bfloat16", data=dst.data)
    _rounded(K, lambda width, c: (dst[base + c], x[i, c]),
             lambda c: T.buffer_store(db, tirx.Cast("bfloat16", x[i, c]), [base + c]))


# ---------------------------------------------------------------- weight gradients
# pairs of rows the weight-gradient kernel packs at a time (in L1).  AMD EPYC Zen 4,
# arxiv-size rows, 2 threads, interleaved: 128 x 32 4.0 ms with 8, 3.7-3.9 with 16, 4.4
# with 32; 32 x 32 1.2, 1.0, 1.4
BLOCK_PAIRS = 16


def _tn_tile(part, p, xp, yp, count, SX: int, SY: int, a0, ta: int, b0, tb: int,
             ones: int | None) -> None:
    """Rows a0 .. a0 + ta - 1, columns b0 .. b0 + tb - 1 of range p's partial sum
    ``part`` += the ``count`` packed pairs of x and y rows: the tile's sums in registers
    (padded to whole vectors) for the block.  ``ones``: the tile is the bias row, its x
    pairs the ones at that position of each packed x row."""
    V = _padded(tb) // LANES
    acc = [_scratch((V * LANES,)) for _ in range(ta)]
    # padding lanes too (part's columns past M stay 0): a lane never written is poison to
    # LLVM, and the instruction's whole result with it
    for t in range(ta):
        _features(V * LANES, lambda j, t=t: T.buffer_store(acc[t], part[p, a0 + t, b0 + j],
                                                           [j]))
    with T.serial(0, count) as q:
        for t in range(ta):
            pos = ones if ones is not None else 2 * (a0 + t)
            for v in range(V):
                T.evaluate(tirx.call_extern(
                    "void", DOT, tirx.address_of(acc[t][v * LANES]),
                    tirx.address_of(xp[q * SX + pos]),
                    tirx.address_of(yp[q * SY + 2 * (b0 + v * LANES)])))
    for t in range(ta):
        _features(V * LANES, lambda j, t=t: T.buffer_store(part, acc[t][j],
                                                           [p, a0 + t, b0 + j]))


def _pack_rows(dst, base, src, W: int, ra, rb, n) -> None:
    """dst[base + 2 c + e] = src[(ra, rb)[e], c] rounded to bfloat16 (bits), c < W: two
    rows of ``src`` (float32 or bfloat16) interleaved into pairs, by the imported ``PAIR``
    function 16 columns at a time; rb = n (past the last row: an odd n's last pair) gives
    zeros.  A row's last group of fewer than 16 columns is packed as a whole group too,
    reading into the next row (its columns past W are never multiplied into a stored sum:
    ``dst`` rows are padded to whole groups), except on the last row, where it is packed
    value by value."""
    u16 = "uint16"
    bf = str(src.dtype) == "bfloat16"
    flat = T.decl_buffer((n * W,), u16, data=src.data) if bf else None
    db = T.decl_buffer(dst.shape, "bfloat16", data=dst.data)
    groups = -(-W // LANES) * LANES

    def element(row, c, e):
        if bf:
            T.buffer_store(dst, flat[row * W + c], [base + 2 * c + e])
        else:
            T.buffer_store(db, tirx.Cast("bfloat16", src[row, c]), [base + 2 * c + e])

    def pair(g):
        ptr = (lambda row: tirx.address_of(flat[row * W + g])) if bf else \
            (lambda row: tirx.address_of(src[row, g]))
        T.evaluate(tirx.call_extern("void", PAIR + ("bf16" if bf else "float32"),
                                    tirx.address_of(dst[base + 2 * g]), ptr(ra), ptr(rb)))
    main = W - W % LANES
    with T.If(rb < n - 1 if main < W else rb < n):
        with T.Then():
            with T.serial(0, groups // LANES) as q:
                pair(q * LANES)
        with T.Else():
            with T.If(rb < n):
                with T.Then():
                    with T.serial(0, main // LANES) as q:
                        pair(q * LANES)
                    with T.serial(main, W) as c:
                        element(ra, c, 0)
                        element(rb, c, 1)
                with T.Else():
                    with T.serial(0, W) as c:
                        element(ra, c, 0)
                        T.buffer_store(dst, tirx.const(0, u16), [base + 2 * c + 1])


def matmul_tn_dot(K: int, M: int, chunks: int, sum_row: bool):
    """out = x.T @ y (x: [n, K], y: [n, M], either stored as bfloat16 or float32; out
    float32), weight gradients on dot products, pairs of rows at a time: out[k, :] +=
    x[2p, k] y[2p, :] + x[2p + 1, k] y[2p + 1, :] is one instruction per 16 columns once
    row 2p + 1's values sit beside row 2p's.  ``chunks`` ranges of pairs in parallel, each
    into its own partial sum (added up at the end, deterministic); a range packs
    ``BLOCK_PAIRS`` pairs of x rows and of y rows at a time, interleaved (rounded to
    bfloat16 where float32), and adds them into the partial sum tile by tile, each tile's
    sums in registers.  ``sum_row``: a last row of y's column sums (a bias gradient), x's
    packed rows ending in a pair of ones."""
    f32, u16 = "float32", "uint16"
    MP = _padded(M)
    col_tiles = _tiles(M, TILE)
    TA = next(t for t in (8, 4, 2, 1)
              if t * _padded(col_tiles[0][2]) <= TN_ACCUMULATORS * LANES)
    row_tiles = _tiles(K, TA) + ([(K, 1, 1)] if sum_row else [])
    tiles = [(r, c) for r in row_tiles for c in col_tiles]
    shares = sum(r[1] * c[1] for r, c in tiles)
    KX = K + int(sum_row)                      # rows of the result
    SX = 2 * _padded(K) + (2 * LANES if sum_row else 0)  # packed x pair stride
    SY = 2 * MP
    P = chunks
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul_tn")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            x = arg("x", (n, K), f32)
            y = arg("y", (n, M), f32)
            out = arg("out", (KX, M), f32)
            part = T.alloc_buffer((P, KX, MP), f32)
            pairs = T.Bind((n + 1) // 2)
            with importing_llvm(DOT_LL):
                with T.parallel(0, P) as p:
                    xp = T.alloc_buffer((BLOCK_PAIRS * SX,), u16, scope="local")
                    yp = T.alloc_buffer((BLOCK_PAIRS * SY,), u16, scope="local")
                    with T.serial(0, KX) as a:
                        _features(MP, lambda j: T.buffer_store(part, tirx.const(0.0, f32),
                                                               [p, a, j]))
                    if sum_row:  # bfloat16 ones, past the packed x values
                        with T.serial(0, BLOCK_PAIRS * 2) as j:
                            T.buffer_store(xp, tirx.const(0x3F80, u16),
                                           [(j // 2) * SX + SX - 2 * LANES + j % 2])
                    lo, hi = _row_range(pairs, p, P)

                    def block(first, count, ahead=False):
                        with T.serial(0, count) as q:
                            ra = 2 * (first + q)
                            _pack_rows(xp, q * SX, x, K, ra, ra + 1, n)
                            _pack_rows(yp, q * SY, y, M, ra, ra + 1, n)
                        share0 = 0
                        for (a_first, a_count, ta), (b_first, b_count, tb) in tiles:
                            with T.grid(a_count, b_count) as (at, bt):
                                share = share0 + at * b_count + bt
                                if ahead:  # the next block's rows, a share per tile
                                    _prefetch_share([(x, K), (y, M)], 2 * (first + count),
                                                    2 * BLOCK_PAIRS, n, share, shares)
                                _tn_tile(part, p, xp, yp, count, SX, SY,
                                         a_first + at * ta, ta, b_first + bt * tb, tb,
                                         SX - 2 * LANES if a_first == K else None)
                            share0 += a_count * b_count
                    full = T.Bind((hi - lo) // BLOCK_PAIRS)
                    with T.serial(0, full) as blk:
                        block(lo + blk * BLOCK_PAIRS, BLOCK_PAIRS, ahead=True)
                    block(lo + full * BLOCK_PAIRS, hi - lo - full * BLOCK_PAIRS)
            with T.parallel(0, KX) as a:
                _features(M, lambda j: T.buffer_store(out, part[0, a, j], [a, j]))
                with T.serial(1, P) as q:
                    _features(M, lambda j: T.buffer_store(out, out[a, j] + part[q, a, j],
                                                          [a, j]))
    return ib.get()
