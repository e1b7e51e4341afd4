"""Rows the masked loss does not read (``gcomp/codegen/loss_rows.py``): which steps run on
the training mask's rows alone, and training steps that give the float64 interpreter's
loss and gradients with them, whatever the rows past the mask held before.  Loss rows
apply where every aggregation runs in CSR; the tests ask for CSR, since the cost model's
choice on graphs this small follows the machine's calibration (ELL or dense may win on
another machine)."""

import numpy as np
import pytest
from conftest import awkward_graph, rel_err

import gcomp.models as models
from gcomp.codegen.optimizer import OptimizerConfig
from gcomp.compiler import compile_model
from gcomp.ir import RefGraph, interpret
from gcomp.passes import training_pipeline
from gcomp.runtime.data import GraphData
from gcomp.runtime.plan import kernel_kind
from gcomp.runtime.trainer import Trainer


def labelled(g: GraphData, C: int, fraction: float, seed: int = 0) -> GraphData:
    rng = np.random.default_rng(seed)
    g.y = rng.integers(0, C, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < fraction
    g.val_mask = g.test_mask = ~g.train_mask
    return g


def poison(tr: Trainer) -> None:
    """NaN in every float32 buffer a run step writes (not parameters or optimizer state): a
    step that reads a row no kernel of this step computed returns NaN."""
    b = tr._binding
    keep = set(tr.artifact.train_plan.params) | set(tr.artifact.train_plan.state)
    for s in b.plan_steps:
        name = s["args"][-1].get("buf")
        t = b.buffers.get(name)
        if name in keep or t is None or t.dtype != "float32":
            continue
        t.copyfrom(np.full(tuple(t.shape), np.nan, np.float32))


def reference(model, g: GraphData, params: dict, mask: np.ndarray):
    tg = training_pipeline()(model.graph.copy())
    inputs = {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
              "edge_weight": g.edge_weight, "labels": g.y,
              "train_mask": mask.astype(np.float64), "rng_step": 1}
    outs = interpret(tg, {k: v for k, v in inputs.items() if tg.has(k)}, params)
    return outs[0], dict(zip(tg.meta["grads"], outs[1:]))


def poisoned_step_is_the_interpreters(tr: Trainer, model, g: GraphData) -> None:
    """One step of ``tr`` after ``poison``: its loss and gradients are the interpreter's."""
    params = tr.parameters()
    poison(tr)
    loss = tr.step()
    ref_loss, ref_grads = reference(model, g, params, tr.train_mask)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    for k, v in tr.gradients().items():
        assert rel_err(v, ref_grads[k]) <= 1e-4, (k, rel_err(v, ref_grads[k]))


def steps_of(plan, kind: str, rows=None) -> list:
    return [s for s in plan.steps if kernel_kind(s["kernel"]) == kind
            and (rows is None or s.get("rows") == rows)]


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat", "ggnn"])
@pytest.mark.parametrize("fraction", [0.1, 0.6])
def test_a_step_on_the_loss_rows_gives_the_interpreters_gradients(name, fraction):
    """The mask's nodes are numbered first and the step runs its last layer on them; every
    other buffer written by the step is NaN before it, so a row read but not computed
    would show.  Dropout on, whose masks hash the user's node ids."""
    g = labelled(awkward_graph(num_nodes=90, num_edges=500, num_features=6, seed=7), 3,
                 fraction, seed=1)
    m = models.build(name, 6, hidden=8, out_channels=3, layers=3, heads=2, dropout=0.3, seed=3)
    tr = Trainer(compile_model(m, train=True), g, formats="csr")
    b = tr._binding
    assert b.dims["L"] == int(tr.train_mask.sum()) < g.num_nodes
    assert tr.train_mask[b.order[:b.dims["L"]]].all()
    poisoned_step_is_the_interpreters(tr, m, g)


def test_weighted_gcn_reads_the_edges_into_the_loss_rows_in_csc_order():
    """Fixed edge weights of an out-edge aggregation are put in the order of the CSC of the
    edges into the loss rows once per graph (their own bind step), and the step matches
    the interpreter after poisoning."""
    g = labelled(awkward_graph(num_nodes=80, num_edges=400, num_features=5, seed=2,
                               edge_weight=True), 4, 0.3, seed=3)
    m = models.build("gcn", 5, hidden=8, out_channels=4, layers=3, edge_weight=True, seed=2)
    art = compile_model(m, train=True)
    plan = art.train_plan
    restricted = [s for s in steps_of(plan, "csr_agg")
                  if any(a.get("array") == "csc_indptr" and a.get("rows") for a in s["args"])]
    assert restricted
    made = {s["args"][-1]["buf"]: s for s in plan.bind_steps}
    for s in restricted:
        w = [a["buf"] for a in s["args"] if "buf" in a][0]
        assert w.endswith(".csc.L") and plan.buffers[w]["dims"][0].endswith("|L")
        assert made[w]["args"][0] == {"graph": made[w]["args"][0]["graph"],
                                      "array": "csc_eid", "rows": "L"}
    poisoned_step_is_the_interpreters(Trainer(art, g, formats="csr"), m, g)


@pytest.mark.parametrize("classes", [3, 40])
def test_which_steps_of_graphsage_run_on_the_loss_rows(classes):
    """GraphSAGE's last layer: A(h W_l) + h W_r for 3 classes, (A h) W_l + h W_r for 40
    (reorder_linear).  Its products (but h W_l, which the aggregation gathers), the
    aggregation into its rows, the loss and the weight gradients run on rows [0, L); the loss gradient, read whole by the backward of
    the layer below, is zeroed past L right after; the backward aggregation walks only the
    edges into the loss rows; the hidden layers compute every row."""
    m = models.build("sage", 16, hidden=32, out_channels=classes, layers=3)
    plan = compile_model(m, train=True, optimizer=OptimizerConfig(name="adam")).train_plan
    assert plan.loss_rows == {"mask": "train_mask"}
    loss = steps_of(plan, "cross_entropy_fused")[0]
    assert loss["rows"] == "L" and [a.get("view") for a in loss["args"][1:4]] == [
        ["L", classes], ["L"], ["L"]]
    tail = plan.steps[plan.steps.index(loss) + 1]
    assert tail.get("tail") and kernel_kind(tail["kernel"]) == "zero_rows"
    assert [a["buf"] for a in tail["args"]] == [loss["args"][-1]["buf"]] * 2
    agg_in = [s for s in steps_of(plan, "csr_agg", "L")]
    assert len(agg_in) == 1 and agg_in[0]["args"][0] == {
        "graph": "edge_index", "array": "indptr", "rows": "L"}
    gathered = agg_in[0]["args"][2]
    assert gathered.get("view", ["N"])[0] == "N"  # the source rows stay whole
    tn = steps_of(plan, "matmul_tn")
    # the last layer's weight gradients: both for (A h) W_l; A(h W_l)'s W_l gradient is
    # h.T (A.T dY), whose second factor has every row
    assert sum(s.get("rows") == "L" for s in tn) == (2 if classes == 40 else 1)
    assert all(a.get("view", ["L"])[0] == "L" for s in tn if s.get("rows")
               for a in s["args"][:2])
    back = [s for s in steps_of(plan, "csr_agg") if s["args"][0]["array"] == "csc_indptr"]
    assert sum(a.get("rows") == "L" for s in back for a in s["args"][:2]) == 2  # the last one
    assert len([s for s in plan.steps if s.get("rows") == "L"]) >= 5
    for s in steps_of(plan, "matmul"):
        if s.get("rows") == "L":
            assert all(a.get("view", ["L"])[0] == "L" for a in s["args"]
                       if "buf" in a and plan.buffers[a["buf"]]["dims"][:1] == ["N"])


def test_cuda_and_inference_plans_keep_every_row():
    m = models.build("gcn", 8, hidden=8, out_channels=3, layers=2)
    art = compile_model(m, "cuda", train=True)
    assert art.train_plan.loss_rows == {} and not any(
        s.get("rows") or s.get("tail") for s in art.train_plan.steps)
    cpu = compile_model(m, train=True)
    assert cpu.plan.loss_rows == {} and cpu.train_plan.loss_rows


def test_without_loss_rows_or_in_another_format_every_row_runs_the_same_steps():
    """``loss_rows=False``, ``reorder="none"`` and a format other than CSR keep L = N: the
    given order, no tail step bound; all three train like the loss-row binding."""
    g = labelled(awkward_graph(num_nodes=70, num_edges=350, num_features=6, seed=4), 3, 0.4)
    m = models.build("gin", 6, hidden=8, out_channels=3, layers=3, seed=5)
    art = compile_model(m, train=True)
    runs = {"rows": Trainer(art, g, formats="csr"),
            "off": Trainer(art, g, formats="csr", loss_rows=False),
            "none": Trainer(art, g, formats="csr", reorder="none"),
            "dense": Trainer(art, g, formats="dense")}
    assert runs["rows"]._binding.dims["L"] < g.num_nodes
    for key in ("off", "none", "dense"):
        b = runs[key]._binding
        assert b.dims["L"] == g.num_nodes
        assert not any(s.get("tail") for s in b.plan_steps)
    assert runs["off"]._binding.order is None and runs["none"]._binding.order is None
    # the first step's gradients; then losses, which Adam's steps on gradients near zero
    # (their sign decides a whole step) may move apart at rounding level
    first = {k: tr.step() for k, tr in runs.items()}
    for k in ("off", "none", "dense"):
        assert abs(first[k] - first["rows"]) <= 1e-5 * abs(first["rows"])
        for p, v in runs[k].gradients().items():
            assert rel_err(v, runs["rows"].gradients()[p]) <= 1e-4, (k, p)
    losses = {k: [tr.step() for _ in range(3)] for k, tr in runs.items()}
    for k in ("off", "none", "dense"):
        np.testing.assert_allclose(losses[k], losses["rows"], rtol=1e-4)


def test_feeding_another_mask_numbers_its_rows_first():
    """A mask with a node past the bound loss rows binds again with that mask's nodes
    first; the same mask keeps the binding."""
    g = labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=6, seed=6), 3, 0.3)
    m = models.build("sage", 6, hidden=8, out_channels=3, layers=2, seed=1)
    tr = Trainer(compile_model(m, train=True), g, formats="csr")
    ex, b = tr.train_ex, tr._binding
    feeds = {"x": g.x, "labels": g.y.astype(np.int32),
             "train_mask": tr.train_mask.astype(np.float32)}
    assert ex.feed(b, feeds) is b
    other = ~tr.train_mask
    b2 = ex.feed(b, {**feeds, "train_mask": other.astype(np.float32)})
    assert b2 is not b and b2.dims["L"] == int(other.sum())
    assert other[b2.order[:b2.dims["L"]]].all()
    params = tr.parameters()
    ex.execute(b2)
    loss = float(b2.buffers[tr.artifact.train_plan.loss].numpy())
    ref_loss, _ = reference(m, g, params, other)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)


def test_rcm_tried_for_the_band_still_numbers_the_mask_first(monkeypatch):
    """Where the cost model tries RCM for the banded format and CSR wins anyway (forced
    here: which wins follows the machine's calibration), the mask's nodes are numbered
    first in the RCM order and the loss rows apply."""
    import gcomp.runtime.executor as executor
    g = labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=6, seed=6), 3, 0.3)
    m = models.build("sage", 6, hidden=8, out_channels=3, layers=2, seed=1)
    plan = compile_model(m, train=True).train_plan
    choose = executor.fmts.choose

    def csr_wins(*args, **kwargs):
        chosen, report = choose(*args, **kwargs)
        return {k: "csr" for k in chosen}, report

    monkeypatch.setattr(executor.fmts, "band_would_pay", lambda report, mode: True)
    monkeypatch.setattr(executor.fmts, "choose", csr_wins)
    lay = executor.decide_layout(plan, g, loss_rows=g.train_mask)
    assert lay.reorder["chosen"] == "rcm" and set(lay.chosen.values()) == {"csr"}
    count = int(g.train_mask.sum())
    assert lay.sizes["L"] == lay.reorder["loss_rows"] == count < g.num_nodes
    assert g.train_mask[lay.order[:count]].all()
    rcm = executor.rcm_order(g)  # each part keeps RCM's order
    assert (lay.order[:count] == rcm[g.train_mask[rcm]]).all()


@pytest.mark.parametrize("name", ["sage", "gcn"])
def test_bf16_on_the_loss_rows(name):
    """bfloat16 activations (Mixed precision), GraphSAGE's loss gradient zeroed past L by
    the tail kernel in bfloat16: a step on the loss rows gives the step on every row (the
    same bfloat16 kernels; the sums differ only in their order)."""
    g = labelled(awkward_graph(num_nodes=80, num_edges=400, num_features=8, seed=9), 3, 0.5)
    m = models.build(name, 8, hidden=16, out_channels=3, layers=3, seed=2)
    art = compile_model(m, train=True, precision="bf16")
    rows = Trainer(art, g, formats="csr")
    every = Trainer(art, g, formats="csr", loss_rows=False)
    assert rows._binding.dims["L"] == int(rows.train_mask.sum())
    assert any(s.get("rows") for s in rows._binding.plan_steps)
    assert any(s.get("tail") for s in rows._binding.plan_steps) == (name == "sage")
    for _ in range(3):
        a, b = rows.step(), every.step()
        assert abs(a - b) <= 1e-3 * abs(b)
        for k, v in every.gradients().items():
            assert rel_err(rows.gradients()[k], v) <= 2e-2, k
