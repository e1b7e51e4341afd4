"""Partition a graph's nodes across ranks, and report what the partition costs.

    parts = partition_graph(graph, k=4)                       # METIS, edge-balanced
    parts = partition_graph(graph, k=8, hosts=2)              # hosts first, then ranks of a host
    parts = partition_graph(graph, k=4, method="range")       # fast fallback, no METIS
    print(format_report(partition_report(graph, parts, 4)))

A rank owns the nodes of its part and computes their rows; it stores their
in-edges (complete) and halo copies of the remote sources of those edges.  So
the work of a rank is about ``owned nodes + in-edges``, and what it receives
each layer is its halo.

Methods:

* ``metis``: pymetis k-way on the symmetrized graph (no self loops).  With
  ``balance="edges"`` (default) a node weighs ``1 + in-degree``, so parts get
  similar edge counts, not only node counts (power-law graphs otherwise give one
  rank most of the edges).
* hierarchical (``hosts=H``): METIS into H host parts (cut between hosts is what
  the slow network carries), then each host part into ``k / H`` rank parts on its
  induced subgraph, as Morphling's partitioner does.  Part ``h * (k/H) + j`` is
  rank j of host h, which matches ``mpiexec`` placing consecutive ranks on a host.
* ``range``: contiguous chunks of a reverse Cuthill-McKee order, balanced by the
  same weights.  O(E), for graphs where METIS is too slow or too big.
* ``auto``: METIS up to ``METIS_MAX_EDGES`` symmetric edges, else ``range``.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp

from gcomp.errors import InputError
from gcomp.runtime.data import GraphData, check_seed

METIS_MAX_EDGES = 50_000_000
METHODS = ("auto", "metis", "range", "random")


def _symmetric(graph: GraphData, nodes: np.ndarray | None = None) -> sp.csr_matrix:
    """Undirected adjacency without self loops (of the subgraph induced by ``nodes``)."""
    src, dst = graph.edge_index
    n = graph.num_nodes
    if nodes is not None:
        local = np.full(n, -1, np.int64)
        local[nodes] = np.arange(len(nodes))
        keep = (local[src] >= 0) & (local[dst] >= 0)
        src, dst, n = local[src[keep]], local[dst[keep]], len(nodes)
    keep = src != dst
    a = sp.coo_matrix((np.ones(int(keep.sum()), np.int8), (src[keep], dst[keep])), shape=(n, n))
    a = (a + a.T).tocsr()
    a.sum_duplicates()
    a.sort_indices()
    return a


def node_weights(graph: GraphData, balance: str = "edges") -> np.ndarray:
    """The work of owning each node: 1, or 1 + its in-degree (its rows and its in-edges)."""
    if balance == "nodes":
        return np.ones(graph.num_nodes, np.int64)
    if balance != "edges":
        raise InputError(f"balance must be 'nodes' or 'edges', got {balance!r}")
    return 1 + np.bincount(graph.edge_index[1], minlength=graph.num_nodes).astype(np.int64)


def _metis(adj: sp.csr_matrix, k: int, weights: np.ndarray, seed: int) -> np.ndarray:
    import pymetis
    if k == 1 or adj.shape[0] == 0:
        return np.zeros(adj.shape[0], np.int64)
    opts = pymetis.Options(seed=seed % 2**31)  # METIS takes a C int; any seed is valid
    csr = pymetis.CSRAdjacency(adj.indptr.astype(np.int64), adj.indices.astype(np.int64))
    _, parts = pymetis.part_graph(k, adjacency=csr, vweights=weights.astype(np.int64),
                                  options=opts)
    return np.asarray(parts, np.int64)


def _range(adj: sp.csr_matrix, k: int, weights: np.ndarray) -> np.ndarray:
    from scipy.sparse.csgraph import reverse_cuthill_mckee
    order = reverse_cuthill_mckee(adj, symmetric_mode=True) if adj.nnz else np.arange(adj.shape[0])
    cum = np.cumsum(weights[order])
    cut = cum[-1] * np.arange(1, k) / k  # equal shares of the total weight
    part_of_pos = np.searchsorted(cut, cum - weights[order] * 0.5)
    parts = np.empty(len(order), np.int64)
    parts[order] = part_of_pos
    return parts


def partition_graph(graph: GraphData, k: int, method: str = "auto", hosts: int | None = None,
                    balance: str = "edges", seed: int = 0) -> np.ndarray:
    """Part (0..k-1) of every node; every part is non-empty."""
    n = graph.num_nodes
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise InputError(f"the number of parts must be a positive integer, got {k!r}")
    if k > n:
        raise InputError(f"cannot split {n} nodes into {k} non-empty parts")
    if method not in METHODS:
        raise InputError(f"unknown partition method {method!r} (choose from {', '.join(METHODS)})")
    check_seed(seed)
    w = node_weights(graph, balance)
    if method == "random":
        if hosts is not None and hosts != 1:
            raise InputError(f"--hosts {hosts}: a random partition has no hosts to keep "
                             "edges within; hierarchical partitions are metis or range")
        parts = np.random.default_rng(seed).permutation(np.arange(n) % k)
        return check_parts(parts, n, k)
    if hosts is not None and hosts != 1:
        if hosts < 1 or k % hosts:
            raise InputError(f"--hosts {hosts} must divide the number of parts {k}")
        per = k // hosts
        host = partition_graph(graph, hosts, method, None, balance, seed)
        parts = np.empty(n, np.int64)
        for h in range(hosts):
            nodes = np.nonzero(host == h)[0]
            sub = _symmetric(graph, nodes)
            parts[nodes] = h * per + _split(sub, per, w[nodes], method, seed)
        return check_parts(parts, n, k)
    return check_parts(_split(_symmetric(graph), k, w, method, seed), n, k)


def _split(adj, k, w, method, seed):
    if k > adj.shape[0]:
        raise InputError(f"cannot split {adj.shape[0]} nodes into {k} non-empty parts")
    if method == "auto":
        method = "metis" if adj.nnz <= METIS_MAX_EDGES else "range"
    parts = _metis(adj, k, w, seed) if method == "metis" else _range(adj, k, w)
    if len(np.unique(parts)) < k:  # METIS may leave a part empty on tiny or odd graphs
        parts = _range(adj, k, w)
    return parts


def check_parts(parts, num_nodes: int, k: int) -> np.ndarray:
    """Validate a user- or METIS-given partition vector."""
    p = np.asarray(parts)
    if p.shape != (num_nodes,):
        raise InputError(f"the partition must give one part per node ({num_nodes}), got shape "
                         f"{p.shape}")
    if not np.issubdtype(p.dtype, np.integer):
        if not np.issubdtype(p.dtype, np.floating) or not np.all(np.isfinite(p)) \
                or np.any(p != np.round(p)):
            raise InputError("partition ids must be integers")
    # the range is checked in the given type (whole numbers by now): a uint64 id of 2^63
    # or more reads negative as int64
    if num_nodes and (p.min() < 0 or p.max() >= k):
        raise InputError(f"partition ids must lie in 0..{k - 1}, got "
                         f"{int(p.min())}..{int(p.max())}")
    p = p.astype(np.int64)
    counts = np.bincount(p, minlength=k)
    if (counts == 0).any():
        raise InputError(f"part(s) {np.nonzero(counts == 0)[0].tolist()} own no node; use fewer "
                         f"ranks than nodes or another partition")
    return p


def partition_report(graph: GraphData, parts: np.ndarray, k: int, seconds: float | None = None,
                     feature_bytes: int = 4) -> dict:
    """Edge cut, halo sizes and balance of ``parts``.

    ``halo`` of a part: distinct remote sources of its nodes' in-edges (rows it receives per
    exchanged node tensor).  ``naive_allgather_rows``: rows an all-gather of every node
    tensor would move instead (each rank receives all rows it does not own).
    """
    src, dst = graph.edge_index
    ps, pd = parts[src], parts[dst]
    cross = ps != pd
    nodes = np.bincount(parts, minlength=k)
    edges = np.bincount(pd, minlength=k)  # in-edges of owned nodes: what a rank stores
    pairs = np.unique(pd[cross] * graph.num_nodes + src[cross])
    halo = np.bincount(pairs // max(graph.num_nodes, 1), minlength=k) if len(pairs) else \
        np.zeros(k, np.int64)
    boundary = np.zeros(graph.num_nodes, bool)
    boundary[dst[cross]] = True
    rep = {
        "parts": int(k), "num_nodes": int(graph.num_nodes), "num_edges": int(graph.num_edges),
        "edge_cut": int(cross.sum()),
        "edge_cut_fraction": float(cross.mean()) if len(cross) else 0.0,
        "nodes": nodes.tolist(), "edges": edges.tolist(), "halo": halo.tolist(),
        "interior": [int(((parts == r) & ~boundary).sum()) for r in range(k)],
        "node_balance": float(nodes.max() / nodes.mean()),
        "edge_balance": float(edges.max() / max(edges.mean(), 1e-9)),
        "halo_rows_total": int(halo.sum()),
        "naive_allgather_rows": int((graph.num_nodes - nodes).sum()),
    }
    rep["halo_vs_allgather"] = rep["halo_rows_total"] / max(rep["naive_allgather_rows"], 1)
    if seconds is not None:
        rep["seconds"] = float(seconds)
    return rep


def format_report(rep: dict) -> str:
    lines = [f"{rep['parts']} parts of {rep['num_nodes']} nodes, {rep['num_edges']} edges"
             + (f" ({rep['method']}, {rep['seconds']:.2f} s)" if "method" in rep else ""),
             f"edge cut      {rep['edge_cut']} ({100 * rep['edge_cut_fraction']:.2f}% of edges)",
             f"balance       nodes {rep['node_balance']:.3f}, edges {rep['edge_balance']:.3f} "
             "(max / mean)",
             f"halo rows     {rep['halo_rows_total']} in all, {100 * rep['halo_vs_allgather']:.2f}%"
             f" of an all-gather ({rep['naive_allgather_rows']})",
             "part       nodes     edges      halo  interior"]
    for r in range(rep["parts"]):
        lines.append(f"{r:<4} {rep['nodes'][r]:>11} {rep['edges'][r]:>9} {rep['halo'][r]:>9} "
                     f"{rep['interior'][r]:>9}")
    return "\n".join(lines)


def timed_partition(graph: GraphData, k: int, **kw) -> tuple[np.ndarray, dict]:
    t0 = time.perf_counter()
    parts = partition_graph(graph, k, **kw)
    rep = partition_report(graph, parts, k, time.perf_counter() - t0)
    rep["method"] = kw.get("method", "auto") + (f", hosts={kw['hosts']}" if kw.get("hosts") else "")
    return parts, rep
