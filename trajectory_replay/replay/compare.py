"""Comparison of recomputed values against expected ones, with the V1 flaws fixed.

A value mismatches when |actual - expected| > atol + rtol * |expected| (float32, flat). A non-finite
value on either side is always a mismatch and is named (which side, where): V1 let a NaN in an expected
payload pass. A length mismatch fails with both lengths and compares nothing: V1 passed a truncated
expected list on its prefix. Every mismatch is mapped back to (sample_id, token offset in its response).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy
import torch

from trajectory_replay.bundle.schema import Manifest
from trajectory_replay.replay.kernels import sample_blocks
from trajectory_replay.replay.report import MAX_DIVERGENCES, Divergence, StageResult, format_number

DEFAULT_ATOL = 1e-6
DEFAULT_RTOL = 1e-5


@dataclass(frozen=True)
class Tolerances:
    """The absolute and relative tolerance one stage is compared with."""

    atol: float = DEFAULT_ATOL
    rtol: float = DEFAULT_RTOL


EXACT = Tolerances(atol=0.0, rtol=0.0)


def resolve_tolerance(
    manifest: Manifest, stage: str, atol: float | None = None, rtol: float | None = None
) -> Tolerances:
    """Tolerance of `stage`: explicit overrides, else the manifest's comparison policy, else the defaults."""
    policy = manifest.comparison_policy.tolerances.get(str(stage))
    policy_atol = policy.atol if policy is not None else None
    policy_rtol = policy.rtol if policy is not None else None
    return Tolerances(atol=_first(atol, policy_atol, DEFAULT_ATOL), rtol=_first(rtol, policy_rtol, DEFAULT_RTOL))


def _first(*values: float | None) -> float:
    return next(float(v) for v in values if v is not None)


@dataclass(frozen=True)
class SampleLayout:
    """Maps a flat position to (sample_id, token_offset) for per-token, per-sample or scalar values."""

    sample_ids: tuple[str, ...] = ()
    starts: torch.Tensor | None = None
    """First flat position of each sample's response (int64); None for per-sample values."""
    scalar: bool = False

    @classmethod
    def per_token(cls, sample_ids: Sequence[str], lengths: torch.Tensor) -> SampleLayout:
        """Layout of a flat concatenation of responses with the given lengths."""
        starts = torch.zeros(len(sample_ids), dtype=torch.int64)
        if len(sample_ids) > 1:
            torch.cumsum(lengths[:-1].to(torch.int64), 0, out=starts[1:])
        return cls(sample_ids=tuple(sample_ids), starts=starts)

    @classmethod
    def per_sample(cls, sample_ids: Sequence[str]) -> SampleLayout:
        """Layout of one value per sample."""
        return cls(sample_ids=tuple(sample_ids))

    def locate(self, positions: torch.Tensor) -> list[tuple[str | None, int | None]]:
        """(sample_id, token_offset) of each flat position; offsets are None for per-sample values."""
        if self.scalar or not self.sample_ids:
            return [(None, None)] * positions.numel()
        if self.starts is None:
            return [(self.sample_ids[min(int(p), len(self.sample_ids) - 1)], None) for p in positions]
        # zero-length responses share a start; right=True lands on the last, the one holding the token
        owners = torch.searchsorted(self.starts, positions, right=True).sub_(1).clamp_(min=0)
        return [(self.sample_ids[int(o)], int(p) - int(self.starts[o])) for o, p in zip(owners, positions)]


SCALAR = SampleLayout(scalar=True)


@dataclass(frozen=True)
class FieldComparison:
    """The comparison of one field: counts, the largest finite error, concrete divergences, problems."""

    field: str
    compared: int
    mismatch_count: int = 0
    max_abs_error: float | None = None
    divergences: tuple[Divergence, ...] = ()
    problems: tuple[str, ...] = ()
    evidence: dict | None = None
    """For a field with mismatches: each sample's largest error (`sample_errors`, sample id -> error, NaN where a
    value is not finite) and the first divergent sample's values (`first_sample`: sample, expected, actual,
    divergent token offsets). What the HTML report draws; never part of the JSON report."""
    per_token: bool = False
    """The values compared are per token (else per sample, or one scalar)."""
    positions: tuple[int, ...] = ()
    """Flat positions of `divergences` (where they lie in the compared tensors)."""
    nonfinite: tuple[tuple[str, int, float, int], ...] = ()
    """Per side with a non-finite value: (side, flat position of the first, its value, how many)."""
    sample_errors: torch.Tensor | None = None
    """Each sample's largest error (NaN where a value is not finite), when asked for (a streamed replay merges
    its blocks' evidence from them)."""

    @property
    def failed(self) -> bool:
        """True when any value mismatched or the field could not be compared."""
        return bool(self.mismatch_count or self.problems)

    def summary(self) -> str:
        """One line: the problems, the mismatch count, or how many values matched."""
        parts = list(self.problems)
        if self.compared == 1 and self.divergences:  # a scalar: say both values
            d = self.divergences[0]
            parts.append(f"{self.field}: expected {format_number(d.expected)}, actual {format_number(d.actual)}")
        elif self.mismatch_count:
            parts.append(f"{self.field}: {self.mismatch_count} of {self.compared} values differ")
        if parts:
            return "; ".join(parts)
        return f"{self.field} matches" if self.compared == 1 else f"{self.field}: {self.compared} values match"


def compare_tensors(
    field: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    layout: SampleLayout,
    tol: Tolerances,
    *,
    sample_errors: bool = False,
) -> FieldComparison:
    """Compare two flat tensors as float32 under `tol`; vectorised, mismatches located through `layout`
    (`sample_errors`: also keep each sample's largest error, mismatched or not)."""
    e = expected.reshape(-1).to(torch.float32)
    a = actual.reshape(-1).to(torch.float32)
    if e.numel() != a.numel():
        return FieldComparison(
            field=field, compared=0, problems=(f"{field}: expected has {e.numel()} values, actual has {a.numel()}",)
        )
    within = _within_atol(e, a, layout, tol.atol, sample_errors)
    if within is not None:
        within_err, within_errors = within
        return FieldComparison(
            field=field,
            compared=e.numel(),
            max_abs_error=within_err,
            per_token=layout.starts is not None and not layout.scalar,
            sample_errors=within_errors,
        )
    diff = torch.sub(a, e).abs_()
    max_err = float(diff.max()) if e.numel() else None  # NaN anywhere makes the max NaN
    problems: list[str] = []
    nonfinite: list[tuple[str, int, float, int]] = []
    finite_diff = max_err is not None and math.isfinite(max_err)
    if max_err is None or max_err <= tol.atol:
        bad = None  # every error within atol <= the bound: all match
    else:
        bad = diff > e.abs().mul_(tol.rtol).add_(tol.atol)
        if not math.isfinite(max_err):
            # NaN never compares greater and inf - inf is NaN: add every non-finite value explicitly
            finite_e, finite_a = torch.isfinite(e), torch.isfinite(a)
            bad |= ~(finite_e & finite_a)
            max_err = float(diff.masked_fill_(~torch.isfinite(diff), 0.0).max())
            for side, finite, values in (("expected", finite_e, e), ("actual", finite_a, a)):
                bad_side = (~finite).nonzero().flatten()
                if bad_side.numel():
                    at = int(bad_side[0])
                    nonfinite.append((side, at, float(values[at]), bad_side.numel()))
            problems.extend(
                nonfinite_problem(field, side, value, layout.locate(torch.tensor([at]))[0], n)
                for side, at, value, n in nonfinite
            )
    count = 0 if bad is None else int(torch.count_nonzero(bad))  # a bool sum would widen every element to int64
    errors = None
    if (count or sample_errors) and layout.sample_ids and not layout.scalar:
        # every difference finite: each sample's largest is a max over the differences already taken
        errors = _segment_max(diff, layout) if finite_diff else _sample_errors(e, a, layout)
    del diff
    positions = torch.zeros(0, dtype=torch.int64) if bad is None else bad.nonzero().flatten()[:MAX_DIVERGENCES]
    divergences = tuple(
        Divergence(
            field=field,
            sample_id=sid,
            token_offset=tok,
            expected=float(e[p]),
            actual=float(a[p]),
            abs_error=abs(float(a[p]) - float(e[p])),
        )
        for p, (sid, tok) in zip(positions, layout.locate(positions))
    )
    evidence = _evidence(e, a, bad, layout, errors) if count and bad is not None and errors is not None else None
    return FieldComparison(
        field=field,
        compared=e.numel(),
        mismatch_count=count,
        max_abs_error=max_err,
        divergences=divergences,
        problems=tuple(problems),
        evidence=evidence,
        per_token=layout.starts is not None and not layout.scalar,
        positions=tuple(positions.tolist()),
        nonfinite=tuple(nonfinite),
        sample_errors=errors if sample_errors else None,
    )


CHUNK_TOKENS = 1 << 16
"""Tokens per step of the chunked check of `_within_atol`: its buffer stays in the CPU's cache."""


def _within_atol(
    e: torch.Tensor, a: torch.Tensor, layout: SampleLayout, atol: float, sample_errors: bool
) -> tuple[float, torch.Tensor | None] | None:
    """(largest error, each sample's largest error when `sample_errors`) when every |a - e| of a long per-token
    pair is finite and within atol, so that every value matches: the common case, checked chunk by chunk of whole
    samples in one small reused buffer instead of tensors as long as the inputs. None otherwise, and for short or
    per-sample inputs: the full comparison then runs and says what differs."""
    n = e.numel()
    if (
        n < 2 * CHUNK_TOKENS
        or layout.starts is None
        or layout.scalar
        or len(layout.sample_ids) != layout.starts.numel()
    ):
        return None
    lengths = torch.diff(layout.starts, append=torch.tensor([n]))
    blocks = list(sample_blocks(lengths, CHUNK_TOKENS))
    buffer = torch.empty(max(end - start for _, _, start, end in blocks), dtype=torch.float32)
    errors = numpy.zeros(lengths.numel(), dtype=numpy.float32) if sample_errors and layout.sample_ids else None
    starts, present = layout.starts.numpy(), (lengths > 0).numpy()
    largest = 0.0
    for first, last, start, end in blocks:
        if end == start:
            continue
        diff = buffer[: end - start]
        torch.sub(a[start:end], e[start:end], out=diff).abs_()
        worst = float(diff.max())
        if not worst <= atol:  # a NaN fails this too
            return None
        largest = max(largest, worst)
        if errors is not None:  # each sample's largest error; an empty response's stays 0
            keep = present[first:last]
            at = starts[first:last][keep] - start
            errors[first:last][keep] = numpy.maximum.reduceat(diff.numpy(), at)
    return largest, None if errors is None else torch.from_numpy(errors)


MAX_EVIDENCE_TOKENS = 4096
"""Tokens of the first divergent sample kept for the HTML report's per-token plot."""


def _sample_errors(e: torch.Tensor, a: torch.Tensor, layout: SampleLayout) -> torch.Tensor:
    """Each sample's largest |actual - expected| (NaN where a value is not finite; 0 for an empty response)."""
    diff = torch.sub(a, e).abs_()
    diff[~(torch.isfinite(a) & torch.isfinite(e))] = float("nan")
    if layout.starts is None:  # one value per sample
        return diff
    # a non-finite value marks its sample NaN: taken as +inf through the max, then turned back
    errors = _segment_max(diff.nan_to_num(nan=float("inf")), layout)
    return torch.where(errors == float("inf"), float("nan"), errors)


def _segment_max(diff: torch.Tensor, layout: SampleLayout) -> torch.Tensor:
    """Each sample's largest value of `diff` (finite, flat in `layout`; 0 for an empty response)."""
    if layout.starts is None:  # one value per sample
        return diff.clone()
    lengths = torch.diff(layout.starts, append=torch.tensor([diff.numel()]))
    errors = torch.segment_reduce(diff, "max", lengths=lengths, unsafe=True)
    errors[lengths == 0] = 0.0
    return errors


def _evidence(e: torch.Tensor, a: torch.Tensor, bad: torch.Tensor, layout: SampleLayout, errors: torch.Tensor) -> dict:
    """Per-sample largest errors and the first divergent sample's values, for a field that mismatched."""
    ids = layout.sample_ids
    at = int(bad.nonzero()[0])
    if layout.starts is None:
        first, rows = at, (at, at + 1)
    else:
        first = int(torch.searchsorted(layout.starts, torch.tensor([at]), right=True)[0]) - 1
        start = int(layout.starts[first])
        end = int(layout.starts[first + 1]) if first + 1 < len(ids) else e.numel()
        rows = (start, min(end, start + MAX_EVIDENCE_TOKENS))
    lo, hi = rows
    return {
        "sample_errors": {sid: float(v) for sid, v in zip(ids, errors.tolist())},
        "first_sample": {
            "sample_id": ids[first],
            "expected": e[lo:hi].tolist(),
            "actual": a[lo:hi].tolist(),
            "divergent": bad[lo:hi].nonzero().flatten().tolist(),
        },
    }


def nonfinite_problem(field: str, side: str, value: float, where: tuple[str | None, int | None], count: int) -> str:
    """The problem a non-finite value makes: which side, its value, where the first is, how many."""
    sid, tok = where
    at = "" if sid is None else f" at {sid}" + ("" if tok is None else f" token {tok}")
    return f"{field}: {side} value is {value}{at} ({count} non-finite)"


def compare_scalar(field: str, expected: float, actual: float, tol: Tolerances) -> FieldComparison:
    """Compare one cohort-level scalar (no sample, no token)."""
    return compare_tensors(
        field, torch.tensor([expected], dtype=torch.float64), torch.tensor([actual], dtype=torch.float64), SCALAR, tol
    )


@dataclass
class StageChecks:
    """One stage's checks so far: its field comparisons, its structural problems and their divergences; `result`
    makes them the stage's StageResult."""

    comparisons: list[FieldComparison] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)

    def add(self, comparison: FieldComparison) -> FieldComparison:
        """Record a field comparison and return it."""
        self.comparisons.append(comparison)
        return comparison

    def problem(self, message: str, divergence: Divergence | None = None) -> None:
        """Record a failure that is not a numeric mismatch (e.g. a sample with no group_index)."""
        self.problems.append(message)
        if divergence is not None:
            self.divergences.append(divergence)

    @property
    def failed(self) -> bool:
        """True when anything failed so far."""
        return bool(self.problems) or any(c.failed for c in self.comparisons)

    def result(
        self, stage: str, rank: int | None = None, passed_message: str = "", metrics: dict | None = None
    ) -> StageResult:
        """The stage verdict: failures first in the message, divergences capped at MAX_DIVERGENCES."""
        errors = [e for e in (c.max_abs_error for c in self.comparisons) if e is not None]
        divergences = (self.divergences + [d for c in self.comparisons for d in c.divergences])[:MAX_DIVERGENCES]
        if self.failed:
            message = "; ".join(self.problems + [c.summary() for c in self.comparisons if c.failed])
        else:
            message = "; ".join([passed_message] * bool(passed_message) + [c.summary() for c in self.comparisons])
        evidence = {c.field: c.evidence for c in self.comparisons if c.evidence is not None}
        return StageResult(
            stage=stage,
            rank=rank,
            status="fail" if self.failed else "pass",
            message=message or "ok",
            max_abs_error=max(errors) if errors else None,
            mismatch_count=sum(c.mismatch_count for c in self.comparisons),
            compared=sum(c.compared for c in self.comparisons),
            divergences=tuple(divergences),
            metrics=dict(metrics or {}),
            evidence=evidence,
        )


__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "EXACT",
    "FieldComparison",
    "StageChecks",
    "SCALAR",
    "SampleLayout",
    "Tolerances",
    "compare_scalar",
    "compare_tensors",
    "nonfinite_problem",
    "resolve_tolerance",
]
