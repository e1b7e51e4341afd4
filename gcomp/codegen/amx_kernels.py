"""Dense products on Intel AMX tiles, for bfloat16 activations (``--precision bf16``).

A CPU with AMX-BF16 (Intel Sapphire Rapids and later) multiplies a 16 x 32 bfloat16
tile by a 32 x 16 one into 16 x 16 float32 sums in one instruction (``tdpbf16ps``):
the 32-wide products of a GNN layer stop being compute bound.  The row-group kernel of
``cpu_kernels.matmul`` widens each bfloat16 value and multiplies in float32 (the 32 -> 32
product over arxiv-size rows: 1.9 ms in a training step); on tiles it takes 0.7-0.8 ms,
and 128 -> 32 takes 1.5 ms instead of 7.

The weight is rounded to bfloat16 for the product (as PyTorch's autocast does); sums
stay float32, and the epilogue runs on the float32 sums.  The kernel:

* per range of rows (``CHUNKS`` in parallel): configures the tiles (``ldtilecfg``), and
  packs the float32 weight into bfloat16 pairs along k (the layout the instruction reads:
  ``wp[k // 2, 2 j + k % 2] = w[k, j]``, columns padded to a multiple of 16 with zeros);
* per group of 16 rows: for each k range of up to 32, loads the rows' x tile and, for
  each 16 columns, the weight tile, multiplied into that column tile's sums; stores the
  sums to a local [16, M] block, then applies the epilogue row by row;
* rows past the last full group (fewer than 16) are multiplied in vector registers.

Tiles: one per 16 output columns (sums, at most 4), one x and one weight tile per k range
shape (32, and the rest when 32 does not divide K): at most 8, the hardware's count.
Linux grants the tile state per process on request (``runtime/cpu_features.py``), which
the artifact does when it loads a library built with AMX.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.kernels import arg

ROWS = 16      # rows of an x tile and of a sums tile
COLS = 16      # float32 columns of a sums tile
KMAX = 32      # bfloat16 values of one x tile row (64 bytes)
MAX_TILES = 8
CHUNKS = 16    # row ranges in parallel (>= threads, for balance)


def k_ranges(K: int) -> list[tuple[int, int]]:
    """(first k, width) of the k ranges one tile each covers."""
    return [(k, min(KMAX, K - k)) for k in range(0, K, KMAX)]


def supported(K: int, M: int) -> bool:
    """Whether the tiles hold a K -> M product: K even (values pair up along k) and the
    sums, x and weight tiles within the hardware's eight."""
    if K % 2 or K < 2:
        return False
    shapes = len({w for _, w in k_ranges(K)})
    return -(-M // COLS) + 2 * shapes <= MAX_TILES


def _intrin(name: str, *args) -> None:
    T.evaluate(tirx.call_llvm_intrin("void", name, *args))


def _tile(t: int):
    return tirx.const(t, "int8")


def matmul_amx(K: int, M: int, epilogue: tuple, extras: tuple):
    """out = epilogue(x @ w) with x stored as bfloat16 (see the module docstring)."""
    f32, u16 = "float32", "uint16"
    MT = -(-M // COLS)          # sums tiles
    MP = MT * COLS              # padded columns of the packed weight and the sums block
    ranges = k_ranges(K)
    widths = sorted({w for _, w in ranges}, reverse=True)
    x_tile = {w: MT + 2 * s for s, w in enumerate(widths)}   # tile numbers per k width
    w_tile = {w: MT + 2 * s + 1 for s, w in enumerate(widths)}
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("matmul")
            T.func_attr({"tirx.noalias": True})
            n = tirx.Var("n", "int64")
            x = arg("x", (n, K), f32)
            w = arg("w", (K, M), f32)
            extra = [arg(f"e{k}", epi.shape(kind, n, M), f32) for k, kind in enumerate(extras)]
            out = arg("out", (n, M), f32)
            # the tile loads read raw bfloat16 bits: an alias of x's data as uint16 keeps
            # TVM's bfloat16 legalization away from the pointer arithmetic
            xb = T.decl_buffer((n, K), u16, data=x.data)
            groups = T.Bind(n // ROWS)
            with T.parallel(0, CHUNKS) as p:
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                wp = T.alloc_buffer((K // 2, 2 * MP), "bfloat16", scope="local")
                wpb = T.decl_buffer((K // 2, 2 * MP), u16, data=wp.data)
                sums = T.alloc_buffer((ROWS, MP), f32, scope="local")
                with T.serial(0, K // 2) as kk:
                    with T.serial(0, MP) as j:
                        for s in range(2):
                            T.buffer_store(wp, tirx.Cast("bfloat16", tirx.if_then_else(
                                j < M, w[2 * kk + s, tirx.min(j, M - 1)],
                                tirx.const(0.0, f32))), [kk, 2 * j + s])
                _configure(cfg, MT, x_tile, w_tile)
                _intrin("llvm.x86.ldtilecfg", cfg.access_ptr("r"))
                lo = T.Bind(groups * tirx.Cast("int64", p) // CHUNKS)
                hi = T.Bind(groups * tirx.Cast("int64", p + 1) // CHUNKS)
                with T.serial(0, hi - lo) as gi:
                    row0 = (lo + gi) * ROWS
                    for t in range(MT):
                        _intrin("llvm.x86.tilezero", _tile(t))
                    for k0, kw in ranges:
                        _intrin("llvm.x86.tileloadd64", _tile(x_tile[kw]),
                                xb.access_ptr("r", offset=row0 * K + k0),
                                tirx.const(2 * K, "int64"))
                        for t in range(MT):
                            _intrin("llvm.x86.tileloadd64", _tile(w_tile[kw]),
                                    wpb.access_ptr("r", offset=(k0 // 2) * 2 * MP + 2 * COLS * t),
                                    tirx.const(4 * MP, "int64"))
                            _intrin("llvm.x86.tdpbf16ps", _tile(t), _tile(x_tile[kw]),
                                    _tile(w_tile[kw]))
                    for t in range(MT):
                        _intrin("llvm.x86.tilestored64", _tile(t),
                                sums.access_ptr("w", offset=COLS * t), tirx.const(4 * MP, "int64"))
                    with T.serial(0, ROWS) as r:
                        _store_row(out, extra, extras, epilogue, row0 + r, M,
                                   lambda j, r=r: sums[r, j])
                _intrin("llvm.x86.tilerelease")
                with T.If(p == CHUNKS - 1):  # the last rows, fewer than a group
                    with T.Then():
                        with T.serial(0, n - groups * ROWS) as r:
                            i = groups * ROWS + r
                            row = T.alloc_buffer((MP,), f32, scope="local")
                            with T.vectorized(0, MP) as j:
                                T.buffer_store(row, tirx.const(0.0, f32), [j])
                            with T.serial(0, K) as k:
                                with T.vectorized(0, MP) as j:
                                    T.buffer_store(row, row[j] + tirx.Cast(f32, x[i, k]) *
                                                   tirx.Cast(f32, wp[k // 2, 2 * j + k % 2]), [j])
                            _store_row(out, extra, extras, epilogue, i, M, lambda j: row[j])
    return ib.get()


def _configure(cfg, MT: int, x_tile: dict, w_tile: dict) -> None:
    """The 64-byte tile configuration: palette 1; per tile its rows and bytes per row."""
    with T.serial(0, 64) as b:
        T.buffer_store(cfg, tirx.const(0, "uint8"), [b])
    T.buffer_store(cfg, tirx.const(1, "uint8"), [0])

    def shape(t: int, rows: int, colsb: int) -> None:
        T.buffer_store(cfg, tirx.const(colsb & 255, "uint8"), [16 + 2 * t])
        T.buffer_store(cfg, tirx.const(colsb >> 8, "uint8"), [17 + 2 * t])
        T.buffer_store(cfg, tirx.const(rows, "uint8"), [48 + t])
    for t in range(MT):
        shape(t, ROWS, 4 * COLS)
    for kw, t in x_tile.items():
        shape(t, ROWS, 2 * kw)
    for kw, t in w_tile.items():
        shape(t, kw // 2, 4 * COLS)


def _store_row(out, extra, extras, epilogue, i, M: int, value) -> None:
    """out[i, :] = epilogue(value(j)), vectorized over the columns."""
    with T.vectorized(0, M) as j:
        res = epi.apply(epilogue, value(j), lambda e: extra[e][epi.index(extras[e], i, j)])
        T.buffer_store(out, res, [i, j])
