"""Kernel definitions: what each kernel computes, in TensorIR, for any target.

A ``KernelSpec`` names a kernel kind and its static parameters (feature widths,
reduction, attributes).  ``define(spec)`` returns an unscheduled PrimFunc;
``gcomp/schedules/<target>.py`` then schedules it.  A kind whose best loop
structure differs by target may also have a definition for one target
(``definer(kind, target="llvm")``, ``define(spec, "llvm")``): it comes with its
loop kinds chosen and is not scheduled further; such a definer returns None for
parameters where the generic definition, scheduled, is faster.  Sizes that depend on the
graph (nodes ``n``, source rows ``m``, edges ``nnz``) are symbolic int64
variables, so one compiled kernel serves every graph.  Feature widths are
static: the CPU backend can only vectorize loops of static extent.

Graph arrays follow one convention everywhere (built by
``gcomp/runtime/graph.py``): edges are stored in CSR order (sorted by
destination, stable); ``indptr`` (int64, n+1) delimits each destination's
in-edges, ``indices`` (int32) holds their sources and ``rows`` (int32) their
destinations.  Edge tensors are stored in the same order, so reducing over a
node's in-edges is a contiguous segment.

Sparse kernels are written as a spatial block over (row, head, feature) whose
body loops over the row's edges and accumulates straight into the output
element: vectorizing the feature axis then keeps a row of accumulators in
vector registers (a separate local accumulator is shared across vector lanes
by TVM's vectorizer and gives wrong sums).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass

from tvm import ir, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as IB

from gcomp.errors import CompileError


@dataclass(frozen=True)
class KernelSpec:
    kind: str
    params: tuple  # sorted (key, value) pairs; values are JSON-able and hashable

    @staticmethod
    def make(kind: str, **params) -> "KernelSpec":
        return KernelSpec(kind, tuple(sorted((k, _freeze(v)) for k, v in params.items())))

    @property
    def p(self) -> dict:
        return dict(self.params)

    @property
    def name(self) -> str:
        """A readable, deterministic, unique symbol name."""
        digest = hashlib.sha1(json.dumps([self.kind, self.params]).encode()).hexdigest()[:8]
        return f"gc_{self.kind}_{digest}"


def _freeze(v):
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v


_DEFINERS = {}  # (kind, target or None) -> definition


def _definer_of(kind: str, target: str | None):
    """The definer registered for ``(kind, target)``, or None.  The definition modules
    register theirs when imported; they import this module, so they are imported here on
    first use rather than at its top (any of them may then be imported first)."""
    from gcomp.codegen import (aggregate_kernel, cpu_kernels, dense_kernels,  # noqa: F401
                               format_kernels, scatter_kernel, sparse_kernels)
    return _DEFINERS.get((kind, target))


def definer(kind: str, target: str | None = None):
    def reg(fn):
        _DEFINERS[(kind, target)] = fn
        return fn
    return reg


_STORED_BF16: frozenset = frozenset()  # float32 arguments of the kernel being defined
#                                        that are stored as bfloat16 (``spec.p["bf16"]``)


@contextmanager
def _stored_bf16(names):
    global _STORED_BF16
    saved, _STORED_BF16 = _STORED_BF16, frozenset(names)
    try:
        yield
    finally:
        _STORED_BF16 = saved


def env_knob(name: str, default: int, least: int = 1) -> int:
    """A tuning knob from the environment (docs/cuda.md): an integer >= ``least``, or a
    CompileError naming the variable (int() raised, or 0 divided by zero in TVM)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise CompileError(f"{name}={text!r}: a tuning knob takes an integer >= {least}")
    return value


def stored_bf16(name: str) -> bool:
    """Whether argument ``name`` of the kernel being defined is stored as bfloat16."""
    return name in _STORED_BF16


def bound(value):
    """``T.Bind(value)``, or for a bfloat16 load the load widened to float32, unbound:
    TVM 0.27's bfloat16 storage legalization miscompiles a variable bound to a widened
    load (the kernel reads garbage), and LLVM hoists the repeated load itself."""
    if str(value.ty) == "bfloat16":
        return tirx.Cast("float32", value)
    return IB.Bind(value)


@contextmanager
def importing_llvm(text: str):
    """The body it wraps may call (``call_extern``) the LLVM functions of ``text``,
    imported with TVM's ``pragma_import_llvm``; nothing is imported for an empty text."""
    if not text:
        yield
        return
    with IB.attr(tirx.const(0, "int32"), "pragma_import_llvm", ir.StringImm(text)):
        yield


def arg(name: str, shape, dtype: str):
    """A buffer argument, named ``name``, of the PrimFunc an IRBuilder is building.  A
    float32 argument the spec stores as bfloat16 is declared so: TVM widens what the
    kernel loads from it to float32 (arithmetic with float32 operands) and rounds what it
    stores into it once, so the kernel body is written for float32 alone."""
    if dtype == "float32" and name in _STORED_BF16:
        dtype = "bfloat16"
    buf = IB.match_buffer(IB.arg(name, IB.handle()), shape, dtype, align=4)
    IRBuilder.name(name, buf)
    return buf


def cpu_tuning(target: dict) -> str:
    """Which measured table sizes the register tiles of the CPU definitions: ``avx512`` for
    CPUs that run 512-bit vectors at full width (Intel's AVX-512 cores: 32 registers of 16
    floats, two 512-bit multiply-add units), ``default`` for AMD's AVX-512 cores (Zen 4 and
    later: 32 registers, 512-bit vectors run as two 256-bit halves), ``avx2`` for CPUs
    without AVX-512 (16 registers of 8 floats: tiles sized for 32 registers spill).  It
    chooses loop structures only; the instructions are LLVM's for the target's ``mcpu``."""
    import tvm
    from tvm.target import codegen
    if target["kind"] != "llvm":
        return "default"
    if not codegen.target_has_features("avx512f", tvm.target.Target(target)):
        return "avx2"
    return "default" if str(target.get("mcpu", "")).startswith("znver") else "avx512"


def has_amx(target: dict) -> bool:
    """Whether ``target`` has Intel AMX tiles with bfloat16 products
    (``gcomp/codegen/amx_kernels.py``)."""
    import tvm
    from tvm.target import codegen
    return target["kind"] == "llvm" and all(
        codegen.target_has_features(f, tvm.target.Target(target)) for f in ("amx-tile", "amx-bf16"))


def has_dot_bf16(target: dict) -> bool:
    """Whether ``target`` has AVX-512 BF16 dot products but no AMX tiles
    (``gcomp/codegen/dot_bf16_kernels.py``)."""
    import tvm
    from tvm.target import codegen
    return target["kind"] == "llvm" and not has_amx(target) and \
        codegen.target_has_features("avx512bf16", tvm.target.Target(target))


def target_definition(spec: KernelSpec, target: dict | str):
    """``target``'s own PrimFunc for ``spec`` (already scheduled), named ``spec.name``, or
    None: the kind has none for the target, or its definer declines these parameters.
    A definer with a ``tuning`` parameter gets the target's ``cpu_tuning``, one with an
    ``amx`` parameter whether it ``has_amx``, one with a ``dot_bf16`` parameter whether it
    ``has_dot_bf16``."""
    if isinstance(target, str):  # a kind: that kind's target for this machine
        from gcomp.codegen.build import make_target
        target = make_target(target)
    fn = _definer_of(spec.kind, target["kind"])
    if fn is None:
        return None
    params = spec.p
    if "tuning" in inspect.signature(fn).parameters:
        params["tuning"] = cpu_tuning(target)
    if "amx" in inspect.signature(fn).parameters:
        params["amx"] = has_amx(target)
    if "dot_bf16" in inspect.signature(fn).parameters:
        params["dot_bf16"] = has_dot_bf16(target)
    func = _call(fn, spec, params)
    return None if func is None else func.with_attr("global_symbol", spec.name)


def define(spec: KernelSpec, target: dict | str | None = None):
    """The PrimFunc of ``spec`` named ``spec.name``: ``target``'s own definition if it has
    one for these parameters (already scheduled), else the generic, unscheduled one."""
    func = target_definition(spec, target) if target is not None else None
    if func is not None:
        return func
    fn = _definer_of(spec.kind, None)
    if fn is None:
        raise CompileError(f"no kernel definition for {spec.kind!r}")
    return _call(fn, spec, spec.p).with_attr("global_symbol", spec.name)


def _call(fn, spec: KernelSpec, params: dict):
    """``fn(**params)`` with the arguments ``params["bf16"]`` names stored as bfloat16;
    a CompileError if the definition did not declare each of them (it names its
    arguments some other way)."""
    stored = params.pop("bf16", ())
    with _stored_bf16(stored):
        try:
            func = fn(**params)
        except Exception as e:  # a definition whose expressions need float32 operands
            if not stored:
                raise
            raise CompileError(f"kernel {spec.kind}: arguments {sorted(stored)} cannot be "
                               f"stored as bfloat16 ({e})") from e
    if func is not None and stored:
        got = {name for name, dtype in param_dtypes(func).items() if dtype == "bfloat16"}
        if got != set(stored):
            raise CompileError(f"kernel {spec.kind}: arguments {sorted(set(stored) - got)} "
                               "cannot be stored as bfloat16")
    return func


def param_dtypes(func) -> dict:
    """Argument name -> element dtype of a PrimFunc's buffer arguments."""
    return {p.name: str(p.ty.dtype) for p in func.params if hasattr(p.ty, "dtype")}

