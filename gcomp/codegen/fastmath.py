"""exp as a polynomial TIR expression, so loops that call it vectorize.

LLVM lowers ``tirx.exp`` to calls of the C library's ``expf``, one lane at a
time; losses and softmaxes spend most of their time there.  This is the Cephes
single-precision algorithm (range reduction by ln 2, a degree-6 polynomial,
scaling by 2^n through the exponent bits): relative error about 1e-7, the
float32 epsilon, for inputs in [-87, 88]; smaller inputs give 0 (``expf`` gives
denormals there), larger are clamped.
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


def fast_exp(x):
    """exp(x) for a float32 PrimExpr."""
    x = tirx.max(tirx.min(x, _f(88.3762626647950)), _f(-87.3365478515625))
    fx = tirx.floor(x * _f(LOG2E) + _f(0.5))
    r = x - fx * _f(C1) - fx * _f(C2)
    p = _f(POLY[0])
    for c in POLY[1:]:
        p = p * r + _f(c)
    y = p * (r * r) + r + _f(1.0)
    scale = tirx.reinterpret("float32", (tirx.Cast("int32", fx) + 127) << 23)
    return y * scale
