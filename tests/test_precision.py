"""--precision bf16: node-sized activations stored as bfloat16, arithmetic in float32."""

import numpy as np
import pytest
from conftest import ref_inputs, rel_err

import gcomp.models as models
from gcomp.codegen.build import make_target
from gcomp.codegen.kernels import KernelSpec, define, param_dtypes
from gcomp.codegen.optimizer import OptimizerConfig
from gcomp.codegen.precision import _accumulated
from gcomp.compiler import compile_model
from gcomp.errors import CompileError
from gcomp.ir import interpret
from gcomp.runtime.data import load_graph
from gcomp.runtime.synthetic import synthetic_graph



def _stored(plan) -> set:
    return {n for n, b in plan.buffers.items() if b["dtype"] == "bfloat16"}


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat", "ggnn"])
def test_inference_within_bfloat16_rounding_of_the_float64_reference(name):
    """Outputs stay float32 and within bfloat16's rounding (8 bits of mantissa, 3.9e-3
    per value stored) of the float64 interpreter; far from float32's agreement, which
    shows the activations really are stored in 16 bits."""
    g = synthetic_graph(2000, 16000, 24, 5, seed=2)
    m = models.build(name, 24, hidden=32, out_channels=5, layers=3, heads=2, seed=0)
    art = compile_model(m, precision="bf16")
    assert _stored(art.plan), "no activation is stored as bfloat16"
    assert art.info()["precision"] == "bf16"
    out = art.run(g)[0]
    assert out.dtype == np.float32
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    err = rel_err(out, ref)
    assert 1e-4 < err < 3e-2, err
    assert rel_err(compile_model(m).run(g)[0], ref) < 1e-5


def test_parameters_inputs_outputs_and_optimizer_state_stay_float32():
    m = models.build("gcn", 24, hidden=32, out_channels=5, layers=3)
    art = compile_model(m, train=True, optimizer=OptimizerConfig(name="adam", lr=0.01),
                        precision="bf16")
    p = art.train_plan
    stored = _stored(p)
    kept = (set(p.params) | set(p.state) | set(p.grads.values()) | {p.loss}
            | {i["name"] for i in p.inputs} | {o["buffer"] for o in p.outputs})
    assert stored and not stored & kept
    assert all(p.buffers[n]["dims"][0] == "N" for n in stored)


def test_planned_memory_shrinks():
    from gcomp.runtime.memory import plan_memory
    m = models.build("gcn", 128, hidden=32, out_channels=40, layers=3)
    opt = OptimizerConfig(name="adam", lr=0.01)
    sizes = {"N": 100_000, "E:edge_index": 1_000_000}
    fp32 = compile_model(m, train=True, optimizer=opt).train_plan
    bf16 = compile_model(m, train=True, optimizer=opt, precision="bf16").train_plan
    sizes.update({d: 1_100_000 for p in (fp32, bf16) for b in p.buffers.values()
                  for d in b["dims"] if isinstance(d, str) and d.startswith("E:")})
    a, b = plan_memory(fp32, sizes).live_peak_bytes, plan_memory(bf16, sizes).live_peak_bytes
    # 54.8 -> 51.2 MB (67.2 -> 51.2 before fuse_bias_grads: the last layer's dY [N, 40]
    # now ends at its weight gradient, which also computes its bias's column sums)
    assert b < 0.95 * a, (a, b)


def test_memory_preferred_reads_the_float32_features_without_a_bfloat16_copy():
    """``--prefer memory``: no bfloat16 copy of the features lives through the binding
    (the products reading them read the caller's float32 rows, and on a CPU with
    bfloat16 dot products round them as they read them, where the default build gives
    such a CPU, or one with tiles, a copy); the training
    step's gradients stay within bfloat16 rounding of the float32 build's."""
    from gcomp.passes import PassContext
    from gcomp.runtime.trainer import Trainer
    g = synthetic_graph(2000, 16000, 24, 5, seed=2)
    m = models.build("gin", 24, hidden=32, out_channels=5, layers=3, seed=0)
    opt = OptimizerConfig(name="adam", lr=0.01)
    art = compile_model(m, train=True, optimizer=opt, precision="bf16",
                        ctx=PassContext(options={"prefer": "memory"}))
    for plan in (art.plan, art.train_plan):
        assert _stored(plan) and "x.bf16" not in plan.buffers
        assert not any(s["op"] == "round_rows" for s in plan.feed_steps)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert 1e-4 < rel_err(art.run(g)[0], ref) < 3e-2
    fp32 = Trainer(compile_model(m, train=True, optimizer=opt), g)
    bf16 = Trainer(art, g)
    loss, want_loss = bf16.step(), fp32.step()
    assert abs(loss - want_loss) < 3e-2 * abs(want_loss)
    want = fp32.gradients()
    for name, grad in bf16.gradients().items():
        assert rel_err(grad, want[name]) < 5e-2, name


def test_training_on_cora_matches_float32_accuracy():
    """200 epochs of GCN on Cora: bfloat16 activations reach float32's test accuracy
    (within 2 points) with float32 weights and Adam."""
    from gcomp.runtime.trainer import Trainer
    g = load_graph("cora")
    m = models.build("gcn", g.num_features, hidden=16, out_channels=7, layers=2, seed=0)
    acc = {}
    for precision in ("fp32", "bf16"):
        art = compile_model(m, train=True, optimizer=OptimizerConfig(
            name="adam", lr=0.01, weight_decay=5e-4), precision=precision)
        tr = Trainer(art, g)
        for _ in range(200):
            tr.step()
        acc[precision] = tr.evaluate()["test_acc"]
    assert acc["fp32"] > 0.75
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.02, acc


def test_a_kernel_that_adds_into_its_output_keeps_it_float32():
    """The check behind the demotion: csr_agg sums a bfloat16 output in a float32 row
    (its output is stored once); a reading of the output in the kernel is found."""
    spec = KernelSpec.make("csr_agg", reduce="sum", H=1, C=16, weight="edge",
                           bf16=("out", "x"))
    llvm = make_target("llvm")
    func = define(spec, llvm)
    assert param_dtypes(func)["out"] == "bfloat16"
    assert _accumulated(func) == set()
    # the cross-entropy kernel reads back the log-sum-exp it writes: lse stays float32
    ce = KernelSpec.make("cross_entropy", C=40, bf16=("lse", "z"))
    assert _accumulated(define(ce, llvm)) == {"lse"}
    # a generic product's reduction output is float32 only: refused, not miscompiled
    with pytest.raises(CompileError, match="cannot be stored as bfloat16"):
        define(KernelSpec.make("matmul", K=8, M=8, bf16=("matmul",)))


def test_unknown_precision_is_refused():
    m = models.build("gcn", 8, hidden=8, out_channels=2, layers=2)
    with pytest.raises(CompileError, match="unknown precision 'fp8'"):
        compile_model(m, precision="fp8")


def test_distributed_training_refuses_bfloat16_artifacts():
    from gcomp.distributed.halo import Comm, DistributedError
    from gcomp.distributed.trainer import DistributedTrainer
    g = synthetic_graph(200, 1000, 8, 3, seed=0)
    m = models.build("gcn", 8, hidden=8, out_channels=3, layers=2)
    art = compile_model(m, train=True, precision="bf16")
    with pytest.raises(DistributedError, match="--precision bf16"):
        DistributedTrainer(art, g, comm=Comm())


def test_cuda_judges_the_scheduled_gpu_forms():
    """On CUDA the pass judges each kernel as scheduled for the GPU: the split aggregation
    sums in a float32 register (its bfloat16 output is stored once), the plain one in a
    register copy of its output (a bfloat16 register: it keeps the output float32); a
    decision made for one target is not reused for another."""
    from gcomp.codegen.precision import _accepted
    cuda, llvm = make_target("cuda"), make_target("llvm")
    names = frozenset({"x", "out"})
    split = KernelSpec.make("csr_agg", reduce="sum", H=1, C=16, weight="none", split=True)
    plain = KernelSpec.make("csr_agg", reduce="sum", H=1, C=16, weight="none")
    assert _accepted(split, names, cuda) == names
    assert _accepted(plain, names, cuda) == {"x"}
    assert _accepted(plain, names, llvm) == names  # the CPU's rows sum in float32 vectors


@pytest.mark.parametrize("force", [None, True, False])
def test_values_a_variant_measures_are_stored_as_bfloat16_too(force):
    """GraphSAGE's mean of the input features (training plan) is computed once per feed
    and its sparsity picks a kernel variant: stored as bfloat16, it is measured and
    matched (its ``match_kernel`` reads bfloat16); with either variant the loss stays
    within bfloat16 rounding of the float32 artifact's, and features fed later are
    picked up."""
    from conftest import awkward_graph
    from gcomp.runtime.executor import Executor
    from gcomp.runtime.trainer import OPT_STEP
    g = awkward_graph(num_nodes=90, num_edges=500, num_features=16, seed=5)
    x = g.dense_x()
    x[np.random.default_rng(1).random(x.shape) < 0.97] = 0.0
    m = models.build("sage", 16, hidden=8, out_channels=3, layers=2)
    arts = {p: compile_model(m, train=True, sparse_threshold=0.5, precision=p)
            for p in ("fp32", "bf16")}
    plan = arts["bf16"].train_plan
    computed = [k for k, v in plan.variants.items() if "sources" in v]
    assert computed and all(plan.buffers[plan.variants[k]["input"]]["dtype"] == "bfloat16"
                            for k in computed)
    y = (np.arange(90) % 3).astype(np.int32)
    exs, bound = {}, {}
    for p, art in arts.items():
        exs[p] = Executor(art.train_plan, art.library(), art.params)
        if force is not None:
            exs[p].force_variants = {k: force for k in computed}
        bound[p] = exs[p].bind(g, {"x": x})
    if force is not False:
        assert set(computed) <= bound["bf16"].variants
    for x_fed in (x, np.where(x != 0, x * 3.0, 0.0).astype(np.float32)):  # then moved values
        losses = {}
        for p, ex in exs.items():
            b = ex.feed(bound[p], {"x": x_fed, "labels": y,
                                   "train_mask": np.ones(90, np.float32)})
            ex.set(OPT_STEP, 1)
            ex.execute(b)
            losses[p] = float(b.buffers[arts[p].train_plan.loss].numpy())
        assert abs(losses["bf16"] - losses["fp32"]) <= 3e-2 * abs(losses["fp32"]), losses


def test_explain_lists_what_is_stored_in_bfloat16_and_why_the_rest_is_not():
    from gcomp.debug.explain import explain, render
    m = models.build("gcn", 24, hidden=32, out_channels=5, layers=3)
    art = compile_model(m, train=True, precision="bf16")
    report = explain(art.graphs["training"], {"inference": art.plan, "training": art.train_plan})
    p = report["precision"]["training"]
    assert set(p["bfloat16"]) == _stored(art.train_plan)
    assert "sym_norm" in p["kept_float32"]["convs.0.sym_norm.deg"]
    assert p["bytes_per_node_saved"] == sum(
        2 * int(np.prod(art.train_plan.buffers[b]["dims"][1:])) for b in p["bfloat16"])
    assert "storage (training):" in render(report)
    fp32 = compile_model(m, train=True)
    assert "precision" not in explain(fp32.graphs["training"], {"training": fp32.train_plan})


def test_cli_compiles_saves_and_trains_a_bfloat16_artifact(tmp_path, capsys):
    import json

    from gcomp.cli import main
    art = tmp_path / "gcn16.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--hidden", "16", "--out", "7", "--train",
                 "--precision", "bf16", "-o", str(art)]) == 0
    capsys.readouterr()
    assert main(["info", str(art), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"
    assert main(["train", str(art), "--graph", "cora", "--epochs", "30", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["train_acc"] > 0.9 and np.isfinite(res["final_loss"])
