"""The GPU forms of kernel definitions (``gpu=True``), compiled for the CPU without a
schedule and checked against numpy in float64: their arithmetic is tested on every
machine, their CUDA schedules on a GPU (``tests/gpu``)."""

import numpy as np
import pytest
import tvm

from gcomp.codegen.kernels import KernelSpec, define


@pytest.mark.parametrize("K,M,n", [(8, 3, 37), (6, 5, 200), (3, 7, 5), (128, 32, 1000)])
def test_matmul_tn_gpu_form(K, M, n):
    spec = KernelSpec.make("matmul_tn", K=K, M=M, gpu=True, chunks=16)
    fn = tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
    rng = np.random.default_rng(K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y = rng.standard_normal((n, M)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((K, M), np.float32))
    fn(tvm.runtime.tensor(x), tvm.runtime.tensor(y), out)
    ref = x.astype(np.float64).T @ y.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
