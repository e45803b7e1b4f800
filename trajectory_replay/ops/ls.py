"""`ls`: the bundles of a store root with their anchor, status, ranks, sizes and age.

Read-only: a finalizable bundle is shown as such (fsck, or any reader, finalizes it).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from trajectory_replay.ops.walk import CORRUPT, BundleState, Walker, open_root, scan_bundles


@dataclass(frozen=True)
class BundleListing:
    """One line of `ls`."""

    name: str
    anchor: Optional[str]
    rollout_id: Optional[int]
    step_id: Optional[int]
    status: str
    ranks: list[int]
    expected_ranks: list[int]
    missing_ranks: list[int]
    logical_bytes: int
    """Sum of the payload sizes of every rank the markers pin."""
    stored_bytes: int
    """Bytes of the unique chunks the bundle references (payloads and documents)."""
    age_seconds: Optional[float]
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ListReport:
    root: str
    bundles: list[BundleListing] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "bundles": [b.to_dict() for b in self.bundles]}

    def to_json(self) -> str:
        """The `ls --json` output: a list of bundle objects."""
        return json.dumps([b.to_dict() for b in self.bundles])

    def render_text(self) -> str:
        if not self.bundles:
            return f"{self.root}: no bundles"
        rows = [("BUNDLE", "ANCHOR", "STATUS", "RANKS", "LOGICAL", "STORED", "AGE")]
        for b in self.bundles:
            status = b.status + (f" (missing ranks {b.missing_ranks})" if b.missing_ranks else "")
            rows.append((b.name, b.anchor or "-", status, ",".join(map(str, b.ranks)) or "-",
                         human_bytes(b.logical_bytes), human_bytes(b.stored_bytes), human_age(b.age_seconds)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"{b.name}: {b.detail}" for b in self.bundles if b.status == CORRUPT]
        return "\n".join(lines)


def list_bundles(root: str | os.PathLike, **storage_options: Any) -> ListReport:
    """Every bundle under `root` (complete, incomplete, finalizable, corrupt) with sizes and age."""
    backend = open_root(root, **storage_options)
    states = scan_bundles(backend)
    trees = Walker(backend).trees([s for s in states if s.status != CORRUPT])
    now = time.time()
    report = ListReport(str(root))
    for state in states:
        tree = trees.get(state.name)
        report.bundles.append(_listing(state, tree, now))
    return report


def _listing(state: BundleState, tree, now: float) -> BundleListing:
    anchor = state.anchor
    status, detail = state.status, state.detail
    if tree is not None and tree.problems:
        status, detail = CORRUPT, "; ".join(tree.problems)
    ranks = state.expected_ranks if state.complete is not None else state.landed_ranks
    return BundleListing(
        name=state.name, anchor=str(anchor) if anchor else None,
        rollout_id=anchor.rollout_id if anchor else None, step_id=anchor.step_id if anchor else None,
        status=status, ranks=list(ranks), expected_ranks=list(state.expected_ranks),
        missing_ranks=list(state.missing_ranks),
        logical_bytes=tree.logical_bytes if tree else 0, stored_bytes=tree.stored_bytes if tree else 0,
        age_seconds=None if state.mtime is None else max(0.0, now - state.mtime), detail=detail)


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def human_age(seconds: Optional[float]) -> str:
    """Seconds -> '42s', '5m', '3h', '2d'."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


__all__ = ["BundleListing", "ListReport", "human_age", "human_bytes", "list_bundles"]
