"""The replay runner: checks the sources, plans the stages, resolves the selection, runs, and reports.

A multi-rank bundle comes as one source per rank, and every rank is replayed and reported. How the
ranks relate is read from their content, never assumed from their sample ids alone:

- Ranks whose content is identical (records, expected values, payloads) are replicas: the data is
  replayed once, and the per-rank `loss.policy` verdict is reported for each of them.
- Otherwise, when the sample ids of the ranks are disjoint, the ranks are data-parallel shards of one
  cohort: the per-sample and group-level stages see their union (a prompt group split across ranks is
  normal) and the cohort-level `loss.policy` runs per rank against that rank's own expected values.
- Otherwise the ids are rank-local (the older tool numbers every rank's samples from `s-0`, each rank
  holding its own data): every rank is replayed on its own, all stages reported per rank, and a fault in
  any rank fails the replay. `--sample`/`--group`/`--batch` then select in each rank that has the ids.

`rank=r` replays one rank of such a bundle (all of whose ranks are given). A rank that shares sample ids
with another (a replica, or rank-local ids) is replayed alone. A data-parallel shard is replayed with its
prompt groups closed over the other ranks (a group split across ranks is normalized over all of its
members, so replaying the rank's rows alone would report a divergence where there is none), and
loss.policy for rank r alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import STAGE_ORDER, SampleRecord, StageId
from trajectory_replay.errors import BundleError
from trajectory_replay.replay import kernels
from trajectory_replay.replay.cohort import Cohort, CohortPart, PayloadCache
from trajectory_replay.replay.compare import resolve_tolerance
from trajectory_replay.replay.report import ReplayReport, StageResult, skipped
from trajectory_replay.replay.selection import Closure, Selection, group_id, resolve_selection
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.stages import PlannedStage, StageContext, check_topology, plan_stages

PARTIAL_SELECTION = "cohort-level stage is not replayable under a partial selection"


@dataclass
class _Shard:
    """One distinct content of a bundle: the source replayed and every rank that holds exactly that content."""

    source: ReplaySource
    ranks: list[Optional[int]] = field(default_factory=list)


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
        mine = {r.sample_id for r in focus.index.samples}
        if any(s is not focus and not mine.isdisjoint(r.sample_id for r in s.index.samples) for s in ordered):
            ordered, focus = [focus], None   # a replica, or rank-local ids: the rank's data is whole by itself
    first = ordered[0]
    for source in ordered:
        check_topology(source.index)
    plan = plan_stages(first.manifest, stages)
    config = first.index.config
    if config.kl_coef != 0 and any(p.stage.id == StageId.ADVANTAGE_KL and p.action == "run" for p in plan):
        kernels.check_kl_type(config.kl_loss_type)  # fail before loading anything

    run = _Run(plan, first, atol, rtol, PayloadCache(), labelled=len(ordered) > 1)
    selection = Selection(tuple(samples), tuple(groups), tuple(batches))
    shards = _group_by_content(ordered, run.cache)
    if len(shards) > 1 and not _disjoint(shards):
        if focus is not None:  # the other ranks overlap among themselves: this rank's data stands alone too
            shards = [_Shard(focus, [focus.rank])]
        results: list[StageResult] = []
        for shard, closure in _select_per_shard(selection, shards):
            records = shard.source.index.samples
            selected = {records[i].sample_id for i in closure.positions}
            results += _copies(run.cohort([shard], selected, closure.partial, label=shard.ranks[0]), shard)
        order = {stage.value: i for i, stage in enumerate(STAGE_ORDER)}
        results.sort(key=lambda r: (order.get(r.stage, len(order)), -1 if r.rank is None else r.rank))
        return ReplayReport(bundle_id=first.bundle_id, stages=tuple(results))

    union = [r for shard in shards for r in shard.source.index.samples]
    rank_whole = False
    if focus is not None:
        # the selection picks among the rank's own samples; their groups then close over the other ranks
        own = focus.index.samples
        within = resolve_selection(selection, own)
        rank_whole = not within.partial
        selection = Selection(samples=tuple(own[i].sample_id for i in within.positions))
        shards = [replace(s, ranks=[focus.rank]) if focus.rank in s.ranks else replace(s, ranks=[])
                  for s in shards]
    closure = resolve_selection(selection, union)
    selected_ids = {union[i].sample_id for i in closure.positions}
    results = run.cohort(shards, selected_ids, closure.partial, label=None, rank_whole=rank_whole)
    return ReplayReport(bundle_id=first.bundle_id, stages=tuple(results))


class _Run:
    """What every cohort of one replay shares: the plan, the bundle's config and policy, the payload cache."""

    def __init__(self, plan: list[PlannedStage], first: ReplaySource, atol: Optional[float], rtol: Optional[float],
                 cache: PayloadCache, labelled: bool) -> None:
        self.plan, self.first, self.atol, self.rtol, self.cache = plan, first, atol, rtol, cache
        self.labelled = labelled
        """True for a multi-rank bundle: per-rank verdicts name their rank."""
        self.contracted = frozenset(first.manifest.stage_contracts)

    def context(self, stage: StageId, cohort: Cohort, outputs: dict, rank: Optional[int]) -> StageContext:
        return StageContext(cohort=cohort, config=self.first.index.config,
                            tol=resolve_tolerance(self.first.manifest, stage, self.atol, self.rtol),
                            contracted=self.contracted, outputs=outputs, rank=rank)

    def cohort(self, shards: Sequence[_Shard], selected_ids: set[str], partial: bool, *, label: Optional[int],
               rank_whole: bool = False) -> list[StageResult]:
        """Replay the union of the shards' selected samples: the sample-level stages once (reported with rank
        `label`), then each cohort-level stage per shard, reported for every rank listed in the shard."""
        cohort = Cohort(_nonempty([_part(s.source, selected_ids) for s in shards]), self.cache, partial)
        plan = self.plan
        outputs: dict = {}
        results: list[StageResult] = []
        sample_level = [p for p in plan if not p.stage.cohort_level]
        for i, planned in enumerate(sample_level):
            ctx = self.context(planned.stage.id, cohort, outputs, label)
            results.append(_run_planned(planned, ctx, outputs))
            _release(outputs, self.cache, [p.stage for p in sample_level[i + 1:]]
                     + [p.stage for p in plan if p.stage.cohort_level])
        by_source = {id(s.source): s for s in shards}
        for planned in (p for p in plan if p.stage.cohort_level):
            if planned.action != "run" or (partial and not rank_whole):
                results.append(skipped(planned.stage.id.value, planned.reason or PARTIAL_SELECTION, label))
                continue
            per_rank: list[StageResult] = []
            for k, part in enumerate(cohort.parts):
                shard = by_source.get(id(part.source))
                if shard is None or not shard.ranks:
                    continue
                rank_outputs = {stage: {key: value[cohort.token_range(k)] for key, value in produced.items()}
                                for stage, produced in outputs.items() if stage == StageId.ADVANTAGE_ESTIMATE}
                ctx = self.context(planned.stage.id, cohort.part(k), rank_outputs,
                                   shard.ranks[0] if self.labelled else label)
                result = _run_planned(planned, ctx, {})
                per_rank.append(result)
                per_rank += [_same_data(result, r, shard.ranks[0]) for r in shard.ranks[1:]]
            results.extend(sorted(per_rank, key=lambda r: -1 if r.rank is None else r.rank))
        return results


def _same_data(result: StageResult, rank: Optional[int], source_rank: Optional[int]) -> StageResult:
    """`result` reported for a replica `rank` (its data is identical to `source_rank`'s, which ran)."""
    return replace(result, rank=rank, message=f"{result.message} (data identical to rank {source_rank})".lstrip())


def _copies(results: list[StageResult], shard: _Shard) -> list[StageResult]:
    """A shard's results, and the same for every replica rank of it (its sample-level verdicts are labelled with
    the shard's first rank; cohort-level ones already name every rank)."""
    out = list(results)
    for result in results:
        if result.rank == shard.ranks[0] and not _per_rank_done(result, results, shard):
            out += [_same_data(result, r, shard.ranks[0]) for r in shard.ranks[1:]]
    return out


def _per_rank_done(result: StageResult, results: list[StageResult], shard: _Shard) -> bool:
    """True when the stage of `result` already has an entry for another rank of the shard."""
    return any(r.stage == result.stage and r.rank in shard.ranks[1:] for r in results)


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


# --------------------------------------------------------------------------- how the ranks relate

def _group_by_content(ordered: Sequence[ReplaySource], cache: PayloadCache) -> list[_Shard]:
    """The ranks grouped by identical content, in rank order of each group's first rank."""
    shards: list[_Shard] = []
    for source in ordered:
        for shard in shards:
            if _same_content(shard.source, source):
                shard.ranks.append(source.rank)
                break
        else:
            shards.append(_Shard(source, [source.rank]))
    return shards


def _disjoint(shards: Sequence[_Shard]) -> bool:
    """True when no sample id occurs in two shards: globally unique ids, so the shards form one cohort."""
    seen: set[str] = set()
    for shard in shards:
        ids = {r.sample_id for r in shard.source.index.samples}
        if not seen.isdisjoint(ids):
            return False
        seen |= ids
    return True


def _same_content(a: ReplaySource, b: ReplaySource) -> bool:
    """True when two ranks hold the same records, expected values and payloads (so are replicas)."""
    if [r.sample_id for r in a.index.samples] != [r.sample_id for r in b.index.samples]:
        return False  # cheap first: data-parallel shards never get further
    if a.index.samples != b.index.samples or _canonical(a.expected) != _canonical(b.expected):
        return False
    if set(a.manifest.payloads) != set(b.manifest.payloads):
        return False
    digests_a, digests_b = _payload_digests(a), _payload_digests(b)
    if digests_a is not None and digests_b is not None:
        return digests_a == digests_b
    for name in a.manifest.payloads:   # a source without digests (built in memory): compare the tensors
        x, y = a.load_payload(name), b.load_payload(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


def _canonical(value: object) -> str:
    # NaN != NaN, but two identical documents holding NaN are the same content
    return json.dumps(value, sort_keys=True, default=str)


def _payload_digests(source: ReplaySource) -> Optional[dict[str, str]]:
    """{payload: content digest} when the source knows them without loading (None otherwise)."""
    digests = getattr(source, "payload_digests", None)
    if isinstance(digests, dict):
        return digests
    specs = source.manifest.payloads
    if all(spec.digest for spec in specs.values()):
        return {name: spec.digest for name, spec in specs.items()}
    return None


# --------------------------------------------------------------------------- selection over rank-local ids

_KEYS: dict[str, Callable[[SampleRecord], Optional[str]]] = {
    "samples": lambda r: r.sample_id,
    "groups": lambda r: group_id(r.group_index),
    "batches": lambda r: r.micro_batch_id,
}


def _select_per_shard(selection: Selection, shards: Sequence[_Shard]) -> list[tuple[_Shard, Closure]]:
    """Each shard the selection touches, with its closure; an id that is in no shard fails closed."""
    if selection.everything:
        return [(s, resolve_selection(selection, s.source.index.samples)) for s in shards]
    present = [{kind: {key(r) for r in s.source.index.samples} for kind, key in _KEYS.items()} for s in shards]
    nowhere = Selection(**{kind: tuple(i for i in getattr(selection, kind) if not any(i in p[kind] for p in present))
                           for kind in _KEYS})
    if not nowhere.everything:
        resolve_selection(nowhere, [r for s in shards for r in s.source.index.samples])  # names what is missing
    out = []
    for shard, ids in zip(shards, present):
        mine = Selection(**{kind: tuple(i for i in getattr(selection, kind) if i in ids[kind]) for kind in _KEYS})
        if not mine.everything:
            out.append((shard, resolve_selection(mine, shard.source.index.samples)))
    return out


def _part(source: ReplaySource, selected_ids: set[str]) -> CohortPart:
    return CohortPart(source, tuple(i for i, r in enumerate(source.index.samples) if r.sample_id in selected_ids))


def _nonempty(parts: list[CohortPart]) -> list[CohortPart]:
    """The parts with selected samples (a rank none of whose samples is selected is not read at all)."""
    return [p for p in parts if p.positions] or parts[:1]


__all__ = ["PARTIAL_SELECTION", "replay"]
