"""The Graph IR: one ``Node`` class, a ``Graph`` that owns nodes in order.

Modelled on torch.fx: a node's ``inputs`` are other nodes; assigning them keeps
every node's ``users`` up to date, so passes never edit use-lists by hand.
``replace_all_uses_with``, ``erase_node`` (refuses while users remain) and
``with graph.inserting_before(n):`` are the safe edit primitives.

Analysis results live in ``node.meta`` (a side table the printer does not show
unless asked): each pass's docstring names the keys it reads and writes.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator

from gcomp.errors import IRError
from gcomp.ir.ops import OPS, Op, infer_type, normalize_attrs
from gcomp.ir.types import GraphType, Type

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class Node:
    __slots__ = ("graph", "name", "op", "_inputs", "attrs", "ty", "users", "meta")

    def __init__(self, graph: "Graph", name: str, op: Op, attrs: dict, ty: Type | None):
        self.graph = graph
        self.name = name
        self.op = op
        self._inputs: tuple[Node, ...] = ()
        self.attrs = attrs
        self.ty = ty
        self.users: dict[Node, None] = {}  # ordered set
        self.meta: dict = {}

    @property
    def inputs(self) -> tuple["Node", ...]:
        return self._inputs

    @inputs.setter
    def inputs(self, new: Iterable["Node"]) -> None:
        new = tuple(new)
        for n in new:
            if n.graph is not self.graph:
                raise IRError(f"%{self.name}: input %{n.name} belongs to another graph")
        for old in self._inputs:
            old.users.pop(self, None)
        self._inputs = new
        for n in new:
            n.users[self] = None

    def replace_input(self, old: "Node", new: "Node") -> None:
        self.inputs = [new if i is old else i for i in self._inputs]

    def __repr__(self) -> str:
        return f"%{self.name}"


class Graph:
    """An ordered, topologically sorted list of nodes with named inputs and outputs."""

    def __init__(self, name: str = "main"):
        self.name = name
        self._nodes: list[Node] = []
        self._names: dict[str, Node] = {}
        self.outputs: list[Node] = []
        self._insert_at: Node | None = None  # None: append
        self.meta: dict = {}  # whole-graph analysis results (e.g. autodiff's gradient map)

    # ------------------------------------------------------------ queries
    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self._nodes))

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self._nodes if n.op == Op.INPUT]

    @property
    def params(self) -> list[Node]:
        return [n for n in self._nodes if n.op == Op.PARAM]

    def node(self, name: str) -> Node:
        try:
            return self._names[name]
        except KeyError:
            raise IRError(f"no value named %{name} in graph {self.name}") from None

    def has(self, name: str) -> bool:
        return name in self._names

    def fresh_name(self, hint: str) -> str:
        """A unique name derived from ``hint`` (``h``, ``h_1``, ``h_2``...)."""
        base = re.sub(r"[^A-Za-z0-9_.]", "_", hint) or "v"
        if not (base[0].isalpha() or base[0] == "_"):
            base = "v" + base
        if base not in self._names:
            return base
        i = 1
        while f"{base}_{i}" in self._names:
            i += 1
        return f"{base}_{i}"

    # ------------------------------------------------------------ edits
    def create_node(self, op: Op, inputs: Iterable[Node] = (), attrs: dict | None = None,
                    ty: Type | None = None, name: str | None = None) -> Node:
        """Create a node at the insertion point; its type is inferred unless ``op`` is a leaf."""
        op = Op(op)
        attrs = normalize_attrs(op, dict(attrs or {}))
        if name is None:
            name = self.fresh_name(op.value)
        elif name in self._names:
            raise IRError(f"duplicate value name %{name}")
        elif not _NAME_RE.match(name):
            raise IRError(f"bad value name {name!r} (letters, digits, '_' and '.')")
        node = Node(self, name, op, attrs, ty if OPS[op].infer is None else None)
        node.inputs = inputs
        if OPS[op].infer is not None:
            node.ty = infer_type(node)
        elif ty is None:
            raise IRError(f"%{name} = {op}: leaf values need an explicit type")
        self._names[name] = node
        if op == Op.INPUT:  # inputs stay in front, in signature order
            self._nodes.insert(len(self.inputs), node)
        elif self._insert_at is None:
            self._nodes.append(node)
        else:
            self._nodes.insert(self._nodes.index(self._insert_at), node)
        return node

    @contextlib.contextmanager
    def inserting_before(self, node: Node):
        prev, self._insert_at = self._insert_at, node
        try:
            yield
        finally:
            self._insert_at = prev

    def move_before(self, node: Node, anchor: Node) -> None:
        """Move ``node`` to just before ``anchor``; the caller keeps the order topological
        (the verifier checks it after each pass)."""
        self._nodes.remove(node)
        self._nodes.insert(self._nodes.index(anchor), node)

    def replace_all_uses_with(self, old: Node, new: Node) -> None:
        for user in list(old.users):
            user.replace_input(old, new)
        self.outputs = [new if o is old else o for o in self.outputs]

    def erase_node(self, node: Node) -> None:
        if node.users:
            users = ", ".join(f"%{u.name}" for u in node.users)
            raise IRError(f"cannot erase %{node.name}: still used by {users}")
        if node in self.outputs:
            raise IRError(f"cannot erase %{node.name}: it is a graph output")
        node.inputs = ()
        self._nodes.remove(node)
        del self._names[node.name]

    def rename(self, node: Node, name: str) -> None:
        """Give ``node`` a free name (graph values cannot be renamed: types refer to them)."""
        if isinstance(node.ty, GraphType):
            raise IRError(f"cannot rename graph value %{node.name}: edge types refer to it")
        if name in self._names or not _NAME_RE.match(name):
            raise IRError(f"cannot rename %{node.name} to {name!r}")
        del self._names[node.name]
        node.name = name
        self._names[name] = node

    def set_outputs(self, outputs: Iterable[Node]) -> None:
        self.outputs = list(outputs)

    def retype(self, node: Node) -> None:
        """Recompute the type of ``node`` after its inputs or attributes changed."""
        if OPS[node.op].infer is not None:
            node.ty = infer_type(node)

    def copy(self) -> "Graph":
        """A deep copy (same names, types, attributes and meta)."""
        g = Graph(self.name)
        m: dict[Node, Node] = {}
        for n in self._nodes:
            c = Node(g, n.name, n.op, _copy_attrs(n.attrs), n.ty)
            c.inputs = [m[i] for i in n.inputs]
            c.meta = dict(n.meta)
            g._nodes.append(c)
            g._names[c.name] = c
            m[n] = c
        g.outputs = [m[o] for o in self.outputs]
        g.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in self.meta.items()}
        return g

    def __str__(self) -> str:
        from gcomp.ir.printer import print_graph
        return print_graph(self)


def _copy_attrs(attrs: dict) -> dict:
    return {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}
