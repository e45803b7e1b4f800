"""`gc`: remove what no bundle and no capture in progress needs.

Order matters, because writers run concurrently and take no lock:

1. List `objects/` and `blobs/`. Only keys listed now can be removed by this run.
2. Read the in-flight records `.inflight/*.json`. A writer lists every object it will write
   or reuse there first, and removes its record only after its marker exists, so every listed
   key is either named by an in-flight record read now or by a marker scanned in step 3 (or is
   garbage). Records are roots until removed or past their own TTL (`max(created, updated) +
   ttl_seconds`), whatever the grace period.
3. Mark from every COMPLETE, from the rank markers of cohorts that are finalizable, younger than
   the grace period or named by a live in-flight record; an older incomplete cohort is
   abandoned and its markers go too. Marking follows documents -> manifest payload blobs ->
   refs -> records -> chunks (`walk.Walker`). A tree that cannot be read whole stops gc before
   anything is deleted.
4. Sweep unmarked keys older than the grace period (by mtime) in layers: markers of abandoned
   cohorts, then refs, then records, then chunks (so at every instant a ref names a record
   that exists and a record names chunks that exist), each layer in small batches. Before
   every batch the in-flight records are read again (what they name is spared, down to the
   chunks of a listed blob or record, even when this run already removed the blob's ref) and
   new markers are looked for.

The window that re-reading cannot close (a writer lists an orphaned object just after the
re-read of a batch, finds it present, and the batch then deletes it) is closed with the writer:
gc holds a sweep lease `.gc/lease-<run>` while it deletes and moves the epoch `.gc/epoch` when it
is done; a writer about to commit waits out any live lease and, when the epoch moved since it
started, checks that everything it listed still exists, refusing to commit otherwise. So a
bundle that completes is whole; a capture that loses the race fails cleanly and is written again.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from trajectory_replay.backends import Backend, redact_url
from trajectory_replay.bundle.writer import DEFAULT_INFLIGHT_TTL, GC_EPOCH_KEY, GC_LEASE_PREFIX, INFLIGHT_FORMAT
from trajectory_replay.errors import BundleError, NotFoundError, TrajectoryReplayError, UsageError
from trajectory_replay.ops.progress import Progress
from trajectory_replay.ops.walk import (
    COMPLETE_STATUS, CORRUPT, FINALIZABLE, BundleState, Walker, batched, bundle_names, concurrently,
    looks_like_record, open_root, scan_bundle, scan_bundles,
)
from trajectory_replay.store import BlobRecord
from trajectory_replay.store.digest import blob_ref_key, digest_from_key, object_key, parse_digest

DEFAULT_GRACE = "24h"
INFLIGHT_PREFIX = ".inflight/"
DELETE_BATCH = 128
LEASE_SECONDS = 300.0
"""A sweep lease outlives a batch by far; a gc that dies leaves a lease that expires on its own."""
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
class GcReport:
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
    run fsck once that capture has finished."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render_text(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        lines = [f"gc {self.root}: {verb} {self.objects_removed} objects, {self.refs_removed} blob refs, "
                 f"{self.markers_removed} markers, {self.inflight_removed} expired in-flight records; "
                 f"{self.bytes_freed} bytes {'would be ' if self.dry_run else ''}freed",
                 f"  kept {self.objects_live} live keys, {self.protected_by_inflight} named by "
                 f"{self.active_captures} capture(s) in progress, {self.too_young} younger than the grace period"]
        if self.abandoned_bundles:
            lines.append(f"  abandoned cohorts: {', '.join(self.abandoned_bundles)}")
        if self.conflicts:
            lines.append(f"  WARNING: {len(self.conflicts)} removed keys were reused by a capture meanwhile; "
                         "run fsck when it has finished")
        return "\n".join(lines)


@dataclass
class InflightState:
    """One `.inflight/<attempt>.json` as gc reads it."""

    key: str
    digests: list[str]
    bundle: Optional[str]
    expires: float
    mtime: float

    def live(self, now: float) -> bool:
        return now <= self.expires


def read_inflight(backend: Backend) -> list[InflightState]:
    """Every in-flight record (one that vanishes while being read was removed by its writer)."""
    keys = [k for k in backend.list(INFLIGHT_PREFIX) if k.endswith(".json")]

    def one(key: str) -> Optional[InflightState]:
        try:
            mtime, data = backend.mtime(key), backend.read(key)
        except NotFoundError:
            return None
        try:
            doc = json.loads(data)
            if doc.get("format") != INFLIGHT_FORMAT:
                raise ValueError("unknown format")
            digests = [d for d in doc.get("digests", []) if _is_digest(d)]
            stamp = max(float(doc.get("created", 0)), float(doc.get("updated", 0)))
            return InflightState(key, digests, doc.get("bundle"), stamp + float(doc["ttl_seconds"]), mtime)
        except (ValueError, KeyError, TypeError, AttributeError):
            # unreadable: it names nothing we can protect; it expires by age alone
            return InflightState(key, [], None, mtime + DEFAULT_INFLIGHT_TTL, mtime)

    return [r for r in concurrently(one, keys, backend.max_workers) if r is not None]


def _is_digest(value: Any) -> bool:
    try:
        parse_digest(value)
        return True
    except TrajectoryReplayError:
        return False


def collect_garbage(root: str | os.PathLike, *, grace: str | float = DEFAULT_GRACE, dry_run: bool = False,
                    progress: Optional[Progress] = None, **storage_options: Any) -> GcReport:
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
        self.lease_key = f"{GC_LEASE_PREFIX}{uuid.uuid4().hex}"
        self.walker = Walker(backend)
        self.report = GcReport(shown, dry_run, grace)
        self.inflight_digests: set[str] = set()
        self.live: set[str] = set()
        self.root_bundles: set[str] = set()
        """Bundles already marked from (COMPLETE is immutable, so a complete one needs no second look)."""
        self.ref_memo: dict[str, Optional[str]] = {}
        """Record digest each candidate ref held, read before any delete (a deleted ref still protects)."""
        self.record_kind: dict[str, Optional[BlobRecord]] = {}
        self.sizes: dict[str, int] = {}
        self.candidates: set[str] = set()
        self.active_bundles: set[str] = set()

    # ---- phases -------------------------------------------------------------------------------
    def run(self) -> GcReport:
        listed = self.backend.list("objects/") + self.backend.list("blobs/")       # 1
        inflight = self._read_inflight()                                            # 2
        states = scan_bundles(self.backend)                                         # 3
        roots, abandoned = self._classify(states)
        self._mark(roots)
        self.report.abandoned_bundles = sorted(s.name for s in abandoned)
        self.report.objects_live = sum(1 for k in listed if k in self.live)
        candidates = self._aged([k for k in listed if k not in self.live])        # 4
        markers = self._aged([k for s in abandoned for k in s.marker_keys])
        self._read_candidate_refs(candidates)
        self.candidates = set(candidates) | set(markers)
        self._hold_lease()  # writers that commit from now on wait for this sweep, then re-check
        protected = self._refresh()
        self.report.protected_by_inflight = len(protected & set(candidates))
        expired = self._aged([r.key for r in inflight if not r.live(self.start)])
        layers = [markers, [k for k in candidates if k.startswith("blobs/")],
                  [k for k in candidates if k.startswith("objects/") and self._is_record_key(k)],
                  [k for k in candidates if k.startswith("objects/") and not self._is_record_key(k)]]
        self.progress.phase("gc: deleting" if not self.dry_run else "gc: dry run",
                            objects=sum(map(len, layers)) + len(expired),
                            nbytes=sum(self.sizes.get(k, 0) for layer in layers for k in layer))
        first = True
        try:
            for layer in layers:
                for batch in batched(layer, DELETE_BATCH):
                    if not first:
                        self._hold_lease()
                        self._refresh()
                    first = False
                    self._delete([k for k in batch if k in self.candidates])
            if self.report.removed and not self.dry_run:
                self._refresh(final=True)  # only to detect conflicts with captures that started meanwhile
        finally:
            self._release_lease()
        if expired:  # a writer past its TTL may have refreshed its record meanwhile: look again
            still = {r.key: r for r in read_inflight(self.backend)}
            self._delete([k for k in expired if k in still and not still[k].live(time.time())])
        return self.report

    def _read_inflight(self) -> list[InflightState]:
        records = read_inflight(self.backend)
        live = [r for r in records if r.live(time.time())]
        self.report.active_captures = len(live)
        for r in live:
            self.inflight_digests.update(r.digests)
        self.active_bundles = {r.bundle for r in live if r.bundle}
        return records

    def _classify(self, states: list[BundleState]) -> tuple[list[BundleState], list[BundleState]]:
        roots, abandoned = [], []
        for s in states:
            if s.status == CORRUPT and (s.complete is None and (
                    f"{s.name}/COMPLETE" in s.marker_keys or len(s.rank_markers) < len(s.marker_keys))):
                raise BundleError(f"gc: cannot read the markers of {s.name} ({s.detail}); nothing was deleted "
                                  "(run fsck, or remove the bundle)")
            if s.status in (COMPLETE_STATUS, FINALIZABLE, CORRUPT) or s.name in self.active_bundles \
                    or (s.mtime is not None and s.mtime > self.cutoff):
                roots.append(s)
            else:
                abandoned.append(s)
        return roots, abandoned

    def _mark(self, roots: list[BundleState]) -> None:
        trees = self.walker.trees(roots)
        problems = [p for t in trees.values() for p in t.problems]
        if problems:
            raise BundleError(f"gc: cannot read the whole tree of every bundle ({problems[0]}"
                              f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''}); nothing was "
                              "deleted (run fsck)")
        for tree in trees.values():
            self.live |= tree.keys
        self.root_bundles |= {s.name for s in roots if s.status == COMPLETE_STATUS}

    def _aged(self, keys: list[str]) -> list[str]:
        """The keys whose mtime is older than the grace period; records their sizes."""
        def stat(key: str) -> Optional[tuple[int, float]]:
            try:
                return self.backend.size(key), self.backend.mtime(key)
            except NotFoundError:
                return None

        out = []
        for key, st in zip(keys, concurrently(stat, keys, self.backend.max_workers)):
            if st is None:
                continue
            if st[1] <= self.cutoff:
                self.sizes[key] = st[0]
                out.append(key)
            else:
                self.report.too_young += 1
        return out

    def _read_candidate_refs(self, candidates: list[str]) -> None:
        digests = [digest_from_key(k) for k in candidates if k.startswith("blobs/")]
        self.ref_memo = self.walker.refs(d for d in digests if d)
        candidate_set = set(candidates)
        records = [r for r in self.ref_memo.values() if r and object_key(r) in candidate_set]
        for r, rec in self.walker.records(records).items():
            self.record_kind[r] = rec if isinstance(rec, BlobRecord) else None

    def _is_record_key(self, key: str) -> bool:
        return self.record_kind.get(digest_from_key(key) or "") is not None

    # ---- protection -----------------------------------------------------------------------------
    def _hold_lease(self) -> None:
        """Take (or renew) this run's sweep lease; writers committing meanwhile wait for it."""
        if not self.dry_run:
            self.backend.write(self.lease_key, json.dumps({"expires": time.time() + LEASE_SECONDS}).encode())

    def _release_lease(self) -> None:
        """Move the epoch if anything was deleted (writers then re-check what they listed), drop the lease."""
        if self.dry_run:
            return
        if self.report.removed:
            self.backend.write(GC_EPOCH_KEY, uuid.uuid4().hex.encode())
        self.backend.delete(self.lease_key)

    def _refresh(self, final: bool = False) -> set[str]:
        """Re-read in-flight records and look for new markers; drop what they need from the candidates."""
        self._read_inflight()
        protected = self._expand(self.inflight_digests)
        self._rescan()
        needed = protected | self.live
        self.candidates -= needed
        if final:  # needed, removed by us, and not written again by the capture that needs it
            lost = sorted(needed & set(self.report.removed))
            self.report.conflicts = [k for k, there in zip(lost, concurrently(
                self.backend.exists, lost, self.backend.max_workers)) if not there]
        return protected

    def _expand(self, digests: Iterable[str]) -> set[str]:
        """Keys an in-flight capture relies on: each listed object and ref, and below a listed blob or record
        that is a candidate, its record and chunks."""
        out: set[str] = set()
        for d in digests:
            out |= {object_key(d), blob_ref_key(d)}
            for record_digest in (self.ref_memo.get(d), d):
                if record_digest and object_key(record_digest) in self.candidates:
                    record = self._record(record_digest)
                    if record is not None:
                        out.add(object_key(record_digest))
                        out |= {object_key(c.digest) for c in record.chunks}
        return out

    def _record(self, digest: str) -> Optional[BlobRecord]:
        """The record `objects/<digest>` holds, or None when that object is not a record (probed once)."""
        if digest not in self.record_kind:
            try:
                head = self.backend.read_range(object_key(digest), 0, 40)
            except NotFoundError:
                head = b""
            record = self.walker.records([digest])[digest] if looks_like_record(head) else None
            self.record_kind[digest] = record if isinstance(record, BlobRecord) else None
        return self.record_kind[digest]

    def _rescan(self) -> None:
        """Mark from bundles that completed, landed a rank or gained a capture since the mark phase."""
        names = [n for n in bundle_names(self.backend) if n not in self.root_bundles]
        states = [s for s in concurrently(lambda n: scan_bundle(self.backend, n), names, self.backend.max_workers)
                  if s is not None]
        roots, _abandoned = self._classify(states)
        fresh = [s for s in roots if s.status != CORRUPT]
        if fresh:
            self._mark(fresh)
            for s in fresh:  # markers of a cohort no longer abandoned stay
                self.candidates -= set(s.marker_keys)

    # ---- deleting --------------------------------------------------------------------------------
    def _delete(self, keys: list[str]) -> None:
        if not keys:
            return
        if not self.dry_run:
            concurrently(self.backend.delete, keys, self.backend.max_workers)
        freed = 0
        for key in keys:
            freed += self.sizes.get(key, 0)
            if key.startswith("objects/"):
                self.report.objects_removed += 1
            elif key.startswith("blobs/"):
                self.report.refs_removed += 1
            elif key.startswith(INFLIGHT_PREFIX):
                self.report.inflight_removed += 1
            else:
                self.report.markers_removed += 1
        self.report.bytes_freed += freed
        self.report.removed += keys
        self.progress.advance(len(keys), freed)


__all__ = ["DEFAULT_GRACE", "GcReport", "InflightState", "collect_garbage", "parse_duration", "read_inflight"]
