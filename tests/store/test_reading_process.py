"""The reading process: local chunk files read and verified by a helper process into a shared arena, exactly as
this process would read them, and never a source of errors of its own."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from trajectory_replay.errors import IntegrityError, NotFoundError, TrajectoryReplayError
from trajectory_replay.store import ChunkingParams, ObjectStore, object_key, parse_digest
from trajectory_replay.store import reading_process as process

SMALL = ChunkingParams(chunk_size=64 << 10, min_size=16 << 10, target_size=32 << 10)


@pytest.fixture
def local(tmp_path):
    store = ObjectStore.open(str(tmp_path / "store"))
    store.chunking = SMALL
    data = os.urandom(400_000)
    ref = store.put(data)
    assert len(store.record(ref).chunks) == 7
    return store, ref, data


def _read(store, ref, start=0, end=None):
    record = store.record(ref)
    return store.read_joined(ref, [(start, record.size if end is None else end)], for_tensor=True)


def _chunk_file(store, ref, i: int) -> str:
    return store.backend.local_file(object_key(store.record(ref).chunks[i].digest))


def test_the_helper_reads_whole_chunks_into_its_arena(local):
    store, ref, data = local
    with process.reading_process(1 << 20) as helper:
        assert helper is not None and process.active() is helper
        got = _read(store, ref)
        assert isinstance(got, memoryview) and got.obj.base.obj is helper._map  # a part of the arena
        assert bytes(got) == data
        # a range with partial chunks at both edges: the whole chunks by the helper, the edges by blocks here
        inner = _read(store, ref, 70_000, 330_000)
        assert bytes(inner) == data[70_000:330_000]
        tensor = torch.frombuffer(inner, dtype=torch.uint8)
        assert bytes(tensor.numpy()) == data[70_000:330_000]


def test_without_for_tensor_a_read_never_lands_in_the_arena(local):
    store, ref, data = local
    with process.reading_process(1 << 20):
        assert store.read_ranges(ref, [(0, len(data))])[0] == data
        got = store.read_joined(ref, [(0, len(data))])
    assert isinstance(got, bytearray) and got == data


@pytest.mark.parametrize("helper", [True, False])
def test_several_ranges_are_joined_in_one_buffer_whole_chunks_read_whole(local, monkeypatch, helper):
    """Ranges anywhere in the blob (inside one chunk, across several, touching, empty), one after another in one
    buffer; the chunks wholly inside a range are read whole, the rest by blocks: all of it by the helper when one
    is on, nothing in this process."""
    from trajectory_replay.backends.local import LocalBackend

    store, ref, data = local
    spans = [(0, 10), (10, 200_000), (250_000, 250_000), (260_000, 399_000), (5, 70_000), (399_990, 400_000)]
    whole_reads: list[str] = []
    block_reads: list[str] = []
    read_into, read_range = LocalBackend.read_into, LocalBackend.read_range

    def recording(self, key, target):
        whole_reads.append(key)
        return read_into(self, key, target)

    def recording_range(self, key, start, end):
        block_reads.append(key)
        return read_range(self, key, start, end)

    monkeypatch.setattr(LocalBackend, "read_into", recording)
    monkeypatch.setattr(LocalBackend, "read_range", recording_range)
    with process.reading_process(1 << 20) if helper else contextlib.nullcontext():
        got = store.read_joined(ref, spans, for_tensor=True)
        assert bytes(got) == b"".join(data[a:b] for a, b in spans)
        assert isinstance(got, memoryview) == helper
    inside = {
        object_key(c.digest)
        for c in store.record(ref).chunks
        if any(a <= c.offset and c.offset + c.size <= b for a, b in spans)
    }
    assert inside and (whole_reads == [] if helper else set(whole_reads) == inside)
    assert (block_reads == []) == helper
    with pytest.raises(TrajectoryReplayError, match="outside blob"):
        store.read_joined(ref, [(0, 10), (399_999, 400_001)])


def test_an_arena_part_is_written_again_only_once_nothing_refers_to_it(local):
    with process.reading_process(1 << 20) as helper:
        first, second = helper.allocate(1000), helper.allocate(1000)
        assert first.offset == 0 and second.offset == 1000
        tensor = torch.frombuffer(first.view, dtype=torch.uint8)  # a tensor on a part keeps it in use
        del first
        third = helper.allocate(1000)
        assert third.offset == 2000
        del tensor, third
        again = helper.allocate(1000)
        assert again.offset == 0  # free again: the lowest free run
        piece = second.view[10:20]  # so does a slice of a part, on its own
        del second
        assert helper.allocate(1000).offset == 1000 + 1000  # the run after `again` and `piece`'s part
        del piece
        assert helper.allocate(2000).offset == 1000
        assert helper.allocate(1 << 21) is None  # larger than the arena: the caller reads into memory of its own


@pytest.mark.parametrize("read", ["whole", "edge"])
@pytest.mark.parametrize("damage", ["flipped", "missing", "short", "long"])
def test_a_damaged_chunk_fails_as_it_does_without_the_helper(local, damage, read):
    """The same error, word for word, whichever process read the chunk: read whole, or only part of it at the edge
    of a range (by its blocks). A chunk one byte too long is not noticed by a read of part of it, here or there."""
    store, ref, data = local
    chunk = store.record(ref).chunks[3]
    path = _chunk_file(store, ref, 3)
    content = open(path, "rb").read()
    os.chmod(path, 0o644)
    if damage == "missing":
        os.remove(path)
    else:
        changed = {
            "flipped": content[:100] + bytes([content[100] ^ 1]) + content[101:],
            "short": content[:-1],
            "long": content + b"x",
        }[damage]
        with open(path, "wb") as f:
            f.write(changed)
    start = 0 if read == "whole" else chunk.offset + 50  # chunk 3 read from its byte 50: an edge, by blocks
    if read == "edge" and damage == "long":
        assert bytes(store.read_joined(ref, [(start, len(data))])) == data[start:]
        with process.reading_process(1 << 20):
            assert bytes(_read(store, ref, start)) == data[start:]
        return
    kind = NotFoundError if damage == "missing" else IntegrityError
    with pytest.raises(kind) as alone:
        _read(store, ref, start)
    with process.reading_process(1 << 20) as helper:
        with pytest.raises(kind) as helped:
            _read(store, ref, start)
        assert helper.broken is None  # a damaged store is the store's fault, not the helper's
    assert str(helped.value) == str(alone.value)
    assert chunk.digest in str(alone.value) or store.record(ref).digest in str(alone.value)


def test_a_helper_that_dies_leaves_the_reads_to_this_process(local):
    store, ref, data = local
    with process.reading_process(1 << 20) as helper:
        assert bytes(_read(store, ref)) == data
        helper._proc.kill()
        helper._proc.wait()
        assert bytes(_read(store, ref)) == data  # read here instead, as correct
        assert helper.broken is not None and process.active() is None


def test_the_helper_ends_with_the_last_use(local):
    store, ref, data = local
    with process.reading_process(1 << 20) as outer:
        with process.reading_process(1 << 20) as inner:
            assert inner is outer  # one helper per process
        assert process.active() is outer and outer._proc.poll() is None
        kept = _read(store, ref)
    assert process.active() is None
    assert outer._proc.poll() is not None  # the helper process has exited
    assert bytes(kept) == data  # what was read stays valid after the helper is gone


def test_where_no_helper_can_run_reads_stay_here(local, monkeypatch):
    store, ref, data = local
    monkeypatch.delattr(os, "memfd_create")
    with process.reading_process(1 << 20) as helper:
        assert helper is None and process.active() is None
        got = _read(store, ref)
    assert isinstance(got, bytearray) and got == data


def test_the_helper_answers_requests_with_named_failures(local):
    """A request of a whole chunk and of blocks of another: read into the arena and checked, and each failure named
    by the item it is for, its kind and its detail."""
    store, ref, data = local
    record = store.record(ref)
    one, two = record.chunks[1], record.chunks[2]
    size = record.block_size
    with process.reading_process(1 << 20) as helper:
        part = helper.allocate(one.size + size)
        whole = process.WholeChunk(_chunk_file(store, ref, 1), part.offset, one.size, parse_digest(one.digest))
        blocks = process.ChunkBlocks(
            _chunk_file(store, ref, 2),
            part.offset + one.size,
            lo=0,
            hi=size,
            block_size=size,
            first=0,
            hashes=two.blocks[:32],
            a=0,
            b=size,
        )
        assert helper.read([whole, blocks]) == []
        assert bytes(part.view) == data[one.offset : one.offset + one.size] + data[two.offset : two.offset + size]
        wrong = blocks._replace(hashes=one.blocks[:32])
        missing = whole._replace(path=whole.path + "-gone")
        failures = helper.read([whole, wrong, missing])
        assert failures == [process.ReadFailure(1, "block", 0), process.ReadFailure(2, "missing", 0)]
        assert failures[0].item == 1 and failures[0].kind == "block" and failures[0].detail == 0


def test_the_store_decides_whether_reading_ahead_uses_a_reading_process(local, tmp_path):
    """A store on local disk reads ahead through a reading process; one with a read cache, or not on local disk,
    reads as it always does."""
    store, ref, data = local
    with store.reading_ahead(1 << 20):
        helper = process.active()
        assert helper is not None
        got = _read(store, ref)
        assert isinstance(got, memoryview) and got.obj.base.obj is helper._map
    assert process.active() is None
    memory = ObjectStore.open("memory://reading-ahead")
    cached = ObjectStore.open(str(tmp_path / "store"), cache=True, cache_dir=str(tmp_path / "cache"))
    for other, blob in ((memory, memory.put(data)), (cached, ref)):
        assert not other.reads_local_files
        with other.reading_ahead(1 << 20):
            assert process.active() is None
            got = other.read_joined(blob, [(0, len(data))], for_tensor=True)
            assert isinstance(got, bytearray) and got == data
