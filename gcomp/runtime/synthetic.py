"""Synthetic graphs with power-law degrees, for tests and benchmarks.

Real large graphs (ogbn-arxiv, Reddit) are not available offline; these have
the same node, edge, feature and class counts and a heavy-tailed degree
distribution (Chung-Lu: endpoints drawn with probability proportional to
(rank + 1) ** -exponent, sources and destinations with independent
permutations), from a fixed seed.  ``load_graph`` knows them by name.
"""

from __future__ import annotations

import numpy as np

from gcomp.runtime.data import GraphData

# name: (nodes, directed edges, features, classes)
SIZES = {
    "pubmed-synth": (19_717, 88_648, 500, 3),
    "arxiv-synth": (169_343, 1_166_243, 128, 40),
    "reddit-synth": (232_965, 114_615_892, 602, 41),
}


def power_law_edges(num_nodes: int, num_edges: int, rng: np.random.Generator,
                    exponent: float = 0.8) -> np.ndarray:
    w = (np.arange(num_nodes) + 1.0) ** -exponent
    p = w / w.sum()
    cdf = np.cumsum(p)
    cdf[-1] = 1.0
    src = np.searchsorted(cdf, rng.random(num_edges)).astype(np.int64)
    dst = np.searchsorted(cdf, rng.random(num_edges)).astype(np.int64)
    # different permutations: hubs as sources are not hubs as destinations
    return np.stack([rng.permutation(num_nodes)[src], rng.permutation(num_nodes)[dst]])


def random_split(num_nodes: int, rng: np.random.Generator, fractions=(0.6, 0.2, 0.2)):
    order = rng.permutation(num_nodes)
    a = int(fractions[0] * num_nodes)
    b = a + int(fractions[1] * num_nodes)
    masks = [np.zeros(num_nodes, bool) for _ in range(3)]
    masks[0][order[:a]] = True
    masks[1][order[a:b]] = True
    masks[2][order[b:]] = True
    return masks


def synthetic_graph(num_nodes: int, num_edges: int, num_features: int, num_classes: int,
                    seed: int = 0, name: str = "synthetic", exponent: float = 0.8) -> GraphData:
    rng = np.random.default_rng(seed)
    ei = power_law_edges(num_nodes, num_edges, rng, exponent)
    x = rng.standard_normal((num_nodes, num_features), dtype=np.float32)
    y = rng.integers(0, num_classes, num_nodes)
    tr, va, te = random_split(num_nodes, rng)
    return GraphData(name, num_nodes, ei, x, None, y, tr, va, te)


def named(name: str, seed: int = 0) -> GraphData:
    n, e, f, c = SIZES[name]
    return synthetic_graph(n, e, f, c, seed=seed, name=name)
