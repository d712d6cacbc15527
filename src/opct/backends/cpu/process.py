"""Process-wide memory settings of the CPU backend, applied only when it is set up (never on import).

Keep freed memory in the process instead of handing it back to the OS after every step (glibc only). A training
step allocates and frees the same large buffers every time: activations, log-prob chunks, and decode weights
merged and packed afresh where they cannot be merged in place. By default glibc serves blocks above a threshold
with fresh mmap()s and unmaps them on free, and trims the top of its heap once enough of it is free, so the next
step page-faults all of that memory in again and the kernel zeroes it. Raising both thresholds keeps the pages.
The cost: the process's resident memory stays near its high-water mark after a peak instead of shrinking.
The `keep_freed_memory` setting (env OPCT_KEEP_FREED_MEMORY=0) turns it off; other C libraries are left alone.

Long-lived buffers that a loop streams through many times (the lean decoder's kept packed weights) can be moved
onto 2 MB pages in place (`collapse_to_huge_pages`, Linux's MADV_COLLAPSE): a decode token then reads them with
far fewer TLB misses. The kernel copies the (already written) pages once; a kernel without the call leaves them as
they are.

Transparent huge pages for large tensors (`huge_pages`, env THP_MEM_ALLOC_ENABLE; off by default) are read by
PyTorch once, at its first allocation, so only the CLI can apply it: it sets that variable before it imports torch
(`opct.cli.before_torch`). Library users who want it set THP_MEM_ALLOC_ENABLE=1 in the environment. Off by
default because, with freed pages kept in the process, huge pages no longer save page faults: they only round
allocations up (figures: dev/LOG.md, 2026-11-24 (later)).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB come from the heap, so freeing them keeps their pages
TRIM_THRESHOLD = (1 << 31) - 1  # free memory at the heap's top is kept up to the largest value mallopt takes


_MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1+
_HUGE = 2 << 20


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def collapse_to_huge_pages(addr: int, nbytes: int) -> bool:
    """Ask the kernel to back [addr, addr + nbytes) with 2 MB pages where whole ones fit (MADV_COLLAPSE), now and
    synchronously; the contents are unchanged. Returns whether it did; False (and nothing changed) where the range
    holds no whole 2 MB page, on other systems or kernels, or when the kernel declines (it collapses pages that
    have been written, not untouched ones)."""
    madvise = _madvise()
    start, end = -(-addr // _HUGE) * _HUGE, (addr + nbytes) // _HUGE * _HUGE
    if madvise is None or end <= start:
        return False
    return madvise(start, end - start, _MADV_COLLAPSE) == 0


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process. Returns whether they are raised."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD))
                    and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)))
    except (OSError, AttributeError):
        return False

