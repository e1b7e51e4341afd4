"""Types of Graph IR values.

A value is either a dense tensor or a graph structure.

* Tensor shapes are tuples of dimensions.  A dimension is an ``int`` (static),
  ``N`` (the number of nodes of the graph the model runs on, symbolic) or
  ``EdgeDim(g)`` (the number of edges of the graph value named ``g``,
  symbolic).  Every node tensor has ``N`` as its first axis; every edge tensor
  has an ``EdgeDim`` as its first axis.  One compiled artifact therefore serves
  graphs of any size.
* A graph type carries the sparse format the runtime stores it in.

Types print as ``f32[N,16]``, ``f32[E(g1),4]``, ``f32[]`` and ``graph<csr>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

N = "N"

DTYPES = {"f32": "float32", "f64": "float64", "i32": "int32", "i64": "int64", "bool": "bool"}
SHORT_DTYPE = {v: k for k, v in DTYPES.items()}

GRAPH_FORMATS = ("coo", "csr", "ell", "dense", "banded")


@dataclass(frozen=True)
class EdgeDim:
    """The (symbolic) number of edges of the graph value named ``graph``."""

    graph: str

    def __str__(self) -> str:
        return f"E({self.graph})"


Dim = Union[int, str, EdgeDim]


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str = "float32"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_node(self) -> bool:
        return bool(self.shape) and self.shape[0] == N

    @property
    def edge_graph(self) -> str | None:
        """Name of the graph whose edges index axis 0, or None for non-edge tensors."""
        if self.shape and isinstance(self.shape[0], EdgeDim):
            return self.shape[0].graph
        return None

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape after the symbolic first axis (all static)."""
        return tuple(self.shape[1:]) if not self.is_static else self.shape

    def with_shape(self, shape) -> "TensorType":
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        return f"{SHORT_DTYPE[self.dtype]}[{','.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class GraphType:
    format: str = "coo"

    def __str__(self) -> str:
        return f"graph<{self.format}>"


Type = Union[TensorType, GraphType]


def is_symbolic(d: Dim) -> bool:
    return not isinstance(d, int)


def parse_type(text: str) -> Type:
    """Parse the printed form of a type (inverse of ``str``)."""
    from gcomp.errors import IRError

    text = text.strip()
    if text.startswith("graph<") and text.endswith(">"):
        fmt = text[len("graph<"):-1]
        if fmt not in GRAPH_FORMATS:
            raise IRError(f"unknown graph format {fmt!r} in type {text!r}")
        return GraphType(fmt)
    if "[" not in text or not text.endswith("]"):
        raise IRError(f"cannot parse type {text!r}")
    short, dims = text[:-1].split("[", 1)
    if short not in DTYPES:
        raise IRError(f"unknown dtype {short!r} in type {text!r}")
    shape: list[Dim] = []
    for part in filter(None, (p.strip() for p in dims.split(","))):
        if part == N:
            shape.append(N)
        elif part.startswith("E(") and part.endswith(")"):
            shape.append(EdgeDim(part[2:-1]))
        else:
            try:
                shape.append(int(part))
            except ValueError:
                raise IRError(f"bad dimension {part!r} in type {text!r}") from None
    return TensorType(tuple(shape), DTYPES[short])


def value_role(ty) -> str:
    """What an input or output of type ``ty`` is to a caller: ``graph``, ``node`` (one row
    per node), ``edge`` (one row per edge), ``scalar`` or ``tensor`` (of fixed shape)."""
    if isinstance(ty, GraphType):
        return "graph"
    if ty.is_node:
        return "node"
    if ty.edge_graph:
        return "edge"
    return "scalar" if ty.rank == 0 else "tensor"
