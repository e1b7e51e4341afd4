"""What this CPU and OS allow beyond the instructions a target names: AMX tiles, AVX-512
BF16 dot products, and the vector instructions of a CPU another artifact was compiled
for (``--mcpu``).

An artifact compiled with ``--precision bf16`` on a CPU with AMX-BF16 runs its dense
products on tiles (``gcomp/codegen/amx_kernels.py``).  LLVM may not name such a CPU
(under a hypervisor it reports an older model), so the compiler asks the kernel's CPU
flags; and Linux hands a process the tiles' register state only when it asks for it
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), which ``enable_amx`` does
before such a library runs.  Without the grant the first tile instruction kills the
process, so loading refuses instead, with the reason.  A CPU with AVX-512 BF16 but no
tiles (AMD Zen 4) runs those products on its dot products instead; the compiler adds
them to a target LLVM does not know has them, so the artifact names them too and
loading checks them apart from the target's.
"""

from __future__ import annotations

import ctypes
import platform
from functools import lru_cache

AMX_FLAGS = ("amx_tile", "amx_bf16")   # /proc/cpuinfo names
AMX_MATTR = ["+amx-tile", "+amx-bf16"]  # LLVM's
DOT_BF16_FLAG = "avx512_bf16"
DOT_BF16_MATTR = ["+avx512bf16"]
_SYS_ARCH_PRCTL = 158                   # x86-64 Linux
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@lru_cache(maxsize=1)
def host_flags() -> frozenset:
    """The CPU flags Linux reports (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_has_dot_bf16() -> bool:
    """AVX-512 BF16 dot products (``gcomp/codegen/dot_bf16_kernels.py``)."""
    return platform.machine() == "x86_64" and DOT_BF16_FLAG in host_flags()


def host_has_amx() -> bool:
    return platform.machine() == "x86_64" and all(f in host_flags() for f in AMX_FLAGS)


@lru_cache(maxsize=1)
def enable_amx() -> str | None:
    """Ask Linux for the AMX tile state of this process; None when granted, else why not."""
    if not host_has_amx():
        return "this CPU has no AMX-BF16 tiles (/proc/cpuinfo flags amx_tile, amx_bf16)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return f"Linux refused the AMX tile state (arch_prctl errno {ctypes.get_errno()})"
    return None


# LLVM's names of the vector instruction sets a library compiled for a CPU with them uses
# freely (AMX only where gcomp calls it: the manifest's cpu_features, checked apart)
_ISA_PREFIXES = ("avx", "fma", "f16c", "vaes", "vpclmulqdq", "gfni")


def _norm(name: str) -> str:
    return name.replace("_", "").replace("-", "").replace(".", "").lower()


@lru_cache(maxsize=None)
def isa_features(mcpu: str) -> tuple[str, ...]:
    """The vector instruction sets LLVM gives CPU ``mcpu`` (needs TVM's compiler: the
    compiler records them in the manifest, where a runtime-only process reads them)."""
    import tvm
    feats = tvm.get_global_func("target.llvm_get_cpu_features")(
        tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
    return tuple(sorted(f for f in feats if f.startswith(_ISA_PREFIXES)))


def missing(features) -> tuple[str, ...]:
    """Those of LLVM's instruction sets ``features`` this CPU's flags lack (``/proc/
    cpuinfo``; none where they cannot be read): code that uses them may stop here with an
    illegal instruction."""
    if platform.machine() != "x86_64" or not host_flags():
        return ()
    have = {_norm(f) for f in host_flags()}
    return tuple(f for f in features if _norm(f) not in have)


def missing_features(mcpu: str) -> tuple[str, ...]:
    return missing(isa_features(mcpu))
