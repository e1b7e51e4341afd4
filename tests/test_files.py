"""Atomic writes (gcomp/files.py): a file is replaced whole or left as it was."""

import os

import pytest

from gcomp.errors import GcompError
from gcomp.files import writable_dir, write_atomic


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

    with pytest.raises(GcompError, match=r"cannot write '.*ckpt.npz': disk full"):
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


def test_permissions_are_those_of_a_created_file_or_of_the_file_replaced(tmp_path):
    old = os.umask(0o022)
    try:
        new = write_atomic(tmp_path / "a.gcomp", lambda f: f.write(b"x"))
        assert os.stat(new).st_mode & 0o777 == 0o644  # not mkstemp's private 0600
        kept = tmp_path / "b.npy"
        kept.write_bytes(b"old")
        kept.chmod(0o640)
        write_atomic(kept, lambda f: f.write(b"new"))
        assert os.stat(kept).st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_a_symlink_is_written_through_and_kept(tmp_path):
    target = tmp_path / "store" / "model.gcomp"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "current.gcomp"
    link.symlink_to(target)
    write_atomic(link, lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gcomp"]


def test_an_uncreatable_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(GcompError, match=r"cannot write '.*missing/out.npy'"):
        write_atomic(tmp_path / "missing" / "out.npy", lambda f: f.write(b"x"))
    with pytest.raises(GcompError, match=r"directory '.*missing' does not exist"):
        writable_dir(tmp_path / "missing" / "ckpt.npz", "checkpoint")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(GcompError, match="Permission denied"):
            writable_dir(ro / "ckpt.npz", "checkpoint")
