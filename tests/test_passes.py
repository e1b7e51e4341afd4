"""Each pass alone on a tiny graph, compared with the expected IR text (Before/Expected)."""

import pytest

from gcomp.errors import GcompError
from gcomp.ir import parse_graph, print_graph
from gcomp.passes import (Canonicalize, DeadCodeElimination, FuseAggregate, FuseAttention,
                          HoistGraphStatic, Instrument, PassContext, PassError, PassManager)


def run_pass(p, before: str) -> str:
    g = parse_graph(before)
    PassManager([p])(g)
    return print_graph(g)


def same(after: str, expected: str) -> None:
    assert after == print_graph(parse_graph(expected))


def test_fuse_weighted_gcn_message():
    before = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %g1 = self_loops[mode="add_remaining"](%g) : graph<coo>
  %norm = sym_norm(%g1) : f32[E(g1)]
  %n2 = reshape[shape=["E", 1]](%norm) : f32[E(g1),1]
  %xj = gather[side="src"](%g1, %x) : f32[E(g1),4]
  %m = mul(%n2, %xj) : f32[E(g1),4]
  %y = scatter[reduce="sum"](%g1, %m) : f32[N,4]
  return %y
}"""
    expected = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %g1 = self_loops[mode="add_remaining"](%g) : graph<coo>
  %norm = sym_norm(%g1) : f32[E(g1)]
  %y = aggregate[reduce="sum"](%g1, %x, %norm) : f32[N,4]
  return %y
}"""
    same(run_pass(FuseAggregate(), before), expected)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_fuse_plain_message(reduce):
    before = f"""graph t(%x: f32[N,4], %g: graph<coo>) {{
  %xj = gather[side="src"](%g, %x) : f32[E(g),4]
  %y = scatter[reduce="{reduce}"](%g, %xj) : f32[N,4]
  return %y
}}"""
    expected = f"""graph t(%x: f32[N,4], %g: graph<coo>) {{
  %y = aggregate[reduce="{reduce}"](%g, %x) : f32[N,4]
  return %y
}}"""
    same(run_pass(FuseAggregate(), before), expected)


def test_fuse_per_head_attention():
    before = """graph t(%h: f32[N,2,3], %a: f32[E(g),2], %g: graph<coo>) {
  %a3 = reshape[shape=["E", 2, 1]](%a) : f32[E(g),2,1]
  %xj = gather[side="src"](%g, %h) : f32[E(g),2,3]
  %m = mul(%xj, %a3) : f32[E(g),2,3]
  %y = scatter[reduce="sum"](%g, %m) : f32[N,2,3]
  return %y
}"""
    expected = """graph t(%h: f32[N,2,3], %a: f32[E(g),2], %g: graph<coo>) {
  %y = aggregate[reduce="sum"](%g, %h, %a) : f32[N,2,3]
  return %y
}"""
    after = run_pass(FuseAggregate(), before.replace("%a: f32[E(g),2], %g: graph<coo>",
                                                     "%g: graph<coo>, %a: f32[E(g),2]"))
    same(after, expected.replace("%a: f32[E(g),2], %g: graph<coo>", "%g: graph<coo>, %a: f32[E(g),2]"))


def test_no_fusion_of_destination_side_or_feature_wise_weights():
    before = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %xi = gather[side="dst"](%g, %x) : f32[E(g),4]
  %xj = gather[side="src"](%g, %x) : f32[E(g),4]
  %m = mul(%xi, %xj) : f32[E(g),4]
  %y = scatter[reduce="sum"](%g, %m) : f32[N,4]
  return %y
}"""
    assert run_pass(FuseAggregate(), before) == print_graph(parse_graph(before))


def test_canonicalize_bias_consts_reshapes():
    before = """graph t(%x: f32[N,4]) {
  %b = param[init="zeros"] : f32[4]
  %one = const[value=1.0] : f32[]
  %two = const[value=2.0] : f32[]
  %s = add(%one, %two) : f32[]
  %y = add(%x, %b) : f32[N,4]
  %z = mul(%y, %s) : f32[N,4]
  %r1 = reshape[shape=["N", 2, 2]](%z) : f32[N,2,2]
  %r2 = reshape[shape=["N", 4]](%r1) : f32[N,4]
  return %r2
}"""
    expected = """graph t(%x: f32[N,4]) {
  %b = param[init="zeros"] : f32[4]
  %s = const[value=3.0] : f32[]
  %y = bias_add(%x, %b) : f32[N,4]
  %z = mul(%y, %s) : f32[N,4]
  return %z
}"""
    same(run_pass(Canonicalize(), before), expected)


def test_canonicalize_reduce_over_unit_axis_is_a_reshape():
    before = """graph t(%x: f32[N,1,3], %g: graph<coo>) {
  %m = mean[axis=1](%x) : f32[N,3]
  %k = max[axis=-1, keepdims=true](%m) : f32[N,1]
  %e = gather(%g, %x) : f32[E(g),1,3]
  %s = sum[axis=1](%e) : f32[E(g),3]
  %w = sum[axis=-1](%k) : f32[N]
  return %m, %s, %w
}"""
    expected = """graph t(%x: f32[N,1,3], %g: graph<coo>) {
  %m = reshape[shape=["N", 3]](%x) : f32[N,3]
  %k = max[axis=-1, keepdims=true](%m) : f32[N,1]
  %e = gather(%g, %x) : f32[E(g),1,3]
  %s = reshape[shape=["E", 3]](%e) : f32[E(g),3]
  %w = reshape[shape=["N"]](%k) : f32[N]
  return %m, %s, %w
}"""
    same(run_pass(Canonicalize(), before), expected)


ATTENTION = """graph t(%x: f32[N,2,3], %s: f32[N,2], %d: f32[N,2], %g: graph<coo>) {
  %a = gather(%g, %s) : f32[E(g),2]
  %b = gather[side="dst"](%g, %d) : f32[E(g),2]
  %e = add(%b, %a) : f32[E(g),2]
  %l = leaky_relu[alpha=0.1](%e) : f32[E(g),2]
  %w = edge_softmax(%g, %l) : f32[E(g),2]
  %y = aggregate(%g, %x, %w) : f32[N,2,3]
  return %y%s
}"""


def test_fuse_attention():
    expected = """graph t(%x: f32[N,2,3], %s: f32[N,2], %d: f32[N,2], %g: graph<coo>) {
  %y = attention_aggregate[negative_slope=0.1](%g, %x, %s, %d) : f32[N,2,3]
  return %y
}"""
    same(run_pass(FuseAttention(), ATTENTION.replace("%y%s", "%y")), expected)


def test_fuse_attention_one_head_and_no_activation():
    before = """graph t(%x: f32[N,1,3], %s: f32[N,1], %d: f32[N,1], %g: graph<coo>) {
  %a = gather(%g, %s) : f32[E(g),1]
  %b = gather[side="dst"](%g, %d) : f32[E(g),1]
  %e = add(%a, %b) : f32[E(g),1]
  %w = edge_softmax(%g, %e) : f32[E(g),1]
  %r = reshape[shape=["E"]](%w) : f32[E(g)]
  %y = aggregate(%g, %x, %r) : f32[N,1,3]
  return %y
}"""
    after = run_pass(FuseAttention(), before)
    assert "attention_aggregate[negative_slope=1.0](%g, %x, %s, %d)" in after, after
    assert "edge_softmax" not in after


@pytest.mark.parametrize("also", [", %w", ", %a"])
def test_attention_coefficients_read_elsewhere_stay_unfused(also):
    """The backward pass (or anything else) reading an edge intermediate keeps the chain."""
    before = ATTENTION.replace("%y%s", "%y" + also)
    same(run_pass(FuseAttention(), before), before)


def test_dce_keeps_inputs_and_outputs():
    before = """graph t(%x: f32[N,4], %unused: f32[N,2]) {
  %a = relu(%x) : f32[N,4]
  %b = exp(%a) : f32[N,4]
  %dead = tanh(%b) : f32[N,4]
  return %b
}"""
    expected = """graph t(%x: f32[N,4], %unused: f32[N,2]) {
  %a = relu(%x) : f32[N,4]
  %b = exp(%a) : f32[N,4]
  return %b
}"""
    same(run_pass(DeadCodeElimination(), before), expected)


def test_hoist_marks_graph_static_values():
    text = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %g1 = self_loops[mode="add_remaining"](%g) : graph<coo>
  %norm = sym_norm(%g1) : f32[E(g1)]
  %y = aggregate[reduce="sum"](%g1, %x, %norm) : f32[N,4]
  return %y
}"""
    g = parse_graph(text)
    PassManager([HoistGraphStatic()])(g)
    assert {n.name: n.meta["phase"] for n in g} == {
        "x": "feed", "g": "bind", "g1": "bind", "norm": "bind", "y": "feed"}
    with_params = text.replace("return %y", "%w = param : f32[4,2]\n"
                               "  %z = matmul(%y, %w) : f32[N,2]\n  return %z")
    g = parse_graph(with_params)
    PassManager([HoistGraphStatic()])(g)
    assert [g.node(k).meta["phase"] for k in ("y", "w", "z")] == ["feed", "run", "run"]


def test_failing_pass_is_named_with_the_passes_before_it():
    class Boom(Canonicalize):
        name = "boom"

        def run(self, graph, ctx):
            raise RuntimeError("kaput")

    seen = []

    class Spy(Instrument):
        def run_on_failure(self, p, before, error, pipeline, ctx):
            seen.append((p.name, pipeline, print_graph(before)))

    g = parse_graph("graph t(%x: f32[N,4]) {\n  %y = relu(%x) : f32[N,4]\n  return %y\n}")
    pm = PassManager([DeadCodeElimination(), Boom()])
    with pytest.raises(PassError, match=r"pass 'boom' failed: kaput\n\(passes that ran before it: dce\)"):
        pm(g, PassContext(instruments=[Spy()]))
    assert seen and seen[0][0] == "boom" and seen[0][1] == ["dce", "boom"]


def test_disabling_an_unknown_pass_is_an_error():
    g = parse_graph("graph t(%x: f32[N,4]) {\n  %y = relu(%x) : f32[N,4]\n  return %y\n}")
    with pytest.raises(GcompError, match="unknown pass"):
        PassManager([DeadCodeElimination()])(g, PassContext(disabled=frozenset({"fusion"})))


def test_fuse_epilogues_groups_bias_and_activation():
    from gcomp.passes import FuseEpilogues
    text = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %b = param[init="zeros"] : f32[4]
  %a = aggregate(%g, %x) : f32[N,4]
  %c = bias_add(%a, %b) : f32[N,4]
  %r = relu(%c) : f32[N,4]
  %s = sigmoid(%x) : f32[N,4]
  %t = mul(%s, %r) : f32[N,4]
  %u = tanh(%t) : f32[N,4]
  return %u, %c
}"""
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g)
    meta = {n.name: {k: v for k, v in n.meta.items() if k in ("fused", "fused_into")} for n in g}
    # %c is a graph output: the chain stops there (the kernel writes %c), relu starts anew
    assert meta["a"] == {"fused": ["c"]} and meta["c"] == {"fused_into": "a"}
    # relu and sigmoid -> mul -> tanh: a tree, one elementwise kernel writing %u
    assert meta["r"] == {"fused": ["s", "t", "u"]}
    assert all(meta[m] == {"fused_into": "r"} for m in "stu")
    assert print_graph(g) == print_graph(parse_graph(text))  # values unchanged


def test_fuse_epilogues_computes_a_scaled_operand_in_the_epilogue():
    """GIN's sum_j x_j + (1 + eps) * x: the product is computed per element in the
    aggregation's epilogue instead of by a kernel of its own.  Over out-edges (whose
    extras the distributed runtime zeroes on halo rows) only a product with a node
    tensor, which vanishes there, and only where they gather (not on CUDA with
    ``prefer=memory``, whose atomic scatters take only added extras); where another value
    reads the product, it stays stored.  ``deterministic`` keeps the gathers, and so the
    fusion."""
    from gcomp.passes import FuseEpilogues
    text = """graph t(%x: f32[N,4], %dy: f32[N,4], %g: graph<coo>) {
  %eps = param[init="zeros"] : f32[]
  %a = aggregate(%g, %x) : f32[N,4]
  %m = mul(%eps, %x) : f32[N,4]
  %s = add(%a, %m) : f32[N,4]
  %r = relu(%s) : f32[N,4]
  %b = aggregate[flow="out"](%g, %dy) : f32[N,4]
  %n = mul(%eps, %dy) : f32[N,4]
  %t = add(%b, %n) : f32[N,4]
  %o = aggregate[flow="out"](%g, %x) : f32[N,4]
  %e = add(%eps, %dy) : f32[N,4]
  %f = add(%o, %e) : f32[N,4]
  %c = aggregate(%g, %dy) : f32[N,4]
  %k = mul(%eps, %r) : f32[N,4]
  %u = add(%c, %k) : f32[N,4]
  return %r, %t, %f, %u, %k
}"""

    def fused(target, **options):
        g = parse_graph(text)
        PassManager([FuseEpilogues()])(g, PassContext(target=target, options=options))
        assert print_graph(g) == print_graph(parse_graph(text))  # values unchanged
        return {n.name: {k: v for k, v in n.meta.items() if k in ("fused", "fused_into",
                                                                   "operand")} for n in g}
    for meta in (fused("llvm"), fused("cuda"), fused("cuda", prefer="memory",
                                                     deterministic=True)):
        assert meta["a"] == {"fused": ["m", "s", "r"]}
        assert meta["m"] == {"fused_into": "a", "operand": True}
        assert meta["b"] == {"fused": ["n", "t"]}
        assert meta["n"] == {"fused_into": "b", "operand": True}
        # eps + dy is eps on zeroed halo rows: not additive, stays stored
        assert meta["o"] == {"fused": ["f"]} and "fused_into" not in meta["e"]
        assert meta["c"] == {"fused": ["u"]} and "fused_into" not in meta["k"]  # an output
    meta = fused("cuda", prefer="memory")
    assert meta["a"] == {"fused": ["m", "s", "r"]}
    assert meta["b"] == {"fused": ["t"]} and "fused_into" not in meta["n"]


def test_fuse_epilogues_scales_an_aggregation_by_an_activation_gradient():
    """GIN's backward ``(A.T dz + (1 + eps) * dz) * relu'(h)``: the aggregation over
    out-edges applies the activation's gradient before it stores (no kernel of its own
    reading the sum back), on the CPU and on CUDA; with CUDA's ``prefer=memory`` (atomic
    scatters; not with ``deterministic``, which keeps the gathers) it stays a kernel of its
    own, as does a gradient whose activation value is computed by the chain itself."""
    from gcomp.passes import FuseEpilogues
    text = """graph t(%dz: f32[N,4], %h: f32[N,4], %g: graph<coo>) {
  %eps = param[init="zeros"] : f32[]
  %b = aggregate[flow="out"](%g, %dz) : f32[N,4]
  %n = mul(%eps, %dz) : f32[N,4]
  %t = add(%b, %n) : f32[N,4]
  %d = elementwise_grad[op="relu", of_output=true](%t, %h) : f32[N,4]
  %c = aggregate[flow="out"](%g, %h) : f32[N,4]
  %e = elementwise_grad[op="relu", of_output=true](%c, %c) : f32[N,4]
  return %d, %e
}"""

    def fused(target, **options):
        g = parse_graph(text)
        PassManager([FuseEpilogues()])(g, PassContext(target=target, options=options))
        assert print_graph(g) == print_graph(parse_graph(text))  # values unchanged
        return {n.name: {k: v for k, v in n.meta.items() if k in ("fused", "fused_into")}
                for n in g}
    # --deterministic keeps CUDA's gathers under prefer=memory, and so the fusion
    for meta in (fused("llvm"), fused("cuda"), fused("cuda", prefer="memory",
                                                     deterministic=True)):
        assert meta["b"] == {"fused": ["n", "t", "d"]} and meta["d"] == {"fused_into": "b"}
        assert "fused" not in meta["c"] and "fused_into" not in meta["e"]
    meta = fused("cuda", prefer="memory")
    assert meta["b"] == {"fused": ["t"]} and "fused_into" not in meta["d"]


def test_gin_backward_aggregation_applies_relu_gradient_like_the_interpreter():
    """End to end on the CPU: a 3-layer GIN step has no activation-gradient kernel of its
    own (the aggregation over out-edges reads h and stores the masked sum), and its loss
    and gradients equal the float64 interpreter's."""
    from conftest import awkward_graph
    from test_training import compiled_vs_interpreted, labelled

    from gcomp import models
    g = labelled(awkward_graph(num_nodes=90, num_edges=600, num_features=6, seed=5), 3)
    m = models.build("gin", 6, hidden=16, out_channels=3, layers=3, seed=4)
    tr = compiled_vs_interpreted(m, g, 3, seed=1)
    steps = tr.artifact.train_plan.steps
    kinds = [s["kernel"].rsplit("_", 1)[0] for s in steps]
    assert "gc_ewise_grad" not in kinds
    # aggregations over out-edges reading h (layer 0's output, relu) for its gradient:
    # layer 1's (16 -> 16, aggregated first); layer 2 aggregates h W (3 wide), so its
    # relu gradient follows a product and is fused there
    masked = [s for s in steps if s["kernel"].startswith("gc_csr_agg")
              and s["args"][0].get("array") == "csc_indptr"
              and any(a.get("buf") == "relu" for a in s["args"])]
    assert len(masked) == 1


def test_fuse_epilogues_reads_one_value_per_row():
    """A mean's gradient scales each row by 1 / degree ([N, 1]) after dY @ W.T: the matmul
    reads the column per row; a static [4, 1] column is no value per node or edge row."""
    from gcomp.passes import FuseEpilogues
    text = """graph t(%dy: f32[N,4], %inv: f32[N,1]) {
  %k = param : f32[4,1]
  %w = param : f32[4,4]
  %m = matmul(%dy, %w) : f32[N,4]
  %s = mul(%m, %inv) : f32[N,4]
  %v = param : f32[4,4]
  %p = matmul(%v, %w) : f32[4,4]
  %q = mul(%p, %k) : f32[4,4]
  return %s, %q
}"""
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g)
    assert g.node("m").meta.get("fused") == ["s"]
    assert "fused" not in g.node("p").meta
    assert print_graph(g) == print_graph(parse_graph(text))


def test_elide_broadcasts_the_consumer_does_itself():
    """A sum's gradient, broadcast back (autodiff), read by two products: both read the
    small tensor; a broadcast that numpy rules would not reproduce stays (here the other
    operand is as small, so the result would shrink)."""
    from gcomp.passes import ElideBroadcasts
    before = """graph t(%h: f32[N,4,8], %ds: f32[N,4,1], %c: f32[N,4,1]) {
  %a = param : f32[4,8]
  %b = broadcast_to(%ds, %h) : f32[N,4,8]
  %m = mul(%b, %a) : f32[N,4,8]
  %n = mul(%h, %b) : f32[N,4,8]
  %k = add(%b, %c) : f32[N,4,8]
  return %m, %n, %k
}"""
    expected = """graph t(%h: f32[N,4,8], %ds: f32[N,4,1], %c: f32[N,4,1]) {
  %a = param : f32[4,8]
  %b = broadcast_to(%ds, %h) : f32[N,4,8]
  %m = mul(%ds, %a) : f32[N,4,8]
  %n = mul(%h, %ds) : f32[N,4,8]
  %k = add(%b, %c) : f32[N,4,8]
  return %m, %n, %k
}"""
    same(run_pass(ElideBroadcasts(), before), expected)
    only = """graph t(%h: f32[N,4,8], %ds: f32[N,4,1]) {
  %a = param : f32[4,8]
  %b = broadcast_to(%ds, %h) : f32[N,4,8]
  %m = mul(%b, %a) : f32[N,4,8]
  return %m
}"""
    same(run_pass(ElideBroadcasts(), only), """graph t(%h: f32[N,4,8], %ds: f32[N,4,1]) {
  %a = param : f32[4,8]
  %m = mul(%ds, %a) : f32[N,4,8]
  return %m
}""")


def test_fuse_epilogues_reductions_read_elementwise_trees():
    """GAT's scores sum(h * a, -1) and its attention vector's gradient sum(ds * h, 0)
    reduce the product as it is computed; a product another value also reads is stored,
    and a tree of the gradient sum (dx + ds * a) is one kernel."""
    from gcomp.passes import FuseEpilogues
    text = """graph t(%h: f32[N,4,8], %ds: f32[N,4,1], %dx: f32[N,4,8]) {
  %a = param : f32[4,8]
  %p = mul(%h, %a) : f32[N,4,8]
  %s = sum(%p) : f32[N,4]
  %q = mul(%ds, %h) : f32[N,4,8]
  %da = sum[axis=0](%q) : f32[4,8]
  %r = mul(%h, %ds) : f32[N,4,8]
  %m = max(%r) : f32[N,4]
  %u = mul(%ds, %a) : f32[N,4,8]
  %g = add(%dx, %u) : f32[N,4,8]
  return %s, %da, %m, %r, %g
}"""
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g)
    meta = {n.name: {k: v for k, v in n.meta.items() if k in ("fused", "fused_into")} for n in g}
    assert meta["p"] == {"fused": ["s"]} and meta["s"] == {"fused_into": "p"}
    assert meta["q"] == {"fused": ["da"]} and meta["da"] == {"fused_into": "q"}
    assert meta["r"] == {} and meta["m"] == {}  # %r is an output: it is stored
    assert meta["u"] == {"fused": ["g"]} and meta["g"] == {"fused_into": "u"}
    assert print_graph(g) == print_graph(parse_graph(text))


def test_fusion_respects_values_the_backward_pass_needs():
    from gcomp.passes import FuseEpilogues
    text = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %a = aggregate(%g, %x) : f32[N,4]
  %r = relu(%a) : f32[N,4]
  %e = exp(%a) : f32[N,4]
  %s = add(%r, %e) : f32[N,4]
  return %s
}"""
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g)
    assert "fused" not in g.node("a").meta  # %a has two users: it must be materialized


def test_reorder_aggregates_on_the_narrow_side():
    from gcomp.passes import ReorderLinear
    before = """graph t(%x: f32[N,8], %g: graph<coo>) {
  %w = param : f32[8,2]
  %a = aggregate[reduce="mean"](%g, %x) : f32[N,8]
  %y = matmul(%a, %w) : f32[N,2]
  return %y
}"""
    expected = """graph t(%x: f32[N,8], %g: graph<coo>) {
  %w = param : f32[8,2]
  %x.lin = matmul(%x, %w) : f32[N,2]
  %y = aggregate[reduce="mean"](%g, %x.lin) : f32[N,2]
  return %y
}"""
    same(run_pass(ReorderLinear(), before), expected)
    wide = """graph t(%x: f32[N,2], %g: graph<coo>) {
  %w = param : f32[2,8]
  %h = matmul(%x, %w) : f32[N,8]
  %y = aggregate(%g, %h) : f32[N,8]
  return %y
}"""
    after = parse_graph(run_pass(ReorderLinear(), wide))
    assert [n.op.value for n in after if n.op.value in ("matmul", "aggregate")] == \
        ["aggregate", "matmul"]
    assert after.outputs[0].op.value == "matmul"


TRAINING_GIN_LAYER = """graph t(%x: f32[N,8], %g: graph<coo>, %labels: i32[N], %train_mask: f32[N]) {
  %w = param : f32[8,2]
  %eps = param : f32[]
  %a = aggregate(%g, %x) : f32[N,8]
  %s = mul(%eps, %x) : f32[N,8]
  %h = add(%a, %s) : f32[N,8]
  %y = matmul(%h, %w) : f32[N,2]
  %loss = cross_entropy(%y, %labels, %train_mask) : f32[]
  return %loss
}"""


def test_reorder_through_gin_sum_shares_one_product():
    from gcomp.passes import ReorderLinear
    before = TRAINING_GIN_LAYER.replace("  %loss = cross_entropy(%y, %labels, %train_mask)"
                                        " : f32[]\n", "").replace("return %loss", "return %y")
    g = parse_graph(run_pass(ReorderLinear(), before))
    mm = [n for n in g if n.op.value == "matmul"]
    assert len(mm) == 1 and mm[0].inputs[0].name == "x"
    agg = [n for n in g if n.op.value == "aggregate"][0]
    assert agg.inputs[1] is mm[0]


@pytest.mark.parametrize("target,prefer", [("llvm", "speed"), ("cuda", "speed"),
                                           ("cuda", "memory")])
def test_reorder_of_a_trained_gin_sum_depends_on_the_target(target, prefer):
    """GIN's (A x + eps x) W in a training step, eps trained: the CPU aggregates x W (one
    product, an aggregation every step); for CUDA, A x stays wide (once per feed) and the
    product is applied to each term, unless memory is preferred."""
    from gcomp.passes import ReorderLinear
    g = parse_graph(TRAINING_GIN_LAYER)
    PassManager([ReorderLinear()])(g, PassContext(target=target, options={"prefer": prefer}))
    agg = next(n for n in g if n.op.value == "aggregate")
    mm = [n for n in g if n.op.value == "matmul"]
    if target == "llvm" or prefer == "memory":
        assert len(mm) == 1 and mm[0].inputs[0].name == "x" and agg.inputs[1] is mm[0]
        return
    assert agg.inputs[1].name == "x"
    assert sorted(n.inputs[0].name for n in mm) == ["a", "x"]
    assert agg.meta["reorder"] == {"width_before": 8, "width_after": 8, "hoisted": True}
    PassManager([HoistGraphStatic()])(g)
    assert agg.meta["phase"] == "feed"


TRAINING_GCN_LAYER = """graph t(%x: f32[N,8], %g: graph<coo>, %labels: i32[N], %train_mask: f32[N]) {
  %w = param : f32[8,2]
  %g1 = self_loops[mode="add_remaining"](%g) : graph<coo>
  %norm = sym_norm(%g1) : f32[E(g1)]
  %h = matmul(%x, %w) : f32[N,2]
  %y = aggregate[reduce="sum"](%g1, %h, %norm) : f32[N,2]
  %loss = cross_entropy(%y, %labels, %train_mask) : f32[]
  return %loss
}"""


def test_reorder_hoists_aggregation_of_fed_values_in_training():
    """In a training step (loss output) the features are fed once: A(XW) becomes (AX)W even
    though W narrows 8 -> 2, so the aggregation runs once per feed, not once per step."""
    from gcomp.passes import ReorderLinear
    expected = """graph t(%x: f32[N,8], %g: graph<coo>, %labels: i32[N], %train_mask: f32[N]) {
  %w = param : f32[8,2]
  %g1 = self_loops[mode="add_remaining"](%g) : graph<coo>
  %norm = sym_norm(%g1) : f32[E(g1)]
  %y_1 = aggregate[reduce="sum"](%g1, %x, %norm) : f32[N,8]
  %y = matmul(%y_1, %w) : f32[N,2]
  %loss = cross_entropy(%y, %labels, %train_mask) : f32[]
  return %loss
}"""
    g = parse_graph(TRAINING_GCN_LAYER)
    PassManager([ReorderLinear()])(g)
    same(print_graph(g), expected)
    agg = next(n for n in g if n.op.value == "aggregate")
    assert agg.meta["reorder"] == {"width_before": 2, "width_after": 8, "hoisted": True}
    PassManager([HoistGraphStatic()])(g)
    assert agg.meta["phase"] == "feed" and g.node("y").meta["phase"] == "run"
    # an inference graph keeps the narrow side; so does a training graph whose aggregated
    # values change every step (dropout's mask)
    inference = TRAINING_GCN_LAYER.replace("  %loss = cross_entropy(%y, %labels, %train_mask)"
                                           " : f32[]\n", "").replace("return %loss", "return %y")
    assert run_pass(ReorderLinear(), inference) == print_graph(parse_graph(inference))
    no_phases = parse_graph(TRAINING_GCN_LAYER)  # nothing would run once per feed
    PassManager([ReorderLinear()])(no_phases, PassContext(disabled=frozenset(
        {"hoist_graph_static"})))
    assert print_graph(no_phases) == print_graph(parse_graph(TRAINING_GCN_LAYER))
    memory = parse_graph(TRAINING_GCN_LAYER)  # no wide buffer kept across steps
    PassManager([ReorderLinear()])(memory, PassContext(options={"prefer": "memory"}))
    assert print_graph(memory) == print_graph(parse_graph(TRAINING_GCN_LAYER))
    dropped = TRAINING_GCN_LAYER.replace(
        "%h = matmul(%x, %w)", "%s = input : i32[]\n  %xd = dropout[p=0.5](%x, %s) : f32[N,8]\n"
        "  %h = matmul(%xd, %w)")
    assert run_pass(ReorderLinear(), dropped) == print_graph(parse_graph(dropped))


def test_reorder_keeps_shared_values():
    from gcomp.passes import ReorderLinear
    before = """graph t(%x: f32[N,8], %g: graph<coo>) {
  %w = param : f32[8,2]
  %a = aggregate(%g, %x) : f32[N,8]
  %y = matmul(%a, %w) : f32[N,2]
  return %y, %a
}"""
    assert run_pass(ReorderLinear(), before) == print_graph(parse_graph(before))


def test_fusion_takes_activation_gradients_into_matmuls_and_aggregations():
    """relu'(y) times dY W^T fuses into the matmul (its backward layer), and on CPU
    targets into an aggregation over out-edges (the gradient is linear in the sum, so the
    distributed runtime's partial sums, each scaled by the same y, still add up; for
    CUDA see the test above)."""
    from gcomp.passes import FuseEpilogues
    text = """graph t(%dy: f32[N,4], %y: f32[N,3], %g: graph<coo>) {
  %w = param : f32[3,4]
  %m = matmul[trans_b=true](%dy, %w) : f32[N,3]
  %d = elementwise_grad[op="relu", of_output=true](%m, %y) : f32[N,3]
  %a = aggregate[flow="out"](%g, %d) : f32[N,3]
  %e = elementwise_grad[op="relu", of_output=true](%a, %y) : f32[N,3]
  return %e
}"""
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g)
    assert g.node("m").meta["fused"] == ["d"]
    assert g.node("a").meta["fused"] == ["e"]


def test_autodiff_of_fused_attention():
    """The fused op's gradient rule: the destination pass (statistics, d s_dst), then the
    source pass reading them (d x and d s_src side by side, sliced apart); only the
    slices something needs: here x and s_src depend on the parameters, d does not."""
    from gcomp.passes import Autodiff
    before = """graph t(%x0: f32[N,2,3], %d: f32[N,2], %g: graph<coo>) {
  %w = param : f32[3]
  %a = param : f32[2,3]
  %x = mul(%x0, %w) : f32[N,2,3]
  %xa = mul(%x, %a) : f32[N,2,3]
  %s = sum(%xa) : f32[N,2]
  %y = attention_aggregate[negative_slope=0.1](%g, %x, %s, %d) : f32[N,2,3]
  %r1 = sum(%y) : f32[N,2]
  %r2 = sum(%r1) : f32[N]
  %loss = sum[axis=0](%r2) : f32[]
  return %loss
}"""
    after = run_pass(Autodiff(), before)
    lines = [ln.strip() for ln in after.splitlines()]
    dst = [ln for ln in lines if "= attention_grad_dst[negative_slope=0.1](%g, %x, %s, %d, %"
           in ln]
    src = [ln for ln in lines if "= attention_grad_src[negative_slope=0.1](%g, %x, %s, %" in ln]
    assert len(dst) == len(src) == 1, after
    stats = dst[0].split(" = ")[0]
    assert src[0].split(", ")[-1].startswith(stats + ")"), src  # reads the statistics
    assert dst[0].endswith(": f32[N,8]") and src[0].endswith(": f32[N,8]")  # 4H; H*C + H
    both = src[0].split(" = ")[0]
    slices = [ln for ln in lines if ln.split(" = ")[-1].startswith("slice")]
    assert any(f"slice[axis=1, start=0, stop=6]({both})" in ln for ln in slices), slices
    assert any(f"slice[axis=1, start=6, stop=8]({both})" in ln for ln in slices), slices
    assert not any(f"({stats})" in ln for ln in slices)  # d needs no gradient


def test_fuse_attention_with_dropout_of_the_coefficients():
    before = """graph t(%x: f32[N,2,3], %s: f32[N,2], %d: f32[N,2], %g: graph<coo>, %k: i32[]) {
  %a = gather(%g, %s) : f32[E(g),2]
  %b = gather[side="dst"](%g, %d) : f32[E(g),2]
  %e = add(%a, %b) : f32[E(g),2]
  %l = leaky_relu[alpha=0.1](%e) : f32[E(g),2]
  %w = edge_softmax(%g, %l) : f32[E(g),2]
  %m = dropout[p=0.3, seed=4](%w, %k) : f32[E(g),2]
  %y = aggregate(%g, %x, %m) : f32[N,2,3]
  return %y
}"""
    expected = """graph t(%x: f32[N,2,3], %s: f32[N,2], %d: f32[N,2], %g: graph<coo>, %k: i32[]) {
  %y = attention_aggregate[negative_slope=0.1, p=0.3, seed=4](%g, %x, %s, %d, %k) : f32[N,2,3]
  return %y
}"""
    same(run_pass(FuseAttention(), before), expected)


SPLIT_BEFORE = """graph t(%a: f32[N,2], %b: f32[N,3], %x: f32[N,4]) {
  %w = param : f32[4,5]
  %v = param : f32[5,4]
  %c = concat[axis=1](%a, %b) : f32[N,5]
  %y = matmul[trans_b=true](%c, %w) : f32[N,4]
  %z = matmul(%c, %v) : f32[N,4]
  %gw = matmul[trans_a=true](%x, %c) : f32[4,5]
  %gb = sum[axis=0](%c) : f32[5]
  return %y, %z, %gw, %gb
}"""


def test_split_concat_products_reads_the_parts():
    """A GRU's gate gradients: the concat every user of which is a product or a column
    sum is not stored; each product reads the parts (weights sliced to them) and adds up,
    or concatenates weight-sized results; values match the interpreter's on the original
    graph to float rounding."""
    import numpy as np

    from gcomp.ir.interpreter import interpret
    from gcomp.passes import SplitConcatProducts
    expected = """graph t(%a: f32[N,2], %b: f32[N,3], %x: f32[N,4]) {
  %w = param : f32[4,5]
  %v = param : f32[5,4]
  %y.w = slice[axis=1, start=0, stop=2](%w) : f32[4,2]
  %y.part0 = matmul[trans_b=true](%a, %y.w) : f32[N,4]
  %y.w_1 = slice[axis=1, start=2, stop=5](%w) : f32[4,3]
  %y.part1 = matmul[trans_b=true](%b, %y.w_1) : f32[N,4]
  %y = add(%y.part0, %y.part1) : f32[N,4]
  %z.w = slice[axis=0, start=0, stop=2](%v) : f32[2,4]
  %z.part0 = matmul(%a, %z.w) : f32[N,4]
  %z.w_1 = slice[axis=0, start=2, stop=5](%v) : f32[3,4]
  %z.part1 = matmul(%b, %z.w_1) : f32[N,4]
  %z = add(%z.part0, %z.part1) : f32[N,4]
  %gw.part0 = matmul[trans_a=true](%x, %a) : f32[4,2]
  %gw.part1 = matmul[trans_a=true](%x, %b) : f32[4,3]
  %gw = concat[axis=1](%gw.part0, %gw.part1) : f32[4,5]
  %gb.part0 = sum[axis=0](%a) : f32[2]
  %gb.part1 = sum[axis=0](%b) : f32[3]
  %gb = concat[axis=0](%gb.part0, %gb.part1) : f32[5]
  return %y, %z, %gw, %gb
}"""
    same(run_pass(SplitConcatProducts(), SPLIT_BEFORE), expected)
    rng = np.random.default_rng(0)
    inputs = {"a": rng.standard_normal((6, 2)), "b": rng.standard_normal((6, 3)),
              "x": rng.standard_normal((6, 4))}
    params = {"w": rng.standard_normal((4, 5)), "v": rng.standard_normal((5, 4))}
    ref = interpret(parse_graph(SPLIT_BEFORE), inputs, params)
    got = interpret(parse_graph(expected), inputs, params)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-12)


BIAS_BEFORE = """graph t(%x: f32[N,4], %dy: f32[N,3], %dz: f32[N,3]) {
  %h = relu(%x) : f32[N,4]
  %gw = matmul[trans_a=true](%h, %dy) : f32[4,3]
  %gb = sum[axis=0](%dy) : f32[3]
  %gv = matmul[trans_a=true](%x, %dz) : f32[4,3]
  %gc = sum[axis=0](%dz) : f32[3]
  return %gw, %gb, %gv, %gc
}"""


def test_fuse_bias_grads_makes_the_bias_a_row_of_the_weight_gradient():
    """A column sum of dY beside x.T @ dY becomes the product's last row, sliced apart
    under the gradients' names; values match the interpreter's on the original graph to
    float rounding.  Not where x is node features (their sparse-feature variant has no
    such row), not for CUDA, and not where the products run on AMX tiles."""
    import numpy as np

    from gcomp.ir.interpreter import interpret
    from gcomp.passes import FuseBiasGrads
    expected = """graph t(%x: f32[N,4], %dy: f32[N,3], %dz: f32[N,3]) {
  %h = relu(%x) : f32[N,4]
  %gw.with_bias = matmul[trans_a=true, sum_row=true](%h, %dy) : f32[5,3]
  %gw = slice[axis=0, start=0, stop=4](%gw.with_bias) : f32[4,3]
  %gb.row = slice[axis=0, start=4, stop=5](%gw.with_bias) : f32[1,3]
  %gb = reshape[shape=[3]](%gb.row) : f32[3]
  %gv = matmul[trans_a=true](%x, %dz) : f32[4,3]
  %gc = sum[axis=0](%dz) : f32[3]
  return %gw, %gb, %gv, %gc
}"""
    same(run_pass(FuseBiasGrads(), BIAS_BEFORE), expected)
    rng = np.random.default_rng(0)
    inputs = {k: rng.standard_normal((7, w)) for k, w in (("x", 4), ("dy", 3), ("dz", 3))}
    ref = interpret(parse_graph(BIAS_BEFORE), inputs, {})
    got = interpret(parse_graph(expected), inputs, {})
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-12)
    for ctx in (PassContext(target="cuda"), PassContext(tile_products=True)):
        g = parse_graph(BIAS_BEFORE)
        PassManager([FuseBiasGrads()])(g, ctx)
        same(print_graph(g), BIAS_BEFORE)


def test_bias_grads_stay_apart_where_the_products_run_on_tiles():
    """A bfloat16 compile for a CPU with AMX tiles (named, so this runs anywhere) keeps
    each bias gradient a column sum: the tile kernels have no bias row.  float32 for the
    same CPU, and bfloat16 for one without tiles, fold them into the weight gradients."""
    from gcomp import models
    from gcomp.compiler import compile_model
    m = models.build("gin", 32, hidden=32, out_channels=4, layers=2)

    def fused(mcpu, precision):
        art = compile_model(m, mcpu=mcpu, train=True, precision=precision)
        return "sum_row=true" in art.ir["training"]
    assert not fused("sapphirerapids", "bf16")
    assert fused("sapphirerapids", "fp32") and fused("znver3", "bf16")


def test_split_concat_products_keeps_a_concat_read_otherwise():
    """One user that is neither a product nor a column sum (here relu) keeps the concat
    for every user."""
    from gcomp.passes import SplitConcatProducts
    text = SPLIT_BEFORE.replace("return %y, %z, %gw, %gb",
                                "%r = relu(%c) : f32[N,5]\n  return %y, %z, %gw, %gb, %r")
    same(run_pass(SplitConcatProducts(), text), text)


REMAT_BEFORE = """graph t(%h: f32[N,8], %n: f32[N,8], %dy: f32[N,8]) {
  %s = sub(%h, %n) : f32[N,8]
  %y = mul(%s, %s) : f32[N,8]
  %loss = sum[axis=0](%y) : f32[8]
  %dh = mul(%dy, %h) : f32[N,8]
  %dn = mul(%dy, %n) : f32[N,8]
  %dz = mul(%dy, %s) : f32[N,8]
  return %loss, %dh, %dn, %dz
}"""


def test_rematerialize_recomputes_what_the_backward_can():
    """After the loss (the first output) comes the backward pass: a forward sub of values
    it reads anyway is computed again before its first backward reader, so the forward
    value need not live through the backward pass; with one of its inputs not read by the
    backward pass, recomputing would keep that input alive instead, and nothing changes."""
    from gcomp.passes import Rematerialize
    expected = """graph t(%h: f32[N,8], %n: f32[N,8], %dy: f32[N,8]) {
  %s = sub(%h, %n) : f32[N,8]
  %y = mul(%s, %s) : f32[N,8]
  %loss = sum[axis=0](%y) : f32[8]
  %dh = mul(%dy, %h) : f32[N,8]
  %dn = mul(%dy, %n) : f32[N,8]
  %s.again = sub(%h, %n) : f32[N,8]
  %dz = mul(%dy, %s.again) : f32[N,8]
  return %loss, %dh, %dn, %dz
}"""
    same(run_pass(Rematerialize(), REMAT_BEFORE), expected)
    kept = REMAT_BEFORE.replace("  %dn = mul(%dy, %n) : f32[N,8]\n", "").replace(
        "return %loss, %dh, %dn, %dz", "return %loss, %dh, %dz")
    same(run_pass(Rematerialize(), kept), kept)


REMAT_AGG_BEFORE = """graph t(%x: f32[N,8], %g: graph<coo>, %dy: f32[N,4]) {
  %w = param : f32[8,4]
  %p = matmul(%x, %w) : f32[N,4]
  %h = relu(%p) : f32[N,4]
  %a = aggregate(%g, %h) : f32[N,4]
  %s = add(%a, %h) : f32[N,4]
  %loss = sum[axis=0](%s) : f32[4]
  %dh = mul(%dy, %h) : f32[N,4]
  %ds = mul(%dy, %dy) : f32[N,4]
  %dn = neg(%dh) : f32[N,4]
  %dw = matmul[trans_a=true](%s, %ds) : f32[4,4]
  return %loss, %dh, %dn, %dw
}"""


def test_rematerialize_recomputes_aggregations_when_memory_is_preferred():
    """With ``prefer="memory"``, GIN's ``sum_j h_j + h`` that a weight gradient reads is
    computed again from h (which the backward reads anyway), its aggregation with it; the
    weight gradient moves up to just after its other input, so the copy lives from there
    to it alone.  Preferring speed keeps the value; so does an aggregation of a graph
    input (the fed features: computed once per feed, not every step).  A product of the
    features with a weight is computed again too (the features stay through the step)."""
    from gcomp.passes import Rematerialize
    memory = PassContext(options={"prefer": "memory"})

    def remat(text, ctx):
        g = parse_graph(text)
        PassManager([Rematerialize()])(g, ctx)
        return print_graph(g)

    expected = """graph t(%x: f32[N,8], %g: graph<coo>, %dy: f32[N,4]) {
  %w = param : f32[8,4]
  %p = matmul(%x, %w) : f32[N,4]
  %h = relu(%p) : f32[N,4]
  %a = aggregate(%g, %h) : f32[N,4]
  %s = add(%a, %h) : f32[N,4]
  %loss = sum[axis=0](%s) : f32[4]
  %dh = mul(%dy, %h) : f32[N,4]
  %ds = mul(%dy, %dy) : f32[N,4]
  %a.again = aggregate(%g, %h) : f32[N,4]
  %s.again = add(%a.again, %h) : f32[N,4]
  %dw = matmul[trans_a=true](%s.again, %ds) : f32[4,4]
  %dn = neg(%dh) : f32[N,4]
  return %loss, %dh, %dn, %dw
}"""
    same(remat(REMAT_AGG_BEFORE, memory), expected)
    same(remat(REMAT_AGG_BEFORE, PassContext()), REMAT_AGG_BEFORE)
    fed = REMAT_AGG_BEFORE.replace("%a = aggregate(%g, %h)", "%a = aggregate(%g, %dy)")
    same(remat(fed, memory), fed)
    # GIN's x W, which its eps gradient reads: a product of the features, recomputed too
    product = REMAT_AGG_BEFORE.replace("%dh = mul(%dy, %h)", "%dh = mul(%dy, %p)")
    again = remat(product, memory)
    assert "%p.again = matmul(%x, %w)" in again and "%dh = mul(%dy, %p.again)" in again
    same(remat(product, PassContext()), product)


def test_compile_model_runs_the_passes_for_the_target_it_compiles_for():
    """A pass context made for another target (here CUDA's) does not change what the CPU
    build's passes choose: GIN's training step keeps the CPU's narrow first layer."""
    import gcomp.models as models
    from gcomp.compiler import compile_model
    m = models.build("gin", 16, hidden=8, out_channels=3, layers=2, seed=0)
    art = compile_model(m, "llvm", train=True, ctx=PassContext(target="cuda"))
    assert not art.train_plan.feed_steps
    assert sum(s["op"] == "aggregate" for s in art.train_plan.steps) == 4


def test_pass_context_refuses_unknown_options():
    with pytest.raises(GcompError, match="unknown pass option 'prefr'"):
        PassContext(options={"prefr": "memory"})
    with pytest.raises(GcompError, match="takes 'speed' or 'memory', not 'small'"):
        PassContext(options={"prefer": "small"})
    with pytest.raises(GcompError, match="'deterministic' takes False or True, not 'yes'"):
        PassContext(options={"deterministic": "yes"})
    assert PassContext().option("prefer") == "speed"
    assert PassContext().option("deterministic") is False


LOSS_BEFORE = """graph t(%z: f32[N,5], %y: i32[N], %m: f32[N]) {
  %loss = cross_entropy(%z, %y, %m) : f32[]
  %seed = const[value=1.0] : f32[]
  %g = cross_entropy_grad(%seed, %z, %y, %m) : f32[N,5]
  return %loss, %g
}"""


def test_fuse_loss_grad_marks_the_loss_as_computed_by_its_gradient():
    """The loss and its gradient of the same operands are marked for one kernel; not
    where the gradient's seed is computed from the loss (the kernel would read it before
    writing it), and not for CUDA."""
    from gcomp.passes import FuseLossGrad
    g = parse_graph(LOSS_BEFORE)
    PassManager([FuseLossGrad()])(g)
    loss, grad = g.node("loss"), g.node("g")
    assert loss.meta["with_grad"] == "g" and grad.meta["with_loss"] == "loss"
    assert '"with_grad": "g"' in print_graph(g, show_meta=True)
    scaled = LOSS_BEFORE.replace(
        "  %g = cross_entropy_grad(%seed, %z, %y, %m) : f32[N,5]",
        "  %s = mul(%seed, %loss) : f32[]\n  %g = cross_entropy_grad(%s, %z, %y, %m) : f32[N,5]")
    for text, ctx in ((scaled, None), (LOSS_BEFORE, PassContext(target="cuda"))):
        g = parse_graph(text)
        PassManager([FuseLossGrad()])(g, ctx)
        assert not any({"with_grad", "with_loss"} & n.meta.keys() for n in g)


def test_fused_loss_kernel_trains_as_the_two_kernels():
    """End to end on the CPU: one ``cross_entropy_fused`` step instead of the loss and
    gradient kernels, writing the gradient over the logits; the loss and every gradient of
    a GraphSAGE step equal those of the pipeline without the pass (float rounding)."""
    import numpy as np

    from gcomp import models
    from gcomp.compiler import compile_model
    from gcomp.runtime.trainer import Trainer
    from conftest import awkward_graph
    graph = awkward_graph(num_nodes=300, num_edges=2000, num_features=12, seed=3)
    graph.y = np.arange(300) % 11
    m = models.build("sage", 12, hidden=16, out_channels=11, layers=2)
    arts = {k: compile_model(m, train=True, ctx=PassContext(disabled=frozenset(off)))
            for k, off in (("fused", ()), ("apart", ("fuse_loss_grad",)))}
    kernels = {k: [s["kernel"].rsplit("_", 1)[0] for s in a.train_plan.steps]
               for k, a in arts.items()}
    assert kernels["fused"].count("gc_cross_entropy_fused") == 1
    assert "gc_cross_entropy" not in kernels["fused"]
    assert {"gc_cross_entropy", "gc_cross_entropy_grad"} <= set(kernels["apart"])
    trs = {k: Trainer(a, graph) for k, a in arts.items()}
    losses = {k: t.step() for k, t in trs.items()}
    assert abs(losses["fused"] - losses["apart"]) <= 1e-6 * abs(losses["apart"])
    ga, gb = trs["fused"].gradients(), trs["apart"].gradients()
    for k in gb:
        np.testing.assert_allclose(ga[k], gb[k], rtol=1e-5, atol=1e-7 * np.abs(gb[k]).max())


SAGE_LAYER = """graph t(%x: f32[N,4], %g: graph<coo>) {
  %wl = param[init="glorot"] : f32[4,3]
  %wr = param[init="glorot"] : f32[4,3]
  %bl = param[init="zeros"] : f32[3]
  %h = relu(%x) : f32[N,4]
  %m = aggregate[reduce="mean"](%g, %h) : f32[N,4]
  %p = matmul(%m, %wl) : f32[N,3]
  %b = bias_add(%p, %bl) : f32[N,3]
  %q = matmul(%h, %wr) : f32[N,3]
  %s = add(%b, %q) : f32[N,3]
  %r = relu(%s) : f32[N,3]
  return %r
}"""


def _fusion_meta(g) -> dict:
    return {n.name: {k: v for k, v in n.meta.items() if k in ("fused", "fused_into", "product")}
            for n in g}


def test_fuse_epilogues_sums_a_second_product_in_the_matmul():
    """GraphSAGE's ``lin_l(mean) + bias + lin_r(h)``: the first product's kernel takes in
    the bias, the second product (marked, summed in the same registers), the add and the
    relu; values unchanged."""
    from gcomp.passes import FuseEpilogues
    g = parse_graph(SAGE_LAYER)
    PassManager([FuseEpilogues()])(g)
    meta = _fusion_meta(g)
    assert meta["p"] == {"fused": ["b", "q", "s", "r"]}
    assert meta["q"] == {"fused_into": "p", "product": True}
    assert all(meta[m] == {"fused_into": "p"} for m in "bsr")
    assert print_graph(g) == print_graph(parse_graph(SAGE_LAYER))


@pytest.mark.parametrize("change", ["second user", "relu first", "features", "cuda", "tiles"])
def test_second_products_stay_apart_where_the_kernel_cannot_sum_them(change):
    """Not when the second product is read elsewhere too (it must be stored), when a
    non-additive member comes before the add (the sums would skip it), when an x is node
    features (their products have sparse-feature variants), on CUDA, or where bfloat16
    products run on AMX tiles (one product a kernel there): the add reads the second
    product as a stored extra, as before."""
    from gcomp.passes import FuseEpilogues
    text, ctx = SAGE_LAYER, None
    if change == "second user":
        text = text.replace("return %r", "return %r, %q")
    elif change == "relu first":
        text = text.replace("%b = bias_add(%p, %bl)", "%b = tanh(%p)")
    elif change == "features":
        text = text.replace("%q = matmul(%h, %wr)", "%q = matmul(%x, %wr)")
    else:
        ctx = PassContext(target="cuda") if change == "cuda" else PassContext(tile_products=True)
    g = parse_graph(text)
    PassManager([FuseEpilogues()])(g, ctx)
    meta = _fusion_meta(g)
    assert not any("product" in m for m in meta.values())
    if change != "second user":
        assert meta["p"]["fused"] == ["b", "s", "r"]  # %q read from memory
