"""A store root seen whole: what it holds, what each blob reaches, whether it is sound, and removing it.

`ObjectStore` reads and writes one blob at a time and raises at the first bad byte. The operations
over a whole root (gc, fsck, cp, stats, inspect's damage report) need the opposite: every object
and ref listed, thousands of values read in a few round trips (concurrent batches of `read_many`),
and a bad value reported, not raised, so that one damaged key hides nothing else. This is that view.

A blob's closure is what reading it needs: its ref (blob digest -> record digest), the record the
caller holds and the one the ref names (usually the same), and every chunk those records list.
Records are verified against their digest and bounded before they are parsed; chunks are named,
not read (`verify` and `read_blobs` read them).

Keys appear in what this module returns only as names for reports and for sets of keys; they are
spelled in `digest` alone, and `key_kind` / `digest_from_key` tell them apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from trajectory_replay.backends import Backend
from trajectory_replay.backends.base import WorkerPool
from trajectory_replay.errors import IntegrityError, NotFoundError, TrajectoryReplayError, ValueTooLargeError
from trajectory_replay.store.digest import (
    OBJECT,
    REF,
    blob_ref_key,
    digest_from_key,
    hash_bytes,
    key_kind,
    object_key,
    parse_digest,
)
from trajectory_replay.store.layout import GC, OBJECTS_DIR, REFS_DIR, touched_by
from trajectory_replay.store.records import (
    MAX_RECORD_BYTES,
    MAX_REF_BYTES,
    RECORD_HEAD,
    BlobRecord,
    RecordError,
    looks_like_record,
    oversized_record,
    parse_record,
)

T = TypeVar("T")
R = TypeVar("R")

READ_BATCH = 256
"""Keys per `read_many` call: big enough to keep every connection busy, small enough to bound memory."""


# ---- concurrency ------------------------------------------------------------------------------------


def concurrently(fn: Callable[[T], R], items: Sequence[T], workers: int = 8) -> list[R]:
    """`[fn(x) for x in items]`, in order: on this thread while the items keep it busy, on a pool of `workers`
    threads from the first item that mostly waited.

    Over a store on local disk each item (a marker read and parsed, a file's status) is a fraction of a millisecond
    of work for the interpreter: on a pool the threads only take turns at its lock, and listing 200 bundles took
    three times as long as on one thread. An item that waits (on S3 or another remote store, a network file system,
    a cold disk) is what threads are for: once one has waited more than WAITED_FOR_A_POOL beyond the CPU time it
    took, the rest go to the pool."""
    items = list(items)
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
    out: list[R] = []
    for i, item in enumerate(items):
        wall, cpu = time.perf_counter(), time.thread_time()
        out.append(fn(item))
        waited = (time.perf_counter() - wall) - (time.thread_time() - cpu)
        if waited > WAITED_FOR_A_POOL and i + 1 < len(items):
            return out + _pool(workers).map(fn, items[i + 1 :])
    return out


WAITED_FOR_A_POOL = 0.001
"""Seconds an item of `concurrently` may wait (wall time beyond its CPU time) before the rest go to a thread pool:
less than any round trip to a remote store, far more than a read from the page cache."""


_POOLS: dict[int, WorkerPool] = {}


def _pool(workers: int) -> WorkerPool:
    """One long-lived pool per size: gc and fsck call this thousands of times."""
    if workers not in _POOLS:
        _POOLS[workers] = WorkerPool(workers)
    return _POOLS[workers]


def batched(items: Sequence[T], size: int = READ_BATCH) -> list[list[T]]:
    items = list(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


def fetch(backend: Backend, keys: Iterable[str], limit: int | None = None) -> dict[str, bytes | None]:
    """The values of `keys` (None for an absent key), read in concurrent batches. With `limit`, a value over it
    is read no further than that and comes back as its ValueTooLargeError."""
    keys = list(dict.fromkeys(keys))
    out: dict[str, bytes | None] = {}
    for batch in batched(keys):
        if limit is not None:
            out.update(zip(batch, concurrently(lambda k: _read_bounded(backend, k, limit), batch, backend.max_workers)))
            continue
        try:
            out.update(zip(batch, backend.read_many(batch)))
        except NotFoundError:  # find which ones are absent, still concurrently
            out.update(zip(batch, concurrently(lambda k: _read_or_none(backend, k), batch, backend.max_workers)))
    return out


def _read_bounded(backend: Backend, key: str, limit: int):
    try:
        return backend.read(key, limit)
    except NotFoundError:
        return None
    except ValueTooLargeError as exc:
        return exc


def _read_or_none(backend: Backend, key: str) -> bytes | None:
    try:
        return backend.read(key)
    except NotFoundError:
        return None


# ---- values -----------------------------------------------------------------------------------------


def parse_ref(value: bytes | None) -> str | None:
    """The record digest a blob ref holds, or None when absent or malformed."""
    got = _ref_value(value)
    return got if isinstance(got, str) else None


def _ref_value(value: bytes | None) -> str | IntegrityError | None:
    if value is None:
        return None
    if isinstance(value, ValueTooLargeError):  # read with MAX_REF_BYTES and refused unread
        return IntegrityError(f"does not hold a digest (over the {MAX_REF_BYTES}-byte bound)")
    text = value.decode("ascii", errors="replace").strip()
    try:
        parse_digest(text)
    except TrajectoryReplayError:
        return IntegrityError("does not hold a digest")
    return text


def value_problem(key: str, data: bytes) -> str | None:
    """Why `data` cannot be the value of object or ref `key` (None when it can): an object's content must
    hash to the digest its key names, a ref must hold a digest."""
    digest = digest_from_key(key)
    if digest is None:
        return "not a key the store names"
    if key_kind(key) == OBJECT:
        return None if hash_bytes(data) == digest else "content does not match its digest"
    return None if isinstance(_ref_value(data), str) else "blob ref does not hold a digest"


def digest_keys(digest: str) -> set[str]:
    """The keys a digest may name: the object, and the blob ref."""
    return {object_key(digest), blob_ref_key(digest)}


def record_keys(record_digest: str, record: BlobRecord) -> set[str]:
    """A record's own key and its chunks' keys."""
    return {object_key(record_digest), *(object_key(c.digest) for c in record.chunks)}


@dataclass
class BlobNode:
    """A blob's closure as found: its record's chunks (empty when the record could not be read)."""

    digest: str
    record: str
    size: int
    chunks: tuple[tuple[str, int], ...] = ()
    ref_record: str | None = None
    """What the blob's ref names (None when the ref is absent); may differ from `record`."""
    keys: set[str] = field(default_factory=set)
    """The ref, the record(s) and their chunks."""
    missing: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    """Why the record could not be used (then `chunks` is empty and the subtree unknown)."""


def write_layers(nodes: Iterable[BlobNode]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The keys of these blobs in the order the store writes them: (chunks, records, refs), each key -> its
    expected size (0 when unknown). Written in that order, a ref never names something absent."""
    chunks: dict[str, int] = {}
    records: dict[str, int] = {}
    refs: dict[str, int] = {}
    for node in nodes:
        refs[blob_ref_key(node.digest)] = 0
        for r in (node.record, node.ref_record):
            if r:
                records[object_key(r)] = 0
        chunks.update({object_key(c): s for c, s in node.chunks})
        for key in node.keys:
            if key not in refs and key not in records:
                chunks.setdefault(key, 0)
    return chunks, records, refs


@dataclass
class BlobContent:
    """A blob read whole from its record's chunks: `data` when every chunk and the whole are sound."""

    data: bytes | None = None
    missing: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    """Chunk keys absent, and chunk keys whose bytes are not their digest's content."""


@dataclass(frozen=True)
class Checked:
    """One object or ref read back and checked (`verify`)."""

    key: str
    kind: str
    """OBJECT or REF."""
    size: int
    sound: bool


# ---- the inventory ----------------------------------------------------------------------------------


class Inventory:
    """One store root in bulk. Verified records are remembered for the inventory's life (it lives as long
    as one operation: a record found absent is not looked for again by it)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.record_cache: dict[str, BlobRecord | RecordError | None] = {}
        self._probed: dict[str, BlobRecord | None] = {}

    # ---- listing ------------------------------------------------------------------------------
    def object_keys(self) -> list[str]:
        """Every key in the object directory, as listed (one the store does not name so included)."""
        return self.backend.list(f"{OBJECTS_DIR}/")

    def ref_keys(self) -> list[str]:
        """Every key in the ref directory, as listed (one the store does not name so included)."""
        return self.backend.list(f"{REFS_DIR}/")

    def object_digests(self) -> list[str]:
        """The digest of every stored object (keys the store does not name so left out)."""
        return [d for d in map(digest_from_key, self.object_keys()) if d is not None]

    def ref_digests(self) -> list[str]:
        """The digest of every blob with a ref (keys the store does not name so left out)."""
        return [d for d in map(digest_from_key, self.ref_keys()) if d is not None]

    def links_out(self) -> list[str]:
        """The directories gc deletes under (`layout.touched_by(GC)`) that are symbolic links out of the root
        (local disk only): deleting through one would delete foreign files."""
        return [name for name in touched_by(GC) if self.backend.escapes_root(name)]

    # ---- reading ------------------------------------------------------------------------------
    def read(self, keys: Iterable[str], limit: int | None = None) -> dict[str, bytes | None]:
        """The raw values of `keys` (None for an absent one), unverified: `verify` or `value_problem` judge them.
        With `limit` (a marker's bound, say), a value over it is its ValueTooLargeError, read no further."""
        return fetch(self.backend, keys, limit)

    def read_objects(self, digests: Iterable[str], limit: int | None = None) -> dict[str, bytes | None]:
        """The raw, unverified bytes of objects by digest (None for an absent one; with `limit`, the
        ValueTooLargeError of one larger than that, unread)."""
        keys = {object_key(d): d for d in digests}
        return {keys[key]: value for key, value in fetch(self.backend, keys, limit).items()}

    def read_refs(self, digests: Iterable[str]) -> dict[str, str | IntegrityError | None]:
        """What each blob's ref holds: the record digest, None when absent, the error when not a digest."""
        keys = {blob_ref_key(d): d for d in digests}
        return {keys[key]: _ref_value(value) for key, value in fetch(self.backend, keys, MAX_REF_BYTES).items()}

    def refs(self, digests: Iterable[str]) -> dict[str, str | None]:
        """The record digest each blob's ref names (None when the ref is absent or does not hold a digest)."""
        return {d: got if isinstance(got, str) else None for d, got in self.read_refs(digests).items()}

    def read_ref(self, digest: str) -> str | None:
        return self.refs([digest])[digest]

    def records(self, digests: Iterable[str]) -> dict[str, BlobRecord | RecordError | None]:
        """Verified, parsed records (None when absent, the RecordError when the object is not a record)."""
        digests = list(dict.fromkeys(digests))
        todo = [d for d in digests if d not in self.record_cache]
        values = self.read_objects(todo, limit=MAX_RECORD_BYTES)
        for d in todo:
            data = values[d]
            self.record_cache[d] = (
                None
                if data is None
                else parse_record(d, data)
                if not isinstance(data, ValueTooLargeError)
                else oversized_record(d, data)
            )
        return {d: self.record_cache[d] for d in digests}

    def probe_record(self, digest: str) -> BlobRecord | None:
        """The record object `digest` holds, or None when it holds none; an object whose first bytes are not
        a record's is not read further (a chunk costs one short ranged read)."""
        if digest not in self._probed:
            try:
                head = self.backend.read_range(object_key(digest), 0, len(RECORD_HEAD))
            except NotFoundError:
                head = b""
            record = self.records([digest])[digest] if looks_like_record(head) else None
            self._probed[digest] = record if isinstance(record, BlobRecord) else None
        return self._probed[digest]

    def closure(self, blobs: dict[str, tuple[str, int]]) -> dict[str, BlobNode]:
        """blob digest -> its closure, for blobs given as digest -> (record digest, size): refs in one batch,
        then every record named in another."""
        refs = self.refs(blobs)
        self.records([r for r, _ in blobs.values()] + [r for r in refs.values() if r])
        out = {}
        for digest, (record_digest, size) in blobs.items():
            node = BlobNode(digest, record_digest, size, ref_record=refs[digest])
            node.keys.add(blob_ref_key(digest))
            if node.ref_record is None:
                node.missing.add(blob_ref_key(digest))
            for which in dict.fromkeys([record_digest, node.ref_record]):
                if which is None:
                    continue
                key, record = object_key(which), self.record_cache[which]
                if record is None and which != record_digest:
                    # the ref names a record that is not there, while the caller names another: writes go record
                    # before ref, so the ref is what is wrong (and what a sound copy repairs), not some object
                    # nothing else names
                    node.corrupt.add(blob_ref_key(digest))
                    continue
                node.keys.add(key)
                if isinstance(record, BlobRecord) and record.digest == digest:
                    node.keys.update(object_key(c.digest) for c in record.chunks)
                    if which == record_digest:
                        node.chunks = tuple((c.digest, c.size) for c in record.chunks)
                    continue
                if record is None:
                    node.missing.add(key)
                    why = f"missing record {which}"
                elif not isinstance(record, BlobRecord):
                    node.corrupt.add(key)
                    why = str(record)
                else:
                    # a verified record of another blob is healthy: what is wrong is whatever names it here,
                    # the ref (repairable) or the caller's own document (a problem of the bundle)
                    if which == node.ref_record:
                        node.corrupt.add(blob_ref_key(digest))
                    why = f"record {which} describes {record.digest}, not this blob"
                if which == record_digest:
                    node.problems.append(why)
            out[digest] = node
        return out

    def read_blobs(self, blobs: dict[str, Sequence[str]]) -> dict[str, BlobContent]:
        """Small blobs read whole, given as digest -> chunk digests: every chunk in one batch, each and the
        whole checked against their digests."""
        values = self.read_objects(c for chunks in blobs.values() for c in chunks)
        out = {}
        for digest, chunks in blobs.items():
            got, parts = BlobContent(), []
            for c in chunks:
                data = values[c]
                if data is None:
                    got.missing.add(object_key(c))
                elif hash_bytes(data) != c:
                    got.corrupt.add(object_key(c))
                else:
                    parts.append(data)
            if not (got.missing or got.corrupt):
                whole = b"".join(parts)
                got.data = whole if hash_bytes(whole) == digest else None
            out[digest] = got
        return out

    # ---- checking -----------------------------------------------------------------------------
    def verify(self, keys: Sequence[str]) -> list[Checked]:
        """Read and check object and ref keys (`value_problem`); a key absent by now is left out."""
        out = []
        for key, data in self.read(keys).items():
            if data is not None:
                out.append(
                    Checked(key, REF if key_kind(key) == REF else OBJECT, len(data), value_problem(key, data) is None)
                )
        return out

    def verify_object(self, digest: str) -> str | None:
        """Why object `digest` is not sound ('missing', or what is wrong with its bytes); None when it is."""
        data = self.read_objects([digest])[digest]
        return "missing" if data is None else value_problem(object_key(digest), data)

    # ---- writing ------------------------------------------------------------------------------
    def link(self, digest: str, record_digest: str) -> bool:
        """Create blob `digest`'s ref naming `record_digest` unless a ref exists; False when one naming another
        record is there."""
        parse_digest(record_digest)
        return self.backend.create_if_absent(blob_ref_key(digest), record_digest.encode())

    def install(self, key: str, data: bytes) -> bool:
        """Store a value already checked (`value_problem`) under its object or ref key, create-once. A stored
        object's bytes that differ cannot be its content: they are replaced. False only when a different ref
        is there (it stays)."""
        if self.backend.create_if_absent(key, data):
            return True
        if key_kind(key) == OBJECT:
            self.backend.write(key, data)
            return True
        return False

    def replace(self, key: str, data: bytes) -> None:
        """Write a value already checked (`value_problem`) over whatever is stored under its key, atomically."""
        self.backend.write(key, data)

    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys of this root, concurrently (an absent one is no error)."""
        concurrently(self.backend.delete, list(keys), self.backend.max_workers)

    def delete_objects(self, digests: Iterable[str]) -> None:
        self.delete([object_key(d) for d in digests])

    def delete_refs(self, digests: Iterable[str]) -> None:
        self.delete([blob_ref_key(d) for d in digests])


__all__ = [
    "BlobContent",
    "BlobNode",
    "Checked",
    "Inventory",
    "READ_BATCH",
    "batched",
    "concurrently",
    "digest_keys",
    "fetch",
    "parse_ref",
    "record_keys",
    "value_problem",
    "write_layers",
]
