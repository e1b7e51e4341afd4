"""Two products summed in one kernel, ``epilogue(x @ w + x2 @ w2)`` (``K2`` of the CPU
``matmul``; ``fuse_epilogues`` marks the second product, GraphSAGE's ``lin_r(x)``):
the kernels against float64 products, and GraphSAGE training against the same model
compiled without fusion."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import assert_bf16_step_close, bf16_bits, widen_bf16

from gcomp import models
from gcomp.codegen import dot_bf16_kernels
from gcomp.codegen.build import make_target
from gcomp.codegen.kernels import KernelSpec, define, target_definition
from gcomp.compiler import compile_model
from gcomp.passes import PassContext
from gcomp.runtime.cpu_features import host_flags
from gcomp.runtime.synthetic import synthetic_graph
from gcomp.runtime.trainer import Trainer

EPILOGUE = (("bias_add", (), 0, False), ("add", (), 1, False), ("relu", (), None, False))


def _operand(a, bf16: bool):
    if bf16:
        return tvm_ffi.from_dlpack(bf16_bits(a))._create_view(a.shape, "bfloat16")
    return tvm.runtime.tensor(a)


def _targets() -> list:
    """(label, target, dot products expected): this CPU's own kernels; with AVX-512 BF16,
    also its dot products (where it has AMX too, the dot products forced)."""
    out = [("host", {**make_target("llvm"), "mattr": ["-avx512bf16", "-amx-tile"]}, False)]
    if "avx512_bf16" in host_flags():
        out.append(("dot", {**make_target("llvm"),
                            "mattr": ["+avx512bf16", "-amx-tile", "-amx-bf16"]}, True))
    return out


@pytest.mark.parametrize("label,target,dot", _targets(), ids=[t[0] for t in _targets()])
@pytest.mark.parametrize("K,K2,M,n,bf16", [
    (32, 32, 32, 1000, ()), (32, 48, 40, 517, ()), (128, 32, 32, 9, ()),
    (32, 32, 128, 101, ()), (32, 32, 32, 1000, ("x", "x2")),
    (128, 32, 40, 333, ("x", "x2", "out")), (32, 30, 130, 77, ("x", "x2")),
    (32, 33, 32, 5, ("x", "x2")), (32, 32, 32, 70, ("x",))])
def test_two_products_match_float64(label, target, dot, K, K2, M, n, bf16):
    """Groups of rows and the last rows (n = 9, 5); K2 other than K, odd (33: pairs along
    k cannot take it, so the widened kernel does) and with a rest of pairs (30); column
    tiles (M = 128, 130); the epilogue (bias, a residual row, relu) on the sums of both;
    x and x2 in bfloat16 (dot products where both are), a bfloat16 output rounded once,
    and x2 kept float32 (the widened kernel)."""
    spec = KernelSpec.make("matmul", K=K, M=M, K2=K2, epilogue=EPILOGUE,
                           extras=("vec", "row"), bf16=bf16)
    func = define(spec, target)
    on_dots = dot_bf16_kernels.uses_dot(func.script())
    assert on_dots == (dot and "x2" in bf16 and K2 % 2 == 0)
    fn = tvm.compile(tvm.IRModule({spec.name: func}),
                     target=tvm.target.Target(target))[spec.name]
    rng = np.random.default_rng(K + K2 + M + n)
    x, x2 = (rng.standard_normal((n, k)).astype(np.float32) for k in (K, K2))
    w, w2 = (rng.standard_normal((k, M)).astype(np.float32) for k in (K, K2))
    b = rng.standard_normal(M).astype(np.float32)
    res = rng.standard_normal((n, M)).astype(np.float32)
    if "out" in bf16:
        out = tvm_ffi.from_dlpack(np.full((n, M), 0x7FC0, np.uint16))._create_view((n, M),
                                                                                  "bfloat16")
    else:
        out = tvm.runtime.tensor(np.full((n, M), np.nan, np.float32))
    fn(_operand(x, "x" in bf16), tvm.runtime.tensor(w), _operand(x2, "x2" in bf16),
       tvm.runtime.tensor(w2), tvm.runtime.tensor(b), tvm.runtime.tensor(res), out)

    def value(a, name):  # what the kernel multiplies: stored operands rounded, and the
        return widen_bf16(bf16_bits(a)) if name else a.astype(np.float64)  # dots' weights
    ref = np.maximum(value(x, "x" in bf16) @ value(w, on_dots)
                     + value(x2, "x2" in bf16) @ value(w2, on_dots) + b + res, 0)
    got = widen_bf16(out.numpy().view(np.uint16)) if "out" in bf16 else out.numpy()
    tol = 8e-3 if "out" in bf16 else 1e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def _sage(hidden: int):
    """3 layers, as on the arxiv-size graph (40 classes: no layer aggregates after its
    product, ``reorder_linear``)."""
    return models.build("sage", 24, hidden=hidden, out_channels=40, layers=3)


def _two_product_steps(art, plan) -> int:
    return sum(bool(art.specs[s["kernel"]].p.get("K2")) for s in plan.steps)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sage_trains_as_without_fusion(precision):
    """GraphSAGE (3 layers): the second and third layers' two products run as one kernel
    each, in inference and training.  float32: three training steps give the losses and
    gradients of the same model compiled without fusion, to rounding.  bfloat16 (where
    unfused, every intermediate is stored rounded): a step within bfloat16 rounding of
    both the unfused bfloat16 step and the float32 one."""
    m = _sage(32)
    fused = compile_model(m, train=True, precision=precision)
    plain = compile_model(m, train=True, precision=precision,
                          ctx=PassContext(disabled={"fuse_epilogues"}))
    assert _two_product_steps(fused, fused.plan) == 2
    assert _two_product_steps(fused, fused.train_plan) == 2
    assert '"product": true' in fused.ir["training"]
    g = synthetic_graph(300, 2400, 24, 40, seed=1)
    if precision == "bf16":
        fp32 = compile_model(m, train=True)
        assert_bf16_step_close({"bf16": Trainer(fused, g), "fp32": Trainer(fp32, g)})
        assert_bf16_step_close({"bf16": Trainer(fused, g), "fp32": Trainer(plain, g)})
        return
    tr = {k: Trainer(a, g) for k, a in (("fused", fused), ("plain", plain))}
    for _ in range(3):
        loss = {k: t.step() for k, t in tr.items()}
        assert abs(loss["fused"] - loss["plain"]) <= 1e-5 * abs(loss["plain"])
    g1, g2 = tr["fused"].gradients(), tr["plain"].gradients()
    for k in g2:
        err = np.abs(g1[k] - g2[k]).max() / (np.abs(g2[k]).max() + 1e-12)
        assert err < 1e-4, (k, err)


def test_products_the_row_groups_decline_run_apart():
    """Where the CPU's row-group kernel does not take a shape (Intel's AVX-512 tuning
    leaves 16 -> 16 products to the generic kernel), the second product runs as its own
    step and the epilogue adds it: the plan has no two-product kernel and trains as the
    model compiled without fusion."""
    skx = {"kind": "llvm", "mcpu": "skylake-avx512"}
    assert target_definition(KernelSpec.make("matmul", K=16, M=16, K2=16), skx) is None
    m = _sage(16)
    fused = compile_model(m, train=True, mcpu="skylake-avx512")
    assert _two_product_steps(fused, fused.train_plan) == 0
    assert '"product": true' in fused.ir["training"]  # the pass marked it all the same
    if "avx512f" not in host_flags():
        return  # compiled for Skylake: runs on an AVX-512 CPU only
    plain = compile_model(m, train=True, mcpu="skylake-avx512",
                          ctx=PassContext(disabled={"fuse_epilogues"}))
    g = synthetic_graph(200, 1500, 24, 40, seed=2)
    a, b = Trainer(fused, g), Trainer(plain, g)
    for _ in range(2):
        la, lb = a.step(), b.step()
        assert abs(la - lb) <= 1e-5 * abs(lb)
