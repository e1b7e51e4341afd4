"""Runs gcomp's CUDA kernels on the CPU: the schedules' thread layouts checked where no
GPU is.

A CUDA kernel's arithmetic is checked everywhere by compiling its definition for the CPU
without a schedule (``tests/test_gpu_definitions.py``).  What that cannot see is the
schedule: which thread computes which element, what a block stages in shared memory and
when it synchronizes, which bound checks survive (TVM 0.27 drops one under a split that
does not divide; an H100 found it).  This module runs the code TVM generates for CUDA:

1. the kernel is scheduled as for ``-t cuda`` (``cuda_build.schedule_module``) and
   lowered to TVM's host function and device kernels;
2. the device kernels' CUDA source (as nvcc would get it) is compiled by the host C++
   compiler against ``EMULATION_HEADER``: every thread of a block is a host thread,
   ``__syncthreads`` a barrier of the block's threads, warp shuffles an exchange among a
   warp's threads behind a barrier of their own, ``__shared__`` arrays one per process
   (the blocks of a launch run one after another);
3. the host function's launches are replayed: scratch buffers allocated, grid and block
   sizes evaluated from the bound arrays' shapes, kernels called in order.

``EmulatedLibrary(specs)`` maps kernel names to callables taking the plan's arguments,
so an ``Executor`` runs a CUDA plan with it on the CPU; ``EmulatedArtifact`` wraps what
``compile_model(..., "cuda")`` returns so that ``run`` and ``Trainer`` do
(``tests/test_cuda_emulated.py``).  It is slow (a host thread per GPU thread) and meant
for small graphs.  The threads, and which elements each reads and writes, are the GPU's;
floating-point results may differ from a GPU's in the last bits (the host compiler
contracts multiply-adds differently).  A kernel writing outside its buffers can crash the
process instead of failing a check.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import tvm
from tvm import tirx

from gcomp.codegen import cuda_build
from gcomp.codegen.kernels import KernelSpec
from gcomp.errors import CompileError

TARGET = {"kind": "cuda", "arch": "sm_90"}

EMULATION_HEADER = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

struct emu_uint3 { unsigned int x, y, z; };
static thread_local emu_uint3 threadIdx, blockIdx;
static emu_uint3 blockDim, gridDim;
static std::barrier<>* emu_block_barrier;
static std::vector<std::barrier<>*> emu_warp_barriers;
static uint64_t emu_warp_slots[32][32];
static thread_local int emu_tid;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short

/* bfloat16 as CUDA stores it (--precision bf16): the upper half of a float, rounded to
   nearest even; arithmetic on it is float arithmetic */
struct nv_bfloat16 {
  uint16_t bits;
  nv_bfloat16() = default;
  nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (uint16_t)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = (uint16_t)(u >> 16);
  }
  nv_bfloat16(double d) : nv_bfloat16((float)d) {}
  nv_bfloat16(int i) : nv_bfloat16((float)i) {}
  operator float() const {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static inline nv_bfloat16 __float2bfloat16_rn(float f) { return nv_bfloat16(f); }
static inline nv_bfloat16 __float2bfloat16(float f) { return nv_bfloat16(f); }
static inline float __bfloat162float(nv_bfloat16 b) { return (float)b; }

/* CUDA's vector types in the aggregations with float4 lanes (``schedules/cuda.agg_vector``):
   the values, a fast exponential's exponent bits (int4) and the comparisons of an
   activation's select (TVM writes them as ushort4) */
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct alignas(16) int4 { int x, y, z, w; };
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
struct alignas(8) ushort4 { unsigned short x, y, z, w; };
static inline ushort4 make_ushort4(unsigned short x, unsigned short y, unsigned short z,
                                   unsigned short w) { return {x, y, z, w}; }

static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

/* atomics (the scatter over out-edges, ``csr_scatter``): a block's threads are host
   threads running at once, so the add is a real atomic one; TVM calls it through a
   helper defined in the prelude this header replaces */
static inline float atomicAdd(float* a, float v) { return std::atomic_ref<float>(*a).fetch_add(v); }
template <class T> static inline T tvm_builtin_cuda_atomic_add(T* a, T v) { return atomicAdd(a, v); }

static inline unsigned int __activemask() {
  int w = emu_tid / 32, n = (int)(blockDim.x * blockDim.y * blockDim.z) - 32 * w;
  return n >= 32 ? 0xffffffffu : ((1u << n) - 1u);
}

template <class T> static inline T emu_exchange(T v, int src, bool keep) {
  int w = emu_tid / 32, lane = emu_tid % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu_warp_slots[w][lane] = bits;
  emu_warp_barriers[w]->arrive_and_wait();
  T r = v;
  if (!keep) std::memcpy(&r, &emu_warp_slots[w][src], sizeof(T));
  emu_warp_barriers[w]->arrive_and_wait();
  return r;
}
template <class T> static inline T __shfl_down_sync(unsigned, T v, int delta, int width = 32) {
  int lane = emu_tid % 32, seg = lane / width * width;
  return emu_exchange(v, lane + delta, lane + delta >= seg + width);
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, int delta, int width = 32) {
  int lane = emu_tid % 32, seg = lane / width * width;
  return emu_exchange(v, lane - delta, lane - delta < seg);
}
template <class T> static inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
  int lane = emu_tid % 32;
  return emu_exchange(v, lane / width * width + src % width, false);
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  int lane = emu_tid % 32;
  return emu_exchange(v, lane ^ mask, false);
}

static inline float max(float a, float b) { return std::fmax(a, b); }
static inline float min(float a, float b) { return std::fmin(a, b); }
static inline double max(double a, double b) { return std::fmax(a, b); }
static inline double min(double a, double b) { return std::fmin(a, b); }
static inline int max(int a, int b) { return std::max(a, b); }
static inline int min(int a, int b) { return std::min(a, b); }
static inline int64_t max(int64_t a, int64_t b) { return std::max(a, b); }
static inline int64_t min(int64_t a, int64_t b) { return std::min(a, b); }
static inline nv_bfloat16 max(nv_bfloat16 a, nv_bfloat16 b) { return std::fmax((float)a, (float)b); }
static inline nv_bfloat16 min(nv_bfloat16 a, nv_bfloat16 b) { return std::fmin((float)a, (float)b); }
static inline int __float_as_int(float x) { int r; std::memcpy(&r, &x, 4); return r; }
static inline float __int_as_float(int x) { float r; std::memcpy(&r, &x, 4); return r; }
static inline unsigned __float_as_uint(float x) { unsigned r; std::memcpy(&r, &x, 4); return r; }
static inline float __uint_as_float(unsigned x) { float r; std::memcpy(&r, &x, 4); return r; }

typedef void (*emu_body)(const uint64_t*);

extern "C" void emu_launch(emu_body body, const uint64_t* args, unsigned gx, unsigned gy,
                           unsigned gz, unsigned bx, unsigned by, unsigned bz) {
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  int n = (int)(bx * by * bz);
  std::barrier<> block(n);
  emu_block_barrier = &block;
  std::vector<std::barrier<>*> warps;
  for (int w = 0; w * 32 < n; ++w) warps.push_back(new std::barrier<>(std::min(32, n - 32 * w)));
  emu_warp_barriers = warps;
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t)
    threads.emplace_back([=, &block] {
      emu_tid = t;
      threadIdx = {(unsigned)(t % bx), (unsigned)(t / bx % by), (unsigned)(t / (bx * by))};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            body(args);
            block.arrive_and_wait();  // the next block reuses the shared arrays
          }
    });
  for (auto& th : threads) th.join();
  for (auto* w : warps) delete w;
}
"""

_DECL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(([^)]*)\);')


def _kernel_source(source: str) -> tuple[str, dict]:
    """TVM's CUDA source without its prelude, and each kernel's parameter types."""
    first = source.index('extern "C" __global__')
    # a __shared__ array is one array of the process: the blocks of a launch run one at a
    # time (alignas must come first in C++)
    body = re.sub(r"__shared__ (alignas\(\d+\) )?", r"\1static ", source[first:])
    kernels = {}
    for name, params in _DECL.findall(body):
        kernels[name] = [p.rsplit(" ", 1)[0].replace("__restrict__", "").strip()
                         for p in params.split(",") if p.strip()]
    return body, kernels


def _wrapper(name: str, types: list) -> str:
    """A C entry ``emu_<name>`` that launches kernel ``name`` with its arguments taken from
    an array of 64-bit slots (pointers and integers as they are, floats as doubles)."""
    def cast(k, t):
        if t.endswith("*"):
            return f"({t})(uintptr_t)a[{k}]"
        if t in ("float", "double"):
            return f"({t})*(const double*)&a[{k}]"
        return f"({t})(int64_t)a[{k}]"
    call = ", ".join(cast(k, t) for k, t in enumerate(types))
    return (f"static void emu_body_{name}(const uint64_t* a) {{ {name}({call}); }}\n"
            f'extern "C" void emu_{name}(const uint64_t* a, unsigned gx, unsigned gy, '
            f"unsigned gz, unsigned bx, unsigned by, unsigned bz) {{\n"
            f"  emu_launch(emu_body_{name}, a, gx, gy, gz, bx, by, bz);\n}}\n")


def _compile(source: str, kernels: dict) -> ctypes.CDLL:
    text = EMULATION_HEADER + source + "\n" + "".join(
        _wrapper(k, t) for k, t in kernels.items())
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    d = Path(tempfile.gettempdir()) / "gcomp-cuda-emulator"
    d.mkdir(exist_ok=True)
    so = d / f"{key}.so"
    if not so.exists():
        src = d / f"{key}.{os.getpid()}.cc"  # another process may build the same
        src.write_text(text)
        tmp = src.with_suffix(".so")
        proc = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                               "-w", "-o", str(tmp), str(src)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise CompileError("the host compiler failed on the emulated CUDA kernels "
                               f"({src}):\n" + "\n".join(proc.stdout.splitlines()[-20:]))
        src.unlink()
        tmp.replace(so)
    return ctypes.CDLL(str(so))


# ------------------------------------------------------------------ the host side
def _walk(stmt, out: list) -> None:
    """Host statements in order: allocations, views, bound values, kernel launches and
    conditionals (their branches walked into programs of their own)."""
    if isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _walk(s, out)
        return
    if isinstance(stmt, tirx.IfThenElse):
        then, other = [], []
        _walk(stmt.then_case, then)
        if stmt.else_case is not None:
            _walk(stmt.else_case, other)
        out.append(("if", (stmt.condition, then, other)))
        return
    if isinstance(stmt, (tirx.For, tirx.While)):
        raise NotImplementedError(f"a loop in a kernel's host code: {stmt}")
    if isinstance(stmt, tirx.AllocBuffer):
        out.append(("alloc", stmt.buffer))
    elif isinstance(stmt, tirx.DeclBuffer):  # another view of a buffer's data
        out.append(("decl", stmt.buffer))
    elif isinstance(stmt, tirx.Bind):  # a value computed once (TVM's common subexpressions)
        out.append(("let", (stmt.var, stmt.value)))
    elif isinstance(stmt, tirx.Evaluate) and type(stmt.value).__name__ == "Call" \
            and stmt.value.op.name == "tirx.call_ffi_kernel":
        out.append(("launch", stmt.value))
    body = getattr(stmt, "body", None)  # attributes, assertions: their bodies run
    if isinstance(body, tirx.Stmt):
        _walk(body, out)


_BINARY = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
           "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b,
           "Div": lambda a, b: int(a / b), "Mod": lambda a, b: int(np.fmod(a, b)),
           "Min": min, "Max": max, "LT": lambda a, b: a < b, "LE": lambda a, b: a <= b,
           "GT": lambda a, b: a > b, "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b,
           "NE": lambda a, b: a != b, "And": lambda a, b: a and b, "Or": lambda a, b: a or b}


class _Env:
    """Host variables bound to values: parameters (their buffers' data pointers and shape
    variables), scratch allocations and views."""

    def __init__(self):
        self.bound: list = []
        self.params: dict = {}

    def bind(self, var, value, param: bool = False) -> None:
        self.bound.append((var, value))
        if param:
            self.params[var.name] = value

    def get(self, var):
        for v, value in self.bound:
            if v.same_as(var):
                return value
        # a view's buffer_data(x) may hold another variable object for the parameter x:
        # the parameters' names are unique in the host function
        if var.name in self.params:
            return self.params[var.name]
        raise KeyError(f"unbound host variable {var}")


def _eval(e, env: _Env):
    """Value of a host expression: integers and the variables bound in ``env``."""
    if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
        return e.value
    if isinstance(e, tirx.Var):
        return env.get(e)
    kind = type(e).__name__
    if kind in _BINARY:
        return _BINARY[kind](_eval(e.a, env), _eval(e.b, env))
    if kind == "Cast":
        v = _eval(e.value, env)
        return float(v) if "float" in str(e.dtype) else int(v)
    if kind == "Select":
        return _eval(e.true_value if _eval(e.condition, env) else e.false_value, env)
    if kind == "Call" and e.op.name == "tirx.buffer_data":
        return _eval(e.args[0], env)
    if kind == "Call" and e.op.name == "tirx.if_then_else":
        a = e.args
        return _eval(a[1] if _eval(a[0], env) else a[2], env)
    raise NotImplementedError(f"host expression {kind}: {e}")


@tvm.instrument.pass_instrument
class _BeforePackedAPI:
    """Keeps the module as it enters ``MakePackedAPI``: host functions still take their
    buffers as parameters, the device kernels are split off and launched by
    ``call_ffi_kernel``."""

    def __init__(self):
        self.mod = None

    def run_before_pass(self, mod, info):
        if info.name.endswith("MakePackedAPI"):
            self.mod = mod


def _host_functions(mod: tvm.IRModule, target) -> dict:
    """The host side of every kernel of ``mod`` after TVM's lowering, before its packed
    API: name -> PrimFunc."""
    keep = _BeforePackedAPI()
    attached = tvm.IRModule({gv: f.with_attr("target", target)
                             for gv, f in mod.functions.items()})
    with tvm.transform.PassContext(instruments=[keep]), target:
        tvm.tirx.get_tir_pipeline("default")[0](attached)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    return {gv.name_hint: f for gv, f in keep.mod.functions.items() if gv.name_hint in names}


class EmulatedKernel:
    """One kernel of a CUDA plan, run on the CPU: call it with the plan's arguments (tvm
    CPU tensors or numpy arrays) as the executor calls a compiled one."""

    def __init__(self, name: str, host, lib: ctypes.CDLL, kernels: dict):
        self.name = name
        self.lib = lib
        self.kernels = kernels
        self.params = list(host.params)
        self.program: list = []
        _walk(host.body, self.program)

    def __call__(self, *args) -> None:
        env, keep = _Env(), []
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        for p, a in zip(self.params, args):
            if not isinstance(p.ty, tirx.buffer.BufferType):  # a scalar parameter
                env.bind(p, a, param=True)
                continue
            keep.append(a)
            env.bind(p, a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr(), param=True)
            for dim, size in zip(p.shape, a.shape):
                if isinstance(dim, tirx.Var):
                    env.bind(dim, int(size))
        self._run(self.program, env, keep)

    def _run(self, program: list, env: _Env, keep: list) -> None:
        for kind, item in program:
            if kind == "alloc":
                size = int(np.prod([_eval(d, env) for d in item.shape]))
                arr = np.zeros(max(size, 1), str(item.dtype))
                keep.append(arr)  # alive until the call returns, as TVM's workspace
                env.bind(item, arr.ctypes.data)
            elif kind == "decl":
                env.bind(item, _eval(item.data, env))
            elif kind == "let":
                env.bind(item[0], _eval(item[1], env))
            elif kind == "if":
                cond, then, other = item
                self._run(then if _eval(cond, env) else other, env, keep)
            else:
                self._launch(item, env)

    def _launch(self, call, env: _Env) -> None:
        kernel = call.args[0].value
        types = self.kernels[kernel]
        values = [_eval(a, env) for a in call.args[1:]]
        args, dims = values[:len(types)], values[len(types):]
        grid, block = [1, 1, 1], [1, 1, 1]
        for tag, v in zip((str(t) for t in call.attrs.launch_params), dims):
            axis = "xyz".index(tag[-1])
            (grid if tag.startswith("blockIdx") else block)[axis] = int(v)
        if 0 in grid:
            return  # CUDA refuses an empty launch; the executor skips those
        slots = (ctypes.c_uint64 * max(1, len(args)))()
        for k, (t, v) in enumerate(zip(types, args)):
            if t in ("float", "double"):
                slots[k] = np.array(v, np.float64).view(np.uint64).item()
            else:
                slots[k] = int(v) & ((1 << 64) - 1)
        getattr(self.lib, f"emu_{kernel}")(slots, *[ctypes.c_uint(v) for v in grid + block])


class EmulatedLibrary:
    """Kernel name -> ``EmulatedKernel`` for every kernel of ``specs``: a stand-in for a
    CUDA artifact's library that an ``Executor`` on the CPU runs.  One scheduling, one
    TVM compilation and one host-compiler run for all of them."""

    def __init__(self, specs: dict[str, KernelSpec]):
        mod = cuda_build.schedule_module(specs, TARGET)
        target = cuda_build.tvm_target(TARGET)
        source = tvm.compile(mod, target=target).mod.imports[0].inspect_source()
        body, kernels = _kernel_source(source)
        lib = _compile(body, kernels)
        hosts = _host_functions(mod, target)
        self._kernels = {name: EmulatedKernel(name, hosts[name], lib, kernels)
                         for name in specs}

    def __getitem__(self, name: str) -> EmulatedKernel:
        return self._kernels[name]


class EmulatedArtifact:
    """A CUDA artifact fresh from ``compile_model`` (which keeps its kernel specs, not
    saved in the file) whose kernels run in the emulator on the CPU: ``run``,
    ``executor`` and ``Trainer`` work as on a GPU."""

    def __init__(self, artifact):
        if artifact.target.get("kind") != "cuda" or getattr(artifact, "specs", None) is None:
            raise ValueError("the emulator runs a CUDA artifact as compile_model returns it "
                             "(with its kernel specs), not one loaded from a file")
        self._artifact = artifact
        self._lib = EmulatedLibrary(artifact.specs)
        self._executor = None

    def __getattr__(self, name):
        return getattr(self._artifact, name)

    def library(self) -> EmulatedLibrary:
        return self._lib

    def device(self):
        return tvm.cpu()

    def executor(self):
        if self._executor is None:
            from gcomp.runtime.executor import Executor
            self._executor = Executor(self.plan, self._lib, self.params)
        return self._executor

    def run(self, graph, features: dict | None = None) -> list:
        return self.executor().run(graph, features)
