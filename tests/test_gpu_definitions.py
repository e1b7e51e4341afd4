"""The GPU forms of kernel definitions (``gpu=True``), compiled for the CPU without a
schedule and checked against numpy in float64: their arithmetic is tested on every
machine, their CUDA schedules on a GPU (``tests/gpu``)."""

import numpy as np
import pytest
import tvm

from gcomp.codegen.kernels import KernelSpec, define


@pytest.mark.parametrize("K,M,n", [(8, 3, 37), (6, 5, 200), (3, 7, 5), (128, 32, 1000),
                                   (1433, 7, 300), (41, 40, 5000), (602, 41, 90)])
def test_matmul_tn_gpu_form(K, M, n):
    spec = KernelSpec.make("matmul_tn", K=K, M=M, gpu=True)
    fn = tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
    rng = np.random.default_rng(K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y = rng.standard_normal((n, M)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((K, M), np.float32))
    fn(tvm.runtime.tensor(x), tvm.runtime.tensor(y), out)
    ref = x.astype(np.float64).T @ y.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("K", [1, 3, 8, 32, 40, 64, 128, 384, 602, 1433])
@pytest.mark.parametrize("M", [1, 3, 7, 16, 32, 41, 128, 384])
def test_matmul_tn_gpu_tiles_are_exact(K, M):
    """The GPU weight gradient's tiling: every thread split divides its (padded) axis, the
    padding covers the result, each thread copies whole elements of both staged tiles,
    and a block fits its threads and shared memory."""
    from gcomp.codegen.dense_kernels import GPU_TN_SHARED, GPU_TN_THREADS, gpu_tn_tiles
    t = gpu_tn_tiles(K, M)
    threads = t.nx * t.ny
    assert 1 <= threads <= GPU_TN_THREADS and 1 <= t.P <= 1024
    assert t.BK == t.ta * t.ny and t.Kp % t.BK == 0 and t.Kp >= K and t.Kp - K < t.BK
    assert t.Mp == t.tb * t.nx and t.Mp >= M and t.Mp - M < t.nx
    assert (t.R * t.BK) % threads == 0 and (t.R * t.Mp) % threads == 0
    assert t.R * (t.BK + t.Mp) * 4 <= GPU_TN_SHARED
    assert threads >= min(64, K * M // 16)  # enough threads to hide the loads' latency


@pytest.mark.parametrize("K,M,n", [(128, 32, 1000), (32, 40, 77), (602, 41, 50), (3, 7, 5),
                                   (64, 384, 130), (1433, 16, 40)])
@pytest.mark.parametrize("epilogue", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_gpu_form(K, M, n, epilogue, trans_b):
    """The GPU's tiled product (padded rows and columns, the epilogue and the bound check
    in the output block) against numpy in float64; the epilogue: bias, then relu.
    ``trans_b``: given w as [M, K] (a backward's dy @ W.T), read transposed."""
    kw = {"epilogue": (("bias_add", (), 0, False), ("relu", (), None, False)),
          "extras": ("vec",)} if epilogue else {}
    spec = KernelSpec.make("matmul", K=K, M=M, gpu=True, trans_b=trans_b, **kw)
    fn = tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
    rng = np.random.default_rng(K + M)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((K, M)).astype(np.float32)
    bias = rng.standard_normal(M).astype(np.float32)
    out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
    given = np.ascontiguousarray(w.T) if trans_b else w
    fn(tvm.runtime.tensor(x), tvm.runtime.tensor(given),
       *([tvm.runtime.tensor(bias)] if epilogue else []), out)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    if epilogue:
        ref = np.maximum(ref + bias, 0)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4 * np.sqrt(K))
    if trans_b:  # the CPU's definition reads it likewise (the bf16 pass reads its names)
        cpu = KernelSpec.make("matmul", K=K, M=M, trans_b=True, **kw)
        fn = tvm.compile(tvm.IRModule({cpu.name: define(cpu)}), target="llvm")[cpu.name]
        out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
        fn(tvm.runtime.tensor(x), tvm.runtime.tensor(given),
           *([tvm.runtime.tensor(bias)] if epilogue else []), out)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4 * np.sqrt(K))


@pytest.mark.parametrize("K", [1, 3, 32, 128, 602, 1433])
@pytest.mark.parametrize("M", [1, 3, 7, 32, 41, 128, 384])
def test_matmul_gpu_tiles_are_exact(K, M):
    """The GPU product's tiling: exact splits of the padded axes, whole-element copies of
    both staged tiles, and a block within its threads and shared memory."""
    from gcomp.codegen.dense_kernels import GPU_TN_SHARED, GPU_TN_THREADS, gpu_mm_tiles
    t = gpu_mm_tiles(K, M)
    threads = t.nx * t.ny
    assert 1 <= threads <= GPU_TN_THREADS
    assert t.Kp % t.KT == 0 and K <= t.Kp < K + t.KT
    assert t.Mp == t.tb * t.nx and M <= t.Mp < M + t.nx
    assert (t.R * t.KT) % threads == 0 and (t.KT * t.Mp) % threads == 0
    assert (t.R * t.KT + t.KT * t.Mp) * 4 <= GPU_TN_SHARED
    assert threads >= min(64, M * 8)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_one_kernel_updates_every_parameter_as_the_per_parameter_kernels(name):
    """The GPU plan's optimizer step (``adam_all``, ``sgd_all``): parameters of several
    sizes (a scalar among them) updated in place by one kernel give, bit for bit, what
    the per-parameter kernels give, and match torch.optim's formulas in float64 over two
    steps (Adam with L2 weight decay; SGD with momentum, dampening and Nesterov)."""
    from gcomp.codegen.optimizer import OptimizerConfig
    sizes = [12, 1, 40, 7]
    sgd = {"momentum": 0.9, "nesterov": True} if name == "sgd" else {}  # torch: no dampening
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=0.01, **sgd)
    hp = np.array(cfg.hparams(), np.float32)
    nmom = 2 if name == "adam" else 1
    rng = np.random.default_rng(3)
    p0 = [rng.standard_normal(S).astype(np.float32) for S in sizes]
    grads = [[rng.standard_normal(S).astype(np.float32) for S in sizes] for _ in range(2)]

    def compiled(spec):
        return tvm.compile(tvm.IRModule({spec.name: define(spec)}), target="llvm")[spec.name]
    one = compiled(KernelSpec.make(f"{name}_all", sizes=sizes))
    each = {S: compiled(KernelSpec.make(name, S=S)) for S in set(sizes)}
    state = {k: [[tvm.runtime.tensor(p.copy())] + [tvm.runtime.tensor(np.zeros_like(p))
                                                   for _ in range(nmom)] for p in p0]
             for k in ("one", "each")}
    for t, gs in enumerate(grads, 1):
        step = tvm.runtime.tensor(np.array(t, np.int32))
        hpt = tvm.runtime.tensor(hp)
        args = []
        for (p, *mom), g in zip(state["one"], gs):
            args += [p, tvm.runtime.tensor(g), *mom]
        one(*args, hpt, step)
        for (p, *mom), g, S in zip(state["each"], gs, sizes):
            each[S](p, tvm.runtime.tensor(g), *mom, hpt, step)
    for a, b in zip(state["one"], state["each"]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.numpy(), y.numpy())
    lr, h1, h2, h3, wd = (float(v) for v in hp)
    for j, p in enumerate(p0):  # torch.optim's update rules in float64
        p, m, v = p.astype(np.float64), 0.0, 0.0
        for t, gs in enumerate(grads, 1):
            g = gs[j] + wd * p if name == "adam" else gs[j] + h3 * p
            if name == "adam":
                m, v = h1 * m + (1 - h1) * g, h2 * v + (1 - h2) * g * g
                p = p - lr / (1 - h1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - h2 ** t) + h3)
            else:
                m = g if t == 1 else h1 * m + (1 - h2) * g
                p = p - lr * (g + h1 * m)  # Nesterov
        np.testing.assert_allclose(state["one"][j][0].numpy(), p, rtol=1e-5, atol=1e-6)
