"""The replay stages, each a separately versioned value, and the capability matrix that admits them.

Downstream stages consume the *recomputed* outputs of upstream stages (advantage.estimate uses the
recomputed post-processed rewards, loss.policy the recomputed advantages when advantage.estimate is
contracted), so a bug shows at the stage where it starts, not where it surfaces.

Capability decisions (a stage's contract in the manifest):
- `recompute`: the stage runs. A recompute contract for a stage replay cannot compute (loss.value), or
  a contract version other than the stage's: UnsupportedError (never a best effort).
- `recorded-only`, `inspect-only`, `unsupported`: the bundle itself says the stage is not to be
  replayed (the older tool's capture declares loss.value unsupported in every bundle). It is reported
  skipped with `capability=<value>` and never fails the replay. A stage with recorded outputs hands them
  downstream instead (reward.post_process the records' `reward`, advantage.estimate the `advantages`
  payload; reward.post_process falls back to the records' `raw_reward` by itself), so the stages after
  it are still checked against what production consumed. Asking for an `unsupported` stage by name
  (`--stage`) is an UnsupportedError: what was asked for cannot be given.
- The topology (advantage_estimator, cp) is checked for the whole bundle: anything but GRPO with cp == 1
  is an UnsupportedError, whatever the contracts say.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import (
    STAGE_ORDER, BundleIndex, Manifest, RecomputeConfig, StageCapability, StageId,
)
from trajectory_replay.errors import SelectionError, UnsupportedError, UsageError
from trajectory_replay.replay import kernels
from trajectory_replay.replay.cohort import Cohort
from trajectory_replay.replay.compare import (
    EXACT, Findings, SampleLayout, Tolerances, compare_scalar, compare_tensors,
)
from trajectory_replay.replay.report import Divergence, StageResult

Outputs = Mapping[str, torch.Tensor]
LOSS_FIELDS = ("loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl")


@dataclass
class StageContext:
    """What a stage runs with: its cohort, config, tolerance and the recomputed upstream outputs."""

    cohort: Cohort
    config: RecomputeConfig
    tol: Tolerances
    contracted: frozenset[StageId]
    outputs: dict[StageId, Outputs]
    """Outputs of upstream stages that produced them (recomputed, or recorded for recorded-only)."""
    rank: Optional[int] = None


@dataclass(frozen=True)
class StageOutcome:
    """A stage's verdict and the outputs it hands downstream (empty when it could not compute them)."""

    result: StageResult
    outputs: Outputs = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One replay stage: what it reads and produces, what it depends on, and how it computes."""

    id: StageId
    version: str
    inputs: tuple[str, ...]
    """Payload names and index fields it may read (payloads are loaded only when actually needed)."""
    outputs: tuple[str, ...]
    depends_on: tuple[StageId, ...]
    cohort_level: bool = False
    """Reduces over the whole cohort: not replayable under a partial selection, runs per rank."""
    compute: Optional[Callable[[StageContext], StageOutcome]] = None
    """None: replay cannot compute this stage."""
    recorded: Optional[Callable[[StageContext], Outputs]] = None
    """The outputs a recorded-only contract hands downstream instead of recomputing."""


def _load_payloads(ctx: StageContext, findings: Findings, names: Sequence[str]) -> Optional[dict[str, torch.Tensor]]:
    """The named per-token payloads, or None after recording which are missing or of the wrong size."""
    missing = [n for n in names if not ctx.cohort.has_payload(n)]
    for name in missing:
        findings.problem(f"bundle has no payload {name!r}")
    if missing:
        return None
    loaded = {n: ctx.cohort.load(n) for n in names}
    tokens = ctx.cohort.num_tokens
    wrong = [(n, t.numel()) for n, t in loaded.items() if t.numel() != tokens]
    for name, numel in wrong:
        findings.problem(f"payload {name!r} has {numel} values, the responses have {tokens} tokens")
    return None if wrong else loaded


def _upstream(ctx: StageContext, findings: Findings, stage: StageId, key: str) -> Optional[torch.Tensor]:
    """A recomputed upstream output, or None after recording why it is not there."""
    produced = ctx.outputs.get(stage, {}).get(key)
    if produced is None:
        why = "produced none" if stage in ctx.contracted else "is not contracted by the bundle"
        findings.problem(f"needs {key} from upstream stage {stage}, which {why}")
    return produced


def _compare_per_sample(ctx: StageContext, f: Findings, stage: StageId, key: str, field_name: str,
                        actual: torch.Tensor) -> None:
    """Compare `actual` with the expected per-sample list `stage.key` (length-checked, indexed down)."""
    expected, problems = ctx.cohort.expected_list(stage.value, key)
    for p in problems:
        f.problem(p)
    if expected is not None:
        f.add(compare_tensors(field_name, expected, actual, ctx.cohort.sample_layout, ctx.tol))


def _run_sample(ctx: StageContext) -> StageOutcome:
    c, f = ctx.cohort, Findings()
    for r in c.records:
        if r.response_length < 0 or r.total_length < r.response_length:
            f.problem(f"sample {r.sample_id}: response_length {r.response_length}, total_length {r.total_length}",
                      Divergence("length", r.sample_id, None, float(r.total_length), float(r.response_length),
                                 None))
        if r.loss_mask and len(r.loss_mask) != r.response_length:
            f.problem(f"sample {r.sample_id}: loss_mask has {len(r.loss_mask)} values, "
                      f"response_length {r.response_length}",
                      Divergence("loss_mask_length", r.sample_id, None, float(r.response_length),
                                 float(len(r.loss_mask)), float(abs(len(r.loss_mask) - r.response_length))))
    duplicates = sorted(sid for sid, count in Counter(c.sample_ids).items() if count > 1)
    if duplicates:
        f.problem(f"duplicate sample ids: {', '.join(duplicates[:10])}")
    _check_payload_sizes(ctx, f)
    mask = c.load("loss_mask")
    if mask.numel() != c.num_tokens:
        f.problem(f"loss_mask_length: loss_mask payload has {mask.numel()} values, "
                  f"the responses have {c.num_tokens} tokens")
    else:
        _check_record_masks(c, mask, f)
    return StageOutcome(f.result(StageId.SAMPLE, ctx.rank, passed_message=f"{len(c.records)} samples, "
                                 f"{c.num_tokens} tokens"))


def _check_payload_sizes(ctx: StageContext, f: Findings) -> None:
    """Every declared per-token payload has sum(response_length) elements (from the manifest, no load)."""
    for part in ctx.cohort.parts:
        tokens = sum(r.response_length for r in part.source.index.samples)
        for spec in part.source.manifest.payloads.values():
            numel = 1
            for dim in spec.shape:
                numel *= dim
            if spec.per_token and numel != tokens:
                f.problem(f"{part.rank_prefix}payload {spec.name!r} has {numel} elements, "
                          f"the responses have {tokens} tokens")


def _check_record_masks(c: Cohort, mask: torch.Tensor, f: Findings) -> None:
    """Records that still carry a loss_mask (older bundles) must agree with the payload (the "expected" side)."""
    carried = [r for r in c.records if r.loss_mask and len(r.loss_mask) == r.response_length]
    if not carried:
        return
    has_mask = torch.tensor([bool(r.loss_mask and len(r.loss_mask) == r.response_length) for r in c.records])
    rows = torch.repeat_interleave(has_mask, c.lengths)
    listed = torch.tensor([v for r in carried for v in r.loss_mask], dtype=torch.float32)
    layout = SampleLayout.per_token([r.sample_id for r in carried],
                                    torch.tensor([r.response_length for r in carried]))
    f.add(compare_tensors("loss_mask", mask[rows], listed, layout, EXACT))


def _run_reward_raw(ctx: StageContext) -> StageOutcome:
    f = Findings()
    actual = _recorded_raw_rewards(ctx)  # V1 supports scalar rewards only: the recorded one is the recompute
    _compare_per_sample(ctx, f, StageId.REWARD_RAW, "raw_rewards", "raw_reward", actual)
    return StageOutcome(f.result(StageId.REWARD_RAW, ctx.rank), {"raw_rewards": actual})


def _recorded_raw_rewards(ctx: StageContext) -> torch.Tensor:
    return torch.tensor([r.raw_reward for r in ctx.cohort.records], dtype=torch.float32)


def _run_reward_post_process(ctx: StageContext) -> StageOutcome:
    c, f, n = ctx.cohort, Findings(), ctx.config.n_samples_per_prompt
    for r in c.records:
        if r.group_index is None:
            f.problem(f"sample {r.sample_id} has no group_index")
    if f.failed:
        return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank))
    group_ids, keys = kernels.dense_group_ids([r.group_index for r in c.records])
    sizes = torch.bincount(group_ids, minlength=len(keys)).tolist()
    for key, size in zip(keys, sizes):
        if size != n:
            f.problem(f"reward group g-{key} has {size} samples, expected {n}")
    if f.failed:
        return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank))
    raw = ctx.outputs.get(StageId.REWARD_RAW, {}).get("raw_rewards")
    rewards = kernels.normalize_group_rewards(raw if raw is not None else _recorded_raw_rewards(ctx), group_ids,
                                              len(keys), ctx.config.grpo_std_normalization)
    _compare_per_sample(ctx, f, StageId.REWARD_POST_PROCESS, "rewards", "reward", rewards)
    return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank,
                                 passed_message=f"{len(keys)} groups of {n}"), {"rewards": rewards})


def _recorded_rewards(ctx: StageContext) -> Outputs:
    return {"rewards": torch.tensor([r.reward for r in ctx.cohort.records], dtype=torch.float32)}


def _run_advantage_kl(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    # kl_coef == 0: the reward-side KL is zeros and the reference log-probs are not needed (not loaded)
    inputs = () if cfg.kl_coef == 0 else ("old_log_probs", "ref_log_probs")
    loaded = _load_payloads(ctx, f, ("kl",) + inputs)
    if loaded is None:
        return StageOutcome(f.result(StageId.ADVANTAGE_KL, ctx.rank))
    if cfg.kl_coef == 0:
        actual = torch.zeros(c.num_tokens, dtype=torch.float32)
    else:
        actual = kernels.kl_estimate(loaded["old_log_probs"], loaded["ref_log_probs"], cfg.kl_loss_type)
    f.add(compare_tensors("kl", loaded["kl"], actual, c.token_layout, ctx.tol))
    return StageOutcome(f.result(StageId.ADVANTAGE_KL, ctx.rank), {"kl": actual})


def _run_advantage_estimate(ctx: StageContext) -> StageOutcome:
    c, f = ctx.cohort, Findings()
    rewards = _upstream(ctx, f, StageId.REWARD_POST_PROCESS, "rewards")
    loaded = _load_payloads(ctx, f, ("advantages",))
    if rewards is None or loaded is None:
        return StageOutcome(f.result(StageId.ADVANTAGE_ESTIMATE, ctx.rank))
    actual = kernels.grpo_advantages(rewards, c.lengths)
    f.add(compare_tensors("advantages", loaded["advantages"], actual, c.token_layout, ctx.tol))
    return StageOutcome(f.result(StageId.ADVANTAGE_ESTIMATE, ctx.rank), {"advantages": actual})


def _recorded_advantages(ctx: StageContext) -> Outputs:
    return {"advantages": ctx.cohort.load("advantages")}


def _run_loss_policy(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    if StageId.ADVANTAGE_ESTIMATE in ctx.contracted:
        advantages = _upstream(ctx, f, StageId.ADVANTAGE_ESTIMATE, "advantages")
        loaded = _load_payloads(ctx, f, ("old_log_probs", "log_probs", "entropy", "loss_mask"))
    else:  # a loss-only bundle: the recorded advantages are the input
        loaded = _load_payloads(ctx, f, ("old_log_probs", "log_probs", "entropy", "loss_mask", "advantages"))
        advantages = loaded["advantages"] if loaded is not None else None
    expected = c.expected_map(StageId.LOSS_POLICY.value)
    if expected is None:
        f.problem("expected has no loss.policy map")
    if advantages is None or loaded is None or expected is None:
        return StageOutcome(f.result(StageId.LOSS_POLICY, ctx.rank))
    actual = kernels.policy_loss_outputs(
        loaded["log_probs"], loaded["old_log_probs"], advantages, loaded["entropy"], loaded["loss_mask"],
        c.lengths, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
        entropy_coef=cfg.entropy_coef)
    for name in LOSS_FIELDS:
        if expected.get(name) is None:
            f.problem(f"expected loss.policy has no field {name!r}")
        else:
            f.add(compare_scalar(name, float(expected[name]), actual[name], ctx.tol))
    return StageOutcome(f.result(StageId.LOSS_POLICY, ctx.rank))


STAGES: dict[StageId, Stage] = {s.id: s for s in (
    Stage(StageId.SAMPLE, "v1", inputs=("loss_mask", "response_length", "total_length", "sample_id"),
          outputs=(), depends_on=(), compute=_run_sample),
    Stage(StageId.REWARD_RAW, "v1", inputs=("raw_reward",), outputs=("raw_rewards",),
          depends_on=(StageId.SAMPLE,), compute=_run_reward_raw),
    Stage(StageId.REWARD_POST_PROCESS, "v1", inputs=("raw_reward", "group_index"), outputs=("rewards",),
          depends_on=(StageId.SAMPLE, StageId.REWARD_RAW), compute=_run_reward_post_process,
          recorded=_recorded_rewards),
    Stage(StageId.ADVANTAGE_KL, "v1", inputs=("old_log_probs", "ref_log_probs", "kl"), outputs=("kl",),
          depends_on=(StageId.SAMPLE,), compute=_run_advantage_kl),
    Stage(StageId.ADVANTAGE_ESTIMATE, "v1", inputs=("advantages",), outputs=("advantages",),
          depends_on=(StageId.SAMPLE, StageId.REWARD_POST_PROCESS), compute=_run_advantage_estimate,
          recorded=_recorded_advantages),
    Stage(StageId.LOSS_POLICY, "v1", inputs=("old_log_probs", "log_probs", "entropy", "loss_mask", "advantages"),
          outputs=LOSS_FIELDS, depends_on=(StageId.SAMPLE, StageId.ADVANTAGE_ESTIMATE), cohort_level=True,
          compute=_run_loss_policy),
    Stage(StageId.LOSS_VALUE, "v1", inputs=(), outputs=(), depends_on=(StageId.SAMPLE,), cohort_level=True),
)}


def check_topology(index: BundleIndex) -> None:
    """Capability matrix: only advantage_estimator 'grpo' with cp == 1 is replayable; else UnsupportedError."""
    estimator, cp = index.config.advantage_estimator, index.identity.rank.cp
    if estimator != "grpo" or cp != 1:
        raise UnsupportedError(f"unsupported replay topology: advantage_estimator={estimator!r}, cp={cp} "
                               "(replay supports advantage_estimator='grpo' with cp=1 only)")


Action = Literal["run", "recorded", "skip"]


@dataclass(frozen=True)
class PlannedStage:
    """A stage replay will run, replace by its recorded outputs, or report skipped (with why)."""

    stage: Stage
    action: Action
    reason: str = ""


def parse_stage(name: str | StageId) -> StageId:
    """A stage id from its name; SelectionError for an unknown one."""
    try:
        return StageId(name)
    except ValueError:
        raise UsageError(f"unknown stage {name!r}: stages are {', '.join(s.value for s in STAGE_ORDER)}") from None


def plan_stages(manifest: Manifest, requested: Optional[Sequence[str | StageId]] = None) -> list[PlannedStage]:
    """The contracted stages to replay, in stage order: all, or `requested` and their contracted dependencies."""
    contracted = set(manifest.stage_contracts)
    if isinstance(requested, (str, StageId)):
        requested = [requested]  # one stage name, not a sequence of characters
    if requested:
        wanted = [parse_stage(s) for s in requested]
        absent = [s.value for s in wanted if s not in contracted]
        if absent:
            raise SelectionError(f"stage {', '.join(absent)} is not contracted by bundle {manifest.bundle_id} "
                                 f"(contracted: {', '.join(s.value for s in STAGE_ORDER if s in contracted)})")
        selected: set[StageId] = set()
        named = set(wanted)
        pending = list(wanted)
        while pending:  # transitive dependencies, only among contracted stages
            stage_id = pending.pop()
            if stage_id in contracted and stage_id not in selected:
                selected.add(stage_id)
                pending.extend(STAGES[stage_id].depends_on)
    else:
        selected, named = contracted, set()
    return [_plan_one(manifest, STAGES[s], s in named) for s in STAGE_ORDER if s in selected]


def _plan_one(manifest: Manifest, stage: Stage, named: bool = False) -> PlannedStage:
    """How one contracted stage is replayed; `named` when the user asked for it with --stage."""
    contract = manifest.stage_contracts[stage.id]
    capability = contract.capability
    if capability != StageCapability.RECOMPUTE:
        if capability == StageCapability.UNSUPPORTED and named:
            raise UnsupportedError(f"stage {stage.id} is declared unsupported by bundle {manifest.bundle_id}: "
                                   "it cannot be replayed")
        reason = f"capability={capability.value} (declared by the bundle)"
        if stage.recorded is not None:
            return PlannedStage(stage, "recorded", f"{reason}; recorded values passed downstream")
        return PlannedStage(stage, "skip", reason)
    if contract.version != stage.version:
        raise UnsupportedError(f"stage {stage.id} contract version {contract.version!r} is not replayable "
                               f"(replay implements {stage.version!r})")
    if stage.compute is None:
        raise UnsupportedError(f"stage {stage.id} is not replayable: replay cannot recompute it")
    return PlannedStage(stage, "run")


__all__ = ["LOSS_FIELDS", "PlannedStage", "STAGES", "Stage", "StageContext", "StageOutcome", "check_topology",
           "parse_stage", "plan_stages"]
