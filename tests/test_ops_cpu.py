"""Each IR op, compiled for llvm, equals the reference interpreter (node and edge outputs)."""

import numpy as np
import pytest
from conftest import awkward_graph, bf16_bits, ref_inputs, rel_err, widen_bf16

from gcomp.compiler import compile_model
from gcomp.frontend.builder import (EdgeInput, GraphInput, Module, NodeInput, Parameter, concat,
                                    maximum, minimum, trace)
from gcomp.ir import interpret


class Fn(Module):
    def __init__(self, fn, params=None):
        self.fn = fn
        self.params = [Parameter(s, init="normal") for s in (params or [])]

    def forward(self, x, edge_index, edge_weight=None):
        return self.fn(x, edge_index, edge_weight, *self.params)


def run_both(fn, F=6, params=None, weighted=False, seed=0, tol=1e-4, n=70, e=400):
    g = awkward_graph(num_nodes=n, num_edges=e, num_features=F, seed=seed, edge_weight=weighted)
    inputs = {"x": NodeInput(F), "edge_index": GraphInput()}
    if weighted:
        inputs["edge_weight"] = EdgeInput("edge_index")
    m = trace(Fn(fn, params), inputs, seed=seed)
    outs = compile_model(m).run(g)
    refs = interpret(m.graph, ref_inputs(m.graph, g), m.params)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        assert rel_err(o, r) <= tol, rel_err(o, r)
    return outs, refs


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_aggregate(reduce):
    run_both(lambda x, g, w: g.aggregate(x, reduce))


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_aggregate_weighted(reduce):
    run_both(lambda x, g, w: g.aggregate(x, reduce, weight=w), weighted=True)


@pytest.mark.parametrize("F", [1, 40, 45, 100])
def test_aggregate_feature_widths(F):
    """Widths one vector loop covers, and wider ones run as vector chunks plus a tail."""
    run_both(lambda x, g, w: [g.aggregate(x, "sum", weight=w), g.aggregate(x, "max"),
                              g.aggregate(x, "mean").relu() + x], F=F, weighted=True)


@pytest.mark.parametrize("shape", ["hub", "tiny", "hubs_first"])
def test_rows_split_by_work(shape):
    """Rows are shared out to threads in ranges of equal edges + rows: one row holding
    nearly every edge, fewer rows than ranges, and hubs numbered first all sum right."""
    from gcomp.runtime.data import GraphData
    rng = np.random.default_rng(7)
    if shape == "hub":
        n, e = 600, 5000
        dst = np.where(rng.random(e) < 0.95, 17, rng.integers(0, n, e))
        ei = np.stack([rng.integers(0, n, e), dst])
    elif shape == "tiny":
        n, ei = 3, np.array([[0, 1, 2, 2], [1, 2, 0, 1]])
    else:
        n, e = 2000, 20000
        ei = np.stack([rng.integers(0, n, e), np.minimum(rng.zipf(1.5, e) - 1, n - 1)])
    x = rng.standard_normal((n, 24)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, ei.shape[1]).astype(np.float32)
    g = GraphData("split", n, ei, x, w)
    m = trace(Fn(lambda x, g, w: [g.aggregate(x, "sum", weight=w), g.aggregate(x, "max")]),
              {"x": NodeInput(24), "edge_index": GraphInput(),
               "edge_weight": EdgeInput("edge_index")})
    for o, r in zip(compile_model(m).run(g), interpret(m.graph, ref_inputs(m.graph, g), m.params)):
        assert rel_err(o, r) <= 1e-4


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_scatter_of_edge_messages(reduce):
    # a message the fusion pass cannot absorb: relu(x_j - x_i) keeps the E x F path
    run_both(lambda x, g, w: g.scatter((g.gather(x, "src") - g.gather(x, "dst")).relu(), reduce))


@pytest.mark.parametrize("fused", [True, False])
def test_per_head_weighted_aggregation(fused):
    """GAT-style attention, fused into one kernel or not (the coefficients also returned);
    nodes without in-edges aggregate to 0."""
    def fn(x, g, w):
        h = x.reshape(-1, 2, 3)  # 2 heads of 3 channels
        e = g.gather(h.sum(-1), "src") + g.gather(h.max(-1), "dst")  # [E, 2]
        alpha = g.edge_softmax(e.leaky_relu(0.2))
        out = g.aggregate(h, "sum", weight=alpha)
        return out if fused else [out, alpha]
    run_both(fn)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_gather_edge_output_in_user_order(side):
    outs, refs = run_both(lambda x, g, w: g.gather(x, side) * 2.0)
    assert outs[0].shape[0] == 400 + 20 + 2 + 20  # every edge, in the order given


def test_edge_softmax_edge_output():
    run_both(lambda x, g, w: g.edge_softmax(g.gather(x, "src") + g.gather(x, "dst")))


@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("weighted", [False, True])
def test_degree(side, weighted):
    run_both(lambda x, g, w: g.degree(w, side=side).reshape(-1, 1) * x, weighted=weighted)


@pytest.mark.parametrize("mode", ["add_remaining", "remove", "add"])
def test_self_loops_and_remap(mode):
    def fn(x, g, w):
        g2 = g.add_self_loops(mode)
        w2 = g2.remap_edge_values(w, fill=0.5)
        return [g2.aggregate(x, "sum", weight=w2), w2, g2.degree()]
    run_both(fn, weighted=True)


def test_sym_norm_weighted_and_not():
    def fn(x, g, w):
        g2 = g.add_self_loops()
        return [g2.gcn_norm(), g2.gcn_norm(g2.remap_edge_values(w)), g.gcn_norm()]
    run_both(fn, weighted=True)


UNARY = {
    "relu": lambda v: v.relu(), "leaky_relu": lambda v: v.leaky_relu(0.2),
    "elu": lambda v: v.elu(0.7), "exp": lambda v: v.exp(), "sigmoid": lambda v: v.sigmoid(),
    "tanh": lambda v: v.tanh(), "neg": lambda v: -v, "log": lambda v: (v * v + 1.0).log(),
    "sqrt": lambda v: (v * v).sqrt(), "pow": lambda v: (v * v + 0.5).pow(-0.5),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op):
    run_both(lambda x, g, w: UNARY[op](x))


@pytest.mark.parametrize("op", ["tanh", "sigmoid", "exp"])
def test_polynomial_math_is_accurate_per_element(op):
    """tanh, sigmoid and exp are polynomials in the kernels (gcomp/codegen/fastmath.py):
    each element within a few float32 ulps of numpy's float64 value, tiny and large
    arguments included (tanh switches form at |x| = 0.625)."""
    from gcomp.runtime.data import GraphData
    mag = np.concatenate([np.geomspace(1e-7, 0.6249, 300), np.linspace(0.6249, 0.6251, 50),
                          np.geomspace(0.6251, 20.0, 300)])
    x = np.concatenate([mag, -mag]).astype(np.float32)
    if op == "exp":
        x = x.clip(-80, 80)
    x = x.reshape(-1, 1)
    m = trace(Fn(lambda v, g, w: UNARY[op](v)), {"x": NodeInput(1), "edge_index": GraphInput()})
    g = GraphData("pts", len(x), np.zeros((2, 0), np.int64), x)
    out = compile_model(m).run(g)[0].astype(np.float64)
    xd = x.astype(np.float64)
    ref = {"tanh": np.tanh, "exp": np.exp, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}[op](xd)
    err = np.abs(out - ref) / np.abs(ref)
    assert err.max() <= 4e-7, (op, float(err.max()), float(xd[err.argmax(), 0]))


@pytest.mark.parametrize("op", ["relu", "leaky_relu", "maximum", "minimum", "relu_fused",
                                "exp", "elu", "sigmoid", "tanh"])
def test_nan_propagates_like_torch(op):
    """A NaN (a diverged parameter, an overflow) stays NaN through relu, leaky_relu,
    maximum, minimum and the polynomial exp (and elu, sigmoid and tanh on it), as in
    torch and the interpreter (relu as max(x, 0) gave 0; exp's clamp made a NaN a bound).
    ``relu_fused``: a bias and relu in an aggregation's epilogue.
    A NaN in one column of a parameter row leaves the other columns exact."""
    def fn(x, g, w, b):
        h = x + b
        if op == "relu_fused":
            return (g.aggregate(x) + b).relu()
        if op in ("maximum", "minimum"):
            return (maximum if op == "maximum" else minimum)(h, x * 0.5)
        return UNARY[op](h)
    m = trace(Fn(fn, params=[(6,)]), {"x": NodeInput(6), "edge_index": GraphInput()})
    name = next(iter(m.params))
    m.params[name] = np.array([np.nan, 0.5, -0.5, 1.0, 0.0, 2.0], np.float32)
    g = awkward_graph(num_nodes=30, num_edges=90, num_features=6, seed=4)
    out = compile_model(m).run(g)[0]
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(ref).any()
    ok = np.isfinite(ref)
    assert rel_err(out[ok], ref[ok]) <= 1e-5


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum"])
@pytest.mark.parametrize("other", ["node", "row", "col", "scalar_param", "const"])
def test_binary_broadcasting(op, other):
    fns = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a / b, "maximum": maximum, "minimum": minimum}

    def fn(x, g, w, prow, pscalar):
        b = {"node": x.relu() + 1.0, "row": prow, "col": x.sum(-1, keepdims=True) * 0 + 3.0,
             "scalar_param": pscalar, "const": 2.5}[other]
        return fns[op](x, b) if op != "div" else fns[op](x, b if other == "const" else b * b + 1.0)
    run_both(fn, params=[(6,), ()])


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("axis,keepdims", [(-1, False), (1, True), (2, False)])
def test_reductions(op, axis, keepdims):
    run_both(lambda x, g, w: getattr(x.reshape(-1, 2, 3), op)(axis, keepdims))


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_over_wide_last_axis(op, keepdims):
    """Last axes of 8k values reduce in vector lanes of partial results."""
    run_both(lambda x, g, w: [getattr(x.reshape(-1, 3, 16), op)(-1, keepdims),
                              getattr(x.reshape(-1, 6, 8), op)(2, keepdims)], F=48)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reductions_of_fused_elementwise_trees(op):
    """A reduction whose input is a tree of elementwise ops evaluates the tree in place
    (GAT's scores sum(h * a, -1); a parameter's gradient sum(dy * x, axis=0)): per-head
    parameters, a broadcast column, a constant, nested ops; over the last axis, a middle
    one and the node axis (column sums in chunks for sum, the generic kernel otherwise)."""
    def fn(x, g, w, *atts):
        h = x.reshape(-1, 3, 4)
        col = h.sum(-1, keepdims=True)

        def tree(att):  # a parameter of its own per tree: no two trees share a value
            return (h * att + col).tanh() * 2.0 - (h + att).sigmoid()
        return [getattr(tree(atts[0]), op)(-1), getattr(tree(atts[1]), op)(1, True),
                getattr(tree(atts[2]), op)(0), getattr(tree(atts[3]), op)(0, True)]
    run_both(fn, F=12, params=[(3, 4)] * 4, n=83)


def test_reduce_over_nodes():
    run_both(lambda x, g, w: [x.sum(0), x.max(0, keepdims=True), x.mean(0, keepdims=True) + x])


@pytest.mark.parametrize("log", [False, True])
def test_softmax(log):
    run_both(lambda x, g, w: x.log_softmax() if log else x.softmax())


def test_concat_and_reshape():
    run_both(lambda x, g, w: concat([x, x.relu(), g.aggregate(x, "mean")], axis=1)
             .reshape(-1, 3, 6).sum(1))


def test_matmul_with_bias():
    run_both(lambda x, g, w, W, b: ((x @ W) + b).relu(), params=[(6, 20), (20,)])


@pytest.mark.parametrize("K,M", [(300, 16), (260, 45), (130, 64), (128, 40), (16, 7), (9, 3),
                                 (40, 384), (33, 128)])
def test_matmul_widths(K, M):
    """Widths where the CPU matmul multiplies groups of rows under some tuning (long rows,
    wide outputs, widths the vector unit does not divide), in whichever kernel this
    machine's tuning picks (``test_matmul_row_groups_of_each_tuning`` covers every
    tuning's row groups), with a bias and activation in the epilogue and a node count
    that leaves the last group short."""
    run_both(lambda x, g, w, W, b: ((x @ W) + b).relu(), F=K, params=[(K, M), (M,)], n=67)


@pytest.mark.parametrize("tuning,K,M", [("default", 300, 16), ("default", 128, 130),
                                        ("default", 9, 3), ("default", 128, 32),
                                        ("default", 32, 40), ("default", 128, 64),
                                     ("avx512", 128, 32), ("avx512", 32, 40),
                                     ("avx512", 130, 64), ("avx512", 500, 16),
                                     ("avx512", 16, 7), ("avx512", 40, 384),
                                     ("avx512", 40, 128), ("avx512", 260, 128),
                                     ("avx2", 128, 32), ("avx2", 128, 128), ("avx2", 500, 16),
                                     ("avx2", 16, 7), ("avx2", 128, 130), ("avx2", 40, 384),
                                     ("avx2", 32, 32), ("avx2", 32, 40), ("avx2", 16, 16),
                                     ("avx2", 5, 16)])
def test_matmul_row_groups_of_each_tuning(tuning, K, M):
    """The row-group matmul as each tuning table sizes it (group rows, column tiles, k
    steps between prefetch shares: K below, a multiple of and past a multiple of
    ``MM_SHARE_K``), compiled for this machine: bias and ReLU epilogue, row counts that
    leave the last group short, smaller than one group, or empty; against float64."""
    import tvm
    from gcomp.codegen.cpu_kernels import _matmul_rows, matmul
    from gcomp.codegen.build import make_target
    assert _matmul_rows(K, M, tuning) is not None
    chain = (("add", (), 0, False), ("relu", (), None, False))
    func = matmul(K, M, epilogue=chain, extras=("vec",), tuning=tuning).with_attr("global_symbol", "mm")
    fn = tvm.compile(tvm.IRModule({"mm": func}), target=tvm.target.Target(make_target("llvm")))["mm"]
    rng = np.random.default_rng(K * M)
    w = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    for n in (0, 1, 5, 67, 1000):
        x = rng.standard_normal((n, K)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
        fn(tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(b), out)
        ref = np.maximum(x.astype(np.float64) @ w + b, 0.0)
        assert np.abs(out.numpy() - ref).max(initial=0.0) <= 1e-5 * max(1.0, np.abs(ref).max(initial=0.0)), n


@pytest.mark.parametrize("tuning", ["default", "avx2"])
@pytest.mark.parametrize("K,M,sum_row", [(128, 32, False), (32, 40, False), (12, 7, False),
                                         (1433, 16, False), (3, 64, False), (128, 128, False),
                                         (12, 96, False), (5, 160, False), (32, 32, True),
                                         (32, 40, True), (12, 7, True), (5, 160, True)])
def test_weight_gradient_in_row_blocks(K, M, sum_row, tuning):
    """The CPU x.T @ y (weight gradients) adds blocks of rows into register tiles of the
    result, as each tuning sizes them, compiled for this machine: row counts that leave
    blocks and chunks short or empty, widths the vector unit does not divide, K without a
    tile that divides it, wide results in column tiles, chunks of several blocks (each
    prefetching the next, the last past the end); with ``sum_row``, y's column sums (a
    bias gradient) in a last row, over the same column tiles."""
    import tvm
    from gcomp.codegen.build import make_target
    from gcomp.codegen.cpu_kernels import TN_BLOCK, _matmul_tn_tile, matmul_tn
    assert _matmul_tn_tile(K, M, tuning) is not None
    func = matmul_tn(K, M, tuning=tuning, sum_row=sum_row).with_attr("global_symbol", "tn")
    fn = tvm.compile(tvm.IRModule({"tn": func}), target=tvm.target.Target(make_target("llvm")))["tn"]
    rng = np.random.default_rng(K + M)
    for n in (0, 1, 15, 17, 16 * 16 + 3, 1000, 16 * 3 * TN_BLOCK + 5):
        x = rng.standard_normal((n, K)).astype(np.float32)
        y = rng.standard_normal((n, M)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((K + sum_row, M), np.nan, np.float32))
        fn(tvm.runtime.tensor(x), tvm.runtime.tensor(y), out)
        ref = x.astype(np.float64).T @ y.astype(np.float64)
        if sum_row:
            ref = np.vstack([ref, y.astype(np.float64).sum(0)])
        assert np.abs(out.numpy() - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), n


@pytest.mark.parametrize("tuning,K,M", [("default", 128, 32), ("default", 5, 16),
                                     ("default", 32, 40), ("avx512", 16, 16),
                                     ("avx2", 128, 130)])
def test_products_of_x_in_another_row_order(tuning, K, M):
    """``x_order``: x @ w and x.T @ y with x's row j standing for the product's row
    ``rows[j]`` (features kept in the caller's node order, the product's rows in another;
    rows past the product's n skipped, as where the loss's first rows are the product's),
    also where row groups would not pay (K = 5) and with a bias gradient row; against
    float64 of x in the product's order."""
    import tvm
    from gcomp.codegen.build import make_target
    from gcomp.codegen.cpu_kernels import _matmul_tn_tile, matmul, matmul_tn
    target = tvm.target.Target(make_target("llvm"))
    chain = (("add", (), 0, False), ("relu", (), None, False))
    mm = matmul(K, M, epilogue=chain, extras=("vec",), tuning=tuning, x_order=True)
    mm = tvm.compile(tvm.IRModule({"mm": mm.with_attr("global_symbol", "mm")}),
                     target=target)["mm"]
    tn = None
    if _matmul_tn_tile(K, M, tuning) is not None:
        tn = matmul_tn(K, M, tuning=tuning, sum_row=True, x_order=True)
        tn = tvm.compile(tvm.IRModule({"tn": tn.with_attr("global_symbol", "tn")}),
                         target=target)["tn"]
    rng = np.random.default_rng(K * M + 1)
    w = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    for n, nx in ((0, 3), (1, 1), (67, 90), (1000, 1000), (1600, 2000)):
        x = rng.standard_normal((nx, K)).astype(np.float32)
        order = rng.permutation(nx)  # the product's row i is x's row order[i]
        rows = np.empty(nx, np.int64)
        rows[order] = np.arange(nx)
        out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
        mm(tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.tensor(b), out,
           tvm.runtime.tensor(rows))
        xr = x[order[:n]].astype(np.float64)
        ref = np.maximum(xr @ w + b, 0.0)
        assert np.abs(out.numpy() - ref).max(initial=0.0) <= 1e-5 * max(1.0, np.abs(ref).max(initial=0.0)), n
        if tn is None:
            continue
        y = rng.standard_normal((n, M)).astype(np.float32)
        out = tvm.runtime.tensor(np.full((K + 1, M), np.nan, np.float32))
        tn(tvm.runtime.tensor(x), tvm.runtime.tensor(y), out, tvm.runtime.tensor(rows))
        ref = np.vstack([xr.T @ y, y.astype(np.float64).sum(0)])
        assert np.abs(out.numpy() - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), n


@pytest.mark.parametrize("C", [16, 40, 33, 7, 17, 23, 47, 64])
def test_cross_entropy_kernels_in_row_ranges(C):
    """The CPU loss and its gradient (rows in ranges, per-row max and sum folded across
    vector lanes; 7 classes: the generic kernels) against float64 numpy: masked rows, rows
    without a label (y = -1), row counts on both sides of the parallel threshold, widths
    with and without a tail (of one lane at 17, odd lane counts at 23 and 47, several
    whole vectors at 64); the gradient reads the log-sum-exps the loss wrote.  The fused
    kernel (both in one pass, ``passes/fuse_loss_grad.py``) writes the gradient over the
    logits, as the memory plan may have it."""
    import tvm
    from gcomp.codegen.build import build_library, make_target
    from gcomp.codegen.cpu_kernels import CE_PARALLEL
    from gcomp.codegen.kernels import KernelSpec
    specs = [KernelSpec.make(k, C=C) for k in ("cross_entropy", "cross_entropy_grad",
                                               "cross_entropy_fused")]
    lib = tvm.runtime.load_module(str(build_library({s.name: s for s in specs},
                                                    make_target("llvm"))))
    loss_fn, grad_fn, fused_fn = (lib[s.name] for s in specs)
    rng = np.random.default_rng(C)
    for n in (5, CE_PARALLEL // C + 77):
        z = (4 * rng.standard_normal((n, C))).astype(np.float32)
        y = rng.integers(-1, C, n).astype(np.int32)
        m = (rng.random(n) < 0.7).astype(np.float32)
        m[0] = 1.0
        T = tvm.runtime.tensor
        loss, grad = T(np.zeros((), np.float32)), T(np.full((n, C), np.nan, np.float32))
        lse_out = T(np.full(n, np.nan, np.float32))
        loss_fn(T(z), T(y), T(m), lse_out, loss)
        grad_fn(T(np.array(2.0, np.float32)), T(z), T(y), T(m), lse_out, grad)
        zz = z.astype(np.float64)
        e = np.exp(zz - zz.max(1, keepdims=True))
        valid, yy = (m != 0) & (y >= 0), np.maximum(y, 0)
        lse = np.log(e.sum(1)) + zz.max(1)
        ref = np.where(valid, m * (lse - zz[np.arange(n), yy]), 0).sum() / m.sum()
        g = e / e.sum(1, keepdims=True)
        g[np.arange(n), yy] -= 1
        g = np.where(valid[:, None], g * (2.0 * m / m.sum())[:, None], 0)
        assert abs(float(loss.numpy()) - ref) <= 1e-5 * abs(ref)
        assert np.abs(lse_out.numpy()[valid] - lse[valid]).max() <= 1e-5 * np.abs(lse).max()
        assert np.abs(grad.numpy() - g).max() <= 1e-5 * np.abs(g).max()
        both, loss = T(z), T(np.zeros((), np.float32))  # the gradient over the logits
        fused_fn(T(np.array(2.0, np.float32)), both, T(y), T(m), loss, both)
        assert abs(float(loss.numpy()) - ref) <= 1e-5 * abs(ref)
        assert np.abs(both.numpy() - g).max() <= 1e-5 * np.abs(g).max()


@pytest.mark.parametrize("order", ["rcm", "degree"])
def test_reordering_is_invisible_for_node_and_edge_outputs(order):
    g = awkward_graph(num_nodes=70, num_edges=400, num_features=6, seed=4, edge_weight=True)
    inputs = {"x": NodeInput(6), "edge_index": GraphInput(), "edge_weight": EdgeInput("edge_index")}

    def fn(x, g_, w):
        g2 = g_.add_self_loops()
        a = g2.edge_softmax(g2.gather(x, "src").sum(-1) + g2.gather(x, "dst").sum(-1))
        return [g2.aggregate(x, "sum", weight=g2.remap_edge_values(w)), a, g_.degree(w)]
    m = trace(Fn(fn), inputs)
    ex = compile_model(m).executor()
    ex.reorder = order
    outs = ex.run(g)
    assert ex._binding.order is not None
    refs = interpret(m.graph, ref_inputs(m.graph, g), m.params)
    for o, r in zip(outs, refs):
        assert rel_err(o, r) <= 1e-4


@pytest.mark.parametrize("with_product", [False, True])
def test_aggregated_features_that_are_outputs_run_with_sparse_features(with_product):
    """A x computed once per feed is skipped by the sparse-feature variant only where
    products alone read it; a model output is always computed (a calibration that
    chose the sparse kernels for dense features once left it unwritten: garbage)."""
    g = awkward_graph(num_nodes=70, num_edges=400, num_features=45, seed=0)
    inputs = {"x": NodeInput(45), "edge_index": GraphInput()}

    def fn(x, g_, w, W):
        ax = g_.aggregate(x, "sum")
        return [ax, ax @ W] if with_product else ax
    m = trace(Fn(fn, [(45, 4)]), inputs)
    ex = compile_model(m, sparse_threshold=0.0).executor()  # the variant for any features
    outs = ex.run(g)
    assert ("sparse:x" in ex._binding.variants) == with_product  # only products have one
    for o, r in zip(outs, interpret(m.graph, ref_inputs(m.graph, g), m.params)):
        assert rel_err(o, r) <= 1e-4


@pytest.mark.parametrize("force", [None, True, False])
def test_matmul_of_values_computed_once_per_feed(force):
    """A matmul of values computed from the features alone (here relu(x), once per feed)
    has its own sparse variant, decided by their sparsity once computed (the runtime
    feeds and measures them when binding); either variant gives the interpreter's
    result, and feeding other features recomputes them."""
    from gcomp.runtime.executor import Executor
    g = awkward_graph(num_nodes=70, num_edges=400, num_features=10, seed=3)
    g.x[np.random.default_rng(2).random(g.x.shape) < 0.5] = 0.0
    inputs = {"x": NodeInput(10), "edge_index": GraphInput()}
    m = trace(Fn(lambda x, g_, w, W: g_.aggregate(x.relu() @ W, "sum"), [(10, 4)]), inputs)
    art = compile_model(m, sparse_threshold=0.6)  # relu of half-zero x: about 75% zeros
    (key, v), = art.plan.variants.items()
    assert v["sources"] == ["x"] and art.plan.feed_steps
    ex = Executor(art.plan, art.library(), art.params)
    if force is not None:
        ex.force_variants = {key: force}
    out = ex.run(g)[0]
    assert (key in ex._binding.variants) == (True if force is None else force)
    assert rel_err(out, interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]) <= 1e-4
    x2 = np.random.default_rng(4).standard_normal(g.x.shape).astype(np.float32)
    out2 = ex.run(g, {"x": x2})[0]
    assert rel_err(out2, interpret(m.graph, ref_inputs(m.graph, g, x2), m.params)[0]) <= 1e-4


def test_trees_read_slices_and_reshapes_in_place():
    """Views inside a fused tree are index maps into the stored tensor: a column range
    regrouped into heads (d x sliced out of fused attention's [N, H*C + H] gradient), a
    range of a middle axis, both under an elementwise tree and under a column sum."""
    from gcomp.ir import parse_graph
    from gcomp.model import Model
    text = """graph t(%x: f32[N,12], %edge_index: graph<coo>) {
  %w = param : f32[12]
  %a = param : f32[2,3]
  %y = mul(%x, %w) : f32[N,12]
  %y2 = add(%x, %w) : f32[N,12]
  %s = slice[axis=1, start=5, stop=11](%y) : f32[N,6]
  %r = reshape[shape=["N", 2, 3]](%s) : f32[N,2,3]
  %m = mul(%r, %a) : f32[N,2,3]
  %t = tanh(%m) : f32[N,2,3]
  %r2 = reshape[shape=["N", 3, 4]](%y2) : f32[N,3,4]
  %s2 = slice[axis=2, start=1, stop=4](%r2) : f32[N,3,3]
  %e = exp(%s2) : f32[N,3,3]
  %d = sum[axis=0](%e) : f32[3,3]
  return %t, %d
}"""
    rng = np.random.default_rng(3)
    m = Model(parse_graph(text), {"w": rng.standard_normal(12), "a": rng.standard_normal((2, 3))})
    art = compile_model(m)
    g = awkward_graph(num_nodes=61, num_edges=300, num_features=12, seed=3)
    outs = art.run(g)
    refs = interpret(m.graph, ref_inputs(m.graph, g), m.params)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and rel_err(o, r) <= 1e-5, rel_err(o, r)
    kinds = sorted(s["kernel"].rsplit("_", 1)[0] for s in art.plan.steps)
    assert kinds == ["gc_colsum", "gc_ewise_chain"]  # two trees, no slice copied


@pytest.mark.parametrize("C", [40, 23])
def test_cross_entropy_of_bfloat16_logits(C):
    """The CPU loss reading logits stored as bfloat16 (``--precision bf16``) widens them
    from their bits: the loss and log-sum-exps of the rounded logits, against float64."""
    import tvm
    import tvm_ffi
    from gcomp.codegen.build import build_library, make_target
    from gcomp.codegen.kernels import KernelSpec
    spec = KernelSpec.make("cross_entropy", C=C, bf16=("z",))
    lib = tvm.runtime.load_module(str(build_library({spec.name: spec}, make_target("llvm"))))
    rng = np.random.default_rng(C)
    n = 3000
    z = (4 * rng.standard_normal((n, C))).astype(np.float32)
    bits = bf16_bits(z)
    zz = widen_bf16(bits)
    y = rng.integers(-1, C, n).astype(np.int32)
    m = (rng.random(n) < 0.6).astype(np.float32)
    T = tvm.runtime.tensor
    loss, lse_out = T(np.zeros((), np.float32)), T(np.full(n, np.nan, np.float32))
    lib[spec.name](tvm_ffi.from_dlpack(bits)._create_view((n, C), "bfloat16"), T(y), T(m),
                   lse_out, loss)
    valid, yy = (m != 0) & (y >= 0), np.maximum(y, 0)
    lse = np.log(np.exp(zz - zz.max(1, keepdims=True)).sum(1)) + zz.max(1)
    ref = np.where(valid, m * (lse - zz[np.arange(n), yy]), 0).sum() / m.sum()
    assert abs(float(loss.numpy()) - ref) <= 1e-5 * abs(ref)
    assert np.abs(lse_out.numpy()[valid] - lse[valid]).max() <= 1e-5 * np.abs(lse).max()


@pytest.mark.parametrize("C", [40, 23, 24, 7])
def test_fused_cross_entropy_of_bfloat16_logits_in_place(C):
    """The fused loss and gradient with logits and gradient stored as bfloat16, the
    gradient written over the logits (as the memory plan may have it): the row's
    exponentials are kept, so each gradient value is rounded once, the label's share
    subtracted before rounding; against float64 of the rounded logits."""
    import tvm
    import tvm_ffi
    from gcomp.codegen.build import build_library, make_target
    from gcomp.codegen.cpu_kernels import CE_PARALLEL
    from gcomp.codegen.kernels import KernelSpec
    spec = KernelSpec.make("cross_entropy_fused", C=C, bf16=("z", "out"))
    lib = tvm.runtime.load_module(str(build_library({spec.name: spec}, make_target("llvm"))))
    rng = np.random.default_rng(C)
    for n in (5, CE_PARALLEL // C + 77):
        z = (4 * rng.standard_normal((n, C))).astype(np.float32)
        bits = bf16_bits(z)
        zz = widen_bf16(bits)
        y = rng.integers(-1, C, n).astype(np.int32)
        m = (rng.random(n) < 0.6).astype(np.float32)
        m[0] = 1.0
        T = tvm.runtime.tensor
        both = tvm_ffi.from_dlpack(bits)._create_view((n, C), "bfloat16")
        loss = T(np.zeros((), np.float32))
        lib[spec.name](T(np.array(2.0, np.float32)), both, T(y), T(m), loss, both)
        valid, yy = (m != 0) & (y >= 0), np.maximum(y, 0)
        e = np.exp(zz - zz.max(1, keepdims=True))
        lse = np.log(e.sum(1)) + zz.max(1)
        ref = np.where(valid, m * (lse - zz[np.arange(n), yy]), 0).sum() / m.sum()
        g = e / e.sum(1, keepdims=True)
        g[np.arange(n), yy] -= 1
        g = np.where(valid[:, None], g * (2.0 * m / m.sum())[:, None], 0)
        got = widen_bf16(bits)  # the gradient, over the logits' bits
        assert abs(float(loss.numpy()) - ref) <= 1e-5 * abs(ref)
        # one rounding to bfloat16 (8 significant bits) per value, and float32 arithmetic
        assert (np.abs(got - g) <= 2.0 ** -8 * np.abs(g) + 1e-6 * np.abs(g).max()).all()
        assert (got[~valid] == 0).all()


@pytest.mark.parametrize("C", [40, 24, 7])
def test_fused_loss_rounds_as_tvm_does_with_the_conversion_instruction(C):
    """On a CPU with AVX-512 BF16 the fused loss rounds its bfloat16 gradient with the
    CPU's conversion (``dot_bf16_kernels.store_rounded``: 16, then 8 values a call, the
    rest by TVM); its bits equal those of TVM's own rounding, the kernel built without it."""
    import tvm
    import tvm_ffi
    from gcomp.codegen import cpu_kernels
    from gcomp.codegen.build import make_target
    from gcomp.codegen.kernels import _stored_bf16, has_dot_bf16
    target = make_target("llvm")
    if not has_dot_bf16(target):
        pytest.skip("this CPU has no AVX-512 BF16 conversion")
    fns = {}
    for rounds in (False, True):
        with _stored_bf16(("z", "out")):
            f = cpu_kernels.cross_entropy_fused(C=C, dot_bf16=rounds)
        name = f"ce_{int(rounds)}"
        fns[rounds] = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name)}),
                                  target=tvm.target.Target(target))[name]
    rng = np.random.default_rng(C)
    n = cpu_kernels.CE_PARALLEL // C + 77
    z = (4 * rng.standard_normal((n, C))).astype(np.float32)
    y = rng.integers(-1, C, n).astype(np.int32)
    m = (rng.random(n) < 0.6).astype(np.float32)
    T = tvm.runtime.tensor
    out = {}
    for rounds, fn in fns.items():
        bits = bf16_bits(z)
        both = tvm_ffi.from_dlpack(bits)._create_view((n, C), "bfloat16")
        loss = T(np.zeros((), np.float32))
        fn(T(np.array(2.0, np.float32)), both, T(y), T(m), loss, both)
        out[rounds] = (float(loss.numpy()), bits)
    assert out[True][0] == out[False][0]
    assert np.array_equal(out[True][1], out[False][1])


@pytest.mark.parametrize("kind,K,M,sum_row", [("matmul", 32, 32, False), ("matmul", 16, 7, False),
                                              ("matmul_tn", 32, 40, False),
                                              ("matmul_tn", 128, 130, False),
                                              ("matmul_tn", 32, 40, True),
                                              ("matmul_tn", 128, 130, True)])
def test_scheduled_generic_products(kind, K, M, sum_row):
    """The generic products as ``schedules/cpu.py`` schedules them (what a tuning falls back
    on where its row groups or tiles lose: this machine's may never pick them), the
    product with a ReLU applied row by row, each row's sums kept in a stack buffer, the
    weight gradient with and without a row of column sums, against float64; node counts
    that leave the last rows of a block or chunk short."""
    import tvm
    from gcomp.codegen.build import make_target
    from gcomp.codegen.kernels import KernelSpec, define
    from gcomp.schedules.cpu import schedule
    params = {"epilogue": (("relu", (), None, False),)} if kind == "matmul" else {}
    if sum_row:
        params["sum_row"] = True
    spec = KernelSpec.make(kind, K=K, M=M, **params)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": define(spec)}))
    sch.work_on("main")
    schedule(sch, spec)
    fn = tvm.compile(tvm.IRModule({"k": sch.mod["main"].with_attr("global_symbol", "k")}),
                     target=tvm.target.Target(make_target("llvm")))["k"]
    rng = np.random.default_rng(K * M)
    for n in (1, 17, 67, 1000):
        x = rng.standard_normal((n, K)).astype(np.float32)
        if kind == "matmul":
            w = rng.standard_normal((K, M)).astype(np.float32)
            ref, shape = np.maximum(x.astype(np.float64) @ w, 0.0), (n, M)
        else:
            w = rng.standard_normal((n, M)).astype(np.float32)
            ref, shape = x.astype(np.float64).T @ w, (K, M)
            if sum_row:
                ref, shape = np.vstack([ref, w.astype(np.float64).sum(0)]), (K + 1, M)
        out = tvm.runtime.tensor(np.full(shape, np.nan, np.float32))
        fn(tvm.runtime.tensor(x), tvm.runtime.tensor(w), out)
        assert np.abs(out.numpy() - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), n


@pytest.mark.parametrize("kind,params", [
    ("matmul", {"K": 32, "M": 32}), ("matmul", {"K": 128, "M": 128}),
    ("csr_agg", {"reduce": "sum", "H": 1, "C": 32, "weight": "none"}),
    ("edge_dot", {"H": 4, "C": 8}), ("attention_agg", {"H": 4, "C": 8, "slope": 0.2}),
    ("attention_grad_dst", {"H": 4, "C": 8, "slope": 0.2}),
    ("attention_grad_src", {"H": 4, "C": 8, "slope": 0.2})])
def test_row_kernels_keep_their_scratch_on_the_stack(kind, params):
    """The CPU kernels that walk rows (or row groups) with a scratch buffer per iteration
    compile to code that never calls TVM's workspace allocator: a buffer in scope "local"
    would be allocated and freed in every iteration (``cpu_kernels._scratch``)."""
    import tvm
    from gcomp.codegen.build import make_target
    from gcomp.codegen.kernels import KernelSpec, target_definition
    target = make_target("llvm")
    spec = KernelSpec.make(kind, **params)
    func = target_definition(spec, target)
    if func is None:
        pytest.skip(f"this CPU's tuning keeps the generic {kind} for {params}")
    lib = tvm.compile(tvm.IRModule({spec.name: func}), target=tvm.target.Target(target))
    asm = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("asm")
    assert "TVMBackendAllocWorkspace" not in asm


@pytest.mark.parametrize("bf16,reduce,F", [(False, "sum", 32), (False, "max", 48),
                                           (True, "mean", 64), (True, "sum", 32)])
def test_aggregation_streams_rows_to_the_same_bits(bf16, reduce, F):
    """An aggregation whose output only products read writes it with streaming stores
    (``stream_out``, ``gcomp/codegen/stream_stores.py``: ``vmovntps``, rows rounded to
    bfloat16 by the CPU first); its bits equal those of the kernel storing through the
    caches, on an output whose rows start cache lines and on one 16 bytes past a line
    (stored plainly: the instruction faults there), and its values match float64."""
    import scipy.sparse as sp
    import tvm
    import tvm_ffi
    from tvm.target import codegen
    from gcomp.codegen import cpu_kernels
    from gcomp.codegen.build import make_target
    from gcomp.codegen.kernels import _stored_bf16, has_dot_bf16
    target = make_target("llvm")
    if not codegen.target_has_features("avx512f", tvm.target.Target(target)):
        pytest.skip("streaming stores of whole lines need AVX-512")
    if bf16 and not has_dot_bf16(target):
        pytest.skip("bfloat16 rows are streamed where the CPU rounds them (AVX-512 BF16)")
    fns = {}
    for stream in (False, True):
        with _stored_bf16(("x", "out") if bf16 else ()):
            f = cpu_kernels.csr_agg(reduce=reduce, H=1, C=F, weight="edge", dot_bf16=bf16,
                                    stream_out=stream, tuning="default")
        lib = tvm.compile(tvm.IRModule({"agg": f.with_attr("global_symbol", "agg")}),
                          target=tvm.target.Target(target))
        assert ("vmovntps" in lib.mod.inspect_source("asm")) == stream
        fns[stream] = lib["agg"]
    rng = np.random.default_rng(F)
    n, m = 700, 500
    deg = rng.integers(0, 14, n)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    indices = rng.integers(0, m, int(indptr[-1])).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (len(indices), 1)).astype(np.float32)
    x = rng.standard_normal((m, F)).astype(np.float32)
    dtype, view = (np.uint16, "bfloat16") if bf16 else (np.float32, "float32")
    xs = bf16_bits(x) if bf16 else x
    T = tvm.runtime.tensor
    got = {}
    for stream, fn in fns.items():
        for offset in (0, 16):
            store = np.zeros(n * F + 64, dtype)
            first = ((-store.ctypes.data) % 64 + offset) // store.itemsize
            rows = store[first:first + n * F]
            assert rows.ctypes.data % 64 == offset
            fn(T(indptr), T(indices), T(w), tvm_ffi.from_dlpack(xs)._create_view((m, F), view),
               tvm_ffi.from_dlpack(rows)._create_view((n, F), view))
            got[stream, offset] = rows.copy()
            assert (store[:first] == 0).all() and (store[first + n * F:] == 0).all()
    first = got[False, 0]
    assert all(np.array_equal(first, v) for v in got.values())
    xv = widen_bf16(xs) if bf16 else x.astype(np.float64)
    terms = sp.csr_matrix((w[:, 0].astype(np.float64), indices, indptr), shape=(n, m))
    if reduce == "max":
        ref = np.zeros((n, F))
        for i in range(n):
            lo, hi = indptr[i], indptr[i + 1]
            if hi > lo:
                ref[i] = (w[lo:hi] * xv[indices[lo:hi]]).max(0)
    else:
        ref = terms @ xv
        if reduce == "mean":
            ref /= np.maximum(deg, 1)[:, None]
    val = widen_bf16(first) if bf16 else first.astype(np.float64)
    tol = 2.0 ** -8 if bf16 else 1e-5
    assert np.abs(val.reshape(n, F) - ref).max() <= tol * np.abs(ref).max()
