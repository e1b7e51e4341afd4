"""Sparse node features: the nonzeros of X as CSR and CSC arrays, for the sparse-X
kernel variants (``plan.variants``; Morphling's sparse input features).

``x @ W`` becomes an aggregation over X's nonzeros gathering rows of W, and the
weight gradient ``X.T @ dY`` an aggregation over X's columns (CSC).  Arrays:
``indptr`` (int64, n+1), ``indices`` (int32 columns), ``rows`` (int32),
``values`` (float32, nnz x 1), and ``csc_indptr`` (int64, F+1), ``csc_indices``
(int32 rows), ``csc_eid`` (int64: CSC slot -> CSR position).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from gcomp.runtime.graph import stable_groups


def sparsity(x) -> float:
    """Fraction of zeros, 1 - nnz / (N * F)."""
    size = x.shape[0] * x.shape[1]
    if size == 0:
        return 0.0
    nnz = x.nnz if sp.issparse(x) else int(np.count_nonzero(x))
    return 1.0 - nnz / size


def sparse_enough(x, threshold: float | None) -> bool:
    """Whether the sparse-feature kernels run for features ``x``: a threshold was set and
    their fraction of zeros reaches it."""
    return x is not None and threshold is not None and sparsity(x) >= threshold


class SparseFeatures:
    def __init__(self, x):
        csr = sp.csr_matrix(x, dtype=np.float32)
        csr.sort_indices()
        n, f = csr.shape
        self.num_features = f
        self.nnz = int(csr.nnz)
        self.indptr = csr.indptr.astype(np.int64)
        self.indices = csr.indices.astype(np.int32)
        self.rows = np.repeat(np.arange(n, dtype=np.int32), np.diff(csr.indptr))
        self.values = csr.data.astype(np.float32).reshape(-1, 1)
        self.csc_indptr, self.csc_eid = stable_groups(self.indices, f)
        self.csc_indices = self.rows[self.csc_eid]

    def array(self, name: str) -> np.ndarray:
        return getattr(self, name)
