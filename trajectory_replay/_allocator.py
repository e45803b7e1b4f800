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
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 2 << 20
TRIM_THRESHOLD = 64 << 20
BLOCK_MMAP_THRESHOLD = 32 << 20
"""The mmap threshold while a replay streams: glibc's largest (on 64-bit), above a block's buffers."""

_libc = None  # set once the tuning is applied
_mmap_threshold = MMAP_THRESHOLD  # the tuned process's threshold (a streamed pass raises it)


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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class BlockHeap:
    """While a replay streams, its block-sized buffers come from the heap (`reuse_block_buffers`)."""

    def __init__(self, libc) -> None:
        self._libc = libc
        self._info = getattr(libc, "mallinfo2", None) if libc is not None else None  # glibc 2.33 and later
        self._outside = 0
        if self._info is not None:
            self._info.restype = _MallInfo2
            self._outside = self._resident() - self._held()  # what malloc does not hold: libraries, Python's own

    def between_blocks(self) -> None:
        """Hand the heap's free pages back to the OS once more than FREE_HEAP_BUDGET of them are resident. Blocks'
        buffers and the small objects that outlive a block interleave on the heap, so some holes fit no later
        buffer: without this the heap grew by a few MiB per block, however many blocks came."""
        if self._libc is None or self._info is None:
            return
        if self._resident() - self._held() - self._outside > FREE_HEAP_BUDGET:
            self._libc.malloc_trim(0)

    def end(self) -> None:
        """Put the 2 MiB threshold back and hand the heap's free memory back to the OS."""
        global _mmap_threshold
        if self._libc is not None:
            self._libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            _mmap_threshold = MMAP_THRESHOLD
            self._libc.malloc_trim(0)
            self._libc = None

    def _held(self) -> int:
        """Bytes malloc has handed out (heap and mapped); asking also merges the heap's small free chunks."""
        assert self._info is not None  # asked only where glibc has mallinfo2
        info = self._info()
        return info.uordblks + info.hblkhd

    @staticmethod
    def _resident() -> int:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


FREE_HEAP_BUDGET = 128 << 20
"""Free heap memory kept between blocks of a streamed pass for the next block's buffers (a block of 4M tokens reads
about 100 MiB)."""


def reuse_block_buffers() -> BlockHeap:
    """While a replay streams, keep its block-sized buffers on the heap; `end()` the returned BlockHeap after it.

    A streamed replay allocates and frees the same few block-sized buffers (read payloads, stage outputs) once per
    block. Above the 2 MiB threshold each would be a fresh mapping, faulted in page by page every time, which on a
    virtual machine costs as much CPU as the arithmetic done in it. For the pass they come from the heap instead,
    where a freed block's buffers serve the next block; at the end the threshold goes back and the heap's free
    memory is handed back to the OS. Nothing happens when the tuning above was not applied (a library user's
    process keeps glibc's own adaptive threshold)."""
    global _mmap_threshold
    libc = _libc
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, BLOCK_MMAP_THRESHOLD):
        return BlockHeap(None)
    _mmap_threshold = BLOCK_MMAP_THRESHOLD
    return BlockHeap(libc)


# --- large read buffers ---------------------------------------------------------------------------
#
# `bytearray(n)` zero-fills its memory, touching every page once before a read fills it again; for
# payload-sized buffers that doubles the page faults and the memory traffic of a read. A buffer a read
# is about to overwrite completely is allocated uninitialised instead (a plain CPython call). Huge pages
# are not requested: with Linux's common "defrag=madvise" setting an madvised fault compacts memory
# synchronously, which stalls badly on a host whose memory is full of page cache.

LARGE_BUFFER = 8 << 20  # smaller buffers gain nothing measurable


def _bind():
    try:
        new = ctypes.pythonapi.PyByteArray_FromStringAndSize
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        resize = ctypes.pythonapi.PyByteArray_Resize
        resize.restype = ctypes.c_int
        resize.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
        return new, resize
    except (AttributeError, OSError):  # not CPython
        return None, None


_new_bytearray, _resize = _bind()

# Under the command line's tuning a large read buffer is its own mapping, returned to the OS when freed, so the
# next payload read faults a fresh one in page by page (on a virtual machine, about as much CPU as the read
# itself). A one-block replay frees payloads as its stages no longer need them while later stages read others of
# the same size, so the process keeps the large buffers it handed out and gives a buffer nothing refers to any
# more to the next read it can hold. At most SPARE_BUFFERS such free buffers are kept; the rest are let go.
SPARE_BUFFERS = 2
_handed_out: list[bytearray] = []
_pool_lock = threading.Lock()


def buffer_for_read(size: int) -> bytearray:
    """A new bytearray of `size` bytes whose content is unspecified: the caller overwrites all of it.

    Never hand such a buffer out before it is filled (on a failed read, drop it)."""
    if size < LARGE_BUFFER or _new_bytearray is None:
        return bytearray(size)
    if _libc is None or size < _mmap_threshold:  # not tuned, or a streamed pass: the heap serves it
        return _new_bytearray(None, size)
    with _pool_lock:
        buffer = _reuse(size)
        if buffer is None:
            buffer = _new_bytearray(None, size)
        _handed_out.append(buffer)
        return buffer


def _reuse(size: int):
    """A handed-out buffer nothing else refers to that holds `size` bytes without reallocating, resized to it; None
    when there is none. Free buffers beyond SPARE_BUFFERS are let go."""
    free = [i for i in range(len(_handed_out)) if sys.getrefcount(_handed_out[i]) == _UNREFERENCED]
    chosen = None
    for i in free:
        capacity = _handed_out[i].__alloc__()
        if capacity // 2 <= size < capacity and (chosen is None or capacity < _handed_out[chosen].__alloc__()):
            chosen = i
    buffer = None
    if chosen is not None:
        buffer = _handed_out[chosen]
        try:
            _resize(buffer, size)  # within its allocation: only the length changes
        except (BufferError, MemoryError):  # not without a reference to it; never hand out a wrong size
            buffer = None
    keep = set(free[-SPARE_BUFFERS:]) - {chosen}
    _handed_out[:] = [b for i, b in enumerate(_handed_out) if i not in free or i in keep]
    return buffer


_UNREFERENCED = 2
"""What `sys.getrefcount` reports for a handed-out buffer held only by `_handed_out`: that list's reference, and the
call's argument."""
