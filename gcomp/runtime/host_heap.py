"""The process's C heap: handing its free pages back to the operating system.

numpy allocates arrays of up to 32 MB from the C heap once glibc has raised its mmap
threshold (it does so each time a larger block is freed).  Freeing them leaves pages the
process still holds, between blocks that stay live; glibc returns them only from the top
of the heap, or when asked (``malloc_trim``).  Binding a graph frees tens of such arrays
at once, so the runtime asks, which lowers the peak that its first steps then set.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc's; other C libraries have none
    except (AttributeError, OSError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
