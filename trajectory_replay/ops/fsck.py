"""`fsck`: verify every object of a store and every bundle's tree; finalize what can be finalized;
optionally repair bad or missing objects from another store.

Every object is read and hashed (it must be its digest's content); every blob ref must hold a
digest of a record of its own blob. Every bundle's tree (`walk.Walker`) must be present. Orphans (keys
no marker and no live in-flight record names) and incomplete bundles are reported but are not
damage: gc removes the first, and the second may be a capture in progress. Rank markers of a
bundle without COMPLETE are checked against their documents (`markers.rank_marker_problems`);
a finalizable bundle (every rank landed, each marker agreeing with its documents and with the
others, COMPLETE missing) is finalized as every reader does (`status.finalize`).

Damage is charged to the key that is wrong, never to a healthy one: a ref naming a verified
record of another blob is a corrupt ref (its record is fine), and a rank marker that
contradicts readable documents is a corrupt marker (a marker whose documents cannot be read is
not: the missing or damaged object is).

With `repair_from`, each missing or corrupt key is fetched from the other store, verified (a
ref only when the record it names there is a record of that blob), and written with
`backend.write` (which replaces a corrupt value atomically). Restoring a record can reveal
chunks the walk could not see before, so repair and walk alternate until nothing changes; the
report is that of the last walk, so a key is reported repaired only when that walk found it
sound, and every key still bad is named with why it was not repaired. Finalizing comes after
repair, so a bundle whose documents were restored is finalized by the same run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from trajectory_replay.backends import Backend, redact_url
from trajectory_replay.bundle.markers import (
    MarkerProblem,
    complete_disagreements,
    rank_marker_problems,
    ranks_brief,
)
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    INCOMPLETE,
    BundleState,
    anchor_problems,
    finalize,
    scan_bundles,
)
from trajectory_replay.errors import BundleError, NoSuchTargetError
from trajectory_replay.ops.progress import Progress
from trajectory_replay.ops.walk import BundleTree, Walker, open_root
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.store import BlobRecord
from trajectory_replay.store.digest import REF, blob_ref_key, digest_from_key, key_kind
from trajectory_replay.store.inventory import Inventory, batched, digest_keys, parse_ref, value_problem
from trajectory_replay.store.liveness import InflightState, read_inflight
from trajectory_replay.units import human_bytes

VERIFY_BATCH = 32
MAX_REPAIR_ROUNDS = 8


@dataclass
class FsckReport(Outcome):
    """What fsck found and did. `healthy` is False while a missing or corrupt object or a damaged bundle remains."""

    root: str
    objects_checked: int = 0
    refs_checked: int = 0
    bytes_checked: int = 0
    bundles: int = 0
    missing: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    """Objects and refs whose bytes are wrong, and rank markers that contradict their documents."""
    orphaned: list[str] = field(default_factory=list)
    orphans_kept_by: list[str] = field(default_factory=list)
    """Bundles whose tree cannot be read whole: while one exists, gc removes no object or ref (one of them might
    be in that tree), so the orphans stay, and keys under a damaged record count among them."""
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    finalizable: list[str] = field(default_factory=list)
    finalized: list[str] = field(default_factory=list)
    damaged_bundles: list[dict[str, str]] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    """Keys rewritten from the other store and found sound by the walk after it."""
    relinked: list[str] = field(default_factory=list)
    """Missing blob refs re-created from the verified record their bundle names."""
    unrepaired: list[str] = field(default_factory=list)
    """Bad keys left as they are although a store to repair from was given; `unrepaired_reasons` says why."""
    unrepaired_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        unfinalized = [n for n in self.finalizable if n not in self.finalized]
        return not (self.missing or self.corrupt or self.damaged_bundles or unfinalized)

    @property
    def status(self) -> Status:
        """pass while healthy, else invalid."""
        return Status.PASS if self.healthy else Status.INVALID

    def failures(self) -> list[str]:
        """Each problem that keeps the store from being healthy, one line."""
        return (
            [f"missing {k}" for k in self.missing]
            + [f"corrupt {k}" for k in self.corrupt]
            + [f"damaged bundle {b.get('name')}: {b.get('detail')}" for b in self.damaged_bundles]
            + [f"not finalized: {n}" for n in self.finalizable if n not in self.finalized]
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "healthy": self.healthy}

    def render_text(self) -> str:
        lines = [
            f"fsck {self.root}: {'healthy' if self.healthy else 'PROBLEMS FOUND'}",
            f"  {self.objects_checked} objects ({human_bytes(self.bytes_checked)}) and {self.refs_checked} "
            f"blob refs verified, {self.bundles} bundles",
        ]
        for label, keys in (
            ("missing", self.missing),
            ("corrupt", self.corrupt),
            ("repaired", self.repaired),
            ("relinked", self.relinked),
        ):
            lines += [f"  {label}: {k}" for k in keys]
        lines += [f"  not repaired: {k} ({self.unrepaired_reasons.get(k, 'no sound copy')})" for k in self.unrepaired]
        if self.orphaned and self.orphans_kept_by:
            lines.append(
                f"  unreferenced: {len(self.orphaned)} keys no readable bundle references; gc keeps them, "
                f"and every other object, while {', '.join(self.orphans_kept_by)} cannot be read whole "
                "(repair it first: the keys under its damaged objects are among them)"
            )
        elif self.orphaned:
            lines.append(f"  orphaned: {len(self.orphaned)} keys no bundle references (gc removes them)")
        lines += [
            f"  incomplete: {b['name']} (missing ranks {ranks_brief(b['missing_ranks'])})" for b in self.incomplete
        ]
        lines += [f"  finalized: {n}" for n in self.finalized]
        lines += [f"  finalizable: {n}" for n in self.finalizable if n not in self.finalized]
        lines += [f"  damaged bundle: {b['name']}: {b['detail']}" for b in self.damaged_bundles]
        return "\n".join(lines)

    def not_repaired(self, key: str, why: str) -> None:
        if key in self.repaired:
            self.repaired.remove(key)
        if key not in self.unrepaired:
            self.unrepaired.append(key)
        self.unrepaired_reasons[key] = why


def check_store(
    root: str | os.PathLike,
    *,
    repair_from: str | None = None,
    repair_options: dict | None = None,
    progress: Progress | None = None,
    **storage_options: Any,
) -> FsckReport:
    """Verify `root`; with `repair_from`, restore bad objects and refs from that store; finalize finalizable bundles."""
    backend = open_root(root, **storage_options)
    inventory = Inventory(backend)
    source = _repair_source(repair_from, repair_options or {}) if repair_from else None
    progress = progress or Progress()
    report = FsckReport(redact_url(os.fspath(root)))
    listed = inventory.object_keys() + inventory.ref_keys()
    inflight = read_inflight(backend)
    progress.phase("fsck: verifying objects", objects=len(listed))
    unsound = _verify_all(inventory, listed, report, progress)
    walk = _walk_and_repair(inventory, source, listed, unsound, report, progress)
    marker_problems = {
        s.name: rank_marker_problems(backend, s.name, s.rank_markers)
        if s.complete is None
        else complete_disagreements(s.name, s.complete, s.rank_markers)
        for s in walk.states
        if s.rank_markers
    }
    _report_keys(report, walk, marker_problems, source)
    _report_orphans(report, listed, walk, inflight)
    _report_bundles(backend, report, walk, marker_problems)
    return report


@dataclass
class _Walk:
    """What the last walk of the bundles' trees found (after repairs, when any were made)."""

    states: list[BundleState]
    trees: dict[str, BundleTree]
    needed: set[str]
    """Every key some tree reaches."""
    missing: set[str]
    corrupt: set[str]
    attempted: set[str]
    """Keys a repair was tried for."""


def _walk_and_repair(
    inventory: Inventory,
    source: Backend | None,
    listed: list[str],
    unsound: set[str],
    report: FsckReport,
    progress: Progress,
) -> _Walk:
    """Walk every bundle's tree; with a `source`, repair what is missing or corrupt from it and walk again, until
    nothing changes (restoring a record can reveal chunks the walk could not see before)."""
    backend = inventory.backend
    present = set(listed)
    attempted: set[str] = set()
    for round_ in range(MAX_REPAIR_ROUNDS + 1):
        states = scan_bundles(backend)
        trees = Walker(backend).trees([s for s in states if s.status != CORRUPT or s.rank_markers])
        needed = set().union(*(t.keys for t in trees.values())) if trees else set()
        missing = (needed - present) | {k for t in trees.values() for k in t.missing}
        relinked = _relink(inventory, trees.values(), missing, report)
        present |= relinked
        missing -= relinked
        corrupt = unsound | {k for t in trees.values() for k in t.corrupt}
        bad = sorted((missing | corrupt) - attempted)
        if source is None or not bad or round_ == MAX_REPAIR_ROUNDS:
            break
        progress.phase("fsck: repairing", objects=len(bad))
        fixed = _repair(inventory, Inventory(source), bad, report, progress)
        attempted |= set(bad)
        present |= fixed
        unsound -= fixed
        if not fixed:
            break
    return _Walk(states, trees, needed, missing, corrupt, attempted)


def _report_keys(
    report: FsckReport, walk: _Walk, marker_problems: dict[str, list[MarkerProblem]], source: Backend | None
) -> None:
    """The missing and corrupt keys (objects, refs, rank markers that contradict their documents), and why each
    one a repair was asked for is still bad."""
    missing, corrupt = walk.missing, walk.corrupt
    bad_markers = sorted(p.key for problems in marker_problems.values() for p in problems if p.corrupt)
    report.missing = sorted(missing)
    report.corrupt = sorted(corrupt | set(bad_markers))
    if source is None:
        return
    for key in sorted((missing | corrupt) & set(report.repaired)):
        report.not_repaired(key, f"copied from {redact_url(source.url)}, still {_state(key, missing)} after it")
    for key in sorted((missing | corrupt) - walk.attempted):
        report.not_repaired(key, f"repair stopped after {MAX_REPAIR_ROUNDS} rounds")
    complete = {s.name for s in walk.states if s.complete is not None}
    for key in bad_markers:
        report.not_repaired(
            key,
            "a rank marker is not restored from another store"
            + ("" if key.rpartition("/")[0] in complete else "; the bundle is not finalized"),
        )


def _report_orphans(report: FsckReport, listed: list[str], walk: _Walk, inflight: list[InflightState]) -> None:
    """The keys no bundle and no live in-flight record names, and the bundles that make gc keep them all."""
    live_digests = {d for r in inflight if r.live(time.time()) for d in r.digests}
    in_flight = {k for d in live_digests for k in digest_keys(d)}
    report.orphaned = sorted(k for k in listed if k not in walk.needed and k not in in_flight)
    # gc walks the same trees: one it cannot read whole makes it keep every object and ref (ops/gc.py)
    walked = {s.name for s in walk.states if s.status != INCOMPLETE}
    report.orphans_kept_by = sorted(name for name, tree in walk.trees.items() if tree.problems and name in walked)


def _report_bundles(
    backend: Backend, report: FsckReport, walk: _Walk, marker_problems: dict[str, list[MarkerProblem]]
) -> None:
    """Finalize the finalizable bundles; name each damaged or incomplete one."""
    report.bundles = len(walk.states)
    anchors = anchor_problems(backend, walk.states)
    for s in walk.states:
        finalize_error = _finalize(backend, s, report)
        damage = _damage(s, walk.trees.get(s.name), marker_problems.get(s.name, []), finalize_error)
        detail = "; ".join(filter(None, [anchors.get(s.name), damage]))
        if detail:
            report.damaged_bundles.append({"name": s.name, "detail": detail})
        elif s.status == INCOMPLETE:
            report.incomplete.append(
                {"name": s.name, "missing_ranks": s.missing_ranks, "expected_ranks": s.expected_ranks}
            )


def _repair_source(url: str, options: dict) -> Backend:
    """The store to repair from; NoSuchTargetError, before anything is checked, when nothing is stored there
    (every key would otherwise be reported "absent" from it, as though the copy lacked just those)."""
    try:
        return open_root(url, **options)
    except NoSuchTargetError as exc:
        raise NoSuchTargetError(f"--repair-from {exc}") from None


def _state(key: str, missing: set[str]) -> str:
    return "missing" if key in missing else "corrupt"


def _damage(
    state: BundleState, tree: BundleTree | None, markers: list[MarkerProblem], finalize_error: str | None
) -> str:
    """What is wrong with a bundle, in one line ('' when nothing is)."""
    parts = []
    if state.status == CORRUPT:
        parts.append(state.detail)
    parts += [str(p) for p in markers if p.corrupt and str(p) not in state.detail]
    if state.status != CORRUPT and tree is not None:
        parts += [p.removeprefix(f"{state.name}: ") for p in tree.problems]
    if finalize_error:
        parts.append(finalize_error)
    return "; ".join(parts)


def _relink(inventory: Inventory, trees, missing: set[str], report: FsckReport) -> set[str]:
    """Re-create missing blob refs whose record the tree names and holds verified (the ref's content is
    exactly that record digest; gc racing a writer that reused the blob can leave such a gap)."""
    done = set()
    for tree in trees:
        for node in [*tree.documents, *(n for _, _, n in tree.payloads)]:
            key = blob_ref_key(node.digest)
            if (
                key in missing
                and key not in done
                and node.chunks
                and not node.problems
                and not (node.keys & missing - {key})
            ):
                inventory.link(node.digest, node.record)
                report.relinked.append(key)
                done.add(key)
    return done


def _finalize(backend: Backend, state: BundleState, report: FsckReport) -> str | None:
    """Finalize a finalizable bundle (`status.finalize` checks its markers again); why it failed, if it did."""
    if state.status != FINALIZABLE:
        return None
    report.finalizable.append(state.name)
    try:
        if finalize(backend, state, raising=True).status == COMPLETE_STATUS:
            report.finalized.append(state.name)
    except BundleError as exc:
        return str(exc)
    return None


def _verify_all(inventory: Inventory, keys: list[str], report: FsckReport, progress: Progress) -> set[str]:
    """Read and check every key; returns the corrupt ones (a key removed since the listing, by gc, is left to
    the tree walk to judge)."""
    corrupt: set[str] = set()
    for batch in batched(keys, VERIFY_BATCH):
        checked = inventory.verify(batch)
        for c in checked:
            if c.kind == REF:
                report.refs_checked += 1
            else:
                report.objects_checked += 1
                report.bytes_checked += c.size
            if not c.sound:
                corrupt.add(c.key)
        progress.advance(len(batch), sum(c.size for c in checked))
    return corrupt


def _repair(
    inventory: Inventory, source: Inventory, keys: list[str], report: FsckReport, progress: Progress
) -> set[str]:
    """Copy verified values of `keys` from `source`; returns the keys restored."""
    fixed: set[str] = set()
    values = source.read(keys)
    where = redact_url(source.backend.url)
    refs = {key: parse_ref(values[key]) for key in keys if key_kind(key) == REF and values[key] is not None}
    records = source.records(r for r in refs.values() if r is not None)
    for key in keys:
        data = values[key]
        if data is None:
            report.not_repaired(key, f"absent from {where}")
            continue
        if key_kind(key) != REF:
            why = None if value_problem(key, data) is None else f"the copy at {where} does not match its digest either"
        else:
            why = _ref_problem(key, refs[key], records, where)
        if why is not None:
            report.not_repaired(key, why)
            continue
        inventory.replace(key, data)
        report.repaired.append(key)
        fixed.add(key)
        progress.advance(1, len(data))
    return fixed


def _ref_problem(
    key: str, record_digest: str | None, records: Mapping[str, BlobRecord | Exception | None], where: str
) -> str | None:
    """Why the other store's ref `key` (naming `record_digest`) is no repair; None when it names, there, a sound
    record of the ref's own blob."""
    if record_digest is None:
        return f"the copy at {where} does not hold a digest either"
    record = records.get(record_digest)
    if record is None:
        return f"the copy at {where} names record {record_digest}, which is absent there"
    if not isinstance(record, BlobRecord):
        return f"the copy at {where} names record {record_digest}, which is damaged there ({record})"
    if record.digest != digest_from_key(key):
        return f"the copy at {where} names record {record_digest} of another blob ({record.digest}) too"
    return None


__all__ = ["FsckReport", "check_store"]
