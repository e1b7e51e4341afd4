"""The AMX tile products of ``--precision bf16`` (``gcomp/codegen/amx_kernels.py``), against
float64 products of the same bfloat16-rounded operands.  Skipped on CPUs without AMX-BF16
(the refusal to load such an artifact there is tested everywhere)."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import assert_bf16_step_close, bf16_bits, widen_bf16

from gcomp import models
from gcomp.codegen import amx_kernels
from gcomp.codegen.build import make_target
from gcomp.codegen.kernels import KernelSpec, define
from gcomp.compiler import compile_model
from gcomp.errors import ArtifactError
from gcomp.runtime import artifact as artifact_mod
from gcomp.runtime.cpu_features import AMX_MATTR, enable_amx, host_has_amx
from gcomp.runtime.synthetic import synthetic_graph
from gcomp.runtime.trainer import Trainer

amx = pytest.mark.skipif(not host_has_amx() or enable_amx() is not None,
                         reason="no AMX-BF16 tiles on this CPU / OS")


def _amx_target() -> dict:
    return {**make_target("llvm"), "mattr": list(AMX_MATTR)}


@amx
@pytest.mark.parametrize("K,M,n", [(32, 32, 1000), (128, 32, 333), (40, 32, 517),
                                   (32, 40, 250), (64, 64, 77), (32, 32, 9), (128, 384, 100),
                                   (40, 128, 40)])
def test_tile_product_matches_float64(K, M, n):
    """Full groups of 16 rows and the last rows; k ranges of 32 and a rest (K = 40);
    output columns padded to a tile (M = 40); fewer rows than a group (n = 9); column
    blocks (384 columns in 4 blocks of 6 tiles; 128 with two k range shapes in 2 of 4).  The
    epilogue (bias, a residual row, relu) runs on the float32 sums."""
    epilogue = (("bias_add", (), 0, False), ("add", (), 1, False), ("relu", (), None, False))
    spec = KernelSpec.make("matmul", K=K, M=M, epilogue=epilogue, extras=("vec", "row"),
                           bf16=("x",))
    func = define(spec, _amx_target())
    assert "tdpbf16ps" in func.script()
    fn = tvm.compile(tvm.IRModule({spec.name: func}), target=tvm.target.Target(_amx_target()))
    rng = np.random.default_rng(K + M + n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    res = rng.standard_normal((n, M)).astype(np.float32)
    xb = bf16_bits(x)
    out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32), tvm.cpu())
    fn[spec.name](tvm_ffi.from_dlpack(xb)._create_view((n, K), "bfloat16"),
                  tvm.runtime.tensor(w), tvm.runtime.tensor(b), tvm.runtime.tensor(res), out)
    ref = np.maximum(widen_bf16(xb) @ widen_bf16(bf16_bits(w)) + b + res, 0)
    got = out.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@amx
@pytest.mark.parametrize("K,M,n,stored", [(128, 32, 1000, ("x",)), (64, 40, 517, ("x",)),
                                          (128, 32, 77, ("x", "y")), (72, 32, 300, ("y",)),
                                          (96, 32, 5, ("x",)), (128, 32, 5000, ("x", "y")),
                                          (32, 40, 4999, ("x", "y")), (32, 32, 2100, ("x", "y")),
                                          (72, 40, 3001, ("x", "y"))])
def test_tile_weight_gradient_matches_float64(K, M, n, stored):
    """x.T @ y over rows in 16 ranges (ranges of a few rows, and of none, at n = 5; rows
    packed 128 at a time, the last pack partial); an operand stored as float32 is rounded
    to bfloat16 as it is packed; K and M padded to tiles (72, 40).  With y stored as
    bfloat16, whole packs of its rows are transposed by gathers (n >= 2,100: ranges of
    more than 128 rows), the last one value by value; short x rows (K = 32) take the
    tiles then."""
    spec = KernelSpec.make("matmul_tn", K=K, M=M, bf16=stored)
    func = define(spec, _amx_target())
    assert "tdpbf16ps" in func.script()
    assert ("gather.dpi" in func.script()) == ("y" in stored)
    fn = tvm.compile(tvm.IRModule({spec.name: func}), target=tvm.target.Target(_amx_target()))
    rng = np.random.default_rng(K * M + n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y = rng.standard_normal((n, M)).astype(np.float32)

    def operand(a, name):
        if name in stored:
            return tvm_ffi.from_dlpack(bf16_bits(a))._create_view(a.shape, "bfloat16")
        return tvm.runtime.tensor(a)
    out = tvm.runtime.tensor(np.full((K, M), np.nan, np.float32), tvm.cpu())
    fn[spec.name](operand(x, "x"), operand(y, "y"), out)
    ref = widen_bf16(bf16_bits(x)).T @ widen_bf16(bf16_bits(y))
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_tile_shapes_within_the_hardware():
    assert amx_kernels.supported(32, 32) and amx_kernels.supported(40, 384)
    assert not amx_kernels.supported(33, 32)   # k pairs
    assert amx_kernels._column_blocks(32, 80) == [(0, 5)]   # 5 sums tiles, x and weight
    assert amx_kernels._column_blocks(32, 112) == [(0, 6), (6, 1)]
    assert amx_kernels._column_blocks(40, 80) == [(0, 4), (4, 1)]  # two k range shapes
    assert amx_kernels.k_ranges(72) == [(0, 32), (32, 32), (64, 8)]
    assert amx_kernels.tn_shape(128, 32) == (32, 128, 32)  # 4 sums tiles, 2 y.T, 1 x
    assert amx_kernels.tn_shape(64, 40) == (48, 64, 16)
    assert amx_kernels.tn_shape(128, 64) is None          # 4 y.T tiles leave too few
    assert amx_kernels.tn_shape(32, 32) is None           # packing outweighs the product
    assert amx_kernels.tn_shape(32, 32, gathered=True) == (32, 32, 32)  # unless gathered
    assert amx_kernels.tn_shape(16, 32, gathered=True) is None


@amx
def test_bf16_training_on_tiles_matches_float32(monkeypatch):
    """Hidden width 32: the products run on tiles; a training step's loss and weight
    gradients stay within bfloat16 rounding of the float32 artifact's."""
    g = synthetic_graph(700, 5000, 32, 4, seed=3)
    m = models.build("gin", 32, hidden=32, out_channels=4, layers=2)
    tiles = []
    define_tiles = amx_kernels.matmul_amx
    monkeypatch.setattr(amx_kernels, "matmul_amx",
                        lambda *a: tiles.append(a) or define_tiles(*a))
    arts = {p: compile_model(m, train=True, precision=p) for p in ("fp32", "bf16")}
    assert tiles and {(K, M) for K, M, *_ in tiles} >= {(32, 32)}
    assert arts["bf16"].manifest["cpu_features"] == ["amx"]
    assert arts["fp32"].manifest["cpu_features"] == []
    tr = {p: Trainer(a, g) for p, a in arts.items()}
    assert_bf16_step_close(tr)


def test_loading_refuses_tiles_the_os_does_not_grant(tmp_path, monkeypatch):
    """An artifact whose products run on tiles, loaded where Linux does not grant them (or
    the CPU has none), is refused with the reason, before any kernel runs."""
    m = models.build("gcn", 8, hidden=8, out_channels=2, layers=2)
    art = compile_model(m)
    art.manifest["cpu_features"] = ["amx"]
    monkeypatch.setattr(artifact_mod, "enable_amx", lambda: "this CPU has no AMX-BF16 tiles")
    with pytest.raises(ArtifactError, match="AMX tiles, and this CPU has no AMX-BF16"):
        art.library()


@amx
def test_info_reports_the_tiles(tmp_path, capsys):
    """`gcomp compile --precision bf16` on this CPU: `gcomp info` names the tiles; the
    saved artifact, loaded afresh, runs them within bfloat16 rounding of float32's."""
    import json

    from gcomp.cli import main
    from gcomp.runtime.artifact import load
    path = tmp_path / "gin16.gcomp"
    assert main(["compile", "gin", "--in", "64", "--hidden", "32", "--out", "4", "--layers",
                 "2", "--precision", "bf16", "-o", str(path)]) == 0
    capsys.readouterr()
    assert main(["info", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_features"] == ["amx"]
    assert main(["info", str(path)]) == 0
    assert "products on AMX tiles" in capsys.readouterr().out
    assert main(["compile", "gin", "--in", "64", "--hidden", "32", "--out", "4", "--layers",
                 "2", "-o", str(tmp_path / "gin.gcomp")]) == 0
    g = synthetic_graph(300, 2000, 64, 4, seed=1)
    got = load(path).run(g)[0]
    want = load(tmp_path / "gin.gcomp").run(g)[0]
    assert np.abs(got - want).max() < 3e-2 * np.abs(want).max()


@amx
def test_features_rounded_once_per_feed_for_the_tile_products():
    """The first layer's products read a bfloat16 copy of the features that a feed step
    makes (the tiles cannot round float32 rows as fast as they multiply them): x itself
    is read by that step alone, features fed again are rounded again, and with sparse
    features the sparse-feature kernels run instead and the copy is not made."""
    from gcomp.runtime.executor import Executor
    m = models.build("gin", 128, hidden=32, out_channels=4, layers=2)
    fp32 = compile_model(m, train=True)
    art = compile_model(m, train=True, precision="bf16", sparse_threshold=0.9)
    plan = art.train_plan
    rounding = [s for s in plan.feed_steps if s["op"] == "round_rows"]
    assert [s["args"] for s in rounding] == [[{"buf": "x"}, {"buf": "x.bf16"}]]
    assert plan.buffers["x.bf16"]["dtype"] == "bfloat16"
    readers = [s for s in plan.steps if any(a.get("buf") == "x.bf16" for a in s["args"])]
    assert {s["op"] for s in readers} == {"matmul"} and len(readers) == 2  # x @ W, x.T @ dY
    assert not any(a.get("buf") == "x" for s in plan.steps for a in s["args"])
    g = synthetic_graph(500, 4000, 128, 4, seed=2)
    rng = np.random.default_rng(0)
    feeds = (g.dense_x(), rng.standard_normal((500, 128)).astype(np.float32))
    outs = {}
    for name, a in (("fp32", fp32), ("bf16", art)):
        ex = Executor(a.plan, a.library(), a.params)
        b = ex.bind(g)
        for k, x in enumerate(feeds):
            b = ex.feed(b, {"x": x})
            ex.execute(b)
            outs[name, k] = ex.outputs(b)[0]
    for k in range(2):
        want = outs["fp32", k]
        assert np.abs(outs["bf16", k] - want).max() < 3e-2 * np.abs(want).max()
    assert np.abs(outs["bf16", 0] - outs["bf16", 1]).max() > 0.1 * np.abs(outs["fp32", 1]).max()
    sparse = synthetic_graph(500, 4000, 128, 4, seed=2)
    xs = sparse.dense_x()
    xs[rng.random(xs.shape) < 0.97] = 0
    ex = Executor(art.plan, art.library(), art.params)
    b = ex.feed(ex.bind(sparse, {"x": xs}), {"x": xs})
    assert "round_rows" not in {s["op"] for s, _, _ in b.feed_steps}
    ex.execute(b)
    ref = Executor(fp32.plan, fp32.library(), fp32.params)
    rb = ref.feed(ref.bind(sparse, {"x": xs}), {"x": xs})
    ref.execute(rb)
    want = ref.outputs(rb)[0]
    assert np.abs(ex.outputs(b)[0] - want).max() < 3e-2 * np.abs(want).max()
