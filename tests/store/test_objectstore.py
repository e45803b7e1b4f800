"""ObjectStore: digests, chunks, records, verified reads, dedup, cache; on memory, local disk and S3."""

from __future__ import annotations

import os

import blake3
import pytest

from trajectory_replay.errors import IntegrityError, InvalidKeyError, NotFoundError
from trajectory_replay.store import ChunkingParams, ObjectStore, blob_ref_key, hash_bytes, object_key, parse_digest
from trajectory_replay.store.objectstore import SMALL_OBJECT

SMALL = ChunkingParams(chunk_size=64 << 10, min_size=16 << 10, target_size=32 << 10)


@pytest.fixture(params=["memory", "local", "s3"])
def store(request, tmp_path):
    if request.param == "memory":
        s = ObjectStore.open(request.getfixturevalue("memory_root"))
    elif request.param == "local":
        s = ObjectStore.open(str(tmp_path / "store"))
    else:
        url, options = request.getfixturevalue("s3_root")
        s = ObjectStore.open(url, cache_dir=str(tmp_path / "cache"), **options)
    s.chunking = SMALL
    return s


def test_put_get_roundtrip_and_digest(store):
    data = os.urandom(300_000)
    ref = store.put(data)
    assert ref.digest == "blake3:" + blake3.blake3(data).hexdigest()
    assert ref.size == len(data)
    assert store.get(ref) == data
    assert store.get(ref.digest) == data
    assert store.has(ref.digest) and store.has(ref.record)
    assert not store.has(hash_bytes(b"never stored"))
    # fixed-size chunks without cuts: ceil(300000 / 65536) chunk objects, one record, one ref
    assert len(store.record(ref).chunks) == 5
    assert store.backend.exists(blob_ref_key(ref.digest))


def test_empty_blob(store):
    ref = store.put(b"")
    assert ref.size == 0 and store.get(ref) == b"" and store.read_range(ref, 0, 0) == b""


def test_second_put_is_a_noop(store):
    data = os.urandom(200_000)
    first = store.put(data)
    written = store.backend.stats.bytes_written
    assert store.put(data) == first
    assert store.backend.stats.bytes_written == written
    assert store.stats.blobs_existing == 1


def test_read_range_exact_bytes_and_only_covering_blocks(store):
    data = os.urandom(1 << 20)
    ref = store.put(data)
    store.record(ref)  # record fetched (and cached for remote) before counting
    for start, end in [(0, 1), (12345, 67890), (65535, 65537), ((1 << 20) - 10, 1 << 20), (500, 500)]:
        store.backend.stats.reset()
        assert store.read_range(ref, start, end) == data[start:end]
        if store.cache is None and end > start:
            first_block, last_block = start // store.block_size, (end - 1) // store.block_size
            # record again (no cache for local stores) plus only whole covering blocks
            record_size = store.backend.size(object_key(ref.record))
            covering = (last_block - first_block + 1) * store.block_size
            assert store.backend.stats.bytes_read <= record_size + covering


def test_read_range_out_of_bounds(store):
    ref = store.put(b"abc")
    with pytest.raises(Exception, match="outside blob"):
        store.read_range(ref, 0, 4)


def test_put_object_and_get_object(store):
    digest = store.put_object(b'{"a":1}')
    assert store.get_object(digest) == b'{"a":1}'
    assert store.get(digest) == b'{"a":1}'  # a plain object is gettable by digest too


def test_missing_blob_is_not_found(store):
    with pytest.raises(NotFoundError, match="no blob or object blake3:0000"):
        store.get("blake3:" + "0" * 64)


@pytest.mark.parametrize("bad", ["md5:abc", "blake3:xyz", "blake3:" + "a" * 63, "blake3:" + "A" * 64, 42])
def test_invalid_digests_rejected(store, bad):
    with pytest.raises(InvalidKeyError, match="invalid digest"):
        store.get(bad)


def _flip(store, key, offset):
    data = bytearray(store.backend.read(key))
    data[offset] ^= 0x01
    store.backend.write(key, bytes(data))


def test_flipped_byte_in_chunk_detected(store):
    data = os.urandom(200_000)
    ref = store.put(data)
    chunk = store.record(ref).chunks[1]
    _flip(store, object_key(chunk.digest), 100)
    if store.cache is not None:
        store.cache.max_bytes = 0  # a damaged object must be refused even when nothing is cached
        store.cache = None
    with pytest.raises(IntegrityError, match=chunk.digest):
        store.get(ref)
    with pytest.raises(IntegrityError, match=chunk.digest):
        store.read_range(ref, chunk.offset + 90, chunk.offset + 110)
    # a range in an intact block of the same chunk is still served, verified
    assert (
        store.read_range(ref, chunk.offset + 40000, chunk.offset + 40010)
        == data[chunk.offset + 40000 : chunk.offset + 40010]
    )


def test_flipped_byte_in_record_detected(store):
    ref = store.put(os.urandom(100_000))
    _flip(store, object_key(ref.record), 10)
    store.cache = None
    with pytest.raises(IntegrityError, match=ref.record.split(":")[1]):
        store.get(ref)
    with pytest.raises(IntegrityError):
        store.read_range(ref, 0, 10)


def test_damage_stays_detected_after_reput(store):
    """A put after damage never masks it: reads keep failing, unless the put wrote the object anew (small
    objects on remote stores go straight to a create-once write, which finds the wrong bytes and repairs)."""
    data = os.urandom(100_000)
    ref = store.put(data)
    chunk = store.record(ref).chunks[0]
    _flip(store, object_key(chunk.digest), 5)
    store.backend.delete(blob_ref_key(ref.digest))  # force a full put
    store.put(data)
    store.cache = None
    repaired = store.backend.capabilities.remote and chunk.size <= SMALL_OBJECT
    if repaired:
        assert store.get(ref) == data
    else:
        with pytest.raises(IntegrityError, match=chunk.digest):
            store.get(ref)


def test_cdc_dedups_shared_rows(store):
    row = 4096
    rows = os.urandom(row * 512)
    cuts = list(range(0, len(rows), row))
    store.put(rows, cuts=cuts)
    before = store.stats.bytes_written
    half = rows[100 * row : 356 * row]
    ref = store.put(half, cuts=list(range(0, len(half), row)))
    new = store.stats.bytes_written - before
    assert store.get(ref) == half
    assert new <= 0.35 * len(half), new  # small test chunks; the benchmark checks the 10% goal at scale


def test_cdc_boundaries_are_row_aligned_and_bounded():
    from trajectory_replay.store import chunk_ends

    data = os.urandom(1 << 20)
    cuts = list(range(0, len(data), 1000))
    ends = chunk_ends(data, cuts, SMALL)
    assert ends[-1] == len(data)
    sizes = [b - a for a, b in zip([0, *ends[:-1]], ends)]
    assert max(sizes) <= SMALL.chunk_size
    assert all(e % 1000 == 0 for e in ends[:-1])


def test_boundaries_are_kept_and_change_nothing_without_them():
    from trajectory_replay.store import chunk_ends

    data = os.urandom(300_000)
    cuts = list(range(0, len(data), 1000))
    assert chunk_ends(data, cuts, SMALL, boundaries=None) == chunk_ends(data, cuts, SMALL)
    assert chunk_ends(data, None, SMALL, boundaries=[]) == chunk_ends(data, None, SMALL)
    ends = chunk_ends(data, cuts, SMALL, boundaries=[0, 77, 120_000, len(data)])
    assert {77, 120_000} <= set(ends) and ends[-1] == len(data)
    # without cut points each segment is cut at fixed sizes from its own start
    assert chunk_ends(data, None, SMALL, boundaries=[100]) == [
        100,
        *range(100 + SMALL.chunk_size, len(data), SMALL.chunk_size),
        len(data),
    ]


def test_aligned_runs_are_shared_whatever_surrounds_them(store):
    """The same rows behind different headers and between different neighbours: chunked alike, stored once."""
    runs = [os.urandom(3000) for _ in range(4)]
    first = b"H" * 72 + runs[0] + runs[1]
    second = b"header!" * 9 + runs[0] + runs[1] + runs[2] + runs[3]

    def bounds(prefix: int, blob_runs) -> list[int]:
        out, at = [prefix], prefix
        for r in blob_runs:
            at += len(r)
            out.append(at)
        return out

    store.put(first, cuts=bounds(72, runs[:2])[:-1], boundaries=bounds(72, runs[:2]))
    before = store.stats.bytes_written
    ref = store.put(second, cuts=bounds(63, runs)[:-1], boundaries=bounds(63, runs))
    assert store.get(ref) == second
    assert store.stats.bytes_written - before == 63 + 2 * 3000  # the new header and the two new runs only


def test_parse_digest_messages():
    with pytest.raises(InvalidKeyError, match="64 hex characters"):
        parse_digest("blake3:abc")


def test_remote_reads_served_from_cache(s3_root, tmp_path):
    url, options = s3_root
    store = ObjectStore.open(url, cache_dir=str(tmp_path / "cache"), **options)
    data = os.urandom(300_000)
    ref = store.put(data)
    fresh = ObjectStore.open(url, cache_dir=str(tmp_path / "cache2"), **options)
    assert fresh.get(ref) == data
    fetched = fresh.backend.stats.bytes_read
    assert fetched >= len(data)
    assert fresh.get(ref) == data
    assert fresh.backend.stats.bytes_read == fetched  # second read: all from the cache
    other = ObjectStore.open(url, cache_dir=str(tmp_path / "cache2"), **options)  # another process's view
    assert other.read_range(ref, 1000, 2000) == data[1000:2000]
    assert other.backend.stats.bytes_read == 0


def test_local_store_has_no_cache(tmp_path):
    assert ObjectStore.open(str(tmp_path / "s")).cache is None


def test_put_many_lists_once_then_stores_everything(store):
    items = [(os.urandom(n), None) for n in (0, 10, 70_000, 300_000)]
    existing = store.put(items[1][0])
    calls = []

    def listed(plans):
        calls.append([p.ref.digest for p in plans])
        # nothing new is written before the caller has seen every plan
        assert not any(store.backend.exists(blob_ref_key(p.ref.digest)) for p in plans if not p.existing)

    refs = store.put_many(items, before_write=listed)
    assert len(calls) == 1 and calls[0] == [r.digest for r in refs]
    assert refs[1] == existing
    for (data, _), ref in zip(items, refs):
        assert ref.digest == hash_bytes(data) and store.get(ref) == data
    # a plan made ahead (to learn a digest first) is accepted as an item
    plan = store.plan(b"made ahead")
    assert store.put_many([plan])[0].digest == plan.ref.digest and store.get(plan.ref.digest) == b"made ahead"


def test_a_record_with_unclean_block_hashes_or_chunk_digests_is_refused_naming_it(tmp_path):
    import base64
    import json

    from trajectory_replay.store.records import BlobRecord, RecordError

    store = ObjectStore.open(tmp_path / "s")
    ref = store.put(bytes(range(256)) * 300)
    good = json.loads(store.get_object(ref.record))
    assert BlobRecord.from_bytes(json.dumps(good).encode(), ref.record).chunks[0].blocks == base64.b64decode(
        good["chunks"][0][2]
    )
    text = good["chunks"][0][2]
    for field, value in (
        (2, text[:-4] + "!" + text[-3:]),  # not in the alphabet
        (2, text.rstrip("=") + "A"),  # wrong length: padding left out
        (2, text + "===="),  # padding past the end
        (2, "=" + text[1:]),  # padding first
        (2, 7),  # not text
        (0, good["chunks"][0][0].upper()),  # a digest not in lowercase
        (0, "blake3:" + "0" * 63),
    ):  # a digest too short
        doc = json.loads(json.dumps(good))
        doc["chunks"][0][field] = value
        with pytest.raises(RecordError, match="malformed blob record"):
            BlobRecord.from_bytes(json.dumps(doc).encode(), ref.record)
