"""Atomic writes (gcomp/files.py): a file is replaced whole or left as it was."""

import pytest

from gcomp.files import write_atomic


def test_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "model.gcomp"
    path.write_bytes(b"old")
    assert write_atomic(path, lambda f: f.write(b"new contents")) == path
    assert path.read_bytes() == b"new contents"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gcomp"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "ckpt.npz"
    path.write_bytes(b"the user's checkpoint")

    def half_then_fail(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, half_then_fail, suffix=".npz")
    assert path.read_bytes() == b"the user's checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]


def test_a_new_file_is_created_only_when_the_write_succeeds(tmp_path):
    path = tmp_path / "out.npy"
    with pytest.raises(ValueError):
        write_atomic(path, lambda f: (_ for _ in ()).throw(ValueError("bad array")))
    assert not path.exists() and list(tmp_path.iterdir()) == []
    write_atomic(path, lambda f: f.write(b"\x93NUMPY"))
    assert path.read_bytes() == b"\x93NUMPY"
