"""Process environment: thread counts (set before torch / TVM are imported), machine, versions."""

from __future__ import annotations

import os
import platform
import sys
import time

from gcomp.codegen.cpu_load import CpuMonitor
from gcomp.runtime.cpu_features import host_flags

THREAD_VARS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def set_threads(n: int) -> None:
    """Give every library ``n`` threads.  Call before importing torch, tvm or dgl: the TVM and
    OpenMP thread pools read their variables when they start."""
    for v in THREAD_VARS:
        os.environ[v] = str(n)


def apply_torch_threads(n: int) -> None:
    """The parts that can only be set after import (torch, DGL)."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(n)
        # Start torch's OpenMP pool now, before TVM starts its own (the first gcomp call).
        # Measured: when torch's pool started after TVM's, PyG's Cora GCN epoch took 300-400
        # ms instead of 8 ms for the rest of the process (thread masks looked the same; the
        # order alone decides it).
        torch.ones(1 << 22).mul_(2)
    if "dgl" in sys.modules:
        sys.modules["dgl"].utils.set_num_threads(n)


def import_dgl():
    """DGL 2.1's graphbolt has no build for torch 2.13; full-graph work does not need it."""
    import types
    sys.modules.setdefault("dgl.graphbolt", types.ModuleType("dgl.graphbolt"))
    import dgl
    return dgl


def machine() -> dict:
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), None)
    except OSError:
        pass
    flags = host_flags()
    mem_kb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu_model": cpu or platform.processor(),
        "cores_available": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1) if mem_kb else None,
        "avx512": "avx512f" in flags,
        "avx2": "avx2" in flags,
        "platform": platform.platform(),
    }


def versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for key, dist in (("gcomp", "gcomp"), ("tvm", "apache-tvm"), ("torch", "torch"),
                      ("torch_geometric", "torch-geometric"), ("dgl", "dgl"), ("numpy", "numpy"),
                      ("scipy", "scipy")):
        try:
            out[key] = md.version(dist)
        except md.PackageNotFoundError:
            out[key] = None
    return out


def wait_quiet(max_wait_s: float, threshold: float = 0.2, window_s: float = 2.0, log=print):
    """Wait (at most ``max_wait_s``) until other processes use < ``threshold`` cores."""
    if max_wait_s <= 0:
        return None
    mon = CpuMonitor()
    t0 = time.monotonic()
    while True:
        time.sleep(window_s)
        load = mon.cores()
        if load is None or load < threshold:
            return load
        if time.monotonic() - t0 > max_wait_s:
            log(f"  machine still busy ({load:.2f} cores used by other processes); going on")
            return load
        log(f"  waiting for a quiet machine: other processes use {load:.2f} cores")
