"""Streaming replay: a cohort cut into blocks of whole prompt groups, each replayed alone, results merged.

A bundle too large to hold in memory (a production step of 512 prompts x 16 samples x 8K tokens) is
replayed block by block: every stage runs on one block's rows (read with ranged reads, only those rows),
then the next block's; nothing per-token outlives its block. What spans the cohort is carried from block
to block in a form that does not depend on the cut:

- a field comparison keeps its counts, its largest error, the flat positions of its first divergences and
  of its first non-finite values, and each sample's largest error; `merge_findings` maps those positions
  back into the cohort and rebuilds exactly the comparison one block over the whole cohort makes;
- the loss stages keep per-sample masked sums and token counts (`losses.LossSums`), the mismatch stage
  per-sample log-ratio sums (`mismatch.MismatchSums`), put together by position before the scalars are
  taken;
- whitened estimators (reinforce_plus_plus, its baseline variant, gae) need the cohort's mean and
  variance before any block's advantages: a first pass collects per-sample moments
  (`kernels.Moments`), the second replays with the cohort's statistics.

So the report of a streamed replay equals that of the replay in one block, field for field. A block is
a set of whole prompt groups (a sample without a group_index is a group of its own): never cut in the
middle of a group, whatever its members' positions in the bundle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trajectory_replay.replay.cohort import Cohort, CohortPart, PayloadCache
from trajectory_replay.replay.compare import FieldComparison, StageChecks, nonfinite_problem
from trajectory_replay.replay.report import MAX_DIVERGENCES, Divergence

BLOCK_TOKENS = 1 << 22
"""Tokens per block when a replay streams (4M: 16 MiB per float32 payload; a block's payloads and the next block's,
read meanwhile, stay within a few hundred MiB)."""

STREAM_TOKENS = 1 << 25
"""A pass over more tokens than this streams (about 128 MiB per float32 payload); a smaller one runs in one block."""


@dataclass(frozen=True, eq=False)
class Block:
    """Some whole groups of a cohort, as a cohort of their own, and where its samples lie in the whole."""

    cohort: Cohort
    index: torch.Tensor
    """For each of the block's samples, its position among the whole cohort's samples (increasing)."""
    starts: torch.Tensor
    """For each of the block's samples, where its tokens start in the whole cohort's per-token layout."""

    def to_whole(self, flat: int) -> int:
        """A flat per-token position of the block's, in the whole cohort's per-token layout."""
        local = self.cohort.token_layout.starts
        assert local is not None
        # zero-length responses share a start; right=True lands on the last, the one holding the token
        owner = int(torch.searchsorted(local, torch.tensor([flat]), right=True)[0]) - 1
        return int(self.starts[owner]) + flat - int(local[owner])

    def part(self, k: int, whole: Cohort) -> tuple[Block, slice] | None:
        """The block's rows of the whole cohort's part `k`, as a block of that part alone, and where their tokens
        lie in the block's per-token values (None when the block has none of the part's rows)."""
        wanted = whole.parts[k]
        for j, part in enumerate(self.cohort.parts):
            if part.source is wanted.source:
                part_rows = whole.row_index(k)
                index = torch.tensor([part_rows[p] for p in part.positions], dtype=torch.int64)
                whole_part = whole.part(k)
                starts = whole_part.token_layout.starts
                assert starts is not None
                return Block(self.cohort.part(j), index, starts[index]), self.cohort.token_range(j)
        return None


def whole_block(cohort: Cohort) -> Block:
    """The cohort as its only block."""
    starts = cohort.token_layout.starts
    assert starts is not None
    return Block(cohort, torch.arange(len(cohort.records), dtype=torch.int64), starts)


def plan_blocks(cohort: Cohort, block_tokens: int) -> list[Block]:
    """The cohort cut into blocks of whole groups of about `block_tokens` tokens (a group larger than that is a
    block alone), groups in order of their first sample; each block's samples in cohort order. One block when
    everything fits."""
    if cohort.num_tokens <= block_tokens:
        return [whole_block(cohort)]
    members: dict[object, list[int]] = {}
    for i, record in enumerate(cohort.records):
        key = ("group", record.group_index) if record.group_index is not None else ("alone", i)
        members.setdefault(key, []).append(i)
    lengths = cohort.lengths.tolist()
    chosen: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for group in members.values():
        size = sum(lengths[i] for i in group)
        if current and tokens + size > block_tokens:
            chosen.append(current)
            current, tokens = [], 0
        current.extend(group)
        tokens += size
    if current:
        chosen.append(current)
    if len(chosen) == 1:
        return [whole_block(cohort)]
    return [_block(cohort, sorted(rows)) for rows in chosen]


def _block(cohort: Cohort, rows: list[int]) -> Block:
    """The cohort's samples `rows` (increasing) as a block, part by part, reading through a cache of its own."""
    offsets, parts = 0, []
    wanted = iter(rows)
    upcoming = next(wanted, None)
    for part in cohort.parts:
        picked = []
        end = offsets + len(part.positions)
        while upcoming is not None and upcoming < end:
            picked.append(part.positions[upcoming - offsets])
            upcoming = next(wanted, None)
        if picked:
            parts.append(CohortPart(part.source, tuple(picked)))
        offsets = end
    index = torch.tensor(rows, dtype=torch.int64)
    starts = cohort.token_layout.starts
    assert starts is not None
    return Block(Cohort(parts, PayloadCache()), index, starts[index])


# --------------------------------------------------------------------------- merging


@dataclass
class Merged:
    """A stage's findings block after block, merged into those of its whole cohort by `merge_findings`."""

    pieces: dict[str, list[tuple[FieldComparison, Block]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)

    def add(self, findings: StageChecks, block: Block) -> None:
        for comparison in findings.comparisons:
            self.pieces.setdefault(comparison.field, []).append((comparison, block))
        for problem in findings.problems:
            if problem not in self.problems:  # the same structural problem in every block is one problem
                self.problems.append(problem)
        self.divergences.extend(findings.divergences)

    def findings(self, whole: Cohort) -> StageChecks:
        """The findings of the whole cohort."""
        return StageChecks(
            comparisons=[merge_comparison(name, pieces, whole) for name, pieces in self.pieces.items()],
            problems=list(self.problems),
            divergences=list(self.divergences),
        )


def merge_comparison(name: str, pieces: Sequence[tuple[FieldComparison, Block]], whole: Cohort) -> FieldComparison:
    """One field's comparisons over blocks, as the comparison over the whole cohort (per-token or per-sample
    values, told apart by the pieces' layouts)."""
    if len(pieces) == 1 and len(pieces[0][1].index) == len(whole.records):
        return pieces[0][0]
    per_token = pieces[0][0].per_token
    layout = whole.token_layout if per_token else whole.sample_layout
    located: list[tuple[int, Divergence]] = []
    nonfinite: dict[str, list] = {}
    problems: list[str] = []
    errors = torch.zeros(len(whole.records), dtype=torch.float32)
    first: tuple[int, dict] | None = None
    for comparison, block in pieces:
        if comparison.problems and not comparison.compared:  # a length mismatch: nothing compared
            problems.extend(p for p in comparison.problems if p not in problems)
            continue
        to_whole = block.to_whole if per_token else (lambda p, b=block: int(b.index[p]))
        located += [(to_whole(p), d) for p, d in zip(comparison.positions, comparison.divergences)]
        for side, at, value, count in comparison.nonfinite:
            seen = nonfinite.setdefault(side, [None, 0.0, 0])
            where = to_whole(at)
            if seen[0] is None or where < seen[0]:
                seen[0], seen[1] = where, value
            seen[2] += count
        if comparison.sample_errors is not None:
            errors[block.index] = comparison.sample_errors.to(torch.float32)
        if comparison.evidence is not None:
            at = to_whole(comparison.positions[0])
            if first is None or at < first[0]:
                first = (at, comparison.evidence["first_sample"])
    located.sort(key=lambda pair: pair[0])
    for side in ("expected", "actual"):
        if side in nonfinite:
            at, value, count = nonfinite[side]
            problems.append(nonfinite_problem(name, side, value, layout.locate(torch.tensor([at]))[0], count))
    count = sum(c.mismatch_count for c, _ in pieces)
    maxima = [c.max_abs_error for c, _ in pieces if c.max_abs_error is not None]
    evidence = None
    if count and first is not None:
        evidence = {
            "sample_errors": {sid: float(v) for sid, v in zip(whole.sample_ids, errors.tolist())},
            "first_sample": first[1],
        }
    return FieldComparison(
        field=name,
        compared=sum(c.compared for c, _ in pieces),
        mismatch_count=count,
        max_abs_error=max(maxima) if maxima else None,
        divergences=tuple(d for _, d in located[:MAX_DIVERGENCES]),
        problems=tuple(problems),
        evidence=evidence,
        positions=tuple(p for p, _ in located[:MAX_DIVERGENCES]),
    )


__all__ = ["BLOCK_TOKENS", "Block", "Merged", "STREAM_TOKENS", "merge_comparison", "plan_blocks", "whole_block"]
