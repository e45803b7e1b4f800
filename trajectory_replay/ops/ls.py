"""`ls`: the bundles of a store root with their anchor, status, ranks, sizes and age.

A finalizable bundle (every rank landed, COMPLETE missing) is finalized on the way, as any reader
does (docs/format.md), and listed as complete; one that cannot be finalized here (a store without
create-once writes, no write permission) stays `finalizable`, with the reason.

Sizes are payload bytes, as in `stats`: logical is the sum of payload sizes, stored the bytes of
the unique chunks they are kept in. The totals (complete bundles only, chunks shared between
bundles counted once) are exactly `stats`' figures for the same root.

A local directory may also hold bundles of the older directory format (or be one): they are listed
with `format` "v1", their anchor from their identity, and their payload files' bytes as both sizes
(that format keeps every payload whole); they are never read as native bundles, and are totalled on
a line of their own.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from trajectory_replay.bundle import legacy
from trajectory_replay.bundle.markers import RANKS_SHOWN, ranks_brief
from trajectory_replay.bundle.resolve import older_bundles
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    UNSUPPORTED,
    BundleState,
    anchor_problems,
    finalize_landed,
    scan_bundles,
)
from trajectory_replay.ops.walk import BundleTree, Walker, open_root
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.units import human_bytes


@dataclass(frozen=True)
class BundleListing:
    """One line of `ls`."""

    name: str
    anchor: str | None
    rollout_id: int | None
    step_id: int | None
    status: str
    ranks: list[int]
    expected_ranks: list[int]
    missing_ranks: list[int]
    logical_bytes: int
    """Sum of the payload sizes of every rank the markers pin."""
    stored_bytes: int
    """Bytes of the unique chunks the bundle's payloads are kept in."""
    age_seconds: float | None
    detail: str = ""
    format: str = "native"
    """`native`, or `v1` for a bundle directory of the older format."""
    trigger: dict[str, Any] | None = None
    """The flight recorder's trigger that kept the bundle (name, value, threshold, step, rank), if any."""

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        if doc["trigger"] is None:  # only a bundle the flight recorder kept has the key
            doc.pop("trigger")
        return doc


@dataclass
class ListReport(Outcome):
    """The bundles of a root, each with its own status; the listing itself always passes (a root that cannot be
    listed is an error)."""

    root: str
    bundles: list[BundleListing] = field(default_factory=list)
    complete_bundles: int = 0
    logical_bytes: int = 0
    """Payload bytes of the complete bundles (as `stats`)."""
    stored_bytes: int = 0
    """Bytes of the unique chunks those payloads are kept in, shared chunks once (as `stats`)."""
    finalized: list[str] = field(default_factory=list)
    """Bundles this listing finalized."""

    @property
    def status(self) -> Status:
        """Always pass: an incomplete or corrupt bundle is listed as such."""
        return Status.PASS

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "bundles": [b.to_dict() for b in self.bundles],
            "complete_bundles": self.complete_bundles,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "finalized": self.finalized,
        }

    def to_json(self) -> str:
        """`to_dict()` serialized (the CLI adds the status)."""
        return json.dumps(self.to_dict())

    def render_text(self) -> str:
        if not self.bundles:
            return f"{self.root}: no bundles"
        triggers = any(b.trigger for b in self.bundles)
        rows = [
            ("BUNDLE", "ANCHOR", "STATUS", "RANKS", "LOGICAL", "STORED", "AGE") + (("TRIGGER",) if triggers else ())
        ]
        for b in self.bundles:
            status = b.status + (f" (missing ranks {ranks_brief(b.missing_ranks)})" if b.missing_ranks else "")
            name = b.name + (" [v1]" if b.format == "v1" else "")
            rows.append(
                (
                    name,
                    b.anchor or "-",
                    status,
                    _ranks_column(b.ranks),
                    human_bytes(b.logical_bytes),
                    human_bytes(b.stored_bytes),
                    human_age(b.age_seconds),
                )
                + ((trigger_brief(b.trigger),) if triggers else ())
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [_about(b.name, b.detail) for b in self.bundles if b.status in (CORRUPT, FINALIZABLE, UNSUPPORTED)]
        lines += [f"{name}: finalized (every rank had landed)" for name in self.finalized]
        older = [b for b in self.bundles if b.format == "v1"]
        if len(older) < len(self.bundles):
            lines.append(
                f"total: {self.complete_bundles} complete bundle(s), {human_bytes(self.logical_bytes)} "
                f"logical, {human_bytes(self.stored_bytes)} stored (chunks shared between bundles counted "
                "once)"
            )
        if older:
            done = [b for b in older if b.status == COMPLETE_STATUS]
            lines.append(
                f"older format [v1]: {len(done)} complete bundle(s) of {len(older)}, "
                f"{human_bytes(sum(b.logical_bytes for b in done))} of payload files"
            )
        return "\n".join(lines)


def trigger_brief(trigger: dict[str, Any] | None) -> str:
    """A trigger in one cell: `name at step (value v, threshold t)`; "-" for none."""
    if not trigger:
        return "-"
    value, threshold = trigger.get("value"), trigger.get("threshold")
    shown = f"{value:.4g}" if isinstance(value, float) else str(value)
    limit = "" if threshold is None else f", threshold {threshold:g}"
    return f"{trigger['name']} at {trigger['step']} (value {shown}{limit})"


def _about(name: str, detail: str) -> str:
    """`detail` as a line about bundle `name`, which names the bundle once: a detail that starts with the name, or
    with a path through the bundle, goes on from the bundle (`b-7: COMPLETE: not valid JSON`)."""
    first, sep, rest = detail.partition(": ")
    if sep and (first == name or first.endswith(f"/{name}")):
        detail = rest
    elif sep and f"/{name}/" in first:
        detail = f"{first.split(f'/{name}/', 1)[1]}: {rest}"
    return f"{name}: {detail}"


def list_bundles(root: str | os.PathLike, **storage_options: Any) -> ListReport:
    """Every bundle under `root` (complete, incomplete, finalizable, corrupt) with sizes and age."""
    backend = open_root(root, **storage_options)
    report = ListReport(str(root))
    now = time.time()
    # older-format bundles are listed from their directories: the native scan skips them
    report.bundles += [_older_listing(legacy.v1_status(path), now) for path in older_bundles(root)]
    states, report.finalized = finalize_landed(backend, scan_bundles(backend))
    trees = Walker(backend).trees([s for s in states if s.status != CORRUPT])
    anchors = anchor_problems(backend, states)
    for state in states:
        tree = trees.get(state.name)
        report.bundles.append(_listing(state, tree, now, anchors.get(state.name)))
    report.bundles.sort(key=lambda b: b.name)
    complete = [trees[b.name] for b in report.bundles if b.status == COMPLETE_STATUS and b.name in trees]
    report.complete_bundles = len(complete)
    report.logical_bytes, report.stored_bytes = payload_totals(complete)
    return report


def _older_listing(state: legacy.V1Status, now: float) -> BundleListing:
    anchor = state.anchor
    return BundleListing(
        name=state.name,
        anchor=str(anchor) if anchor else None,
        rollout_id=state.rollout_id,
        step_id=state.step_id,
        status=state.status,
        ranks=state.landed_ranks,
        expected_ranks=list(state.expected_ranks),
        missing_ranks=list(state.missing_ranks),
        logical_bytes=state.payload_bytes,
        stored_bytes=state.payload_bytes,
        age_seconds=None if state.mtime is None else max(0.0, now - state.mtime),
        detail=state.detail,
        format="v1",
    )


def payload_totals(trees: list[BundleTree]) -> tuple[int, int]:
    """(logical, stored) payload bytes of `trees`: sizes summed, unique chunks counted once."""
    chunks: dict[str, int] = {}
    for tree in trees:
        chunks.update(tree.payload_chunks())
    return sum(t.logical_bytes for t in trees), sum(chunks.values())


def _listing(state: BundleState, tree, now: float, anchor_problem: str | None = None) -> BundleListing:
    anchor = state.anchor
    status, detail = state.status, state.detail
    if tree is not None and tree.problems:
        status, detail = CORRUPT, "; ".join(tree.problems)
    if anchor_problem:
        detail = f"{anchor_problem}; {detail}" if status == CORRUPT else anchor_problem
        status = CORRUPT
    ranks = state.expected_ranks if state.complete is not None else state.landed_ranks
    return BundleListing(
        name=state.name,
        anchor=str(anchor) if anchor else None,
        rollout_id=anchor.rollout_id if anchor else None,
        step_id=anchor.step_id if anchor else None,
        status=status,
        ranks=list(ranks),
        expected_ranks=list(state.expected_ranks),
        missing_ranks=list(state.missing_ranks),
        logical_bytes=tree.logical_bytes if tree else 0,
        stored_bytes=sum(tree.payload_chunks().values()) if tree else 0,
        age_seconds=None if state.mtime is None else max(0.0, now - state.mtime),
        detail=detail,
        trigger=tree.trigger.model_dump(mode="json") if tree is not None and tree.trigger is not None else None,
    )


def _ranks_column(ranks: list[int]) -> str:
    """`0,1,2`; a long list as `ranks_brief` abbreviates it (`--json` has every rank)."""
    if not ranks:
        return "-"
    return ",".join(map(str, ranks)) if len(ranks) <= RANKS_SHOWN else ranks_brief(ranks)


def human_age(seconds: float | None) -> str:
    """Seconds -> '42s', '5m', '3h', '2d'."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


__all__ = ["trigger_brief", "BundleListing", "ListReport", "human_age", "human_bytes", "list_bundles", "payload_totals"]
