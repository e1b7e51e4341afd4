"""What the ``matmul`` kernels share: their arguments (the float32 row groups of
``cpu_kernels``, ``amx_kernels``, ``dot_bf16_kernels``), and the weight packed into
bfloat16 pairs along k (the two bfloat16 product kernels).

Its own module, importing none of the kernel modules, because ``cpu_kernels`` imports
both product modules at its end and each imports helpers from ``cpu_kernels``.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from gcomp.codegen import epilogue as epi
from gcomp.codegen.kernels import arg


def product_args(K: int, M: int, extras: tuple, K2: int = 0, x_rows=None):
    """(n, products, extra, out): the arguments of a ``matmul`` kernel, named as
    ``cpu_kernels.matmul`` names them (the precision pass asks for them by name);
    ``products`` holds (x, w, K) of ``x @ w`` and, when ``K2``, of the second product
    ``x2 @ w2``.  ``x_rows``: x's row count where it is not the output's (x read
    through a row index)."""
    f32 = "float32"
    n = tirx.Var("n", "int64")
    products = [(arg("x", (n if x_rows is None else x_rows, K), f32), arg("w", (K, M), f32), K)]
    if K2:
        products.append((arg("x2", (n, K2), f32), arg("w2", (K2, M), f32), K2))
    extra = [arg(f"e{k}", epi.shape(kind, n, M), f32) for k, kind in enumerate(extras)]
    return n, products, extra, arg("out", (n, M), f32)


def pack_weight_pairs(w, K: int, M: int, MP: int):
    """A local bfloat16 copy of the float32 weight ``w`` [K, M] (K even) in pairs along
    k, as the bfloat16 products read it: ``wp[k // 2, 2 j + k % 2] = w[k, j]``, columns
    M .. MP - 1 zero."""
    wp = T.alloc_buffer((K // 2, 2 * MP), "bfloat16", scope="local")
    with T.serial(0, K // 2) as kk:
        with T.serial(0, MP) as j:
            for s in range(2):
                T.buffer_store(wp, tirx.Cast("bfloat16", tirx.if_then_else(
                    j < M, w[2 * kk + s, tirx.min(j, M - 1)], tirx.const(0.0, "float32"))),
                    [kk, 2 * j + s])
    return wp
