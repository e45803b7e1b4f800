"""The content-addressed object store.

A blob (any byte string) is named by the BLAKE3 of its whole content. It is stored as
chunks, each an immutable object named by its own digest, and described by a blob record
(size, chunk digests and sizes, block size, the hash of every block: `store.records`) which is itself an
object; the create-once ref `blobs/<digest>` maps the blob to its record. Writes go
chunks -> record -> ref, so a ref never points at something missing. Reads verify every
byte before returning it: `get` checks each chunk and the whole blob, `read_range` fetches
only the blocks it covers and checks each against the record, whose own digest the caller
holds (BlobRef.record) or reads from the ref.

Remote stores read through a local cache of verified objects and blocks. A cached copy is
exactly the bytes its digest names, so a read served from it is correct even when the server's
copy was damaged since: replay keeps working where the cache is warm, and fails naming the
object only where it must fetch it. Checking what is stored is another matter: a store opened
with `trust_cache=False` (validate) sends every read to the backend and only fills the cache.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

from trajectory_replay._allocator import buffer_for_read
from trajectory_replay.backends import Backend, ByteRange, open_backend
from trajectory_replay.backends.base import DIFFERENT, SAME, WorkerPool
from trajectory_replay.backends.local import LocalBackend
from trajectory_replay.errors import IntegrityError, NotFoundError, TrajectoryReplayError, ValueTooLargeError
from trajectory_replay.store.cache import ReadCache
from trajectory_replay.store.chunking import ChunkingParams, chunk_ends
from trajectory_replay.store.digest import blob_ref_key, hash_bytes, object_key, parse_digest, raw_hash
from trajectory_replay.store.inventory import Inventory
from trajectory_replay.store.reading_process import (
    ArenaPart,
    ChunkBlocks,
    ReadFailure,
    ReadingProcess,
    ReadRequest,
    WholeChunk,
    active,
    reading_process,
)
from trajectory_replay.store.records import (
    MAX_RECORD_BYTES,
    MAX_REF_BYTES,
    BlobRecord,
    ChunkInfo,
    decode_record,
    oversized_record,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    PutItem = tuple[Buffer, Sequence[int] | None] | tuple[Buffer, Sequence[int] | None, Sequence[int] | None]
    """What `plan_many` and `put_many` take for one blob: (data, cuts[, boundaries])."""

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

DEFAULT_BLOCK_SIZE = 16 << 10
SMALL_OBJECT = 64 << 10
"""Objects up to this size are written to remote stores without looking for them first."""


@dataclass(frozen=True)
class BlobRef:
    """A stored blob: its digest, size in bytes, and the digest of its record."""

    digest: str
    size: int
    record: str


@dataclass
class PutPlan:
    """Everything `put` will write, computed before any byte is written (so a caller can list it first)."""

    ref: BlobRef
    record_bytes: bytes
    chunks: list[tuple[ChunkInfo, memoryview]]
    existing: bool
    """The blob's ref already exists: nothing needs writing (once its chunks are found present)."""
    source: tuple[Any, ...] = field(default=(), repr=False)
    """(data, cuts, boundaries) the plan was made from, to plan again."""
    reused_chunks: tuple[str, ...] = ()
    """The chunk digests of an existing blob's record (empty for a new blob, whose `chunks` say it)."""

    def object_digests(self) -> list[str]:
        """Every object digest this blob needs: its chunks and its record."""
        return [c.digest for c, _ in self.chunks] + list(self.reused_chunks) + [self.ref.record]

    def keys(self) -> list[str]:
        """Every key this blob needs to be readable: its ref, its record and its chunks."""
        return [blob_ref_key(self.ref.digest), *(object_key(d) for d in self.object_digests())]


@dataclass
class PutStats:
    """Counters of what puts wrote and what they found already stored."""

    blobs: int = 0
    blobs_existing: int = 0
    chunks_written: int = 0
    chunks_deduplicated: int = 0
    bytes_written: int = 0
    bytes_deduplicated: int = 0


@dataclass
class ObjectStore:
    """Content-addressed blobs on one backend. Thread-safe."""

    backend: Backend
    cache: ReadCache | None = None
    chunking: ChunkingParams = field(default_factory=ChunkingParams)
    block_size: int = DEFAULT_BLOCK_SIZE
    stats: PutStats = field(default_factory=PutStats)
    trust_cache: bool = True
    """False: every read goes to the backend, so it verifies the stored bytes; the cache is only filled."""

    def __post_init__(self) -> None:
        # chunk transfers call the backend, whose own pool does the ranged and batched reads
        self._io = WorkerPool(self.backend.max_workers, cpu_work=self.backend.reads_are_cpu_work)
        self._hashing = WorkerPool(min(4, os.cpu_count() or 1), cpu_work=True)

    @classmethod
    def open(
        cls,
        path_or_url: str | os.PathLike[str],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache: bool | None = None,
        trust_cache: bool = True,
        **storage_options: Any,
    ) -> ObjectStore:
        """Open the store at a path or URL; remote stores read through the local cache (`cache=False` disables it,
        `trust_cache=False` reads every byte from the store and only fills the cache)."""
        backend = open_backend(path_or_url, **storage_options)
        use_cache = backend.capabilities.remote if cache is None else cache
        return cls(backend, ReadCache(cache_dir) if use_cache else None, trust_cache=trust_cache)

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def inventory(self) -> Inventory:
        """A new view of the whole root in bulk: listing, verifying and deleting objects and refs, blobs'
        closures. It reads the backend itself, never the cache, so what it reports is what is stored."""
        return Inventory(self.backend)

    # ---- writing -------------------------------------------------------------------------------
    def plan(self, data: Buffer, cuts: Sequence[int] | None = None, boundaries: Sequence[int] | None = None) -> PutPlan:
        """Hash `data` (whole, chunks, blocks) and build its record without writing anything."""
        return self.plan_many([(data, cuts, boundaries)])[0]

    def plan_many(self, items: Sequence[PutItem], *, fresh: bool = False) -> list[PutPlan]:
        """`plan` of several (data, cuts[, boundaries]): every blob hashed, then all looked up at once
        (one round trip on a remote store, not one per blob), then the new ones described.

        A stored blob is planned as existing with its record's chunks, so that a writer can list and
        check them; one whose ref or record cannot be read, and every blob when `fresh`, is planned new."""
        sources = [(item[0], item[1] if len(item) > 1 else None, item[2] if len(item) > 2 else None) for item in items]
        views = [memoryview(data).cast("B") for data, _, _ in sources]
        digests = [hash_bytes(view) for view in views]
        # one read answers both "is it stored?" and "under which record?" (once per distinct blob)
        unique = list(dict.fromkeys(digests))
        found = dict.fromkeys(unique) if fresh else dict(zip(unique, self._map(self._find_existing, unique)))
        plans = []
        for source, view, digest in zip(sources, views, digests):
            existing = found[digest]
            if existing is not None:
                record_digest, chunks = existing
                plans.append(
                    PutPlan(
                        BlobRef(digest, len(view), record_digest),
                        b"",
                        [],
                        existing=True,
                        source=source,
                        reused_chunks=chunks,
                    )
                )
            else:
                plans.append(self._describe(view, digest, source))
        return plans

    def _describe(self, view: memoryview, digest: str, source: tuple[Any, ...]) -> PutPlan:
        """The chunks, block hashes and record of a blob that is not stored yet."""
        _, cuts, boundaries = source
        ends = chunk_ends(view, cuts, self.chunking, boundaries)
        starts = [0, *ends[:-1]]

        def describe(span: tuple[int, int]) -> tuple[ChunkInfo, memoryview]:
            start, end = span
            piece = view[start:end]
            blocks = b"".join(raw_hash(piece[i : i + self.block_size]) for i in range(0, len(piece), self.block_size))
            return ChunkInfo(hash_bytes(piece), end - start, start, blocks), piece

        chunks = self._hashing.map(describe, list(zip(starts, ends)))
        record = BlobRecord(digest, len(view), self.block_size, tuple(c for c, _ in chunks))
        record_bytes = record.to_bytes()
        return PutPlan(
            BlobRef(digest, len(view), hash_bytes(record_bytes)), record_bytes, chunks, existing=False, source=source
        )

    def _find_existing(self, digest: str) -> tuple[str, tuple[str, ...]] | None:
        """(record digest, chunk digests) of a stored blob; None when its ref or record is absent or unusable
        (then the blob is stored anew, which repairs what it can)."""
        try:
            record_digest = self._read_ref(digest)
            record = self.record(BlobRef(digest, -1, record_digest))
        except NotFoundError:
            return None
        except IntegrityError as exc:
            log.warning("%s: blob %s is stored but unreadable (%s); storing it again", self.url, digest, exc)
            return None
        return record_digest, tuple(c.digest for c in record.chunks)

    def missing_keys(self, keys: Sequence[str]) -> list[str]:
        """Those of `keys` the backend does not hold now (asked of the backend itself, never of the cache)."""
        keys = list(dict.fromkeys(keys))
        return [k for k, there in zip(keys, self._map(self.backend.exists, keys)) if not there]

    def commit(self, plan: PutPlan) -> BlobRef:
        """Write a plan's chunks (skipping those stored), then its record, then the create-once ref."""
        return self.commit_many([plan])[0]

    def commit_many(self, plans: Sequence[PutPlan]) -> list[BlobRef]:
        """Commit several plans together: all their chunks concurrently, then all records, then all refs
        (each blob's ref is created only after its chunks and record are stored)."""
        for plan in plans:
            self.stats.blobs += 1
            if plan.existing:
                self.stats.blobs_existing += 1
                self.stats.bytes_deduplicated += plan.ref.size
        new = [p for p in plans if not p.existing]
        # an object two blobs of this batch share (a chunk, or the record of a blob given twice) is sent once
        chunks = list({c.digest: (c, piece) for p in new for c, piece in p.chunks}.values())
        records = list({p.ref.record: p for p in new}.values())
        self._map(lambda item: self._put_object(item[0].digest, item[1]), chunks)
        self._map(lambda p: self._put_object(p.ref.record, memoryview(p.record_bytes), count=False), records)
        refs = list({(p.ref.digest, p.ref.record): p for p in new}.values())
        linked = dict(zip(((p.ref.digest, p.ref.record) for p in refs), self._map(self._link_ref, refs)))
        return [linked.get((p.ref.digest, p.ref.record), p.ref) for p in plans]

    def _link_ref(self, plan: PutPlan) -> BlobRef:
        if self.backend.create_if_absent(blob_ref_key(plan.ref.digest), plan.ref.record.encode()):
            return plan.ref
        # another writer stored the same blob with a different chunking: both records are valid
        return BlobRef(plan.ref.digest, plan.ref.size, self._read_ref(plan.ref.digest))

    def put(
        self,
        data: Buffer,
        cuts: Sequence[int] | None = None,
        before_write: Callable[[PutPlan], None] | None = None,
        *,
        boundaries: Sequence[int] | None = None,
    ) -> BlobRef:
        """Store `data` once; `cuts` are allowed chunk boundaries (e.g. row starts), `boundaries` required
        ones (see `chunk_ends`). Returns its BlobRef.

        `before_write(plan)` runs after hashing and before any write, so a caller can record
        every object it is about to write or reuse (the in-flight records gc respects)."""
        listed = None if before_write is None else (lambda plans: before_write(plans[0]))
        return self.put_many([(data, cuts, boundaries)], before_write=listed)[0]

    def put_many(
        self, items: Sequence[PutItem | PutPlan], before_write: Callable[[list[PutPlan]], None] | None = None
    ) -> list[BlobRef]:
        """`put` of several (data, cuts[, boundaries]) at once (or of plans already made): all hashed first,
        `before_write(plans)` called once, then everything uploaded together. Fewer round trips than
        one `put` after another."""
        todo = [(i, item) for i, item in enumerate(items) if not isinstance(item, PutPlan)]
        planned = dict(zip((i for i, _ in todo), self.plan_many([item for _, item in todo])))
        plans = [item if isinstance(item, PutPlan) else planned[i] for i, item in enumerate(items)]
        if before_write is not None:
            before_write(plans)
            # A reused blob is trusted only once its ref, record and every chunk are seen AFTER the listing:
            # from then on gc spares them. A ref alone proves nothing (a sweep may have removed the chunks
            # under it). Whatever is not there is stored anew, listed first again.
            existing = [i for i, p in enumerate(plans) if p.existing]
            absent = set(self.missing_keys([k for i in existing for k in plans[i].keys()]))
            gone = [i for i in existing if absent.intersection(plans[i].keys())]
            if gone:
                log.info(
                    "%s: %d stored blob(s) found incomplete (first %s); storing them again",
                    self.url,
                    len(gone),
                    plans[gone[0]].ref.digest,
                )
                for i, plan in zip(gone, self.plan_many([plans[i].source for i in gone], fresh=True)):
                    plans[i] = plan
                before_write([plans[i] for i in gone])
        return self.commit_many(plans)

    def put_object(self, data: bytes) -> str:
        """Store `data` as one immutable object (no record, no ref); returns its digest."""
        digest = hash_bytes(data)
        self._put_object(digest, memoryview(data), count=False)
        return digest

    def _put_object(self, digest: str, data: memoryview, count: bool = True) -> None:
        key = object_key(digest)
        # A large object is looked for first, so that a stored one is not sent again. A small one on a remote
        # store goes straight to the create-once write: one request instead of two when it is new, and a
        # stored one costs a refused write plus a read back. A local write of a stored object would be a
        # wasted fsync, so local disks always look first.
        if (len(data) > SMALL_OBJECT or not self.backend.capabilities.remote) and self.backend.exists(key):
            status = SAME
        else:
            status = self.backend.create_status(key, data)
        if status == DIFFERENT:
            # bytes under a digest that are not that digest's content: repair with the right ones
            log.warning("%s: stored object %s was damaged; rewriting it", self.url, digest)
            self.backend.write(key, data)
        if not count:
            return
        if status == SAME:
            self.stats.chunks_deduplicated += 1
            self.stats.bytes_deduplicated += len(data)
        else:
            self.stats.chunks_written += 1
            self.stats.bytes_written += len(data)

    # ---- reading -------------------------------------------------------------------------------
    def has(self, digest: str) -> bool:
        """True when `digest` names a stored blob (its ref exists) or a stored object."""
        return self.backend.exists(blob_ref_key(digest)) or self.backend.exists(object_key(digest))

    def ref(self, digest: str) -> BlobRef:
        """The BlobRef of a stored blob, from its ref and record."""
        record_digest = self._read_ref(digest)
        record = self.record(BlobRef(digest, -1, record_digest))
        return BlobRef(digest, record.size, record_digest)

    @overload
    def get(self, ref_or_digest: BlobRef) -> bytearray: ...

    @overload
    def get(self, ref_or_digest: str) -> bytes | bytearray: ...

    def get(self, ref_or_digest: BlobRef | str) -> bytes | bytearray:
        """The whole blob (or plain object), with every chunk and the whole content verified.

        A blob comes back in a new bytearray the caller owns (filled in place, one copy of the data)."""
        if isinstance(ref_or_digest, str):
            parse_digest(ref_or_digest)
            if not self.backend.exists(blob_ref_key(ref_or_digest)):
                try:
                    return self.get_object(ref_or_digest)
                except NotFoundError:
                    raise NotFoundError(f"{self.url}: no blob or object {ref_or_digest}") from None
        record = self.record(ref_or_digest)
        buffer = buffer_for_read(record.size)  # every byte is overwritten by a chunk below, or dropped
        view = memoryview(buffer)
        fetched: list[ChunkInfo] = []

        def fill(chunk: ChunkInfo) -> None:
            # each worker places its own chunk straight into the buffer: no join, no extra copy
            if self._read_chunk_into(record, chunk, view[chunk.offset : chunk.offset + chunk.size]):
                fetched.append(chunk)

        self._map(fill, record.chunks)
        # one hash of the whole content verifies every chunk at once; only a mismatch hashes chunk by chunk,
        # to name the damaged one
        actual = hash_bytes(buffer)
        if actual != record.digest:
            for chunk in record.chunks:
                if hash_bytes(view[chunk.offset : chunk.offset + chunk.size]) != chunk.digest:
                    raise _digest_mismatch(self.url, chunk, record)
            raise IntegrityError(f"blob {record.digest}: content hashes to {actual}")
        cache = self.cache
        if cache is not None and fetched:  # verified above, as part of the whole
            self._map(lambda c: cache.put(parse_digest(c.digest), view[c.offset : c.offset + c.size]), fetched)
        return buffer

    def get_object(self, digest: str) -> bytes:
        """One immutable object, verified against its digest."""
        return self.get_objects([digest])[0]

    def get_objects(self, digests: Sequence[str], limit: int | None = None) -> list[bytes]:
        """Several objects, fetched concurrently (cache first), each verified; with `limit`, an object larger than
        that is refused (ValueTooLargeError) before more than `limit` + 1 bytes of it are read."""
        hexes = [parse_digest(d) for d in digests]
        found: dict[int, bytes] = {}
        cache = self._serving_cache
        if cache is not None:
            for i, h in enumerate(hexes):
                hit = cache.get(h)
                if hit is not None:
                    found[i] = hit
        missing = [i for i in range(len(digests)) if i not in found]
        if missing:
            keys = [object_key(digests[i]) for i in missing]
            try:
                values = (
                    self.backend.read_many(keys)
                    if limit is None
                    else self._map(lambda key: self.backend.read(key, limit), keys)
                )
            except NotFoundError as exc:
                raise NotFoundError(f"{self.url}: missing object ({exc})") from None
            for i, key, value in zip(missing, keys, values):
                actual = hash_bytes(value)
                if actual != digests[i]:
                    raise IntegrityError(f"object {digests[i]} at {self.url}/{key}: content hashes to {actual}")
                if self.cache is not None:
                    self.cache.put(hexes[i], value)
                found[i] = value
        return [found[i] for i in range(len(digests))]

    def record(self, ref_or_digest: BlobRef | str) -> BlobRecord:
        """The verified, parsed record of a blob."""
        if isinstance(ref_or_digest, BlobRef):
            digest, record_digest = ref_or_digest.digest, ref_or_digest.record
        else:
            digest, record_digest = ref_or_digest, self._read_ref(ref_or_digest)
        where = f"{record_digest} (blob {digest})"
        try:
            data = self.get_objects([record_digest], limit=MAX_RECORD_BYTES)[0]
        except ValueTooLargeError as exc:
            raise oversized_record(where, exc) from None
        record = decode_record(data, where)
        if record.digest != digest:
            raise IntegrityError(f"blob record {record_digest} describes {record.digest}, not {digest}")
        if isinstance(ref_or_digest, BlobRef) and ref_or_digest.size >= 0 and record.size != ref_or_digest.size:
            raise IntegrityError(f"blob {digest}: record says {record.size} bytes, reference says {ref_or_digest.size}")
        return record

    def read_range(
        self, ref_or_digest: BlobRef | str, start: int, end: int, record: BlobRecord | None = None
    ) -> bytes | bytearray:
        """Bytes [start, end) of a blob; only the blocks covering them are fetched, each verified."""
        return self.read_ranges(ref_or_digest, [(start, end)], record=record)[0]

    def read_ranges(
        self, ref_or_digest: BlobRef | str, spans: Sequence[tuple[int, int]], record: BlobRecord | None = None
    ) -> list[bytes | bytearray]:
        """Several byte ranges of one blob in one concurrent fetch of the blocks they cover."""
        record = record or self.record(ref_or_digest)
        self._check_spans(record, spans)
        if len(spans) == 1 and self._whole_chunks_within(record, *spans[0]):
            joined = self._read_joined(record, spans)
            assert isinstance(joined, bytearray)  # a buffer of its own, not a part of the reading process's arena
            return [joined]
        needed: dict[tuple[int, int], None] = {}
        for start, end in spans:
            for key in self._blocks_of(record, start, end):
                needed[key] = None
        blocks = self._fetch_blocks(record, list(needed))
        out: list[bytes | bytearray] = []
        for start, end in spans:
            pieces = []
            for ci, bi in self._blocks_of(record, start, end):
                chunk = record.chunks[ci]
                block_start = chunk.offset + bi * record.block_size
                data = blocks[(ci, bi)]
                lo = max(start - block_start, 0)
                hi = min(end - block_start, len(data))
                pieces.append(data[lo:hi])
            out.append(b"".join(pieces))
        return out

    def _read_chunk_into(self, record: BlobRecord, chunk: ChunkInfo, target: memoryview) -> bool:
        """Fill `target` with one chunk of `record`'s blob: from the cache when it serves the chunk (False), else
        from the backend (True: the caller verifies it). A missing or short chunk raises, naming the blob."""
        cache = self._serving_cache
        hit = cache.get(parse_digest(chunk.digest)) if cache is not None else None
        if hit is not None and len(hit) == chunk.size:
            target[:] = hit
            return False
        try:
            got = self.backend.read_into(object_key(chunk.digest), target)
        except NotFoundError:
            raise _missing_chunk(self.url, chunk, record) from None
        if got != chunk.size:
            raise _wrong_size(self.url, chunk, got)
        return True

    @staticmethod
    def _whole_chunks_within(record: BlobRecord, start: int, end: int) -> bool:
        """True when [start, end) spans at least one whole chunk (a long run of rows: read chunk by chunk)."""
        first = bisect.bisect_left(record.chunk_offsets, start)
        return first < len(record.chunks) and record.chunks[first].offset + record.chunks[first].size <= end

    def read_joined(
        self,
        ref_or_digest: BlobRef | str,
        spans: Sequence[tuple[int, int]],
        record: BlobRecord | None = None,
        *,
        for_tensor: bool = False,
    ) -> bytearray | memoryview:
        """The byte ranges `spans` of one blob, one after another in one new buffer (the rows of a block of samples,
        however many runs of the payload they lie in). The chunks wholly inside a range are read whole, straight
        into the buffer, and verified by their digests (one hash each, as `get` does); the rest of each range, at
        its edges, by verified blocks.

        `for_tensor`: the caller makes a tensor straight on the buffer and keeps no other view of it. Within
        `reading_ahead` of a store on local disk without a read cache, the buffer is then a part of the reading
        process's shared arena, reused once nothing refers to it, and that process reads and verifies all of it."""
        record = record or self.record(ref_or_digest)
        self._check_spans(record, spans)
        return self._read_joined(record, spans, shared=for_tensor)

    def _check_spans(self, record: BlobRecord, spans: Sequence[tuple[int, int]]) -> None:
        for start, end in spans:
            if not (0 <= start <= end <= record.size):
                raise TrajectoryReplayError(
                    f"byte range [{start}, {end}) outside blob {record.digest} of {record.size} bytes"
                )

    def _read_joined(
        self, record: BlobRecord, spans: Sequence[tuple[int, int]], shared: bool = False
    ) -> bytearray | memoryview:
        total = sum(end - start for start, end in spans)
        helper = active() if shared and self.reads_local_files else None
        part = helper.allocate(total) if helper is not None else None
        buffer = part.view if part is not None else buffer_for_read(total)
        view = memoryview(buffer)
        whole, edges = _split_spans(record, spans)
        if helper is not None and part is not None and self._read_in_helper(helper, part, record, whole, edges):
            return buffer

        def fill(item: tuple[ChunkInfo, int]) -> None:
            chunk, where = item
            target = view[where : where + chunk.size]
            if not self._read_chunk_into(record, chunk, target):
                return
            if hash_bytes(target) != chunk.digest:
                raise _digest_mismatch(self.url, chunk, record)
            if self.cache is not None:
                self.cache.put(parse_digest(chunk.digest), target)

        if whole:
            self._map(fill, whole)
        if edges:
            parts = self.read_ranges(record.digest, [(a, b) for a, b, _ in edges], record=record)
            for (a, b, where), data in zip(edges, parts):
                view[where : where + b - a] = data
        return buffer

    @property
    def reads_local_files(self) -> bool:
        """True when this store's chunks are files on local disk read without a read cache: what a reading process
        can read for it."""
        return isinstance(self.backend, LocalBackend) and self.cache is None

    @contextmanager
    def reading_ahead(self, capacity: int) -> Iterator[None]:
        """Within it, this store's reads for tensors (`read_joined(for_tensor=True)`) are done as suits a thread that
        reads ahead of others computing: a store on local disk without a read cache has a reading process (see
        `store.reading_process`) read and verify them into an arena of `capacity` bytes the processes share, so
        that the reading thread does not contend with the computing ones for the interpreter lock. Any other store
        reads as it always does."""
        if not self.reads_local_files:
            yield
            return
        with reading_process(capacity):
            yield

    def _read_in_helper(
        self,
        helper: ReadingProcess,
        part: ArenaPart,
        record: BlobRecord,
        whole: Sequence[tuple[ChunkInfo, int]],
        edges: Sequence[tuple[int, int, int]],
    ) -> bool:
        """Have the reading process read and verify, into its arena part: each (chunk, where) whole, and each edge
        (start, end, where) by the blocks that cover it. False when it cannot (the caller reads them itself). A
        chunk or block that is missing, short or of the wrong content raises as a read in this process would."""
        backend = self.backend
        assert isinstance(backend, LocalBackend)
        requests: list[ReadRequest] = []
        chunks: list[ChunkInfo] = []  # each request's chunk
        for chunk, where in whole:
            requests.append(
                WholeChunk(
                    backend.local_file(object_key(chunk.digest)),
                    part.offset + where,
                    chunk.size,
                    parse_digest(chunk.digest),
                )
            )
            chunks.append(chunk)
        size = record.block_size
        for start, end, where in edges:
            ci = max(bisect.bisect_right(record.chunk_offsets, start) - 1, 0)
            while ci < len(record.chunks) and record.chunks[ci].offset < end:
                chunk = record.chunks[ci]
                a = max(start, chunk.offset) - chunk.offset
                b = min(end, chunk.offset + chunk.size) - chunk.offset
                if a < b:
                    first, last = a // size, (b - 1) // size
                    requests.append(
                        ChunkBlocks(
                            backend.local_file(object_key(chunk.digest)),
                            part.offset + where + chunk.offset + a - start,
                            lo=first * size,
                            hi=min(chunk.size, (last + 1) * size),
                            block_size=size,
                            first=first,
                            hashes=chunk.blocks[32 * first : 32 * (last + 1)],
                            a=a,
                            b=b,
                        )
                    )
                    chunks.append(chunk)
                ci += 1
        failures = helper.read(requests)
        if failures is None:
            return False
        if failures:
            failure = failures[0]
            self._raise_read_failure(record, chunks[failure.item], requests[failure.item], failure)
            return False  # the helper could not read a file this process may: read them all here
        for request in requests:
            backend.stats.count_read(request.size if isinstance(request, WholeChunk) else request.hi - request.lo)
        return True

    def _raise_read_failure(
        self, record: BlobRecord, chunk: ChunkInfo, request: ReadRequest, failure: ReadFailure
    ) -> None:
        """Raise the error a read of `request` in this process would have raised for `failure`; return for a failure
        of the reading process itself (a file it could not read)."""
        blocks = isinstance(request, ChunkBlocks)
        if failure.kind == "missing" and not blocks:
            raise _missing_chunk(self.url, chunk, record)
        if failure.kind == "missing":
            raise _missing_blocks(self.url, record, f"{self.backend.url}: no such key {object_key(chunk.digest)!r}")
        if failure.kind == "size":
            raise _wrong_size(self.url, chunk, int(failure.detail))
        if failure.kind == "digest":
            raise _digest_mismatch(self.url, chunk, record)
        if failure.kind == "short" and isinstance(request, ChunkBlocks):
            raise _short_range(self.url, chunk, request.lo, request.hi, int(failure.detail))
        if failure.kind == "block":
            raise _block_mismatch(self.url, chunk, int(failure.detail), record)

    def _blocks_of(self, record: BlobRecord, start: int, end: int) -> Iterator[tuple[int, int]]:
        """(chunk index, block index) pairs covering [start, end)."""
        if start >= end:
            return
        # chunks lie in offset order: start at the one holding `start` (a read of many rows asks this per row)
        first = max(bisect.bisect_right(record.chunk_offsets, start) - 1, 0)
        for ci in range(first, len(record.chunks)):
            chunk = record.chunks[ci]
            c_end = chunk.offset + chunk.size
            if chunk.offset >= end:
                break
            if c_end <= start:
                continue
            lo = (max(start, chunk.offset) - chunk.offset) // record.block_size
            hi = (min(end, c_end) - chunk.offset - 1) // record.block_size
            for bi in range(lo, hi + 1):
                yield ci, bi

    def _fetch_blocks(self, record: BlobRecord, wanted: list[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
        """Fetch and verify blocks; runs of adjacent blocks in one chunk become one ranged read."""
        result: dict[tuple[int, int], bytes] = {}
        todo = []
        whole_chunks: dict[int, bytes | None] = {}
        cache = self._serving_cache
        for ci, bi in wanted:
            expected = record.chunks[ci].blocks[32 * bi : 32 * bi + 32]
            hit = None
            if cache is not None:
                if ci not in whole_chunks:  # a chunk cached whole by `get` serves its blocks too
                    whole_chunks[ci] = cache.get(parse_digest(record.chunks[ci].digest))
                chunk_bytes = whole_chunks[ci]
                if chunk_bytes is not None:
                    hit = chunk_bytes[bi * record.block_size : (bi + 1) * record.block_size]
                else:
                    hit = cache.get(expected.hex())
            if hit is not None:
                result[(ci, bi)] = hit
            else:
                todo.append((ci, bi))
        runs: list[list[tuple[int, int]]] = []
        for item in sorted(todo):
            if runs and runs[-1][-1][0] == item[0] and runs[-1][-1][1] + 1 == item[1]:
                runs[-1].append(item)
            else:
                runs.append([item])
        requests = []
        for run in runs:
            chunk = record.chunks[run[0][0]]
            lo = run[0][1] * record.block_size
            hi = min(chunk.size, (run[-1][1] + 1) * record.block_size)
            requests.append(ByteRange(object_key(chunk.digest), lo, hi))
        try:
            payloads = self.backend.read_ranges(requests)
        except NotFoundError as exc:
            raise _missing_blocks(self.url, record, str(exc)) from None
        for run, req, data in zip(runs, requests, payloads):
            chunk = record.chunks[run[0][0]]
            if len(data) != req.end - req.start:
                raise _short_range(self.url, chunk, req.start, req.end, len(data))
            for j, (ci, bi) in enumerate(run):
                block = data[j * record.block_size : (j + 1) * record.block_size]
                expected = chunk.blocks[32 * bi : 32 * bi + 32]
                if raw_hash(block) != expected:
                    raise _block_mismatch(self.url, chunk, bi, record)
                if self.cache is not None:
                    self.cache.put(expected.hex(), block)
                result[(ci, bi)] = block
        return result

    @property
    def _serving_cache(self) -> ReadCache | None:
        """The cache when reads may be served from it (it is trusted), else None."""
        return self.cache if self.trust_cache else None

    def _read_ref(self, digest: str) -> str:
        key = blob_ref_key(digest)
        try:
            value = self.backend.read(key, MAX_REF_BYTES).decode("ascii", errors="replace").strip()
        except NotFoundError:
            raise NotFoundError(f"{self.url}: no blob {digest}") from None
        try:
            parse_digest(value)
        except TrajectoryReplayError:
            raise IntegrityError(f"blob ref {self.url}/{key} does not hold a digest") from None
        return value

    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        return self._io.map(fn, items)


def _split_spans(
    record: BlobRecord,
    spans: Sequence[tuple[int, int]],
) -> tuple[list[tuple[ChunkInfo, int]], list[tuple[int, int, int]]]:
    """How to read `spans` of a blob one after another into one buffer: the chunks wholly inside a span, as (chunk,
    where it goes in the buffer), read whole; and the rest of each span at its edges, as (start, end, where it
    goes), read by blocks."""
    whole: list[tuple[ChunkInfo, int]] = []
    edges: list[tuple[int, int, int]] = []
    at = 0
    chunks = record.chunks
    for start, end in spans:
        # the chunks wholly inside [start, end), walked by index: a slice of a large record's chunk list per run
        # would copy the rest of the list each time
        first = last = bisect.bisect_left(record.chunk_offsets, start)
        while last < len(chunks) and chunks[last].offset + chunks[last].size <= end:
            last += 1
        inside = chunks[first:last]
        if inside:
            lo, hi = inside[0].offset, inside[-1].offset + inside[-1].size
            whole += [(chunk, at + chunk.offset - start) for chunk in inside]
            edges += [(a, b, at + a - start) for a, b in ((start, lo), (hi, end)) if a < b]
        elif start < end:
            edges.append((start, end, at))
        at += end - start
    return whole, edges


def _missing_chunk(url: str, chunk: ChunkInfo, record: BlobRecord) -> NotFoundError:
    return NotFoundError(f"{url}: missing chunk {chunk.digest} of blob {record.digest}")


def _wrong_size(url: str, chunk: ChunkInfo, got: int) -> IntegrityError:
    return IntegrityError(
        f"chunk {chunk.digest} at {url}/{object_key(chunk.digest)}: {got} bytes, record says {chunk.size}"
    )


def _missing_blocks(url: str, record: BlobRecord, why: str) -> NotFoundError:
    return NotFoundError(f"{url}: missing chunk of blob {record.digest} ({why})")


def _short_range(url: str, chunk: ChunkInfo, start: int, end: int, got: int) -> IntegrityError:
    return IntegrityError(
        f"chunk {chunk.digest} at {url}/{object_key(chunk.digest)}: expected {end - start} bytes at {start}, got {got}"
    )


def _block_mismatch(url: str, chunk: ChunkInfo, block: int, record: BlobRecord) -> IntegrityError:
    return IntegrityError(
        f"chunk {chunk.digest} at {url}/{object_key(chunk.digest)}: block {block} does not match "
        f"the record of blob {record.digest}"
    )


def _digest_mismatch(url: str, chunk: ChunkInfo, record: BlobRecord) -> IntegrityError:
    return IntegrityError(
        f"chunk {chunk.digest} at {url}/{object_key(chunk.digest)}: content does not match its "
        f"digest (blob {record.digest})"
    )


__all__ = ["DEFAULT_BLOCK_SIZE", "SMALL_OBJECT", "BlobRef", "ObjectStore", "PutPlan", "PutStats"]
