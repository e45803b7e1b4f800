"""`import`: convert older-format (V1) directory bundles into native bundles of a store.

Identity, records (loss masks included), config, stage contracts, comparison and redaction
policy, and expected values are kept, so a replay of the imported bundle gives the verdicts
of the original. Importing the same bundle again is a no-op. Importing onto an existing bundle
with different content is refused, with the way out (`--as NAME`), and leaves nothing behind: when
the name is taken, the import first runs as a dry run over the store (reads see the store, writes
stay in memory), so a refusal writes no object and no in-flight record.

The source is a bundle, a rank-<r> bundle's multi-rank parent, or a capture directory of them (the
older tool's `replay-<R>-<S>/`, `replay-rollout-<R>/`); `step`/`rollout`/`critic` pick one bundle of a
capture directory by its identity, as `replay --step/--rollout/--critic` does (the older format anchors no critic's
step, so `critic` finds none).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from trajectory_replay.backends import redact_url
from trajectory_replay.backends.overlay import OverlayBackend
from trajectory_replay.bundle import legacy
from trajectory_replay.bundle.markers import (
    ABANDONED,
    FINALIZER,
    CompleteMarker,
    RankMarker,
    landed_ranks,
    rank_key,
    read_complete,
    read_marker,
    try_finalize,
)
from trajectory_replay.bundle.schema import check_name
from trajectory_replay.bundle.writer import BundleWriter
from trajectory_replay.errors import BundleError
from trajectory_replay.store import ObjectStore


def import_v1(
    source: str | os.PathLike,
    store_root: str,
    *,
    name: str | None = None,
    step: str | None = None,
    rollout: int | None = None,
    critic: str | None = None,
    **storage_options: Any,
) -> list[str]:
    """Import one V1 bundle, or every V1 bundle of a capture directory (or the one `step`/`rollout`/`critic` picks);
    returns the native bundle URLs."""
    path = Path(os.fspath(source)).expanduser()
    if step is not None or rollout is not None or critic is not None:
        from trajectory_replay.bundle.resolve import V1, open_bundle

        chosen = open_bundle(path, step=step, rollout=rollout, critic=critic)
        if chosen.format != V1:
            raise BundleError(f"{chosen.target}: a native bundle, not an older-format one; copy it with cp")
        assert chosen.path is not None  # an older-format bundle is a directory
        bundles = [chosen.path]
    elif legacy.is_v1_bundle(path):
        bundles = [path]
    else:
        bundles = legacy.find_v1_bundles(path) if path.is_dir() else []
        if not bundles:
            raise BundleError(f"{source}: neither a V1 bundle nor a directory of V1 bundles")
        if name is not None:
            raise BundleError(f"--as names one bundle, but {source} holds {len(bundles)}")
    store = ObjectStore.open(store_root, **storage_options)
    return [_import_one(b, store, store_root, name) for b in bundles]


def _import_one(path: Path, store: ObjectStore, store_root: str, name: str | None) -> str:
    sources = legacy.open_v1(path)
    target_name = name or sources[0].bundle_id
    try:
        check_name(target_name, "bundle name")
    except ValueError as exc:
        raise BundleError(str(exc)) from None
    url = f"{store_root.rstrip('/')}/{target_name}"
    # a finalizer claim, or gc's note of an abandoned cohort, alone is no bundle
    if any(n not in (FINALIZER, ABANDONED) for n in store.backend.list_dir(target_name)):
        _check_same_as_existing(sources, store, store_root, target_name, path, name)
    _write(sources, store, url, path, name)
    return url


def _check_same_as_existing(
    sources: list, store: ObjectStore, store_root: str, target_name: str, path: Path, name: str | None
) -> None:
    """Refuse, before writing anything, an import onto a name whose bundle (complete, or some ranks landed)
    holds other documents. The import runs under a scratch name over the store, writes kept in memory."""
    scratch = f"{target_name}-import-check-{uuid.uuid4().hex[:12]}"
    with OverlayBackend(store.backend) as overlay:
        _write(sources, ObjectStore(overlay), f"{store_root.rstrip('/')}/{scratch}", path, name)
        ours = read_complete(overlay, scratch)
    theirs = read_complete(store.backend, target_name)
    if theirs is not None:
        same = ours is not None and theirs.multi_rank == ours.multi_rank and _digests(theirs) == _digests(ours)
    else:
        landed = {
            str(r): read_marker(store.backend, rank_key(target_name, r), RankMarker)
            for r in landed_ranks(store.backend, target_name)
        }
        mine = _digests(ours) if ours is not None and ours.multi_rank else {}
        same = bool(landed) and all(m is not None and mine.get(r) == m.documents.digests() for r, m in landed.items())
    if not same:
        raise BundleError(_refusal(f"{store_root.rstrip('/')}/{target_name}", path, name))


def _digests(marker: CompleteMarker) -> dict[str, list[str]]:
    return {r: d.digests() for r, d in marker.shards.items()}


def _refusal(url: str, path: Path, name: str | None) -> str:
    hint = "choose another name with --as NAME" if name else "import it under another name with --as NAME"
    return (
        f"{redact_url(url)}: a different bundle with this name already exists (importing {path}: different "
        f"content); {hint}"
    )


def _write(sources: list, store: ObjectStore, url: str, path: Path, name: str | None) -> None:
    multi = sources[0].rank is not None
    expected_ranks = [s.rank for s in sources] if multi else None
    final = None
    for source in sources:
        manifest = source.manifest.model_copy(update={"payloads": {}})
        full_index = source.index  # V1 records carry their loss masks
        writer = BundleWriter(
            url,
            manifest,
            full_index,
            source.expected,
            store=store,
            rank=source.rank if multi else None,
            expected_ranks=expected_ranks,
        )
        try:
            for payload, spec in source.manifest.payloads.items():
                writer.write_payload(payload, source.load_payload(payload).reshape(spec.shape))
            final = writer.finalize()
        except BundleError as exc:
            writer.abort()  # no in-flight record outlives a refused import
            if "different content" not in str(exc):
                raise
            raise BundleError(_refusal(url, path, name)) from None  # written meanwhile by someone else
    if multi and final is None:
        # every rank has landed, but another producer's FINALIZER claim was there first: finalize as a reader does
        try_finalize(store.backend, writer.name, expected_ranks)
