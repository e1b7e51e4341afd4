"""Build kernels with TVM: define, schedule, compile, cache.

All kernels of a model go into one IRModule and one shared library.  TVM has
no compile cache of its own; we key exported libraries by the structural hash
of the scheduled module plus the target and TVM version, under
``$GCOMP_CACHE_DIR`` (default ``~/.cache/gcomp``).  Writes are atomic, so
concurrent compiles never see a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import tvm
import tvm_ffi

from gcomp.codegen.kernels import KernelSpec, define, target_definition
from gcomp.errors import CompileError

TARGETS = ("llvm", "cuda")


def host_cpu() -> str:
    return tvm.get_global_func("target.llvm_get_system_cpu")()


def make_target(kind: str, mcpu: str | None = None, arch: str | None = None) -> dict:
    """The JSON target dict for ``kind`` (``llvm``: host CPU unless ``mcpu`` given)."""
    if kind == "llvm" and arch is not None:
        raise CompileError(f"arch {arch!r} is a GPU architecture, for target cuda, not llvm")
    if kind == "cuda" and mcpu is not None:
        raise CompileError(f"mcpu {mcpu!r} is a CPU, for target llvm, not cuda (the host "
                           "side of a cuda artifact is generic x86-64)")
    if kind == "llvm":
        if mcpu is not None:
            triple = tvm.get_global_func("target.llvm_get_system_triple")()
            if not tvm.get_global_func("target.llvm_is_valid_cpu")(mcpu, triple):
                raise CompileError(f"unknown CPU {mcpu!r} for --mcpu: LLVM knows CPUs such as "
                                   f"znver3, sapphirerapids, skylake-avx512, x86-64")
        return {"kind": "llvm", "mcpu": mcpu or host_cpu()}
    if kind == "cuda":
        from gcomp.codegen.cuda_build import parse_arch
        arch = "sm_90" if arch is None else arch
        parse_arch(arch)  # a clear CompileError for a malformed arch
        return {"kind": "cuda", "arch": arch}
    raise CompileError(f"unknown target {kind!r}; targets: {', '.join(TARGETS)}")


def device_code_format(target: dict) -> str | None:
    """How the library holds device code: None (host code only), or cubin/fatbin/ptx."""
    if target["kind"] == "cuda":
        from gcomp.codegen.cuda_build import DEVICE_CODE_FORMAT
        return DEVICE_CODE_FORMAT
    return None


def cache_dir() -> Path:
    d = Path(os.environ.get("GCOMP_CACHE_DIR", Path.home() / ".cache" / "gcomp"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def schedule_module(specs: dict[str, KernelSpec], target: dict) -> tvm.IRModule:
    if target["kind"] == "llvm":
        from gcomp.schedules.cpu import schedule
    else:
        raise CompileError(f"no schedules for target {target['kind']!r} yet")
    funcs = {}
    for name, spec in sorted(specs.items()):
        func = target_definition(spec, target)
        if func is not None:  # written with its loop kinds
            funcs[name] = func
            continue
        sch = tvm.s_tir.Schedule(tvm.IRModule({name: define(spec)}))
        sch.work_on(name)
        try:
            schedule(sch, spec)
        except Exception as e:  # noqa: BLE001 - a schedule bug must name its kernel
            raise CompileError(f"scheduling kernel {name} ({spec.kind} {spec.p}) failed: {e}") from e
        funcs[name] = sch.mod[name]
    return tvm.IRModule(funcs)


def build_library(specs: dict[str, KernelSpec], target: dict, out_path: Path | None = None) -> Path:
    """Compile the kernels into a shared library; return its path (in the cache)."""
    if target["kind"] == "cuda":  # schedules, nvcc and device-code packing: cuda_build.py
        from gcomp.codegen.cuda_build import build_cuda_library
        return build_cuda_library(specs, target, cache_dir())
    mod = schedule_module(specs, target)
    key = hashlib.sha256(
        f"{tvm_ffi.structural_hash(mod)}|{sorted(target.items())}|{tvm.__version__}|{sorted(specs)}"
        .encode()).hexdigest()[:24]
    path = cache_dir() / f"{key}.so"
    if not path.exists():
        try:
            lib = tvm.compile(mod, target=tvm.target.Target(target))
        except Exception as e:  # noqa: BLE001
            raise CompileError(f"TVM failed to compile the kernels for {target}: {e}") from e
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        lib.export_library(tmp)
        os.replace(tmp, path)
    return path
