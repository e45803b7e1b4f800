"""What state a bundle is in: the states of both formats (`BundleStatus`), a native bundle's decided in one place
from its markers, and finalizing, which every reader does through here. Every command that shows, picks, copies,
keeps or repairs bundles (inspect, ls, replay's resolution, cp, gc, fsck, stats) asks here; the older format's
reader (`legacy.v1_status`) states its bundles in the same terms.

    complete     COMPLETE exists and reads
    incomplete   some expected rank has not landed (or a writer has not committed yet)
    finalizable  every expected rank landed, the markers agree with each other and with their documents,
                 and COMPLETE is missing: any reader of a native bundle writes it (`finalize`), none of an
                 older-format one
    corrupt      a marker cannot be read, or the landed markers cannot be finalized (named in `detail`)
    unsupported  an older-format bundle of the older tool's format 2

A bundle directory without any marker has no state (`bundle_status` returns None): `describe_missing`
tells a writer still at work (or one that died before its marker) from a directory that is no bundle.
A FINALIZER claim is no marker: it says which producer took on finalizing, never what state a bundle is
in, so a directory holding only a claim (its rank markers removed) has no state either.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from trajectory_replay.backends import Backend, redact_url
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.markers import (
    COMPLETE,
    FINALIZER,
    RANK_MARKER,
    CompleteMarker,
    Documents,
    RankMarker,
    anchor_problem,
    check_agreement,
    complete_key,
    finalizer_key,
    rank_key,
    rank_marker_problems,
    ranks_brief,
    read_marker,
    try_finalize,
)
from trajectory_replay.bundle.paths import is_v1_bundle
from trajectory_replay.errors import (
    BackendError,
    BundleError,
    NoSuchTargetError,
    NotFoundError,
    StorageUnavailableError,
    TrajectoryReplayError,
    UsageError,
)
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.inventory import concurrently
from trajectory_replay.store.layout import is_bundle_dir
from trajectory_replay.store.liveness import read_inflight
from trajectory_replay.words import Word


class BundleStatus(Word):
    """The state of a bundle of either format (see the module docstring); a string, its value, the word every
    report shows."""

    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    FINALIZABLE = "finalizable"
    CORRUPT = "corrupt"
    UNSUPPORTED = "unsupported"


COMPLETE_STATUS = BundleStatus.COMPLETE
"""`BundleStatus.COMPLETE` (COMPLETE is the marker's file name); the others by their member names:"""
INCOMPLETE, FINALIZABLE = BundleStatus.INCOMPLETE, BundleStatus.FINALIZABLE
CORRUPT, UNSUPPORTED = BundleStatus.CORRUPT, BundleStatus.UNSUPPORTED


@dataclass
class BundleState:
    """One bundle directory of a root: its markers and what they say."""

    name: str
    status: BundleStatus
    """complete | incomplete (ranks missing) | finalizable (all ranks landed, COMPLETE missing) | corrupt"""
    complete: CompleteMarker | None = None
    rank_markers: dict[int, RankMarker] = field(default_factory=dict)
    expected_ranks: list[int] = field(default_factory=list)
    """Sorted; empty when a marker could not be read."""
    missing_ranks: list[int] = field(default_factory=list)
    marker_keys: list[str] = field(default_factory=list)
    finalizer_key: str | None = None
    """The FINALIZER claim's key when the directory holds one (never among `marker_keys`: it is copied by no
    one and names no document; gc removes it with an abandoned cohort's markers)."""
    mtime: float | None = None
    """Modification time of COMPLETE, else of the newest rank marker or FINALIZER claim."""
    detail: str = ""

    @property
    def anchor(self) -> Anchor | None:
        """The anchor its markers record (None when none could be read)."""
        if self.complete is not None:
            return self.complete.anchor
        if self.rank_markers:
            return next(iter(self.rank_markers.values())).anchor
        return None

    @property
    def multi_rank(self) -> bool:
        return self.complete.multi_rank if self.complete is not None else bool(self.rank_markers)

    @property
    def landed_ranks(self) -> list[int]:
        return sorted(self.rank_markers)

    @property
    def markers_unreadable(self) -> bool:
        """True when a marker itself could not be read (`detail` names it), as opposed to markers that read but
        cannot be finalized."""
        return self.status == CORRUPT and not self.expected_ranks

    def documents(self) -> list[tuple[int | None, Documents]]:
        """(rank, documents) of every shard the markers pin: COMPLETE's shards, else the landed ranks'."""
        if self.complete is not None:
            if not self.complete.multi_rank:
                return [(None, self.complete.documents())]
            return [(int(r), d) for r, d in sorted(self.complete.shards.items(), key=lambda kv: int(kv[0]))]
        return [(r, m.documents) for r, m in sorted(self.rank_markers.items())]


def bundle_names(backend: Backend) -> list[str]:
    """Children of the root that may be bundles (`layout.is_bundle_dir`; on a local disk not the directories of the
    older format, whose COMPLETE is not a native marker: `ls` lists those itself)."""
    names = [n for n in backend.list_dir() if is_bundle_dir(n)]
    root = getattr(backend, "root", None)
    if not isinstance(root, os.PathLike):
        return names
    return [n for n in names if not is_v1_bundle(os.path.join(root, n))]


def bundle_status(backend: Backend, name: str, *, retry: bool = True) -> BundleState | None:
    """The state of bundle `name` from its markers; None when its directory holds no marker."""
    names = backend.list_dir(name)
    marker_names = [n for n in names if n == COMPLETE or RANK_MARKER.fullmatch(n)]
    if not marker_names:
        return None
    state = BundleState(
        name,
        INCOMPLETE,
        marker_keys=[f"{name}/{n}" for n in sorted(marker_names)],
        finalizer_key=finalizer_key(name) if FINALIZER in names else None,
    )
    try:
        mtimes = [backend.mtime(k) for k in state.marker_keys]
        if COMPLETE in marker_names:
            state.mtime = backend.mtime(complete_key(name))
            state.complete = read_marker(backend, complete_key(name), CompleteMarker)
        else:  # the claim's age counts: gc removes a cohort's markers and its claim together, or none of them
            state.mtime = max(mtimes + ([backend.mtime(state.finalizer_key)] if state.finalizer_key else []))
        for n in marker_names:
            match = RANK_MARKER.fullmatch(n)
            if match:
                marker = read_marker(backend, rank_key(name, int(match.group(1))), RankMarker)
                if marker is not None:
                    state.rank_markers[int(match.group(1))] = marker
    except NotFoundError:  # a marker removed while we looked (gc of an abandoned cohort): look again
        return bundle_status(backend, name, retry=False) if retry else None
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
        state.detail = f"missing ranks {ranks_brief(state.missing_ranks)} of {ranks_brief(state.expected_ranks)}"
    else:
        state.status, state.detail = FINALIZABLE, "every rank landed; COMPLETE is missing"
    return state


def scan_bundles(backend: Backend, names: Iterable[str] | None = None) -> list[BundleState]:
    """Every bundle of the root (or of `names`), markers read concurrently, sorted by name."""
    names = bundle_names(backend) if names is None else list(names)
    states = concurrently(lambda n: bundle_status(backend, n), names, backend.max_workers)
    return sorted((s for s in states if s is not None), key=lambda s: s.name)


def anchor_problems(backend: Backend, states: Iterable[BundleState]) -> dict[str, str]:
    """Bundle name -> why, for each complete bundle whose COMPLETE records an anchor other than its index's
    identity (`markers.anchor_problem`: the first bytes of each index, read verified, concurrently)."""
    store = ObjectStore(backend)
    complete = [(s.name, s.complete) for s in states if s.complete is not None]
    found = concurrently(lambda item: anchor_problem(store, *item), complete, backend.max_workers)
    return {name: why for (name, _), why in zip(complete, found) if why is not None}


def finalize(backend: Backend, state: BundleState, *, raising: bool = False) -> BundleState:
    """A finalizable bundle after writing its final COMPLETE, as every reader does (docs/format.md): complete;
    still finalizable, `detail` saying why, where this store or user cannot write markers; corrupt when its
    markers turn out not to be finalizable. Any other state is returned as it is.

    With `raising` (a reader that cannot go on without COMPLETE: opening a bundle, fsck), what keeps the bundle
    from being finalized is raised instead: BackendError where this store or user cannot write markers, and
    `markers.try_finalize`'s BundleError naming the bad marker where every rank landed but the markers cannot be
    finalized (a corrupt state is then tried too, for that error)."""
    landed = state.status == FINALIZABLE or (
        raising and state.status == CORRUPT and bool(state.expected_ranks) and not state.missing_ranks
    )
    if not landed:
        return state
    try:
        try_finalize(backend, state.name, state.expected_ranks)
    except StorageUnavailableError:
        raise
    except (BackendError, OSError) as exc:  # this store or this user cannot write markers: say so
        if raising:
            raise
        state.detail = f"every rank landed; not finalized here: {exc}"
        return state
    except TrajectoryReplayError as exc:
        if raising:
            raise
        state.status, state.detail = CORRUPT, str(exc)
        return state
    again = bundle_status(backend, state.name)
    return again if again is not None and again.status == COMPLETE_STATUS else state


def finalize_landed(backend: Backend, states: list[BundleState]) -> tuple[list[BundleState], list[str]]:
    """`finalize` each of `states`, as a reader of a whole root does (ls, stats, scan, replay's resolution): (the
    states after that, the names finalized now)."""
    landed = [s.name for s in states if s.status == FINALIZABLE]
    after = [finalize(backend, s) for s in states]
    return after, [s.name for s in after if s.name in landed and s.status == COMPLETE_STATUS]


def describe_missing(backend: Backend, name: str, state: BundleState | None) -> str:
    """Why bundle `name` (whose state is `state`) has no final COMPLETE: which ranks landed and which are missing,
    or that a writer has not committed. NoSuchTargetError when the directory is no bundle at all; BundleError when
    a marker cannot be read."""
    if state is None:
        pending = [r for r in read_inflight(backend) if r.bundle == name]
        if pending:
            return (
                f"incomplete bundle: COMPLETE is missing (documents written by {len(pending)} writer "
                "attempt(s) that did not commit: in progress, or crashed)"
            )
        if backend.list(f"{name}/"):
            # a bundle directory holds only its markers, and a writer records its attempt before writing
            raise NoSuchTargetError(
                f"{redact_url(backend.url)}/{name}: not a bundle (no COMPLETE, no rank marker, no writer in progress)"
            )
        raise NoSuchTargetError(f"{redact_url(backend.url)}/{name}: no such bundle")
    if state.markers_unreadable:
        raise BundleError(state.detail)
    return (
        f"incomplete bundle: ranks {ranks_brief(state.landed_ranks)} landed, missing ranks "
        f"{ranks_brief(state.missing_ranks)} of {ranks_brief(state.expected_ranks)}"
    )


__all__ = [
    "BundleState",
    "BundleStatus",
    "COMPLETE_STATUS",
    "CORRUPT",
    "FINALIZABLE",
    "INCOMPLETE",
    "UNSUPPORTED",
    "anchor_problems",
    "bundle_names",
    "bundle_status",
    "describe_missing",
    "finalize",
    "finalize_landed",
    "scan_bundles",
]
