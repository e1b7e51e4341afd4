"""Compiled training: gradients equal the interpreter and PyG, Adam and SGD follow torch,
checkpoints resume exactly, the CLI reports what it promises."""

import json
import os
import re

import numpy as np
import pytest
from conftest import awkward_graph, rel_err
from test_autodiff import OPS, Fn

import gcomp.models as models
from gcomp.cli import main
from gcomp.codegen.optimizer import OptimizerConfig
from gcomp.compiler import compile_model
from gcomp.errors import ArtifactError, GcompError, InputError
from gcomp.frontend.builder import GraphInput, NodeInput, trace
from gcomp.ir import RefGraph, interpret
from gcomp.passes import training_pipeline
from gcomp.runtime.data import GraphData, load_graph
from gcomp.runtime.trainer import Trainer


def labelled(g: GraphData, C: int, seed=0) -> GraphData:
    rng = np.random.default_rng(seed)
    g.y = rng.integers(0, C, g.num_nodes)
    g.train_mask = rng.random(g.num_nodes) < 0.7
    g.val_mask = ~g.train_mask
    g.test_mask = ~g.train_mask
    return g


def compiled_vs_interpreted(model, g, C, seed=0, tol=1e-4, ctx=None, sparse_threshold=None,
                            **trainer_options):
    """One training step's loss and gradients against the float64 interpreter; returns
    the trainer (``ctx``, ``sparse_threshold``: the compiler's; ``trainer_options``: e.g.
    ``formats``)."""
    art = compile_model(model, train=True, ctx=ctx, sparse_threshold=sparse_threshold)
    tr = Trainer(art, g, seed=seed, **trainer_options)
    params0 = tr.parameters()
    loss = tr.step()
    tg = training_pipeline()(model.graph.copy())
    inputs = {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
              "labels": g.y, "train_mask": tr.train_mask.astype(np.float64),
              "rng_step": (1 + seed * 1_000_003) % (1 << 31)}
    outs = interpret(tg, {k: v for k, v in inputs.items() if tg.has(k)}, params0)
    assert abs(loss - outs[0]) <= tol * abs(outs[0])
    grads = tr.gradients()
    for name, ref in zip(tg.meta["grads"], outs[1:]):
        assert rel_err(grads[name], ref) <= tol, (name, rel_err(grads[name], ref))
    return tr


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_model_gradients_equal_the_interpreter(name):
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=6, seed=3), 3)
    m = models.build(name, 6, hidden=8, out_channels=3, layers=3, heads=2, dropout=0.3, seed=1)
    compiled_vs_interpreted(m, g, 3, seed=2)


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_gradients_with_memory_preferred_equal_the_interpreter(name):
    """``--prefer memory``: aggregations of fed values at the narrow width every step, and
    GraphSAGE's and GIN's aggregations that a weight gradient reads computed again in the
    backward pass (rematerialize), ReLU gradients masked by packed signs (pack_relu_masks):
    the same loss and gradients."""
    from gcomp.passes import PassContext
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=6, seed=3), 3)
    m = models.build(name, 6, hidden=8, out_channels=3, layers=3, heads=2, dropout=0.3, seed=1)
    tr = compiled_vs_interpreted(m, g, 3, seed=2,
                                 ctx=PassContext(options={"prefer": "memory"}))
    again = [s for s in tr.artifact.train_plan.steps
             if s["op"] == "aggregate" and ".again" in s["node"]]
    assert bool(again) == (name in ("sage", "gin"))  # not of a dropout's output: not kept
    # the ReLUs, read last by dropout in the forward pass, masked by their packed signs
    masked = [s for s in tr.artifact.train_plan.steps if s["op"] == "mask_bits"]
    assert bool(masked) == (name != "gat")  # GAT's activation is an ELU


@pytest.mark.parametrize("name,hidden,heads", [("gat", 20, 3), ("gat", 5, 2), ("sage", 45, 1),
                                               ("gin", 40, 1)])
def test_wide_and_odd_feature_widths_train_like_the_interpreter(name, hidden, heads):
    """Feature loops of 40 to 135 run in vector chunks plus a tail; 5 channels in scalar
    partial sums (the CPU aggregation and edge-dot kernels)."""
    g = labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=6, seed=4), 3)
    m = models.build(name, 6, hidden=hidden, out_channels=3, layers=2, heads=heads, seed=2)
    compiled_vs_interpreted(m, g, 3, seed=1)


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_gradients_equal_the_interpreter(op):
    g = labelled(awkward_graph(num_nodes=50, num_edges=250, num_features=4, seed=5), 3)
    m = trace(Fn(OPS[op], 4), {"x": NodeInput(4), "edge_index": GraphInput()}, seed=5)
    compiled_vs_interpreted(m, g, 3)


@pytest.mark.parametrize("settings", [dict(momentum=0.9, weight_decay=1e-3),
                                      dict(momentum=0.9, dampening=0.3, weight_decay=1e-3),
                                      dict(momentum=0.9, nesterov=True),
                                      dict(momentum=0.0, dampening=0.5)])
def test_sgd_momentum_follows_torch(settings):
    """SGD's updates are torch.optim.SGD's, fed the same gradients: momentum, dampening
    (ignored without momentum, as torch does), Nesterov, weight decay."""
    torch = pytest.importorskip("torch")
    g = labelled(awkward_graph(num_nodes=40, num_edges=200, num_features=5, seed=1), 3)
    m = models.build("sage", 5, hidden=6, out_channels=3, layers=2)
    cfg = OptimizerConfig(name="sgd", lr=0.05, **settings)
    tr = Trainer(compile_model(m, train=True, optimizer=cfg), g)
    ref = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in m.params.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.05, **settings)
    for _ in range(5):
        tr.step()
        for k, v in ref.items():  # feed our gradients to torch's optimizer
            v.grad = torch.tensor(tr.gradients()[k].astype(np.float64))
        opt.step()
        for k, v in tr.parameters().items():
            assert np.allclose(v, ref[k].detach().numpy(), rtol=1e-5, atol=1e-6), k


def test_nesterov_needs_momentum_and_no_dampening():
    from gcomp.errors import CompileError
    for bad in (dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1)):
        with pytest.raises(CompileError, match="nesterov needs a momentum > 0"):
            OptimizerConfig(name="sgd", **bad)


def test_checkpoint_resume_gives_the_same_losses(tmp_path):
    g = labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=5, seed=2), 3)
    m = models.build("gat", 5, hidden=4, out_channels=3, heads=2, dropout=0.5)
    art = compile_model(m, train=True)
    a = Trainer(art, g, seed=7)
    first = [a.step() for _ in range(5)]
    a.save(tmp_path / "ck.npz")
    rest = [a.step() for _ in range(5)]
    b = Trainer(art, g, seed=0)
    b.load(tmp_path / "ck.npz")
    assert b.step_count == 5
    assert [b.step() for _ in range(5)] == rest
    assert first != rest


def test_resume_on_a_graph_without_masks_keeps_the_split_of_the_seed(tmp_path, capsys):
    """The split of a graph without masks comes from the seed: a checkpoint resumes with
    the seed it was trained with (the CLI takes it from the checkpoint), never silently
    on another split."""
    g = labelled(awkward_graph(num_nodes=60, num_edges=300, num_features=5, seed=2), 3)
    g.train_mask = g.val_mask = g.test_mask = None
    art = compile_model(models.build("gcn", 5, hidden=4, out_channels=3), train=True)
    a = Trainer(art, g, seed=3)
    [a.step() for _ in range(3)]
    a.save(tmp_path / "ck.npz")
    rest = [a.step() for _ in range(3)]
    b = Trainer(art, g, seed=0)
    with pytest.raises(InputError, match="trained with seed 3, which drew its train/val/test"):
        b.load(tmp_path / "ck.npz")
    c = Trainer(art, g, seed=3)
    c.load(tmp_path / "ck.npz")
    assert [c.step() for _ in range(3)] == rest
    # the CLI: --resume without --seed takes the checkpoint's
    path = tmp_path / "g.npz"
    np.savez(path, edge_index=g.edge_index, x=g.x, y=g.y)
    art_path = str(tmp_path / "gcn.gcomp")
    art.save(art_path)

    def final_loss(*extra):
        assert main(["train", art_path, "--graph", str(path), "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])["final_loss"]
    whole = final_loss("--epochs", "6", "--seed", "3")
    final_loss("--epochs", "3", "--seed", "3", "--checkpoint", str(tmp_path / "ck3.npz"))
    assert final_loss("--epochs", "3", "--resume", str(tmp_path / "ck3.npz")) == whole
    assert main(["train", art_path, "--graph", str(path), "--epochs", "1", "--seed", "0",
                 "--resume", str(tmp_path / "ck3.npz")]) == 2
    assert "trained with seed 3" in capsys.readouterr().err


def test_cli_train_writes_nothing_over_its_inputs_and_checks_the_output_first(tmp_path,
                                                                              capsys):
    path = tmp_path / "g.npz"
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    np.savez(path, edge_index=g.edge_index, x=g.x, y=g.y)
    before = path.read_bytes()
    assert main(["train", "gcn", "--graph", str(path), "--epochs", "1",
                 "--checkpoint", str(path)]) == 2
    assert "is an input of this command" in capsys.readouterr().err
    assert path.read_bytes() == before
    art = tmp_path / "gcn.gcomp"
    compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True).save(art)
    art_bytes = art.read_bytes()
    assert main(["train", str(art), "--graph", str(path), "--epochs", "1",
                 "--checkpoint", str(art)]) == 2
    assert art.read_bytes() == art_bytes
    capsys.readouterr()
    assert main(["train", str(art), "--graph", str(path), "--epochs", "1",
                 "--checkpoint", str(tmp_path / "missing" / "ck.npz")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "epochs" not in err  # refused before training


def test_cli_train_json_is_valid_json_without_numbers_to_report(tmp_path, capsys):
    art = tmp_path / "gcn.gcomp"
    compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True).save(art)
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    g.val_mask = np.zeros(30, bool)  # an accuracy over no node
    path = tmp_path / "g.npz"
    np.savez(path, edge_index=g.edge_index, x=g.x, y=g.y, train_mask=g.train_mask,
             val_mask=g.val_mask, test_mask=g.test_mask)
    assert main(["train", str(art), "--graph", str(path), "--epochs", "0", "--json"]) == 0

    def no_nan(c):
        raise AssertionError(f"{c} in the JSON")
    r = json.loads(capsys.readouterr().out.splitlines()[-1], parse_constant=no_nan)
    assert r["final_loss"] is None and r["val_acc"] is None and "best_epoch" not in r
    assert r["test_acc"] is not None

    g.val_mask = ~g.train_mask  # no epoch, so no best one
    np.savez(path, edge_index=g.edge_index, x=g.x, y=g.y, train_mask=g.train_mask,
             val_mask=g.val_mask, test_mask=g.test_mask)
    assert main(["train", str(art), "--graph", str(path), "--epochs", "0", "--json",
                 "--best-val"]) == 0
    r = json.loads(capsys.readouterr().out.splitlines()[-1], parse_constant=no_nan)
    assert r["best_epoch"] is None and r["best_val_acc"] is None and r["val_acc"] is not None


def test_a_checkpoint_replaces_only_a_checkpoint(tmp_path, capsys):
    """--checkpoint naming another file the user has (a model, a graph, an artifact that
    is not an input of this run) is refused before training; an earlier checkpoint is
    replaced."""
    art = tmp_path / "gcn.gcomp"
    compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True).save(art)
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    path = tmp_path / "g.npz"
    np.savez(path, edge_index=g.edge_index, x=g.x, y=g.y, train_mask=g.train_mask)
    other = tmp_path / "other.npz"
    np.savez(other, edge_index=g.edge_index)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"not a checkpoint")
    for victim in (other, model):
        before = victim.read_bytes()
        assert main(["train", str(art), "--graph", str(path), "--epochs", "1",
                     "--checkpoint", str(victim)]) == 2
        assert "exists and is not a gcomp checkpoint" in capsys.readouterr().err
        assert victim.read_bytes() == before
    ck = tmp_path / "ck.npz"
    for _ in range(2):
        assert main(["train", str(art), "--graph", str(path), "--epochs", "1",
                     "--checkpoint", str(ck)]) == 0
    tr = Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True), g)
    with pytest.raises(GcompError, match="not a gcomp checkpoint; refusing to replace it"):
        tr.save(model)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    tr = Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True), g)
    tr.step()
    path = tmp_path / "ck.npz"
    tr.save(path)
    before = path.read_bytes()
    tr.step()

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(GcompError, match="cannot write .*ck.npz.*disk full"):
        tr.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz"]


def test_checkpoint_of_another_model_is_refused(tmp_path):
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    a = Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True), g)
    a.save(tmp_path / "a.npz")
    b = Trainer(compile_model(models.build("gin", 4, hidden=4, out_channels=3), train=True), g)
    with pytest.raises(InputError, match="different compiled model"):
        b.load(tmp_path / "a.npz")
    (tmp_path / "junk.npz").write_bytes(b"junk")
    with pytest.raises(InputError, match="not a readable gcomp checkpoint"):
        b.load(tmp_path / "junk.npz")


def test_checkpoint_resumes_on_the_same_model_compiled_otherwise(tmp_path):
    """Compiling again (for the graph, with another sparse-feature threshold: what other
    thread or rank counts and machines measure differently) keeps checkpoints valid."""
    g = labelled(awkward_graph(num_nodes=40, num_edges=160, num_features=5), 3)
    m = models.build("gcn", 5, hidden=4, out_channels=3)
    a = Trainer(compile_model(m, train=True, graph=g), g)
    a.step()
    a.save(tmp_path / "a.npz")
    b = Trainer(compile_model(m, train=True, sparse_threshold=0.0), g)
    b.load(tmp_path / "a.npz")
    assert b.step_count == 1
    assert all(np.array_equal(a.parameters()[k], b.parameters()[k]) for k in a.parameters())
    assert np.isclose(a.step(), b.step(), rtol=1e-6)


def test_inference_artifact_cannot_train():
    g = labelled(awkward_graph(num_nodes=30, num_edges=100, num_features=4), 3)
    with pytest.raises(ArtifactError, match="compiled for inference"):
        Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3)), g)


def test_cli_train_json(capsys, tmp_path):
    rc = main(["train", "gcn", "--graph", "cora", "--epochs", "3", "--json", "--checkpoint",
               str(tmp_path / "ck.npz")])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("final_loss", "train_acc", "val_acc", "test_acc", "epoch_ms_median",
                "peak_rss_mb"):
        assert isinstance(result[key], float), key
    assert result["epochs"] == 3 and (tmp_path / "ck.npz").exists()
    # compiled for cora (a bundled model is): its formats were fixed then, and are reported
    assert result["formats"] and set(result["formats"].values()) <= {"csr", "ell", "dense",
                                                                      "banded"}
    rc = main(["train", "gcn", "--graph", "cora", "--epochs", "2", "--json", "--resume",
               str(tmp_path / "ck.npz")])
    assert rc == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 5


def test_cli_train_uses_a_weighted_graphs_edge_weights(capsys, tmp_path):
    """``gcomp train gcn`` on a graph file with edge_weight trains the weighted GCN (its
    losses are a --edge-weight artifact's, not the unweighted model's); a model without
    edge weights says it does not use them; an abbreviated flag is not taken for another."""
    g = load_graph("cora")
    w = np.random.default_rng(0).uniform(0.01, 5.0, g.num_edges).astype(np.float32)
    arrays = dict(edge_index=g.edge_index, x=g.dense_x(), y=g.y, train_mask=g.train_mask,
                  val_mask=g.val_mask, test_mask=g.test_mask)
    np.savez(tmp_path / "w.npz", edge_weight=w, **arrays)
    np.savez(tmp_path / "u.npz", **arrays)

    def loss(*argv):
        capsys.readouterr()
        assert main(["train", *argv, "--epochs", "3", "--json"]) == 0
        out = capsys.readouterr()
        return json.loads(out.out.splitlines()[-1])["final_loss"], out.err
    art = tmp_path / "gcn_w.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "--edge-weight",
                 "-o", str(art)]) == 0
    weighted, err = loss("gcn", "--graph", str(tmp_path / "w.npz"))
    assert "not used" not in err
    assert weighted == loss(str(art), "--graph", str(tmp_path / "w.npz"))[0]
    assert weighted != loss("gcn", "--graph", str(tmp_path / "u.npz"))[0]
    assert "takes no edge weights" in loss("sage", "--graph", str(tmp_path / "w.npz"))[1]
    with pytest.raises(SystemExit):
        main(["train", "gcn", "--edge-weight", "--graph", "cora"])
    assert "unrecognized arguments: --edge-weight" in capsys.readouterr().err


def test_cli_train_refuses_best_val_without_validation_and_a_diverged_last_step(
        capsys, tmp_path):
    """--best-val on a graph without validation nodes is an error (it reported the
    untrained model as best); a last update that makes the loss NaN is reported as the
    others are (accuracies of NaN logits were printed), and no checkpoint is written."""
    g = load_graph("cora")
    np.savez(tmp_path / "noval.npz", edge_index=g.edge_index, x=g.dense_x(), y=g.y,
             train_mask=g.train_mask, test_mask=g.test_mask)
    capsys.readouterr()
    assert main(["train", "gcn", "--graph", str(tmp_path / "noval.npz"), "--epochs", "2",
                 "--best-val"]) == 2
    assert "no labelled validation node" in capsys.readouterr().err
    ck = tmp_path / "ck.npz"
    assert main(["train", "gcn", "--graph", "cora", "--epochs", "1", "--optimizer", "sgd",
                 "--lr", "1e30", "--checkpoint", str(ck)]) == 2
    assert "after the last step (epoch 1)" in capsys.readouterr().err and not ck.exists()


def test_cli_train_compiled_artifact_and_errors(capsys, tmp_path):
    art = tmp_path / "gcn.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "--lr", "0.02",
                 "-o", str(art)]) == 0
    assert main(["train", str(art), "--graph", "cora", "--epochs", "2"]) == 0
    p = tmp_path / "nolabels.npz"
    np.savez(p, edge_index=np.array([[0, 1], [1, 0]]), x=np.ones((2, 3), np.float32))
    capsys.readouterr()
    assert main(["train", "gcn", "--graph", str(p), "--epochs", "1"]) == 2
    assert "no labels" in capsys.readouterr().err
    inf = tmp_path / "inf.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "-o", str(inf)]) == 0
    assert main(["train", str(inf), "--graph", "cora", "--epochs", "1"]) == 2
    assert "compiled for inference" in capsys.readouterr().err
    # what the artifact fixed at compile time is refused, not ignored
    for flags in (["--lr", "0.5"], ["--optimizer", "sgd"], ["--hidden", "64"],
                  ["--dropout", "0.3"], ["--precision", "bf16"]):
        assert main(["train", str(art), "--graph", "cora", "--epochs", "1", *flags]) == 2
        assert f"{flags[0]}: '{art}' is compiled" in capsys.readouterr().err
    for flags in (["--save-every", "2"], ["--save-every", "-1", "--checkpoint",
                                          str(tmp_path / "c.npz")]):
        assert main(["train", str(art), "--graph", "cora", "--epochs", "1", *flags]) == 2
        assert "--save-every K writes the --checkpoint" in capsys.readouterr().err
    for cmd in (["train", str(art), "--graph", "cora"], ["compile", "gcn", "-o", str(inf)]):
        with pytest.raises(SystemExit):
            main(cmd + ["--seed", "-3"])
        assert "'-3' is not a non-negative integer" in capsys.readouterr().err
    for flags in (["--parts", "p.npy"], ["--hosts", "2"], ["--partition", "metis"]):
        assert main(["train", str(art), "--graph", "cora", "--epochs", "1", *flags]) == 2
        assert f"{flags[0]}: these split the graph across MPI ranks" in capsys.readouterr().err
    # a truncated checkpoint is named, not a zipfile traceback
    ck = tmp_path / "ck.npz"
    assert main(["train", str(art), "--graph", "cora", "--epochs", "1", "--checkpoint",
                 str(ck)]) == 0
    ck.write_bytes(ck.read_bytes()[: ck.stat().st_size // 2])
    capsys.readouterr()
    assert main(["train", str(art), "--graph", "cora", "--epochs", "1", "--resume", str(ck)]) == 2
    assert "is not a readable gcomp checkpoint (truncated or damaged?)" in capsys.readouterr().err


def test_split_when_the_graph_has_no_masks():
    g = awkward_graph(num_nodes=100, num_edges=300, num_features=4)
    g.y = np.random.default_rng(0).integers(0, 3, 100)
    tr = Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True), g)
    assert tr.train_mask.sum() == 60 and tr.val_mask.sum() == 20 and tr.test_mask.sum() == 20
    assert not (tr.train_mask & tr.val_mask).any()


def test_given_validation_and_test_masks_are_kept_without_a_train_mask():
    """Validation and test masks without a train mask: training takes the labelled nodes in
    neither (a random split would have trained on given test nodes)."""
    g = awkward_graph(num_nodes=100, num_edges=300, num_features=4)
    g.y = np.random.default_rng(0).integers(0, 3, 100)
    g.y[:5] = -1
    rng = np.random.default_rng(1)
    g.val_mask, g.test_mask = rng.random(100) < 0.2, rng.random(100) < 0.3
    tr = Trainer(compile_model(models.build("gcn", 4, hidden=4, out_channels=3), train=True), g)
    assert np.array_equal(tr.val_mask, g.val_mask & (g.y >= 0))
    assert np.array_equal(tr.test_mask, g.test_mask & (g.y >= 0))
    assert np.array_equal(tr.train_mask, ~(g.val_mask | g.test_mask) & (g.y >= 0))


@pytest.mark.parametrize("kind", ["normal", "binary", "sparse-binary", "sparse-negative",
                                  "small-rows"])
def test_normalize_features_is_pygs(kind):
    """``--normalize-features`` against PyG's NormalizeFeatures (the minimum subtracted,
    rows divided by their sum where it exceeds 1): real-valued features, binary ones
    dense and sparse, sparse ones with negative values, rows summing below 1."""
    import scipy.sparse as sp
    torch = pytest.importorskip("torch", reason="PyG comparison needs torch ([bench] extra)")
    T = pytest.importorskip("torch_geometric.transforms", reason="needs PyG ([bench] extra)")
    from torch_geometric.data import Data
    from gcomp.runtime.data import normalize_features
    rng = np.random.default_rng(0)
    x = {"normal": rng.standard_normal((50, 7)),
         "binary": rng.random((50, 7)) < 0.3,
         "sparse-binary": rng.random((50, 7)) < 0.3,
         "sparse-negative": (rng.random((50, 7)) < 0.3) * rng.standard_normal((50, 7)),
         "small-rows": rng.random((50, 7)) * 0.05}[kind].astype(np.float32)
    g = awkward_graph(num_nodes=50, num_edges=100, num_features=7)
    g.x = sp.csr_matrix(x) if kind.startswith("sparse") else x
    got = normalize_features(g).x
    assert sp.issparse(got) == (kind == "sparse-binary")
    ref = T.NormalizeFeatures()(Data(x=torch.from_numpy(x.copy()))).x.numpy()
    got = got.toarray() if sp.issparse(got) else got
    assert got.dtype == np.float32 and np.abs(got - ref).max() <= 1e-6


def test_set_parameters_takes_exact_shapes_and_finite_values():
    """Trainer.set_parameters writes what it is given (the next step's loss is the
    interpreter's with those weights) and refuses, naming the parameter, a transposed
    weight of the right size, a wrong size, NaN, an unknown name or optimizer state, all
    before writing any."""
    from gcomp.errors import InputError
    g = awkward_graph(num_nodes=60, num_edges=200, num_features=5)
    g.y = np.random.default_rng(0).integers(0, 3, 60)
    m = models.build("gcn", 5, hidden=4, out_channels=3)
    tr = Trainer(compile_model(m, train=True), g)
    new = {k: np.random.default_rng(1).standard_normal(v.shape).astype(np.float32)
           for k, v in tr.parameters().items()}
    tr.set_parameters(new)
    assert all(np.array_equal(tr.parameters()[k], v) for k, v in new.items())
    w = "convs.0.lin.weight"
    before = tr.parameters()
    for bad, msg in (({w: new[w].T}, "has shape [5, 4], the value given [4, 5]"),
                     ({w: new[w].ravel()}, "the value given [20]"),
                     ({"convs.0.bias": np.full(4, np.nan)}, "NaN or Inf"),
                     ({"convs.0.bias": new["convs.0.bias"], "nope": 1.0},
                      "'nope' is not a parameter"),
                     ({"opt.m.convs.0.bias": np.zeros(4)}, "is not a parameter")):
        with pytest.raises(InputError, match=re.escape(msg)):
            tr.set_parameters(bad)
    assert all(np.array_equal(tr.parameters()[k], v) for k, v in before.items())


def test_labels_and_masks_as_lists_and_a_bad_seed():
    """A GraphData built in Python with lists for labels, masks and features trains as
    with arrays (reordered too); a negative seed is named, not a numpy traceback."""
    from gcomp.errors import InputError
    from gcomp.runtime.data import GraphData
    g = awkward_graph(num_nodes=60, num_edges=200, num_features=5)
    y = np.random.default_rng(0).integers(0, 3, 60)
    mask = np.random.default_rng(1).random(60) < 0.5
    art = compile_model(models.build("gcn", 5, hidden=4, out_channels=3), train=True)
    listed = GraphData("l", 60, g.edge_index, g.dense_x().tolist(), y=y.tolist(),
                       train_mask=mask.tolist())
    arrays = GraphData("a", 60, g.edge_index, g.dense_x(), y=y, train_mask=mask)
    a, b = (Trainer(art, h, reorder="rcm") for h in (listed, arrays))
    assert a.step() == b.step() and a.step() == b.step()
    for seed in (-1, 1.5, "0"):
        with pytest.raises(InputError, match="seed must be a non-negative integer"):
            Trainer(art, arrays, seed=seed)


def test_citeseer_unlabelled_nodes_never_count():
    g = load_graph("citeseer")
    tr = Trainer(compile_model(models.build("gcn", 3703, hidden=4, out_channels=6), train=True), g)
    for m in (tr.train_mask, tr.val_mask, tr.test_mask):
        assert (g.y[m] >= 0).all()


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("dropout", [0.4, 0.0])
def test_sparse_feature_variant_equals_dense(name, sparse, dropout):
    """Both kernel variants for node features give the interpreter's gradients, with
    dropout and without (then GCN's and SAGE's first aggregation is of the features, once
    per feed, and the sparse variant aggregates the product of X's nonzeros instead)."""
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=9, seed=6), 3)
    g.x[np.random.default_rng(0).random(g.x.shape) < 0.8] = 0.0  # sparse features
    m = models.build(name, 9, hidden=8, out_channels=3, layers=2, heads=2, dropout=dropout,
                     seed=3)
    art = compile_model(m, train=True, sparse_threshold=0.5)
    hoisted = [s for s in art.train_plan.feed_steps if s["op"] == "aggregate"]
    assert bool(hoisted) == (dropout == 0.0 and name in ("gcn", "sage"))
    # GCN's sum: skipped in the sparse variant; SAGE's mean: its own variant, measured
    assert all(s.get("unless") == ("sparse:x" if name == "gcn" else None) for s in hoisted)
    variants = {"sparse:x": sparse}
    variants.update({k: sparse for k in art.train_plan.variants if k != "sparse:x"})
    tr = Trainer(art, g, variants=variants)
    assert tr._binding.variants == (set(art.train_plan.variants) if sparse else set())
    params0 = tr.parameters()
    loss = tr.step()
    tg = training_pipeline()(m.graph.copy())
    inputs = {"x": g.x, "edge_index": RefGraph.from_edge_index(g.edge_index, g.num_nodes),
              "labels": g.y, "train_mask": tr.train_mask.astype(np.float64), "rng_step": 1}
    outs = interpret(tg, {k: v for k, v in inputs.items() if tg.has(k)}, params0)
    assert abs(loss - outs[0]) <= 1e-4 * abs(outs[0])
    for pname, ref in zip(tg.meta["grads"], outs[1:]):
        assert rel_err(tr.gradients()[pname], ref) <= 1e-4, pname


@pytest.mark.parametrize("sparse", [False, True])
def test_memory_preferred_recomputes_the_feature_product_in_both_variants(sparse):
    """``--prefer memory``: GIN's x W, which its eps gradient reads, is computed again in
    the backward pass (dense, or from X's nonzeros in the sparse-feature variant): the
    interpreter's gradients either way."""
    from gcomp.passes import PassContext
    g = labelled(awkward_graph(num_nodes=70, num_edges=400, num_features=9, seed=6), 3)
    g.x[np.random.default_rng(0).random(g.x.shape) < 0.8] = 0.0  # sparse features
    m = models.build("gin", 9, hidden=8, out_channels=3, layers=2, seed=3)
    tr = compiled_vs_interpreted(m, g, 3, ctx=PassContext(options={"prefer": "memory"}),
                                 sparse_threshold=0.5, variants={"sparse:x": sparse})
    assert tr._binding.variants == ({"sparse:x"} if sparse else set())
    assert [s for s in tr.artifact.train_plan.steps if s["node"] == "x.lin.again"]


def test_inference_sparse_variant_and_refeeding():
    g = awkward_graph(num_nodes=60, num_edges=300, num_features=12, seed=2)
    g.x[np.random.default_rng(1).random(g.x.shape) < 0.9] = 0.0
    m = models.build("gcn", 12, hidden=8, out_channels=3)
    art = compile_model(m, sparse_threshold=0.5)
    from conftest import ref_inputs
    ex = art.executor()
    assert rel_err(ex.run(g)[0], interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]) < 1e-4
    assert ex._binding.variants == {"sparse:x"}
    x2 = np.random.default_rng(5).standard_normal(g.x.shape).astype(np.float32)  # dense now
    y2 = ex.run(g, {"x": x2})[0]
    assert rel_err(y2, interpret(m.graph, ref_inputs(m.graph, g, x2), m.params)[0]) < 1e-4


def test_feeding_other_features_returns_the_binding_to_run():
    """Sparse-feature kernels are bound to the features they were chosen for: feeding
    others gives a new binding, and running the superseded one is refused (its inputs
    were never fed) instead of computing from stale features."""
    g = awkward_graph(num_nodes=60, num_edges=300, num_features=12, seed=2)
    g.x[np.random.default_rng(1).random(g.x.shape) < 0.9] = 0.0
    m = models.build("gcn", 12, hidden=8, out_channels=3)
    ex = compile_model(m, sparse_threshold=0.5).executor()
    b = ex.bind(g)
    x2 = np.random.default_rng(5).standard_normal(g.x.shape).astype(np.float32)
    fed = ex.feed(b, {"x": x2})
    assert fed is not b
    with pytest.raises(InputError, match="binding that feed\\(\\) returned"):
        ex.execute(b)
    ex.execute(fed)
    from conftest import ref_inputs
    ref = interpret(m.graph, ref_inputs(m.graph, g, x2), m.params)[0]
    assert rel_err(ex.outputs(fed)[0], ref) < 1e-4


@pytest.mark.parametrize("order", ["rcm", "degree"])
def test_reordered_nodes_give_the_same_training_step(order):
    """Reordering is invisible: same loss, gradients and outputs, dropout included."""
    g = labelled(awkward_graph(num_nodes=80, num_edges=400, num_features=6, seed=8), 3)
    m = models.build("gat", 6, hidden=4, out_channels=3, layers=2, heads=2, dropout=0.3, seed=4)
    art = compile_model(m, train=True)
    a, b = Trainer(art, g, reorder="none"), Trainer(art, g, reorder=order)
    assert b._binding.order is not None and b._binding.reorder["chosen"] == order
    assert not np.array_equal(b._binding.order, np.arange(g.num_nodes))
    for _ in range(3):
        assert abs(a.step() - b.step()) <= 1e-5
    for k, v in a.gradients().items():
        assert rel_err(b.gradients()[k], v) <= 1e-4, k
    assert rel_err(b.logits(), a.logits()) <= 1e-4


def test_auto_order_keeps_small_graphs_as_given():
    """The gather-distance model alone (in CSR; the banded format may renumber a graph to
    narrow its band: tests/test_formats.py; the training mask's nodes go first unless
    ``loss_rows=False``: tests/test_loss_rows.py)."""
    g = labelled(awkward_graph(num_nodes=80, num_edges=400, num_features=6), 3)
    tr = Trainer(compile_model(models.build("gcn", 6, hidden=4, out_channels=3), train=True), g,
                 formats="csr", loss_rows=False)
    assert tr._binding.order is None and tr._binding.reorder["chosen"] == "given"


def test_sparse_kernels_follow_features_changed_in_place():
    """The sparse-feature kernels read the nonzeros extracted when the graph was bound.
    Feeding the same array again after changing it in place (numpy or scipy) is noticed by
    an exact comparison (``match_rows``) and binds again; unchanged, the binding is kept.
    Outputs against the float64 interpreter on the new values."""
    import scipy.sparse as sp
    from conftest import ref_inputs
    g = awkward_graph(num_nodes=60, num_edges=300, num_features=12, seed=2)
    rng = np.random.default_rng(1)
    x = g.dense_x()
    x[rng.random(x.shape) < 0.9] = 0.0
    m = models.build("gcn", 12, hidden=8, out_channels=3)
    ex = compile_model(m, sparse_threshold=0.5).executor()
    for value in (x, sp.csr_matrix(x)):
        b = ex.feed(ex.bind(g, {"x": value}), {"x": value})
        assert b.variants == {"sparse:x"}
        assert ex.feed(b, {"x": value}) is b  # unchanged: no new binding
        # a row other than 3 with zeros and nonzeros
        r = int(np.flatnonzero(x.any(1) & ~x.all(1) & (np.arange(len(x)) != 3))[0])
        j, j2 = int(np.flatnonzero(x[r])[0]), int(np.flatnonzero(x[r] == 0)[0])
        for step in range(1 if sp.issparse(value) else 3):
            if sp.issparse(value):
                value.data *= -2.0
            elif step == 0:
                value[3, 4] = 0.0 if value[3, 4] else 1.5  # one entry, zero <-> nonzero
            elif step == 1:
                value[r, j2], value[r, j] = value[r, j], 0.0  # a nonzero moved: same count
            else:
                value[r, j2] *= 0.5  # a value changed, nothing moved
            b2 = ex.feed(b, {"x": value})
            assert b2 is not b
            ex.execute(b2)
            dense = value.toarray() if sp.issparse(value) else value
            ref = interpret(m.graph, ref_inputs(m.graph, g, dense), m.params)[0]
            assert rel_err(ex.outputs(b2)[0], ref) < 1e-4
            b = b2


def test_sparse_aggregated_features_follow_features_changed_in_place():
    """A training step's mean of the neighbours' X (GraphSAGE), computed once per feed and
    read by sparse kernels when it is sparse enough: after X changes in place and is fed
    again, the step's loss is that of an executor with the same parameters that never saw
    the old X."""
    from gcomp.runtime.executor import Executor
    from gcomp.runtime.trainer import OPT_STEP
    g = labelled(awkward_graph(num_nodes=80, num_edges=200, num_features=16, seed=6), 3)
    x = g.dense_x()
    x[np.random.default_rng(3).random(x.shape) < 0.97] = 0.0
    m = models.build("sage", 16, hidden=8, out_channels=3)
    art = compile_model(m, train=True, sparse_threshold=0.5)
    computed = [k for k, v in art.train_plan.variants.items() if "sources" in v]
    assert computed
    feeds = {"labels": g.y.astype(np.int32), "train_mask": np.ones(80, np.float32), "x": x}

    def loss(ex, b):
        b = ex.feed(b, feeds)
        ex.set(OPT_STEP, 1)
        ex.execute(b)
        return b, float(b.buffers[art.train_plan.loss].numpy())

    def executor(store=None):
        ex = Executor(art.train_plan, art.library(), art.params, store)
        ex.force_variants = {k: True for k in art.train_plan.variants}
        return ex
    ex = executor()
    b, _ = loss(ex, ex.bind(g, {"x": x}))
    assert set(computed) <= b.variants
    x[:] = np.where(x != 0, x * 3.0, 0.0)
    x[5, 7] = 2.0
    kept = {k: ex.tensor(t.numpy()) for k, t in ex.store.items()}  # parameters after one step
    b2, changed = loss(ex, b)
    assert b2 is not b
    fresh = executor(store=kept)
    _, ref = loss(fresh, fresh.bind(g, {"x": x}))
    assert abs(changed - ref) <= 1e-5 * abs(ref)


def test_a_parameter_the_loss_does_not_depend_on_is_left_as_it_is():
    """A head feeding only a second output (an auxiliary read-out) gets no gradient and no
    update, weight decay included, as torch's optimizers skip a parameter whose .grad is
    None; the rest trains step for step as the model without that head."""
    from gcomp.frontend.builder import Linear, Module
    from gcomp.models.gcn import GCNConv

    class OneHead(Module):
        def __init__(self):
            self.conv = GCNConv(6, 3)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    class TwoHeads(OneHead):
        def __init__(self):
            super().__init__()
            self.aux = Linear(6, 2)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index), self.aux(x)

    g = labelled(awkward_graph(num_nodes=50, num_edges=250, num_features=6, seed=4), 3)
    inputs = {"x": NodeInput(6), "edge_index": GraphInput()}
    opt = OptimizerConfig(name="adam", lr=0.05, weight_decay=0.1)
    two = compile_model(trace(TwoHeads(), inputs, seed=1), train=True, optimizer=opt)
    assert two.info()["untrained"] == ["aux.weight", "aux.bias"]
    tr2 = Trainer(two, g, seed=0)
    tr1 = Trainer(compile_model(trace(OneHead(), inputs, seed=2), train=True, optimizer=opt),
                  g, seed=0)
    start = tr2.parameters()
    tr1.set_parameters({k: start[k] for k in ("conv.lin.weight", "conv.bias")})
    for _ in range(3):
        assert abs(tr2.step() - tr1.step()) <= 1e-6
        assert sorted(tr2.gradients()) == ["conv.bias", "conv.lin.weight"]
    after, ref = tr2.parameters(), tr1.parameters()
    for k in ("conv.lin.weight", "conv.bias"):
        assert rel_err(after[k], ref[k]) <= 1e-6 and rel_err(after[k], start[k]) > 1e-3, k
    for k in ("aux.weight", "aux.bias"):
        assert np.array_equal(after[k], start[k]), k


def test_autodiff_skips_a_parameter_of_another_output():
    """The pass on a graph whose loss is one output of several: a parameter feeding only
    another output gets no gradient (the optimizer then leaves it as it is)."""
    from gcomp.frontend.builder import Linear, Module
    from gcomp.models.gcn import GCNConv
    from gcomp.passes import PassManager
    from gcomp.passes.add_loss import AddLoss
    from gcomp.passes.autodiff import Autodiff

    class TwoHeads(Module):
        def __init__(self):
            self.conv, self.aux = GCNConv(6, 3), Linear(6, 2)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index), self.aux(x)

    graph = trace(TwoHeads(), {"x": NodeInput(6), "edge_index": GraphInput()}).graph
    aux = graph.outputs[1]
    PassManager([AddLoss()])(graph)
    graph.set_outputs([graph.outputs[0], aux])
    PassManager([Autodiff()])(graph)
    assert sorted(graph.meta["grads"]) == ["conv.bias", "conv.lin.weight"]
    assert len(graph.outputs) == 3


def test_a_loss_no_parameter_influences_is_refused():
    from gcomp.frontend.builder import Linear, Module

    class Fixed(Module):
        def __init__(self):
            self.aux = Linear(6, 2)

        def forward(self, x, edge_index):
            return edge_index.aggregate(x, "sum"), self.aux(x)

    m = trace(Fixed(), {"x": NodeInput(6), "edge_index": GraphInput()})
    with pytest.raises(GcompError, match="no parameter influences the loss"):
        compile_model(m, train=True)
