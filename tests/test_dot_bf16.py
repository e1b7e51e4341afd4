"""The AVX-512 BF16 dot-product kernels of ``--precision bf16`` on CPUs without AMX tiles
(``gcomp/codegen/dot_bf16_kernels.py``), against float64 products of the same
bfloat16-rounded operands.  The kernels run where this CPU has ``avx512_bf16``; that they
compile to ``vdpbf16ps`` for such a CPU, and what the compiler picks for it, is checked
on every machine."""

import json
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import assert_bf16_step_close, bf16_bits, widen_bf16

from gcomp import models
from gcomp.codegen import dot_bf16_kernels, precision
from gcomp.codegen.build import make_target
from gcomp.codegen.kernels import KernelSpec, define, has_amx, has_dot_bf16
from gcomp.compiler import compile_model
from gcomp.passes import PassContext
from gcomp.runtime.cpu_features import host_flags, host_has_amx
from gcomp.runtime.synthetic import synthetic_graph
from gcomp.runtime.trainer import Trainer

ZEN4 = {"kind": "llvm", "mcpu": "znver4"}  # AVX-512 BF16, no AMX
here = pytest.mark.skipif("avx512_bf16" not in host_flags(),
                          reason="this CPU has no AVX-512 BF16 dot products")


def _host_dot_target() -> dict:
    """This CPU, with its dot products used even where it also has AMX tiles (or LLVM
    names it older than its flags show)."""
    return {**make_target("llvm"), "mattr": ["+avx512bf16", "-amx-tile", "-amx-bf16"]}


def _operand(a, bf16: bool):
    if bf16:
        return tvm_ffi.from_dlpack(bf16_bits(a))._create_view(a.shape, "bfloat16")
    return tvm.runtime.tensor(a)


def _build(spec, target):
    func = define(spec, target)
    assert dot_bf16_kernels.uses_dot(func.script())
    return tvm.compile(tvm.IRModule({spec.name: func}),
                       target=tvm.target.Target(target))[spec.name]


def test_the_target_picks_the_dot_products():
    """Zen 4 (no AMX) gets them; a CPU with AMX keeps its tiles; a CPU without AVX-512
    BF16 gets neither."""
    assert has_dot_bf16(ZEN4) and not has_amx(ZEN4)
    assert not has_dot_bf16({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert has_amx({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert not has_dot_bf16({"kind": "llvm", "mcpu": "znver3"})
    assert not has_dot_bf16({"kind": "cuda", "arch": "sm_90"})


@pytest.mark.parametrize("kind,stored", [("matmul", ("x",)), ("matmul_tn", ("x", "y")),
                                         ("matmul_tn", ("y",))])
def test_compiles_to_vdpbf16ps_for_zen4(kind, stored):
    """On any machine: the kernels for Zen 4 contain the instruction (the imported LLVM
    function inlined), and the float32 ones do not."""
    spec = KernelSpec.make(kind, K=32, M=40, bf16=stored)
    lib = tvm.compile(tvm.IRModule({spec.name: define(spec, ZEN4)}),
                      target=tvm.target.Target(ZEN4))
    asm = (lib.mod if hasattr(lib, "mod") else lib).inspect_source("asm")
    assert "vdpbf16ps" in asm
    assert not re.search(rf"call\w*\s+{dot_bf16_kernels.DOT}", asm)  # inlined
    f32 = KernelSpec.make(kind, K=32, M=40)
    assert not dot_bf16_kernels.uses_dot(define(f32, ZEN4).script())


@here
@pytest.mark.parametrize("K,M,n,out_bf16,round_x", [
    (32, 32, 1000, False, False), (128, 32, 333, True, False), (40, 32, 517, False, False),
    (32, 40, 250, True, False), (32, 17, 9, False, False), (32, 128, 101, True, False),
    (10, 20, 3, False, False), (64, 200, 70, False, False), (1432, 64, 50, True, False),
    (64, 1433, 20, False, False), (128, 32, 333, True, True), (40, 32, 517, False, True),
    (10, 20, 3, False, True), (64, 200, 70, True, True), (1432, 64, 50, True, True)])
def test_product_matches_float64(K, M, n, out_bf16, round_x):
    """Groups of 8 rows and the last rows (n = 9, 3: rows past n repeat the last and are
    not stored); columns padded to 16 (M = 17, 40, 200); tiles of 64 columns in groups of 4
    rows (M = 128, 200: three tiles of 64 in a loop and one of 8; 1,433: 22 and one of 25);
    K = 10, five pairs: a prefetch step of 4 and one more; Cora-wide rows (K = 1,432); the
    epilogue (bias, a residual row, relu) on the float32 sums; a bfloat16 output rounded
    once.  ``round_x``: x float32, each group's rows rounded as read (16, 8 and single
    values: K = 40, 10, 1,432; again for each column tile: M = 200)."""
    epilogue = (("bias_add", (), 0, False), ("add", (), 1, False), ("relu", (), None, False))
    stored = (() if round_x else ("x",)) + (("out",) if out_bf16 else ())
    spec = KernelSpec.make("matmul", K=K, M=M, epilogue=epilogue, extras=("vec", "row"),
                           bf16=stored, **({"round_x": True} if round_x else {}))
    fn = _build(spec, _host_dot_target())
    rng = np.random.default_rng(K + M + n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal(M).astype(np.float32)
    res = rng.standard_normal((n, M)).astype(np.float32)
    if out_bf16:
        out = tvm_ffi.from_dlpack(np.full((n, M), 0x7FC0, np.uint16))._create_view((n, M),
                                                                                  "bfloat16")
    else:
        out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
    fn(_operand(x, not round_x), tvm.runtime.tensor(w), tvm.runtime.tensor(b),
       tvm.runtime.tensor(res), out)
    ref = np.maximum(widen_bf16(bf16_bits(x)) @ widen_bf16(bf16_bits(w)) + b + res, 0)
    got = widen_bf16(out.numpy().view(np.uint16)) if out_bf16 else out.numpy()
    assert np.isfinite(got).all()
    tol = 8e-3 if out_bf16 else 1e-5  # a bfloat16 output: one rounding
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


@here
@pytest.mark.parametrize("K,M,n,stored,sum_row", [
    (128, 32, 1000, ("x", "y"), False), (128, 32, 5001, ("x", "y"), True),
    (32, 40, 4999, ("x", "y"), True), (33, 17, 1001, ("y",), False),
    (16, 48, 1000, ("x",), True), (7, 5, 1001, ("x", "y"), True), (32, 32, 5, ("x", "y"), False),
    (128, 128, 700, ("x", "y"), False), (40, 32, 2, ("x",), True), (32, 32, 1, ("x", "y"), True),
    (80, 200, 1001, ("x", "y"), True), (1433, 64, 301, ("y",), True)])
def test_weight_gradient_matches_float64(K, M, n, stored, sum_row):
    """x.T @ y in pairs of rows over 16 ranges: an odd n's last pair is one row and a zero
    row; ranges of a few pairs and of none (n = 1, 2, 5); blocks of 16 pairs and a partial
    last block (n = 5,001: prefetching the next block); a float32 operand rounded as it is
    packed; rows of fewer than 16 values or with a rest (K = 7, 33, M = 5, 17, 40), whose
    last group reads into the next row except on the last row; two column tiles (M =
    128; 200: three tiles of 64 and one of 8, shapes the float32 kernel leaves to the
    generic one), Cora-wide rows (K = 1,433: 179 row tiles of 8 in a loop and one of 1;
    unrolled tile by tile, LLVM took minutes); and a last row of y's column sums (a bias
    gradient)."""
    spec = KernelSpec.make("matmul_tn", K=K, M=M, bf16=stored, sum_row=sum_row)
    fn = _build(spec, _host_dot_target())
    rng = np.random.default_rng(K * M + n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y = rng.standard_normal((n, M)).astype(np.float32)
    R = K + int(sum_row)
    out = tvm.runtime.tensor(np.full((R, M), np.nan, np.float32))
    fn(_operand(x, "x" in stored), _operand(y, "y" in stored), out)
    xr, yr = widen_bf16(bf16_bits(x)), widen_bf16(bf16_bits(y))
    ref = xr.T @ yr
    if sum_row:
        ref = np.vstack([ref, yr.sum(0)])
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_features_rounded_for_the_dot_products():
    """On any machine, for Zen 4: the first layer's products read the features' bfloat16
    copy (rounded once per feed, as for AMX tiles), run on dot products, and the artifact
    says so; float32 artifacts do not."""
    m = models.build("gin", 128, hidden=32, out_channels=4, layers=2)
    art = compile_model(m, train=True, precision="bf16", target="llvm", mcpu="znver4")
    plan = art.train_plan
    assert [s["args"] for s in plan.feed_steps if s["op"] == "round_rows"] == \
        [[{"buf": "x"}, {"buf": "x.bf16"}]]
    readers = [s for s in plan.steps if any(a.get("buf") == "x.bf16" for a in s["args"])]
    assert {s["op"] for s in readers} == {"matmul"} and len(readers) == 2  # x @ W, x.T @ dY
    assert art.manifest["cpu_features"] == ["avx512_bf16"]
    assert compile_model(m, train=True, target="llvm", mcpu="znver4")\
        .manifest["cpu_features"] == []


def test_features_rounded_as_read_when_memory_is_preferred(monkeypatch):
    """On any machine, for Zen 4, with --prefer memory: no copy of the features; both
    products x @ W (the forward one and GIN's recomputed one for its eps gradient) read the
    float32 features and round them in the dot-product kernel (``round_x``); the weight
    gradient x.T @ dY runs on dot products too (dY stored as bfloat16)."""
    from gcomp import compiler
    seen = {}

    def store_bf16(plans, specs, tgt, **kw):
        seen.update(specs=specs)
        return precision.store_bf16(plans, specs, tgt, **kw)
    monkeypatch.setattr(compiler, "store_bf16", store_bf16)
    m = models.build("gin", 128, hidden=32, out_channels=4, layers=2)
    art = compile_model(m, train=True, precision="bf16", target="llvm", mcpu="znver4",
                        ctx=PassContext(options={"prefer": "memory"}))
    plan, specs = art.train_plan, seen["specs"]
    assert "x.bf16" not in plan.buffers and not plan.feed_steps
    readers = [specs[s["kernel"]] for s in plan.steps if s["args"][0].get("buf") == "x"]
    assert sorted(r.kind for r in readers) == ["matmul", "matmul", "matmul_tn"]
    for r in readers:
        assert r.p.get("round_x", False) == (r.kind == "matmul")
        assert "x" not in r.p.get("bf16", ())
        assert dot_bf16_kernels.uses_dot(define(r, ZEN4).script())


@here
@pytest.mark.skipif(host_has_amx(), reason="the AMX tiles take the products here (test_amx)")
def test_bf16_training_on_dot_products_matches_float32(tmp_path, capsys):
    """`gcomp compile --precision bf16` on this CPU: `gcomp info` names the dot products,
    and a GIN training step's loss and weight gradients stay within bfloat16 rounding of
    the float32 artifact's."""
    from gcomp.cli import main
    from gcomp.runtime.artifact import load
    path = tmp_path / "gin16.gcomp"
    flags = ["--in", "64", "--hidden", "32", "--out", "4", "--layers", "2", "--train"]
    assert main(["compile", "gin", *flags, "--precision", "bf16", "-o", str(path)]) == 0
    assert main(["compile", "gin", *flags, "-o", str(tmp_path / "gin.gcomp")]) == 0
    capsys.readouterr()
    assert main(["info", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cpu_features"] == ["avx512_bf16"]
    assert main(["info", str(path)]) == 0
    assert "products on AVX-512 BF16 dot products" in capsys.readouterr().out
    g = synthetic_graph(700, 5000, 64, 4, seed=3)
    tr = {p: Trainer(load(f), g) for p, f in (("bf16", path), ("fp32", tmp_path / "gin.gcomp"))}
    assert_bf16_step_close(tr)


def test_loading_refuses_dot_products_the_cpu_lacks(monkeypatch):
    """An artifact whose products run on AVX-512 BF16, loaded on a CPU without them (LLVM
    may not have named the CPU it was compiled on, so the target's instructions do not
    show them), is refused with the reason before any kernel runs."""
    from gcomp.errors import ArtifactError
    from gcomp.runtime import cpu_features
    m = models.build("gcn", 8, hidden=8, out_channels=2, layers=2)
    art = compile_model(m)
    art.manifest["cpu_features"] = ["avx512_bf16"]
    art.manifest["isa"] = []
    monkeypatch.setattr(cpu_features, "host_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(ArtifactError, match="AVX-512 BF16 dot products, and this CPU has none"):
        art.library()


def test_a_cpu_llvm_does_not_name_gets_its_dot_products(monkeypatch):
    """Under a hypervisor LLVM may name an older CPU than the one the kernel's flags show
    (as for AMX): a bf16 compile for this host then adds the dot products to the target
    and names them in the artifact."""
    from gcomp import compiler
    monkeypatch.setattr(compiler, "make_target",
                        lambda *a, **k: {"kind": "llvm", "mcpu": "skylake-avx512"})
    monkeypatch.setattr(compiler, "host_has_amx", lambda: False)
    monkeypatch.setattr(compiler, "host_has_dot_bf16", lambda: True)
    m = models.build("gcn", 64, hidden=32, out_channels=4, layers=2)
    art = compile_model(m, precision="bf16")
    assert art.target["mattr"] == ["+avx512bf16"]
    assert art.manifest["cpu_features"] == ["avx512_bf16"]
    assert not has_dot_bf16({"kind": "llvm", "mcpu": "skylake-avx512"})
