"""Epilogues: elementwise work folded into the kernel that produces its input.

An epilogue is a chain of steps applied to a kernel's result before it is stored,
as written by the ``fuse_epilogues`` pass: each step is ``(op, attrs, extra, swap)``
with ``extra`` None for unary ops or, for binary ones, the index of an extra kernel
input (a bias vector, a scalar, or a tensor shaped like the output) or an operand
computed from extra inputs, ``(op, attrs, (extra, ...))`` (GIN's ``(1 + eps) * x``);
``swap`` puts the extra operand first (``sub(b, acc)``).  The step
semantics are the elementwise ops' (``dense_kernels._apply``).

``extras`` of a kernel spec list the extra inputs' shape kinds:
``"vec"`` ([F], indexed by the flat feature), ``"row"`` ([n, F], same as the
output), ``"col"`` ([n, 1], one value per row) or ``"scalar"`` ([]).
"""

from __future__ import annotations


def apply(chain: tuple, acc, extra_value):
    """The epilogue expression; ``extra_value(k)`` gives extra input k at this element."""
    from gcomp.codegen.dense_kernels import _apply
    for op, attrs, extra, swap in chain:
        if extra is None:
            args = [acc]
        else:
            v = _operand(extra, extra_value)
            args = [v, acc] if swap else [acc, v]
        acc = _apply(op, dict(attrs), args)
    return acc


def _operand(extra, extra_value):
    from gcomp.codegen.dense_kernels import _apply
    if isinstance(extra, int):
        return extra_value(extra)
    op, attrs, operands = extra
    return _apply(op, dict(attrs), [_operand(e, extra_value) for e in operands])


def shape(kind: str, rows, width: int) -> tuple:
    """Shape of an extra input of ``kind`` for a kernel output of ``rows`` x ``width``."""
    return {"vec": (width,), "row": (rows, width), "col": (rows, 1), "scalar": ()}[kind]


def index(kind: str, row, feature):
    """Index tuple of an extra input of ``kind`` at output element (row, feature)."""
    if kind == "vec":
        return (feature,)
    if kind == "row":
        return (row, feature)
    if kind == "col":
        return (row, 0)
    return ()
