"""Every module of the package imports on its own, first, in a fresh interpreter.

A test session imports modules in one order and caches them, so an import cycle that
breaks only when a particular module is imported first (as a service or a single test
file does) goes unseen by the rest of the suite.  One interpreter loads the heavy
dependencies once and forks a child per module, which imports that module and nothing
of gcomp before it.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import gcomp

SCRIPT = r"""
import importlib, os, sys, traceback
import numpy, scipy.sparse, tvm  # noqa: F401  (loaded once, before the forks)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED:" + ",".join(failed))
"""


def _modules() -> list[str]:
    root = pathlib.Path(gcomp.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # runs the CLI when imported
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_module_imports_first():
    names = _modules()
    assert "gcomp.codegen.amx_kernels" in names and len(names) > 50
    done = subprocess.run([sys.executable, "-c", SCRIPT, *names], capture_output=True,
                          text=True, timeout=600)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED:"), done.stdout + done.stderr
    assert last == "FAILED:", f"modules that fail imported first: {last[7:]}\n{done.stderr}"
