"""Keep freed memory mapped, so a step's large temporaries never cost page faults.

glibc serves allocations above its mmap threshold (128 KiB, raised dynamically up to
32 MiB) with fresh ``mmap`` pages, and returns freed heap tops to the OS. An engine step
allocates and frees the same large activations every layer, so every step faulted those
pages in again (docs/decisions.md has the cost). Raising them once per process
(what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do, and why vLLM's CPU build
preloads tcmalloc) keeps that memory in the heap for reuse. Elsewhere than glibc: no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM = 2**30  # keep up to 1 GiB of freed heap top mapped
_MMAP = 32 * 2**20  # the most glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit)


def keep_freed_memory_mapped() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if it took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    trim = mallopt(_M_TRIM_THRESHOLD, _TRIM)
    mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP)
    return bool(trim and mmap)
