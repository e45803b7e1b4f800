"""Resolving what a user points at: a bundle, a rank of one, or a capture directory / store root.

A store root holds bundles as children (and `objects/`, `blobs/`, dot-names, which are never
bundles); an older-format capture directory holds V1 bundle directories (`replay-<R>-<S>`,
`replay-rollout-<R>`, or any other name: what counts is the identity inside). A local directory may
hold both kinds; an older-format bundle is never read as a native one. `--step R:S` matches
only a step-level bundle whose actor_step_id is exactly (R, S); `--rollout R` only a
rollout-level bundle. No match, or several without a filter, is an error that lists what is there.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from trajectory_replay.backends import open_backend, redact_url
from trajectory_replay.bundle.markers import COMPLETE, RANK_MARKER, read_complete, try_finalize
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.errors import (
    BackendError, BundleError, SelectionError, StorageUnavailableError, TrajectoryReplayError, UsageError,
)

RESERVED = ("objects", "blobs")


@dataclass(frozen=True)
class Anchor:
    """A bundle's identity anchor: (rollout_id, step_id) for step-level, (rollout_id, None) for rollout-level."""

    rollout_id: Optional[int]
    step_id: Optional[int]

    @classmethod
    def from_marker(cls, anchor: dict[str, Any]) -> "Anchor":
        step = anchor.get("actor_step_id")
        if step:
            return cls(int(step["rollout_id"]), int(step["step_id"]))
        return cls(anchor.get("rollout_id"), None)

    @property
    def level(self) -> str:
        return "step" if self.step_id is not None else "rollout"

    def __str__(self) -> str:
        return f"step {self.rollout_id}:{self.step_id}" if self.step_id is not None else f"rollout {self.rollout_id}"


@dataclass(frozen=True)
class Candidate:
    """A complete bundle found under a root."""

    url: str
    name: str
    anchor: Anchor


def parse_step(text: str) -> tuple[int, int]:
    """`R:S` -> (R, S); UsageError (exit 2) when malformed."""
    match = re.fullmatch(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*", text or "")
    if not match:
        raise UsageError(f"--step {text!r}: expected ROLLOUT:STEP, e.g. 120:0")
    return int(match.group(1)), int(match.group(2))


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _is_local(text: str) -> bool:
    return "://" not in text or text.startswith("file://")


def _v1_candidates(path: Path, unreadable: Optional[list[str]] = None) -> list[Candidate]:
    """The V1 bundle at `path`, or those under it; with `unreadable`, a bundle that cannot be opened is
    named there instead of stopping the search."""
    from trajectory_replay.bundle import legacy

    bundles = [path] if legacy.is_v1_bundle(path) else legacy.find_v1_bundles(path)
    out = []
    for b in bundles:
        try:
            source = legacy.open_v1(b)[0]
        except TrajectoryReplayError as exc:  # also the older tool's format 2, named with its reason
            if unreadable is None:
                raise
            unreadable.append(f"{b.name} ({exc})")
            continue
        ident = source.index.identity
        anchor = Anchor(ident.actor_step_id.rollout_id, ident.actor_step_id.step_id) if ident.actor_step_id \
            else Anchor(ident.rollout_id, None)
        out.append(Candidate(str(b), b.name, anchor))
    return out


def _v1_names(root_url: str) -> list[str]:
    """Names of the older-format bundles directly under a local root (a remote root holds none)."""
    if not _is_local(root_url):
        return []
    from trajectory_replay.bundle import legacy

    local = Path(root_url.removeprefix("file://")).expanduser()
    if not local.is_dir():
        return []
    return [p.name for p in legacy.find_v1_bundles(local)]


def is_native_bundle(path_or_url: str, **storage_options: Any) -> bool:
    """True when `path_or_url` is a bundle directory of a store (it holds COMPLETE or a rank marker)."""
    try:
        root, name, _rank = split_bundle_path(path_or_url)
    except BundleError:
        return False
    backend = open_backend(root, **storage_options)
    return any(n == COMPLETE or RANK_MARKER.fullmatch(n) for n in backend.list_dir(name))


def _has_pending_writer(local: Path) -> bool:
    """True when the store above `local` has an in-flight record for a bundle of that name."""
    from trajectory_replay.store.liveness import read_inflight

    parent = local.parent
    if not parent.is_dir():
        return False
    return any(r.bundle == local.name for r in read_inflight(open_backend(str(parent))))


def find_bundles(root_url: str, unreadable: Optional[list[str]] = None, **storage_options: Any) -> list[Candidate]:
    """Complete bundles directly under a store root (children that are not reserved names).

    A bundle whose COMPLETE cannot be read is a BundleError, or, given `unreadable`, is named there and
    skipped: one corrupt bundle does not hide the others."""
    backend = open_backend(root_url, **storage_options)
    older = set(_v1_names(root_url))
    out = []
    for name in backend.list_dir():
        if name in RESERVED or name.startswith(".") or name in older:
            continue
        try:
            marker = read_complete(backend, name)
            if marker is None and any(RANK_MARKER.fullmatch(n) for n in backend.list_dir(name)):
                marker = try_finalize(backend, name)  # every rank landed: finalized as any reader does
        except StorageUnavailableError:
            raise
        except (BackendError, OSError) as exc:  # a store this user cannot write markers to: not finalized
            if unreadable is None:
                raise
            unreadable.append(f"{name} (every rank landed; not finalized here: {exc})")
            continue
        except BundleError as exc:
            if unreadable is None:
                raise
            unreadable.append(f"{name} ({exc})")
            continue
        if marker is not None:
            out.append(Candidate(_join(root_url, name), name, Anchor.from_marker(marker.anchor)))
    return out


def resolve_target(path_or_url: str | os.PathLike, *, step: Optional[str] = None, rollout: Optional[int] = None,
                   **storage_options: Any) -> str:
    """What `inspect`, `validate` and `import` look at. With `step`/`rollout`, the bundle `resolve_bundle`
    designates. Without, the path itself (an incomplete or damaged bundle is theirs to describe), unless it is
    a local directory that is no bundle but holds older-format bundles (a capture directory): then its one
    bundle, or a SelectionError listing them."""
    text = os.fspath(path_or_url)
    if step is None and rollout is None:
        if not _is_local(text):
            return text
        from trajectory_replay.bundle import legacy

        local = Path(text.removeprefix("file://")).expanduser()
        if not local.is_dir() or legacy.is_v1_bundle(local) or not legacy.find_v1_bundles(local):
            return text
        if is_native_bundle(text, **storage_options):
            return text
    return resolve_bundle(text, step=step, rollout=rollout, **storage_options)


def resolve_bundle(path_or_url: str | os.PathLike, *, step: Optional[str] = None, rollout: Optional[int] = None,
                   **storage_options: Any) -> str:
    """The one bundle path/URL that `path_or_url` designates under the filters; SelectionError otherwise."""
    text = os.fspath(path_or_url)
    if step is not None and rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    want = parse_step(step) if step is not None else None
    shown = redact_url(text)

    local = Path(text.removeprefix("file://")).expanduser() if _is_local(text) else None
    from trajectory_replay.bundle import legacy

    if local is not None and not local.exists() and not re.search(r"/rank-\d+/?$", text):
        if not _has_pending_writer(local):
            raise SelectionError(f"{shown}: no such bundle or directory")
        return text  # a writer left documents but no marker: the reader says it is incomplete
    if re.search(r"/rank-\d+/?$", text.rstrip("/") + "/") and (want is None and rollout is None):
        return text  # one rank of a bundle: the reader checks its cohort
    if local is not None and legacy.is_v1_bundle(local):
        return _choose(_v1_candidates(local), shown, want, rollout, direct=True)
    if is_native_bundle(text, **storage_options):
        if want is None and rollout is None:
            return text
        root, name, _ = split_bundle_path(text)
        marker = read_complete(open_backend(root, **storage_options), name)
        if marker is None:
            return text  # the reader reports what is missing
        return _choose([Candidate(text, name, Anchor.from_marker(marker.anchor))], shown, want, rollout, direct=True)
    unreadable: list[str] = []
    candidates = find_bundles(text, unreadable, **storage_options)
    if local is not None and local.is_dir():
        candidates += _v1_candidates(local, unreadable)
    return _choose(candidates, shown, want, rollout, direct=False, unreadable=unreadable)


def _choose(candidates: list[Candidate], shown: str, want: Optional[tuple[int, int]], rollout: Optional[int],
            *, direct: bool, unreadable: Sequence[str] = ()) -> str:
    if want is not None:
        matches = [c for c in candidates if c.anchor.step_id is not None
                   and (c.anchor.rollout_id, c.anchor.step_id) == want]
        what = f"--step {want[0]}:{want[1]}"
    elif rollout is not None:
        matches = [c for c in candidates if c.anchor.step_id is None and c.anchor.rollout_id == rollout]
        what = f"--rollout {rollout}"
    else:
        matches, what = candidates, ""
    listing = _listing(candidates)
    bad = f"; unreadable: {'; '.join(unreadable)}" if unreadable else ""
    if not matches:
        if not candidates:
            raise SelectionError(f"{shown}: no complete bundle found{bad}")
        if direct:
            raise SelectionError(f"{shown}: bundle is {candidates[0].anchor}, which does not match {what}")
        raise SelectionError(f"{shown}: no bundle matches {what} (found: {listing}){bad}")
    # without a filter an unreadable bundle may be the one meant: it counts, so nothing is picked for the user
    if len(matches) > 1 or (not what and unreadable):
        names = _listing(matches)
        hint = "" if what else "; choose one with --step ROLLOUT:STEP or --rollout ROLLOUT"
        if len({c.anchor for c in matches}) < len(matches):  # no flag tells these apart: only a path does
            hint = (f"; {'they' if what else 'some'} share an anchor, which --step/--rollout cannot tell apart: "
                    f"give one bundle's path instead, e.g. {redact_url(matches[0].url)}")
        count = len(matches) + (0 if what else len(unreadable))
        raise SelectionError(f"{shown}: {count} bundles match{' ' + what if what else ''}: {names}{bad}{hint}")
    for entry in unreadable:
        warnings.warn(f"{shown}: skipped unreadable bundle {entry}", stacklevel=2)
    return matches[0].url


MAX_LISTED = 10
"""Bundles an error message names: enough to see what is there, bounded for a store of thousands."""


def _listing(candidates: Sequence[Candidate]) -> str:
    shown = ", ".join(f"{c.name} ({c.anchor})" for c in candidates[:MAX_LISTED])
    more = len(candidates) - MAX_LISTED
    return shown + (f", ... ({more} more)" if more > 0 else "")
