"""Writing files so that nobody sees half of one.

Artifacts, checkpoints, outputs and calibration tables are written to a temporary file
beside their path, flushed to disk, then renamed over it: a reader (another compile, a
service loading the artifact) finds the old file or the new one, never a partial write,
and a failed write leaves the old file as it was and no temporary file behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, write, suffix: str = "") -> Path:
    """Replace ``path`` with what ``write(f)`` writes to ``f``, a binary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
