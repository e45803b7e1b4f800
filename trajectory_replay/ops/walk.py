"""What a store root holds, as the store operations see it: its bundles, their markers, and each
bundle's reachable objects.

One walk serves ls, cp, gc, fsck and stats. A bundle's tree is the Merkle DAG its markers pin:

    COMPLETE / COMPLETE.<r> -> documents (manifest, index, expected) -> payload blobs
    blob -> ref `blobs/<digest>` -> record `objects/<record>` -> chunks `objects/<chunk>`

Trees are walked level by level across all bundles at once, each level one batch of
concurrent reads (`read_many`), so a store with many bundles costs a few round trips per level,
not one per object. Records and the manifests are verified against their digests before they
are parsed; payload chunks are named, not read (fsck reads them).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from trajectory_replay.backends import Backend, open_backend, redact_url
from trajectory_replay.backends.base import WorkerPool
from trajectory_replay.bundle.documents import (
    MAX_JSON_DEPTH, document_size_problem, nesting_exceeds, parse_json, validate_document,
)
from trajectory_replay.bundle.markers import (
    COMPLETE, RANK_MARKER, CompleteMarker, Documents, RankMarker, check_agreement, complete_key, rank_key,
    rank_marker_problems, read_marker,
)
from trajectory_replay.bundle.resolve import RESERVED, Anchor
from trajectory_replay.bundle.schema import Manifest, PayloadSpec
from trajectory_replay.errors import (
    BundleError, NoSuchTargetError, NotFoundError, StorageUnavailableError, TrajectoryReplayError, UsageError,
)
from trajectory_replay.store import BlobRecord
from trajectory_replay.store.objectstore import MAX_RECORD_BYTES
from trajectory_replay.store.digest import blob_ref_key, digest_from_key, hash_bytes, object_key, parse_digest

T = TypeVar("T")
R = TypeVar("R")

READ_BATCH = 256
"""Keys per `read_many` call: big enough to keep every connection busy, small enough to bound memory."""


# ---- small shared helpers ---------------------------------------------------------------------------

def concurrently(fn: Callable[[T], R], items: Sequence[T], workers: int = 8) -> list[R]:
    """`[fn(x) for x in items]` on a thread pool, in order (sequential for 0 or 1 item)."""
    items = list(items)
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
    return _pool(workers).map(fn, items)


_POOLS: dict[int, WorkerPool] = {}


def _pool(workers: int) -> WorkerPool:
    """One long-lived pool per size: gc and fsck call this thousands of times."""
    if workers not in _POOLS:
        _POOLS[workers] = WorkerPool(workers)
    return _POOLS[workers]


def batched(items: Sequence[T], size: int = READ_BATCH) -> list[list[T]]:
    items = list(items)
    return [items[i:i + size] for i in range(0, len(items), size)]


def fetch(backend: Backend, keys: Iterable[str]) -> dict[str, Optional[bytes]]:
    """The values of `keys` (None for an absent key), read in concurrent batches."""
    keys = list(dict.fromkeys(keys))
    out: dict[str, Optional[bytes]] = {}
    for batch in batched(keys):
        try:
            out.update(zip(batch, backend.read_many(batch)))
        except NotFoundError:  # find which ones are absent, still concurrently
            out.update(zip(batch, concurrently(lambda k: _read_or_none(backend, k), batch, backend.max_workers)))
    return out


def _read_or_none(backend: Backend, key: str) -> Optional[bytes]:
    try:
        return backend.read(key)
    except NotFoundError:
        return None


def digest_matches(key: str, data: bytes) -> bool:
    """True when `data` is the content `key` (objects/<2hex>/<64hex>) names."""
    return hash_bytes(data) == digest_from_key(key)


def open_root(path_or_url: str | os.PathLike, *, must_exist: bool = True, **storage_options: Any) -> Backend:
    """The backend of a store root; NotFoundError when `must_exist` and nothing is there."""
    backend = open_backend(path_or_url, **storage_options)
    if must_exist and not backend.list_dir():
        raise NoSuchTargetError(f"{redact_url(str(path_or_url))}: no such store root (nothing stored there)")
    return backend


# ---- bundles and their markers -------------------------------------------------------------------

COMPLETE_STATUS, INCOMPLETE, FINALIZABLE, CORRUPT = "complete", "incomplete", "finalizable", "corrupt"


@dataclass
class BundleState:
    """One bundle directory of a root: its markers and what they say."""

    name: str
    status: str
    """complete | incomplete (ranks missing) | finalizable (all ranks landed, COMPLETE missing) | corrupt"""
    complete: Optional[CompleteMarker] = None
    rank_markers: dict[int, RankMarker] = field(default_factory=dict)
    expected_ranks: list[int] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    marker_keys: list[str] = field(default_factory=list)
    mtime: Optional[float] = None
    """Modification time of COMPLETE, else of the newest rank marker."""
    detail: str = ""

    @property
    def anchor(self) -> Optional[Anchor]:
        if self.complete is not None:
            return Anchor.from_marker(self.complete.anchor)
        if self.rank_markers:
            return Anchor.from_marker(next(iter(self.rank_markers.values())).anchor)
        return None

    @property
    def multi_rank(self) -> bool:
        return self.complete.multi_rank if self.complete is not None else bool(self.rank_markers)

    @property
    def landed_ranks(self) -> list[int]:
        return sorted(self.rank_markers)

    def documents(self) -> list[tuple[Optional[int], Documents]]:
        """(rank, documents) of every shard the markers pin: COMPLETE's shards, else the landed ranks'."""
        if self.complete is not None:
            if not self.complete.multi_rank:
                return [(None, self.complete.documents())]
            return [(int(r), d) for r, d in sorted(self.complete.shards.items(), key=lambda kv: int(kv[0]))]
        return [(r, m.documents) for r, m in sorted(self.rank_markers.items())]


def bundle_names(backend: Backend) -> list[str]:
    """Children of the root that may be bundles (reserved and dot names excluded, and on a local disk the
    directories of the older format, whose COMPLETE is not a native marker: `ls` lists those itself)."""
    names = [n for n in backend.list_dir() if n not in RESERVED and not n.startswith(".")]
    root = getattr(backend, "root", None)
    if not isinstance(root, os.PathLike):
        return names
    from trajectory_replay.bundle import legacy

    return [n for n in names if not legacy.is_v1_bundle(os.path.join(root, n))]


def scan_bundle(backend: Backend, name: str, *, retry: bool = True) -> Optional[BundleState]:
    """The markers of bundle `name`; None when its directory holds no marker."""
    names = backend.list_dir(name)
    marker_names = [n for n in names if n == COMPLETE or RANK_MARKER.fullmatch(n)]
    if not marker_names:
        return None
    state = BundleState(name, INCOMPLETE, marker_keys=[f"{name}/{n}" for n in sorted(marker_names)])
    try:
        mtimes = [backend.mtime(k) for k in state.marker_keys]
        if COMPLETE in marker_names:
            state.mtime = backend.mtime(complete_key(name))
            state.complete = read_marker(backend, complete_key(name), CompleteMarker)  # type: ignore[assignment]
        else:
            state.mtime = max(mtimes)
        for n in marker_names:
            match = RANK_MARKER.fullmatch(n)
            if match:
                marker = read_marker(backend, rank_key(name, int(match.group(1))), RankMarker)
                if marker is not None:
                    state.rank_markers[int(match.group(1))] = marker  # type: ignore[assignment]
    except NotFoundError:  # a marker removed while we looked (gc of an abandoned cohort): look again
        return scan_bundle(backend, name, retry=False) if retry else None
    except (UsageError, StorageUnavailableError):  # a store that stopped answering says nothing of this bundle
        raise
    except TrajectoryReplayError as exc:
        # one unreadable marker makes its bundle corrupt, named; the other bundles of the root are unaffected
        state.status, state.detail = CORRUPT, str(exc)
        return state
    if state.complete is not None:
        state.status = COMPLETE_STATUS
        state.expected_ranks = list(state.complete.expected_ranks)
        return state
    if not state.rank_markers:
        return None
    first = next(iter(state.rank_markers.values()))
    state.expected_ranks = sorted(first.expected_ranks)
    state.missing_ranks = [r for r in state.expected_ranks if r not in state.rank_markers]
    # all landed: finalizers would write COMPLETE from these markers now, so each is checked against its
    # documents first (which also names the bad marker where the markers merely disagree)
    problems = [] if state.missing_ranks else rank_marker_problems(backend, name, state.rank_markers)
    if problems:
        state.status, state.detail = CORRUPT, "; ".join(map(str, problems))
        return state
    try:
        check_agreement(name, list(state.rank_markers.values()))
    except BundleError as exc:
        state.status, state.detail = CORRUPT, str(exc)
        return state
    if state.missing_ranks:
        state.detail = f"missing ranks {state.missing_ranks} of {state.expected_ranks}"
    else:
        state.status, state.detail = FINALIZABLE, "every rank landed; COMPLETE is missing"
    return state


def scan_bundles(backend: Backend, names: Optional[Iterable[str]] = None) -> list[BundleState]:
    """Every bundle of the root (or of `names`), markers read concurrently, sorted by name."""
    names = bundle_names(backend) if names is None else list(names)
    states = concurrently(lambda n: scan_bundle(backend, n), names, backend.max_workers)
    return sorted((s for s in states if s is not None), key=lambda s: s.name)


# ---- trees ---------------------------------------------------------------------------------------

@dataclass
class BlobNode:
    """A blob as the walk found it: its record's chunks (empty when the record could not be read)."""

    digest: str
    record: str
    size: int
    chunks: tuple[tuple[str, int], ...] = ()
    ref_record: Optional[str] = None
    """What `blobs/<digest>` names (None when the ref is absent); may differ from `record`."""
    keys: set[str] = field(default_factory=set)
    """The ref, the record(s) and their chunks."""
    missing: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)
    """Why the record could not be used (then `chunks` is empty and the subtree unknown)."""


@dataclass
class BundleTree:
    """Everything one bundle's markers reach."""

    name: str
    documents: list[BlobNode] = field(default_factory=list)
    payloads: list[tuple[Optional[int], PayloadSpec, BlobNode]] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    """Keys the walk needed to read and did not find (payload chunks are not read: see fsck)."""
    corrupt: set[str] = field(default_factory=set)
    """Keys the walk read whose bytes are not what their name or their parent says."""
    problems: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> bool:
        """True when every record and manifest was read: `keys` is the whole tree."""
        return not self.problems

    @property
    def logical_bytes(self) -> int:
        return sum(spec.size for _, spec, _ in self.payloads)

    def payload_chunks(self) -> dict[str, int]:
        """Unique chunks of the payload blobs, digest -> size."""
        return {c: s for _, _, node in self.payloads for c, s in node.chunks}

    def all_chunks(self) -> dict[str, int]:
        """Unique chunks of payload and document blobs, digest -> size."""
        out = self.payload_chunks()
        out.update({c: s for node in self.documents for c, s in node.chunks})
        return out

    @property
    def stored_bytes(self) -> int:
        return sum(self.all_chunks().values())

    def add(self, node: BlobNode, label: str) -> None:
        self.keys |= node.keys
        self.missing |= node.missing
        self.corrupt |= node.corrupt
        self.problems += [f"{self.name}: {label}: {p}" for p in node.problems]


class Walker:
    """Walks bundle trees on one backend; verified records are cached (they are immutable)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.record_cache: dict[str, BlobRecord | TrajectoryReplayError | None] = {}

    def refs(self, digests: Iterable[str]) -> dict[str, Optional[str]]:
        """What `blobs/<d>` holds for each digest (None when absent or not a digest)."""
        keys = {blob_ref_key(d): d for d in digests}
        return {keys[key]: parse_ref(value) for key, value in fetch(self.backend, keys).items()}

    def records(self, digests: Iterable[str]) -> dict[str, BlobRecord | TrajectoryReplayError | None]:
        """Verified, parsed records (None when absent, the error when corrupt)."""
        digests = list(dict.fromkeys(digests))
        todo = [d for d in digests if d not in self.record_cache]
        values = fetch(self.backend, [object_key(d) for d in todo])
        for d in todo:
            data = values[object_key(d)]
            self.record_cache[d] = None if data is None else parse_record(d, data)
        return {d: self.record_cache[d] for d in digests}

    def nodes(self, blobs: dict[str, tuple[str, int]]) -> dict[str, BlobNode]:
        """blob digest -> node, for blobs given as digest -> (record digest, size)."""
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
                    # the ref (repairable) or the bundle's own document (a problem of the bundle)
                    if which == node.ref_record:
                        node.corrupt.add(blob_ref_key(digest))
                    why = f"record {which} describes {record.digest}, not this blob"
                if which == record_digest:
                    node.problems.append(why)
            out[digest] = node
        return out

    def trees(self, bundles: Sequence[BundleState]) -> dict[str, BundleTree]:
        """The tree of every bundle (complete ones from COMPLETE, others from their landed rank markers)."""
        shards = {b.name: b.documents() for b in bundles}
        doc_nodes = self.nodes({ref.digest: (ref.record, ref.size) for docs in shards.values() for _, d in docs
                                for ref in (d.manifest, d.index, d.expected)})
        manifest_digests = {d.manifest.digest for docs in shards.values() for _, d in docs}
        manifests, bad_chunks = self._manifests({m: doc_nodes[m] for m in manifest_digests})
        payload_nodes = self.nodes({spec.digest: (spec.record, spec.size) for m in manifests.values()
                                    if isinstance(m, Manifest) for spec in m.payloads.values()
                                    if spec.digest and spec.record})
        trees = {}
        for name, docs in shards.items():
            tree = trees[name] = BundleTree(name)
            for rank, d in docs:
                for label, ref in (("manifest", d.manifest), ("index", d.index), ("expected", d.expected)):
                    tree.documents.append(doc_nodes[ref.digest])
                    tree.add(doc_nodes[ref.digest], label)
                missing, corrupt = bad_chunks.get(d.manifest.digest, (set(), set()))
                tree.missing |= missing
                tree.corrupt |= corrupt
                manifest = manifests[d.manifest.digest]
                if not isinstance(manifest, Manifest):
                    if not doc_nodes[d.manifest.digest].problems:
                        tree.problems.append(f"{name}: manifest {d.manifest.digest}: {manifest}")
                    continue
                for spec in manifest.payloads.values():
                    if not (spec.digest and spec.record):
                        tree.problems.append(f"{name}: payload {spec.name!r} has no digest in the manifest")
                        continue
                    node = payload_nodes[spec.digest]
                    tree.payloads.append((rank, spec, node))
                    tree.add(node, f"payload {spec.name!r}")
        return trees

    def _manifests(self, nodes: dict[str, BlobNode]) -> tuple[dict[str, Manifest | str], dict]:
        """Fetch, verify and parse manifests (all their chunks in one batch).

        Returns digest -> Manifest (or why it failed), and digest -> (missing, corrupt) chunk keys."""
        out: dict[str, Manifest | str] = {}
        bad: dict[str, tuple[set[str], set[str]]] = {}
        for digest, node in nodes.items():
            # the record's chunk sizes add up to the manifest's size: an oversized one is never fetched
            problem = document_size_problem(sum(size for _, size in node.chunks))
            if problem:
                out[digest] = problem
        nodes = {d: node for d, node in nodes.items() if d not in out}
        values = fetch(self.backend, [object_key(c) for node in nodes.values() for c, _ in node.chunks])
        for digest, node in nodes.items():
            if not node.chunks:
                out[digest] = "; ".join(node.problems) or "its record lists no chunks"
                continue
            missing, corrupt, parts = set(), set(), []
            for c, _ in node.chunks:
                data = values[object_key(c)]
                if data is None:
                    missing.add(object_key(c))
                elif hash_bytes(data) != c:
                    corrupt.add(object_key(c))
                else:
                    parts.append(data)
            if missing or corrupt:
                bad[digest] = (missing, corrupt)
                out[digest] = f"{len(missing)} missing and {len(corrupt)} corrupt chunks"
                continue
            blob = b"".join(parts)
            if hash_bytes(blob) != digest:
                out[digest] = f"content does not hash to {digest}"
                continue
            try:
                out[digest] = validate_document(Manifest, parse_json(blob, "manifest"), "manifest")
            except BundleError as exc:
                out[digest] = str(exc)
        return out, bad


def parse_ref(value: Optional[bytes]) -> Optional[str]:
    """The record digest a blob ref holds, or None when absent or malformed."""
    if value is None:
        return None
    text = value.decode("ascii", errors="replace").strip()
    try:
        parse_digest(text)
    except TrajectoryReplayError:
        return None
    return text


def parse_record(digest: str, data: bytes) -> BlobRecord | TrajectoryReplayError:
    """The record `objects/<digest>` holds, verified first; the error (not raised) when it is not one."""
    actual = hash_bytes(data)
    if actual != digest:
        return TrajectoryReplayError(f"record {digest} does not match its digest (hashes to {actual})")
    # correctly addressed bytes can still be hostile: bound them before the JSON parser sees them
    if len(data) > MAX_RECORD_BYTES:
        return TrajectoryReplayError(f"malformed blob record {digest}: {len(data)} bytes, over the "
                                     f"{MAX_RECORD_BYTES}-byte bound")
    if nesting_exceeds(data):
        return TrajectoryReplayError(f"malformed blob record {digest}: nested more than {MAX_JSON_DEPTH} "
                                     "levels deep")
    try:
        return BlobRecord.from_bytes(data, digest)
    except TrajectoryReplayError as exc:
        return exc


RECORD_PREFIX = re.compile(rb'\{"format":"trajectory-replay\.blob/')


def looks_like_record(head: bytes) -> bool:
    """True when an object's first bytes are those of a blob record."""
    return bool(RECORD_PREFIX.match(head))


__all__ = [
    "BlobNode", "BundleState", "BundleTree", "COMPLETE_STATUS", "CORRUPT", "FINALIZABLE", "INCOMPLETE", "Walker",
    "batched", "bundle_names", "concurrently", "digest_matches", "fetch", "looks_like_record", "open_root",
    "parse_record", "parse_ref", "scan_bundle", "scan_bundles",
]
