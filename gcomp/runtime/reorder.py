"""Node reordering when a graph is bound: RCM or degree order, chosen by a cost model.

Aggregation gathers the feature rows of each node's neighbours; when those rows
do not fit in the last-level cache, the cost of a gather depends on how far apart
in memory consecutive neighbours are.  Reverse Cuthill-McKee
(``scipy.sparse.csgraph.reverse_cuthill_mckee``) numbers nodes so that edges
connect nearby rows (a band); degree order puts hubs, the rows gathered most,
together at the front.

The cost model on a CPU: the working set is N x (widest node tensor) x 4 bytes.
If it fits in ``CACHE_BYTES`` the order does not matter and the graph stays as
given.  Otherwise the candidate with the smallest mean |src - dst| (the expected
gather distance, in rows) is chosen, if it at least halves the given order's.

On a GPU the order also decides which rows share a thread block, and a block
holds its resources until its longest row is done (the likely cause of what was
measured).  Degree order puts rows of alike length together, the longest first:
on an H200 it made the same SpMM kernel 1.50x faster at arxiv size (F = 32; 1.30x
at F = 128; degrees' CV 8.6) and 1.06x at Reddit size (``bench.gpu``, 2026-11-26),
and the arxiv-size GCN, GraphSAGE and GIN training epochs 9-10% faster (19:28).
So on a GPU it is chosen where the degrees are skewed (coefficient of variation at
least ``SKEW_CV``), unless it would spread the gathers further than the given
order (a given order with locality keeps it).  On a CPU the same choice made the
32-wide bfloat16 mean aggregation of arxiv-synth faster alone (2.29 -> 1.85 ms) but
128-wide float32 rows slower (21.7 -> 23.2) and bf16 training steps hardly different
(AMD EPYC Zen 4, interleaved: GraphSAGE 43.6 -> 43.1 ms, GCN 29.3 -> 30.0), so the CPU
keeps the distance rule.

Reordering is invisible to the user: node inputs are permuted on the way in,
node outputs on the way out, edges keep their order, and dropout masks hash the
user's node ids (the kernels receive them).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from gcomp.runtime.data import GraphData

CACHE_BYTES = 32 << 20  # last-level cache of the machines gcomp was tuned on
MODES = ("auto", "none", "rcm", "degree")
# degrees' coefficient of variation from which a GPU gets degree order: the synthetic
# power-law graphs have 4.7 (PubMed-size) and 8.6 (arxiv-size); Cora 1.3, Citeseer 1.2
SKEW_CV = 2.0


GAP_CHUNK = 1 << 22  # edges per chunk of ``edge_gaps``


def edge_gaps(src: np.ndarray, dst: np.ndarray, position: np.ndarray | None = None):
    """|position[src] - position[dst]| of the edges (rows apart, in the order ``position``
    gives, default as numbered), a chunk at a time: whole, the positions and their
    differences took 16 bytes an edge twice over (320 MB apiece at 20M edges)."""
    for a in range(0, src.shape[0], GAP_CHUNK):
        s, d = src[a:a + GAP_CHUNK], dst[a:a + GAP_CHUNK]
        if position is not None:
            s, d = position[s], position[d]
        yield np.abs(s.astype(np.int64, copy=False) - d)  # int32 ends would wrap


def mean_distance(edge_index: np.ndarray, position: np.ndarray | None = None) -> float:
    if edge_index.shape[1] == 0:
        return 0.0
    total = sum(int(gap.sum()) for gap in edge_gaps(edge_index[0], edge_index[1], position))
    return total / edge_index.shape[1]


def symmetric_pattern(edge_index: np.ndarray, num_nodes: int) -> sp.csr_array:
    """Which nodes are joined, in either direction: a boolean CSR matrix (repeated edges
    merged, self loops kept).  RCM orders it and the narrowest band counts its rows
    (``formats.narrowest_block``), so a binding makes it once for both (20M random edges
    into 200,000 nodes: 2-3 s and about 380 MB of scratch apiece)."""
    n = num_nodes
    a = sp.csr_array((np.ones(edge_index.shape[1], bool), (edge_index[1], edge_index[0])),
                     shape=(n, n))
    return (a + a.T).tocsr()


def rcm_order(g: GraphData, pattern: sp.csr_array | None = None) -> np.ndarray:
    """Reverse Cuthill-McKee of ``g`` (``pattern``: its ``symmetric_pattern``, if made)."""
    if pattern is None:
        pattern = symmetric_pattern(g.edge_index, g.num_nodes)
    return reverse_cuthill_mckee(pattern, symmetric_mode=True).astype(np.int64)


def degrees(g: GraphData) -> np.ndarray:
    """Each node's degree, in and out."""
    return np.bincount(g.edge_index.ravel(), minlength=g.num_nodes)


def degree_order(g: GraphData, deg: np.ndarray | None = None) -> np.ndarray:
    """The nodes by falling degree (``deg``: ``degrees(g)``, if already counted)."""
    deg = degrees(g) if deg is None else deg
    return np.argsort(-deg, kind="stable").astype(np.int64)


def inverse(order: np.ndarray) -> np.ndarray:
    inv = np.empty_like(order)
    inv[order] = np.arange(len(order), dtype=order.dtype)
    return inv


def degree_cv(deg: np.ndarray) -> float:
    """The coefficient of variation (std / mean) of the degrees ``deg``."""
    return float(deg.std() / deg.mean()) if deg.size and deg.mean() > 0 else 0.0


def choose_order(g: GraphData, row_bytes: int, mode: str = "auto", gpu: bool = False,
                 made: dict | None = None):
    """(order or None, report): order[i] is the user's node at row i; ``gpu``: the
    kernels are CUDA's (the block rule above) rather than the CPU's (the cache rule).
    ``made``, if given, receives the candidate orders computed, by name (a caller that
    tries RCM for another reason takes it from there instead of computing it again), and
    the ``symmetric_pattern`` RCM ordered, as ``"pattern"``."""
    report = {"mode": mode, "working_set_bytes": g.num_nodes * row_bytes,
              "mean_distance": {"given": mean_distance(g.edge_index)}}
    if not gpu:
        report["cache_bytes"] = CACHE_BYTES
    if mode == "none" or g.num_nodes == 0:
        report["chosen"] = "given"
        return None, report
    if mode == "auto" and gpu:
        return _gpu_order(g, report)
    if mode == "auto" and g.num_nodes * row_bytes <= CACHE_BYTES:
        report["chosen"] = "given"
        report["reason"] = "the feature rows fit in the cache"
        return None, report
    def rcm(g):
        pattern = symmetric_pattern(g.edge_index, g.num_nodes)
        if made is not None:
            made["pattern"] = pattern
        return rcm_order(g, pattern)
    candidates = {"rcm": rcm, "degree": degree_order}
    if mode != "auto":
        candidates = {mode: candidates[mode]}
    orders = {}
    for name, make in candidates.items():
        orders[name] = make(g)
        if made is not None:
            made[name] = orders[name]
        report["mean_distance"][name] = mean_distance(g.edge_index, inverse(orders[name]))
    best = min(orders, key=lambda k: report["mean_distance"][k])
    if mode == "auto" and report["mean_distance"][best] > 0.5 * report["mean_distance"]["given"]:
        report["chosen"] = "given"
        report["reason"] = f"{best} would not halve the mean gather distance"
        return None, report
    report["chosen"] = best
    return orders[best], report


def _gpu_order(g: GraphData, report: dict):
    deg = degrees(g)  # counted once for the test and the order (229M ends at Reddit size)
    report["degree_cv"] = cv = degree_cv(deg)
    if cv < SKEW_CV:
        report.update(chosen="given", reason=f"degrees alike (CV under {SKEW_CV}): no "
                      "block waits long on one row")
        return None, report
    order = degree_order(g, deg)
    report["mean_distance"]["degree"] = mean_distance(g.edge_index, inverse(order))
    if report["mean_distance"]["degree"] > report["mean_distance"]["given"]:
        report.update(chosen="given", reason="degree order would spread the gathers")
        return None, report
    report.update(chosen="degree", reason="skewed degrees: a block's rows of alike length, "
                  "the longest first")
    return order, report


def relabel(g: GraphData, order: np.ndarray, x: bool = True) -> GraphData:
    """The same graph with node order[i] renumbered i (edges keep their order); without
    its features where ``x`` is False (a copy of them the caller does not need)."""
    inv = inverse(order)

    def rows(a):
        return None if a is None else a[order]
    return GraphData(g.name, g.num_nodes, inv[g.edge_index], rows(g.x) if x else None,
                     g.edge_weight, rows(g.y), rows(g.train_mask), rows(g.val_mask),
                     rows(g.test_mask))


def mask_first(order, mask: np.ndarray):
    """``order`` (None: as given) with the rows of boolean ``mask`` (the user's node
    order) moved before the others, each part in its order: a training step's loss then
    reads rows [0, L) alone (``codegen/loss_rows.py``).  None where the given order already
    has them first."""
    ids = order if order is not None else np.arange(len(mask))
    picked = mask[ids]
    if picked[:int(picked.sum())].all():
        return order
    return np.concatenate([ids[picked], ids[~picked]])


def first_rows(order, mask: np.ndarray) -> int | None:
    """How many rows ``mask`` marks when they are the first ones in ``order``, else None."""
    picked = mask if order is None else mask[order]
    count = int(picked.sum())
    return count if picked[:count].all() else None

