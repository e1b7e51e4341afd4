"""Calibrate when sparse input features pay off, by measuring on the target.

Morphling reports that multiplying sparse X by dense W beats the dense product
above about 80% zeros; the crossover depends on the machine, the layer's widths
and whether the weight gradient X.T @ dY is computed too, so gcomp measures it:
the dense kernels (``matmul``, and for training ``matmul_tn``) against the
sparse-X kernels (aggregations over X's nonzeros, by rows and by columns) for
this layer's K and M, compiled for the target, timed on random X of increasing
sparsity.  The threshold is the lowest measured sparsity from which the sparse
kernels are at least 10% faster at every higher sparsity too (1.0: never); the
margin keeps timing noise from picking the sparse path for dense features.
"""

from __future__ import annotations

import time

import numpy as np

from gcomp.codegen.kernels import KernelSpec

SPARSITIES = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
MARGIN = 0.9


def _median_time(fn, args, reps: int = 5) -> float:
    fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def calibrate_sparse_threshold(K: int, M: int, target: dict, training: bool = False,
                               rows: int = 2048, seed: int = 0) -> tuple[float, list[dict]]:
    import scipy.sparse as sp
    import tvm

    from gcomp.codegen.build import build_library
    from gcomp.runtime.features import SparseFeatures

    if target["kind"] != "llvm":  # timings need the target machine: only the host can measure
        return 0.8, [{"note": "not measured: the target is not this machine; Morphling's 0.80"}]
    specs = {"dense": KernelSpec.make("matmul", K=K, M=M),
             "sparse": KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge")}
    if training:
        specs["dense_grad"] = KernelSpec.make("matmul_tn", K=K, M=M)
        specs["sparse_grad"] = KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge",
                                               indirect=True)
    lib = tvm.runtime.load_module(str(build_library({s.name: s for s in specs.values()}, target)))
    rng = np.random.default_rng(seed)
    dev = tvm.cpu()

    def t(a):
        return tvm.runtime.tensor(a, dev)
    w = t(rng.standard_normal((K, M)).astype(np.float32))
    dy = t(rng.standard_normal((rows, M)).astype(np.float32))
    out = tvm.runtime.empty((rows, M), "float32", dev)
    gout = tvm.runtime.empty((K, M), "float32", dev)
    table = []
    for s in SPARSITIES:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x[rng.random((rows, K)) < s] = 0.0
        f = SparseFeatures(sp.csr_matrix(x))
        dense = _median_time(lib[specs["dense"].name], (t(x), w, out))
        sparse = _median_time(lib[specs["sparse"].name], (t(f.indptr), t(f.indices), t(f.values),
                                                         w, out))
        if training:
            dense += _median_time(lib[specs["dense_grad"].name], (t(x), dy, gout))
            sparse += _median_time(lib[specs["sparse_grad"].name], (
                t(f.csc_indptr), t(f.csc_indices), t(f.csc_eid), t(f.values), dy, gout))
        table.append({"sparsity": s, "dense_ms": dense * 1e3, "sparse_ms": sparse * 1e3})
    threshold = 1.0
    for row in reversed(table):  # the run of sparsities, from the top, where sparse wins
        if row["sparse_ms"] < MARGIN * row["dense_ms"]:
            threshold = row["sparsity"]
        else:
            break
    return threshold, table
