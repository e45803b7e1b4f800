"""Which convention did production follow? Replay one bundle under many configs and say which reproduce what.

The candidates, tried in this order and reported most specific first (fewest fields changed):
- the recorded config;
- single-field variants of it: std_unbiased flipped, grpo_std_normalization flipped, std_eps at 1e-6, 1e-5, 1e-4
  and 1e-9, singleton_group and mask_advantages flipped, every other loss_agg_mode (the two that divide by
  loss_scale_factor only where it is recorded), the other clip_metric_agg;
- inferred scales: where loss.policy diverges by a constant factor, the loss_scale, or for a token/sequence mean
  the global loss_denominator, that would explain it (solved from the expected and recomputed values, rounded
  to a whole count, then checked by a replay like every other candidate);
- on a bundle built from a profile, every value of each of the framework's closed options (`loss_type=grpo`),
  named by the framework's option, tried before the variants so that a variant equal to one is not tried again;
- every convention profile applied to the recorded config (its conventions, the run's own hyperparameters), the
  profile the manifest records first. Where the config was built from a recorded profile, the conventions the run
  set otherwise than that profile (a framework option the user changed) stay as recorded under every profile; two
  versions of one framework that come to the same config are one candidate, named by the recorded profile if it
  is one of them.
A candidate reproduces a stage when the stage passes under it; among candidates that reproduce, the framework's own
settings (the recorded profile, its options) are named before a field-level rewrite that is equivalent to one, and
the other profiles last. Payloads are read once for all candidates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trajectory_replay.bundle.profiles import CONVENTION_FIELDS, PROFILES
from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.errors import TrajectoryReplayError
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.replay.losses import CLIP_METRIC_AGGS
from trajectory_replay.replay.plan import SCALED_MODES, config_value, plan_replay
from trajectory_replay.replay.report import ReplayReport
from trajectory_replay.replay.runner import execute
from trajectory_replay.replay.source import ReplaySource

STD_EPS_VARIANTS = (1e-6, 1e-5, 1e-4, 1e-9)
AGG_MODES = (
    "sum_of_sample_means",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "seq_mean_token_sum_scaled",
    "token_sum",
)
SCALE_FIELDS = ("entropy_loss", "pg_loss", "kl_loss")
"""loss.policy fields a constant factor is solved from, in order of preference (entropy does not depend on the
advantages, so an upstream divergence does not disturb it)."""


@dataclass(frozen=True)
class Candidate:
    """One config tried: its name, what kind it is, and the fields it changes from the recorded config."""

    name: str
    kind: str
    """recorded, option (a framework option of the recorded profile), variant, inferred or profile."""
    changes: dict[str, Any]
    stages: dict[str, str] = field(default_factory=dict)
    """stage -> pass | fail | skipped (several ranks: fail when any rank fails)."""
    error: str | None = None
    """Why the candidate could not be replayed (an unsupported combination), if so."""
    compared: int = 0
    """How many values its replay compared: a candidate that compared none reproduces nothing."""

    @property
    def reproduces_all(self) -> bool:
        return (
            self.error is None
            and self.compared > 0
            and any(s == "pass" for s in self.stages.values())
            and all(s != "fail" for s in self.stages.values())
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "changes": self.changes,
            "stages": self.stages,
            "compared": self.compared,
            "reproduces_all": self.reproduces_all,
            "error": self.error,
        }


@dataclass(frozen=True)
class ConventionsReport(Outcome):
    """Every candidate tried, and per stage the candidates that reproduce it, most specific first."""

    finite_json = True

    bundle_id: str
    candidates: tuple[Candidate, ...]
    unsupported: str | None = None
    """Why no candidate was tried: the recorded config's replay compared no value (every stage skipped...)."""
    profile: str | None = None
    """The convention profile the manifest records (as `ConventionsRecord.resolved` names it), if any."""

    @property
    def status(self) -> Status:
        """pass (a candidate reproduces every stage), unsupported (nothing could be compared) or diverged."""
        if self.unsupported is not None:
            return Status.UNSUPPORTED
        return Status.PASS if self.best is not None else Status.DIVERGED

    @property
    def reason(self) -> str | None:
        return self.unsupported

    def reproducing(self, stage: str) -> list[str]:
        """The candidates under which `stage` passes, most specific first."""
        return [c.name for c in self._ordered() if c.error is None and c.stages.get(stage) == "pass"]

    @property
    def stage_names(self) -> list[str]:
        recorded = self.candidates[0]
        return list(recorded.stages)

    @property
    def best(self) -> Candidate | None:
        """The most specific candidate that reproduces every stage, or None."""
        return next((c for c in self._ordered() if c.reproduces_all), None)

    def _ordered(self) -> list[Candidate]:
        """The recorded config, then the framework's own settings (the recorded profile and its options by name),
        then the field-level variants and inferred scales, then the other profiles; fewest changes first in each."""
        recorded = f"profile {self.profile}"

        def tier(c: Candidate) -> int:
            if c.kind == "recorded":
                return 0
            if c.kind == "option" or c.name == recorded:
                return 1
            return 3 if c.kind == "profile" else 2

        return sorted(self.candidates, key=lambda c: (tier(c), len(c.changes)))

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "status": self.status,
            "bundle_id": self.bundle_id,
            "reason": self.unsupported,
            "profile": self.profile,
            "best": best.name if best else None,
            "reproduced_by": {s: self.reproducing(s) for s in self.stage_names},
            "candidates": [c.to_dict() for c in self._ordered()],
        }

    def render_text(self) -> str:
        recorded = self.candidates[0]
        if self.unsupported is not None:
            return f"bundle {self.bundle_id}: unsupported: nothing compared ({self.unsupported})"
        lines = [f"bundle {self.bundle_id}: which convention reproduces production's values"]
        failing = [s for s, v in recorded.stages.items() if v == "fail"]
        built = f" (profile {self.profile})" if self.profile is not None else ""
        lines.append(
            f"recorded config{built}: "
            + ("reproduces every stage" if not failing else "diverges at " + ", ".join(failing))
        )
        width = max((len(s) for s in self.stage_names), default=0)
        for stage in self.stage_names:
            verdict = recorded.stages.get(stage)
            if verdict == "skipped":
                continue
            text = (
                "reproduced as recorded"
                if verdict == "pass"
                else _some(self.reproducing(stage)) or "no candidate reproduces it"
            )
            lines.append(f"  {stage:<{width}}  {text}")
        everything = [c.name for c in self._ordered() if c.reproduces_all]
        lines.append("every stage reproduced by: " + (_some(everything) or "no candidate"))
        unsupported = [c for c in self.candidates if c.error]
        if unsupported:
            lines.append("not replayable: " + "; ".join(f"{c.name} ({c.error})" for c in unsupported))
        return "\n".join(lines)


def _some(names: list[str], shown: int = 8) -> str:
    """Up to `shown` names, then how many more."""
    more = f"; and {len(names) - shown} more" if len(names) > shown else ""
    return "; ".join(names[:shown]) + more


class _ReadOnce:
    """A source whose payload reads are kept, so that every candidate's replay reads each payload once."""

    def __init__(self, source: ReplaySource) -> None:
        self._source = source
        self._loaded: dict[tuple[str, tuple[int, ...] | None], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def load_payload(self, name: str, samples: Sequence[int] | None = None) -> Any:
        key = (name, None if samples is None else tuple(samples))
        if key not in self._loaded:
            self._loaded[key] = self._source.load_payload(name, samples)
        return self._loaded[key].clone()  # stages may work in place on what they load


def find_conventions(sources: Sequence[ReplaySource], *, rank: int | None = None) -> ConventionsReport:
    """Replay `sources` (one bundle, one source per rank) under every candidate config; see the module docstring."""
    cached = [_ReadOnce(s) for s in sources]
    recorded = sources[0].index.config
    record = sources[0].manifest.conventions
    built_from = record.resolved() if record is not None else None
    keep = recorded.set_by_run(built_from) if built_from is not None else []
    tried: list[Candidate] = []
    seen: set[str] = set()

    def attempt(name: str, kind: str, changes: dict[str, Any]) -> ReplayReport | None:
        key = repr(sorted(changes.items()))
        if key in seen:
            return None
        seen.add(key)
        try:
            report = execute(plan_replay(cached, rank=rank, overrides=changes))
        except TrajectoryReplayError as exc:
            tried.append(Candidate(name, kind, changes, error=str(exc)))
            return None
        tried.append(Candidate(name, kind, changes, _stage_verdicts(report), compared=report.compared))
        return report

    # the recorded config first, and its errors as replay raises them (an unsupported bundle is no question
    # of conventions)
    seen.add(repr([]))
    base = execute(plan_replay(cached, rank=rank))
    tried.append(Candidate("recorded", "recorded", {}, _stage_verdicts(base), compared=base.compared))
    if base.unsupported_reason is not None:  # nothing to compare under the recorded config: none under a variant
        return ConventionsReport(
            sources[0].bundle_id, tuple(tried), unsupported=base.unsupported_reason, profile=built_from
        )
    if built_from is not None:
        for label, changes in option_variants(recorded, built_from):
            attempt(label, "option", changes)
    for changes in single_field_variants(recorded):
        report = attempt(_label(changes), "variant", changes)
        if "loss_agg_mode" in changes and report is not None:
            _infer_scales(attempt, report, changes, cached)
    _infer_scales(attempt, base, {}, cached)
    versions: set[tuple[str, str]] = set()  # (framework, changes) of the profiles tried
    for name in sorted(PROFILES, key=lambda n: n != built_from):
        applied = recorded.with_conventions_of(name, keep=keep)
        changes = {
            k: config_value(getattr(applied, k))
            for k in CONVENTION_FIELDS
            if getattr(applied, k) != getattr(recorded, k)
        }
        key = repr(sorted(changes.items()))
        if (PROFILES[name].framework, key) in versions:
            continue  # another version of the framework that comes to the same config
        versions.add((PROFILES[name].framework, key))
        if name in (built_from, "relax") or changes:
            seen.discard(key)  # a profile is reported even when a variant equals it
            attempt(f"profile {name}", "profile", changes)
    return ConventionsReport(sources[0].bundle_id, tuple(_one_per_framework(tried, built_from)), profile=built_from)


def _one_per_framework(tried: list[Candidate], built_from: str | None) -> list[Candidate]:
    """The candidates less the versions of a framework this bundle cannot tell apart: a version whose verdicts on
    every stage are those of the version named first (the recorded profile, else the bare name, which is the
    newest) says nothing more, and naming it would make the search prefer an older version for a field the bundle
    never exercises."""
    first: dict[str, Candidate] = {}
    for name in sorted(PROFILES, key=lambda n: (n != built_from, n != PROFILES[n].framework)):
        found = next((c for c in tried if c.kind == "profile" and c.name == f"profile {name}"), None)
        if found is not None:
            first.setdefault(PROFILES[name].framework, found)
    kept = []
    for candidate in tried:
        name = candidate.name.removeprefix("profile ")
        named = first.get(PROFILES[name].framework) if candidate.kind == "profile" and name in PROFILES else None
        if named is None or named is candidate or named.stages != candidate.stages or named.error != candidate.error:
            kept.append(candidate)
    return kept


def option_variants(config: RecomputeConfig, built_from: str) -> list[tuple[str, dict[str, Any]]]:
    """(the framework's setting, the fields it changes) for every value of every closed option of the profile the
    bundle was built from (`Option.values`) that changes the recorded config: `loss_type=grpo` on a TRL bundle."""
    prof, current = PROFILES[built_from], config.model_dump()
    out = []
    for name, option in prof.options.items():
        for value in option.values:
            try:
                fields = prof.changes({name: value}, current, RecomputeConfig.model_fields)
            except ValueError:  # a value the recorded config's other settings rule out
                continue
            changes = {k: config_value(v) for k, v in fields.items() if v != current.get(k)}
            if changes:
                out.append((f"{name}={config_value(value)}", changes))
    return out


def single_field_variants(config: RecomputeConfig) -> list[dict[str, Any]]:
    """The configs that differ from `config` in one convention field."""
    out: list[dict[str, Any]] = [
        {"std_unbiased": not config.std_unbiased},
        {"grpo_std_normalization": not config.grpo_std_normalization},
    ]
    out += [{"std_eps": eps} for eps in STD_EPS_VARIANTS if eps != config.std_eps]
    out.append({"singleton_group": "unit" if config.singleton_group == "nan" else "nan"})
    out.append({"mask_advantages": not config.mask_advantages})
    for mode in AGG_MODES:
        if mode != config.loss_agg_mode and (mode not in SCALED_MODES or config.loss_scale_factor):
            out.append({"loss_agg_mode": mode})
    out += [{"clip_metric_agg": agg} for agg in CLIP_METRIC_AGGS if agg != config.clip_metric_agg]
    return out


def _label(changes: dict[str, Any]) -> str:
    return " + ".join(f"{k}={v}" for k, v in changes.items())


def _stage_verdicts(report: ReplayReport) -> dict[str, str]:
    """stage -> its verdict; a stage reported per rank fails when any rank fails."""
    out: dict[str, str] = {}
    for result in report.stages:
        if result.stage not in out or result.status == "fail":
            out[result.stage] = result.status
    return out


def _infer_scales(attempt, report: ReplayReport, changes: dict[str, Any], sources: Sequence[ReplaySource]) -> None:
    """Try the loss_scale, and for a mean the global loss_denominator, that would turn loss.policy's recomputed
    values into the expected ones, when they differ by one constant factor."""
    factor, rank = _constant_factor(report)
    if factor is None:
        return
    config = sources[0].index.config.model_copy(update=changes)
    scale = _whole(config.loss_scale * factor)
    if scale is not None and scale != config.loss_scale:
        attempt(_label({**changes, "loss_scale": scale}), "inferred", {**changes, "loss_scale": scale})
    if config.loss_agg_mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_scaled"):
        used = config.loss_denominator or _local_denominator(config, sources, rank)
        denominator = _whole(used / factor) if used else None
        if denominator is not None and denominator != used:
            attempt(
                _label({**changes, "loss_denominator": denominator}),
                "inferred",
                {**changes, "loss_denominator": denominator},
            )


def _constant_factor(report: ReplayReport) -> tuple[float | None, int | None]:
    """expected / recomputed of the first loss.policy field both sides of which are non-zero, and its rank."""
    for result in report.stages:
        if result.stage != StageId.LOSS_POLICY.value or result.status != "fail":
            continue
        by_field = {d.field: d for d in result.divergences}
        for name in SCALE_FIELDS:
            d = by_field.get(name)
            if d is not None and d.expected and d.actual and math.isfinite(d.expected / d.actual):
                return d.expected / d.actual, result.rank
    return None, None


def _local_denominator(config: RecomputeConfig, sources: Sequence[ReplaySource], rank: int | None) -> float:
    """What the mode divides by without a recorded denominator: the rank's masked tokens, or its sequences with
    any masked token."""
    import torch

    from trajectory_replay.replay.kernels import token_counts

    source = next((s for s in sources if s.rank == rank), sources[0])
    lengths = torch.tensor([max(r.response_length, 0) for r in source.index.samples], dtype=torch.int64)
    tokens = token_counts(source.load_payload("loss_mask"), lengths)
    return float(tokens.sum()) if config.loss_agg_mode == "token_mean" else float((tokens > 0).sum())


def _whole(value: float) -> float | None:
    """`value` rounded to a whole number (or the reciprocal of one) when it is within 0.1% of it, else None."""
    if not math.isfinite(value) or value <= 0:
        return None
    for candidate, back in ((round(value), lambda x: x), (round(1 / value) if value else 0, lambda x: 1 / x)):
        if candidate >= 1 and abs(back(candidate) - value) <= 1e-3 * abs(value):
            return float(back(candidate))
    return None


__all__ = ["Candidate", "ConventionsReport", "find_conventions", "option_variants", "single_field_variants"]
