"""The replay plan: everything decided before a stage runs, as one frozen value that prints itself.

`plan_replay` checks the sources, admits the stages, works out how the ranks relate, resolves the
selection and lays out the passes; `replay.runner` then executes the plan and changes none of it.
Planning reads documents, and compares payload digests (the tensors only for a source that knows no
digests) to tell replicas apart; it never computes a stage.

Stages (a stage's contract in the manifest):
- `recompute`: the stage runs. A contract version other than the stage's: UnsupportedError (never a best
  effort).
- `recorded-only`, `inspect-only`, `unsupported`: the bundle itself says the stage is not to be
  replayed (the older tool's capture declares loss.value unsupported in every bundle). It is reported
  skipped with `capability=<value>` and never fails the replay. A stage with recorded outputs hands them
  downstream instead (reward.post_process the records' `reward`, advantage.estimate the `advantages`
  payload; reward.post_process falls back to the records' `raw_reward` by itself), so the stages after
  it are still checked against what production consumed. Asking for an `unsupported` stage by name
  (`--stage`) is an UnsupportedError: what was asked for cannot be given.
- The topology (cp == 1) is checked for every rank, and the algorithm for the stages that run: the config's
  estimator, policy loss and aggregation resolve to kernels (`replay.registry`), every field it reads has a
  value replay implements and every payload its algorithm needs is there (`check_algorithm`); otherwise an
  UnsupportedError naming the field, before a payload is read. `overrides` (`replay --set`) apply first.

Ranks (a multi-rank bundle comes as one source per rank; how they relate is read from their content,
never assumed from their sample ids alone):
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import ValidationError

from trajectory_replay.bundle import profiles
from trajectory_replay.bundle.schema import (
    STAGE_ORDER,
    BundleIndex,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageId,
)
from trajectory_replay.bundle.stage_io import STAGE_IO, Setting
from trajectory_replay.errors import BundleError, SelectionError, UnsupportedError, UsageError
from trajectory_replay.replay import kernels as kernels_mod
from trajectory_replay.replay.cohort import CohortPart
from trajectory_replay.replay.flags import setting as setting_of
from trajectory_replay.replay.losses import CLIP_METRIC_AGGS, ENTROPY_AGGS
from trajectory_replay.replay.mismatch import (
    CORRECTION_MODES,
    DIVERGENCE_CRITERIA,
    criterion_bounds,
    rejection_criteria,
    rs_bounds,
)
from trajectory_replay.replay.registry import Kernels, resolve_kernels
from trajectory_replay.replay.selection import Closure, Selection, group_id, resolve_selection
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.stages import STAGES, Stage

PARTIAL_SELECTION = "cohort-level stage is not replayable under a partial selection"

Action = Literal["run", "recorded", "skip"]
Layout = Literal["single", "replicas", "data-parallel", "rank-local"]
"""How the given ranks relate: one source; identical ranks; disjoint sample ids (one cohort, possibly with
replicas among them); overlapping ids with other data (each rank its own cohort)."""


@dataclass(frozen=True)
class PlannedStage:
    """A stage replay will run, replace by its recorded outputs, or report skipped (with why)."""

    stage: Stage
    action: Action
    reason: str = ""
    named: bool = False
    """The user asked for this stage by name (`--stage`): a replay that skips it has not checked what was asked."""


@dataclass(frozen=True)
class Shard:
    """One distinct content of a bundle: the source replayed and every rank that holds exactly that content."""

    source: ReplaySource
    ranks: tuple[int | None, ...]


@dataclass(frozen=True)
class Pass:
    """One run of the stages over a union of selected rows: the sample-level stages once, then each
    cohort-level stage once per part."""

    parts: tuple[CohortPart, ...]
    """The selected rows of each source read (a source none of whose rows is selected is not read)."""
    label: int | None
    """The rank the pass's verdicts are reported for; None for a union of ranks (or a single source)."""
    copies: tuple[int | None, ...]
    """Replica ranks of `label`: each verdict reported for `label` is reported for them too."""
    cohort_ranks: tuple[tuple[int | None, ...], ...]
    """Per part, the ranks its cohort-level verdicts are reported for: the first ran, the others hold the
    same data. Empty: the part only joins the sample-level stages (the other ranks of a group)."""
    cohort_skip: str = ""
    """Why the cohort-level stages are skipped in this pass; empty when they run."""
    whole: bool = True
    """The pass covers every sample of the cohort: advantages whitened over the cohort (reinforce_plus_plus,
    its baseline variant, gae) can be recomputed only then."""

    def describe(self) -> str:
        rows = ", ".join(
            ("" if p.source.rank is None else f"rank {p.source.rank}: ")
            + f"{len(p.positions)}/{len(p.source.index.samples)}"
            for p in self.parts
        )
        who = "once" if self.label is None else f"for rank {self.label}"
        if self.copies:
            who += f" and its replicas {', '.join(map(str, self.copies))}"
        reported = [r for ranks in self.cohort_ranks for r in ranks]
        cohort = (
            f"skipped ({self.cohort_skip})"
            if self.cohort_skip
            else "once"
            if reported == [None]
            else f"for rank{'s' if len(reported) > 1 else ''} {', '.join(map(str, reported))}"
        )
        return f"samples {rows}; verdicts {who}; cohort-level stages {cohort}"


@dataclass(frozen=True)
class ReplayPlan:
    """What one replay runs, on which rows, reported for which ranks, and what it skips and why."""

    bundle_id: str
    reference: ReplaySource
    """The source whose config, contracts and tolerances the stages use (the ranks agree on the first two)."""
    ranks: tuple[int | None, ...]
    """The ranks replayed, in order."""
    layout: Layout
    shards: tuple[Shard, ...]
    stages: tuple[PlannedStage, ...]
    passes: tuple[Pass, ...]
    config: RecomputeConfig
    """The config the stages recompute with: the recorded one, with `overrides` applied."""
    kernels: Kernels
    overrides: tuple[tuple[str, Any], ...] = ()
    """(field, value) of every config field overridden, in the order given."""

    @property
    def setting(self) -> Setting:
        """What the stage table's conditions ask: the config and the flags of the estimator the plan computes with."""
        return Setting(self.config, self.kernels.estimator.flags)

    def describe(self) -> str:
        """The plan in a few lines of text."""
        ranks = "" if self.ranks == (None,) else f" ranks {', '.join(map(str, self.ranks))}"
        lines = [
            f"bundle {self.bundle_id}{ranks}: {self.layout}",
            f"kernels: {self.kernels.estimator.name}, {self.kernels.policy_loss.name}, {self.kernels.aggregation.name}",
        ]
        if self.overrides:
            lines.append("config overridden: " + ", ".join(f"{k}={v}" for k, v in self.overrides))
        lines.append(
            "stages: "
            + ", ".join(f"{p.stage.id} {p.action}" + (f" ({p.reason})" if p.reason else "") for p in self.stages)
        )
        lines += [f"pass {i}: {p.describe()}" for i, p in enumerate(self.passes, 1)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def plan_replay(
    sources: Sequence[ReplaySource],
    selection: Selection = Selection(),
    *,
    stages: Sequence[str | StageId] | None = None,
    rank: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ReplayPlan:
    """The plan to replay one bundle (one source per rank); with `rank`, only that rank of it (the selection
    then picks among that rank's samples); with `overrides`, under the recorded config with those fields changed.
    Every error a replay can raise before computing is raised here."""
    ordered, focus = _focused(_check_sources(sources), rank)
    first = ordered[0]
    for source in ordered:
        check_topology(source.index)
    changes = field_overrides(first, overrides or {})
    config = effective_config(first.index.config, changes)
    planned = tuple(plan_stages(first.manifest, stages, config))
    running = {p.stage.id for p in planned if p.action == "run"}
    # fail before loading anything
    chosen = check_algorithm(config, first.manifest, running, lambda name: all(s.has_payload(name) for s in ordered))
    shards = _group_by_content(ordered)
    if len(shards) > 1 and not _disjoint(shards):
        layout: Layout = "rank-local"
        if focus is not None:  # the other ranks overlap among themselves: this rank's data stands alone too
            shards = [Shard(focus, (focus.rank,))]
        passes = tuple(_rank_local_pass(shard, closure) for shard, closure in _select_per_shard(selection, shards))
    else:
        layout = "single" if len(ordered) == 1 else "replicas" if len(shards) == 1 else "data-parallel"
        passes = (_union_pass(selection, shards, focus, labelled=len(ordered) > 1),)
    return ReplayPlan(
        bundle_id=first.bundle_id,
        reference=first,
        ranks=tuple(s.rank for s in ordered),
        layout=layout,
        shards=tuple(shards),
        stages=planned,
        passes=passes,
        config=config,
        kernels=chosen,
        overrides=tuple((k, config_value(getattr(config, k))) for k in changes),
    )


def _focused(ordered: list[ReplaySource], rank: int | None) -> tuple[list[ReplaySource], ReplaySource | None]:
    """(the sources to replay, the rank's source when only its rows of a data-parallel cohort are replayed)."""
    if rank is None:
        return ordered, None
    focus = next((s for s in ordered if s.rank == rank), None)
    if focus is None:
        raise BundleError(f"bundle {ordered[0].bundle_id} has no rank {rank} (ranks {[s.rank for s in ordered]})")
    mine = {r.sample_id for r in focus.index.samples}
    if any(s is not focus and not mine.isdisjoint(r.sample_id for r in s.index.samples) for s in ordered):
        return [focus], None  # a replica, or rank-local ids: the rank's data is whole by itself
    return ordered, focus


def _union_pass(selection: Selection, shards: Sequence[Shard], focus: ReplaySource | None, *, labelled: bool) -> Pass:
    """The one pass over the union of the shards (one cohort); with `focus`, over that rank's selected rows and
    the other ranks' members of their groups, cohort-level stages for that rank only."""
    union = [r for shard in shards for r in shard.source.index.samples]
    rank_whole = False
    if focus is not None:
        # the selection picks among the rank's own samples; their groups then close over the other ranks
        own = focus.index.samples
        within = resolve_selection(selection, own)
        rank_whole = not within.partial
        selection = Selection(samples=tuple(own[i].sample_id for i in within.positions))
        shards = [replace(s, ranks=(focus.rank,)) if focus.rank in s.ranks else replace(s, ranks=()) for s in shards]
    closure = resolve_selection(selection, union)
    selected = {union[i].sample_id for i in closure.positions}
    parts = _nonempty([_part(s.source, selected) for s in shards])
    ranks = {id(s.source): s.ranks if labelled or not s.ranks else (None,) for s in shards}
    return Pass(
        parts=tuple(parts),
        label=None,
        copies=(),
        cohort_ranks=tuple(ranks[id(p.source)] for p in parts),
        whole=len(parts) == len(shards) and all(p.whole for p in parts),
        cohort_skip=PARTIAL_SELECTION if closure.partial and not rank_whole else "",
    )


def _rank_local_pass(shard: Shard, closure: Closure) -> Pass:
    """A pass over one rank's own selected rows, reported for that rank and its replicas."""
    records = shard.source.index.samples
    parts = _nonempty([_part(shard.source, {records[i].sample_id for i in closure.positions})])
    return Pass(
        parts=tuple(parts),
        label=shard.ranks[0],
        copies=shard.ranks[1:],
        cohort_ranks=(shard.ranks,),
        whole=all(p.whole for p in parts),
        cohort_skip=PARTIAL_SELECTION if closure.partial else "",
    )


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
            raise BundleError(
                f"ranks {first.rank} and {other.rank} of bundle {first.bundle_id} disagree on the recompute config"
            )
        if other.manifest.stage_contracts != first.manifest.stage_contracts:
            raise BundleError(
                f"ranks {first.rank} and {other.rank} of bundle {first.bundle_id} disagree on the stage contracts"
            )
    return ordered


# --------------------------------------------------------------------------- which stages run


def check_topology(index: BundleIndex) -> None:
    """Replay recomputes with context parallelism cp == 1 only (a cp shard holds part of each sequence)."""
    cp = index.identity.rank.cp
    if cp != 1:
        raise UnsupportedError(
            f"unsupported replay topology: cp={cp} "
            f"(advantage_estimator={index.config.advantage_estimator!r}; replay supports cp=1 only)"
        )


SCALED_MODES = ("seq_mean_token_sum_norm", "seq_mean_token_sum_scaled")
"""The aggregation modes that divide by loss_scale_factor."""

_CHOICES = {
    "group_size_check": ("exact", "any"),
    "singleton_group": ("nan", "unit"),
    "masked_return": ("restart", "carry"),
    "rollout_is": CORRECTION_MODES,
    "clip_metric_agg": CLIP_METRIC_AGGS,
    "std_scope": ("group", "batch"),
    "nan_rewards": ("propagate", "exclude"),
    "cispo_clip": ("window", "cap"),
    "entropy_agg": ENTROPY_AGGS,
}


def check_algorithm(
    config: RecomputeConfig, manifest: Manifest, running: set[StageId], has_payload: Callable[[str], bool]
) -> Kernels:
    """The kernels the config names for the stages that run, after checking the config can be recomputed there:
    UnsupportedError naming the field (and value, or the payload it needs) otherwise."""
    kernels = resolve_kernels(config, manifest, running)
    _check_choices(config)
    _check_kl_types(config, running)
    if running & {StageId.LOSS_POLICY, StageId.LOSS_VALUE}:
        _check_loss_config(config, running)
    if StageId.LOSS_POLICY in running or StageId.ROLLOUT_MISMATCH in running:
        _check_rollout_correction(config)
    if StageId.ROLLOUT_MISMATCH in running and config.max_staleness is not None and config.actor_version is None:
        raise UnsupportedError(
            f"max_staleness {config.max_staleness} needs actor_version, which the config does not record"
        )
    _check_planned_payloads(Setting(config, kernels.estimator.flags), manifest, running, has_payload)
    return kernels


def _check_choices(config: RecomputeConfig) -> None:
    """Every field of a closed set of choices holds one replay implements."""
    for field, allowed in _CHOICES.items():
        if getattr(config, field) not in allowed:
            raise UnsupportedError(f"unsupported {field} {getattr(config, field)!r}: one of {', '.join(allowed)}")


def _check_kl_types(config: RecomputeConfig, running: set[StageId]) -> None:
    """The KL estimators the running stages compute with, and those the KL clamps name, are ones replay
    implements."""
    for kl_type in config.kl_clamped or ():
        kernels_mod.check_kl_type(kl_type, "kl_clamped entry")
    if StageId.ADVANTAGE_KL in running and config.kl_coef != 0:
        kernels_mod.check_kl_type(config.kl_loss_type, "kl_loss_type")
    if StageId.LOSS_POLICY in running and config.kl_loss_coef != 0:
        kernels_mod.check_kl_type(config.kl_loss_estimator, "kl_loss_estimator")


def _check_loss_config(config: RecomputeConfig, running: set[StageId]) -> None:
    """The losses' denominators are recorded and positive, and a dual clip is above 1."""
    if config.loss_agg_mode in SCALED_MODES and config.loss_scale_factor is None:
        raise UnsupportedError(
            f"loss_agg_mode {config.loss_agg_mode!r} needs loss_scale_factor (the padded width "
            "production divided by), which the config does not record"
        )
    for field in ("loss_denominator", "loss_scale_factor"):
        value = getattr(config, field)
        if value is not None and not value > 0:
            raise UnsupportedError(f"unsupported {field} {value!r}: must be a positive count")
    if (
        StageId.LOSS_POLICY in running
        and config.policy_loss == "ppo_clip"
        and config.eps_clip_c is not None
        and not config.eps_clip_c > 1.0
    ):
        raise UnsupportedError(f"unsupported eps_clip_c {config.eps_clip_c!r}: the dual clip must be greater than 1")


def _check_planned_payloads(
    setting: Setting, manifest: Manifest, running: set[StageId], has_payload: Callable[[str], bool]
) -> None:
    """Every payload a running stage cannot be replayed without under `setting` (`StageIO.planned`) is there."""
    contracted = set(manifest.stage_contracts)
    for stage in STAGE_ORDER:
        if stage not in running:
            continue
        for payload, why in STAGE_IO[stage].planned_payloads(setting, contracted, stage):
            if not has_payload(payload):
                raise UnsupportedError(
                    f"{why} needs payload {payload!r}, which bundle {manifest.bundle_id} does not hold"
                )


def _check_rollout_correction(config: RecomputeConfig) -> None:
    """A correction's threshold and rejection bounds are positive, the bounds in order; rejection is a mode or a
    chain of divergence criteria replay implements, each with the bounds its kind takes."""
    if not config.rollout_is_threshold > 0:
        raise UnsupportedError(f"unsupported rollout_is_threshold {config.rollout_is_threshold!r}: must be positive")
    lower_is = config.rollout_is_threshold_lower
    if lower_is is not None and not 0 < lower_is <= config.rollout_is_threshold:
        raise UnsupportedError(
            f"unsupported rollout_is_threshold_lower {lower_is!r}: need 0 < it <= rollout_is_threshold "
            f"{config.rollout_is_threshold!r}"
        )
    if config.rollout_rs in ("token", "sequence"):
        lower, upper = rs_bounds(config)
        if not 0 < lower <= upper:
            raise UnsupportedError(
                f"unsupported rejection bounds rollout_rs_lower={lower!r}, rollout_rs_upper="
                f"{upper!r}: need 0 < lower <= upper"
            )
    elif config.rollout_rs != "none":
        _check_criteria(config)


def _check_criteria(config: RecomputeConfig) -> None:
    """Every divergence criterion of rollout_rs is known and has its bounds (k1: 0 < lower <= upper; k2, k3: an
    upper bound above 0 and no lower one)."""
    names = rejection_criteria(config)
    known = ", ".join(("none",) + CORRECTION_MODES[1:] + tuple(DIVERGENCE_CRITERIA))
    if not names:
        raise UnsupportedError(f"unsupported rollout_rs {config.rollout_rs!r}: one of {known}, or a list of criteria")
    for name in names:
        if name not in DIVERGENCE_CRITERIA:
            raise UnsupportedError(f"unsupported rollout_rs criterion {name!r}: one of {known}")
        lower, upper = criterion_bounds(config, name)
        bounds = f"rollout_rs criterion {name!r} with lower={lower!r}, upper={upper!r}"
        if name.endswith("k1"):
            if upper is None or lower is None or not 0 < lower <= upper:
                raise UnsupportedError(f"unsupported {bounds}: a k1 criterion needs 0 < lower <= upper")
        elif upper is None or not upper > 0 or lower is not None:
            raise UnsupportedError(f"unsupported {bounds}: a k2 or k3 criterion needs an upper bound above 0 only")


def field_overrides(source: ReplaySource, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`replay --set` overrides as config fields: on a bundle whose manifest records a convention profile, the
    framework's option names too (`loss_type=grpo` on a TRL bundle), translated by the profile against the recorded
    config; a config field's own name keeps its meaning. UsageError, one line, for a name that is neither or a value
    the profile refuses."""
    record = source.manifest.conventions
    name = record.resolved() if record is not None else None
    if name is None or not overrides:
        return dict(overrides)
    try:
        return profiles.profile(name).changes(overrides, source.index.config.model_dump(), RecomputeConfig.model_fields)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def effective_config(config: RecomputeConfig, overrides: Mapping[str, Any]) -> RecomputeConfig:
    """`config` with fields overridden (`replay --set`); UsageError naming an unknown field or a bad value."""
    if not overrides:
        return config
    unknown = [k for k in overrides if k not in RecomputeConfig.model_fields]
    if unknown:
        raise UsageError(f"unknown config field {unknown[0]!r} (fields: {', '.join(RecomputeConfig.model_fields)})")
    try:
        return RecomputeConfig.model_validate({**config.model_dump(), **overrides})
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        raise UsageError(f"config field {field}: {err['msg']} (got {overrides.get(field)!r})") from None


def parse_stage(name: str | StageId) -> StageId:
    """A stage id from its name; SelectionError for an unknown one."""
    try:
        return StageId(name)
    except ValueError:
        raise UsageError(f"unknown stage {name!r}: stages are {', '.join(s.value for s in STAGE_ORDER)}") from None


def plan_stages(
    manifest: Manifest, requested: Sequence[str | StageId] | None = None, config: RecomputeConfig | None = None
) -> list[PlannedStage]:
    """The contracted stages to replay, in stage order: all, or `requested` and their contracted dependencies
    under `config` (default: the recorded defaults), with the flags of the estimator it names for this bundle."""
    contracted = set(manifest.stage_contracts)
    if isinstance(requested, (str, StageId)):
        requested = [requested]  # one stage name, not a sequence of characters
    if requested:
        wanted = [parse_stage(s) for s in requested]
        absent = [s.value for s in wanted if s not in contracted]
        if absent:
            raise SelectionError(
                f"stage {', '.join(absent)} is not contracted by bundle {manifest.bundle_id} "
                f"(contracted: {', '.join(s.value for s in STAGE_ORDER if s in contracted)})"
            )
        selected: set[StageId] = set()
        named = set(wanted)
        setting = setting_of(config or RecomputeConfig(), manifest)
        pending = list(wanted)
        while pending:  # transitive dependencies, only among contracted stages
            stage_id = pending.pop()
            if stage_id in contracted and stage_id not in selected:
                selected.add(stage_id)
                pending.extend(STAGES[stage_id].dependencies(setting))
    else:
        selected, named = contracted, set()
    return [_plan_one(manifest, STAGES[s], s in named) for s in STAGE_ORDER if s in selected]


def _plan_one(manifest: Manifest, stage: Stage, named: bool = False) -> PlannedStage:
    """How one contracted stage is replayed; `named` when the user asked for it with --stage."""
    contract = manifest.stage_contracts[stage.id]
    capability = contract.capability
    if capability != StageCapability.RECOMPUTE:
        if capability == StageCapability.UNSUPPORTED and named:
            raise UnsupportedError(
                f"stage {stage.id} is declared unsupported by bundle {manifest.bundle_id}: it cannot be replayed"
            )
        reason = f"capability={capability.value} (declared by the bundle)"
        if stage.recorded is not None:
            return PlannedStage(stage, "recorded", f"{reason}; recorded values passed downstream", named)
        return PlannedStage(stage, "skip", reason, named)
    if contract.version != stage.version:
        raise UnsupportedError(
            f"stage {stage.id} contract version {contract.version!r} is not replayable "
            f"(replay implements {stage.version!r})"
        )
    if stage.compute is None:
        raise UnsupportedError(f"stage {stage.id} is not replayable: replay cannot recompute it")
    return PlannedStage(stage, "run", named=named)


# --------------------------------------------------------------------------- how the ranks relate


def _group_by_content(ordered: Sequence[ReplaySource]) -> list[Shard]:
    """The ranks grouped by identical content, in rank order of each group's first rank."""
    shards: list[Shard] = []
    for source in ordered:
        for i, shard in enumerate(shards):
            if _same_content(shard.source, source):
                shards[i] = replace(shard, ranks=shard.ranks + (source.rank,))
                break
        else:
            shards.append(Shard(source, (source.rank,)))
    return shards


def _disjoint(shards: Sequence[Shard]) -> bool:
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
    import torch

    for name in a.manifest.payloads:  # a source without digests (built in memory): compare the tensors
        x, y = a.load_payload(name), b.load_payload(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


def _canonical(value: object) -> str:
    # NaN != NaN, but two identical documents holding NaN are the same content
    return json.dumps(value, sort_keys=True, default=str)


def _payload_digests(source: ReplaySource) -> dict[str, str] | None:
    """{payload: content digest} when the source knows them without loading (None otherwise)."""
    digests = getattr(source, "payload_digests", None)
    if isinstance(digests, dict):
        return digests
    specs = source.manifest.payloads
    known = {name: spec.digest for name, spec in specs.items() if spec.digest}
    return known if len(known) == len(specs) else None


# --------------------------------------------------------------------------- selection over rank-local ids

_KEYS: dict[str, Callable[[SampleRecord], str | None]] = {
    "samples": lambda r: r.sample_id,
    "groups": lambda r: group_id(r.group_index),
    "batches": lambda r: r.micro_batch_id,
}


def _select_per_shard(selection: Selection, shards: Sequence[Shard]) -> list[tuple[Shard, Closure]]:
    """Each shard the selection touches, with its closure; an id that is in no shard fails closed."""
    if selection.everything:
        return [(s, resolve_selection(selection, s.source.index.samples)) for s in shards]
    present = [{kind: {key(r) for r in s.source.index.samples} for kind, key in _KEYS.items()} for s in shards]
    nowhere = Selection(
        **{kind: tuple(i for i in getattr(selection, kind) if not any(i in p[kind] for p in present)) for kind in _KEYS}
    )
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


def config_value(value: Any) -> Any:
    """A config value as the report prints it (JSON-ready)."""
    return value.value if hasattr(value, "value") else value


__all__ = [
    "Action",
    "Layout",
    "check_algorithm",
    "config_value",
    "effective_config",
    "PARTIAL_SELECTION",
    "Pass",
    "PlannedStage",
    "ReplayPlan",
    "Shard",
    "check_topology",
    "parse_stage",
    "plan_replay",
    "plan_stages",
]
