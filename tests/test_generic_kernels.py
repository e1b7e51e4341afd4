"""The generic kernel definitions, the ones CUDA schedules, compiled for llvm as they are
(serial loops, no schedule), equal the CPU definitions on the same arguments.

No GPU is needed to check what a GPU kernel computes: its schedule only binds loops to
threads and moves scratch values into registers.  Each kernel is compared on a graph with
nodes lacking in-edges (or out-edges), a hub and duplicate edges, and its outputs against
the interpreter's float64 values where the op has them."""

import numpy as np
import pytest
import tvm

from gcomp.codegen.kernels import KernelSpec, define
from gcomp.ir import RefGraph
from gcomp.ir.interpreter import _attention_grad
from gcomp.ir.ops import Op
from gcomp.runtime.graph import hub_split


def _graph(n=60, e=300, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, n, e)
    dst = rng.integers(0, n - 5, e)                      # the last 5 nodes: no in-edges
    src = np.concatenate([src, np.arange(n - 5), [3, 3]])  # a hub of in-edges at node 7,
    dst = np.concatenate([dst, np.full(n - 5, 7), [4, 4]])  # a duplicated edge 3 -> 4
    return RefGraph(n, src.astype(np.int64), dst.astype(np.int64))


def _csr(g: RefGraph, by_dst: bool):
    """indptr, neighbours and each slot's edge id in the given order."""
    key, other = (g.dst, g.src) if by_dst else (g.src, g.dst)
    order = np.argsort(key, kind="stable")
    indptr = np.zeros(g.num_nodes + 1, np.int64)
    np.add.at(indptr, key + 1, 1)
    return np.cumsum(indptr), other[order].astype(np.int32), order.astype(np.int64)


def _run(spec, target_def: bool, args, out_shape):
    func = define(spec, "llvm" if target_def else None)
    lib = tvm.compile(tvm.IRModule({spec.name: func}), target="llvm")
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(out_shape, np.float32), dev)
    lib[spec.name](*[tvm.runtime.tensor(a, dev) for a in args], out)
    return out.numpy()


def _both(spec, args, out_shape):
    generic = _run(spec, False, args, out_shape)
    cpu = _run(spec, True, args, out_shape)
    np.testing.assert_allclose(generic, cpu, rtol=2e-5, atol=2e-6)
    return cpu


@pytest.mark.parametrize("H,C,slope,p", [(2, 3, 0.2, 0.0), (4, 8, 0.2, 0.0), (1, 16, 1.0, 0.0),
                                         (3, 5, 0.1, 0.0), (4, 8, 0.2, 0.4), (1, 4, 1.0, 0.3)])
def test_attention_kernels(H, C, slope, p):
    """With dropout (p > 0) the kernels hash each coefficient's canonical edge id (here the
    edges' given order, ``perm``) as ``dropout`` of an [E, H] tensor does."""
    g = _graph()
    n = g.num_nodes
    rng = np.random.default_rng(1)
    f32 = np.float32
    x, dy = (rng.standard_normal((n, H * C)).astype(f32) for _ in range(2))
    s_src, s_dst = (rng.standard_normal((n, H)).astype(f32) for _ in range(2))
    indptr, indices, perm = _csr(g, by_dst=True)
    cindptr, cindices, cperm = _csr(g, by_dst=False)
    params = {"H": H, "C": C, "slope": slope}
    ids, step = [[], []], []
    if p:
        params.update(p=p, seed=5)
        ids, step = [[perm], [cperm]], [np.array(7, np.int32)]

    y = _both(KernelSpec.make("attention_agg", **params),
              [indptr, indices] + ids[0] + [s_src, s_dst, x] + step, (n, H * C))
    stats = _both(KernelSpec.make("attention_grad_dst", **params),
                  [indptr, indices] + ids[0] + [s_src, s_dst, x, dy] + step, (n, 4 * H))
    grads = _both(KernelSpec.make("attention_grad_src", **params),
                  [cindptr, cindices] + ids[1] + [s_src, x, dy, stats] + step, (n, H * C + H))
    # the GPU's hub-split forms (rows of more than 4 edges cut into tasks) agree
    for kind, args, seg, ref in (
            ("attention_agg", [indptr, indices] + ids[0] + [s_src, s_dst, x] + step, indptr, y),
            ("attention_grad_dst", [indptr, indices] + ids[0] + [s_src, s_dst, x, dy] + step,
             indptr, stats),
            ("attention_grad_src", [cindptr, cindices] + ids[1] + [s_src, x, dy, stats] + step,
             cindptr, grads)):
        tasks, hub = hub_split(seg, size=4)
        assert len(tasks) > 10
        got = _run(KernelSpec.make(kind, **params, split=True), False, args + [tasks, hub],
                   ref.shape)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6 * max(1, np.abs(ref).max()),
                                   err_msg=kind)

    f64 = [a.astype(np.float64) for a in (x.reshape(n, H, C), s_src, s_dst, dy.reshape(n, H, C))]
    attrs = {"negative_slope": slope, "p": p, "seed": 5}
    ref_dst = _attention_grad(Op.ATTENTION_GRAD_DST, attrs, g, *f64, 7)
    ref_src = _attention_grad(Op.ATTENTION_GRAD_SRC, attrs, g, *f64, 7)
    scale = np.abs(ref_src).max()
    np.testing.assert_allclose(stats, ref_dst, rtol=1e-4, atol=1e-5 * max(1, np.abs(ref_dst).max()))
    np.testing.assert_allclose(grads, ref_src, rtol=1e-4, atol=1e-5 * scale)
    has_in = np.bincount(g.dst, minlength=n) > 0
    assert not np.delete(stats[~has_in], np.s_[H:2 * H], axis=1).any()  # no in-edges: 0
    # D = dy . y (y with the same dropout), the identity the destination half relies on
    D = (dy.reshape(n, H, C) * y.reshape(n, H, C)).sum(-1)
    np.testing.assert_allclose(stats[:, 3 * H:], D, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-chunks", "gpu-chunks"])
def test_column_sums_of_a_fused_tree(gpu):
    """Column sums of a fused elementwise tree (GAT's attention-vector gradient
    sum(ds * h, 0), ds broadcast over each head's channels, plus a per-head bias), in the
    generic definition's 16 chunks (and the CPU definition's) and the GPU definition's
    4,096 (more chunks than rows; its final sum a reduction block), against numpy in
    float64."""
    rng = np.random.default_rng(5)
    n, H, C = 70, 4, 8
    ds = rng.standard_normal((n, H, 1)).astype(np.float32)
    h = rng.standard_normal((n, H, C)).astype(np.float32)
    b = rng.standard_normal((H, C)).astype(np.float32)
    expr = ["add", {}, [["mul", {}, [["in", 0], ["in", 1]]], ["in", 2]]]
    params = {"gpu": True} if gpu else {}
    spec = KernelSpec.make("colsum", F=H * C, expr=expr, shape=("n", H, C),
                           in_shapes=[("n", H, 1), ("n", H, C), (H, C)], **params)
    args = [ds, h, b]
    # the CPU chunking also against the CPU definition (rows added whole, in order)
    out = _run(spec, False, args, (H * C,)) if gpu else _both(spec, args, (H * C,))
    ref = (ds.astype(np.float64) * h + b).sum(0).reshape(-1)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
