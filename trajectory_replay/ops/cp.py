"""`cp`: copy bundles between any two store roots, transferring only what the destination lacks.

Order at the destination is the store's own write order, so a destination bundle is visible
only when whole and an interrupted copy leaves only garbage that a re-run completes:

    chunks (and documents' chunks) -> blob records -> blob refs -> COMPLETE.<r> -> COMPLETE

Every object is verified against its digest on the way (a corrupt source object stops the
copy before anything names it at the destination). Presence at the destination is checked
object by object, concurrently (or by one listing for a large copy); transfers run on a thread pool.
A finalizable source bundle (every rank landed, COMPLETE missing) is copied with the final
COMPLETE its rank markers determine, without writing to the source.

Copying from a root, a bundle whose markers cannot be read or whose tree is damaged is not copied
and is named in the report (`skipped`); the other bundles are copied. A bundle named directly is
copied whole or refused.

A bundle of the older directory format, or a local directory holding only such bundles (a capture
directory of the older tool), is converted into native bundles of the destination as `import`
does, chosen the same way (`--step`, `--critic`, `--rollout`, `--all`, or the one bundle there is). In a
directory that also holds native bundles, only the native ones are copied.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trajectory_replay.backends import Backend, redact_url
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.markers import (
    COMPLETE,
    CompleteMarker,
    complete_key,
    final_marker_bytes,
    parse_complete,
    read_complete,
)
from trajectory_replay.bundle.paths import split_bundle_path
from trajectory_replay.bundle.resolve import Candidate, Selection
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    BundleState,
    bundle_status,
    scan_bundles,
)
from trajectory_replay.errors import BundleError, IntegrityError, NotFoundError, UsageError
from trajectory_replay.ops.progress import Progress
from trajectory_replay.ops.walk import Walker, open_root
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.store.digest import OBJECT, key_kind
from trajectory_replay.store.inventory import BlobNode, Inventory, concurrently, value_problem, write_layers
from trajectory_replay.units import human_bytes

LIST_THRESHOLD = 1000
"""From this many keys to check, one listing of the destination beats a request per key."""


@dataclass
class CopyReport(Outcome):
    """What a copy transferred. A re-run after a successful copy transfers 0 objects."""

    source: str
    dest: str
    bundles: list[str] = field(default_factory=list)
    objects_copied: int = 0
    objects_skipped: int = 0
    """Objects and refs the destination already held."""
    bytes_copied: int = 0
    markers_written: int = 0
    markers_skipped: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    """Bundles of the source root not copied because they are corrupt: {name, detail}."""
    converted: list[str] = field(default_factory=list)
    """Native names of the older-format bundles converted into the destination (then nothing else is copied)."""

    @property
    def status(self) -> Status:
        """invalid when a corrupt bundle of the source root was skipped (the others are copied), else pass."""
        return Status.INVALID if self.skipped else Status.PASS

    def failures(self) -> list[str]:
        return [f"{s['name']}: not copied: {s['detail']}" for s in self.skipped]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render_text(self) -> str:
        lines = [
            f"copied {len(self.bundles)} bundle(s) {', '.join(self.bundles)} to {self.dest}: "
            f"{self.objects_copied} objects copied ({human_bytes(self.bytes_copied)}), "
            f"{self.objects_skipped} already there, {self.markers_written} markers written"
        ]
        if self.converted:
            lines = [
                f"converted {len(self.converted)} older-format bundle(s) {', '.join(self.converted)} into "
                f"native bundles of {self.dest}"
            ]
        lines += [f"not copied: {s['name']}: corrupt ({s['detail']})" for s in self.skipped]
        return "\n".join(lines)


def copy_bundles(
    source: str | os.PathLike,
    dest_root: str | os.PathLike,
    *,
    step: str | None = None,
    rollout: int | None = None,
    all_bundles: bool = False,
    critic: str | None = None,
    source_options: dict | None = None,
    dest_options: dict | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
) -> CopyReport:
    """Copy one bundle (`<root>/<bundle>`), or the bundles of a root chosen by `step`/`critic`/`rollout`/
    `all_bundles`."""
    if sum(x is not None and x is not False for x in (step, critic, rollout, all_bundles or None)) > 1:
        raise UsageError("--step, --critic, --rollout and --all are mutually exclusive")
    progress = progress or Progress()
    older = _older_format_selection(os.fspath(source), step, rollout, critic, all_bundles)
    if older is not None:
        return _convert(os.fspath(source), older, dest_root, dest_options or {})
    src, selection = _source(os.fspath(source), Anchor.requested(step, rollout, critic), source_options or {})
    chosen, covered = selection.several(all_bundles)
    states, direct = [_state(c) for c in chosen], selection.direct
    skipped = [{"name": c.name, "detail": c.detail} for c in covered]
    trees = Walker(src).trees(states)
    for tree in trees.values():
        if tree.problems or tree.missing or tree.corrupt:
            detail = "; ".join(tree.problems) or f"{len(tree.missing)} missing, {len(tree.corrupt)} corrupt objects"
            if direct:
                raise BundleError(
                    f"{redact_url(src.url)}/{tree.name}: cannot copy a damaged bundle ({detail}); run fsck"
                )
            skipped.append({"name": tree.name, "detail": f"damaged tree: {detail}; run fsck"})
    damaged = {s["name"] for s in skipped}
    states = [s for s in states if s.name not in damaged]
    if not states:
        raise BundleError(
            f"{redact_url(os.fspath(source))}: nothing copied; "
            + "; ".join(f"{s['name']}: {s['detail']}" for s in skipped)
        )
    trees = {name: tree for name, tree in trees.items() if name not in damaged}
    dest = open_root(dest_root, must_exist=False, **(dest_options or {}))
    _check_destination(src, dest, os.fspath(dest_root), dest_options or {})
    report = CopyReport(
        redact_url(os.fspath(source)),
        redact_url(os.fspath(dest_root)),
        bundles=[s.name for s in states],
        skipped=skipped,
    )
    copy_objects(
        src,
        dest,
        (node for tree in trees.values() for node in [*tree.documents, *(n for _, _, n in tree.payloads)]),
        report,
        progress,
        workers,
    )
    dest.require_atomic_create()
    for state in states:
        _write_markers(src, dest, state, report)
    return report


def copy_objects(
    src: Backend,
    dest: Backend,
    nodes: Iterable[BlobNode],
    report: CopyReport,
    progress: Progress | None = None,
    workers: int | None = None,
) -> None:
    """Copy the blobs of `nodes` that `dest` lacks: chunks, then blob records, then refs, each verified against
    its digest on the way; counted in `report`. Names nothing at the destination: markers are the caller's."""
    chunks, records, refs = write_layers(nodes)
    copier = _Copier(src, dest, report, progress or Progress(), workers or max(src.max_workers, dest.max_workers))
    for label, keys in (("chunks", chunks), ("records", records), ("refs", refs)):
        copier.transfer(label, keys)


def _source(source: str, want: Anchor | None, options: dict) -> tuple[Backend, Selection]:
    """The source's backend and what it holds as a `Selection`: the one bundle it names (refused unless complete
    or finalizable), or the complete, finalizable and corrupt bundles of the root it is. A finalizable bundle is
    copied with the COMPLETE its rank markers determine: a copy writes nothing to its source."""
    shown, direct = redact_url(source), None
    try:
        root, name, rank = split_bundle_path(source)
    except BundleError:
        pass
    else:
        if rank is not None:
            raise UsageError(f"{shown}: copy the whole bundle, not one rank of it")
        try:
            backend = open_root(root, **options)
            direct = bundle_status(backend, name)
        except NotFoundError:
            pass
    if direct is not None:
        if direct.status not in (COMPLETE_STATUS, FINALIZABLE):
            raise BundleError(f"{shown}: {direct.status} bundle ({direct.detail}); only complete bundles are copied")
        return backend, Selection(shown, want, [Candidate.of(direct, source)], direct=True)
    backend = open_root(source, **options)
    states = [(s, Candidate.of(s, f"{source.rstrip('/')}/{s.name}")) for s in scan_bundles(backend)]
    return backend, Selection(
        shown,
        want,
        [c for s, c in states if s.status in (COMPLETE_STATUS, FINALIZABLE)],
        [c for s, c in states if s.status == CORRUPT],
    )


def _local_dir(source: str) -> Path | None:
    """The directory a local source names (None for a URL of a remote store, or a path that is no directory)."""
    if "://" in source and not source.startswith("file://"):
        return None
    path = Path(source.removeprefix("file://")).expanduser()
    return path if path.is_dir() else None


@dataclass
class _OlderSelection:
    bundles: list[Path]
    skipped: list[dict[str, str]]


def _older_path(path: Path | None) -> Path:
    """The directory of an older-format bundle `open_bundle` chose (it always has one)."""
    assert path is not None
    return path


def _state(candidate: Candidate) -> BundleState:
    """The state of a native bundle a selection chose (its candidate always carries one)."""
    assert candidate.state is not None
    return candidate.state


def _older_format_selection(
    source: str, step: str | None, rollout: int | None, critic: str | None, all_bundles: bool
) -> _OlderSelection | None:
    """The older-format bundles to convert: the source itself when it is one, else those of a local directory
    that holds no native bundle, chosen by the flags; None when the source is for the native copy."""
    from trajectory_replay.bundle import legacy
    from trajectory_replay.bundle.resolve import open_bundle

    local = _local_dir(source)
    if local is None:
        return None
    if legacy.is_v1_bundle(local):
        return _OlderSelection([_older_path(open_bundle(local, step=step, rollout=rollout, critic=critic).path)], [])
    older = legacy.find_v1_bundles(local)
    if not older:
        return None
    if scan_bundles(open_root(source)):  # native bundles beside them: the native copy (older ones never scanned)
        return None
    if not all_bundles:
        return _OlderSelection([_older_path(open_bundle(local, step=step, rollout=rollout, critic=critic).path)], [])
    chosen, skipped = [], []
    for path in older:
        status = legacy.v1_status(path)
        if status.status == COMPLETE_STATUS:
            chosen.append(path)
        elif status.status == CORRUPT:  # unfinished ones are left out unnamed, as native ones are
            skipped.append({"name": path.name, "detail": status.detail})
    if not chosen:
        raise BundleError(
            f"{redact_url(source)}: nothing copied; " + "; ".join(f"{s['name']}: {s['detail']}" for s in skipped)
        )
    return _OlderSelection(chosen, skipped)


def _convert(source: str, older: _OlderSelection, dest_root: str | os.PathLike, options: dict) -> CopyReport:
    """Convert the chosen older-format bundles into native bundles of the destination (as `import`)."""
    from trajectory_replay.ops.importer import _import_one
    from trajectory_replay.store import ObjectStore

    dest = open_root(dest_root, must_exist=False, **options)
    _check_destination(open_root(source), dest, os.fspath(dest_root), options)
    store = ObjectStore.open(os.fspath(dest_root), **options)
    names = [
        _import_one(path, store, os.fspath(dest_root), None).rstrip("/").rsplit("/", 1)[-1] for path in older.bundles
    ]
    return CopyReport(
        redact_url(source), redact_url(os.fspath(dest_root)), bundles=names, skipped=older.skipped, converted=names
    )


def _check_destination(src: Backend, dest: Backend, dest_root: str, options: dict) -> None:
    """Refuse the source store itself, and any directory at or below a bundle (native or older format): a
    store written there would be taken for part of that bundle, or hide it."""
    if _same_root(src, dest):
        raise UsageError(f"{redact_url(dest_root)}: the destination is the source store itself; nothing to copy")
    from trajectory_replay.bundle.resolve import is_native_bundle

    text = dest_root.rstrip("/")
    scheme, _, path = text.rpartition("://")
    if not scheme:
        path = os.path.abspath(os.path.expanduser(text.removeprefix("file://")))
    parts = path.split("/")
    # a URL's first component is its bucket, never a bundle; a local path is checked up to its top directory
    for depth in range(len(parts), 1, -1):
        candidate = "/".join(parts[:depth])
        shown = f"{scheme}://{candidate}" if scheme else candidate
        if not scheme or scheme == "file":
            from trajectory_replay.bundle import legacy

            if legacy.is_v1_bundle(Path(candidate)):
                raise UsageError(f"{redact_url(dest_root)}: inside the bundle {shown}; copy into a store root")
        try:
            inside = is_native_bundle(shown, **options)
        except (BundleError, NotFoundError):
            inside = False
        if inside:
            raise UsageError(f"{redact_url(dest_root)}: inside the bundle {redact_url(shown)}; copy into a store root")


def _same_root(a: Backend, b: Backend) -> bool:
    if type(a) is not type(b):
        return False
    root_a, root_b = getattr(a, "root", None), getattr(b, "root", None)
    if isinstance(root_a, Path) and isinstance(root_b, Path):
        return os.path.realpath(root_a) == os.path.realpath(root_b)
    return a.url.rstrip("/") == b.url.rstrip("/")


class _Copier:
    """Transfers keys the destination lacks, in verified batches on a thread pool."""

    def __init__(self, src: Backend, dest: Backend, report: CopyReport, progress: Progress, workers: int) -> None:
        self.src, self.dest, self.report, self.progress, self.workers = src, dest, report, progress, workers
        self.dest_inventory = Inventory(dest)
        self._lock = threading.Lock()
        self._listed: set[str] | None = None

    def transfer(self, label: str, keys: dict[str, int]) -> None:
        present = self._present(list(keys))
        missing = [k for k, there in zip(keys, present) if not there]
        self.report.objects_skipped += len(keys) - len(missing)
        self.progress.phase(f"copying {label}", objects=len(missing), nbytes=sum(keys[k] for k in missing) or None)
        # one key per task, `workers` in flight all along: no batch waits for its slowest member
        concurrently(self._copy, missing, self.workers)

    def _present(self, keys: list[str]) -> list[bool]:
        """Whether the destination holds each key: one listing for a large copy, else a check per key."""
        if len(keys) < LIST_THRESHOLD and self._listed is None:
            return concurrently(self.dest.exists, keys, self.workers)
        if self._listed is None:
            self._listed = set(self.dest_inventory.object_keys()) | set(self.dest_inventory.ref_keys())
        return [k in self._listed for k in keys]

    def _copy(self, key: str) -> None:
        data = self.src.read(key)
        _verify(self.src, key, data)
        self.dest_inventory.install(key, data)
        with self._lock:
            self.report.objects_copied += 1
            self.report.bytes_copied += len(data)
        self.progress.advance(1, len(data))


def _verify(src: Backend, key: str, data: bytes) -> None:
    why = value_problem(key, data)
    if why is None:
        return
    where = f"{redact_url(src.url)}/{key}"
    if key_kind(key) == OBJECT:
        raise IntegrityError(f"{where}: {why}; nothing that names it was copied (run fsck on the source)")
    raise IntegrityError(f"{where}: {why}")


def _write_markers(src: Backend, dest: Backend, state: BundleState, report: CopyReport) -> None:
    """Rank markers first, then COMPLETE: the destination bundle becomes visible only now, whole."""
    name = state.name
    for key in state.marker_keys:
        if key.endswith(f"/{COMPLETE}"):
            continue
        if dest.create_if_absent(key, src.read(key)):
            report.markers_written += 1
        else:
            report.markers_skipped += 1  # an earlier landing of that rank; COMPLETE below decides
    if state.complete is not None:
        data = src.read(complete_key(name))
    else:
        data = final_marker_bytes([state.rank_markers[r] for r in state.expected_ranks])
    if dest.exists(complete_key(name)):
        existing = read_complete(dest, name)
        if existing is None or _documents(existing) != _documents(parse_complete(data)):
            raise BundleError(
                f"{redact_url(dest.url)}/{name}: a different bundle with this name exists at the "
                "destination; refusing to overwrite it"
            )
        report.markers_skipped += 1
        return
    if not dest.create_if_absent(complete_key(name), data):
        existing = read_complete(dest, name)
        if existing is None or _documents(existing) != _documents(parse_complete(data)):
            raise BundleError(f"{redact_url(dest.url)}/{name}: a different COMPLETE was written concurrently")
        report.markers_skipped += 1
        return
    report.markers_written += 1


def _documents(marker: CompleteMarker) -> dict:
    return {r: d.digests() for r, d in marker.shards.items()}


__all__ = ["CopyReport", "copy_bundles", "copy_objects"]
