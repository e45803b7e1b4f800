"""`fsck`: verify every object of a store and every bundle's tree; finalize what can be finalized;
optionally repair bad or missing objects from another store.

Every object is read and hashed (its key names its digest); every blob ref must hold a digest.
Every bundle's tree (`walk.Walker`) must be present. Orphans (keys no marker and no live
in-flight record names) and incomplete bundles are reported but are not damage: gc removes
the first, and the second may be a capture in progress. A finalizable bundle (every rank
landed and agreeing, COMPLETE missing) is finalized with `markers.try_finalize`.

With `repair_from`, each missing or corrupt key is fetched from the other store, verified,
and written with `backend.write` (which replaces a corrupt value atomically). Restoring a
record can reveal chunks the walk could not see before, so repair runs until nothing changes.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from trajectory_replay.backends import Backend, open_backend, redact_url
from trajectory_replay.bundle.markers import try_finalize
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.gc import read_inflight
from trajectory_replay.ops.progress import Progress
from trajectory_replay.ops.walk import (
    CORRUPT, FINALIZABLE, INCOMPLETE, Walker, batched, digest_matches, fetch, open_root,
    parse_ref, scan_bundles,
)
from trajectory_replay.store.digest import blob_ref_key, digest_from_key, object_key

VERIFY_BATCH = 32
MAX_REPAIR_ROUNDS = 8


@dataclass
class FsckReport:
    """What fsck found and did. `healthy` is False while a missing or corrupt object or a damaged bundle remains."""

    root: str
    objects_checked: int = 0
    refs_checked: int = 0
    bytes_checked: int = 0
    bundles: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    finalizable: list[str] = field(default_factory=list)
    finalized: list[str] = field(default_factory=list)
    damaged_bundles: list[dict[str, str]] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    relinked: list[str] = field(default_factory=list)
    """Missing blob refs re-created from the verified record their bundle names."""
    unrepaired: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        unfinalized = [n for n in self.finalizable if n not in self.finalized]
        return not (self.missing or self.corrupt or self.damaged_bundles or unfinalized)

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "healthy": self.healthy}

    def render_text(self) -> str:
        lines = [f"fsck {self.root}: {'healthy' if self.healthy else 'PROBLEMS FOUND'}",
                 f"  {self.objects_checked} objects ({self.bytes_checked} bytes) and {self.refs_checked} blob refs "
                 f"verified, {self.bundles} bundles"]
        for label, keys in (("missing", self.missing), ("corrupt", self.corrupt), ("repaired", self.repaired), ("relinked", self.relinked),
                            ("not repaired", self.unrepaired)):
            lines += [f"  {label}: {k}" for k in keys]
        if self.orphaned:
            lines.append(f"  orphaned: {len(self.orphaned)} keys no bundle references (gc removes them)")
        lines += [f"  incomplete: {b['name']} (missing ranks {b['missing_ranks']})" for b in self.incomplete]
        lines += [f"  finalized: {n}" for n in self.finalized]
        lines += [f"  finalizable: {n}" for n in self.finalizable if n not in self.finalized]
        lines += [f"  damaged bundle: {b['name']}: {b['detail']}" for b in self.damaged_bundles]
        return "\n".join(lines)


def check_store(root: str | os.PathLike, *, repair_from: Optional[str] = None,
                repair_options: Optional[dict] = None, progress: Optional[Progress] = None,
                **storage_options: Any) -> FsckReport:
    """Verify `root`; finalize finalizable bundles; with `repair_from`, restore bad objects from that store."""
    backend = open_root(root, **storage_options)
    source = open_backend(repair_from, **(repair_options or {})) if repair_from else None
    progress = progress or Progress()
    report = FsckReport(redact_url(os.fspath(root)))
    listed = backend.list("objects/") + backend.list("blobs/")
    inflight = read_inflight(backend)
    _finalize(backend, report)
    progress.phase("fsck: verifying objects", objects=len(listed))
    corrupt = _verify_all(backend, listed, report, progress)
    present = set(listed)
    for _round in range(MAX_REPAIR_ROUNDS):
        states = scan_bundles(backend)
        trees = Walker(backend).trees([s for s in states if s.status != CORRUPT or s.rank_markers])
        needed = set().union(*(t.keys for t in trees.values())) if trees else set()
        missing = (needed - present) | {k for t in trees.values() for k in t.missing}
        relinked = _relink(backend, trees.values(), missing, report)
        present |= relinked
        missing -= relinked
        corrupt |= {k for t in trees.values() for k in t.corrupt}
        bad = sorted((missing | corrupt) - set(report.repaired) - set(report.unrepaired))
        if source is None or not bad:
            break
        progress.phase("fsck: repairing", objects=len(bad))
        fixed = _repair(backend, source, bad, report, progress)
        present |= fixed
        corrupt -= fixed
        missing -= fixed
        if not fixed:
            break
    report.missing = sorted(missing - set(report.repaired))
    report.corrupt = sorted(corrupt - set(report.repaired))
    report.bundles = len(states)
    live_digests = {d for r in inflight if r.live(time.time()) for d in r.digests}
    in_flight = {object_key(d) for d in live_digests} | {blob_ref_key(d) for d in live_digests}
    report.orphaned = sorted(k for k in listed if k not in needed and k not in in_flight)
    for s in states:
        tree = trees.get(s.name)
        if s.status == CORRUPT:
            report.damaged_bundles.append({"name": s.name, "detail": s.detail})
        elif tree is not None and tree.problems:
            detail = "; ".join(p.removeprefix(f"{s.name}: ") for p in tree.problems)
            report.damaged_bundles.append({"name": s.name, "detail": detail})
        elif s.status == INCOMPLETE:
            report.incomplete.append({"name": s.name, "missing_ranks": s.missing_ranks,
                                      "expected_ranks": s.expected_ranks})
    return report


def _relink(backend: Backend, trees, missing: set[str], report: FsckReport) -> set[str]:
    """Re-create missing blob refs whose record the tree names and holds verified (the ref's content is
    exactly that record digest; gc racing a writer that reused the blob can leave such a gap)."""
    done = set()
    for tree in trees:
        for node in [*tree.documents, *(n for _, _, n in tree.payloads)]:
            key = blob_ref_key(node.digest)
            if key in missing and key not in done and node.chunks and not node.problems \
                    and not (node.keys & missing - {key}):
                backend.create_if_absent(key, node.record.encode())
                report.relinked.append(key)
                done.add(key)
    return done


def _finalize(backend: Backend, report: FsckReport) -> None:
    for state in scan_bundles(backend):
        if state.status != FINALIZABLE:
            continue
        report.finalizable.append(state.name)
        try:
            if try_finalize(backend, state.name, state.expected_ranks) is not None:
                report.finalized.append(state.name)
        except BundleError as exc:
            report.damaged_bundles.append({"name": state.name, "detail": str(exc)})


def _verify_all(backend: Backend, keys: list[str], report: FsckReport, progress: Progress) -> set[str]:
    """Read and check every key; returns the corrupt ones."""
    corrupt: set[str] = set()
    for batch in batched(keys, VERIFY_BATCH):
        values = fetch(backend, batch)
        nbytes = 0
        for key, data in values.items():
            if data is None:  # removed since the listing (gc): the tree walk decides whether it matters
                continue
            nbytes += len(data)
            if key.startswith("blobs/"):
                report.refs_checked += 1
                if digest_from_key(key) is None or parse_ref(data) is None:
                    corrupt.add(key)
            else:
                report.objects_checked += 1
                report.bytes_checked += len(data)
                if digest_from_key(key) is None or not digest_matches(key, data):
                    corrupt.add(key)
        progress.advance(len(batch), nbytes)
    return corrupt


def _repair(backend: Backend, source: Backend, keys: list[str], report: FsckReport, progress: Progress) -> set[str]:
    """Copy verified values of `keys` from `source`; returns the keys restored."""
    fixed: set[str] = set()
    values = fetch(source, keys)
    for key in keys:
        data = values[key]
        ok = data is not None and (digest_matches(key, data) if key.startswith("objects/")
                                   else parse_ref(data) is not None)
        if not ok:
            report.unrepaired.append(key)
            continue
        backend.write(key, data)
        report.repaired.append(key)
        fixed.add(key)
        progress.advance(1, len(data))
    return fixed


__all__ = ["FsckReport", "check_store"]
