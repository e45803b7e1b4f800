"""The replay report: per-stage verdicts, the first divergence, and its JSON and text renderings.

JSON numbers that are not finite (a NaN in an expected payload, an infinite loss) are rendered as the
strings "nan", "inf" and "-inf" so that `--json` always prints valid JSON and still says what was there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trajectory_replay.outcome import Outcome, Status

StageStatus = Literal["pass", "fail", "skipped"]

MAX_DIVERGENCES = 10
"""Concrete divergences listed per stage entry."""


@dataclass(frozen=True)
class Divergence:
    """One concrete mismatch: which field, where (sample, token offset inside its response), and by how much."""

    field: str
    sample_id: str | None
    token_offset: int | None
    expected: float | None
    actual: float | None
    abs_error: float | None

    def to_dict(self) -> dict[str, Any]:
        """The divergence object of `replay --json`."""
        return {
            "field": self.field,
            "sample_id": self.sample_id,
            "token_offset": self.token_offset,
            "expected": json_number(self.expected),
            "actual": json_number(self.actual),
            "abs_error": json_number(self.abs_error),
        }

    def render(self) -> str:
        """`field s-0 token 3: expected=... actual=... abs_err=...` (sample and token only where known)."""
        where = self.field
        if self.sample_id is not None:
            where += f" {self.sample_id}"
        if self.token_offset is not None:
            where += f" token {self.token_offset}"
        return (
            f"{where}: expected={format_number(self.expected)} actual={format_number(self.actual)} "
            f"abs_err={format_number(self.abs_error)}"
        )


@dataclass(frozen=True)
class StageResult:
    """The verdict of one stage (or of one rank of a per-rank stage)."""

    stage: str
    status: StageStatus
    message: str
    rank: int | None = None
    max_abs_error: float | None = None
    mismatch_count: int = 0
    divergences: tuple[Divergence, ...] = ()
    compared: int = 0
    """How many values the stage compared (a stage that passes having compared none has checked nothing)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What a stage measures whether it passes or not (rollout.mismatch: its metrics and worst tokens)."""
    evidence: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Per failed field: per-sample errors and the first divergent sample's values, for the HTML report only."""

    @property
    def failed(self) -> bool:
        """True when the stage ran and diverged."""
        return self.status == "fail"

    @property
    def label(self) -> str:
        """The stage name, with its rank when the stage ran per rank."""
        return self.stage if self.rank is None else f"{self.stage} (rank {self.rank})"

    def to_dict(self) -> dict[str, Any]:
        """The stage object of `replay --json`."""
        out = {
            "stage": self.stage,
            "rank": self.rank,
            "status": self.status,
            "message": self.message,
            "compared": self.compared,
            "max_abs_error": json_number(self.max_abs_error),
            "mismatch_count": self.mismatch_count,
            "divergences": [d.to_dict() for d in self.divergences],
        }
        if self.metrics:
            out["metrics"] = _json_ready(self.metrics)
        return out

    def render_metrics(self) -> list[str]:
        """The metrics as report lines: one of `name=value` pairs, then one per listed token."""
        if not self.metrics:
            return []
        scalars = [f"{k}={_plain(v)}" for k, v in self.metrics.items() if not isinstance(v, list)]
        lines = ["metrics: " + " ".join(scalars)] if scalars else []
        for name, rows in self.metrics.items():
            if isinstance(rows, list) and rows:
                lines.append(f"{name.replace('_', ' ')}:")
                lines.extend("  " + " ".join(f"{k}={_plain(v)}" for k, v in row.items()) for row in rows)
        return lines


def skipped(stage: str, message: str, rank: int | None = None) -> StageResult:
    """A stage that did not run; it never counts toward the first divergence."""
    return StageResult(stage=stage, status="skipped", message=message, rank=rank)


@dataclass(frozen=True)
class ReplayReport(Outcome):
    """Everything one replay found, in stage order; its status is pass (every compared value matched), diverged (a
    value differs) or unsupported (nothing that was asked was compared: every stage declared unsupported or
    skipped, an empty cohort, a stage asked for by name that did not run)."""

    finite_json = True

    bundle_id: str
    stages: tuple[StageResult, ...] = field(default_factory=tuple)
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields replayed with a value other than the recorded one (`replay --set`), field -> value."""
    requested: tuple[str, ...] = ()
    """The stages asked for by name (`--stage`); empty when every contracted stage was asked for."""

    @property
    def compared(self) -> int:
        """How many values the stages that ran compared, over all stages and ranks."""
        return sum(s.compared for s in self.stages if s.status != "skipped")

    @property
    def unsupported_reason(self) -> str | None:
        """Why this replay checked nothing that was asked, or None when it did (a divergence always checked)."""
        if any(s.failed for s in self.stages):
            return None
        return unchecked_reason(self.stages, self.requested)

    @property
    def reason(self) -> str | None:
        return self.unsupported_reason

    @property
    def status(self) -> Status:
        """pass, diverged, or unsupported (nothing that was asked was compared): never pass without a value."""
        if any(s.failed for s in self.stages):
            return Status.DIVERGED
        return Status.UNSUPPORTED if self.unsupported_reason is not None else Status.PASS

    @property
    def passed(self) -> bool:
        """True only when values were compared and none diverged."""
        return self.status is Status.PASS

    @property
    def first_divergent_stage(self) -> str | None:
        """The first failed stage in stage order, or None."""
        return next((s.stage for s in self.stages if s.failed), None)

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        """{bundle, stage, rank, sample, field, token} of the first failure, or None."""
        failed = next((s for s in self.stages if s.failed), None)
        return None if failed is None else divergence_place(self.bundle_id, failed)

    def stage(self, stage: str, rank: int | None = None) -> StageResult:
        """The entry of `stage` (and `rank`); KeyError when it is not in the report."""
        for s in self.stages:
            if s.stage == stage and s.rank == rank:
                return s
        raise KeyError(f"no report entry for stage {stage!r} rank {rank!r}")

    def to_dict(self) -> dict[str, Any]:
        """The `replay --json` object, JSON-ready (non-finite numbers as strings). A chained replay's object has the
        same keys, and more (`ChainReport.to_dict`)."""
        return {
            "status": self.status,
            "bundle_id": self.bundle_id,
            "passed": self.passed,
            "first_divergent_stage": self.first_divergent_stage,
            "first_divergence": self.first_divergence,
            "reason": self.unsupported_reason,
            "compared": self.compared,
            "config_overrides": dict(self.overrides),
            "stages": [{"bundle": self.bundle_id, **s.to_dict()} for s in self.stages],
        }

    def to_json(self, indent: int | None = None) -> str:
        """`to_dict()` serialized; always valid JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def headline(self) -> str:
        """The report's first line: the first divergent stage, or why nothing was checked."""
        reason = self.unsupported_reason
        if reason is not None:
            return f"bundle {self.bundle_id} — unsupported: nothing compared ({reason})"
        return f"bundle {self.bundle_id} — first divergent stage: {self.first_divergent_stage or 'none'}"

    def render_text(self) -> str:
        """The human-readable report: headline, one line per stage, then each stage's divergences."""
        lines = [self.headline()]
        if self.overrides:
            lines.append(
                "config overridden (not as recorded): "
                + ", ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides.items())
            )
        lines.extend(render_stage_lines(self.stages))
        return "\n".join(lines)


def render_stage_lines(stages: Sequence[StageResult]) -> list[str]:
    """One line per stage (its verdict, message and errors), then its metrics and divergences, indented."""
    lines = []
    for s in stages:
        line = f"[{s.status:>7}] {s.label}  {s.message}"
        if s.status != "skipped":
            line += f", max_abs_error={format_number(s.max_abs_error)}, mismatches={s.mismatch_count}"
        lines.append(line)
        lines.extend(f"          {m}" for m in s.render_metrics())
        lines.extend(f"          {d.render()}" for d in s.divergences)
    return lines


def unchecked_reason(stages: Sequence[StageResult], requested: Sequence[str] = ()) -> str | None:
    """Why `stages` (none failed) checked nothing that was asked: a stage asked for by name that did not run, every
    stage skipped, or stages that ran and compared no value; None when values were compared."""
    for name in requested:
        entries = [s for s in stages if s.stage == name]
        if entries and all(s.status == "skipped" for s in entries):
            return f"stage {name} was asked for and skipped: {entries[0].message}"
    if not stages:
        return "the bundle contracts no stage"
    if all(s.status == "skipped" for s in stages):
        reasons = list(dict.fromkeys(s.message.split(";")[0] for s in stages))  # "...; recorded values passed"
        return f"every stage was skipped: {'; '.join(reasons[:3])}" + (
            f"; and {len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
        )
    if sum(s.compared for s in stages if s.status != "skipped") == 0:
        ran = ", ".join(dict.fromkeys(s.stage for s in stages if s.status != "skipped"))
        return f"the stages that ran ({ran}) had no value to compare (an empty cohort?)"
    return None


def divergence_place(bundle: str, result: StageResult) -> dict[str, Any]:
    """{bundle, stage, rank, sample, field, token} of a failed stage's first divergence (sample, field and token
    null when the failure is not a value)."""
    d = result.divergences[0] if result.divergences else None
    return {
        "bundle": bundle,
        "stage": str(result.stage),
        "rank": result.rank,
        "sample": d.sample_id if d else None,
        "field": d.field if d else None,
        "token": d.token_offset if d else None,
    }


def _plain(value: Any) -> str:
    """A metric value as text: names and counts as they are, measurements as format_number prints them."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    return format_number(value)


def _json_ready(value: Any) -> Any:
    """Nested metrics with every non-finite float as json_number renders it."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    return json_number(value) if isinstance(value, float) else value


def json_number(value: float | None) -> float | str | None:
    """A float for JSON: finite values as is, NaN/Inf as "nan"/"inf"/"-inf", None as null."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def format_number(value: float | None) -> str:
    """Up to 6 significant digits; integral values keep one decimal (`-1.0`), like Python's repr."""
    if value is None:
        return "n/a"
    text = f"{value:.6g}"
    if text.lstrip("-").isdigit():
        text += ".0"
    return text


__all__ = [
    "Divergence",
    "MAX_DIVERGENCES",
    "ReplayReport",
    "StageResult",
    "StageStatus",
    "divergence_place",
    "format_number",
    "json_number",
    "render_stage_lines",
    "skipped",
    "unchecked_reason",
]
