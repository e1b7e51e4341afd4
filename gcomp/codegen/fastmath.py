"""exp and tanh as polynomial TIR expressions, so loops that call them vectorize.

LLVM lowers ``tirx.exp`` and ``tirx.tanh`` to calls of the C library's ``expf`` and
``tanhf``, one lane at a time; losses, softmaxes and GRU gates spend most of their
time there (GGNN's gate kernel on arxiv-synth: 96 ms with ``tanhf``).  ``fast_exp``
is the Cephes single-precision algorithm (range reduction by ln 2, a degree-6
polynomial, scaling by 2^n through the exponent bits): relative error about 1e-7,
the float32 epsilon, for inputs in [-87, 88]; smaller inputs give 0 (``expf`` gives
denormals there), larger are clamped; a NaN stays NaN on the CPU.  ``fast_tanh`` is
Cephes' ``tanhf``: an odd polynomial below |x| = 0.625, where 1 - 2 / (exp(2|x|) + 1)
would cancel, that form above it.
"""

from __future__ import annotations

from tvm import tirx

LOG2E = 1.44269504088896341
C1 = 0.693359375
C2 = -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
        1.6666665459e-1, 5.0000001201e-1)


def _f(v: float):
    return tirx.const(v, "float32")


def lanes_of(x) -> int:
    """Lanes of float32 PrimExpr (or TE tensor element) ``x``: 1 for a scalar."""
    return int(str(getattr(x, "ty", "float32")).partition("x")[2] or 1)


def like(x, v: float):
    """The constant ``v`` with ``x``'s lanes (a select's values must match its condition's)."""
    lanes = lanes_of(x)
    return _f(v) if lanes == 1 else tirx.Broadcast(_f(v), lanes)


def fast_exp(x):
    """exp(x) for a float32 PrimExpr (or TE tensor element), scalar or vector (float32xL)."""
    lanes = lanes_of(x)
    suffix = f"x{lanes}" if lanes > 1 else ""
    # The bound comes first: LLVM lowers min(a, b) as a < b ? a : b, which gives b, here
    # x, when x is a NaN, so a NaN stays NaN as in torch (CUDA's fminf/fmaxf give the
    # bound).  Selects that pass a NaN through repeat x, and the trees of nested exps grew
    # until GGNN's CUDA training step took over 300 s to compile instead of 15.
    x = tirx.max(_f(-87.3365478515625), tirx.min(_f(88.3762626647950), x))
    fx = tirx.floor(x * _f(LOG2E) + _f(0.5))
    r = x - fx * _f(C1) - fx * _f(C2)
    p = _f(POLY[0])
    for c in POLY[1:]:
        p = p * r + _f(c)
    y = p * (r * r) + r + _f(1.0)
    scale = tirx.reinterpret("float32" + suffix, (tirx.Cast("int32" + suffix, fx) + 127) << 23)
    return y * scale


TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
             -3.33332819422e-1)


def fast_tanh(x):
    """tanh(x) for a float32 PrimExpr (LLVM computes the repeated subexpressions once)."""
    z = x * x
    p = _f(TANH_POLY[0])
    for c in TANH_POLY[1:]:
        p = p * z + _f(c)
    a = tirx.abs(x)
    large = _f(1.0) - _f(2.0) / (fast_exp(a + a) + _f(1.0))
    return tirx.Select(a < _f(0.625), p * z * x + x, tirx.Select(x < _f(0.0), -large, large))
