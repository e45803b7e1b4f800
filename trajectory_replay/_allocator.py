"""Process-level memory tuning for the command line (never applied by the library on its own).

glibc raises its mmap threshold after the first large buffer is freed, so later payload-sized
buffers come from the heap, where freed space is fragmented and stays resident. Replay loads and
frees many payload-sized tensors; with a fixed threshold they are mapped and returned to the OS
when freed, which keeps peak memory near what is actually live. Small temporaries stay on the
heap, whose top is kept (up to TRIM_THRESHOLD) instead of being handed back after every free:
replay's kernels allocate and free such buffers thousands of times, and each trimmed-then-regrown
page is a page fault. All threads share one heap (one arena): a buffer read on replay's read-ahead
thread and freed on the main thread goes back where the main thread's next buffer comes from, instead
of leaving a second heap's worth of free memory resident. Respects a user's own MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_ and MALLOC_ARENA_MAX.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 2 << 20
TRIM_THRESHOLD = 64 << 20
BLOCK_MMAP_THRESHOLD = 32 << 20
"""The mmap threshold while a replay streams: glibc's largest (on 64-bit), above a block's buffers."""

_libc = None   # set once the tuning is applied


def return_large_buffers_to_os() -> bool:
    """Fix glibc's mmap threshold at 2 MiB and its trim threshold at 64 MiB, and keep one heap for all threads; True
    when applied (Linux with glibc only)."""
    global _libc
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        if applied and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        if applied and "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(_M_ARENA_MAX, 1)
        if applied:
            _libc = libc
        return applied
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False


def reuse_block_buffers() -> Callable[[], None]:
    """While a replay streams, keep its block-sized buffers on the heap; returns the function that ends it.

    A streamed replay allocates and frees the same few block-sized buffers (read payloads, stage outputs) once per
    block. Above the 2 MiB threshold each would be a fresh mapping, faulted in page by page every time, which on a
    virtual machine costs as much CPU as the arithmetic done in it. For the pass they come from the heap instead,
    where a freed block's buffers serve the next block; at the end the threshold goes back and the heap's free
    memory is handed back to the OS. Nothing happens when the tuning above was not applied (a library user's
    process keeps glibc's own adaptive threshold)."""
    libc = _libc
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, BLOCK_MMAP_THRESHOLD):
        return lambda: None

    def end() -> None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.malloc_trim(0)

    return end


# --- large read buffers ---------------------------------------------------------------------------
#
# `bytearray(n)` zero-fills its memory, touching every page once before a read fills it again; for
# payload-sized buffers that doubles the page faults and the memory traffic of a read. A buffer a read
# is about to overwrite completely is allocated uninitialised instead (a plain CPython call). Huge pages
# are not requested: with the kernel's common "defrag=madvise" setting an madvised fault compacts memory
# synchronously, which stalls badly on a host whose memory is full of page cache.

LARGE_BUFFER = 8 << 20  # smaller buffers gain nothing measurable


def _bind():
    try:
        new = ctypes.pythonapi.PyByteArray_FromStringAndSize
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        return new
    except (AttributeError, OSError):  # not CPython
        return None


_new_bytearray = _bind()


def buffer_for_read(size: int) -> bytearray:
    """A new bytearray of `size` bytes whose content is unspecified: the caller overwrites all of it.

    Never hand such a buffer out before it is filled (on a failed read, drop it)."""
    if size < LARGE_BUFFER or _new_bytearray is None:
        return bytearray(size)
    return _new_bytearray(None, size)
