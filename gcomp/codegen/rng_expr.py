"""The dropout keep test of ``gcomp/ir/rng.py`` as a TIR expression, for every kernel that
drops elements (``dropout``, ``dropout_nnz``, fused attention's coefficients)."""

from __future__ import annotations

from tvm.script import tirx as T

from gcomp.ir import rng


def _u32(v):
    return T.uint32(v & 0xFFFFFFFF)


def keep(index, step, seed: int, p: float):
    """The dropout keep test of gcomp/ir/rng.py as one expression.

    Built in Python at parse time: TVMScript turns a named intermediate into a local
    scalar, which the vectorizer would share across lanes.
    """
    h = ((T.Cast("uint32", index) * _u32(rng.GOLDEN)) ^ _u32(seed * rng.SEED_MUL)
         ^ (T.Cast("uint32", step) * _u32(rng.STEP_MUL)))
    h = (h ^ (h >> T.uint32(16))) * _u32(rng.FMIX1)
    h = (h ^ (h >> T.uint32(13))) * _u32(rng.FMIX2)
    h = h ^ (h >> T.uint32(16))
    return T.Cast("float32", h >> T.uint32(8)) * T.float32(1.0 / (1 << 24)) >= T.float32(p)
