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
