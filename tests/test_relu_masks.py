"""A ReLU's gradient from its packed signs (``pack_relu_masks``, ``--prefer memory``): the
ops against numpy, the kernels against the ops, the pass alone, the compiler's choice by
the arena it plans, and training through it against the build without it."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import awkward_graph, bf16_bits, widen_bf16
from test_training import labelled

import gcomp.models as models
from gcomp.codegen.build import make_target, schedule_module
from gcomp.codegen.kernels import KernelSpec
from gcomp.compiler import compile_model
from gcomp.ir.interpreter import sign_bits, unpack_bits
from gcomp.ir.parser import parse_graph
from gcomp.ir.printer import print_graph
from gcomp.passes import PackReluMasks, PassContext, PassManager
from gcomp.runtime.trainer import Trainer

MEMORY = PassContext(options={"prefer": "memory"})


def _values(n, F, seed):
    """Positive, negative, +0 and -0 entries (-0 is not > 0)."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((n, F))
    y[rng.random((n, F)) < 0.2] = 0.0
    y[rng.random((n, F)) < 0.1] = -0.0
    return y


@pytest.mark.parametrize("F", [1, 31, 32, 33, 70])
def test_signs_round_trip(F):
    y = _values(9, F, F)
    bits = sign_bits(y)
    assert bits.dtype == np.int32 and bits.shape == (9, -(-F // 32))
    assert (unpack_bits(bits, F) == (y > 0)).all()
    words = bits.view(np.uint32).astype(np.int64)  # bit 31 set: a negative word
    expect = [[sum(1 << b for b in range(32) if 32 * w + b < F and y[i, 32 * w + b] > 0)
               for w in range(bits.shape[1])] for i in range(9)]
    assert (words == np.array(expect)).all()


class _Operand:
    """A kernel argument from float32 values: stored as they are, or as bfloat16 bits the
    tensor views (64-byte aligned; the bits and the tensor they were imported as are held
    here, so the kernel never touches freed memory)."""

    def __init__(self, a: np.ndarray, bf16: bool):
        if bf16:  # on 64 bytes, as the generic kernels assume of every argument
            raw = np.empty(a.size + 32, np.uint16)
            skip = (-raw.ctypes.data % 64) // 2
            self.host = raw[skip:skip + a.size].reshape(a.shape)
            self.host[...] = bf16_bits(a)
            assert self.host.ctypes.data % 64 == 0
            self.imported = tvm_ffi.from_dlpack(self.host)
            self.tensor = self.imported._create_view(a.shape, "bfloat16")
        else:
            self.host = np.ascontiguousarray(a, np.float32)
            self.tensor = tvm.runtime.tensor(self.host)

    def values(self) -> np.ndarray:
        """What the kernel left there, in float64."""
        if self.host.dtype == np.uint16:
            return widen_bf16(self.host)
        return self.tensor.numpy().astype(np.float64)


@pytest.mark.parametrize("stored", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("F", [1, 8, 32, 40, 70])
def test_kernels_equal_the_ops(F, stored):
    """``sign_bits`` and ``mask_bits`` compiled for this CPU (F within a word, past one,
    a partial last word; activations stored as bfloat16 or float32) against the
    interpreter's ops on the values the kernels read."""
    n = 203
    y = _values(n, F, 7).astype(np.float32)
    dy = np.random.default_rng(8).standard_normal((n, F)).astype(np.float32)
    s1 = KernelSpec.make("sign_bits", F=F, **({"bf16": ("x",)} if stored else {}))
    s2 = KernelSpec.make("mask_bits", F=F, **({"bf16": ("dy", "ewise")} if stored else {}))
    tgt = make_target("llvm")
    lib = tvm.compile(schedule_module({s1.name: s1, s2.name: s2}, tgt),
                      target=tvm.target.Target(tgt))
    words = tvm.runtime.tensor(np.zeros((n, -(-F // 32)), np.int32))
    y_in, dy_in = _Operand(y, stored), _Operand(dy, stored)
    out = _Operand(np.full((n, F), 7.0, np.float32), stored)
    lib[s1.name](y_in.tensor, words)
    assert (words.numpy() == sign_bits(y_in.values())).all()
    lib[s2.name](dy_in.tensor, words, out.tensor)
    assert (out.values() == np.where(y_in.values() > 0, dy_in.values(), 0.0)).all()


PACK_BEFORE = """graph t(%x: f32[N,8], %g: graph<coo>, %dy: f32[N,40]) {
  %w = param : f32[8,40]
  %p = matmul(%x, %w) : f32[N,40]
  %y = relu(%p) : f32[N,40]
  %loss = sum[axis=0](%y) : f32[40]
  %dw = matmul[trans_a=true](%y, %dy) : f32[40,40]
  %m = mul(%dy, %dy) : f32[N,40]
  %a = aggregate(%g, %m) : f32[N,40]
  %dp = elementwise_grad[op="relu", of_output=true](%a, %y) : f32[N,40]
  return %loss, %dw, %dp
}"""


def _pass(text, ctx=MEMORY):
    g = parse_graph(text)
    PassManager([PackReluMasks()])(g, ctx)
    return print_graph(g)


def test_the_gradient_reads_the_signs_when_the_output_is_held_for_its_mask_alone():
    """y's last value reader (its weight gradient) comes before a node-sized buffer made
    and read (m, aggregated) ahead of y's gradient: y's signs are taken just after y and
    the gradient masks with them, under the gradient's name."""
    expected = """graph t(%x: f32[N,8], %g: graph<coo>, %dy: f32[N,40]) {
  %w = param : f32[8,40]
  %p = matmul(%x, %w) : f32[N,40]
  %y = relu(%p) : f32[N,40]
  %y.signs = sign_bits(%y) : i32[N,2]
  %loss = sum[axis=0](%y) : f32[40]
  %dw = matmul[trans_a=true](%y, %dy) : f32[40,40]
  %m = mul(%dy, %dy) : f32[N,40]
  %a = aggregate(%g, %m) : f32[N,40]
  %dp = mask_bits(%a, %y.signs) : f32[N,40]
  return %loss, %dw, %dp
}"""
    assert _pass(PACK_BEFORE) == print_graph(parse_graph(expected))


@pytest.mark.parametrize("case", ["speed", "read_after", "nothing_between", "output"])
def test_nothing_changes_where_the_signs_free_nothing(case):
    """Preferring speed; y read after its gradient (it lives on anyway); nothing made and
    freed between y's last value reader and its gradient (GCN's layer: the product that
    reads y is the one before the masked one); y a model output."""
    text, ctx = PACK_BEFORE, MEMORY
    if case == "speed":
        ctx = PassContext()
    elif case == "read_after":
        text = text.replace("  return %loss, %dw, %dp", "  %late = mul(%dp, %y) : f32[N,40]\n"
                            "  return %loss, %dw, %late")
    elif case == "nothing_between":
        text = text.replace("elementwise_grad[op=\"relu\", of_output=true](%a, %y)",
                            "elementwise_grad[op=\"relu\", of_output=true](%dy, %y)")
        text = text.replace("  %m = mul(%dy, %dy) : f32[N,40]\n  %a = aggregate(%g, %m) : "
                            "f32[N,40]\n", "")
    else:
        text = text.replace("return %loss, %dw, %dp", "return %loss, %dw, %dp, %y")
    assert _pass(text, ctx) == print_graph(parse_graph(text))


def _arxiv_like(name, dropout=0.0):
    return models.build(name, 128, hidden=32, out_channels=40, layers=3, dropout=dropout,
                        seed=1)


def _steps(art, op):
    return [s for s in art.train_plan.steps if s["op"] == op]


@pytest.mark.parametrize("name,packed", [("sage", True), ("gcn", False), ("gin", False)])
def test_the_compiler_keeps_the_signs_where_the_arena_shrinks(name, packed):
    """GraphSAGE (3 layers, hidden 32, as benchmarked): each hidden activation, read last
    by its layer's weight gradients, is held through the aggregation of the input
    gradient, the busiest step: packed, the planned arena shrinks.  GCN's and GIN's
    busiest steps hold no such activation: the plan without the pass is kept (equal or
    smaller arena, fewer kernels)."""
    from gcomp.runtime.memory import nominal_arena_bytes
    art = compile_model(_arxiv_like(name), train=True, ctx=MEMORY)
    plain = compile_model(_arxiv_like(name), train=True,
                          ctx=PassContext(options={"prefer": "memory"},
                                          disabled={"pack_relu_masks"}))
    assert bool(_steps(art, "mask_bits")) == packed
    assert len(_steps(art, "sign_bits")) == (2 if packed else 0)
    assert not _steps(plain, "mask_bits")
    ours, theirs = nominal_arena_bytes(art.train_plan), nominal_arena_bytes(plain.train_plan)
    assert ours < theirs if packed else ours == theirs
    if packed:  # one [N, 32] float32 buffer less, less the words
        assert theirs - ours >= 100_000 * (32 * 4 - 2 * 4) - 4096


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_with_the_signs_equals_training_without(precision):
    """GraphSAGE with and without the pass, three Adam steps on the same graph: the same
    losses and weights, bit for bit (the mask selects dy or 0 either way; in bfloat16 dy is
    rounded once before or after it, to the same value)."""
    g = labelled(awkward_graph(num_nodes=300, num_edges=2400, num_features=128, seed=4), 40)
    runs = {}
    for packed in (True, False):
        ctx = PassContext(options={"prefer": "memory"},
                          disabled=() if packed else {"pack_relu_masks"})
        art = compile_model(_arxiv_like("sage"), train=True, ctx=ctx, precision=precision)
        assert bool(_steps(art, "mask_bits")) == packed
        tr = Trainer(art, g, seed=0)
        runs[packed] = ([tr.step() for _ in range(3)], tr.parameters())
    assert runs[True][0] == runs[False][0]
    for k, v in runs[False][1].items():
        assert np.array_equal(runs[True][1][k], v), k
