"""Local rewrites as pattern tables (tinygrad's ``PatternMatcher`` idea).

A rule is ``(ops, fn)``: ``fn(node)`` is tried on every node whose op is in
``ops`` and returns a replacement node (created before ``node``) or None.
``apply_rules`` rewrites to a fixed point and removes what became dead.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from gcomp.ir.graph import Graph, Node
from gcomp.ir.ops import Op
from gcomp.ir.types import GraphType

Rule = tuple[frozenset, Callable[[Node], "Node | None"]]


def rule(ops: Iterable[Op]):
    def wrap(fn):
        return (frozenset(ops), fn)
    return wrap


def remove_dead(graph: Graph) -> bool:
    """Erase values nothing uses (inputs stay: they are the model's signature)."""
    changed = False
    for n in reversed(graph.nodes):
        if not n.users and n.op != Op.INPUT and n not in graph.outputs:
            graph.erase_node(n)
            changed = True
    return changed


def apply_rules(graph: Graph, rules: Sequence[Rule], max_rounds: int = 100) -> bool:
    changed = False
    for _ in range(max_rounds):
        replaced: list[tuple[str, Node]] = []
        existing = set(graph.nodes)
        for n in graph.nodes:  # nothing is erased until the round ends
            for ops, fn in rules:
                if n.op in ops:
                    with graph.inserting_before(n):
                        new = fn(n)
                    if new is not None and new is not n:
                        graph.replace_all_uses_with(n, new)
                        replaced.append((n.name, new))
                        break
        if not replaced:
            break
        changed = True
        remove_dead(graph)
        # a value created this round that took over a dead one inherits its name, so printed
        # IR stays readable
        for old_name, new in replaced:
            if (new not in existing and not graph.has(old_name) and graph.has(new.name)
                    and not isinstance(new.ty, GraphType)):
                graph.rename(new, old_name)
    return changed
