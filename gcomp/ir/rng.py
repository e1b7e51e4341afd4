"""The counter-based random numbers behind ``dropout``: part of the op's meaning.

keep(seed, step, i) = uniform(hash(seed, step, i)) >= p, where the hash mixes
the three counters and finishes with MurmurHash3's fmix32, all in uint32
arithmetic.  The same (seed, step) gives the same mask for the forward and the
backward pass and on every backend; the CPU and CUDA kernels compute exactly
this formula.
"""

from __future__ import annotations

import numpy as np

GOLDEN = 0x9E3779B1
SEED_MUL = 0x85EBCA77
STEP_MUL = 0xC2B2AE3D
FMIX1 = 0x85EBCA6B
FMIX2 = 0xC2B2AE35


def uniform(seed: int, step: int, size: int) -> np.ndarray:
    """Uniform floats in [0, 1) for element indices 0..size-1 (float64, exact 24-bit values)."""
    i = np.arange(size, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        x = (i * np.uint32(GOLDEN)) ^ np.uint32((seed * SEED_MUL) & 0xFFFFFFFF) \
            ^ np.uint32((step * STEP_MUL) & 0xFFFFFFFF)
        x ^= x >> np.uint32(16)
        x *= np.uint32(FMIX1)
        x ^= x >> np.uint32(13)
        x *= np.uint32(FMIX2)
        x ^= x >> np.uint32(16)
    return (x >> np.uint32(8)).astype(np.float64) * (1.0 / (1 << 24))


def keep_mask(seed: int, step: int, shape: tuple, p: float) -> np.ndarray:
    size = int(np.prod(shape)) if shape else 1
    return (uniform(seed, step, size) >= p).reshape(shape)
