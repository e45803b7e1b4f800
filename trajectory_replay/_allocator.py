"""Process-level memory tuning for the command line (never applied by the library on its own).

glibc raises its mmap threshold after the first large buffer is freed, so later payload-sized
buffers come from the heap, where freed space is fragmented and stays resident. Replay loads and
frees many payload-sized tensors; with a fixed threshold they are mapped and returned to the OS
when freed, which keeps peak memory near what is actually live. Respects a user's own
MALLOC_MMAP_THRESHOLD_.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 2 << 20


def return_large_buffers_to_os() -> bool:
    """Fix glibc's mmap threshold at 2 MiB; True when applied (Linux with glibc only)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
