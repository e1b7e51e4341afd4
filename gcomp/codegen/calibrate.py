"""Calibrate when sparse input features pay off, by measuring on the target.

Morphling reports that multiplying sparse X by dense W beats the dense product
above about 80% zeros; the crossover depends on the machine and on the layer's
widths, so gcomp measures it: the dense matmul kernel and the sparse-X kernel
(an aggregation over X's nonzeros) for this layer's K and M, compiled for the
target, timed on random X of increasing sparsity.  The threshold is the lowest
measured sparsity at which the sparse kernel wins (1.0: never).
"""

from __future__ import annotations

import time

import numpy as np

from gcomp.codegen.kernels import KernelSpec

SPARSITIES = (0.0, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)


def _median_time(fn, args, reps: int = 5) -> float:
    fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def calibrate_sparse_threshold(K: int, M: int, target: dict, rows: int = 2048,
                               seed: int = 0) -> tuple[float, list[dict]]:
    import scipy.sparse as sp
    import tvm

    from gcomp.codegen.build import build_library

    if target["kind"] != "llvm":  # timings need the target machine: only the host can measure
        return 0.8, [{"note": "not measured: the target is not this machine; Morphling's 0.80"}]
    dense = KernelSpec.make("matmul", K=K, M=M)
    sparse = KernelSpec.make("csr_agg", reduce="sum", H=1, C=M, weight="edge")
    lib = tvm.runtime.load_module(str(build_library({dense.name: dense, sparse.name: sparse},
                                                    target)))
    rng = np.random.default_rng(seed)
    dev = tvm.cpu()
    w = tvm.runtime.tensor(rng.standard_normal((K, M)).astype(np.float32), dev)
    out = tvm.runtime.empty((rows, M), "float32", dev)
    table, threshold = [], 1.0
    for s in SPARSITIES:
        x = rng.standard_normal((rows, K)).astype(np.float32)
        x[rng.random((rows, K)) < s] = 0.0
        csr = sp.csr_matrix(x)
        t_dense = _median_time(lib[dense.name], (tvm.runtime.tensor(x, dev), w, out))
        t_sparse = _median_time(lib[sparse.name], (
            tvm.runtime.tensor(csr.indptr.astype(np.int64), dev),
            tvm.runtime.tensor(csr.indices.astype(np.int32), dev),
            tvm.runtime.tensor(csr.data.astype(np.float32).reshape(-1, 1), dev), w, out))
        table.append({"sparsity": s, "dense_ms": t_dense * 1e3, "sparse_ms": t_sparse * 1e3})
        if t_sparse < t_dense and threshold == 1.0:
            threshold = s
    return threshold, table
