"""Addresses: what a user points at, turned into the bundle it designates, of either format.

An address is a native bundle of a store (`<root>/<bundle>`), one rank of one (`<root>/<bundle>/rank-<r>`), an
older-format (V1) bundle directory or a rank directory of one, or a place that holds bundles: a store root
(its children, never the store's own directories or dot-names), an older-format capture directory
(`replay-<R>-<S>`, `replay-rollout-<R>`, or any other name: what counts is the identity inside), or a local
directory with both. An older-format bundle is never read as a native one.

`open_bundle` is the one way from an address to a `Bundle`; replay, inspect, validate, import and cp all go
through it, and `Bundle.readers()` opens it. `Selection` is the one place `--step R:S` / `--critic R:S` /
`--rollout R` are matched against bundles (an anchor matches exactly: see `bundle.anchor`): a bundle must be
chosen (replay, inspect, validate, import: `one`) or a set of them copied (cp: `several`). No match, or several
where one is needed, is a SelectionError that lists what is there.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajectory_replay.backends import open_backend, redact_url
from trajectory_replay.bundle.anchor import FILTER_FLAGS, Anchor
from trajectory_replay.bundle.markers import COMPLETE, RANK_MARKER
from trajectory_replay.bundle.paths import find_v1_bundles, is_v1_bundle, split_bundle_path
from trajectory_replay.bundle.reader import BundleReader, native_readers
from trajectory_replay.bundle.status import (
    CORRUPT,
    FINALIZABLE,
    BundleState,
    bundle_status,
    finalize_landed,
    scan_bundles,
)
from trajectory_replay.errors import BundleError, NoMatchingBundleError, SelectionError, TrajectoryReplayError
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.liveness import read_inflight

NATIVE, V1 = "native", "v1"
"""The two formats a bundle may be in."""
_RANK_SUFFIX = re.compile(r"/rank-\d+/?$")
MAX_LISTED = 10
"""Bundles an error message names: enough to see what is there, bounded for a store of thousands."""


@dataclass(frozen=True)
class Bundle:
    """One bundle an address designates, not read yet: a native bundle of `store` (`rank` when the address names
    one rank of it) or an older-format directory at `path`."""

    target: str
    """The bundle's own path or URL (for a store root or capture directory, the bundle chosen in it)."""
    format: str
    name: str
    rank: int | None = None
    store: ObjectStore | None = None
    path: Path | None = None

    def readers(self) -> list:
        """One source per rank (BundleReader or LegacyBundle), verified as far as opening goes; a bundle that is
        not complete is refused (IncompleteBundleError saying what is missing)."""
        if self.format == V1:
            from trajectory_replay.bundle import legacy  # only an older-format bundle loads its reader

            assert self.path is not None  # an older-format bundle is a directory
            return legacy.open_v1(self.path)
        assert self.store is not None  # a native bundle is in a store
        return native_readers(self.store, self.name, self.rank)


def open_bundle(
    address: str | os.PathLike,
    *,
    step: str | None = None,
    rollout: int | None = None,
    choose: bool = True,
    critic: str | None = None,
    **storage_options: Any,
) -> Bundle:
    """The bundle `address` designates under `--step`/`--critic`/`--rollout` (SelectionError when none or several
    do).

    Without a filter, an address that is a bundle designates itself (whatever state it is in: opening it
    says what is missing). An address that holds bundles designates its only one when `choose` (replay);
    otherwise it is taken for a bundle itself, which `inspect` and `validate` describe ("not a bundle"),
    unless it is a local directory of older-format bundles, whose one bundle it designates.
    `storage_options` open the store (e.g. `trust_cache=False`)."""
    text = os.fspath(address)
    want = Anchor.requested(step, rollout, critic)
    local = _local_path(text)
    if want is None and not choose and not _holds_older_bundles(text, local, storage_options):
        return _bundle_at(text, local, storage_options)
    return _designated(text, local, want, storage_options)


def open_sources(path_or_url: str | os.PathLike, **storage_options: Any) -> list:
    """Replay sources (one per rank) of the bundle at `path_or_url`: native, a rank of one, or an older-format
    directory (see `open_bundle` with `choose=False`)."""
    return open_bundle(path_or_url, choose=False, **storage_options).readers()


def open_for_replay(
    path_or_url: str | os.PathLike,
    *,
    step: str | None = None,
    rollout: int | None = None,
    critic: str | None = None,
    **storage_options: Any,
) -> tuple[list, int | None]:
    """(sources, rank) to replay what `path_or_url` designates (see `open_bundle`). A rank of a native
    multi-rank bundle (`<bundle>/rank-<r>`) comes with its peer ranks and `rank = r`: a prompt group split across
    ranks is normalized over all of its members, so the group-level stages need the peers' rows of the rank's
    groups."""
    sources = open_bundle(path_or_url, step=step, rollout=rollout, critic=critic, **storage_options).readers()
    if len(sources) == 1 and isinstance(sources[0], BundleReader) and sources[0].rank is not None:
        return [sources[0], *sources[0].peers()], sources[0].rank
    return sources, None


def older_bundles(address: str | os.PathLike) -> list[Path]:
    """The older-format bundles a local address is (one) or holds as children; none for a remote address or a
    path that is no directory (older-format bundles live on a local disk only)."""
    local = _local_path(os.fspath(address))
    if local is None or not local.is_dir():
        return []
    return [local] if is_v1_bundle(local) else find_v1_bundles(local)


def is_native_bundle(path_or_url: str | os.PathLike, **storage_options: Any) -> bool:
    """True when `path_or_url` is a bundle directory of a store (it holds COMPLETE or a rank marker)."""
    return _native_bundle(os.fspath(path_or_url), storage_options) is not None


# ---- the one place --step / --critic / --rollout are matched ------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A bundle found at an address: where it is, its anchor (None when its markers cannot be read), and for one
    that cannot be chosen, why (`detail`)."""

    name: str
    url: str
    anchor: Anchor | None
    format: str = NATIVE
    detail: str = ""
    state: BundleState | None = field(default=None, compare=False)
    """A native bundle's state, as its markers say."""

    @classmethod
    def of(cls, state: BundleState, url: str) -> Candidate:
        return cls(state.name, url, state.anchor, detail=state.detail, state=state)

    def __str__(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else f"{self.name} ({self.anchor})"


@dataclass
class Selection:
    """The bundles found at an address (`found`, which may be chosen; `unreadable`, which cannot be, each with
    why) and the anchor `--step` / `--critic` / `--rollout` ask for (`want`; None without a filter)."""

    shown: str
    """The address as messages show it (credentials redacted)."""
    want: Anchor | None
    found: list[Candidate]
    unreadable: list[Candidate] = field(default_factory=list)
    direct: bool = False
    """The address named one bundle, rather than a place holding bundles."""

    def matches(self, candidate: Candidate) -> bool:
        """True when the filter designates `candidate`: no filter, or exactly its anchor."""
        return self.want is None or candidate.anchor == self.want

    @property
    def chosen(self) -> list[Candidate]:
        return [c for c in self.found if self.matches(c)]

    @property
    def what(self) -> str:
        return self.want.flag if self.want is not None else ""

    def one(self) -> Candidate:
        """The one bundle designated. Unreadable bundles are named in every error; without a filter one of them
        may be the bundle meant, so nothing is picked for the user; with one, each is skipped with a warning."""
        matches, what = self.chosen, self.what
        bad = f"; unreadable: {'; '.join(map(str, self.unreadable))}" if self.unreadable else ""
        if not matches:
            if not self.found:
                raise NoMatchingBundleError(f"{self.shown}: no complete bundle found{bad}")
            if self.direct:
                raise SelectionError(f"{self.shown}: bundle is {self.found[0].anchor}, which does not match {what}")
            raise NoMatchingBundleError(f"{self.shown}: no bundle matches {what} (found: {listing(self.found)}){bad}")
        if len(matches) > 1 or (not what and self.unreadable):
            hint = "" if what else f"; choose one with {FILTER_FLAGS}"
            if len({c.anchor for c in matches}) < len(matches):  # no flag tells these apart: only a path does
                hint = (
                    f"; {'they' if what else 'some'} share an anchor, which --step/--critic/--rollout cannot tell "
                    f"apart: give one bundle's path instead, e.g. {redact_url(matches[0].url)}"
                )
            count = len(matches) + (0 if what else len(self.unreadable))
            raise SelectionError(
                f"{self.shown}: {count} bundles match{' ' + what if what else ''}: {listing(matches)}{bad}{hint}"
            )
        for entry in self.unreadable:
            warnings.warn(f"{self.shown}: skipped unreadable bundle {entry}", stacklevel=3)
        return matches[0]

    def several(self, all_bundles: bool) -> tuple[list[Candidate], list[Candidate]]:
        """(the bundles designated, the unreadable ones the request covers) for a command that takes several
        (cp): every match of a filter, every bundle with `all_bundles`, else the one there is. An unreadable bundle
        is covered by --all, by a filter its anchor matches, and it counts, unnamed, where its anchor is unknown."""
        chosen, what = self.chosen, self.what
        covered = [c for c in self.unreadable if c.anchor is None or self.matches(c)]
        skipped = covered if all_bundles else [c for c in covered if what and c.anchor is not None]
        found = listing(self.found) or "none"
        bad = "".join(f"; corrupt: {c}" for c in covered)
        if not chosen:
            raise SelectionError(
                f"{self.shown}: no complete bundle{' matches ' + what if what else ''} (found: {found}){bad}"
            )
        if not self.direct and not what and not all_bundles and len(chosen) + len(covered) > 1:
            raise SelectionError(
                f"{self.shown}: {len(chosen) + len(covered)} bundles ({found}){bad}; choose with "
                f"{FILTER_FLAGS.replace(' or ', ', ')} or --all"
            )
        return chosen, skipped


def listing(candidates: Sequence[Candidate]) -> str:
    """`name (anchor), ...`, at most MAX_LISTED of them and a count of the rest."""
    shown = ", ".join(f"{c.name} ({c.anchor})" for c in candidates[:MAX_LISTED])
    more = len(candidates) - MAX_LISTED
    return shown + (f", ... ({more} more)" if more > 0 else "")


# ---- from an address to a bundle ------------------------------------------------------------------


def _local_path(text: str) -> Path | None:
    """The local path an address names (None for a URL of a remote store)."""
    if "://" in text and not text.startswith("file://"):
        return None
    return Path(text.removeprefix("file://")).expanduser()


def _is_older(local: Path) -> bool:
    """True for an older-format bundle directory, or a rank directory of one."""
    return is_v1_bundle(local) or (local.name.startswith("rank-") and is_v1_bundle(local.parent))


def _bundle_at(text: str, local: Path | None, options: dict) -> Bundle:
    """The address itself as a bundle: older-format when it is one, else native (whatever its directory holds)."""
    if local is not None and _is_older(local):
        return Bundle(text, V1, local.name, path=local)
    root, name, rank = split_bundle_path(text)
    return Bundle(text, NATIVE, name, rank, store=ObjectStore.open(root, **options))


def _native_bundle(text: str, options: dict) -> Bundle | None:
    """The native bundle at `text` when its directory holds a marker, else None."""
    try:
        root, name, rank = split_bundle_path(text)
    except BundleError:
        return None
    store = ObjectStore.open(root, **options)
    if not any(n == COMPLETE or RANK_MARKER.fullmatch(n) for n in store.backend.list_dir(name)):
        return None
    return Bundle(text, NATIVE, name, rank, store=store)


def _holds_older_bundles(text: str, local: Path | None, options: dict) -> bool:
    """True for a local directory that is no bundle but holds older-format bundles (a capture directory)."""
    if local is None or not local.is_dir() or is_v1_bundle(local) or not find_v1_bundles(local):
        return False
    return _native_bundle(text, options) is None


def _has_pending_writer(local: Path) -> bool:
    """True when the store above `local` has an in-flight record for a bundle of that name."""
    parent = local.parent
    if not parent.is_dir():
        return False
    return any(r.bundle == local.name for r in read_inflight(open_backend(str(parent))))


def _designated(text: str, local: Path | None, want: Anchor | None, options: dict) -> Bundle:
    """The bundle `text` designates under `want`: itself when it is one (checked against `want`), else the one
    bundle of the place it is (a root's finalizable bundles finalized first, as every reader does)."""
    shown = redact_url(text)
    if local is not None and not local.exists() and not _RANK_SUFFIX.search(text):
        if not _has_pending_writer(local):
            raise SelectionError(f"{shown}: no such bundle or directory")
        return _bundle_at(text, local, options)  # a writer left documents but no marker: opening says so
    if want is None and _RANK_SUFFIX.search(text.rstrip("/") + "/"):
        return _bundle_at(text, local, options)  # one rank of a bundle: opening checks its cohort
    if local is not None and is_v1_bundle(local):
        if want is not None:
            Selection(shown, want, [_older_candidate(local)], direct=True).one()
        return _bundle_at(text, local, options)
    native = _native_bundle(text, options)
    if native is not None:
        state = bundle_status(native.store.backend, native.name) if want is not None else None  # type: ignore
        if state is not None and state.complete is not None:
            Selection(shown, want, [Candidate.of(state, text)], direct=True).one()
        return native  # without COMPLETE, opening says what is missing
    store = ObjectStore.open(text, **options)
    states, _ = finalize_landed(store.backend, scan_bundles(store.backend))
    found = [Candidate.of(s, f"{text.rstrip('/')}/{s.name}") for s in states if s.complete is not None]
    unreadable = [
        Candidate.of(s, f"{text.rstrip('/')}/{s.name}")
        for s in states
        if s.complete is None and s.status in (CORRUPT, FINALIZABLE)
    ]
    older = _older_candidates(older_bundles(text))
    found += [c for c in older if not c.detail]
    unreadable += [c for c in older if c.detail]
    chosen = Selection(shown, want, found, unreadable).one()
    if chosen.format == V1:
        return Bundle(chosen.url, V1, chosen.name, path=Path(chosen.url))
    return Bundle(chosen.url, NATIVE, chosen.name, store=store)


def _older_candidate(path: Path) -> Candidate:
    """An older-format bundle as a candidate, opened to read its identity."""
    from trajectory_replay.bundle import legacy

    return Candidate(path.name, str(path), Anchor.of(legacy.open_v1(path)[0].index.identity), V1)


def _older_candidates(paths: Sequence[Path]) -> list[Candidate]:
    """Older-format bundles as candidates; one that does not open is one with a `detail` saying why."""
    out = []
    for path in paths:
        try:
            out.append(_older_candidate(path))
        except TrajectoryReplayError as exc:  # also the older tool's format 2, named with its reason
            out.append(Candidate(path.name, str(path), None, V1, detail=str(exc)))
    return out


__all__ = [
    "Bundle",
    "Candidate",
    "MAX_LISTED",
    "NATIVE",
    "Selection",
    "V1",
    "is_native_bundle",
    "listing",
    "older_bundles",
    "open_bundle",
    "open_for_replay",
    "open_sources",
]
