"""`import`: convert older-format (V1) directory bundles into native bundles of a store.

Identity, records (loss masks included), config, stage contracts, comparison and redaction
policy, and expected values are kept, so a replay of the imported bundle gives the verdicts
of the original. Importing onto an existing bundle with different content is refused by the
writer; importing the same bundle again is a no-op.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from trajectory_replay.bundle import legacy
from trajectory_replay.bundle.schema import check_name
from trajectory_replay.bundle.writer import BundleWriter
from trajectory_replay.errors import BundleError
from trajectory_replay.store import ObjectStore


def import_v1(source: str | os.PathLike, store_root: str, *, name: Optional[str] = None,
              **storage_options: Any) -> list[str]:
    """Import one V1 bundle, or every V1 bundle of a capture directory; returns the native bundle URLs."""
    path = Path(os.fspath(source)).expanduser()
    if legacy.is_v1_bundle(path):
        bundles = [path]
    else:
        bundles = legacy.find_v1_bundles(path) if path.is_dir() else []
        if not bundles:
            raise BundleError(f"{source}: neither a V1 bundle nor a directory of V1 bundles")
        if name is not None:
            raise BundleError(f"--as names one bundle, but {source} holds {len(bundles)}")
    store = ObjectStore.open(store_root, **storage_options)
    return [_import_one(b, store, store_root, name) for b in bundles]


def _import_one(path: Path, store: ObjectStore, store_root: str, name: Optional[str]) -> str:
    sources = legacy.open_v1(path)
    target_name = name or sources[0].bundle_id
    try:
        check_name(target_name, "bundle name")
    except ValueError as exc:
        raise BundleError(str(exc)) from None
    url = f"{store_root.rstrip('/')}/{target_name}"
    multi = sources[0].rank is not None
    expected_ranks = [s.rank for s in sources] if multi else None
    for source in sources:
        manifest = source.manifest.model_copy(update={"payloads": {}})
        full_index = source.index  # V1 records carry their loss masks
        writer = BundleWriter(url, manifest, full_index, source.expected, store=store,
                              rank=source.rank if multi else None, expected_ranks=expected_ranks)
        for payload, spec in source.manifest.payloads.items():
            writer.write_payload(payload, source.load_payload(payload).reshape(spec.shape))
        writer.finalize()
    return url
