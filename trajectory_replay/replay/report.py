"""The replay report: per-stage verdicts, the first divergence, and its JSON and text renderings.

JSON numbers that are not finite (a NaN in an expected payload, an infinite loss) are rendered as the
strings "nan", "inf" and "-inf" so that `--json` always prints valid JSON and still says what was there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

StageStatus = Literal["pass", "fail", "skipped"]

MAX_DIVERGENCES = 10
"""Concrete divergences listed per stage entry."""


@dataclass(frozen=True)
class Divergence:
    """One concrete mismatch: which field, where (sample, token offset inside its response), and by how much."""

    field: str
    sample_id: Optional[str]
    token_offset: Optional[int]
    expected: Optional[float]
    actual: Optional[float]
    abs_error: Optional[float]

    def to_dict(self) -> dict[str, Any]:
        """The divergence object of `replay --json`."""
        return {"field": self.field, "sample_id": self.sample_id, "token_offset": self.token_offset,
                "expected": json_number(self.expected), "actual": json_number(self.actual),
                "abs_error": json_number(self.abs_error)}

    def render(self) -> str:
        """`field s-0 token 3: expected=... actual=... abs_err=...` (sample and token only where known)."""
        where = self.field
        if self.sample_id is not None:
            where += f" {self.sample_id}"
        if self.token_offset is not None:
            where += f" token {self.token_offset}"
        return (f"{where}: expected={format_number(self.expected)} actual={format_number(self.actual)} "
                f"abs_err={format_number(self.abs_error)}")


@dataclass(frozen=True)
class StageResult:
    """The verdict of one stage (or of one rank of a per-rank stage)."""

    stage: str
    status: StageStatus
    message: str
    rank: Optional[int] = None
    max_abs_error: Optional[float] = None
    mismatch_count: int = 0
    divergences: tuple[Divergence, ...] = ()
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
        out = {"stage": self.stage, "rank": self.rank, "status": self.status, "message": self.message,
               "max_abs_error": json_number(self.max_abs_error), "mismatch_count": self.mismatch_count,
               "divergences": [d.to_dict() for d in self.divergences]}
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


def skipped(stage: str, message: str, rank: Optional[int] = None) -> StageResult:
    """A stage that did not run; it never counts toward the first divergence."""
    return StageResult(stage=stage, status="skipped", message=message, rank=rank)


@dataclass(frozen=True)
class ReplayReport:
    """Everything one replay found, in stage order."""

    bundle_id: str
    stages: tuple[StageResult, ...] = field(default_factory=tuple)
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields replayed with a value other than the recorded one (`replay --set`), field -> value."""

    @property
    def passed(self) -> bool:
        """True when no stage that ran diverged."""
        return not any(s.failed for s in self.stages)

    @property
    def first_divergent_stage(self) -> Optional[str]:
        """The first failed stage in stage order, or None."""
        return next((s.stage for s in self.stages if s.failed), None)

    @property
    def exit_code(self) -> int:
        """0 when the replay passed, else 1 (the documented exit codes)."""
        return 0 if self.passed else 1

    def stage(self, stage: str, rank: Optional[int] = None) -> StageResult:
        """The entry of `stage` (and `rank`); KeyError when it is not in the report."""
        for s in self.stages:
            if s.stage == stage and s.rank == rank:
                return s
        raise KeyError(f"no report entry for stage {stage!r} rank {rank!r}")

    def to_dict(self) -> dict[str, Any]:
        """The `replay --json` object, JSON-ready (non-finite numbers as strings)."""
        return {"bundle_id": self.bundle_id, "passed": self.passed,
                "first_divergent_stage": self.first_divergent_stage,
                "config_overrides": dict(self.overrides),
                "stages": [s.to_dict() for s in self.stages]}

    def to_json(self, indent: Optional[int] = None) -> str:
        """`to_dict()` serialized; always valid JSON."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def render_text(self) -> str:
        """The human-readable report: headline, one line per stage, then each stage's divergences."""
        lines = [f"bundle {self.bundle_id} — first divergent stage: {self.first_divergent_stage or 'none'}"]
        if self.overrides:
            lines.append("config overridden (not as recorded): "
                         + ", ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides.items()))
        for s in self.stages:
            line = f"[{s.status:>7}] {s.label}  {s.message}"
            if s.status != "skipped":
                line += f", max_abs_error={format_number(s.max_abs_error)}, mismatches={s.mismatch_count}"
            lines.append(line)
            lines.extend(f"          {m}" for m in s.render_metrics())
            lines.extend(f"          {d.render()}" for d in s.divergences)
        return "\n".join(lines)


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


def json_number(value: Optional[float]) -> Optional[float | str]:
    """A float for JSON: finite values as is, NaN/Inf as "nan"/"inf"/"-inf", None as null."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def format_number(value: Optional[float]) -> str:
    """Up to 6 significant digits; integral values keep one decimal (`-1.0`), like Python's repr."""
    if value is None:
        return "n/a"
    text = f"{value:.6g}"
    if text.lstrip("-").isdigit():
        text += ".0"
    return text


__all__ = ["Divergence", "MAX_DIVERGENCES", "ReplayReport", "StageResult", "StageStatus", "format_number",
           "json_number", "skipped"]
