"""The store's inventory: listing, refs, records, closures, verifying and deleting, on local disk and S3."""

from __future__ import annotations

import os

import pytest

from trajectory_replay.errors import IntegrityError
from trajectory_replay.store import ChunkingParams, ObjectStore, blob_ref_key, hash_bytes, object_key
from trajectory_replay.store.digest import OBJECT, REF
from trajectory_replay.store.inventory import write_layers
from trajectory_replay.store.layout import OBJECTS_DIR
from trajectory_replay.store.records import RecordError

SMALL = ChunkingParams(chunk_size=64 << 10, min_size=16 << 10, target_size=32 << 10)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        s = ObjectStore.open(str(tmp_path / "store"))
    else:
        url, options = request.getfixturevalue("s3_root")
        s = ObjectStore.open(url, cache=False, **options)
    s.chunking = SMALL
    return s


def _blob(store: ObjectStore, size: int = 200_000):
    ref = store.put(os.urandom(size))
    return ref, store.record(ref)


def test_lists_objects_and_refs_by_digest(store):
    ref, record = _blob(store)
    plain = store.put_object(b"a plain object")
    store.backend.write(f"{OBJECTS_DIR}/zz/not-a-digest", b"x")  # named the way no store names an object
    inventory = store.inventory
    chunks = {c.digest for c in record.chunks}
    assert set(inventory.object_digests()) == chunks | {ref.record, plain}
    assert inventory.ref_digests() == [ref.digest]
    assert f"{OBJECTS_DIR}/zz/not-a-digest" in inventory.object_keys()
    assert len(inventory.object_keys()) == len(chunks) + 3
    assert inventory.ref_keys() == [blob_ref_key(ref.digest)]


def test_refs_and_records_say_what_is_wrong_without_raising(store):
    ref, record = _blob(store)
    other, _ = _blob(store, 50_000)
    absent = hash_bytes(b"never stored")
    store.backend.write(blob_ref_key(other.digest), b"garbage")
    inventory = store.inventory
    refs = inventory.read_refs([ref.digest, other.digest, absent])
    assert refs[ref.digest] == ref.record and refs[absent] is None
    assert isinstance(refs[other.digest], IntegrityError) and "does not hold a digest" in str(refs[other.digest])
    assert inventory.refs([other.digest]) == {other.digest: None}

    chunk = record.chunks[0].digest
    got = inventory.records([ref.record, chunk, absent])
    assert got[ref.record] == record and got[absent] is None
    assert isinstance(got[chunk], RecordError)  # verified bytes, but not a record
    damaged = bytearray(store.backend.read(object_key(other.record)))
    damaged[5] ^= 0xFF
    store.backend.write(object_key(other.record), bytes(damaged))
    bad = store.inventory.records([other.record])[other.record]
    assert isinstance(bad, RecordError) and bad.reason.startswith("content hashes to blake3:")


def test_hostile_record_is_refused_before_it_is_parsed(store):
    data = b"[" * 5000 + b"]" * 5000
    digest = store.put_object(data)
    got = store.inventory.records([digest])[digest]
    assert isinstance(got, RecordError) and "nested more than" in got.reason


def test_probe_tells_records_from_chunks(store):
    ref, record = _blob(store)
    inventory = store.inventory
    assert inventory.probe_record(ref.record) == record
    assert inventory.probe_record(record.chunks[0].digest) is None
    assert inventory.probe_record(hash_bytes(b"never stored")) is None


def test_closure_names_ref_record_and_chunks_and_blames_the_right_key(store):
    ref, record = _blob(store)
    other, _ = _blob(store, 50_000)
    store.backend.delete(object_key(record.chunks[0].digest))  # chunks are named, not read
    node = store.inventory.closure({ref.digest: (ref.record, ref.size)})[ref.digest]
    chunk_keys = {object_key(c.digest) for c in record.chunks}
    assert node.keys == {blob_ref_key(ref.digest), object_key(ref.record)} | chunk_keys
    assert node.chunks == tuple((c.digest, c.size) for c in record.chunks)
    assert not (node.missing or node.corrupt or node.problems)
    chunks, records, refs = write_layers([node])  # the store's write order: chunks, then records, then refs
    assert (set(chunks), list(records), list(refs)) == (
        chunk_keys,
        [object_key(ref.record)],
        [blob_ref_key(ref.digest)],
    )
    assert chunks[object_key(record.chunks[0].digest)] == record.chunks[0].size

    store.backend.write(blob_ref_key(ref.digest), other.record.encode())  # the ref names another blob's record
    store.backend.delete(object_key(ref.record))
    node = store.inventory.closure({ref.digest: (ref.record, ref.size)})[ref.digest]
    assert node.ref_record == other.record
    assert node.missing == {object_key(ref.record)} and node.corrupt == {blob_ref_key(ref.digest)}
    assert node.problems == [f"missing record {ref.record}"] and node.chunks == ()


def test_read_blobs_checks_each_chunk_and_the_whole(store):
    ref, record = _blob(store)
    data = store.get(ref)
    chunks = [c.digest for c in record.chunks]
    inventory = store.inventory
    assert inventory.read_blobs({ref.digest: chunks})[ref.digest].data == data
    store.backend.delete(object_key(chunks[0]))
    store.backend.write(object_key(chunks[1]), b"not its content")
    got = store.inventory.read_blobs({ref.digest: chunks})[ref.digest]
    assert got.data is None
    assert got.missing == {object_key(chunks[0])} and got.corrupt == {object_key(chunks[1])}


def test_verify_install_link_and_delete(store):
    ref, record = _blob(store)
    inventory = store.inventory
    chunk = record.chunks[0].digest
    keys = [object_key(chunk), object_key(ref.record), blob_ref_key(ref.digest)]
    checked = {c.key: c for c in inventory.verify(keys)}
    assert all(c.sound for c in checked.values())
    assert checked[blob_ref_key(ref.digest)].kind == REF and checked[object_key(chunk)].kind == OBJECT
    assert checked[object_key(chunk)].size == record.chunks[0].size
    assert inventory.verify_object(chunk) is None

    good = store.backend.read(object_key(chunk))
    store.backend.write(object_key(chunk), b"damaged")
    store.backend.write(blob_ref_key(ref.digest), b"garbage")
    checked = {c.key: c for c in inventory.verify(keys)}
    assert not checked[object_key(chunk)].sound and not checked[blob_ref_key(ref.digest)].sound
    assert inventory.verify_object(chunk) == "content does not match its digest"

    inventory.install(object_key(chunk), good)  # a stored object with the wrong bytes is replaced
    assert inventory.verify_object(chunk) is None
    inventory.delete_refs([ref.digest])
    assert inventory.link(ref.digest, ref.record) and inventory.read_ref(ref.digest) == ref.record
    assert not inventory.link(ref.digest, record.chunks[1].digest)  # create-once: the first ref stays
    inventory.delete_objects([chunk])
    assert inventory.verify_object(chunk) == "missing"
    assert object_key(chunk) not in {c.key for c in inventory.verify(keys)}


def test_links_out_of_the_root_are_found(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    root = tmp_path / "store"
    root.mkdir()
    os.symlink(outside, root / OBJECTS_DIR)
    assert ObjectStore.open(str(root)).inventory.links_out() == [OBJECTS_DIR]
    assert ObjectStore.open(str(tmp_path / "other")).inventory.links_out() == []


def test_concurrently_keeps_busy_items_on_this_thread_and_sends_waiting_ones_to_a_pool():
    """Items that keep the thread busy (a local store's metadata) run here, in order; from the first item that
    waited, the rest go to a thread pool, still returned in order."""
    import threading
    import time

    from trajectory_replay.store.inventory import concurrently

    here = threading.current_thread().name

    def busy(x: int) -> tuple[int, str]:
        return x * x, threading.current_thread().name

    runs = [concurrently(busy, range(50), 4) for _ in range(3)]
    assert all([v for v, _ in got] == [x * x for x in range(50)] for got in runs)
    # a thread preempted for a millisecond mid-item looks like a wait: one run of three on this thread is enough
    assert any({t for _, t in got} == {here} for got in runs)

    def waits(x: int) -> tuple[int, str]:
        if x >= 3:
            time.sleep(0.005)  # a round trip to a remote store
        return x, threading.current_thread().name

    got = concurrently(waits, range(20), 4)
    assert [v for v, _ in got] == list(range(20))
    assert {t for _, t in got[:4]} == {here}  # up to and including the first item that waited
    assert here not in {t for _, t in got[4:]}
