"""GPU tests: skipped unless a CUDA device is present (and nvcc, to compile for it).

A GPU host often has no TVM compiler (``docs/cuda.md``), so the artifacts can be built on
another machine and carried over.  Three modes, chosen by the environment:

* neither variable set: compile with nvcc and run here (needs both a GPU and nvcc);
* ``GCOMP_GPU_PREPARE=DIR``: compile every artifact the tests need into DIR and skip
  (no GPU needed);
* ``GCOMP_GPU_ARTIFACTS=DIR``: load the artifacts from DIR instead of compiling (needs a GPU
  and the TVM runtime only).  The references (float64 interpreter) are computed here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

PREPARE = os.environ.get("GCOMP_GPU_PREPARE")
PREPARED = os.environ.get("GCOMP_GPU_ARTIFACTS")
# llvm artifacts built elsewhere must run on the GPU host's CPU: a baseline x86-64 with AVX2
PORTABLE_MCPU = "x86-64-v3"


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
    if PREPARE:
        if nvcc_or_none() is None:
            why = "no nvcc (preparing cuda artifacts needs the CUDA toolkit)"
    elif cuda_device_or_none() is None:
        why = "no CUDA device (tests/gpu needs a GPU and its driver)"
    elif not PREPARED and nvcc_or_none() is None:
        why = "no nvcc (compiling for cuda needs the CUDA toolkit)"
    if why:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=why))


def artifact_dir(var: str) -> Path:
    d = Path(os.environ[var])
    d.mkdir(parents=True, exist_ok=True)
    return d


def artifact_name(nodeid: str, target: str) -> str:
    """A file name for one test's artifact: the test id with its odd characters replaced."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid.split("::", 1)[-1]) + f"-{target}.gcomp"


@pytest.fixture
def build(request):
    """``build(model, *targets, train=False, precision="fp32", options=None)``: one
    artifact per target (``options``: the pass context's), compiled here, or (prepare
    mode) compiled, saved and the test skipped, or (prepared mode) loaded. A test calls
    it once: in prepare mode a second call would never be reached."""
    def _build(model, *targets, train=False, precision="fp32", options=None):
        names = [artifact_name(request.node.nodeid, t) for t in targets]
        if PREPARED:
            from gcomp.runtime.artifact import load
            arts = [load(artifact_dir("GCOMP_GPU_ARTIFACTS") / n) for n in names]
            for art in arts:  # a stale artifact would compare other parameters
                assert set(art.params) == set(model.params)
                for k, v in model.params.items():
                    assert np.array_equal(art.params[k], np.asarray(v, np.float32)), k
            return arts
        from gcomp.compiler import compile_model
        from gcomp.passes import PassContext
        arts = [compile_model(model, t, train=train, precision=precision,
                              mcpu=PORTABLE_MCPU if (PREPARE and t == "llvm") else None,
                              ctx=PassContext(options=options or {}))
                for t in targets]
        if PREPARE:
            for art, n in zip(arts, names):
                art.save(artifact_dir("GCOMP_GPU_PREPARE") / n)
            pytest.skip(f"prepared {', '.join(names)}")
        return arts
    return _build


@pytest.fixture
def artifact_mode():
    """("prepare", DIR), ("load", DIR) or (None, None): for tests that drive the CLI."""
    if PREPARE:
        return "prepare", artifact_dir("GCOMP_GPU_PREPARE")
    if PREPARED:
        return "load", artifact_dir("GCOMP_GPU_ARTIFACTS")
    return None, None
