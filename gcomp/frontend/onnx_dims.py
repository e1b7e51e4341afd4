"""Symbolic sizes for the ONNX importer: node and edge counts as linear expressions.

An exported GNN computes with sizes it only knows at run time: the number of
nodes, of edges, of edges left after removing self loops.  The importer
represents such a size as a ``Lin``, an integer linear combination of named
atoms plus a constant (``E(rm(edge_index)) + N`` is the edge count after
PyG's add_remaining_self_loops).  Static sizes stay plain ``int``.  Shape
plumbing (Shape -> Gather -> Concat -> Expand ...) is folded with numpy on
object arrays holding ``int`` and ``Lin`` entries, so ``Lin`` implements the
integer arithmetic numpy calls.

Equality of two ``Lin`` values is structural; ``decide_equal`` is the ONNX
``Equal`` on sizes, and raises when the answer depends on the graph.
"""

from __future__ import annotations

from math import prod
from typing import Union

from gcomp.errors import ModelImportError


class Lin:
    """const + sum(coeff * atom), with at least one non-zero coefficient."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict, const: int = 0):
        self.terms = tuple(sorted((a, int(c)) for a, c in terms.items() if c != 0))
        self.const = int(const)

    @staticmethod
    def atom(name: str) -> "Lin":
        return Lin({name: 1})

    # ------------------------------------------------------------ arithmetic
    def _combine(self, other, sign: int):
        if isinstance(other, Lin):
            terms = dict(self.terms)
            for a, c in other.terms:
                terms[a] = terms.get(a, 0) + sign * c
            return norm(Lin(terms, self.const + sign * other.const))
        if _is_int(other):
            return Lin(dict(self.terms), self.const + sign * int(other))
        return NotImplemented

    def __add__(self, other):
        return self._combine(other, 1)

    __radd__ = __add__

    def __sub__(self, other):
        return self._combine(other, -1)

    def __rsub__(self, other):
        return (-self)._combine(other, 1)

    def __neg__(self):
        return Lin({a: -c for a, c in self.terms}, -self.const)

    def __mul__(self, other):
        if _is_int(other):
            return norm(Lin({a: c * int(other) for a, c in self.terms}, self.const * int(other)))
        if isinstance(other, Lin):
            raise ModelImportError(f"cannot resolve the size {self} * {other}: gcomp tracks sizes "
                                   "that are linear in the node and edge counts")
        return NotImplemented

    __rmul__ = __mul__

    def __floordiv__(self, other):
        if _is_int(other) and other != 0 and all(c % other == 0 for _, c in self.terms) \
                and self.const % other == 0:
            return norm(Lin({a: c // other for a, c in self.terms}, self.const // other))
        raise ModelImportError(f"cannot resolve the size {self} // {other}")

    def __index__(self):  # numpy and range() call this; a symbolic size has no int value
        raise ModelImportError(f"the size {self} is only known when the model runs; it cannot "
                               "be used where ONNX needs a constant")

    # ------------------------------------------------------------ identity
    def __eq__(self, other):
        return isinstance(other, Lin) and self.terms == other.terms and self.const == other.const

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash((self.terms, self.const))

    def __bool__(self):
        return True  # sizes with a symbolic part are never known to be zero

    def __str__(self) -> str:
        parts = [a if c == 1 else f"{c}*{a}" for a, c in self.terms]
        if self.const:
            parts.append(str(self.const))
        return " + ".join(parts)

    __repr__ = __str__


Dim = Union[int, Lin]


def _is_int(v) -> bool:
    import numpy as np
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def norm(d) -> Dim:
    """A ``Lin`` with no symbolic part becomes a plain ``int``."""
    if isinstance(d, Lin):
        return d.const if not d.terms else d
    return int(d)


def is_static(d) -> bool:
    return not isinstance(d, Lin)


def same(a: Dim, b: Dim) -> bool:
    """Structural equality of two sizes (ints and ``Lin``)."""
    if isinstance(a, Lin) or isinstance(b, Lin):
        return isinstance(a, Lin) and isinstance(b, Lin) and a == b
    return int(a) == int(b)


def decide_equal(a: Dim, b: Dim) -> bool:
    """ONNX ``Equal`` of two sizes; raises when it depends on the graph run on."""
    if same(a, b):
        return True
    if is_static(a) and is_static(b):
        return False
    raise ModelImportError(f"cannot decide whether the sizes {a} and {b} are equal: the answer "
                           "depends on the graph the model runs on")


def broadcast(a: tuple, b: tuple) -> tuple:
    """Numpy broadcasting of two shapes of ``Dim``; raises ModelImportError."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if same(da, db) or same(db, 1):
            out.append(da)
        elif same(da, 1):
            out.append(db)
        else:
            raise ModelImportError(f"shapes {fmt(a)} and {fmt(b)} do not broadcast")
    return tuple(reversed(out))


def numel(shape: tuple) -> Dim:
    return norm(prod(shape, start=1)) if shape else 1


def reshape_target(in_shape: tuple, target: list, allowzero: bool = False) -> tuple:
    """ONNX Reshape semantics (0 copies, -1 infers) over symbolic sizes."""
    out: list = []
    infer = None
    for i, d in enumerate(target):
        if same(d, 0) and not allowzero:
            if i >= len(in_shape):
                raise ModelImportError(f"Reshape: 0 at axis {i} has no input axis to copy")
            out.append(in_shape[i])
        elif same(d, -1):
            if infer is not None:
                raise ModelImportError("Reshape: more than one -1")
            infer = i
            out.append(None)
        else:
            if is_static(d) and int(d) < 0:
                raise ModelImportError(f"Reshape: bad dimension {d}")
            out.append(d)
    if infer is not None:
        known = [d for d in out if d is not None]
        total = numel(in_shape)
        rest = numel(tuple(known))
        out[infer] = _divide(total, rest)
    elif not same(numel(tuple(out)), numel(in_shape)):
        raise ModelImportError(f"Reshape: cannot reshape {fmt(in_shape)} to {fmt(tuple(out))}")
    return tuple(out)


def _divide(total: Dim, rest: Dim) -> Dim:
    """total / rest for Reshape's -1, where both may be symbolic."""
    if is_static(rest):
        if int(rest) == 0:
            raise ModelImportError("Reshape: cannot infer -1 next to a zero-sized axis")
        if is_static(total):
            if int(total) % int(rest):
                raise ModelImportError(f"Reshape: {total} elements do not split by {rest}")
            return int(total) // int(rest)
        return total // int(rest)
    # a symbolic rest must divide a symbolic total exactly: k * S / (m * S) = k / m
    if isinstance(total, Lin) and isinstance(rest, Lin) and not total.const and not rest.const:
        ratios = {a: c for a, c in total.terms}
        div = {a: c for a, c in rest.terms}
        if set(ratios) == set(div):
            k = {ratios[a] / div[a] for a in ratios}
            if len(k) == 1 and float(next(iter(k))).is_integer():
                return int(next(iter(k)))
    raise ModelImportError(f"Reshape: cannot infer -1 from {total} elements over {rest}")


def fmt(shape: tuple) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
