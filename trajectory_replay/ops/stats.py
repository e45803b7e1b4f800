"""`stats`: how much a store holds and how well it deduplicates.

logical_bytes is the sum of payload sizes over every complete bundle and rank (what a naive
copy per bundle would store); stored_bytes is the bytes of the unique chunks those payload
blobs reference (what the store holds for them). Documents and records are left out of both,
so dedup_ratio = logical_bytes / stored_bytes measures payload sharing only. `ls` sizes bundles
the same way and its totals are these figures. Like `ls`, a finalizable bundle is finalized first.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from trajectory_replay.backends import redact_url
from trajectory_replay.bundle.status import COMPLETE_STATUS, finalize_landed, scan_bundles
from trajectory_replay.ops.ls import payload_totals
from trajectory_replay.ops.walk import Walker, open_root
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.store.inventory import Inventory
from trajectory_replay.units import human_bytes


@dataclass
class KindStats:
    """One payload name across the store."""

    payloads: int = 0
    logical_bytes: int = 0
    stored_bytes: int = 0
    dedup_ratio: float = 0.0


@dataclass
class StoreStats(Outcome):
    """Counts and sizes of a store root."""

    root: str
    bundles: int = 0
    complete_bundles: int = 0
    objects: int = 0
    blob_refs: int = 0
    logical_bytes: int = 0
    stored_bytes: int = 0
    dedup_ratio: float = 0.0
    kinds: dict[str, KindStats] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        """Always pass: the figures of whatever the root holds."""
        return Status.PASS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        lines = [
            f"store {self.root}: {self.bundles} bundles ({self.complete_bundles} complete), "
            f"{self.objects} objects, {self.blob_refs} blob refs",
            f"  payloads: {human_bytes(self.logical_bytes)} logical, {human_bytes(self.stored_bytes)} stored, "
            f"dedup ratio {self.dedup_ratio:.2f}",
        ]
        width = max((len(k) for k in self.kinds), default=0)
        for name, k in sorted(self.kinds.items()):
            lines.append(
                f"  {name.ljust(width)}  {k.payloads:>4} payloads  {human_bytes(k.logical_bytes):>10} logical  "
                f"{human_bytes(k.stored_bytes):>10} stored  x{k.dedup_ratio:.2f}"
            )
        return "\n".join(lines)


def _ratio(logical: int, stored: int) -> float:
    return logical / stored if stored else 0.0


def store_stats(root: str | os.PathLike, **storage_options: Any) -> StoreStats:
    """Counts, logical and stored payload bytes, the dedup ratio, and a breakdown per payload name."""
    backend = open_root(root, **storage_options)
    states, _ = finalize_landed(backend, scan_bundles(backend))
    complete = [s for s in states if s.status == COMPLETE_STATUS]
    inventory = Inventory(backend)
    trees = Walker(backend, inventory).trees(complete)
    out = StoreStats(redact_url(os.fspath(root)), bundles=len(states), complete_bundles=len(complete))
    out.objects = len(inventory.object_keys())
    out.blob_refs = len(inventory.ref_keys())
    kind_chunks: dict[str, dict[str, int]] = {}
    out.logical_bytes, out.stored_bytes = payload_totals(list(trees.values()))
    for tree in trees.values():
        for _rank, spec, node in tree.payloads:
            kind = out.kinds.setdefault(spec.name, KindStats())
            kind.payloads += 1
            kind.logical_bytes += spec.size
            kind_chunks.setdefault(spec.name, {}).update(node.chunks)
    out.dedup_ratio = _ratio(out.logical_bytes, out.stored_bytes)
    for name, kind in out.kinds.items():
        kind.stored_bytes = sum(kind_chunks[name].values())
        kind.dedup_ratio = _ratio(kind.logical_bytes, kind.stored_bytes)
    return out


__all__ = ["KindStats", "StoreStats", "store_stats"]
