"""The README's Python examples run as written (a newcomer copies them verbatim)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    """The README's ```python blocks that use gcomp alone (not the torch export)."""
    text = (REPO / "README.md").read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
            if "gcomp" in b and "torch" not in b]


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_example_runs(tmp_path, index):
    block = python_blocks()[index]
    p = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    if "print(model.graph)" in block:  # the builder example prints its Graph IR
        assert "aggregate" in p.stdout or "scatter" in p.stdout, p.stdout[:500]
    if "trainer.evaluate()" in block:
        assert "test_acc" in p.stdout and (tmp_path / "ck.npz").exists()


def test_readme_has_the_examples():
    assert len(python_blocks()) >= 2
