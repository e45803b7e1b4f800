"""The replay runner: checks the sources, plans the stages, resolves the selection, runs, and reports.

Multi-rank bundles come as one source per rank. Ranks whose sample ids coincide are replicas: each is
replayed and the comparison policy's exact fields must agree between them (zero tolerance). Ranks with
disjoint ids are data-parallel shards: the per-sample and group-level stages see their union as one
cohort (a prompt group split across ranks is normal), and the cohort-level loss.policy runs per rank
against that rank's own expected values. Partly overlapping ids are a BundleError.

With replicas the union stages run once per replica cohort; identical verdicts are reported once,
differing ones are merged into one entry whose message names the ranks.

`rank=r` replays one rank of such a bundle (all of whose ranks are given): its samples, closed over their
prompt groups across ranks (a group split across ranks is normalized over all of its members, so replaying
a rank's rows alone would report a divergence where there is none), and loss.policy of rank r alone.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Optional, Sequence

import torch

from trajectory_replay.bundle.schema import STAGE_ORDER, SampleRecord, StageId
from trajectory_replay.errors import BundleError
from trajectory_replay.replay import kernels
from trajectory_replay.replay.cohort import Cohort, CohortPart, PayloadCache
from trajectory_replay.replay.compare import EXACT, FieldComparison, SampleLayout, compare_tensors, resolve_tolerance
from trajectory_replay.replay.report import MAX_DIVERGENCES, Divergence, ReplayReport, StageResult, skipped
from trajectory_replay.replay.selection import Selection, resolve_selection
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.stages import PlannedStage, StageContext, check_topology, plan_stages

PARTIAL_SELECTION = "cohort-level stage is not replayable under a partial selection"


def replay(sources: Sequence[ReplaySource], *, samples: Sequence[str] = (), groups: Sequence[str] = (),
           batches: Sequence[str] = (), stages: Optional[Sequence[str | StageId]] = None,
           atol: Optional[float] = None, rtol: Optional[float] = None, rank: Optional[int] = None) -> ReplayReport:
    """Replay one bundle (one source per rank) and report every stage and the first divergence;
    with `rank`, only that rank of it (the selection then picks among that rank's samples)."""
    ordered = _check_sources(sources)
    focus = None
    if rank is not None:
        focus = next((s for s in ordered if s.rank == rank), None)
        if focus is None:
            raise BundleError(f"bundle {ordered[0].bundle_id} has no rank {rank} "
                              f"(ranks {[s.rank for s in ordered]})")
        mine = frozenset(r.sample_id for r in focus.index.samples)
        if all(frozenset(r.sample_id for r in s.index.samples) == mine for s in ordered):
            ordered, focus = [focus], None   # replicas: the rank holds every sample of the bundle
    first = ordered[0]
    for source in ordered:
        check_topology(source.index)
    plan = plan_stages(first.manifest, stages)
    config = first.index.config
    if config.kl_coef != 0 and any(p.stage.id == StageId.ADVANTAGE_KL and p.action == "run" for p in plan):
        kernels.check_kl_type(config.kl_loss_type)  # fail before loading anything

    shards = _shards(ordered)
    replica_sets = [[shard[min(j, len(shard) - 1)] for shard in shards] for j in range(max(map(len, shards)))]
    union = [r for source in replica_sets[0] for r in source.index.samples]
    selection = Selection(tuple(samples), tuple(groups), tuple(batches))
    rank_whole = False
    if focus is not None:
        # the selection picks among the rank's own samples; their groups then close over the other ranks
        own = focus.index.samples
        within = resolve_selection(selection, own)
        rank_whole = not within.partial
        selection = Selection(samples=tuple(own[i].sample_id for i in within.positions))
    closure = resolve_selection(selection, union)
    selected_ids = {union[i].sample_id for i in closure.positions}
    cache = PayloadCache()
    cohorts = [Cohort(_nonempty([_part(s, selected_ids) for s in sources_j]), cache, closure.partial)
               for sources_j in replica_sets]

    replica_findings = _compare_replicas(shards, selected_ids, cache, first.manifest.comparison_policy.exact_fields)
    sample_runs = any(p.stage.id == StageId.SAMPLE and p.action == "run" for p in plan)
    if not sample_runs and any(c.failed for c in replica_findings):
        raise BundleError("replica ranks disagree: " + "; ".join(c.summary() for c in replica_findings if c.failed))

    contracted = frozenset(first.manifest.stage_contracts)

    def context(stage: StageId, cohort: Cohort, outputs: dict, rank: Optional[int] = None,
                findings: Sequence[FieldComparison] = ()) -> StageContext:
        return StageContext(cohort=cohort, config=config, tol=resolve_tolerance(first.manifest, stage, atol, rtol),
                            contracted=contracted, outputs=outputs, rank=rank, replica_findings=findings)

    by_stage: dict[StageId, list[tuple[str, StageResult]]] = defaultdict(list)
    cohort_outputs: list[dict] = []
    sample_level = [p for p in plan if not p.stage.cohort_level]
    for j, cohort in enumerate(cohorts):
        outputs: dict = {}
        for i, planned in enumerate(sample_level):
            ctx = context(planned.stage.id, cohort, outputs,
                          findings=replica_findings if j == 0 and planned.stage.id == StageId.SAMPLE else ())
            by_stage[planned.stage.id].append((_label(cohort), _run_planned(planned, ctx, outputs)))
            _release(outputs, cache, [p.stage for p in sample_level[i + 1:]]
                     + [p.stage for p in plan if p.stage.cohort_level])
        cohort_outputs.append(outputs)

    results = [_merge(by_stage[s]) for s in STAGE_ORDER if s in by_stage]
    for planned in (p for p in plan if p.stage.cohort_level):
        if planned.action != "run" or (closure.partial and not rank_whole):
            results.append(skipped(planned.stage.id.value, planned.reason or PARTIAL_SELECTION))
            continue
        per_rank: list[StageResult] = []
        done: set[int] = set()
        for cohort, outputs in zip(cohorts, cohort_outputs):
            for k, part in enumerate(cohort.parts):
                if id(part.source) in done or (focus is not None and part.source is not focus):
                    continue
                done.add(id(part.source))
                part_rank = part.source.rank if len(ordered) > 1 else None
                rank_outputs = {stage: {key: value[cohort.token_range(k)] for key, value in produced.items()}
                                for stage, produced in outputs.items() if stage == StageId.ADVANTAGE_ESTIMATE}
                ctx = context(planned.stage.id, cohort.part(k), rank_outputs, rank=part_rank)
                per_rank.append(_run_planned(planned, ctx, {}))
        results.extend(sorted(per_rank, key=lambda r: -1 if r.rank is None else r.rank))
    return ReplayReport(bundle_id=first.bundle_id, stages=tuple(results))


def _release(outputs: dict, cache: PayloadCache, later: Sequence) -> None:
    """Drop stage outputs and loaded payloads that no later stage reads, so peak memory stays near the inputs."""
    needed_outputs = {dep for stage in later for dep in stage.depends_on}
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


def _check_sources(sources: Sequence[ReplaySource]) -> list[ReplaySource]:
    """The sources in rank order, after checking they are ranks of one bundle with one config and plan."""
    if not sources:
        raise BundleError("nothing to replay: no source given")
    ordered = sorted(sources, key=lambda s: -1 if s.rank is None else s.rank)
    first = ordered[0]
    for other in ordered[1:]:
        if other.bundle_id != first.bundle_id:
            raise BundleError(f"sources belong to different bundles: {first.bundle_id}, {other.bundle_id}")
        if other.index.config != first.index.config:
            raise BundleError(f"ranks {first.rank} and {other.rank} of bundle {first.bundle_id} "
                              "disagree on the recompute config")
        if other.manifest.stage_contracts != first.manifest.stage_contracts:
            raise BundleError(f"ranks {first.rank} and {other.rank} of bundle {first.bundle_id} "
                              "disagree on the stage contracts")
    return ordered


def _shards(ordered: Sequence[ReplaySource]) -> list[list[ReplaySource]]:
    """Group ranks into data-parallel shards of replicas (same sample ids); partial overlap is an error."""
    shards: list[tuple[frozenset[str], list[ReplaySource]]] = []
    for source in ordered:
        ids = frozenset(r.sample_id for r in source.index.samples)
        for shard_ids, members in shards:
            if shard_ids == ids:
                members.append(source)
                break
            if shard_ids & ids:
                raise BundleError(f"ranks {members[0].rank} and {source.rank} share {len(shard_ids & ids)} sample "
                                  "ids but not all: neither replicas nor data-parallel shards")
        else:
            shards.append((ids, [source]))
    return [members for _, members in shards]


def _part(source: ReplaySource, selected_ids: set[str]) -> CohortPart:
    return CohortPart(source, tuple(i for i, r in enumerate(source.index.samples) if r.sample_id in selected_ids))


def _nonempty(parts: list[CohortPart]) -> list[CohortPart]:
    """The parts with selected samples (a rank none of whose samples is selected is not read at all)."""
    return [p for p in parts if p.positions] or parts[:1]


def _label(cohort: Cohort) -> str:
    ranks = [p.source.rank for p in cohort.parts if p.source.rank is not None]
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}" if ranks else ""


def _merge(labelled: list[tuple[str, StageResult]]) -> StageResult:
    """One entry for a stage run once per replica cohort: identical verdicts once, else merged by rank."""
    results = [r for _, r in labelled]
    if all(r == results[0] for r in results):
        return results[0]
    status = "fail" if any(r.failed for r in results) else results[0].status
    shown = [(label, r) for label, r in labelled if r.failed] or labelled
    errors = [r.max_abs_error for r in results if r.max_abs_error is not None]
    return StageResult(stage=results[0].stage, status=status, rank=results[0].rank,
                       message="; ".join(f"{label}: {r.message}" for label, r in shown),
                       max_abs_error=max(errors) if errors else None,
                       mismatch_count=sum(r.mismatch_count for r in results),
                       divergences=tuple(d for _, r in shown for d in r.divergences)[:MAX_DIVERGENCES])


def _compare_replicas(shards: Sequence[Sequence[ReplaySource]], selected_ids: set[str], cache: PayloadCache,
                      exact_fields: Sequence[str]) -> list[FieldComparison]:
    """Each replica against the first rank of its shard on the exact fields, with zero tolerance."""
    findings: list[FieldComparison] = []
    for shard in shards:
        reference = _part(shard[0], selected_ids)
        for other_source in shard[1:]:
            other = _part(other_source, selected_ids)
            findings.extend(_compare_replica(reference, other, cache, exact_fields))
    return findings


def _compare_replica(reference: CohortPart, other: CohortPart, cache: PayloadCache,
                     exact_fields: Sequence[str]) -> list[FieldComparison]:
    ref_records = [reference.source.index.samples[i] for i in reference.positions]
    other_records = [other.source.index.samples[i] for i in other.positions]
    pair = f"replica rank {other.source.rank} disagrees with rank {reference.source.rank}"
    ids = [r.sample_id for r in ref_records]
    same_order = ids == [r.sample_id for r in other_records]
    findings: list[FieldComparison] = []
    for name in exact_fields:
        if name == "sample_id":
            problems = () if same_order else (f"{pair} on the sample_id order",)
            findings.append(FieldComparison(field=name, compared=len(ids), problems=problems))
        elif name == "loss_mask":
            if not same_order:
                continue  # the order problem is already reported; rows cannot be aligned
            layout = SampleLayout.per_token(ids, torch.tensor([max(r.response_length, 0) for r in ref_records]))
            compared = compare_tensors(name, cache.load(reference, name), cache.load(other, name), layout, EXACT)
            findings.append(_prefixed(compared, pair))
        elif name in SampleRecord.model_fields:
            findings.append(_compare_record_field(name, ref_records, other_records, pair))
        else:
            findings.append(FieldComparison(field=name, compared=0,
                                            problems=(f"exact field {name!r} is not a sample field",)))
    return findings


def _compare_record_field(name: str, ref_records: Sequence[SampleRecord], other_records: Sequence[SampleRecord],
                          pair: str) -> FieldComparison:
    """One per-sample record field compared exactly between replicas, samples aligned by id."""
    others = {r.sample_id: getattr(r, name) for r in other_records}
    divergences = []
    for record in ref_records:
        mine, theirs = getattr(record, name), others.get(record.sample_id)
        if mine != theirs:
            divergences.append(Divergence(name, record.sample_id, None, _number(mine), _number(theirs),
                                          _abs_diff(mine, theirs)))
    problems = (f"{pair} on {name} of {len(divergences)} sample(s)",) if divergences else ()
    return FieldComparison(field=name, compared=len(ref_records), mismatch_count=len(divergences),
                           divergences=tuple(divergences[:MAX_DIVERGENCES]), problems=problems)


def _prefixed(comparison: FieldComparison, prefix: str) -> FieldComparison:
    if not comparison.failed:
        return comparison
    return replace(comparison, problems=(f"{prefix} on {comparison.field}",) + comparison.problems)


def _number(value: object) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _abs_diff(a: object, b: object) -> Optional[float]:
    x, y = _number(a), _number(b)
    return None if x is None or y is None else abs(x - y)


__all__ = ["PARTIAL_SELECTION", "replay"]
