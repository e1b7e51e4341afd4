"""Graph preparation: CSR / CSC arrays for every graph value of a plan.

Runs once when a graph is bound (numpy only; no compiler needed).  Edges are
stored in CSR order: sorted by destination, stable, so edges into one node keep
the order the user gave them.  For each graph value:

``indptr`` (int64, n+1), ``indices`` (int32, sources), ``rows`` (int32,
destinations): the CSR arrays kernels read.
``perm`` (int64): CSR position -> the edge's canonical id (the user's edge id
for an input graph; for a derived graph, the order PyG builds: kept edges in
order, then one self loop per node).  Edge inputs are permuted into CSR order
with it, edge outputs back out of it.
``origin`` (int64, derived graphs): CSR position -> CSR position of the same
edge in the parent, or -1 for a new self loop (the last existing loop of a node
when mode is ``add_remaining``, as PyG's add_remaining_self_loops keeps it).
``csc_indptr`` / ``csc_indices`` / ``csc_eid``: edges grouped by source (the
transposed graph); ``csc_indices`` holds each out-edge's destination and
``csc_eid`` the CSR position of its edge (out-degrees, backward passes);
``csc_perm`` its canonical id.
``hub_tasks`` / ``hub_rows`` (and ``csc_`` ones, by source): the rows longer than
``task_edges`` (``HUB_EDGES`` or more) cut into tasks of at most that many edges, for the
GPU's aggregation (``hub_split``).

Arrays are computed on first use, so a plan that never needs CSC never pays
for it.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import scipy.sparse as sp

from gcomp.errors import InputError


HUB_EDGES = 128  # a GPU thread's longest edge loop in an aggregation (hub_split), at least
# tasks a graph may always have, whatever its rows (a GPU runs thousands of warps at once;
# their partial rows are at most 16 KB per feature)
MIN_TASKS = 4096


def task_edges(indptr: np.ndarray) -> int:
    """Edges per hub task for a graph: ``HUB_EDGES``, doubled while the tasks would be
    more than half the rows (and more than ``MIN_TASKS``).  Each task reduces into a
    partial row of the aggregation's width (t x F float32 scratch, which TVM's device
    workspace pool keeps once allocated), so the partials take at most half the output's
    memory, and a hub row merges fewer of them (one thread per feature adds its row's
    partials in order).  At 128 edges the Reddit-size graph (492 edges a row on average)
    had 4.1 times as many tasks as rows: GraphSAGE's 602-wide mean aggregation (once per
    feed) held 2.2 GB of partials on the GPU (156 MB at the 1,024 edges chosen now); the
    arxiv-size graph keeps 128, and so does a graph of few rows with long ones (up to
    ``MIN_TASKS`` tasks), whose hubs would otherwise be walked by few threads."""
    deg = np.diff(indptr)
    allowed = max(len(deg) // 2, MIN_TASKS)
    size = HUB_EDGES
    while int(np.sum(-(-deg[deg > size] // size))) > allowed:
        size *= 2
    return size


def hub_split(indptr: np.ndarray, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tasks, rows): ``tasks`` (int64, t x 3) the edge ranges [start, end) that cut each
    row of more than ``size`` edges (default ``task_edges``) into pieces of ``size`` (the
    last one shorter), and the row each piece belongs to (GAT's attention needs it: its
    scores read the row's own term); ``rows`` (int64, n+1) row i's tasks, ``rows[i]`` to
    ``rows[i+1]`` (none for shorter rows).  With no such row, one empty task (a kernel
    launch needs one thread block)."""
    deg = np.diff(indptr)
    size = task_edges(indptr) if size is None else size
    k = np.where(deg > size, -(-deg // size), 0)
    rows = np.concatenate([[0], np.cumsum(k)]).astype(np.int64)
    if rows[-1] == 0:
        return np.zeros((1, 3), np.int64), rows
    row_of = np.repeat(np.arange(len(deg)), k)
    start = indptr[row_of] + (np.arange(rows[-1]) - rows[row_of]) * size
    end = np.minimum(start + size, indptr[row_of + 1])
    return np.stack([start, end, row_of], axis=1).astype(np.int64), rows


def stable_groups(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(indptr, order): ``keys`` (integers in [0, n)) grouped by value, stably: group k is
    ``order[indptr[k]:indptr[k + 1]]``, positions in increasing order, so ``order`` equals
    ``np.argsort(keys, kind="stable")``.  A counting sort, through scipy's COO -> CSR
    conversion of the matrix with a one at (key, position): linear in the edges, where
    numpy's stable argsort of 64-bit keys is a merge sort (20M edges into 200,000 nodes,
    2 cores: 2.9 s -> 0.9 s)."""
    e = keys.shape[0]
    # the index type scipy would convert both to (int64 positions took 8 bytes an edge)
    idx = np.int32 if max(n, e) < 2**31 else np.int64
    a = sp.csr_array((np.ones(e, np.int8), (keys.astype(idx), np.arange(e, dtype=idx))),
                     shape=(n, max(e, 1)))
    a.sort_indices()  # each row's positions ascending: the stable order
    return a.indptr.astype(np.int64, copy=False), a.indices.astype(np.int64, copy=False)


def from_csr_order(values: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Edge values in CSR order -> canonical order, ``perm`` a structure's ``perm``."""
    out = np.empty_like(values)
    out[perm] = values
    return out


class GraphStructure:
    def __init__(self, num_nodes: int, indptr, indices, rows, perm_fn, origin=None):
        self.num_nodes = int(num_nodes)
        self.indptr = indptr
        self.indices = indices
        self.rows = rows
        self._perm_fn = perm_fn
        self._origin = origin

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @cached_property
    def perm(self) -> np.ndarray:
        return self._perm_fn()

    @property
    def origin(self) -> np.ndarray:
        if self._origin is None:
            raise InputError("origin is only defined for graphs derived by self_loops")
        return self._origin

    @cached_property
    def csc_eid(self) -> np.ndarray:
        return stable_groups(self.indices, self.num_nodes)[1]

    @cached_property
    def csc_perm(self) -> np.ndarray:
        """Canonical id of each out-edge, in CSC order (dropout masks hashed per edge)."""
        return self.perm[self.csc_eid]

    @cached_property
    def csc_indices(self) -> np.ndarray:
        """Destination of each out-edge, in CSC order."""
        return self.rows[self.csc_eid]

    @cached_property
    def csc_indptr(self) -> np.ndarray:
        counts = np.bincount(self.indices, minlength=self.num_nodes)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @cached_property
    def _hub_split(self) -> tuple[np.ndarray, np.ndarray]:
        return hub_split(self.indptr)

    @cached_property
    def _csc_hub_split(self) -> tuple[np.ndarray, np.ndarray]:
        return hub_split(self.csc_indptr)

    @property
    def hub_tasks(self) -> np.ndarray:
        return self._hub_split[0]

    @property
    def hub_rows(self) -> np.ndarray:
        return self._hub_split[1]

    @property
    def csc_hub_tasks(self) -> np.ndarray:
        return self._csc_hub_split[0]

    @property
    def csc_hub_rows(self) -> np.ndarray:
        return self._csc_hub_split[1]

    def array(self, name: str) -> np.ndarray:
        return getattr(self, name)

    def into_first(self, limit: int) -> "GraphStructure":
        """The same graph without the edges into rows ``limit`` and after: what an
        aggregation over out-edges of a tensor that is zero on those rows needs
        (``codegen/loss_rows.py``); its CSC arrays keep the order of this one's.  A new
        structure on each call, which callers keep: cached here, the two would hold each
        other, and their arrays would wait for the garbage collector."""
        if limit >= self.num_nodes:
            return self
        end = int(self.indptr[limit])  # CSR order is by destination: a prefix of edges
        return GraphStructure(self.num_nodes, self.indptr[:limit + 1], self.indices[:end],
                              self.rows[:end], lambda: self.perm[:end])

    # ------------------------------------------------------------------ edge values
    def to_csr_order(self, values: np.ndarray) -> np.ndarray:
        """Edge values in canonical order -> CSR order."""
        return values[self.perm]

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_edge_index(edge_index: np.ndarray, num_nodes: int) -> "GraphStructure":
        """CSR by destination of a validated (2, E) int64 edge index."""
        src, dst = edge_index[0], edge_index[1]
        indptr, order = stable_groups(dst, num_nodes)
        return GraphStructure(num_nodes, indptr, src[order].astype(np.int32),
                              dst[order].astype(np.int32), lambda: order)

    def derive(self, mode: str, node_ids: np.ndarray | None = None) -> "GraphStructure":
        """The graph made by ``self_loops[mode]`` (see ``gcomp.ir.ops``).

        ``node_ids``: the user's id of each node when the runtime reordered them; the new
        self loops are numbered in the user's node order (their canonical edge ids).
        """
        n = self.num_nodes
        is_loop = self.indices == self.rows
        keep = np.ones(self.num_edges, bool) if mode == "add" else ~is_loop
        kept = np.nonzero(keep)[0]
        kept_per_row = np.bincount(self.rows[kept], minlength=n)
        n_kept = len(kept)
        parent = self

        def kept_rank():  # canonical id of each kept edge among the kept ones
            mask = np.zeros(parent.num_edges, bool)
            mask[parent.perm[kept]] = True
            return (np.cumsum(mask) - 1)[parent.perm[kept]]

        if mode == "remove":
            indptr = np.concatenate([[0], np.cumsum(kept_per_row)]).astype(np.int64)
            return GraphStructure(n, indptr, self.indices[kept], self.rows[kept],
                                  lambda: kept_rank().astype(np.int64), kept.astype(np.int64))
        # each row: its kept edges in order, then its new self loop (stable order by dst)
        counts = kept_per_row + 1
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        total = int(indptr[-1])
        loop_slot = indptr[1:] - 1
        is_new = np.zeros(total, bool)
        is_new[loop_slot] = True
        indices = np.empty(total, np.int32)
        indices[~is_new] = self.indices[kept]
        indices[loop_slot] = np.arange(n, dtype=np.int32)
        rows = np.repeat(np.arange(n, dtype=np.int32), counts)
        origin = np.empty(total, np.int64)
        origin[~is_new] = kept
        loop_origin = np.full(n, -1, np.int64)
        if mode == "add_remaining":
            lp = np.nonzero(is_loop)[0]
            np.maximum.at(loop_origin, self.rows[lp], lp)  # the last loop of a node wins
        origin[loop_slot] = loop_origin

        def perm():
            p = np.empty(total, np.int64)
            p[~is_new] = kept_rank()
            p[loop_slot] = n_kept + (np.arange(n) if node_ids is None else node_ids)
            return p

        return GraphStructure(n, indptr, indices, rows, perm, origin)
