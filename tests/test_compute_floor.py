"""bench.compute_floor counts a training step's dense products from the bound plan."""

import gcomp.models as models
from bench.compute_floor import product_flops
from gcomp.codegen.lower import lower
from gcomp.passes import training_pipeline


def test_products_of_a_gcn_step():
    """3-layer GCN 16 -> 8 -> 8 -> 4 (A X precomputed, so its first layer is a 16 x 8
    product): forward x W per layer, dY W^T for layers 2 and 3 and x^T dY for every
    weight; 2 n K M operations each."""
    g = training_pipeline()(models.build("gcn", 16, hidden=8, out_channels=4,
                                         layers=3).graph.copy())
    plan, _ = lower(g)
    n = 1000
    run = [s for s in plan.steps if "when" not in s]  # dense features: no sparse variant
    total = sum(product_flops(plan, s, n) for s in run)
    km = 16 * 8 * 2 + 8 * 8 * 3 + 8 * 4 * 3
    assert total == 2 * n * km
    assert all(product_flops(plan, s, n) == 0 for s in run if s["op"] != "matmul")


def test_kernel_bytes_count_each_argument_once():
    """A bound aggregation's compulsory traffic: its CSR arrays, edge weights, the rows it
    gathers (once each) and its output, from the arrays the kernel is called with."""
    from bench import workload as W
    from bench.compute_floor import arg_bytes
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    wl = W.make("gcn", "cora", 2, 16, 1)
    tr = Trainer(compile_model(wl.model, train=True), wl.graph)
    b = tr._binding
    agg = next(k for k, s in enumerate(b.plan_steps) if s["kernel"].startswith("gc_csr_agg"))
    indptr, indices, w, x, out = b.steps[agg][1]
    n, nnz, F = out.shape[0], indices.shape[0], out.shape[1]
    expect = (n + 1) * 8 + nnz * 4 + nnz * 4 + x.shape[0] * x.shape[1] * 4 + n * F * 4
    assert arg_bytes(b.steps[agg][1]) == expect
    assert arg_bytes([3, 1.0]) == 0  # scalar arguments move nothing


def test_roofline_takes_the_larger_floor_per_kernel():
    from bench.compute_floor import roofline
    row = {"kernel_names": ["gemm", "copy"], "kernel_ms": [30.0, 150.0],
           "kernel_flops": [2e9, 0], "kernel_bytes": [1e6, 1e9]}
    r = roofline(row, gflop_s=100.0, gb_s=10.0)
    # gemm: 20 ms of work against 0.1 ms of bytes; copy: 100 ms of bytes
    assert abs(r["kernel_floor_ms"][0] - 20.0) < 1e-9 and abs(r["kernel_floor_ms"][1] - 100.0) < 1e-9
    assert abs(r["roofline_ms"] - 120.0) < 1e-9 and abs(r["memory_floor_ms"] - 100.1) < 1e-9
    assert [k["kernel"] for k in r["furthest"]] == ["copy", "gemm"]  # 50 ms over, then 10
