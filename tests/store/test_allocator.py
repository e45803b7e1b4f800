"""The command line's malloc tuning, observed through glibc's own counters in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import ctypes, json
    import torch
    from trajectory_replay import _allocator

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _allocator._MallInfo2

    def mapped(nbytes):
        before = libc.mallinfo2().hblks
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        return libc.mallinfo2().hblks - before

    block = 16 << 20   # a block's payload (4M float32 tokens)
    _allocator.reuse_block_buffers().end()   # before the tuning: nothing to do
    seen = {}
    seen["tuned"] = _allocator.return_large_buffers_to_os()
    seen["mapped_small"] = mapped(4 << 20)
    streaming = _allocator.reuse_block_buffers()
    seen["streaming_block"] = mapped(block)
    seen["streaming_huge"] = mapped(64 << 20)
    streaming.end()
    seen["after_block"] = mapped(block)

    # freed buffers stay resident in the heap until between_blocks hands them back
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096
    libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD: a free at the top of the heap must not hand pages back itself
    heap = _allocator.reuse_block_buffers()
    buffers, pins = [], []
    for _ in range(12):
        buffers.append(torch.ones(block, dtype=torch.uint8))
        pins.append(torch.ones(1 << 16, dtype=torch.uint8))
    del buffers
    before = rss()
    heap.between_blocks()
    seen["handed_back"] = (before - rss()) >> 20 >= 150 or (before >> 20, rss() >> 20)
    heap.end()
    print(json.dumps(seen))
""")


def test_block_buffers_come_from_the_heap_while_a_replay_streams_and_free_pages_go_back():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # a user's own settings win
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, env=env)
    seen = json.loads(out.stdout)
    assert seen == {
        "tuned": True,
        "mapped_small": 1,
        "streaming_block": 0,
        "streaming_huge": 1,
        "after_block": 1,
        "handed_back": True,
    }, seen
