"""The replay runner: plans (`replay.plan`), then executes the plan's passes and reports.

Execution follows the plan and decides nothing about ranks or selection: each pass runs the
sample-level stages once over its rows, then each cohort-level stage once per part, and every
verdict is reported for the ranks the plan names. Loaded payloads and stage outputs are dropped as
soon as no later stage reads them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import STAGE_ORDER, RecomputeConfig, StageId
from trajectory_replay.replay.cohort import Cohort, PayloadCache
from trajectory_replay.replay.compare import resolve_tolerance
from trajectory_replay.replay.plan import Pass, PlannedStage, ReplayPlan, plan_replay
from trajectory_replay.replay.report import ReplayReport, StageResult, skipped
from trajectory_replay.replay.selection import Selection
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.stages import Stage, StageContext


def replay(sources: Sequence[ReplaySource], *, samples: Sequence[str] = (), groups: Sequence[str] = (),
           batches: Sequence[str] = (), stages: Optional[Sequence[str | StageId]] = None,
           atol: Optional[float] = None, rtol: Optional[float] = None, rank: Optional[int] = None,
           overrides: Optional[Mapping[str, Any]] = None) -> ReplayReport:
    """Replay one bundle (one source per rank) and report every stage and the first divergence;
    with `rank`, only that rank of it (the selection then picks among that rank's samples); with `overrides`,
    under the recorded config with those fields changed (the report lists them)."""
    plan = plan_replay(sources, Selection(tuple(samples), tuple(groups), tuple(batches)), stages=stages, rank=rank,
                       overrides=overrides)
    return execute(plan, atol=atol, rtol=rtol)


def execute(plan: ReplayPlan, *, atol: Optional[float] = None, rtol: Optional[float] = None) -> ReplayReport:
    """Run `plan`: every pass, its verdicts in stage order, rank by rank."""
    return execute_keeping(plan, (), atol=atol, rtol=rtol)[0]


PER_SAMPLE_OUTPUTS = ("raw_rewards", "rewards")
"""Stage outputs with one value per sample; every other output has one per token."""


def execute_keeping(plan: ReplayPlan, keep: Sequence[str], *, atol: Optional[float] = None,
                    rtol: Optional[float] = None) -> tuple[ReplayReport, dict[str, dict[str, torch.Tensor]]]:
    """`execute`, also handing back the recomputed outputs named in `keep` (of the sample-level stages that ran),
    as {output: {sample_id: the sample's values}}: what a chained replay links a step's inputs to."""
    run = _Run(plan, atol, rtol, keep)
    results = [result for one in plan.passes for result in run.one_pass(one)]
    order = {stage.value: i for i, stage in enumerate(STAGE_ORDER)}
    results.sort(key=lambda r: (order.get(r.stage, len(order)), -1 if r.rank is None else r.rank))
    return ReplayReport(bundle_id=plan.bundle_id, stages=tuple(results), overrides=dict(plan.overrides)), run.kept


class _Run:
    """What every pass of one replay shares: the plan, the tolerance overrides, the payload cache."""

    def __init__(self, plan: ReplayPlan, atol: Optional[float], rtol: Optional[float],
                 keep: Sequence[str] = ()) -> None:
        self.plan, self.atol, self.rtol = plan, atol, rtol
        self.keep = frozenset(keep)
        self.kept: dict[str, dict[str, torch.Tensor]] = {}
        self.cache = PayloadCache()
        self.contracted = frozenset(plan.reference.manifest.stage_contracts)
        self.sample_level = [p for p in plan.stages if not p.stage.cohort_level]
        self.cohort_level = [p for p in plan.stages if p.stage.cohort_level]

    def context(self, stage: StageId, cohort: Cohort, outputs: dict, rank: Optional[int]) -> StageContext:
        reference = self.plan.reference
        return StageContext(cohort=cohort, config=self.plan.config,
                            tol=resolve_tolerance(reference.manifest, stage, self.atol, self.rtol),
                            contracted=self.contracted, outputs=outputs, rank=rank, kernels=self.plan.kernels)

    def one_pass(self, plan: Pass) -> list[StageResult]:
        """The verdicts of one pass: sample-level stages over all its rows, then cohort-level ones per part."""
        cohort = Cohort(plan.parts, self.cache)
        outputs: dict = {}
        results: list[StageResult] = []
        for i, planned in enumerate(self.sample_level):
            ctx = self.context(planned.stage.id, cohort, outputs, plan.label)
            if not plan.whole and planned.action == "run" and self._whitened(planned.stage.id):
                result = skipped(planned.stage.id.value, f"{WHITENED_PART} ({self.plan.kernels.estimator.name})",
                                 plan.label)
            else:
                result = _run_planned(planned, ctx, outputs)
                if planned.action == "run" and self.keep:
                    self._keep(outputs.get(planned.stage.id, {}), cohort)
            results += _with_copies(result, plan.label, plan.copies)
            _release(outputs, self.cache, [p.stage for p in self.sample_level[i + 1:] + self.cohort_level],
                     self.plan.config)
        for planned in self.cohort_level:
            if planned.action != "run" or plan.cohort_skip:
                result = skipped(planned.stage.id.value, planned.reason or plan.cohort_skip, plan.label)
                results += _with_copies(result, plan.label, plan.copies)
            else:
                results += self.per_part(planned, cohort, outputs, plan)
        return results

    def _keep(self, produced: Mapping[str, torch.Tensor], cohort: Cohort) -> None:
        """Split the kept outputs a stage recomputed into each sample's values."""
        for name in self.keep & set(produced):
            values = produced[name].reshape(-1)
            if name in PER_SAMPLE_OUTPUTS:
                rows = values.split(1)
            else:
                rows = values.split(cohort.lengths.tolist())
            self.kept.setdefault(name, {}).update(zip(cohort.sample_ids, rows))

    def _whitened(self, stage: StageId) -> bool:
        """True for advantage.estimate of an estimator that whitens over the whole cohort."""
        return stage == StageId.ADVANTAGE_ESTIMATE and self.plan.kernels.estimator.whitened

    def per_part(self, planned: PlannedStage, cohort: Cohort, outputs: dict, plan: Pass) -> list[StageResult]:
        """A cohort-level stage run on each part alone, against its own expected values, with the part's slice of
        the (per-token) upstream outputs it consumes."""
        results: list[StageResult] = []
        for k, ranks in enumerate(plan.cohort_ranks):
            if not ranks:
                continue
            part_outputs = {stage: {key: value[cohort.token_range(k)] for key, value in produced.items()}
                            for stage, produced in outputs.items() if stage in planned.stage.io.upstream_stages}
            result = _run_planned(planned, self.context(planned.stage.id, cohort.part(k), part_outputs, ranks[0]), {})
            results += _with_copies(result, ranks[0], ranks[1:])
        return results


WHITENED_PART = "advantages whitened over the whole cohort are not replayable on part of it"


def _with_copies(result: StageResult, source_rank: Optional[int],
                 replicas: Sequence[Optional[int]]) -> list[StageResult]:
    """`result`, and the same verdict for every replica rank (its data is identical to `source_rank`'s)."""
    message = f"{result.message} (data identical to rank {source_rank})".lstrip()
    return [result] + [replace(result, rank=r, message=message) for r in replicas]


def _release(outputs: dict, cache: PayloadCache, later: Sequence[Stage], config: RecomputeConfig) -> None:
    """Drop stage outputs and loaded payloads that no later stage reads, so peak memory stays near the inputs."""
    needed_outputs = {dep for stage in later for dep in stage.dependencies(config)}
    for stage_id in [s for s in outputs if s not in needed_outputs]:
        del outputs[stage_id]
    cache.retain({name for stage in later for name in stage.inputs})


def _run_planned(planned: PlannedStage, ctx: StageContext, outputs: dict) -> StageResult:
    """Run, replace by recorded outputs, or skip one planned stage; store what it hands downstream."""
    stage = planned.stage
    if planned.action == "skip":
        return skipped(stage.id.value, planned.reason, ctx.rank)
    if planned.action == "recorded":
        outputs[stage.id] = stage.recorded(ctx)
        return skipped(stage.id.value, planned.reason, ctx.rank)
    outcome = stage.compute(ctx)
    if outcome.outputs:
        outputs[stage.id] = outcome.outputs
    return outcome.result


__all__ = ["PER_SAMPLE_OUTPUTS", "execute", "execute_keeping", "replay"]
