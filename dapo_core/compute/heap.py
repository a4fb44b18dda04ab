"""Returning the C heap's free memory to the operating system after a large pass (glibc's `malloc_trim`).

glibc keeps freed blocks in its arenas (one per thread that allocated, up to 8 × cores) and hands little of
them back; a Ray actor's calls may run on different threads, so each generation can leave its own arena's
worth of freed prefill and sampling buffers resident, and the process's peak creeps up by that much per
thread. `trim_heap()` after a pass releases those pages. Where the C library has no `malloc_trim` (macOS,
musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["trim_heap"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Hand the free pages of every malloc arena back to the OS (`malloc_trim(0)`); True when it ran and
    released something, False when nothing was released or the C library cannot trim."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
