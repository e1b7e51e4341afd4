"""Liveness-based memory planning for one bound graph.

Expects: a plan and the sizes of one graph (``N`` and every ``E:<graph>``).
Guarantees: every run-phase intermediate buffer gets storage that no other
buffer uses during its lifetime (from the first step that touches it to the
last); buffers whose lifetimes do not overlap share storage (greedy best fit,
in step order).  Pinned buffers keep storage of their own: parameters,
constants and state (they outlive the binding), inputs (copied in once),
outputs and gradients (read after the run), and everything the bind- and
feed-phase steps write (computed once, read on every run).  Views (reshapes) share their
root's storage and extend its lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from gcomp.runtime.plan import Plan

ITEMSIZE = {"float32": 4, "int32": 4, "int64": 8, "float64": 8}


def _root(plan: Plan, name: str) -> str:
    return plan.buffers[name].get("alias", name)


def nbytes(plan: Plan, name: str, sizes: dict[str, int]) -> int:
    b = plan.buffers[name]
    return int(prod(sizes[d] if isinstance(d, str) else d for d in b["dims"])) * \
        ITEMSIZE[b["dtype"]]


@dataclass
class MemoryPlan:
    slots: dict[str, int]                 # planned root buffer -> storage slot
    slot_bytes: list[int]                 # size of each slot
    pinned: list[str]                     # root buffers with storage of their own
    pinned_bytes: int
    unplanned_bytes: int                  # what the planned buffers would take without reuse
    stats: dict = field(default_factory=dict)

    @property
    def planned_bytes(self) -> int:
        return sum(self.slot_bytes)

    def summary(self) -> dict:
        return {"pinned_bytes": self.pinned_bytes, "planned_bytes": self.planned_bytes,
                "without_reuse_bytes": self.unplanned_bytes,
                "total_bytes": self.pinned_bytes + self.planned_bytes,
                "buffers": len(self.slots), "slots": len(self.slot_bytes)}


def plan_memory(plan: Plan, sizes: dict[str, int], store_names=()) -> MemoryPlan:
    pinned = set(store_names) | set(plan.params) | set(plan.consts) | set(plan.state)
    pinned |= {i["name"] for i in plan.inputs if i["role"] != "graph"}
    pinned |= {_root(plan, o["buffer"]) for o in plan.outputs}
    pinned |= {_root(plan, g) for g in plan.grads.values()}
    for s in plan.bind_steps + plan.feed_steps:
        pinned |= {_root(plan, a["buf"]) for a in s["args"] if "buf" in a}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, s in enumerate(plan.steps):
        for a in s["args"]:
            if "buf" in a:
                r = _root(plan, a["buf"])
                first.setdefault(r, k)
                last[r] = k
    roots = [r for r in first if r not in pinned]
    pinned_roots = sorted({_root(plan, b) for b in plan.buffers} & pinned -
                          set(store_names) - set(plan.params) - set(plan.consts) - set(plan.state))
    free: list[int] = []  # free slot ids
    slot_bytes: list[int] = []
    slots: dict[str, int] = {}
    release_at: dict[int, list[str]] = {}
    for r in roots:
        release_at.setdefault(last[r], []).append(r)
    by_start: dict[int, list[str]] = {}
    for r in roots:
        by_start.setdefault(first[r], []).append(r)
    for k in range(len(plan.steps)):
        for r in sorted(by_start.get(k, ()), key=lambda r: -nbytes(plan, r, sizes)):
            need = nbytes(plan, r, sizes)
            fits = [s for s in free if slot_bytes[s] >= need]
            if fits:
                s = min(fits, key=lambda s: slot_bytes[s])  # best fit
                free.remove(s)
            elif free:  # grow the largest free slot rather than adding one
                s = max(free, key=lambda s: slot_bytes[s])
                free.remove(s)
                slot_bytes[s] = need
            else:
                s = len(slot_bytes)
                slot_bytes.append(need)
            slots[r] = s
        free.extend(slots[r] for r in release_at.get(k, ()))
    return MemoryPlan(slots, slot_bytes, pinned_roots,
                      sum(nbytes(plan, r, sizes) for r in pinned_roots),
                      sum(nbytes(plan, r, sizes) for r in roots))
