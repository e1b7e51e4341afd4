"""Liveness-based memory planning for one bound graph.

Expects: a plan and the sizes of one graph (``N`` and every ``E:<graph>``).
Guarantees: every run-phase intermediate buffer gets storage that no other
buffer uses during its lifetime (from the first step that touches it to the
last); buffers whose lifetimes do not overlap share storage (greedy best fit,
in step order; a buffer given a slot at least twice its size takes its start, and
the rest becomes a slot of its own).  Pinned buffers keep storage of their own: parameters,
constants and state (they outlive the binding), inputs the run steps read
(copied in once), outputs and gradients (read after the run), and everything
the bind- and feed-phase steps write (computed once, read on every run).  A node
input that only the feed steps read (GCN's features once ``A X`` is computed
from them) lives before the first run step: the run's intermediates reuse its storage,
and the next feed copies it in again.  Views (reshapes) share their
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


ALIGN = 4096  # slots carved from one storage start on page boundaries


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class MemoryPlan:
    slots: dict[str, int]                 # planned root buffer -> slot
    slot_bytes: list[int]                 # size of each slot
    slot_at: list[tuple[int, int]]        # slot -> (storage, byte offset in it)
    storage_bytes: list[int]              # size of each storage allocation
    pinned: list[str]                     # root buffers with storage of their own
    pinned_bytes: int
    unplanned_bytes: int                  # what the planned buffers would take without reuse
    stats: dict = field(default_factory=dict)

    @property
    def planned_bytes(self) -> int:
        return sum(self.storage_bytes)

    def summary(self) -> dict:
        return {"pinned_bytes": self.pinned_bytes, "planned_bytes": self.planned_bytes,
                "without_reuse_bytes": self.unplanned_bytes,
                "total_bytes": self.pinned_bytes + self.planned_bytes,
                "buffers": len(self.slots), "slots": len(self.slot_bytes)}


def plan_memory(plan: Plan, sizes: dict[str, int], store_names=(),
                carve: bool = True) -> MemoryPlan:
    """``carve``: whether a slot may be cut into several (views at an offset)."""
    results = {_root(plan, o["buffer"]) for o in plan.outputs}
    results |= {_root(plan, g) for g in plan.grads.values()}
    pinned = set(store_names) | set(plan.params) | set(plan.consts) | set(plan.state) | results
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
    for i in plan.inputs:
        if i["role"] == "node" and i["name"] not in first and i["name"] not in results:
            # read by the feed steps alone: its storage is free once they ran (step -1)
            pinned.discard(i["name"])
            first[i["name"]] = last[i["name"]] = -1
        elif i["role"] != "graph":
            pinned.add(i["name"])
    roots = [r for r in first if r not in pinned]
    pinned_roots = sorted({_root(plan, b) for b in plan.buffers} & pinned -
                          set(store_names) - set(plan.params) - set(plan.consts) - set(plan.state))
    free: list[int] = []  # free slot ids
    slot_bytes: list[int] = []
    slot_at: list[tuple[int, int]] = []
    storage_bytes: list[int] = []
    whole: set[int] = set()  # slots that are their whole storage: they may grow
    slots: dict[str, int] = {}
    release_at: dict[int, list[str]] = {}
    for r in roots:
        release_at.setdefault(last[r], []).append(r)
    by_start: dict[int, list[str]] = {}
    for r in roots:
        by_start.setdefault(first[r], []).append(r)
    for k in range(-1, len(plan.steps)):
        for r in sorted(by_start.get(k, ()), key=lambda r: -nbytes(plan, r, sizes)):
            need = nbytes(plan, r, sizes)
            fits = [s for s in free if slot_bytes[s] >= need]
            growable = [s for s in free if s in whole]
            if fits:
                s = min(fits, key=lambda s: slot_bytes[s])  # best fit
                free.remove(s)
                spare = slot_bytes[s] - _aligned(need)
                if carve and spare >= need:  # the rest of a much larger slot serves others
                    storage, offset = slot_at[s]
                    slot_bytes[s] = _aligned(need)
                    slot_at.append((storage, offset + slot_bytes[s]))
                    slot_bytes.append(spare)
                    free.append(len(slot_bytes) - 1)
                    whole.discard(s)
            elif growable:  # grow the largest free slot rather than adding one
                s = max(growable, key=lambda s: slot_bytes[s])
                free.remove(s)
                slot_bytes[s] = storage_bytes[slot_at[s][0]] = need
            else:
                s = len(slot_bytes)
                slot_bytes.append(need)
                slot_at.append((len(storage_bytes), 0))
                storage_bytes.append(need)
                whole.add(s)
            slots[r] = s
        free.extend(slots[r] for r in release_at.get(k, ()))
    return MemoryPlan(slots, slot_bytes, slot_at, storage_bytes, pinned_roots,
                      sum(nbytes(plan, r, sizes) for r in pinned_roots),
                      sum(nbytes(plan, r, sizes) for r in roots))
