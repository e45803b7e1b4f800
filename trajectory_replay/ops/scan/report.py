"""What a scan found: every bundle's verdict in anchor order, the counts, the earliest divergence; as text and
as the `--json` object."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from trajectory_replay.ops.ls import trigger_brief
from trajectory_replay.ops.scan.verdicts import (
    DIVERGED,
    ERROR,
    INCOMPLETE,
    INVALID,
    PASS,
    UNSUPPORTED,
    VERDICT_STATUSES,
    Verdict,
)
from trajectory_replay.outcome import Outcome, Status


@dataclass
class ScanReport(Outcome):
    """What a scan found. Its status is the worst verdict: diverged, then invalid (a bundle that could not be judged
    counts as invalid), incomplete, unsupported; pass when every bundle passed."""

    finite_json = True

    root: str
    engine: str
    workers: int
    replay_version: str
    options: dict[str, Any]
    verdicts: list[Verdict] = dc_field(default_factory=list)
    """Every bundle, in anchor order."""
    finalized: list[str] = dc_field(default_factory=list)
    replayed: int = 0
    cached: int = 0
    seconds: float = 0.0
    engine_start_seconds: float = 0.0
    """Time the engine took to start (Ray: connecting to or starting a cluster), included in `seconds`."""
    forced: bool = False
    unkept: list[str] = dc_field(default_factory=list)
    """'<bundle>: why' for each verdict reached but not kept in the store (a store this user cannot write)."""
    triggers: list[dict[str, Any]] = dc_field(default_factory=list)
    """The flight recorder's triggers at this root (its `.recorder/` markers), in step order."""
    kept_by: dict[str, dict[str, Any]] = dc_field(default_factory=dict)
    """Bundle name -> the trigger that kept it (from its manifest), for the bundles a flight recorder promoted."""
    unreadable_triggers: list[str] = dc_field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(v.status == s for v in self.verdicts) for s in VERDICT_STATUSES}

    @property
    def earliest_divergence(self) -> Verdict | None:
        """The first diverged bundle in anchor order."""
        return next((v for v in self.verdicts if v.status == DIVERGED), None)

    @property
    def incomplete(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.status == INCOMPLETE]

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    @property
    def status(self) -> Status:
        counts = self.counts
        for verdict, status in (
            (DIVERGED, Status.DIVERGED),
            (INVALID, Status.INVALID),
            (ERROR, Status.INVALID),
            (INCOMPLETE, Status.INCOMPLETE),
            (UNSUPPORTED, Status.UNSUPPORTED),
        ):
            if counts[verdict]:
                return status
        return Status.PASS if self.verdicts else Status.SELECTION

    def failures(self) -> list[str]:
        return self.problems()

    def problems(self) -> list[str]:
        return [
            f"{v.name}: {v.status}"
            + (f" at {v.first_divergent_stage}" if v.first_divergent_stage else "")
            + (f": {v.detail}" if v.detail and v.status != DIVERGED else "")
            for v in self.verdicts
            if v.status != PASS
        ]

    def to_dict(self) -> dict[str, Any]:
        first = self.earliest_divergence
        return {
            "root": self.root,
            "engine": self.engine,
            "workers": self.workers,
            "replay_version": self.replay_version,
            "options": self.options,
            "bundles": len(self.verdicts),
            "counts": self.counts,
            "replayed": self.replayed,
            "cached": self.cached,
            "forced": self.forced,
            "earliest_divergence": None if first is None else self._with_trigger(first),
            "incomplete": [
                {
                    "name": v.name,
                    "anchor": v.anchor,
                    "missing_ranks": v.missing_ranks,
                    "expected_ranks": v.expected_ranks,
                    "detail": v.detail,
                }
                for v in self.incomplete
            ],
            "finalized": self.finalized,
            "seconds": round(self.seconds, 3),
            "engine_start_seconds": round(self.engine_start_seconds, 3),
            "unkept": self.unkept,
            "verdicts": [self._with_trigger(v) for v in self.verdicts],
            **({"triggers": self.triggers} if self.triggers or self.unreadable_triggers else {}),
            **({"unreadable_triggers": self.unreadable_triggers} if self.unreadable_triggers else {}),
        }

    def _with_trigger(self, verdict: Verdict) -> dict[str, Any]:
        """A verdict's dict, with the trigger that kept its bundle where a flight recorder promoted it."""
        doc = verdict.to_dict()
        if verdict.name in self.kept_by:
            doc["trigger"] = self.kept_by[verdict.name]
        return doc

    def render_text(self) -> str:
        counts = self.counts
        lines = [
            f"scan {self.root}: {len(self.verdicts)} bundle(s): "
            + ", ".join(f"{counts[s]} {s}" for s in VERDICT_STATUSES if counts[s] or s in (PASS, DIVERGED)),
            f"  {self.replayed} replayed, {self.cached} from stored verdicts ({self.engine} engine, "
            f"{self.workers} worker(s), {self.seconds:.1f} s; replay {self.replay_version})",
        ]
        first = self.earliest_divergence
        if first is not None:
            where = first.place
            kept = self.kept_by.get(first.name)
            lines.append(
                f"earliest divergence: {first.name} ({first.anchor or 'no anchor'}) at "
                f"{first.first_divergent_stage}"
                + (f": {where}" if where else "")
                + (f"; kept by trigger {trigger_brief(kept)}" if kept else "")
            )
        else:
            lines.append("earliest divergence: none")
        for v in self.incomplete:
            lines.append(
                f"incomplete: {v.name} ({v.anchor or 'no anchor'}): "
                + (f"missing ranks {v.missing_ranks} of {v.expected_ranks}" if v.missing_ranks else v.detail)
            )
        for name in self.finalized:
            lines.append(f"{name}: finalized (every rank had landed)")
        if self.unkept:
            lines.append(
                f"{len(self.unkept)} verdict(s) not kept in the store (the next scan replays them again): "
                f"{self.unkept[0]}"
            )
        if self.triggers:
            lines.append(f"triggers of the flight recorder ({len(self.triggers)}), in step order:")
            lines += [f"  {trigger_brief(t)}" + (f": {t['detail']}" if t.get("detail") else "") for t in self.triggers]
        lines += [f"trigger marker not read: {why}" for why in self.unreadable_triggers]
        if not self.verdicts:
            return "\n".join(lines)
        triggered = bool(self.kept_by)
        rows = [
            ("BUNDLE", "ANCHOR", "STATUS", "FIRST DIVERGENT STAGE", "SAMPLE", "FROM")
            + (("TRIGGER",) if triggered else ())
        ]
        for v in self.verdicts:
            rows.append(
                (
                    v.name,
                    v.anchor or "-",
                    v.status,
                    v.first_divergent_stage or "-",
                    v.sample_id or "-",
                    "stored"
                    if v.cached
                    else ("replayed" if v.status in (PASS, DIVERGED, INVALID, UNSUPPORTED) or v.attempts else "-"),
                )
                + ((trigger_brief(self.kept_by.get(v.name)),) if triggered else ())
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [
            f"{v.name}: {v.status}: {v.detail}"
            for v in self.verdicts
            if v.status in (INVALID, ERROR, UNSUPPORTED) and v.detail
        ]
        return "\n".join(lines)


__all__ = ["ScanReport"]
