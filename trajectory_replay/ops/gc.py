"""`gc`: remove what no bundle and no capture in progress needs.

Writers run concurrently and take no lock; the agreement between them and gc is the in-flight
records, the sweep lease and the epoch of `store.liveness`. A run goes:

1. List every object and blob ref, keeping only those named the way the store names them.
   Nothing else is ever deleted. On local disk, a store directory that is a symbolic link out
   of the root stops gc before it deletes anything.
2. Read the in-flight records. Each listed digest is a root, with its ref, record and chunks.
3. Mark from every COMPLETE, and from the rank markers of cohorts that are finalizable, younger
   than the grace period or named by a live in-flight record; an older incomplete cohort is
   abandoned and its markers go too, with its FINALIZER claim (and a claim left alone in a
   directory whose markers are gone). Marking follows documents -> manifest payload blobs -> refs
   -> records -> chunks. A bundle whose markers or tree cannot be read whole is never guessed at:
   what its raw markers name is kept, and if that cannot be known (its manifest or a record is
   unreadable, a marker names no digest) no object or ref is deleted by this run. The report names
   each such bundle; the rest of the run (expired in-flight records, abandoned markers) proceeds.
4. Take the sweep lease (renewed by a heartbeat) and open a new epoch, then sweep unmarked keys
   older than the grace period in layers: markers of abandoned cohorts, refs, records, chunks (so
   a ref never names a record gc removed first), in small batches. Before every batch the
   in-flight records are read again and new markers looked for, and the batch goes only while the
   lease is fresh.

A writer that found an object present after this run re-read the in-flight records, and before
the object was deleted, sees the lease or the new epoch when it commits and checks (and re-stores)
everything its bundle needs, so a bundle that completes is whole.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from trajectory_replay.backends import Backend, KeyStat, redact_url
from trajectory_replay.bundle.documents import parse_json
from trajectory_replay.bundle.markers import (
    ABANDONED,
    FINALIZER,
    MAX_MARKER_BYTES,
    RANK_MARKER,
    abandoned_key,
    abandoned_note,
    finalizer_key,
)
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    BundleState,
    bundle_names,
    bundle_status,
    scan_bundles,
)
from trajectory_replay.errors import BackendError, BundleError, NotFoundError, UsageError
from trajectory_replay.ops.progress import Progress
from trajectory_replay.ops.walk import Walker, open_root
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.store import BlobRecord
from trajectory_replay.store.digest import OBJECT, REF, digest_from_key, digests_in, key_kind, object_key
from trajectory_replay.store.inventory import Inventory, batched, concurrently, digest_keys, record_keys
from trajectory_replay.store.liveness import (
    DEFAULT_INFLIGHT_TTL,
    InflightState,
    LeaseLostError,
    SweepLease,
    is_inflight_key,
    read_inflight,
    remove_dead_leases,
)
from trajectory_replay.units import human_bytes

DEFAULT_GRACE = "24h"
TEMPORARY_MIN_AGE = 3600.0
"""Seconds: a temporary file younger than this may belong to a write in progress and is never removed."""
DELETE_BATCH = 128
SALVAGE_DOCUMENT_BYTES = 64 << 20
"""A blob named by an unreadable marker is read for the digests it names only up to this size."""
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    """'0s', '30m', '24h', '7d', '1h30m' -> seconds; UsageError (exit 2) when malformed."""
    value = (text or "").strip().lower()
    parts = _DURATION.findall(value)
    if not value or "".join(n + u for n, u in parts) != value:
        raise UsageError(f"--grace {text!r}: expected a duration like 0s, 30m, 24h or 7d")
    return float(sum(float(n) * _UNITS[u] for n, u in parts))


@dataclass
class GcReport(Outcome):
    """What gc removed (or, with dry_run, would remove) and what it kept."""

    root: str
    dry_run: bool
    grace_seconds: float
    objects_removed: int = 0
    refs_removed: int = 0
    markers_removed: int = 0
    inflight_removed: int = 0
    bytes_freed: int = 0
    objects_live: int = 0
    """Objects and refs reachable from bundles."""
    protected_by_inflight: int = 0
    """Unreachable keys kept because a capture in progress names them."""
    too_young: int = 0
    """Unreachable keys kept because they are younger than the grace period."""
    active_captures: int = 0
    abandoned_bundles: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    """Removed keys that a capture turned out to rely on (it began reusing them inside a batch's window);
    that capture finds them gone before it commits and stores them again or refuses."""
    unreadable_bundles: list[str] = field(default_factory=list)
    """'<bundle>: why' for each bundle whose markers or tree could not be read whole."""
    kept_everything: bool = False
    """No object or ref was removed because an unreadable bundle might reference any of them."""
    dead_leases_removed: list[str] = field(default_factory=list)
    temporaries_removed: list[str] = field(default_factory=list)
    """Partial writes of killed writers (local temporary files), older than the grace period and at least
    TEMPORARY_MIN_AGE."""

    @property
    def status(self) -> Status:
        """Always pass: what gc could not read it keeps, and says so in the report."""
        return Status.PASS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render_text(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        lines = [
            f"gc {self.root}: {verb} {self.objects_removed} objects, {self.refs_removed} blob refs, "
            f"{self.markers_removed} markers, {self.inflight_removed} expired in-flight records; "
            f"{human_bytes(self.bytes_freed)} {'would be ' if self.dry_run else ''}freed",
            f"  kept {self.objects_live} live keys, {self.protected_by_inflight} named by "
            f"{self.active_captures} capture(s) in progress, {self.too_young} younger than the grace period",
        ]
        if self.temporaries_removed:
            lines.append(f"  {verb} {len(self.temporaries_removed)} partial writes left by killed writers")
        if self.abandoned_bundles:
            lines.append(f"  abandoned cohorts: {', '.join(self.abandoned_bundles)}")
        for problem in self.unreadable_bundles:
            lines.append(f"  unreadable bundle {problem}")
        if self.kept_everything:
            lines.append(
                "  kept every object and ref: an unreadable bundle might reference any of them "
                "(run fsck, repair or remove it)"
            )
        if self.conflicts:
            lines.append(
                f"  WARNING: {len(self.conflicts)} removed keys were reused by a capture meanwhile; it "
                "stores them again (or refuses to commit) before its marker is written"
            )
        if self.dry_run and (self.removed or self.temporaries_removed):
            lines.append("  would remove:")
            lines += [f"    {key}" for key in self.removed + self.temporaries_removed]
        return "\n".join(lines)


def _whole_json(data: bytes) -> bool:
    """True when `data` parses as one JSON object (nesting bounded as for every marker)."""
    try:
        parse_json(data, "marker")
    except BundleError:
        return False
    return True


def _cohort_keys(state: BundleState) -> list[str]:
    """The keys an abandoned cohort leaves: its FINALIZER claim first, so that a run stopped between its
    batches leaves rank markers (a cohort the next run abandons again), not a claim alone."""
    return ([state.finalizer_key] if state.finalizer_key else []) + state.marker_keys


def collect_garbage(
    root: str | os.PathLike,
    *,
    grace: str | float = DEFAULT_GRACE,
    dry_run: bool = False,
    progress: Progress | None = None,
    **storage_options: Any,
) -> GcReport:
    """Remove unreachable objects, blob refs, abandoned cohorts' markers and expired in-flight records."""
    grace_s = parse_duration(grace) if isinstance(grace, str) else float(grace)
    if grace_s < 0:
        raise UsageError("--grace must not be negative")
    backend = open_root(root, **storage_options)
    return _Collector(backend, grace_s, dry_run, progress or Progress(), redact_url(os.fspath(root))).run()


class _Collector:
    def __init__(self, backend: Backend, grace: float, dry_run: bool, progress: Progress, shown: str) -> None:
        self.backend, self.grace, self.dry_run, self.progress = backend, grace, dry_run, progress
        self.start = time.time()
        self.cutoff = self.start - grace
        self.lease: SweepLease | None = None
        self.inventory = Inventory(backend)
        self.walker = Walker(backend, self.inventory)
        self.report = GcReport(shown, dry_run, grace)
        self.inflight_digests: set[str] = set()
        self.live: set[str] = set()
        self.root_bundles: set[str] = set()
        """Bundles already marked from (COMPLETE is immutable, so a complete one needs no second look)."""
        self.unreadable: dict[str, str] = {}
        """Bundle -> why its tree is not known whole (its raw markers' digests are kept; see `_salvage`)."""
        self.ref_memo: dict[str, str | None] = {}
        """Record digest each candidate ref held, read before any delete (a deleted ref still protects)."""
        self.record_kind: dict[str, BlobRecord | None] = {}
        self.sizes: dict[str, int] = {}
        self.candidates: set[str] = set()
        self.active_bundles: set[str] = set()

    # ---- phases -------------------------------------------------------------------------------
    def run(self) -> GcReport:
        self._refuse_links_out()
        listed = [
            k
            for k in self.inventory.object_keys() + self.inventory.ref_keys()  # 1
            if digest_from_key(k) is not None
        ]
        inflight = self._read_inflight()  # 2
        names = bundle_names(self.backend)
        states = scan_bundles(self.backend, names)
        roots, abandoned = self._classify(states)  # 3
        self._mark(roots)
        self.report.abandoned_bundles = sorted(s.name for s in abandoned)
        self.report.objects_live = sum(1 for k in listed if k in self.live)
        candidates = self._aged([k for k in listed if k not in self.live])  # 4
        claims, notes = self._leftovers(names, states)
        markers = self._aged([k for s in abandoned for k in _cohort_keys(s)] + claims) + self._aged(
            notes, self.start - max(self.grace, DEFAULT_INFLIGHT_TTL)
        )
        self._read_candidate_refs(candidates)
        self.candidates = set(candidates) | set(markers)
        if not self.dry_run:
            # writers that found something present before this point see the lease or the new epoch at commit
            self.lease = SweepLease(self.backend)
            self.lease.acquire()
        try:
            if self.lease is not None:
                self.report.dead_leases_removed = remove_dead_leases(self.backend)
            protected = self._refresh()
            self.report.protected_by_inflight = len(protected & set(candidates))
            expired = self._aged([r.key for r in inflight if not r.live(self.start) and r.removable])
            kinds = {k: key_kind(k) for k in candidates}
            layers = [
                markers,
                [k for k in candidates if kinds[k] == REF],
                [k for k in candidates if kinds[k] == OBJECT and self._is_record_key(k)],
                [k for k in candidates if kinds[k] == OBJECT and not self._is_record_key(k)],
            ]
            self.progress.phase(
                "gc: deleting" if not self.dry_run else "gc: dry run",
                objects=sum(map(len, layers)) + len(expired),
                nbytes=sum(self.sizes.get(k, 0) for layer in layers for k in layer),
            )
            first = True
            for layer in layers:
                for batch in batched(layer, DELETE_BATCH):
                    if not first:
                        self._refresh()
                    first = False
                    doomed = [k for k in batch if k in self.candidates and self._deletable(k)]
                    if layer is markers:
                        self._note_abandoned(doomed)
                    self._delete(doomed)
            if self.report.removed and not self.dry_run:
                self._refresh(final=True)  # only to detect conflicts with captures that started meanwhile
        except LeaseLostError as exc:
            raise BackendError(f"gc: {exc}; what was removed before is listed by --json") from None
        finally:
            if self.lease is not None:
                self.lease.release()
        if expired:  # a writer past its TTL may have refreshed its record meanwhile: look again
            still = {r.key: r for r in read_inflight(self.backend)}
            self._delete([k for k in expired if k in still and not still[k].live(time.time())])
        self._remove_temporaries()
        self.report.unreadable_bundles = [f"{name}: {why}" for name, why in sorted(self.unreadable.items())]
        return self.report

    def _remove_temporaries(self) -> None:
        """A writer killed between writing a temporary file and linking it leaves the file behind; no key names
        it, so only its age tells it is dead. A live write links its file within seconds, so one older than
        TEMPORARY_MIN_AGE (and than the grace period) is a leftover whatever --grace says."""
        older_than = self.start - max(self.grace, TEMPORARY_MIN_AGE)
        leftovers = self.backend.leftover_temporaries(older_than)
        if not self.dry_run:
            for path in leftovers:
                self.backend.remove_temporary(path)
        self.report.temporaries_removed = leftovers

    def _refuse_links_out(self) -> None:
        """On local disk, a store directory that links out of the root would make gc delete foreign files."""
        links = self.inventory.links_out()
        if links:
            raise BackendError(
                f"gc: {self.backend.url}/{links[0]} is a symbolic link out of the store root; "
                "gc deletes nothing through it (replace the link by a directory or mount)"
            )

    def _deletable(self, key: str) -> bool:
        """Only what the store names is ever deleted; while a bundle's references are unknown, no object or ref."""
        if key_kind(key) is not None:
            return digest_from_key(key) is not None and not self.report.kept_everything
        return True  # markers and claims of abandoned cohorts: only COMPLETE, COMPLETE.<r> and FINALIZER keys

    def _read_inflight(self) -> list[InflightState]:
        records = read_inflight(self.backend)
        live = [r for r in records if r.live(time.time())]
        self.report.active_captures = len(live)
        for r in live:
            self.inflight_digests.update(r.digests)
        self.active_bundles = {r.bundle for r in live if r.bundle}
        return records

    def _leftovers(self, names: list[str], states: list[BundleState]) -> tuple[list[str], list[str]]:
        """(FINALIZER claims, ABANDONED notes) left in directories without markers, where no bundle state names
        them and nothing else would remove them. A claim is left when the rank markers are gone (removed by hand,
        or by a gc run that stopped between deletes); a note outlives its cohort on purpose (see
        `_note_abandoned`) and goes only once older than an in-flight record's TTL, so no writer that started
        before it is still at work."""
        stated = {s.name for s in states}
        claims, notes = [], []
        for name in names:
            if name in stated or name in self.active_bundles:
                continue
            held = set(self.backend.list_dir(name))
            if held and held <= {FINALIZER, ABANDONED}:
                claims += [finalizer_key(name)] if FINALIZER in held else []
                notes += [abandoned_key(name)] if ABANDONED in held else []
        return claims, notes

    def _note_abandoned(self, keys: list[str]) -> None:
        """Before the rank markers among `keys` go, write each cohort's ABANDONED note: a producer of the bundle
        that lands later finds its cohort incomplete and, reading the note, fails loudly instead of returning as
        though its landing would count (markers.removed_since). Written again by every sweep that abandons the
        bundle, so its time is that of the latest removal."""
        ranks: dict[str, list[int]] = {}
        for key in keys:
            name, _, tail = key.rpartition("/")
            match = RANK_MARKER.fullmatch(tail)
            if match:
                ranks.setdefault(name, []).append(int(match.group(1)))
        if not self.dry_run:
            for name, landed in ranks.items():
                self.backend.write(abandoned_key(name), abandoned_note(landed, time.time()))

    def _classify(self, states: list[BundleState]) -> tuple[list[BundleState], list[BundleState]]:
        roots, abandoned = [], []
        for s in states:
            if (
                s.status in (COMPLETE_STATUS, FINALIZABLE, CORRUPT)
                or s.name in self.active_bundles
                or (s.mtime is not None and s.mtime > self.cutoff)
            ):
                roots.append(s)
            else:
                abandoned.append(s)
        return roots, abandoned

    def _mark(self, roots: list[BundleState]) -> None:
        readable = [s for s in roots if s.status != CORRUPT]
        trees = self.walker.trees(readable)
        for tree in trees.values():
            self.live |= tree.keys
            if tree.problems:
                self._unknowable(tree.name, tree.problems[0])
        for s in roots:
            if s.status == CORRUPT and s.name not in self.unreadable:
                self.unreadable[s.name] = s.detail or "markers cannot be read"
                self._salvage(s)
        self.live |= {k for s in roots for k in s.marker_keys}
        self.root_bundles |= {s.name for s in readable if s.status == COMPLETE_STATUS and not trees[s.name].problems}

    def _unknowable(self, name: str, why: str) -> None:
        self.unreadable.setdefault(name, why)
        self.report.kept_everything = True

    def _salvage(self, state: BundleState) -> None:
        """Keep what the raw bytes of an unreadable bundle's markers name, down to chunks and payloads.

        Every `blake3:` digest in the markers is kept as an object and as a blob (ref, record, chunks);
        a blob that is a JSON document is read for the digests it names in turn (markers -> documents
        -> payloads). When that cannot be done completely, no object or ref is deleted."""
        raw = self.inventory.read(state.marker_keys, MAX_MARKER_BYTES)  # a marker larger than that is none
        seeds: set[str] = set()
        for key, data in raw.items():
            if isinstance(data, Exception):
                self._unknowable(
                    state.name, f"marker {key} cannot be a marker ({data}), so what it names cannot be known"
                )
                return
            if data is not None and not _whole_json(data):
                # cut short (or not JSON at all): the digests it still holds need not be all it named
                self._unknowable(
                    state.name, f"marker {key} is not whole JSON (truncated?), so what it names cannot be known"
                )
                return
            found = set() if data is None else digests_in(data)
            if data is not None and not found:
                self._unknowable(state.name, f"marker {key} names no digest")
                return
            seeds |= found
        seen: set[str] = set()
        for _depth in range(3):  # marker -> documents -> payload blobs
            todo = sorted(seeds - seen)
            if not todo:
                return
            seen |= set(todo)
            self.live |= {k for d in todo for k in digest_keys(d)}
            refs = self.inventory.refs(todo)
            records = self.inventory.records(set(todo) | {r for r in refs.values() if r})
            documents = []
            for digest in todo:
                for record_digest in dict.fromkeys([refs.get(digest), digest]):
                    if not record_digest:
                        continue
                    record = records.get(record_digest)
                    if isinstance(record, BlobRecord):
                        self.live |= record_keys(record_digest, record)
                        if record.digest == digest and record.size <= SALVAGE_DOCUMENT_BYTES:
                            documents.append(record)
            heads = self.inventory.read_objects(r.chunks[0].digest for r in documents if r.chunks)
            for record in documents:
                head = heads.get(record.chunks[0].digest) if record.chunks else b""
                if not head or not head.lstrip().startswith(b"{"):
                    continue  # a tensor payload, not a document
                body = self.inventory.read_objects(c.digest for c in record.chunks)
                chunks = [body[c.digest] for c in record.chunks]
                present = [chunk for chunk in chunks if chunk is not None]
                if len(present) < len(chunks):
                    self._unknowable(state.name, f"document {record.digest} has missing chunks")
                    return
                seeds |= digests_in(b"".join(present))
        if seeds - seen:
            self._unknowable(state.name, "its documents nest deeper than a bundle's")

    def _aged(self, keys: list[str], cutoff: float | None = None) -> list[str]:
        """The keys whose mtime is older than the grace period (or `cutoff`); records their sizes."""

        def stat(key: str) -> KeyStat | None:
            try:
                return self.backend.stat(key)
            except NotFoundError:
                return None

        out = []
        for key, st in zip(keys, concurrently(stat, keys, self.backend.max_workers)):
            if st is None:
                continue
            if st.mtime <= (self.cutoff if cutoff is None else cutoff):
                self.sizes[key] = st.size
                out.append(key)
            else:
                self.report.too_young += 1
        return out

    def _read_candidate_refs(self, candidates: list[str]) -> None:
        digests = [digest_from_key(k) for k in candidates if key_kind(k) == REF]
        self.ref_memo = self.inventory.refs(d for d in digests if d)
        candidate_set = set(candidates)
        records = [r for r in self.ref_memo.values() if r and object_key(r) in candidate_set]
        for r, rec in self.inventory.records(records).items():
            self.record_kind[r] = rec if isinstance(rec, BlobRecord) else None

    def _is_record_key(self, key: str) -> bool:
        return self.record_kind.get(digest_from_key(key) or "") is not None

    # ---- protection -----------------------------------------------------------------------------
    def _refresh(self, final: bool = False) -> set[str]:
        """Re-read in-flight records and look for new markers; drop what they need from the candidates.

        Called before every delete batch; the batch goes only if the lease is still fresh afterwards."""
        self._read_inflight()
        protected = self._expand(self.inflight_digests)
        self._rescan()
        needed = protected | self.live
        self.candidates -= needed
        if final:  # needed, removed by us, and not written again by the capture that needs it
            lost = sorted(needed & set(self.report.removed))
            self.report.conflicts = [
                k
                for k, there in zip(lost, concurrently(self.backend.exists, lost, self.backend.max_workers))
                if not there
            ]
        elif self.lease is not None:
            self.lease.check()
        return protected

    def _expand(self, digests: Iterable[str]) -> set[str]:
        """Keys an in-flight capture relies on: each listed object and ref, and below a listed blob or record
        that is a candidate, its record and chunks."""
        out: set[str] = set()
        for d in digests:
            out |= digest_keys(d)
            for record_digest in (self.ref_memo.get(d), d):
                if record_digest and object_key(record_digest) in self.candidates:
                    record = self._record(record_digest)
                    if record is not None:
                        out |= record_keys(record_digest, record)
        return out

    def _record(self, digest: str) -> BlobRecord | None:
        """The record object `digest` holds, or None when that object is not a record (probed once)."""
        if digest not in self.record_kind:
            self.record_kind[digest] = self.inventory.probe_record(digest)
        return self.record_kind[digest]

    def _rescan(self) -> None:
        """Mark from bundles that completed, landed a rank or gained a capture since the mark phase."""
        names = [n for n in bundle_names(self.backend) if n not in self.root_bundles]
        states = [
            s
            for s in concurrently(lambda n: bundle_status(self.backend, n), names, self.backend.max_workers)
            if s is not None
        ]
        roots, _abandoned = self._classify(states)
        if roots:
            self._mark(roots)
            for s in roots:  # markers of a cohort no longer abandoned stay, and so does its claim
                self.candidates -= set(_cohort_keys(s))

    # ---- deleting --------------------------------------------------------------------------------
    def _delete(self, keys: list[str]) -> None:
        if not keys:
            return
        if not self.dry_run:
            self.inventory.delete(keys)
        freed = 0
        for key in keys:
            freed += self.sizes.get(key, 0)
            kind = key_kind(key)
            if kind == OBJECT:
                self.report.objects_removed += 1
            elif kind == REF:
                self.report.refs_removed += 1
            elif is_inflight_key(key):
                self.report.inflight_removed += 1
            else:
                self.report.markers_removed += 1
        self.report.bytes_freed += freed
        self.report.removed += keys
        self.progress.advance(len(keys), freed)


__all__ = ["DEFAULT_GRACE", "GcReport", "collect_garbage", "parse_duration"]
