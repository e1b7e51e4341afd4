"""Every bundled model on a CUDA GPU: forward against the float64 reference interpreter,
one training step (loss, gradients, updated parameters) against the interpreter and the
CPU build; every PyG export of the ONNX corpus: forward against the interpreter and
PyG.  Skipped without a CUDA device; the artifacts may be compiled elsewhere
(``tests/gpu/conftest.py``)."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err
from corpus import CORPUS, FIX, STEMS, fixed_graph

import gcomp.models as models
from gcomp.debug.compare import compare_forward, compare_training_step
from gcomp.ir import RefGraph, interpret
from gcomp.passes import training_pipeline
from gcomp.runtime.synthetic import synthetic_graph
from gcomp.runtime.trainer import Trainer

MODELS = ["gcn", "sage", "gin", "gat", "ggnn"]


def build_model(name: str, features: int, hidden: int, **kw):
    """A bundled model; GGNN's hidden width at least the features it pads to it."""
    if name == "ggnn":
        hidden = max(hidden, features)
    return models.build(name, features, hidden=hidden, **kw)


def first_difference(rows) -> str:
    """The first kernel whose output differs between the CUDA and the CPU build."""
    bad = next((r for r in rows if not r["ok"]), None)
    return ("no kernel output differs" if bad is None else
            f"first differing kernel: {bad['kernel']} writing {bad['buffer']} {bad['shape']} "
            f"(rel err {bad['rel_err']:.2e}; CPU kernel {bad['other_kernel']})")


def check_forward(build, model, graph, tol=1e-4):
    art, cpu_art = build(model, "cuda", "llvm")
    ex = art.executor()
    assert ex.device.dlpack_device_type() == 2  # kDLCUDA: buffers and kernels on the GPU
    out = art.run(graph)[0]
    ref = interpret(model.graph, ref_inputs(model.graph, graph), model.params)[0]
    assert out.shape == ref.shape
    err = rel_err(out, ref)
    assert err <= tol, (err, first_difference(compare_forward(art, cpu_art, graph)))
    again = art.run(graph)[0]  # the cached binding: same buffers, same answer, bit for bit
    assert np.array_equal(out, again)
    return out


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_awkward_graphs(build, name, seed):
    g = awkward_graph(num_nodes=80, num_edges=500, num_features=12, seed=seed)
    m = build_model(name, 12, 8, out_channels=5, layers=3, heads=3, seed=seed)
    check_forward(build, m, g)


@pytest.mark.parametrize("name", MODELS)
def test_forward_power_law_graph(build, name):
    g = synthetic_graph(20000, 300000, 64, 7, seed=3)  # hub rows, features wider than a warp
    m = build_model(name, 64, 48, out_channels=7, layers=2, heads=2)
    check_forward(build, m, g)


@pytest.mark.parametrize("name", MODELS)
def test_forward_graph_without_edges(build, name):
    g = awkward_graph(num_nodes=10, num_edges=20, num_features=4)
    g.edge_index = np.zeros((2, 0), np.int64)  # empty edge tensors: those launches are skipped
    m = build_model(name, 4, 4, out_channels=2, layers=2, heads=2)
    check_forward(build, m, g)


@pytest.mark.parametrize("stem", STEMS)
def test_forward_onnx_exports(build, stem):
    """Every PyG export of the ONNX corpus: forward on the corpus's fixed graph against the
    interpreter, and against the output PyG itself computed there."""
    from gcomp.frontend.onnx import import_onnx
    out = check_forward(build, import_onnx(CORPUS / f"{stem}.onnx"), fixed_graph(stem))
    assert rel_err(out, FIX[f"out.{stem}"]) <= 1e-4


def labelled(g, C, seed=0):
    rng = np.random.default_rng(seed)
    g.y = rng.integers(0, C, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < 0.7
    g.val_mask = ~g.train_mask
    g.test_mask = ~g.train_mask
    return g


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("name", MODELS)
def test_training_step(build, name, dropout, tol=1e-4):
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=6, seed=3), 3)
    m = build_model(name, 6, 8, out_channels=3, layers=3, heads=2, dropout=dropout, seed=1)
    gpu_art, cpu_art = build(m, "cuda", "llvm", train=True)
    gpu, cpu = Trainer(gpu_art, g, seed=2), Trainer(cpu_art, g, seed=2)
    assert gpu.train_ex.device.dlpack_device_type() == 2
    params0 = gpu.parameters()
    loss = gpu.step()
    # the interpreter, float64, on the same inputs (dropout masks come from the step counter)
    tg = training_pipeline()(m.graph.copy())
    inputs = {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
              "labels": g.y, "train_mask": gpu.train_mask.astype(np.float64),
              "rng_step": (1 + 2 * 1_000_003) % (1 << 31)}
    outs = interpret(tg, {k: v for k, v in inputs.items() if tg.has(k)}, params0)
    assert abs(loss - outs[0]) <= tol * abs(outs[0])
    grads = gpu.gradients()
    wrong = {p: rel_err(grads[p], ref) for p, ref in zip(tg.meta["grads"], outs[1:])
             if rel_err(grads[p], ref) > tol}
    assert not wrong, (wrong, first_difference(compare_training_step(gpu_art, cpu_art, g, seed=2)))
    # and the CPU build after the same step: loss, gradients, updated parameters
    assert abs(cpu.step() - loss) <= tol * abs(loss)
    for k, v in cpu.parameters().items():
        assert rel_err(gpu.parameters()[k], v) <= tol, k
    for _ in range(5):  # a few more steps stay finite and close
        lg, lc = gpu.step(), cpu.step()
        assert np.isfinite(lg) and abs(lg - lc) <= 1e-3 * abs(lc)
    ev = gpu.evaluate()
    assert np.isfinite(ev["loss"])


@pytest.mark.parametrize("name", MODELS)
def test_training_step_with_hub_rows(build, name):
    """A training step on a graph whose rows of in-edges and of out-edges exceed
    ``graph.task_edges``: the hub tasks of every aggregation and of GAT's attention (forward,
    both backward halves, with dropout) against the CPU build: loss, gradients, updated
    parameters."""
    from gcomp.runtime.graph import task_edges
    g = synthetic_graph(3000, 40000, 16, 4, seed=5)
    for side in (0, 1):
        deg = np.bincount(g.edge_index[side], minlength=g.num_nodes)
        assert (deg > task_edges(np.concatenate([[0], np.cumsum(deg)]))).sum() > 10
    m = build_model(name, 16, 32, out_channels=4, layers=2, heads=4, dropout=0.2, seed=1)
    gpu_art, cpu_art = build(m, "cuda", "llvm", train=True)
    gpu, cpu = Trainer(gpu_art, g, seed=2), Trainer(cpu_art, g, seed=2)
    lg, lc = gpu.step(), cpu.step()
    grads, ref = gpu.gradients(), cpu.gradients()
    wrong = {p: rel_err(grads[p], ref[p]) for p in ref if rel_err(grads[p], ref[p]) > 1e-4}
    assert abs(lg - lc) <= 1e-4 * abs(lc) and not wrong, (
        lg, lc, wrong, first_difference(compare_training_step(gpu_art, cpu_art, g, seed=2)))
    # Adam's first step moves each parameter by about lr * sign(gradient): an element whose
    # gradient is at float32 rounding level (GGNN's GRU biases have one of 5e-8, 1e-6 of
    # the largest) may move either way in another summation order, so it is left out
    for k, v in cpu.parameters().items():
        mag = np.abs(ref[k])
        clear = mag > 1e-4 * mag.max()
        assert rel_err(gpu.parameters()[k][clear], v[clear]) <= 1e-4, k


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "ggnn"])
def test_training_step_with_atomic_scatters(build, name):
    """``--prefer memory``: the backward aggregations scatter over the forward CSR with
    atomic adds (hub tasks included), against the CPU build on a graph with hub rows.
    Both come from one ``build`` call: in prepare mode the call skips the test, so a
    second call never ran and the GPU host lacked the CPU artifact."""
    g = synthetic_graph(3000, 40000, 16, 4, seed=5)
    m = build_model(name, 16, 32, out_channels=4, layers=2, dropout=0.2, seed=1)
    gpu_art, cpu_art = build(m, "cuda", "llvm", train=True, options={"prefer": "memory"})
    assert any(k.startswith("gc_csr_scatter_") for k in gpu_art.kernels())
    gpu, cpu = Trainer(gpu_art, g, seed=2), Trainer(cpu_art, g, seed=2)
    lg, lc = gpu.step(), cpu.step()
    grads, ref = gpu.gradients(), cpu.gradients()
    wrong = {p: rel_err(grads[p], ref[p]) for p in ref if rel_err(grads[p], ref[p]) > 1e-4}
    assert abs(lg - lc) <= 1e-4 * abs(lc) and not wrong, (lg, lc, wrong)


@pytest.mark.parametrize("name", MODELS)
def test_cuda_graph_replay_matches_eager_steps(build, name):
    """Executor.cuda_graphs: the steps after the first replayed as one CUDA graph give the
    eager launches' losses and parameters bit for bit (the same kernels in the same
    order), dropout's step counter and Adam's included; inference likewise."""
    g = labelled(awkward_graph(num_nodes=300, num_edges=3000, num_features=6, seed=3), 3)
    m = build_model(name, 6, 8, out_channels=3, layers=3, heads=2, dropout=0.3, seed=1)
    (art,) = build(m, "cuda", train=True)
    eager, replay = Trainer(art, g, seed=2), Trainer(art, g, seed=2)
    replay.train_ex.cuda_graphs = True
    for _ in range(4):
        assert replay.step() == eager.step()
    assert replay._binding.cuda_graph is not None and eager._binding.cuda_graph is None
    for k, v in eager.parameters().items():
        np.testing.assert_array_equal(replay.parameters()[k], v, err_msg=k)
    ex = art.executor()
    ex.cuda_graphs = True
    first = ex.run(g)[0]
    assert np.array_equal(ex.run(g)[0], first) and np.array_equal(ex.run(g)[0], first)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_forward_and_training_step(build, name):
    """--precision bf16 on the GPU (checked so far in the CUDA emulator only,
    tests/test_cuda_emulated.py): the forward pass within bfloat16's rounding of the
    float64 interpreter; a training step's loss within it of the float32 CPU build's."""
    g = labelled(awkward_graph(num_nodes=300, num_edges=3000, num_features=12, seed=4), 3)
    m = build_model(name, 12, 16, out_channels=3, layers=3, heads=2, seed=1)
    gpu_art, cpu_art = build(m, "cuda", "llvm", train=True, precision="bf16")
    assert gpu_art.train_plan.precision["bfloat16"]
    out = gpu_art.run(g)[0]
    err = rel_err(out, interpret(m.graph, ref_inputs(m.graph, g), m.params)[0])
    assert 1e-4 < err < 3e-2, err
    lg, lc = Trainer(gpu_art, g, seed=2).step(), Trainer(cpu_art, g, seed=2).step()
    assert abs(lg - lc) <= 3e-2 * abs(lc)


def test_cli_train_on_gpu(capsys, artifact_mode):
    import json

    from gcomp.cli import main
    mode, where = artifact_mode
    model = ["gcn", "-t", "cuda"]
    if mode == "prepare":  # compile the artifact `gcomp train` runs on the GPU host
        out = where / "cli-gcn-train.gcomp"
        assert main(["compile", "gcn", "-t", "cuda", "--train", "-o", str(out)]) == 0
        pytest.skip(f"prepared {out.name}")
    if mode == "load":
        model = [str(where / "cli-gcn-train.gcomp")]
    assert main(["train", *model, "--graph", "cora", "--epochs", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["epochs"] == 20 and np.isfinite(result["final_loss"])
    assert result["train_acc"] > 0.3  # 7 classes: chance is 0.14
