"""Every bundled model on a CUDA GPU: forward against the float64 reference interpreter,
one training step (loss, gradients, updated parameters) against the interpreter and the
CPU build.  Skipped without a CUDA device (``tests/gpu/conftest.py``)."""

import numpy as np
import pytest
from conftest import awkward_graph, ref_inputs, rel_err

import gcomp.models as models
from gcomp.compiler import compile_model
from gcomp.ir import RefGraph, interpret
from gcomp.passes import training_pipeline
from gcomp.runtime.synthetic import synthetic_graph
from gcomp.runtime.trainer import Trainer

MODELS = ["gcn", "sage", "gin", "gat"]


def check_forward(model, graph, tol=1e-4):
    art = compile_model(model, "cuda")
    ex = art.executor()
    assert ex.device.dlpack_device_type() == 2  # kDLCUDA: buffers and kernels on the GPU
    out = art.run(graph)[0]
    ref = interpret(model.graph, ref_inputs(model.graph, graph), model.params)[0]
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    again = art.run(graph)[0]  # the cached binding: same buffers, same answer, bit for bit
    assert np.array_equal(out, again)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_awkward_graphs(name, seed):
    g = awkward_graph(num_nodes=80, num_edges=500, num_features=12, seed=seed)
    m = models.build(name, 12, hidden=8, out_channels=5, layers=3, heads=3, seed=seed)
    check_forward(m, g)


@pytest.mark.parametrize("name", MODELS)
def test_forward_power_law_graph(name):
    g = synthetic_graph(20000, 300000, 64, 7, seed=3)  # hub rows, features wider than a warp
    m = models.build(name, 64, hidden=48, out_channels=7, layers=2, heads=2)
    check_forward(m, g)


@pytest.mark.parametrize("name", MODELS)
def test_forward_graph_without_edges(name):
    g = awkward_graph(num_nodes=10, num_edges=20, num_features=4)
    g.edge_index = np.zeros((2, 0), np.int64)  # empty edge tensors: those launches are skipped
    m = models.build(name, 4, hidden=4, out_channels=2, layers=2, heads=2)
    check_forward(m, g)


def labelled(g, C, seed=0):
    rng = np.random.default_rng(seed)
    g.y = rng.integers(0, C, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < 0.7
    g.val_mask = ~g.train_mask
    g.test_mask = ~g.train_mask
    return g


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("name", MODELS)
def test_training_step(name, dropout, tol=1e-4):
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=6, seed=3), 3)
    m = models.build(name, 6, hidden=8, out_channels=3, layers=3, heads=2, dropout=dropout,
                     seed=1)
    gpu = Trainer(compile_model(m, "cuda", train=True), g, seed=2)
    cpu = Trainer(compile_model(m, "llvm", train=True), g, seed=2)
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
    for pname, ref in zip(tg.meta["grads"], outs[1:]):
        assert rel_err(grads[pname], ref) <= tol, (pname, rel_err(grads[pname], ref))
    # and the CPU build after the same step: loss, gradients, updated parameters
    assert abs(cpu.step() - loss) <= tol * abs(loss)
    for k, v in cpu.parameters().items():
        assert rel_err(gpu.parameters()[k], v) <= tol, k
    for _ in range(5):  # a few more steps stay finite and close
        lg, lc = gpu.step(), cpu.step()
        assert np.isfinite(lg) and abs(lg - lc) <= 1e-3 * abs(lc)
    ev = gpu.evaluate()
    assert np.isfinite(ev["loss"])


def test_cli_train_on_gpu(tmp_path, capsys):
    import json

    from gcomp.cli import main
    assert main(["train", "gcn", "--graph", "cora", "--epochs", "20", "-t", "cuda",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["epochs"] == 20 and np.isfinite(result["final_loss"])
    assert result["train_acc"] > 0.3  # 7 classes: chance is 0.14
