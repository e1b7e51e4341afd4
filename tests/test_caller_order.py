"""Node features read through the bound node order (``gcomp/codegen/caller_order.py``):
which steps offer the form, and bound runs that number nodes anew (the training mask's
rows first, a locality order) reading the caller's features in place, never permuted,
with the float64 interpreter's results whatever gcomp's own feature buffer holds."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err
from test_loss_rows import labelled, poisoned_step_is_the_interpreters

import gcomp.models as models
from gcomp.compiler import compile_model
from gcomp.ir import interpret
from gcomp.runtime.plan import kernel_kind
from gcomp.runtime.trainer import Trainer


def readers_of(plan, name: str) -> list:
    return [s for s in plan.feed_steps + plan.steps
            if any(a.get("buf") == name for a in s["args"])]


@pytest.mark.parametrize("name,forms", [
    ("sage", {("matmul", "rows"), ("matmul_tn", "rows"), ("csr_agg", "indices")}),
    ("gin", {("matmul", "rows"), ("matmul_tn", "rows")}),
    ("gcn", {("csr_agg", "indices")})])
def test_every_step_reading_the_features_has_a_form_through_the_order(name, forms):
    """GraphSAGE's products of x and of its mean (hoisted, computed once per feed), GIN's
    first product and its weight gradient, GCN's hoisted A x: each carries its form; a
    product's is a kernel of its own in the library, an aggregation's its own kernel."""
    m = models.build(name, 40, hidden=16, out_channels=3, layers=2, seed=0)
    art = compile_model(m, train=True)
    plan = art.train_plan
    readers = readers_of(plan, "x")
    assert {(kernel_kind(s["kernel"]), s["caller_order"]["via"]) for s in readers} == forms
    for s in readers:
        g = s["caller_order"]
        if g["via"] == "rows":
            assert kernel_kind(g["kernel"]) == kernel_kind(s["kernel"])
            assert g["kernel"] != s["kernel"] and g["kernel"] in plan.kernels()
        assert s["args"][g["arg"]]["buf"] == "x"
    assert not any("caller_order" in s for s in plan.steps + plan.feed_steps
                   if s not in readers)
    art.executor()  # the library holds every kernel the plan names


@pytest.mark.parametrize("name", ["gcn", "sage", "gin"])
@pytest.mark.parametrize("F", [6, 40])
def test_training_on_the_loss_rows_reads_the_callers_features(name, F):
    """The mask's rows numbered first: the kernels read the features where the caller
    keeps them, in the caller's order (never copied or changed), and gcomp's own buffer
    for them, NaN, is never read: the step is the interpreter's.  Widths in groups of
    rows and not (6: one row at a time).  GIN aggregates 6-wide features before its
    first product, and its elementwise kernels read them at the row too: copied in the
    bound order, as every input without the forms."""
    g = labelled(awkward_graph(num_nodes=90, num_edges=500, num_features=F, seed=7), 3, 0.6,
                 seed=1)
    given = g.x.copy()
    m = models.build(name, F, hidden=8, out_channels=3, layers=3, seed=3)
    tr = Trainer(compile_model(m, train=True), g, formats="csr")
    b = tr._binding
    through = (name, F) != ("gin", 6)
    assert b.order is not None and b.caller_order == ({"x"} if through else set())
    assert b.reads_callers("x") == through
    if through:
        b.buffers["x"].copyfrom(np.full(tuple(b.buffers["x"].shape), np.nan, np.float32))
    poisoned_step_is_the_interpreters(tr, m, g)
    assert np.array_equal(g.x, given)


def test_training_in_a_scattered_order_copies_the_features_once():
    """A training binding in a degree order (the caller's rows in many runs) copies the
    features in that order once, rather than every step writing its products' rows at
    random; the step is still the interpreter's."""
    g = labelled(awkward_graph(num_nodes=90, num_edges=500, num_features=40, seed=7), 3, 0.6,
                 seed=1)
    m = models.build("sage", 40, hidden=8, out_channels=3, layers=3, seed=3)
    tr = Trainer(compile_model(m, train=True), g, formats="csr", reorder="degree")
    b = tr._binding
    assert np.count_nonzero(np.diff(b.order) < 0) > 8
    assert b.caller_order == set() and not b.reads_callers("x")
    poisoned_step_is_the_interpreters(tr, m, g)


@pytest.mark.parametrize("reorder", ["degree", "rcm"])
def test_inference_in_a_locality_order_reads_the_callers_features(reorder):
    """A bound order for locality: outputs in the user's order as the interpreter's, the
    caller's array read in place; features handed over as float64 are converted and
    copied in the caller's order (no permutation), with the same outputs."""
    g = awkward_graph(num_nodes=120, num_edges=700, num_features=40, seed=2)
    m = models.build("sage", 40, hidden=16, out_channels=3, layers=2, seed=1)
    ex = compile_model(m).executor()
    ex.reorder = reorder
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    b = ex.bind(g)
    assert b.order is not None and b.caller_order == {"x"}
    fed = ex.feed(b, {"x": g.x})
    assert fed.reads_callers("x")
    ex.execute(fed)
    assert rel_err(ex.outputs(fed)[0], ref) <= 1e-5
    fed = ex.feed(b, {"x": g.x.astype(np.float64)})
    assert not fed.reads_callers("x")
    ex.execute(fed)
    assert rel_err(ex.outputs(fed)[0], ref) <= 1e-5


@pytest.mark.parametrize("name", ["gcn", "sage", "gin"])
def test_bf16_steps_read_the_callers_features(name):
    """bfloat16 activations (Mixed precision): the features' bfloat16 copy (where the
    products read one) is made from the caller's rows into the bound ones, and
    aggregations storing bfloat16 gather them through the order; with gcomp's own float32
    buffer for them NaN, steps on the loss rows give the steps on every row in the
    caller's order."""
    g = labelled(awkward_graph(num_nodes=80, num_edges=400, num_features=40, seed=9), 3, 0.5)
    m = models.build(name, 40, hidden=16, out_channels=3, layers=3, seed=2)
    art = compile_model(m, train=True, precision="bf16")
    assert all("caller_order" in s for s in readers_of(art.train_plan, "x"))
    rows = Trainer(art, g, formats="csr")
    every = Trainer(art, g, formats="csr", loss_rows=False)
    b = rows._binding
    assert b.order is not None and b.caller_order == {"x"} and every._binding.order is None
    b.buffers["x"].copyfrom(np.full(tuple(b.buffers["x"].shape), np.nan, np.float32))
    for _ in range(3):
        a, e = rows.step(), every.step()
        assert abs(a - e) <= 1e-3 * abs(e)
        for k, v in every.gradients().items():
            assert rel_err(rows.gradients()[k], v) <= 2e-2, k
