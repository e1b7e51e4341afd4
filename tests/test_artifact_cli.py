"""Artifacts (save, load, checks, runtime-only runs) and the CLI (compile, run, info, errors)."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import ref_inputs, rel_err

import gcomp.models as models
from gcomp.cli import main
from gcomp.compiler import compile_model
from gcomp.errors import ArtifactError
from gcomp.ir import interpret
from gcomp.runtime import artifact
from gcomp.runtime.data import load_graph


@pytest.fixture(scope="module")
def gcn_art(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "gcn.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--hidden", "16", "--out", "7", "-o",
                 str(path)]) == 0
    return path


@pytest.mark.parametrize("specialized", [False, True])
def test_a_graph_given_new_arrays_is_bound_again(specialized):
    """A service that keeps one GraphData and assigns it new edges (or a new node count)
    gets results on them: the binding is reused only for the same arrays (it computed on
    the old edges, with the same features or, compiled for a graph, with new ones)."""
    from conftest import awkward_graph
    from gcomp.runtime.data import GraphData
    m = models.build("gcn", 8, hidden=6, out_channels=3, edge_weight=True)
    rng = np.random.default_rng(0)
    g0 = awkward_graph(num_nodes=50, num_edges=200, num_features=8, seed=1, edge_weight=True)
    art = compile_model(m, graph=g0 if specialized else None)
    g = GraphData("svc", 50, g0.edge_index, g0.x, g0.edge_weight)
    x = g0.dense_x()

    def check(x):
        ref = interpret(m.graph, ref_inputs(m.graph, g, x), m.params)[0]
        assert rel_err(art.run(g, {"x": x})[0], ref) <= 1e-5
    check(x)
    g.edge_index = rng.integers(0, 50, (2, 300))
    g.edge_weight = rng.random(300).astype(np.float32)
    check(x)
    g.edge_weight = rng.random(300).astype(np.float32)  # new weights alone
    check(x)
    x80 = rng.standard_normal((80, 8)).astype(np.float32)
    g.num_nodes, g.edge_index, g.x = 80, rng.integers(0, 80, (2, 120)), x80
    g.edge_weight = rng.random(120).astype(np.float32)
    check(x80)


@pytest.mark.parametrize("reorder", ["none", "degree"])
def test_features_of_the_wrong_shape_are_named_before_binding(reorder):
    """Features from Python with other rows than the graph's nodes, or one axis, are an
    InputError when the graph is bound (the layout and variant choices read them first:
    TVM, numpy or scipy tracebacks); a list of rows is numpy's view of it."""
    from conftest import awkward_graph
    from gcomp.errors import InputError
    m = models.build("gcn", 6, hidden=4, out_channels=3)
    art = compile_model(m)
    art.executor().reorder = reorder
    g = awkward_graph(num_nodes=40, num_edges=150, num_features=6, seed=5)
    x = g.dense_x()
    for bad in (np.vstack([x, x[:3]]), x[:-3], x[:, 0], x[:3].tolist()):
        with pytest.raises(InputError, match="input 'x' must be \\[N, F\\] with N = 40"):
            art.run(g, {"x": bad})
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert rel_err(art.run(g, {"x": x.tolist()})[0], ref) <= 1e-5


def test_saved_artifact_runs_and_matches_reference(gcn_art):
    art = artifact.load(gcn_art)
    m = models.build("gcn", 1433, hidden=16, out_channels=7)  # same seed: same parameters
    g = load_graph("cora")
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    assert rel_err(art.run(g)[0], ref) <= 1e-4
    info = art.info()
    assert info["target"]["kind"] == "llvm" and info["tvm_version"].startswith("0.27")
    assert info["num_parameters"] == 1433 * 16 + 16 + 16 * 7 + 7


def test_save_is_atomic_and_round_trips(tmp_path):
    m = models.build("gin", 5, hidden=4, out_channels=2)
    art = compile_model(m)
    p = art.save(tmp_path / "a.gcomp")
    again = artifact.load(p)
    assert again.plan == art.plan and again.lib_bytes == art.lib_bytes
    assert all(np.array_equal(again.params[k], art.params[k]) for k in art.params)
    assert [f.name for f in tmp_path.iterdir()] == ["a.gcomp"]  # no temporary left behind


def _rewrite(src: Path, dst: Path, edit) -> None:
    with zipfile.ZipFile(src) as z:
        members = {n: z.read(n) for n in z.namelist()}
    edit(members)
    with zipfile.ZipFile(dst, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)


def test_corrupt_member_is_detected(gcn_art, tmp_path):
    bad = tmp_path / "bad.gcomp"

    def flip(m):
        lib = bytearray(m["kernels.so"])
        lib[len(lib) // 2] ^= 0xFF
        m["kernels.so"] = bytes(lib)
    _rewrite(gcn_art, bad, flip)
    with pytest.raises(ArtifactError, match="kernels.so does not match its SHA-256"):
        artifact.load(bad)


@pytest.mark.parametrize("field,value,msg", [
    ("format_version", 99, "format version 99"),
    ("plan_version", 99, "plan of version 99; .* runs plans up to version 4"),
    ("tvm_version", "0.1.0", "built with TVM 0.1.0"),
    ("format", "something-else", "not a gcomp artifact"),
    ("target", "llvm", "names no llvm or cuda target"),
])
def test_version_and_format_checks(gcn_art, tmp_path, field, value, msg):
    bad = tmp_path / "v.gcomp"

    def edit(m):
        man = json.loads(m["manifest.json"])
        man[field] = value
        m["manifest.json"] = json.dumps(man).encode()
    _rewrite(gcn_art, bad, edit)
    with pytest.raises(ArtifactError, match=msg):
        artifact.load(bad)


def _rehashed(src: Path, dst: Path, name: str, edit) -> None:
    """``src`` with member ``name`` edited and the manifest's digest of it made to match
    (a writer other than gcomp's, or gcomp's of another build)."""
    import hashlib

    def change(m):
        m[name] = edit(m[name])
        man = json.loads(m["manifest.json"])
        man["files"][name] = hashlib.sha256(m[name]).hexdigest()
        m["manifest.json"] = json.dumps(man).encode()
    _rewrite(src, dst, change)


def _params_npz(arrays: dict) -> bytes:
    import io
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _params_of(blob: bytes) -> dict:
    import io
    with np.load(io.BytesIO(blob)) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name,edit,msg", [
    ("plan.json", lambda b: b"{not json", "plan.json is not a plan"),
    ("plan.json", lambda b: b"{}", "a plan without outputs"),
    ("params.npz", lambda b: b"garbage", "corrupt: params.npz"),
    ("params.npz", lambda b: _params_npz({k: v for k, v in _params_of(b).items()
                                          if k != "convs.0.lin.weight"}),
     "parameter 'convs.0.lin.weight' is missing"),
    ("params.npz", lambda b: _params_npz({**_params_of(b), "convs.0.lin.weight":
                                          np.zeros((3, 16), np.float32)}),
     "parameter 'convs.0.lin.weight' has shape \\[3, 16\\], its plan says \\[1433, 16\\]"),
])
def test_members_consistent_with_their_digest_but_not_each_other(gcn_art, tmp_path, name,
                                                                 edit, msg):
    bad = tmp_path / "c.gcomp"
    _rehashed(gcn_art, bad, name, edit)
    with pytest.raises(ArtifactError, match=msg):
        artifact.load(bad)


def test_truncated_and_foreign_files(gcn_art, tmp_path):
    trunc = tmp_path / "t.gcomp"
    trunc.write_bytes(gcn_art.read_bytes()[: gcn_art.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="not a gcomp artifact|corrupt"):
        artifact.load(trunc)
    text = tmp_path / "x.gcomp"
    text.write_text("hello")
    with pytest.raises(ArtifactError, match="not a gcomp artifact"):
        artifact.load(text)
    missing = tmp_path / "m.gcomp"
    _rewrite(gcn_art, missing, lambda m: m.pop("plan.json"))
    with pytest.raises(ArtifactError, match="plan.json is missing"):
        artifact.load(missing)


RUNTIME_ONLY = """
import sys
from gcomp.cli import main
rc = main(sys.argv[1:])
maps = open('/proc/self/maps').read()
assert 'libtvm_compiler' not in maps, 'the TVM compiler library was loaded'
compiler_modules = [m for m in sys.modules if m.startswith(('gcomp.codegen', 'gcomp.compiler',
                    'gcomp.passes', 'gcomp.schedules'))]
assert not compiler_modules, compiler_modules
sys.exit(rc)
"""


def test_run_in_a_runtime_only_process(gcn_art, tmp_path):
    out = tmp_path / "y.npy"
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    r = subprocess.run([sys.executable, "-c", RUNTIME_ONLY, "run", str(gcn_art), "--graph", "cora",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    y = np.load(out)
    m = models.build("gcn", 1433, hidden=16, out_channels=7)
    g = load_graph("cora")
    assert rel_err(y, interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]) <= 1e-4


def test_cli_info(gcn_art, capsys):
    assert main(["info", str(gcn_art), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target"]["kind"] == "llvm" and info["ops"]["aggregate"] == 2
    assert info["signature"]["inputs"][0] == {"name": "x", "role": "node", "type": "f32[N,1433]"}
    assert main(["info", str(gcn_art)]) == 0
    assert "convs.0.lin.weight: [1433, 16]" in capsys.readouterr().out


def test_cli_run_with_features_file(gcn_art, tmp_path):
    g = load_graph("cora")
    x = np.random.default_rng(0).standard_normal((g.num_nodes, 1433)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", str(gcn_art), "--graph", "cora", "--features", str(tmp_path / "x.npy"),
                 "--out", str(tmp_path / "y.npy")]) == 0
    m = models.build("gcn", 1433, hidden=16, out_channels=7)
    ref = interpret(m.graph, ref_inputs(m.graph, g, x), m.params)[0]
    assert rel_err(np.load(tmp_path / "y.npy"), ref) <= 1e-4


def _err(argv, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("gcomp: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def _graph_file(tmp_path, **arrays):
    p = tmp_path / "g.npz"
    base = {"edge_index": np.array([[0, 1, 2], [1, 2, 0]]), "x": np.ones((3, 1433), np.float32)}
    base.update(arrays)
    np.savez(p, **{k: v for k, v in base.items() if v is not None})
    return str(p)


@pytest.mark.parametrize("arrays,msg", [
    ({"edge_index": np.array([[0, 1, 5], [1, 2, 0]])}, "node id 5 \\(edge 2\\), out of range for 3 nodes"),
    ({"edge_index": np.array([[0, -1, 2], [1, 2, 0]])}, "negative node id -1 \\(edge 1\\)"),
    ({"edge_index": np.array([[0, 1.5, 2], [1, 2, 0]])}, "non-integer node id 1.5"),
    ({"edge_index": np.array([0, 1, 2])}, "shape \\(2, E\\)"),
    ({"edge_index": None}, "no 'edge_index'"),
    ({"x": np.full((3, 1433), np.nan, np.float32)}, "NaN or Inf"),
    ({"x": np.where(np.eye(3, 1433, 1400) > 0, np.inf, 1.0).astype(np.float32)},
     "NaN or Inf \\(first at node 0, feature 1400\\)"),
    ({"x": np.where(np.eye(3, 1433, 7) > 0, -np.inf, 1.0).astype(np.float32)},
     "NaN or Inf \\(first at node 0, feature 7\\)"),
    ({"x": np.ones((3, 100), np.float32)}, "expects 1433 features per node, got 100"),
    ({"x": np.ones(3, np.float32)}, "2-D"),
    ({"y": np.ones(4, np.int64)}, "y must be 3 integer labels"),
])
def test_cli_bad_graphs(gcn_art, tmp_path, capsys, arrays, msg):
    import re
    err = _err(["run", str(gcn_art), "--graph", _graph_file(tmp_path, **arrays), "--out",
                str(tmp_path / "y.npy")], capsys)
    assert re.search(msg, err), err


def test_cli_refuses_to_overwrite_inputs(gcn_art, tmp_path, capsys):
    before = gcn_art.read_bytes()
    err = _err(["run", str(gcn_art), "--graph", "cora", "--out", str(gcn_art)], capsys)
    assert "is an input" in err and gcn_art.read_bytes() == before
    g = _graph_file(tmp_path)
    _err(["run", str(gcn_art), "--graph", g, "--out", g], capsys)
    user_file = tmp_path / "notes.txt"
    user_file.write_text("mine")
    err = _err(["compile", "gcn", "-o", str(user_file)], capsys)
    assert "not a gcomp artifact" in err and user_file.read_text() == "mine"
    # another tool's zip with a manifest of its own is no artifact either, whatever its name
    foreign = tmp_path / "other.gcomp"
    with zipfile.ZipFile(foreign, "w") as z:
        z.writestr("manifest.json", '{"format": "other-tool"}')
    before_zip = foreign.read_bytes()
    err = _err(["compile", "gcn", "-o", str(foreign)], capsys)
    assert "not a gcomp artifact" in err and foreign.read_bytes() == before_zip
    renamed = tmp_path / "other.zip"
    renamed.write_bytes(before_zip)
    err = _err(["train", str(renamed), "--graph", "cora", "--epochs", "1"], capsys)
    assert "is not a gcomp artifact (manifest format 'other-tool')" in err
    # --out names the arrays' file: a mistyped path to another file is refused, not replaced
    err = _err(["run", str(gcn_art), "--graph", "cora", "--out", str(user_file)], capsys)
    assert ".npy or .npz" in err and user_file.read_text() == "mine"
    err = _err(["partition", "cora", "-k", "2", "--out", str(user_file)], capsys)
    assert ".npy" in err and user_file.read_text() == "mine"
    # a --graph is an input too, with --force, and a bundled dataset's own file
    before = Path(g).read_bytes()
    err = _err(["compile", "gcn", "--in", "1433", "--out", "7", "--graph", g, "-o", g,
                "--force"], capsys)
    assert "is an input" in err and Path(g).read_bytes() == before


def test_cli_refuses_to_overwrite_a_bundled_dataset(gcn_art, tmp_path, capsys, monkeypatch):
    import shutil
    from gcomp.runtime import data
    cora = tmp_path / "cora.npz"  # the bundled file, copied: the real one is never at risk
    shutil.copy(data.BUNDLED["cora"], cora)
    monkeypatch.setitem(data.BUNDLED, "cora", cora)
    before = cora.read_bytes()
    for argv in (["run", str(gcn_art), "--graph", "cora", "--out", str(cora)],
                 ["train", "gcn", "--graph", "cora", "--epochs", "1", "--checkpoint", str(cora)]):
        assert "is an input" in _err(argv, capsys)
    assert cora.read_bytes() == before


def test_cli_other_errors(gcn_art, tmp_path, capsys):
    _err(["run", str(tmp_path / "nope.gcomp"), "--graph", "cora", "--out", str(tmp_path / "y.npy")],
         capsys)
    _err(["run", str(gcn_art), "--graph", "pubmedx", "--out", str(tmp_path / "y.npy")], capsys)
    _err(["compile", "transformer", "-o", str(tmp_path / "t.gcomp")], capsys)
    _err(["run", str(gcn_art), "--graph", "cora", "--out", str(tmp_path / "no" / "y.npy")], capsys)
    bad_feats = tmp_path / "f.npy"
    bad_feats.write_bytes(b"garbage")
    _err(["run", str(gcn_art), "--graph", "cora", "--features", str(bad_feats), "--out",
          str(tmp_path / "y.npy")], capsys)


def test_cli_debug_shows_traceback(gcn_art, tmp_path):
    with pytest.raises(ArtifactError):
        main(["--debug", "info", str(tmp_path / "nope.gcomp")])


def test_gcomp_console_script(gcn_art, tmp_path):
    r = subprocess.run(["gcomp", "info", str(gcn_art)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "aggregate x2" in r.stdout
    r = subprocess.run(["gcomp", "info", str(tmp_path / "none.gcomp")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("gcomp: error:")


def test_finite_check_is_exact_when_the_sum_overflows():
    """all_finite's one-pass sum proves finiteness; a sum that overflowed (large finite
    values) or cancelled infinities fall back to min and max."""
    from gcomp.runtime.data import all_finite
    big = np.full((4, 5), 3e38, np.float32)
    assert all_finite(big) and all_finite(-big) and all_finite(np.zeros((0, 3), np.float32))
    both = np.ones((2, 3), np.float32)
    both[0, 0], both[1, 2] = np.inf, -np.inf
    assert not all_finite(both)
    one_nan = big.copy()
    one_nan[3, 4] = np.nan
    assert not all_finite(one_nan)


def _generic_products(monkeypatch):
    """Compile products with the generic (scheduled) kernel, which assumes 64-byte aligned
    arguments, on every CPU: the tunings that take row groups for every shape (``avx2``)
    would otherwise never use it."""
    from gcomp.codegen import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "_matmul_rows", lambda K, M, tuning: None)


def test_features_are_fed_in_place_by_one_checking_kernel(monkeypatch):
    """Dense float32 features are read where the caller keeps them (any 4-byte alignment)
    by the feed kernel, which copies and checks them in one pass when a kernel reading
    them (here the generic 12 -> 8 product) needs 64-byte alignment: same outputs as the
    copying path (reordered nodes, float64 input), every non-finite entry named."""
    from conftest import awkward_graph, ref_inputs, rel_err
    from gcomp.errors import InputError
    from gcomp.ir import interpret
    from gcomp.runtime.executor import Executor
    _generic_products(monkeypatch)
    m = models.build("sage", 12, hidden=8, out_channels=3, layers=2)
    art = compile_model(m)
    assert all("feed_kernel" in i for i in art.plan.inputs if i["name"] == "x")
    g = awkward_graph(num_nodes=300, num_edges=1500, num_features=12, seed=3)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    base = np.zeros(300 * 12 + 1, np.float32)
    x = base[1:].reshape(300, 12)  # 4 bytes past an allocation: not 64-byte aligned
    x[...] = g.dense_x()
    ex = art.executor()
    ex.force_variants = {"sparse:x": False}
    # the caller's order: a reordering the cost model may choose (its costs are measured,
    # so a loaded machine can tip it) would copy the features anyway
    ex.reorder = "none"
    b = ex.feed(ex.bind(g, {"x": x}), {"x": x})
    assert b.order is None and b.reads >= {"x"} and b.in_place["x"]["need"] == 64
    ex.execute(b)
    assert rel_err(ex.outputs(b)[0], ref) <= 1e-4
    for order, value in (("degree", x), ("none", x.astype(np.float64))):  # copying paths
        other = Executor(art.plan, art.library(), art.params)
        other.reorder, other.force_variants = order, {"sparse:x": False}
        out = other.run(g, {"x": value})[0]
        assert rel_err(out, ref) <= 1e-4
        assert (other._binding.order is not None) == (order == "degree")
    ex.reorder = "degree"  # a changed choice binds the graph again
    assert rel_err(ex.run(g, {"x": x})[0], ref) <= 1e-4 and ex._binding.order is not None
    ex.reorder = "none"
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[299, 11] = bad
        with pytest.raises(InputError, match="first at node 299, feature 11"):
            ex.run(g, {"x": y})


def _placed(a: np.ndarray, offset: int) -> np.ndarray:
    """A float32 copy of ``a`` starting ``offset`` bytes past a 64-byte boundary."""
    raw = np.zeros(a.size * 4 + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    out = raw[start:start + a.size * 4].view(np.float32).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("width, offset, in_place", [
    (256, 4, True),   # CPU row-group product kernels (every tuning's, from K = 256) take any
                      # 4-byte alignment
    (12, 16, False),  # the generic 12 -> 8 product assumes 64 bytes: copied in
    (12, 0, True),    # ... which a 64-byte-aligned array has
])
def test_kernels_read_the_callers_features_where_every_reader_accepts_them(width, offset,
                                                                           in_place,
                                                                           monkeypatch):
    """The check kernel reads the features once and the kernels read the caller's array
    itself, never writing it, until the next feed: changing it between feed and execute
    changes the result (documented); a feed that must copy (float64) points them back at
    the binding's own buffer.  Outputs against the float64 interpreter."""
    from conftest import awkward_graph, ref_inputs, rel_err
    from gcomp.ir import interpret
    if width == 12:
        _generic_products(monkeypatch)
    m = models.build("gcn", width, hidden=8, out_channels=3, layers=2)
    ex = compile_model(m).executor()
    ex.force_variants, ex.reorder = {"sparse:x": False}, "none"
    g = awkward_graph(num_nodes=300, num_edges=1500, num_features=width, seed=3)

    def ref(x):
        return interpret(m.graph, ref_inputs(m.graph, g, x), m.params)[0]

    x = _placed(g.dense_x(), offset)
    kept = x.copy()
    b = ex.feed(ex.bind(g, {"x": x}), {"x": x})
    assert b.in_place["x"]["need"] == (4 if width == 256 else 64)
    assert b.reads_callers("x") == in_place
    ex.execute(b)
    assert rel_err(ex.outputs(b)[0], ref(kept)) <= 1e-4
    assert np.array_equal(x, kept)  # read, never written
    x[:50] *= 2.0  # after the feed: seen by the kernels only where they read x in place
    ex.execute(b)
    assert rel_err(ex.outputs(b)[0], ref(x if in_place else kept)) <= 1e-4
    other = g.dense_x().astype(np.float64) + 1.0
    b = ex.feed(b, {"x": other})  # copied in: the kernels read the binding's buffer again
    assert not b.reads_callers("x")
    x[50:100] *= 3.0
    ex.execute(b)
    assert rel_err(ex.outputs(b)[0], ref(other)) <= 1e-4


def test_training_reads_the_features_in_place_with_the_same_steps():
    """A training step whose products read the caller's features (forward and weight
    gradient) gives the losses of one that reads a copy (a Fortran-ordered array)."""
    from conftest import awkward_graph
    from gcomp.runtime.trainer import Trainer
    from test_training import labelled
    g = labelled(awkward_graph(num_nodes=200, num_edges=1000, num_features=64, seed=4), 3)
    art = compile_model(models.build("sage", 64, hidden=16, out_channels=3, layers=2),
                        train=True)
    a = Trainer(art, g, variants={k: False for k in art.train_plan.variants}, reorder="none")
    assert len(a._binding.in_place["x"]["uses"]) >= 2 and a._binding.reads_callers("x")
    g.x = np.asfortranarray(g.x)  # not C-ordered: copied in
    b = Trainer(art, g, variants={k: False for k in art.train_plan.variants}, reorder="none")
    assert not b._binding.reads_callers("x")
    la, lb = [a.step() for _ in range(3)], [b.step() for _ in range(3)]
    assert np.allclose(la, lb, rtol=1e-5), (la, lb)


def test_features_no_kernel_reads_are_still_checked():
    """With the sparse-feature kernels bound, no kernel reads the dense features (they read
    the nonzeros): the feed only checks them, and names a non-finite entry."""
    from conftest import awkward_graph, ref_inputs, rel_err
    from gcomp.errors import InputError
    from gcomp.ir import interpret
    m = models.build("gcn", 64, hidden=8, out_channels=3, layers=2)
    ex = compile_model(m, sparse_threshold=0.5).executor()
    ex.force_variants = {"sparse:x": True}
    g = awkward_graph(num_nodes=200, num_edges=1000, num_features=64, seed=5)
    x = g.dense_x()
    x[np.random.default_rng(2).random(x.shape) < 0.9] = 0.0
    b = ex.feed(ex.bind(g, {"x": x}), {"x": x})
    assert "x" not in b.reads and not b.reads_callers("x")
    ex.execute(b)
    assert rel_err(ex.outputs(b)[0], interpret(m.graph, ref_inputs(m.graph, g, x),
                                               m.params)[0]) <= 1e-4
    x[123, 45] = np.inf
    with pytest.raises(InputError, match="first at node 123, feature 45"):
        ex.feed(b, {"x": x})


# ---------------------------------------------------------------- inputs a service hands over
@pytest.fixture(scope="module")
def small_gcn():
    """A GCN over 40-wide features and its float64 reference inputs' graph."""
    from conftest import awkward_graph
    m = models.build("gcn", 40, hidden=8, out_channels=3)
    g = awkward_graph(num_nodes=1500, num_edges=6000, num_features=40, seed=4)
    ref = interpret(m.graph, ref_inputs(m.graph, g), m.params)[0]
    return compile_model(m), g, ref


def test_read_only_features_run_in_place_and_train(small_gcn, tmp_path):
    """numpy exports no read-only array through DLPack: a memory-mapped file
    (np.load(mmap_mode="r")) or a frozen array still runs, reading the same values."""
    from gcomp.runtime.trainer import Trainer
    art, g, ref = small_gcn
    frozen = g.x.copy()
    frozen.flags.writeable = False
    np.save(tmp_path / "x.npy", g.x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    for x in (frozen, mapped):
        assert rel_err(art.run(g, {"x": x})[0], ref) <= 1e-4
    t_art = compile_model(models.build("gcn", 40, hidden=8, out_channels=3), train=True)
    g.train_mask = np.arange(g.num_nodes) % 2 == 0
    try:
        from gcomp.runtime.data import GraphData
        ro = GraphData(g.name, g.num_nodes, g.edge_index, frozen, y=g.y, train_mask=g.train_mask)
        losses = [Trainer(t_art, graph, seed=1).step() for graph in (ro, g)]
    finally:
        g.train_mask = None
    assert losses[0] == losses[1]


def test_a_graph_built_in_python_is_checked_like_a_file(small_gcn):
    from gcomp.errors import InputError
    from gcomp.runtime.data import GraphData
    art, g, ref = small_gcn
    bad = g.edge_index.copy()
    bad[0, 17] = g.num_nodes
    with pytest.raises(InputError, match=f"node id {g.num_nodes} \\(edge 17\\), out of range"):
        art.run(GraphData("mine", g.num_nodes, bad, g.x))
    with pytest.raises(InputError, match="num_nodes must be a non-negative integer"):
        art.run(GraphData("mine", -3, g.edge_index, g.x))
    with pytest.raises(InputError, match="x has 1500 rows but the graph has 1600 nodes"):
        art.run(GraphData("mine", 1600, g.edge_index, g.x))
    as_lists = GraphData("mine", g.num_nodes, g.edge_index.tolist(), g.x)  # any array-like
    assert rel_err(art.run(as_lists)[0], ref) <= 1e-4
    assert isinstance(as_lists.edge_index, list)  # the caller's object is left as it was
    # a misspelt input name is named, not ignored (its values would go unused)
    with pytest.raises(InputError, match="unknown node input 'features'; the model's node "
                                         "inputs: 'x'"):
        art.run(g, {"x": g.x, "features": g.x})
    with pytest.raises(InputError, match="missing node input 'x'"):
        art.run(g, {})


def test_sparse_feature_indices_out_of_range_are_named(tmp_path, capsys):
    import scipy.sparse as sp

    from gcomp.errors import InputError
    x = sp.random(5, 8, density=0.4, format="csr", random_state=0, dtype=np.float32)
    ind = x.indices.copy()
    ind[3] = 108
    p = tmp_path / "g.npz"
    np.savez(p, edge_index=np.array([[0, 1, 2], [1, 2, 0]]), x_indptr=x.indptr,
             x_indices=ind, x_data=x.data, x_shape=np.array(x.shape))
    art = tmp_path / "gcn.gcomp"
    compile_model(models.build("gcn", 8, hidden=4, out_channels=2)).save(art)
    err = _err(["run", str(art), "--graph", str(p), "--out", str(tmp_path / "y.npy")], capsys)
    assert "column indices hold 108 (entry 3, row" in err and "out of range for 8 features" in err
    g = load_graph(_graph_file(tmp_path, x=np.ones((3, 8), np.float32)))
    bad = sp.csr_matrix((np.ones(3, np.float32), np.array([0, -1, 2]), np.array([0, 1, 2, 3])),
                        shape=(3, 8))
    with pytest.raises(InputError, match="column indices hold -1"):
        artifact.load(art).run(g, {"x": bad})


def test_concurrent_runs_of_one_artifact_take_turns(small_gcn):
    from concurrent.futures import ThreadPoolExecutor
    art, g, ref = small_gcn
    xs = [g.x * (k + 1) for k in range(4)]  # each thread its own features
    with ThreadPoolExecutor(4) as pool:
        outs = [art.run(g, {"x": x})[0] for x in xs]
        results = list(pool.map(lambda k: art.run(g, {"x": xs[k % 4]})[0], range(24)))
    for k, y in enumerate(results):
        assert np.array_equal(y, outs[k % 4]), k
    assert rel_err(outs[0], ref) <= 1e-4


def test_an_artifact_for_a_cpu_with_instructions_this_one_lacks(tmp_path, capsys):
    """--mcpu naming a CPU with vector instructions this one lacks compiles (the
    calibrations time this CPU's kernels: the other's died here with SIGILL), and loading
    the artifact here is refused naming them, where its kernels would stop the process."""
    from gcomp.runtime.cpu_features import missing_features
    if not missing_features("diamondrapids"):
        pytest.skip("this CPU has diamondrapids' instructions")
    out = tmp_path / "dmr.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "--mcpu",
                 "diamondrapids", "-o", str(out)]) == 0
    capsys.readouterr()
    err = _err(["run", str(out), "--graph", "cora", "--out", str(tmp_path / "y.npy")], capsys)
    assert "compiled for CPU 'diamondrapids', whose instructions this CPU lacks" in err
    assert main(["info", str(out)]) == 0  # described, not run


def test_cli_refusals_of_settings(tmp_path, capsys):
    out = str(tmp_path / "a.gcomp")
    assert "unknown CPU 'bogus'" in _err(["compile", "gcn", "--mcpu", "bogus", "-o", out], capsys)
    assert "must be finite: lr=nan" in _err(["compile", "gcn", "--train", "--lr", "nan",
                                             "-o", out], capsys)
    assert "momentum, dampening and nesterov are sgd's" in _err(
        ["compile", "gcn", "--train", "--momentum", "0.9", "-o", out], capsys)
    assert not (tmp_path / "a.gcomp").exists()
    cora = str(tmp_path / "gin-cora.gcomp")
    assert main(["compile", "gin", "--in", "1433", "--out", "7", "--graph", "cora",
                 "-o", cora]) == 0
    capsys.readouterr()
    assert main(["info", cora]) == 0
    assert "specialized to graph 'cora' (2708 nodes" in capsys.readouterr().out
    err = _err(["run", cora, "--graph", "cora", "--format", "dense", "--out",
                str(tmp_path / "y.npy")], capsys)
    assert "format 'dense': this artifact has only CSR kernels" in err


@pytest.mark.parametrize("content,msg", [
    (b"hello", "is not an .npz archive"),
    ({"edge_index": np.array([[0], [1]]), "num_nodes": np.array(30.7)},
     "num_nodes must be one non-negative integer, got float64 30.7"),
    ({"edge_index": np.array([[0], [1]]), "num_nodes": np.array(-3)},
     "num_nodes must be one non-negative integer"),
])
def test_graph_file_problems_are_named(tmp_path, content, msg):
    from gcomp.errors import InputError
    p = tmp_path / "g.npz"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        np.savez(p, **content)
    with pytest.raises(InputError, match=msg):
        load_graph(p)


def test_negative_weighted_degree_is_named_not_nan():
    from gcomp.errors import InputError
    from gcomp.runtime.data import GraphData
    art = compile_model(models.build("gcn", 4, hidden=4, out_channels=2, edge_weight=True))
    ei = np.array([[0, 1, 2, 3], [1, 2, 3, 0]])
    x = np.ones((4, 4), np.float32)
    ok = art.run(GraphData("w", 4, ei, x, np.array([1.0, 2.0, 0.5, 1.0], np.float32)))[0]
    assert np.isfinite(ok).all()
    w = np.array([1.0, -3.0, 0.5, 1.0], np.float32)  # node 2: -3 + its self loop's 1
    with pytest.raises(InputError, match="gives node 2 the weighted degree -2 "):
        art.run(GraphData("w", 4, ei, x, w))


def test_flags_a_compiled_artifact_fixed_are_refused_at_any_value(tmp_path, capsys):
    """A flag given at the parser's default (--lr 0.01, --precision fp32, -t llvm) was
    taken for no flag and silently ignored; a renamed artifact is still an artifact (it
    was an 'unknown model'); model flags shape bundled models, not ONNX files."""
    art = tmp_path / "tr.gcomp"
    assert main(["compile", "gcn", "--in", "1433", "--out", "7", "--train", "--lr", "0.05",
                 "-o", str(art)]) == 0
    capsys.readouterr()
    assert main(["info", str(art)]) == 0  # what it fixed: the text shows it too
    out = capsys.readouterr().out
    assert "training   adam {" in out and '"lr": 0.05' in out and "training-step steps" in out
    train = ["train", str(art), "--graph", "cora", "--epochs", "1"]
    for flag in (["--lr", "0.01"], ["--precision", "fp32"], ["-t", "llvm"], ["--hidden", "16"]):
        assert f"{flag[0]}: {str(art)!r} is compiled" in _err(train + flag, capsys)
    renamed = tmp_path / "tr.zip"
    renamed.write_bytes(art.read_bytes())
    assert "--lr: " in _err(["train", str(renamed), "--graph", "cora", "--lr", "0.01"], capsys)
    assert main(["train", str(renamed), "--graph", "cora", "--epochs", "1"]) == 0
    capsys.readouterr()
    onnx = str(Path(models.__file__).parent / "onnx" / "gcn2_opset18.onnx")
    for flag in (["--out", "9"], ["--hidden", "99"], ["--seed", "5"], ["--edge-weight"]):
        err = _err(["compile", onnx, *flag, "-o", str(tmp_path / "o.gcomp")], capsys)
        assert f"{flag[0]}: these shape a bundled model" in err
    assert "--heads: attention heads are GAT's; 'gcn' has none" in _err(
        ["compile", "gcn", "--heads", "3", "-o", str(tmp_path / "o.gcomp")], capsys)


def test_bad_settings_of_the_environment_and_graphs_for_info_are_named(gcn_art, tmp_path,
                                                                       capsys, monkeypatch):
    """GCOMP_CUDA_DEVICE that is no number (an int() traceback); info --graph of a graph
    the model cannot take (it planned memory for it)."""
    cu = tmp_path / "cu.gcomp"
    art = compile_model(models.build("gcn", 8, hidden=4, out_channels=3), "cuda")
    art.save(cu)
    monkeypatch.setenv("GCOMP_CUDA_DEVICE", "abc")
    assert "GCOMP_CUDA_DEVICE='abc': give the number of a CUDA device" in _err(
        ["run", str(cu), "--graph", "cora", "--out", str(tmp_path / "y.npy")], capsys)
    small = tmp_path / "small.gcomp"
    compile_model(models.build("gcn", 8, hidden=4, out_channels=3)).save(small)
    assert "graph 'cora' has 1433 features per node; the model's input 'x' takes 8" in _err(
        ["info", str(small), "--graph", "cora"], capsys)


@pytest.mark.parametrize("member,edit,msg", [
    ("manifest.json", lambda m: {**m, "files": sorted(m["files"])},
     "its manifest's files are not a table"),
    ("ir/source.ir", b"\xff\xfe not text", "an IR member is not text"),
])
def test_members_that_match_their_digests_but_not_their_kind_are_corrupt(gcn_art, tmp_path,
                                                                        capsys, member, edit,
                                                                        msg):
    """As a repacking tool would leave them (digests recomputed): tracebacks before."""
    import hashlib
    with zipfile.ZipFile(gcn_art) as z:
        members = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(members["manifest.json"])
    if member == "manifest.json":
        manifest = edit(manifest)
    else:
        members[member] = edit
        manifest["files"][member] = hashlib.sha256(edit).hexdigest()
    members["manifest.json"] = json.dumps(manifest).encode()
    bad = tmp_path / "bad.gcomp"
    with zipfile.ZipFile(bad, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    assert msg in _err(["info", str(bad)], capsys)


def test_a_truncated_artifact_says_it_may_be_truncated(gcn_art, tmp_path, capsys):
    """Cut after its stored params.npz, an artifact reads as that archive: 'not a gcomp
    artifact' alone misled."""
    with zipfile.ZipFile(gcn_art) as z:
        cut = z.getinfo(artifact.LIB_NAME).header_offset + 100
    bad = tmp_path / "cut.gcomp"
    bad.write_bytes(Path(gcn_art).read_bytes()[:cut])
    assert "is not a gcomp artifact or is truncated (no manifest.json)" in _err(
        ["info", str(bad)], capsys)
