"""The samples one replay pass runs over: the selected rows of one or more sources, loaded lazily, once.

A cohort is a union of parts, one per source (one rank of a data-parallel bundle, or the only source).
Per-sample values are concatenated part after part; per-token payloads likewise, so sample i's tokens
stay contiguous. Payload rows are read only when a stage asks for them, and only the selected rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from trajectory_replay.bundle.schema import SampleRecord
from trajectory_replay.replay.compare import SampleLayout
from trajectory_replay.replay.source import ReplaySource


@dataclass(frozen=True, eq=False)
class CohortPart:
    """The selected sample positions (index order) of one source."""

    source: ReplaySource
    positions: tuple[int, ...]

    @property
    def whole(self) -> bool:
        """True when every sample of the source is selected (the payload is then loaded unsliced)."""
        return len(self.positions) == len(self.source.index.samples)

    @property
    def rank_prefix(self) -> str:
        """`rank r: ` for a ranked source, else empty; prefixes messages about this part."""
        return "" if self.source.rank is None else f"rank {self.source.rank}: "


class PayloadCache:
    """Payload rows already loaded, keyed by source, payload name and rows, so each is read once."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[int, str, tuple[int, ...] | None], torch.Tensor] = {}
        self.names: set[str] = set()
        """Every payload name loaded through the cache so far (kept or since forgotten)."""

    def load(self, part: CohortPart, name: str) -> torch.Tensor:
        """The rows of `name` that `part` selects."""
        rows = None if part.whole else part.positions
        key = (id(part.source), name, rows)
        if key not in self._loaded:
            self._loaded[key] = part.source.load_payload(name, samples=None if rows is None else list(rows))
            self.names.add(name)
        return self._loaded[key]

    def retain(self, names: set[str]) -> None:
        """Forget every loaded payload whose name is not in `names` (a later load reads it again)."""
        for key in [k for k in self._loaded if k[1] not in names]:
            del self._loaded[key]


class Cohort:
    """The records and lazily loaded payloads of a union of source parts, in part order."""

    def __init__(self, parts: Sequence[CohortPart], cache: PayloadCache) -> None:
        self.parts = tuple(parts)
        self.cache = cache
        self.records: list[SampleRecord] = [p.source.index.samples[i] for p in self.parts for i in p.positions]
        self.sample_ids = [r.sample_id for r in self.records]
        # a negative length is reported by the sample stage; here it only must not break the layout
        self.lengths = torch.tensor([max(r.response_length, 0) for r in self.records], dtype=torch.int64)
        self._part_cohorts: dict[int, Cohort] = {}
        self._row_indexes: dict[int, dict[int, int]] = {}

    @property
    def num_tokens(self) -> int:
        """Response tokens of the selected samples."""
        return int(self.lengths.sum())

    @cached_property
    def micro_batches(self) -> torch.Tensor:
        """Each sample's micro-batch as a dense id (numbered in order of first appearance): the records'
        micro_batch_id within the sample's rank (samples without one are one micro-batch of their rank)."""
        keys: dict[tuple[int | None, str | None], int] = {}
        ids = [
            keys.setdefault((p.source.rank, p.source.index.samples[i].micro_batch_id), len(keys))
            for p in self.parts
            for i in p.positions
        ]
        return torch.tensor(ids, dtype=torch.int64)

    @cached_property
    def token_layout(self) -> SampleLayout:
        """Layout of per-token values."""
        return SampleLayout.per_token(self.sample_ids, self.lengths)

    @cached_property
    def sample_layout(self) -> SampleLayout:
        """Layout of per-sample values."""
        return SampleLayout.per_sample(self.sample_ids)

    def has_payload(self, name: str) -> bool:
        """True when every part's source holds the payload."""
        return all(p.source.has_payload(name) for p in self.parts)

    def load(self, name: str) -> torch.Tensor:
        """The flat per-token payload over the cohort's samples."""
        chunks = [self.cache.load(p, name) for p in self.parts]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def expected_list(self, stage: str, key: str) -> tuple[torch.Tensor | None, list[str]]:
        """The per-sample expected list `stage.key` indexed down to the cohort, or the problems found.

        Each part's list is first checked against that source's full sample count, so a truncated list
        fails with both lengths instead of being compared on its prefix.
        """
        values: list[float] = []
        problems: list[str] = []
        for part in self.parts:
            stored = _expected_field(part.source.expected, stage, key)
            total = len(part.source.index.samples)
            if stored is None:
                problems.append(f"{part.rank_prefix}expected has no {stage}.{key}")
            elif not isinstance(stored, list):
                problems.append(f"{part.rank_prefix}expected {stage}.{key} is not a list")
            elif len(stored) != total:
                problems.append(
                    f"{part.rank_prefix}expected {stage}.{key} has {len(stored)} values, the bundle has {total} samples"
                )
            else:
                values.extend(_as_float(stored[i]) for i in part.positions)
        if problems:
            return None, problems
        return torch.tensor(values, dtype=torch.float32), []

    def expected_map(self, stage: str) -> dict[str, Any] | None:
        """The expected map of a cohort-level stage (single-part cohorts only: it is per rank)."""
        if len(self.parts) != 1:
            raise ValueError("a cohort-level expected map is per source")
        stored = self.parts[0].source.expected.get(stage)
        return stored if isinstance(stored, dict) else None

    def part(self, k: int) -> Cohort:
        """Part `k` alone, sharing the payload cache (made once)."""
        if k not in self._part_cohorts:
            self._part_cohorts[k] = Cohort([self.parts[k]], self.cache)
        return self._part_cohorts[k]

    def row_index(self, k: int) -> dict[int, int]:
        """Part `k`'s source positions -> their place among the part's samples (made once)."""
        if k not in self._row_indexes:
            self._row_indexes[k] = {p: i for i, p in enumerate(self.parts[k].positions)}
        return self._row_indexes[k]

    def token_range(self, k: int) -> slice:
        """Where part `k`'s tokens lie in the cohort's flat per-token tensors."""
        first = sum(len(p.positions) for p in self.parts[:k])
        start = int(self.lengths[:first].sum())
        return slice(start, start + int(self.lengths[first : first + len(self.parts[k].positions)].sum()))


def _expected_field(expected: dict[str, Any], stage: str, key: str) -> Any:
    section = expected.get(stage)
    return section.get(key) if isinstance(section, dict) else None


def _as_float(value: Any) -> float:
    # a JSON null where a number belongs is reported as a non-finite expected value, not skipped
    return math.nan if value is None else float(value)


__all__ = ["Cohort", "CohortPart", "PayloadCache"]
