"""Ahead-of-time CUDA build: one shared library with host launchers and device binaries.

Compiling for ``cuda`` must work on a machine without a GPU, and the result must
run where only the TVM runtime is installed (no compiler library, no nvcc, no
NVRTC).  TVM 0.27 cannot do both by itself: without a GPU driver its CUDA
plugin does not load, ``tvm.compile`` then returns a placeholder CUDA module
holding CUDA *source*, and a library exported from it needs a CUDA compiler
in the process that loads it.  So this module:

1. schedules every kernel with ``gcomp/schedules/cuda.py`` (or TVM's generic
   GPU ``Fallback`` for kinds it does not know) and lets ``tvm.compile`` emit
   LLVM host launchers plus that placeholder;
2. compiles the placeholder's CUDA source with nvcc into one fatbin holding
   SASS for the target arch and PTX for newer GPUs (``compile_device_code``);
3. exports the library with its packed-imports blob rewritten so that the CUDA
   module carries the fatbin instead of the source (``pack_device_code``).

Loading the library (``tvm.runtime.load_module``) then only needs
``libtvm_runtime_cuda.so``, which deserializes the module with
``ffi.Module.load_from_bytes.cuda`` and hands the fatbin to the driver
(``cuModuleLoadData``): see ``docs/cuda.md`` and ``gcomp.runtime.artifact.load_cuda_runtime``.

Kernels the CUDA schedules do not know (or fail on) get TVM's generic
``dlight.gpu.Fallback`` schedule with a warning naming the kernel;
``GCOMP_CUDA_STRICT=1`` makes that an error instead (the tests set it).

The packed-imports blob (symbol ``__tvm_ffi__library_bin``) in TVM 0.27, all
integers little-endian u64 unless said, strings as (length, bytes)::

    nbytes | n, row_ptr[n] | m, child_indices[m]     (the import tree, CSR)
    per module: kind (string); unless kind == "_lib" (the host library): its bytes (string)
    CUDA module bytes: fmt (string) | fmap | code (string)
    fmap: count, then (name (string), FunctionInfo) per kernel
    FunctionInfo: name (string) | k, DLDataType[k] (4 bytes each) | t, launch tags (string)[t]
                  | e, int32[e] (argument extra tags)

Artifacts record the TVM version and refuse any other, so this layout is pinned;
``parse_imports`` checks it and the CUDA tests read it back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi

from gcomp.codegen.kernels import KernelSpec, define
from gcomp.errors import CompileError

log = logging.getLogger("gcomp.cuda")

DEVICE_CODE_FORMAT = "fatbin"
FATBIN_MAGIC = 0xBA55ED50
LIB_SYMBOL = "__tvm_ffi__library_bin"


# ---------------------------------------------------------------------- target
def parse_arch(arch: str) -> str:
    """``sm_90`` -> ``90`` (also ``sm_90a``); a clear error for anything else."""
    m = re.fullmatch(r"sm_(\d{2,3}[af]?)", str(arch))
    if not m:
        raise CompileError(f"CUDA arch must look like sm_80, sm_90 or sm_90a, got {arch!r}")
    return m.group(1)


def tvm_target(target: dict) -> tvm.target.Target:
    """The CUDA target with a generic x86-64 LLVM host (launchers run on any x86-64 host)."""
    return tvm.target.Target(dict(target), host={"kind": "llvm"})


# ---------------------------------------------------------------------- scheduling
@dataclass
class ScheduleReport:
    fallback: list = field(default_factory=list)  # kernels scheduled by dlight's Fallback
    errors: dict = field(default_factory=dict)  # kernel -> why its own schedule failed


def cuda_spec(spec: KernelSpec) -> KernelSpec:
    """The spec actually defined for CUDA: extra definer parameters for some kinds."""
    from gcomp.schedules.cuda import DEFINITION_PARAMS
    extra = DEFINITION_PARAMS.get(spec.kind)
    return KernelSpec.make(spec.kind, **{**spec.p, **extra}) if extra else spec


def _fallback(func, target: tvm.target.Target):
    from tvm.s_tir import dlight
    with target:
        sch = dlight.gpu.Fallback().apply(func, target, False)
    if sch is None:
        raise CompileError("no GPU schedule applies")
    return sch.mod["main"]


def schedule_kernel(name: str, spec: KernelSpec, target: tvm.target.Target,
                    report: ScheduleReport):
    """The scheduled PrimFunc of one kernel, named ``name`` (the plan's symbol)."""
    from gcomp.schedules.cuda import schedule
    func = define(cuda_spec(spec)).with_attr("global_symbol", name)
    sch = tvm.s_tir.Schedule(tvm.IRModule({name: func}))
    sch.work_on(name)
    try:
        schedule(sch, spec)
        return sch.mod[name]
    except KeyError as e:  # a kind without a CUDA schedule yet (or a schedule's own bug)
        why = (f"no CUDA schedule for kind {spec.kind!r}" if e.args == (spec.kind,)
               else f"KeyError: {e}")
    except Exception as e:  # noqa: BLE001 - a schedule that fails falls back, and says so
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
    if os.environ.get("GCOMP_CUDA_STRICT") == "1":  # tests: every kernel must have its schedule
        raise CompileError(f"cannot schedule kernel {name} ({spec.kind} {spec.p}) for CUDA: {why}")
    log.warning("kernel %s (%s): %s; using the generic GPU fallback schedule", name, spec.kind,
                why)
    report.errors[name] = why
    report.fallback.append(name)
    try:
        return _fallback(define(spec).with_attr("global_symbol", name), target).with_attr(
            "global_symbol", name)
    except Exception as e:  # noqa: BLE001
        raise CompileError(f"cannot schedule kernel {name} ({spec.kind} {spec.p}) for CUDA: "
                           f"{why}; the generic fallback failed too: {e}") from e


def schedule_module(specs: dict[str, KernelSpec], target: dict,
                    report: ScheduleReport | None = None) -> tvm.IRModule:
    report = report if report is not None else ScheduleReport()
    t = tvm_target(target)
    return tvm.IRModule({name: schedule_kernel(name, spec, t, report)
                         for name, spec in sorted(specs.items())})


# ---------------------------------------------------------------------- device code
def find_nvcc() -> str:
    named = os.environ.get("GCOMP_NVCC")
    if named:  # the user's choice or an error: not silently another nvcc
        if not (os.path.isfile(named) and os.access(named, os.X_OK)):
            raise CompileError(f"GCOMP_NVCC={named!r} is not an executable file")
        return named
    for cand in (shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise CompileError("compiling for cuda needs nvcc (the CUDA toolkit; no GPU is needed): "
                       "put it on PATH, or set CUDA_HOME or GCOMP_NVCC")


def compile_device_code(source: str, arch: str) -> bytes:
    """nvcc: CUDA source -> fatbin with SASS for ``arch`` and PTX for newer GPUs."""
    num = parse_arch(arch)
    with tempfile.TemporaryDirectory(prefix="gcomp-nvcc-") as d:
        src, out = Path(d) / "kernels.cu", Path(d) / "kernels.fatbin"
        src.write_text(source)
        cmd = [find_nvcc(), "--fatbin", "-O3", "-w",
               "-gencode", f"arch=compute_{num},code=sm_{num}",
               "-gencode", f"arch=compute_{num},code=compute_{num}",
               "-o", str(out), str(src)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.strip().splitlines()[-20:]) or \
                f"(exit code {proc.returncode}, no output)"
            raise CompileError(f"nvcc ({cmd[0]}) failed to compile the CUDA kernels for "
                               f"{arch}: {tail}")
        if not out.is_file() or out.stat().st_size == 0:
            raise CompileError(f"nvcc ({cmd[0]}) exited 0 but wrote no device code for {arch}")
        return out.read_bytes()


def fatbin_entries(data: bytes) -> list[dict]:
    """The entries of a fatbin: kind (``ptx`` or ``elf``) and the SM number, in order."""
    magic, _version, header, size = struct.unpack_from("<IHHQ", data, 0)
    if magic != FATBIN_MAGIC:
        raise ValueError("not a CUDA fatbin")
    out, off = [], header
    while off < header + size:
        kind, _v, ehdr, payload = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        body = data[off + ehdr:off + ehdr + payload]
        entry = {"kind": {1: "ptx", 2: "elf"}.get(kind, str(kind)), "arch": arch,
                 "elf_magic": body[:4] == b"\x7fELF"}
        if entry["elf_magic"] and len(body) >= 52:  # the cubin's own header: EM_CUDA, its SM
            entry["e_machine"] = struct.unpack_from("<H", body, 18)[0]
            flags = struct.unpack_from("<I", body, 48)[0]
            # CUDA 12.8+ ELF ABI v2 keeps the SM in bits 8-15, older cubins in bits 0-7
            entry["elf_sm"] = (flags >> 8) & 0xFF if (flags & 0xFF) < 0x14 else flags & 0xFF
        out.append(entry)
        off += ehdr + payload
    return out


def inspect_library(so_path: str | Path) -> dict:
    """The device code of an exported CUDA library: format, kernels, fatbin entries."""
    _, _, modules = parse_imports(read_packed_imports(so_path))
    cuda = [parse_cuda_module(d) for k, d in modules if k == "cuda"]
    if len(cuda) != 1:
        raise ValueError(f"expected one CUDA module, found {len(cuda)}")
    m = cuda[0]
    out = {"format": m["fmt"], "kernels": sorted(m["kernels"]), "bytes": len(m["code"])}
    if m["fmt"] == "fatbin":
        out["entries"] = fatbin_entries(m["code"])
    return out


# ---------------------------------------------------------------------- packed imports
class _Reader:
    def __init__(self, data: bytes, off: int = 0):
        self.data, self.off = data, off

    def u64(self) -> int:
        v = struct.unpack_from("<Q", self.data, self.off)[0]
        self.off += 8
        return v

    def raw(self, n: int) -> bytes:
        if self.off + n > len(self.data):
            raise ValueError("truncated")
        v = self.data[self.off:self.off + n]
        self.off += n
        return v

    def str(self) -> bytes:
        return self.raw(self.u64())


def _w_u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _w_str(b: bytes) -> bytes:
    return _w_u64(len(b)) + b


def parse_imports(blob: bytes) -> tuple[list, list, list]:
    """(row_ptr, child_indices, [(kind, bytes or None)]) of a packed-imports blob."""
    r = _Reader(blob)
    if r.u64() != len(blob) - 8:
        raise ValueError("packed imports: length mismatch")
    row_ptr = [r.u64() for _ in range(r.u64())]
    children = [r.u64() for _ in range(r.u64())]
    modules = []
    while r.off < len(blob):
        kind = r.str().decode()
        modules.append((kind, None if kind == "_lib" else r.str()))
    return row_ptr, children, modules


def write_imports(row_ptr: list, children: list, modules: list) -> bytes:
    body = _w_u64(len(row_ptr)) + b"".join(map(_w_u64, row_ptr))
    body += _w_u64(len(children)) + b"".join(map(_w_u64, children))
    for kind, data in modules:
        body += _w_str(kind.encode()) + (b"" if data is None else _w_str(data))
    return _w_u64(len(body)) + body


def parse_cuda_module(data: bytes) -> dict:
    """fmt, kernel names (with their launch tags) and code of a serialized CUDA module."""
    r = _Reader(data)
    fmt = r.str().decode()
    start = r.off
    kernels = {}
    for _ in range(r.u64()):
        key = r.str().decode()
        r.str()  # FunctionInfo.name
        r.raw(4 * r.u64())  # argument types
        tags = [r.str().decode() for _ in range(r.u64())]
        r.raw(4 * r.u64())  # argument extra tags
        kernels[key] = tags
    fmap = data[start:r.off]
    code = r.str()
    if r.off != len(data):
        raise ValueError("serialized CUDA module: unexpected trailing bytes")
    return {"fmt": fmt, "kernels": kernels, "fmap": fmap, "code": code}


def write_cuda_module(fmt: str, fmap: bytes, code: bytes) -> bytes:
    return _w_str(fmt.encode()) + fmap + _w_str(code)


def packed_imports_of(mod) -> bytes:
    """The blob TVM would link into ``mod``'s exported library."""
    from tvm.runtime import _ffi_api
    text = _ffi_api.ModulePackImportsToC(mod, False, "")
    body = text[text.index("= {") + 3:text.rindex("};")]
    return bytes(int(h, 16) for h in re.findall(r"0x([0-9a-fA-F]{2})", body))


def with_device_code(blob: bytes, fmt: str, code: bytes) -> bytes:
    """``blob`` with its (one) CUDA module carrying ``code`` in format ``fmt``."""
    row_ptr, children, modules = parse_imports(blob)
    out, n_cuda = [], 0
    for kind, data in modules:
        if kind == "cuda":
            n_cuda += 1
            m = parse_cuda_module(data)
            data = write_cuda_module(fmt, m["fmap"], code)
        out.append((kind, data))
    if n_cuda != 1:
        raise CompileError(f"expected one CUDA module in the compiled library, found {n_cuda}")
    return write_imports(row_ptr, children, out)


def _asm_blob(path: Path, blob_file: Path) -> None:
    """An assembly file defining the packed-imports symbol with the blob's bytes."""
    path.write_text(
        "\t.section .rodata\n"
        f"\t.globl {LIB_SYMBOL}\n"
        f"\t.type {LIB_SYMBOL}, @object\n"
        "\t.p2align 4\n"
        f"{LIB_SYMBOL}:\n"
        f"\t.incbin \"{blob_file}\"\n"
        f"\t.size {LIB_SYMBOL}, {blob_file.stat().st_size}\n"
        "\t.section .note.GNU-stack,\"\",@progbits\n")


def export_with_device_code(lib, path: Path, fmt: str, code: bytes) -> None:
    """Export ``lib`` (host launchers + CUDA placeholder) with ``code`` as its device code."""
    blob = with_device_code(packed_imports_of(lib.mod), fmt, code)

    def pack(_mod, is_system_lib, prefix, workspace_dir):
        if is_system_lib or prefix:
            raise CompileError("system-library CUDA exports are not supported")
        blob_file = Path(workspace_dir) / "devc.bin"
        blob_file.write_bytes(blob)
        asm = Path(workspace_dir) / "devc.S"
        _asm_blob(asm, blob_file)
        return str(asm)

    lib.export_library(str(path), fpack_imports=pack)


def read_packed_imports(so_path: str | Path) -> bytes:
    """The packed-imports blob of an exported library, read from the ELF file.

    The library is never loaded: ``dlopen`` of a TVM library outside TVM leaves
    its context-function pointers null, and (with ``RTLD_GLOBAL``) those null
    definitions interpose on every TVM library loaded later in the process.
    """
    data = Path(so_path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{so_path}: not a 64-bit little-endian ELF library")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # section header: name, type, flags, addr, offset, size, link, info, align, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    for sec in sections:
        if sec[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sec[6]]
        for off in range(sec[4], sec[4] + sec[5], 24):
            st_name, _, _, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", data, off)
            start = strtab[4] + st_name
            if data[start:data.index(b"\0", start)].decode() != LIB_SYMBOL:
                continue
            home = sections[st_shndx]  # the section holding the symbol: address -> file offset
            pos = st_value - home[3] + home[4]
            n, = struct.unpack_from("<Q", data, pos)
            return data[pos:pos + 8 + n]
    raise ValueError(f"{so_path}: no {LIB_SYMBOL} symbol (not an exported TVM library)")


# ---------------------------------------------------------------------- build
def build_cuda_library(specs: dict[str, KernelSpec], target: dict, cache: Path) -> Path:
    """Compile the kernels into one library with fatbin device code; return its path."""
    find_nvcc()  # fail early and clearly: -t cuda always needs nvcc (but no GPU)
    report = ScheduleReport()
    mod = schedule_module(specs, target, report)
    key = hashlib.sha256(
        f"{tvm_ffi.structural_hash(mod)}|{sorted(target.items())}|{tvm.__version__}|"
        f"{sorted(specs)}|{DEVICE_CODE_FORMAT}".encode()).hexdigest()[:24]
    path = cache / f"{key}.cuda.so"
    if path.exists():
        try:  # a damaged cache entry (a truncated write, a disk error) is built again
            inspect_library(path)
            return path
        except (ValueError, struct.error, OSError):
            path.unlink(missing_ok=True)
    try:
        lib = tvm.compile(mod, target=tvm_target(target))
    except Exception as e:  # noqa: BLE001
        raise CompileError(f"TVM failed to compile the kernels for {target}: {e}") from e
    cuda = [m for m in lib.mod.imports if m.kind == "cuda"]
    if len(cuda) != 1:
        raise CompileError(f"expected one CUDA module from TVM, got {len(cuda)}")
    code = compile_device_code(cuda[0].inspect_source(), target["arch"])
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        export_with_device_code(lib, Path(tmp), DEVICE_CODE_FORMAT, code)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
