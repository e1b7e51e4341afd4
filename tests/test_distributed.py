"""Distributed training (gcomp/distributed): partitions, shards, and 1/2/4-rank runs.

The MPI tests start ``mpiexec -n 2`` / ``-n 4`` in subprocesses with timeouts (the
ranks may share two cores, so graphs are small) and are skipped without mpiexec.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gcomp.distributed.partition import check_parts, partition_graph, partition_report
from gcomp.errors import InputError
from gcomp.runtime.data import load_graph

MPIEXEC = shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
MODELS = ("gcn", "sage", "gin", "gat")
EPOCHS = 20


# ---------------------------------------------------------------------- partitions (no MPI)
@pytest.fixture(scope="module")
def cora():
    return load_graph("cora")


@pytest.mark.parametrize("kw", [{}, {"method": "range"}, {"method": "random"}, {"hosts": 2}])
def test_partition_parts_are_valid_and_balanced(cora, kw):
    parts = partition_graph(cora, 4, **kw)
    assert parts.shape == (cora.num_nodes,) and set(np.unique(parts)) == {0, 1, 2, 3}
    rep = partition_report(cora, parts, 4)
    assert sum(rep["nodes"]) == cora.num_nodes and sum(rep["edges"]) == cora.num_edges
    if kw.get("method") != "random":
        assert rep["edge_balance"] < 1.2
    if not kw.get("method"):
        assert rep["edge_cut_fraction"] < 0.1 and rep["halo_vs_allgather"] < 0.1


def test_hierarchical_keeps_host_cut_small(cora):
    flat = partition_report(cora, partition_graph(cora, 4), 4)
    hier = partition_graph(cora, 4, hosts=2)
    host = hier // 2
    src, dst = cora.edge_index
    assert (host[src] != host[dst]).sum() <= flat["edge_cut"]


def test_invalid_partitions_are_refused(cora):
    n = cora.num_nodes
    for bad, msg in [(np.zeros(n - 1, int), "one part per node"),
                     (np.full(n, 2), "lie in 0..1"),
                     (np.zeros(n, int), "own no node"),
                     (np.full(n, 0.5), "integers"),
                     # as given, not as int64 (where 2^63 + 5 reads -9223372036854775803)
                     (np.full(n, 2 ** 63 + 5, np.uint64), r"got 9223372036854775813\.\."),
                     (np.full(n, 7.0), r"got 7\.\.7$")]:
        with pytest.raises(InputError, match=msg):
            check_parts(bad, n, 2)
    with pytest.raises(InputError, match="positive"):
        partition_graph(cora, 0)
    with pytest.raises(InputError, match="must divide"):
        partition_graph(cora, 3, hosts=2)


def test_shards_cover_every_edge_once(cora):
    from gcomp.distributed.halo import build_shard, local_structures
    k = 3
    parts = partition_graph(cora, k)
    plan_graphs = [{"name": "g", "parent": None, "mode": None},
                   {"name": "s", "parent": "g", "mode": "add_remaining"}]
    shards = [build_shard(cora, parts, r, k) for r in range(k)]
    seen = []
    for sh in shards:
        st = local_structures(sh, cora, plan_graphs)
        g, s = st["g"], st["s"]
        seen.append(g.perm)
        # every local edge is a global edge into an owned node, same source
        assert (sh.gids[g.indices] == cora.edge_index[0][g.perm]).all()
        assert (sh.gids[g.rows] == cora.edge_index[1][g.perm]).all()
        assert g.indptr[sh.n_own] == g.num_edges  # halo rows have no in-edges
        # interior rows read owned rows only
        assert (g.indices[:g.indptr[sh.n_int]] < sh.n_own).all()
        # each owned node gets one self loop in the derived graph, none for halo nodes
        loops = s.origin < 0
        assert loops.sum() <= sh.n_own and (s.rows[loops] < sh.n_own).all()
        for p, (a, z) in sh.halo_ranges.items():  # what p sends me is what I hold for p
            other = shards[p]
            assert (other.gids[other.send_idx[sh.rank]] == sh.gids[a:z]).all()
    allp = np.sort(np.concatenate(seen))
    assert (allp == np.arange(cora.num_edges)).all()


# ---------------------------------------------------------------------- MPI runs
WORKER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from gcomp.runtime import artifact
    from gcomp.runtime.data import load_graph
    from gcomp.runtime.trainer import Trainer
    out, graph, epochs, *arts = sys.argv[1:]
    g = load_graph(graph)
    res = {}
    from gcomp.distributed.launch import world_size
    for path in arts:
        art = artifact.load(path)
        if world_size() == 1:
            tr = Trainer(art, g, seed=0)
        else:
            from gcomp.distributed.trainer import DistributedTrainer
            tr = DistributedTrainer(art, g, seed=0)
        losses = [tr.step() for _ in range(int(epochs))]
        res[path] = {"losses": losses, **tr.evaluate(),
                     "grads": {k: v.tolist() for k, v in tr.gradients().items()}}
    if getattr(tr, "rank", 0) == 0:
        json.dump(res, open(out, "w"))
""")


def _mpirun(k: int, argv: list[str], timeout: int = 240, env=None) -> subprocess.CompletedProcess:
    cmd = ([MPIEXEC, "-n", str(k)] if k > 1 else []) + argv
    e = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    import gcomp.models as models
    from gcomp.compiler import compile_model
    d = tmp_path_factory.mktemp("dist")
    paths = []
    # GAT twice: fused attention and its fused backward with dropout of the coefficients
    # (masks hashed by global edge ids) and without; GIN with 3 layers too: its middle
    # layer aggregates first and, without dropout, its backward aggregation over out-edges
    # applies relu's gradient (h read on halo rows) to partial sums that ranks add up
    for name, dropout, layers in ([(m, 0.5, 2) for m in MODELS] + [("gat", 0.0, 2)]
                                  + [("gin", 0.0, 3)]):
        m = models.build(name, 1433, hidden=16, out_channels=7, layers=layers, heads=2,
                         dropout=dropout)
        p = d / f"{name}-{dropout}-{layers}.gcomp"
        compile_model(m, "llvm", train=True).save(p)
        paths.append(str(p))
    # and GIN and GraphSAGE with memory preferred: their hidden aggregations computed again
    # in the backward pass (rematerialize), exchanging h's halo rows again there, and
    # GraphSAGE's ReLU gradient masked by its packed signs (pack_relu_masks)
    from gcomp.passes import PassContext
    for name in ("gin", "sage"):
        m = models.build(name, 1433, hidden=16, out_channels=7, layers=3, dropout=0.0)
        p = d / f"{name}-memory.gcomp"
        art = compile_model(m, "llvm", train=True, ctx=PassContext(options={"prefer": "memory"}))
        assert any(s["op"] == "mask_bits" for s in art.train_plan.steps) == (name == "sage")
        art.save(p)
        paths.append(str(p))
    (d / "worker.py").write_text(WORKER)
    return d, paths


def _run_worker(artifacts, k: int, graph: str = "cora") -> dict:
    d, paths = artifacts
    out = d / f"res{k}.json"
    r = _mpirun(k, [sys.executable, str(d / "worker.py"), str(out), graph, str(EPOCHS)] + paths,
                timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(artifacts):
    return _run_worker(artifacts, 1)


def _compare(ref: dict, got: dict) -> None:
    for path, a in ref.items():
        b = got[path]
        la, lb = np.array(a["losses"]), np.array(b["losses"])
        assert np.abs(la - lb).max() / np.abs(la).max() <= 1e-4, (path, la, lb)
        for key in ("train_acc", "val_acc", "test_acc"):
            assert abs(a[key] - b[key]) <= 2e-3, (path, key, a[key], b[key])
        for name, g in a["grads"].items():
            g, h = np.array(g), np.array(b["grads"][name])
            assert np.abs(g - h).max() <= 1e-4 * max(np.abs(g).max(), 1e-6), (path, name)


@needs_mpi
def test_two_ranks_match_one_process(artifacts, reference):
    _compare(reference, _run_worker(artifacts, 2))


@needs_mpi
def test_four_ranks_match_one_process(artifacts, reference):
    _compare(reference, _run_worker(artifacts, 4))


def _json_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout  # rank 0 alone prints
    return json.loads(lines[0])


@needs_mpi
def test_ggnn_on_two_ranks_matches_one_process(tmp_path):
    """GGNN's zero padding (a concat), its GRU gates (slices of one product) and their
    gradients shard like the other ops (dropout masks hashed by global node ids)."""
    import gcomp.models as models
    from gcomp.compiler import compile_model
    cora = load_graph("cora")
    x = np.random.default_rng(0).standard_normal((cora.num_nodes, 8)).astype(np.float32)
    graph = tmp_path / "cora8.npz"
    np.savez(graph, edge_index=cora.edge_index, x=x, y=cora.y, train_mask=cora.train_mask,
             val_mask=cora.val_mask, test_mask=cora.test_mask)
    m = models.build("ggnn", 8, hidden=16, out_channels=7, layers=2, dropout=0.5)
    art = tmp_path / "ggnn.gcomp"
    compile_model(m, "llvm", train=True).save(art)
    (tmp_path / "worker.py").write_text(WORKER)
    runs = (tmp_path, [str(art)])
    _compare(_run_worker(runs, 1, str(graph)), _run_worker(runs, 2, str(graph)))


@needs_mpi
def test_cli_train_and_resume_on_another_rank_count(artifacts, tmp_path):
    _, paths = artifacts
    gcn = paths[0]
    gcomp = [sys.executable, "-m", "gcomp.cli"]
    one = _mpirun(1, gcomp + ["train", gcn, "--graph", "cora", "--epochs", "12", "--json"])
    assert one.returncode == 0, one.stderr
    ck = tmp_path / "ck.npz"
    two = _mpirun(2, gcomp + ["train", gcn, "--graph", "cora", "--epochs", "6", "--json",
                              "--checkpoint", str(ck)])
    assert two.returncode == 0, two.stderr
    first = _json_line(two.stdout)
    assert first["ranks"] == 2 and first["step"] == 6 and ck.exists()
    b = first["bytes_per_epoch"]
    assert b["exchange_bytes"] + b["reduce_bytes"] < 0.2 * b["naive_bytes"]  # Cora cuts well
    assert not list(tmp_path.glob(".ck.npz.*"))  # no temporary file left behind
    res = _mpirun(1, gcomp + ["train", gcn, "--graph", "cora", "--epochs", "6", "--json",
                              "--resume", str(ck)])
    assert res.returncode == 0, res.stderr
    a, b = _json_line(one.stdout), _json_line(res.stdout)
    assert b["step"] == 12
    assert abs(a["final_loss"] - b["final_loss"]) <= 1e-4 * abs(a["final_loss"])
    assert a["test_acc"] == pytest.approx(b["test_acc"], abs=2e-3)


@needs_mpi
@pytest.mark.parametrize("kind", ["raise", "die", "hang"])
def test_a_failing_rank_ends_the_job(artifacts, kind):
    _, paths = artifacts
    r = _mpirun(2, [sys.executable, "-m", "gcomp.cli", "train", paths[0], "--graph", "cora",
                    "--epochs", "50", "--json"], timeout=120,
                env={"GCOMP_DIST_FAULT": f"1:3:{kind}", "GCOMP_DIST_TIMEOUT": "10"})
    assert r.returncode != 0
    assert not [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if kind == "raise":
        assert "rank 1/2: injected failure at step 3" in r.stderr
    if kind == "hang":
        assert "no answer from the other ranks" in r.stderr


@needs_mpi
def test_bad_partition_file_is_a_clear_error(artifacts, tmp_path):
    _, paths = artifacts
    bad = tmp_path / "parts.npy"
    np.save(bad, np.zeros(5, np.int32))
    r = _mpirun(2, [sys.executable, "-m", "gcomp.cli", "train", paths[0], "--graph", "cora",
                    "--epochs", "2", "--parts", str(bad)], timeout=120)
    assert r.returncode == 2
    assert "one part per node" in r.stderr


@needs_mpi
def test_partition_npz_and_bad_timeout_are_clear_errors(artifacts, tmp_path):
    _, paths = artifacts
    archive = tmp_path / "parts.npz"
    np.savez(archive, parts=np.zeros(2708, np.int32))
    train = [sys.executable, "-m", "gcomp.cli", "train", paths[0], "--graph", "cora",
             "--epochs", "2"]
    r = _mpirun(2, train + ["--parts", str(archive)], timeout=120)
    assert r.returncode == 2 and "is an .npz archive; give a .npy" in r.stderr
    for bad in ("abc", "-1", "0"):
        r = _mpirun(2, train, timeout=120, env={"GCOMP_DIST_TIMEOUT": bad})
        assert r.returncode == 2 and f"GCOMP_DIST_TIMEOUT='{bad}'" in r.stderr, r.stderr


@needs_mpi
def test_python_api_ranks_fail_together_when_rank_0_cannot_partition(artifacts, tmp_path):
    """DistributedTrainer on 3 nodes over 4 ranks: every rank raises rank 0's reason at
    once (the others waited for its partition until the timeout)."""
    _, paths = artifacts
    script = tmp_path / "tiny.py"
    script.write_text(f"""
import sys
import numpy as np
from gcomp.distributed.trainer import DistributedTrainer
from gcomp.runtime.artifact import load
from gcomp.runtime.data import GraphData
g = GraphData(edge_index=np.array([[0, 1], [1, 2]]), num_nodes=3,
              x=np.ones((3, 1433), np.float32), y=np.array([0, 1, 2]), name="tiny")
try:
    DistributedTrainer(load({paths[0]!r}), g)
except Exception as e:  # one write: ranks' print() calls interleave their parts
    sys.stdout.write(f"failed: {{e}}\\n")
    sys.stdout.flush()
""")
    t0 = time.perf_counter()
    r = _mpirun(4, [sys.executable, str(script)], timeout=120, env={"GCOMP_DIST_TIMEOUT": "60"})
    assert time.perf_counter() - t0 < 50, "ranks waited for the timeout"
    assert r.stdout.count("cannot split 3 nodes into 4 non-empty parts") == 4, r.stdout


def test_fused_epilogues_are_read_from_the_artifact_ir():
    """The distributed runtime reads fusion groups from the artifact's printed IR: the #:
    JSON annotations, and artifacts written before them (# fused_into='a')."""
    from gcomp.distributed.halo import fused_epilogues
    new = ('  %m = mul(%a, %e) : f32[N,4]  #: {"fused_into": "agg", "operand": true}\n'
           '  %r = relu(%m) : f32[N,4]  #: {"fused_into": "agg", "phase": "run"}\n'
           '  %s = relu(%x) : f32[N,4]  #: {"phase": "run"}\n')
    old = "  %m = mul(%a, %e) : f32[N,4]  # fused_into='agg', operand=True, phase='run'\n"
    assert fused_epilogues([new]) == {"agg": [("mul", True, ("a", "e")),
                                              ("relu", False, ("m",))]}
    assert fused_epilogues([old, None]) == {"agg": [("mul", True, ("a", "e"))]}


def test_dist_timeout_is_checked(monkeypatch):
    from gcomp.distributed.halo import DEFAULT_TIMEOUT_S, DistributedError, timeout_s
    monkeypatch.delenv("GCOMP_DIST_TIMEOUT", raising=False)
    assert timeout_s() == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("GCOMP_DIST_TIMEOUT", "2.5")
    assert timeout_s() == 2.5
    for bad in ("", "abc", "-1", "0", "nan", "inf"):
        monkeypatch.setenv("GCOMP_DIST_TIMEOUT", bad)
        with pytest.raises(DistributedError, match="a positive number"):
            timeout_s()


def test_partition_command(tmp_path):
    out = tmp_path / "p.npy"
    r = subprocess.run([sys.executable, "-m", "gcomp.cli", "partition", "cora", "-k", "2",
                        "--out", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["parts"] == 2 and rep["edge_cut"] > 0 and len(rep["halo"]) == 2
    assert np.load(out).shape == (2708,)
    r = subprocess.run([sys.executable, "-m", "gcomp.cli", "partition", "cora", "-k", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "gcomp: error:" in r.stderr


def test_partition_seeds_and_hosts_are_checked(cora):
    """A negative seed is named; any non-negative one works (METIS takes a C int); a
    random partition has no hosts (the report said hosts=2 and ignored them)."""
    with pytest.raises(InputError, match="seed must be a non-negative integer"):
        partition_graph(cora, 2, "random", seed=-1)
    parts = partition_graph(cora, 2, "metis", seed=99999999999999999999)
    check_parts(parts, cora.num_nodes, 2)
    with pytest.raises(InputError, match="a random partition has no hosts"):
        partition_graph(cora, 4, "random", hosts=2)


def test_distributed_trainer_checks_its_seed(artifacts):
    """As Trainer does (numpy and METIS raised their own errors, or -1 was taken)."""
    from gcomp.distributed.trainer import DistributedTrainer
    from gcomp.runtime import artifact
    art = artifact.load(artifacts[1][0])
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InputError, match="seed must be a non-negative integer"):
            DistributedTrainer(art, load_graph("cora"), seed=bad)


WEIGHTED = textwrap.dedent("""
    import numpy as np
    rng = np.random.default_rng(0)
    ei = rng.integers(0, 40, (2, 160))
    np.savez("{path}", edge_index=ei, x=rng.standard_normal((40, 8)).astype(np.float32),
             y=rng.integers(0, 3, 40), edge_weight=rng.random((160, 1)))
""")


@needs_mpi
def test_ranks_refuse_what_one_process_refuses(artifacts, tmp_path):
    """Under mpiexec: edge weights of shape (E, 1) are named as in one process (a TVM
    shape traceback on every rank); --reorder and --parts with the options that choose a
    partition are refused (they were ignored); --json reports the CSR a shard aggregates
    in (it gave the artifact's dense specialization); one error line per rank."""
    import gcomp.models as models
    from gcomp.compiler import compile_model
    _, paths = artifacts
    gcomp = [sys.executable, "-m", "gcomp.cli"]
    graph = tmp_path / "w.npz"
    subprocess.run([sys.executable, "-c", WEIGHTED.format(path=graph)], check=True)
    art = tmp_path / "gcnw.gcomp"
    compile_model(models.build("gcn", 8, hidden=4, out_channels=3, edge_weight=True),
                  train=True).save(art)
    r = _mpirun(2, gcomp + ["train", str(art), "--graph", str(graph), "--epochs", "2"],
                timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "edge values 'edge_weight' must have shape (E, ), got (160, 1)" in r.stderr
    assert all(ln.startswith("gcomp: error: rank") for ln in r.stderr.splitlines()
               if "gcomp: error" in ln)
    train = gcomp + ["train", paths[0], "--graph", "cora", "--epochs", "2"]
    r = _mpirun(2, train + ["--reorder", "rcm"], timeout=120)
    assert r.returncode == 2 and "--reorder rcm: distributed training keeps" in r.stderr
    parts = tmp_path / "parts.npy"
    np.save(parts, np.arange(2708) % 2)
    r = _mpirun(2, train + ["--parts", str(parts), "--partition", "random"], timeout=120)
    assert r.returncode == 2 and "--partition: --parts gives the partition" in r.stderr
    dense = tmp_path / "complete.npz"  # a graph the cost model specializes to dense
    src, dst = np.meshgrid(np.arange(120), np.arange(120))
    rng = np.random.default_rng(0)
    np.savez(dense, edge_index=np.stack([src.ravel(), dst.ravel()]),
             x=rng.standard_normal((120, 8)).astype(np.float32), y=rng.integers(0, 3, 120))
    formats = []
    for k in (1, 2):
        r = _mpirun(k, gcomp + ["train", "gcn", "--graph", str(dense), "--epochs", "2",
                                "--json"], timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        formats.append(set(_json_line(r.stdout)["formats"].values()))
    assert formats == [{"dense"}, {"csr"}]


TTY_RANK0 = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:  # as under srun --pty: only rank 0 on a terminal
        sys.stderr.isatty = lambda: True
    from gcomp.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@needs_mpi
def test_a_progress_bar_on_rank_0_alone_does_not_hang(artifacts, tmp_path):
    """Evaluating is collective: rank 0's bar made it evaluate alone, and the job hung
    until the timeout."""
    _, paths = artifacts
    script = tmp_path / "tty.py"
    script.write_text(TTY_RANK0)
    r = _mpirun(2, [sys.executable, str(script), "train", paths[0], "--graph", "cora",
                    "--epochs", "3"], timeout=120, env={"GCOMP_DIST_TIMEOUT": "30"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch 3/3" in r.stderr and "val" in r.stderr


@needs_mpi
def test_set_parameters_must_agree_across_ranks(artifacts, tmp_path):
    """Replicated parameters stay equal only when every rank sets the same values (each
    rank's own init trained no model, and rank 0's checkpoint described none)."""
    _, paths = artifacts
    script = tmp_path / "setp.py"
    script.write_text(f"""
import sys
import numpy as np
from gcomp.distributed.trainer import DistributedTrainer
from gcomp.runtime.artifact import load
from gcomp.runtime.data import load_graph
tr = DistributedTrainer(load({paths[0]!r}), load_graph("cora"))
name, w = next(iter(tr.parameters().items()))
tr.set_parameters({{name: np.full_like(w, 0.01)}})
tr.step()
try:
    tr.set_parameters({{name: np.full_like(w, 0.01 * (1 + tr.rank))}})
except Exception as e:  # one write: two ranks' print() calls interleave their parts
    sys.stdout.write(f"refused: {{e}}\\n")
    sys.stdout.flush()
""")
    r = _mpirun(2, [sys.executable, str(script)], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("refused: set_parameters was given other values on some ranks") == 2
