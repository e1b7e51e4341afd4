"""GPU tests: skipped unless a CUDA device is present (and nvcc, to compile for it)."""

from __future__ import annotations

import os

import pytest


def cuda_device_or_none():
    """TVM's CUDA device 0, or None (no driver, no GPU, or no CUDA runtime plugin)."""
    try:
        import tvm

        from gcomp.runtime.artifact import load_cuda_runtime
        load_cuda_runtime()
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except Exception:  # noqa: BLE001 - any failure means: no usable GPU here
        return None


def nvcc_or_none():
    from gcomp.codegen.cuda_build import find_nvcc
    from gcomp.errors import CompileError
    try:
        return find_nvcc()
    except CompileError:
        return None


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    gpu_items = [i for i in items if str(i.fspath).startswith(here)]
    if not gpu_items:
        return
    why = None
    if cuda_device_or_none() is None:
        why = "no CUDA device (tests/gpu needs a GPU and its driver)"
    elif nvcc_or_none() is None:
        why = "no nvcc (compiling for cuda needs the CUDA toolkit)"
    if why:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=why))
