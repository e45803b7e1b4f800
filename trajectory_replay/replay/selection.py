"""Sample selection (`--sample`, `--group`, `--batch`) and its group closure. Fails closed.

Membership comes only from the records (sample_id, group_index, micro_batch_id); a group's size is never
used to guess its members. Reward normalization is group-level, so the closure adds every member of
every group the selection touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trajectory_replay.bundle.schema import SampleRecord
from trajectory_replay.errors import SelectionError


def group_id(group_index: int | None) -> str | None:
    """The group id of a sample (`g-<group_index>`), None when it has no group_index."""
    return None if group_index is None else f"g-{group_index}"


@dataclass(frozen=True)
class Selection:
    """What the user asked to replay: sample ids, group ids (`g-N`), micro-batch ids (`mb-NNNN`)."""

    samples: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    batches: tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        """True for the empty selection, which selects every sample."""
        return not (self.samples or self.groups or self.batches)


@dataclass(frozen=True)
class Closure:
    """The sample positions (index order) replay runs on, out of `total`."""

    positions: tuple[int, ...]
    total: int

    @property
    def partial(self) -> bool:
        """True when the closure is smaller than the bundle (cohort-level stages are then skipped)."""
        return len(self.positions) < self.total


def resolve_selection(selection: Selection, records: Sequence[SampleRecord]) -> Closure:
    """The closure of `selection` over `records`; SelectionError on any id that matches nothing."""
    if selection.everything:
        return Closure(positions=tuple(range(len(records))), total=len(records))
    chosen: set[int] = set()
    chosen |= _matching("sample", selection.samples, records, lambda r: r.sample_id)
    chosen |= _matching("group", selection.groups, records, lambda r: group_id(r.group_index))
    chosen |= _matching("batch", selection.batches, records, lambda r: r.micro_batch_id)
    touched = {records[i].group_index for i in chosen} - {None}
    closure = chosen | {i for i, r in enumerate(records) if r.group_index is not None and r.group_index in touched}
    return Closure(positions=tuple(sorted(closure)), total=len(records))


def _matching(
    kind: str, wanted: Sequence[str], records: Sequence[SampleRecord], key: Callable[[SampleRecord], str | None]
) -> set[int]:
    """Positions of the records whose `key` is one of `wanted`; SelectionError naming every miss."""
    by_key: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        value = key(record)
        if value is not None:
            by_key.setdefault(value, []).append(i)
    missing = [w for w in wanted if w not in by_key]
    if missing:
        raise SelectionError(
            f"no {kind} {', '.join(map(repr, missing))}; {valid_ids(kind, list(by_key))} (selection fails closed)"
        )
    return {i for w in wanted for i in by_key[w]}


MAX_LISTED_IDS = 10
"""Valid ids a selection error names: enough to spot a typo or the id scheme, bounded for huge bundles."""


def valid_ids(kind: str, ids: Sequence[str]) -> str:
    """`groups: g-0, g-1` (first MAX_LISTED_IDS, in bundle order, then how many more)."""
    ids = list(ids)
    plural = "batches" if kind == "batch" else f"{kind}s"
    if not ids:
        return f"the bundle has no {plural}"
    shown = ", ".join(ids[:MAX_LISTED_IDS])
    more = f", ... ({len(ids) - MAX_LISTED_IDS} more)" if len(ids) > MAX_LISTED_IDS else ""
    return f"{plural}: {shown}{more}"


__all__ = ["Closure", "MAX_LISTED_IDS", "Selection", "group_id", "resolve_selection", "valid_ids"]
