"""Writing files so that nobody sees half of one.

Artifacts, checkpoints, outputs and calibration tables are written to a temporary file
beside their path, flushed to disk, then renamed over it: a reader (another compile, a
service loading the artifact) finds the old file or the new one, never a partial write,
and a failed write leaves the old file as it was and no temporary file behind.  The new
file gets the permissions the user would get from creating it (the umask's, or those of
the file it replaces: the temporary file starts private), and a path that is a symbolic
link is written through, the link kept.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from gcomp.errors import GcompError


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def writable_dir(path: str | Path, what: str = "output") -> Path:
    """``path``'s directory, if a file can be created there; else a GcompError naming it
    (checked before long work whose result would be lost)."""
    d = Path(os.path.realpath(path)).parent
    if not d.is_dir():
        raise GcompError(f"cannot write the {what} {str(path)!r}: directory {str(d)!r} "
                         "does not exist")
    try:  # creating a file is the only sure test (permissions, read-only mounts, root)
        fd, probe = tempfile.mkstemp(prefix=".gcomp-probe.", dir=d)
    except OSError as e:
        raise GcompError(f"cannot write the {what} {str(path)!r}: directory {str(d)!r}: "
                         f"{e.strerror}") from None
    os.close(fd)
    os.unlink(probe)
    return d


def write_atomic(path: str | Path, write, suffix: str = "") -> Path:
    """Replace ``path`` with what ``write(f)`` writes to ``f``, a binary file.  Failing to
    create or replace the file (permissions, a read-only or full disk) is a GcompError
    naming ``path``."""
    path = Path(path)
    target = Path(os.path.realpath(path))  # a symlink's target is replaced, not the link
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise GcompError(f"cannot write {str(path)!r}: {e.strerror}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    except OSError as e:
        raise GcompError(f"cannot write {str(path)!r}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise GcompError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
        raise
    return path
