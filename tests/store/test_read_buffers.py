"""Large blobs are read into uninitialised buffers; the content must still be exact."""

import os

from trajectory_replay._allocator import LARGE_BUFFER, buffer_for_read
from trajectory_replay.store import ObjectStore


def test_buffer_for_read_sizes_and_type():
    for size in (0, 1, LARGE_BUFFER - 1, LARGE_BUFFER, LARGE_BUFFER + 12345):
        buf = buffer_for_read(size)
        assert isinstance(buf, bytearray) and len(buf) == size
        if size:
            buf[-1:] = b"x"  # writable to the last byte
            assert buf[-1] == ord("x")


def test_large_get_is_exact(tmp_path):
    data = os.urandom(LARGE_BUFFER * 2 + 777)  # several chunks, spans the large-buffer path
    store = ObjectStore.open(str(tmp_path / "s"))
    ref = store.put(data)
    got = store.get(ref)
    assert isinstance(got, bytearray) and got == data


_POOL_PROBE = r"""
import json, sys
import torch
from trajectory_replay import _allocator

seen = {}
size = _allocator.LARGE_BUFFER * 2
untuned = _allocator.buffer_for_read(size)
seen["kept_untuned"] = len(_allocator._handed_out)      # a library user's process keeps nothing
seen["tuned"] = _allocator.return_large_buffers_to_os()

first = _allocator.buffer_for_read(size)
first[:4] = b"abcd"
tensor = torch.frombuffer(first, dtype=torch.uint8)     # what a payload's tensor does with its buffer
del first
second = _allocator.buffer_for_read(size)
seen["not_while_referenced"] = second is not tensor.untyped_storage() and bytes(tensor[:4]) == b"abcd"
address = tensor.data_ptr()
del tensor
third = _allocator.buffer_for_read(size - 100)          # a payload of nearly the same size takes its memory
import ctypes
seen["reused"] = ctypes.addressof((ctypes.c_char * len(third)).from_buffer(third)) == address
seen["size"] = len(third) == size - 100
del third
fourth = _allocator.buffer_for_read(size // 4)          # too small for the free buffers: a new one
seen["small_is_new"] = len(fourth) == size // 4
del second, fourth
for _ in range(5):
    _allocator.buffer_for_read(_allocator.LARGE_BUFFER)
seen["spares"] = sum(sys.getrefcount(_allocator._handed_out[i]) == 2 for i in range(len(_allocator._handed_out)))
heap = _allocator.reuse_block_buffers()                 # a streamed pass: block buffers come from the heap
before = len(_allocator._handed_out)
block = _allocator.buffer_for_read(_allocator.LARGE_BUFFER * 2)
seen["streamed_not_kept"] = len(_allocator._handed_out) == before
heap.end()
print(json.dumps(seen))
"""


def test_large_read_buffers_nothing_refers_to_serve_the_next_read_of_the_command_line():
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, check=True, env=env)
    assert json.loads(out.stdout) == {
        "kept_untuned": 0,
        "tuned": True,
        "not_while_referenced": True,
        "reused": True,
        "size": True,
        "small_is_new": True,
        "spares": 2,
        "streamed_not_kept": True,
    }
