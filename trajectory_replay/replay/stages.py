"""The replay stages: each a separately versioned computation over a cohort, keyed by stage id.

Downstream stages consume the *recomputed* outputs of upstream stages (advantage.estimate uses the
recomputed post-processed rewards, loss.policy the recomputed advantages when advantage.estimate is
contracted), so a bug shows at the stage where it starts, not where it surfaces.

What a stage reads and produces is not declared here: `bundle.stage_io.STAGE_IO` is the one table of
stage inputs and outputs (capture and validate read it too); a `Stage` adds how replay computes it, and
the outputs a stage the bundle declares recorded-only hands downstream instead. Which stages run, and
why others are skipped, is decided by `replay.plan`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import LOSS_FIELDS, MISMATCH_FIELDS, STAGE_IO, StageIO, rollout_correction
from trajectory_replay.replay import kernels, losses, mismatch
from trajectory_replay.replay.estimators import AdvantageInputs, RewardInputs
from trajectory_replay.replay.registry import Kernels
from trajectory_replay.replay.cohort import Cohort
from trajectory_replay.replay.compare import (
    EXACT, Findings, SampleLayout, Tolerances, compare_scalar, compare_tensors,
)
from trajectory_replay.replay.report import Divergence, StageResult

Outputs = Mapping[str, torch.Tensor]


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
    kernels: Kernels = field(default=None)  # type: ignore[assignment]  # set by the runner from the plan
    """The estimator, policy loss and aggregation the config names."""


@dataclass(frozen=True)
class StageOutcome:
    """A stage's verdict and the outputs it hands downstream (empty when it could not compute them)."""

    result: StageResult
    outputs: Outputs = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    """One replay stage: how it computes (its inputs and outputs are its row of `STAGE_IO`)."""

    id: StageId
    version: str
    cohort_level: bool = False
    """Reduces over the whole cohort: not replayable under a partial selection, runs per rank."""
    compute: Optional[Callable[[StageContext], StageOutcome]] = None
    """None: replay cannot compute this stage."""
    recorded: Optional[Callable[[StageContext], Outputs]] = None
    """The outputs a recorded-only contract hands downstream instead of recomputing."""

    @property
    def io(self) -> StageIO:
        return STAGE_IO[self.id]

    @property
    def inputs(self) -> tuple[str, ...]:
        """The payloads it may load (loaded only when actually needed; kept loaded while a later stage may)."""
        return self.io.payloads_read

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.io.outputs

    def dependencies(self, config: RecomputeConfig) -> tuple[StageId, ...]:
        """The stages that must be planned before it under `config`: the sample check (every stage lays values out
        by the records it checks) and the stages whose outputs it consumes under that config."""
        if self.id == StageId.SAMPLE:
            return ()
        return (StageId.SAMPLE,) + tuple(dict.fromkeys(stage for stage, _ in self.io.consumes(config)))


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


def _run_rollout_mismatch(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    metrics: dict[str, object] = {}
    versions = [r.policy_version for r in c.records]
    has_log_probs = c.has_payload("rollout_log_probs")
    if not has_log_probs and all(v is None for v in versions):
        f.problem("bundle has no payload 'rollout_log_probs' and no sample records a policy_version")
        return StageOutcome(f.result(StageId.ROLLOUT_MISMATCH, ctx.rank))
    actual: dict[str, Optional[float]] = {}
    if has_log_probs:
        loaded = _load_payloads(ctx, f, ("rollout_log_probs", "old_log_probs", "loss_mask"))
        if loaded is None:
            return StageOutcome(f.result(StageId.ROLLOUT_MISMATCH, ctx.rank))
        mask, rollout_lp, old_lp = loaded["loss_mask"], loaded["rollout_log_probs"], loaded["old_log_probs"]
        inside = mask.to(torch.bool)
        tokens = int(torch.count_nonzero(inside))
        d = mismatch.log_ratio(old_lp, rollout_lp)
        scores = mismatch.token_scores(d, inside)
        if not math.isfinite(float(scores.max()) if tokens else 0.0):
            _check_finite(f, d, mask, c)
        worst = mismatch.worst_tokens(scores, tokens=tokens)
        # d is ours: zeroed where masked out from here on (the masked-in tokens, all this stage reads, keep theirs)
        actual.update(mismatch.mismatch_metrics(d, inside, c.lengths, scores, in_place=True).as_dict())
        located = c.token_layout.locate(worst)
        rows = [{"sample_id": sid, "token_offset": tok, "rollout_log_prob": float(rollout_lp[p]),
                 "trainer_log_prob": float(old_lp[p]), "log_ratio": float(d[p])} for p, (sid, tok) in zip(worst, located)]
        _check_thresholds(cfg, f, actual, rows, d, mask)
        if c.has_payload("rollout_is_weights") and cfg.rollout_is == "none":
            f.problem("bundle holds production's rollout_is_weights, but the config's rollout_is is 'none' "
                      "(replay --set rollout_is=token or sequence)")
        elif c.has_payload("rollout_is_weights"):
            fix = mismatch.correction(d, mask, c.lengths, cfg)
            recorded = _load_payloads(ctx, f, ("rollout_is_weights",))
            if recorded is not None:
                f.add(compare_tensors("rollout_is_weights", recorded["rollout_is_weights"],
                                      mismatch.recorded_weights(fix, mask), c.token_layout, ctx.tol))
    else:
        rows, tokens = [], 0
    actual["staleness_max"] = _check_staleness(cfg, f, c)
    expected = ctx.cohort.expected_map(StageId.ROLLOUT_MISMATCH.value) or {}
    for name in MISMATCH_FIELDS:
        if expected.get(name) is None:
            continue
        value = actual.get(name)
        if value is None:
            f.problem(f"expected {StageId.ROLLOUT_MISMATCH} has {name} but the bundle holds nothing to compute it from")
        else:
            f.add(compare_scalar(name, float(expected[name]), float(value), ctx.tol))
    metrics.update(actual)
    if has_log_probs:
        metrics["worst_tokens"] = rows
    passed = (f"{tokens} tokens" if has_log_probs else "no rollout log-probs") + \
        (f", staleness max {actual['staleness_max']}" if actual["staleness_max"] is not None else "")
    return StageOutcome(f.result(StageId.ROLLOUT_MISMATCH, ctx.rank, passed_message=passed, metrics=metrics))


def _check_finite(f: Findings, d: torch.Tensor, mask: torch.Tensor, c: Cohort) -> None:
    """A masked-in token whose log ratio is NaN or infinite (a broken log-prob on either side) fails the stage."""
    bad = (~torch.isfinite(d) & mask.to(torch.bool)).nonzero().flatten()
    if bad.numel():
        (sid, tok), = c.token_layout.locate(bad[:1])
        f.problem(f"log ratio is {float(d[bad[0]])} at {sid} token {tok} ({bad.numel()} tokens not finite)")


def _check_thresholds(cfg: RecomputeConfig, f: Findings, actual: dict[str, Optional[float]], rows: list[dict],
                      d: torch.Tensor, mask: torch.Tensor) -> None:
    """Fail when kl_k3 or a token's |d| exceeds its configured ceiling. The divergences are the worst tokens,
    largest |d| first (expected = the rollout log-prob, actual = the trainer's): those over the token ceiling when
    it tripped, else all of them (each adds to kl_k3)."""
    kl_k3, kl_limit, limit = actual["kl_k3"], cfg.mismatch_max_kl_k3, cfg.mismatch_max_token_log_ratio
    kl_tripped = kl_limit is not None and kl_k3 is not None and not kl_k3 <= kl_limit
    if kl_tripped:
        f.problem(f"kl_k3 {kl_k3:.6g} exceeds mismatch_max_kl_k3 {kl_limit:g}")
    over = 0
    if limit is not None:
        over = int(torch.count_nonzero(((d.abs() > limit) | d.isnan()) & mask.to(torch.bool)))
        if over:
            f.problem(f"{over} tokens have |log ratio| above mismatch_max_token_log_ratio {limit:g}")
    if over or kl_tripped:
        listed = [r for r in rows if not abs(r["log_ratio"]) <= limit] if over else rows
        f.divergences.extend(Divergence("log_ratio", r["sample_id"], r["token_offset"], r["rollout_log_prob"],
                                        r["trainer_log_prob"], abs(r["log_ratio"])) for r in listed)


def _check_staleness(cfg: RecomputeConfig, f: Findings, c: Cohort) -> Optional[float]:
    """The largest actor_version - policy_version; a sample from a newer policy, or older than max_staleness, fails."""
    lags = mismatch.staleness([r.policy_version for r in c.records], cfg.actor_version)
    known = [(r, lag) for r, lag in zip(c.records, lags) if lag is not None]
    for r, lag in known:
        if lag < 0:
            f.problem(f"sample {r.sample_id} has policy_version {r.policy_version}, newer than actor_version "
                      f"{cfg.actor_version}",
                      Divergence("policy_version", r.sample_id, None, float(cfg.actor_version), float(r.policy_version),
                                 float(-lag)))
        elif cfg.max_staleness is not None and lag > cfg.max_staleness:
            f.problem(f"sample {r.sample_id} has policy_version {r.policy_version}, {lag} versions behind actor_version "
                      f"{cfg.actor_version} (max_staleness {cfg.max_staleness})",
                      Divergence("policy_version", r.sample_id, None, float(cfg.actor_version), float(r.policy_version),
                                 float(lag)))
    return float(max(lag for _, lag in known)) if known else None


def _run_reward_raw(ctx: StageContext) -> StageOutcome:
    f = Findings()
    actual = _recorded_raw_rewards(ctx)  # V1 supports scalar rewards only: the recorded one is the recompute
    _compare_per_sample(ctx, f, StageId.REWARD_RAW, "raw_rewards", "raw_reward", actual)
    return StageOutcome(f.result(StageId.REWARD_RAW, ctx.rank), {"raw_rewards": actual})


def _recorded_raw_rewards(ctx: StageContext) -> torch.Tensor:
    return torch.tensor([r.raw_reward for r in ctx.cohort.records], dtype=torch.float32)


def _run_reward_post_process(ctx: StageContext) -> StageOutcome:
    c, f, cfg, estimator = ctx.cohort, Findings(), ctx.config, ctx.kernels.estimator
    if estimator.grouped:
        for r in c.records:
            if r.group_index is None:
                f.problem(f"sample {r.sample_id} has no group_index")
        if f.failed:
            return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank))
        group_ids, keys = kernels.dense_group_ids([r.group_index for r in c.records])
    else:  # the estimator works on token rewards: groups play no part
        group_ids, keys = torch.zeros(len(c.records), dtype=torch.int64), [0] if c.records else []
    sizes = torch.bincount(group_ids, minlength=len(keys)).tolist()
    if estimator.grouped and cfg.group_size_check == "exact":
        for key, size in zip(keys, sizes):
            if size != cfg.n_samples_per_prompt:
                f.problem(f"reward group g-{key} has {size} samples, expected {cfg.n_samples_per_prompt}")
        if f.failed:
            return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank))
    raw = ctx.outputs.get(StageId.REWARD_RAW, {}).get("raw_rewards")
    rewards = estimator.post_process(RewardInputs(raw if raw is not None else _recorded_raw_rewards(ctx), group_ids,
                                                  len(keys), cfg))
    _compare_per_sample(ctx, f, StageId.REWARD_POST_PROCESS, "rewards", "reward", rewards)
    passed = (f"{len(keys)} groups" + (f" of {cfg.n_samples_per_prompt}" if cfg.group_size_check == "exact" else "")
              if estimator.grouped else f"{len(c.records)} samples, {estimator.name} keeps raw rewards")
    return StageOutcome(f.result(StageId.REWARD_POST_PROCESS, ctx.rank, passed_message=passed), {"rewards": rewards})


def _recorded_rewards(ctx: StageContext) -> Outputs:
    return {"rewards": torch.tensor([r.reward for r in ctx.cohort.records], dtype=torch.float32)}


def _run_advantage_kl(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    # kl_coef == 0: the reward-side KL is zeros and the log-probs are not needed (not loaded)
    loaded = _load_payloads(ctx, f, STAGE_IO[StageId.ADVANTAGE_KL].needed_payloads(cfg))
    if loaded is None:
        return StageOutcome(f.result(StageId.ADVANTAGE_KL, ctx.rank))
    if cfg.kl_coef == 0:
        actual = torch.zeros(c.num_tokens, dtype=torch.float32)
    else:
        actual = kernels.kl_estimate(loaded["old_log_probs"], loaded["ref_log_probs"], cfg.kl_loss_type,
                                     cfg.kl_log_ratio_clamp, cfg.kl_output_clamp)
    f.add(compare_tensors("kl", loaded["kl"], actual, c.token_layout, ctx.tol))
    return StageOutcome(f.result(StageId.ADVANTAGE_KL, ctx.rank), {"kl": actual})


def _reward_kl(ctx: StageContext, f: Findings) -> Optional[torch.Tensor]:
    """The reward-side KL the token rewards take: advantage.kl's when it ran, else the recorded `kl` payload."""
    produced = ctx.outputs.get(StageId.ADVANTAGE_KL, {}).get("kl")
    if produced is not None:
        return produced
    loaded = _load_payloads(ctx, f, ("kl",))
    return None if loaded is None else loaded["kl"]


def _run_advantage_estimate(ctx: StageContext) -> StageOutcome:
    c, f, cfg, estimator = ctx.cohort, Findings(), ctx.config, ctx.kernels.estimator
    rewards = _upstream(ctx, f, StageId.REWARD_POST_PROCESS, "rewards")
    # a plugin estimator declares whether it reads values (and so produces returns); gae does
    names = ("loss_mask", "advantages") + (("values", "returns") if estimator.needs_values else ())
    loaded = _load_payloads(ctx, f, names)
    kl = _reward_kl(ctx, f) if cfg.kl_in_reward and cfg.kl_coef != 0 and estimator.reads_kl else None
    if rewards is None or loaded is None or f.failed:
        return StageOutcome(f.result(StageId.ADVANTAGE_ESTIMATE, ctx.rank))
    actual = estimator.advantages(AdvantageInputs(rewards, c.lengths, loaded["loss_mask"], cfg, kl=kl,
                                                  values=loaded.get("values")))
    f.add(compare_tensors("advantages", loaded["advantages"], actual.advantages, c.token_layout, ctx.tol))
    outputs = {"advantages": actual.advantages}
    if actual.returns is not None:
        f.add(compare_tensors("returns", loaded["returns"], actual.returns, c.token_layout, ctx.tol))
        outputs["returns"] = actual.returns
    return StageOutcome(f.result(StageId.ADVANTAGE_ESTIMATE, ctx.rank), outputs)


def _recorded_advantages(ctx: StageContext) -> Outputs:
    out = {"advantages": ctx.cohort.load("advantages")}
    if ctx.cohort.has_payload("returns"):
        out["returns"] = ctx.cohort.load("returns")
    return out


def _upstream_or_payload(ctx: StageContext, f: Findings, stage: StageId, key: str,
                         payloads: tuple[str, ...]) -> tuple[Optional[torch.Tensor], Optional[dict[str, torch.Tensor]]]:
    """(`key` from `stage` when the bundle contracts it, else from the payload of that name; the other payloads)."""
    if stage in ctx.contracted:
        return _upstream(ctx, f, stage, key), _load_payloads(ctx, f, payloads)
    loaded = _load_payloads(ctx, f, payloads + (key,))
    return (loaded[key] if loaded is not None else None), loaded


def _compare_scalars(ctx: StageContext, f: Findings, stage: StageId, actual: dict[str, float]) -> None:
    """Compare every scalar the stage produces under the config with its expected map (a missing field fails)."""
    expected = ctx.cohort.expected_map(stage.value)
    if expected is None:
        f.problem(f"expected has no {stage} map")
        return
    for name in STAGE_IO[stage].outputs_for(ctx.config):
        if expected.get(name) is None:
            f.problem(f"expected {stage} has no field {name!r}")
        else:
            f.add(compare_scalar(name, float(expected[name]), actual[name], ctx.tol))


def _run_loss_policy(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    names = ("old_log_probs", "log_probs", "entropy", "loss_mask") + (("ref_log_probs",) if cfg.kl_loss_coef else ()) \
        + (("rollout_log_probs",) if rollout_correction(cfg) else ())
    advantages, loaded = _upstream_or_payload(ctx, f, StageId.ADVANTAGE_ESTIMATE, "advantages", names)
    if ctx.cohort.expected_map(StageId.LOSS_POLICY.value) is None:
        f.problem("expected has no loss.policy map")
    if advantages is None or loaded is None or f.failed:
        return StageOutcome(f.result(StageId.LOSS_POLICY, ctx.rank))
    if cfg.expect_on_policy:
        _check_on_policy(ctx, f, loaded)
    actual = losses.policy_loss_outputs(losses.PolicyLossData(
        loaded["log_probs"], loaded["old_log_probs"], advantages, loaded["entropy"], loaded["loss_mask"], c.lengths,
        loaded.get("ref_log_probs"), loaded.get("rollout_log_probs")), cfg, ctx.kernels)
    _compare_scalars(ctx, f, StageId.LOSS_POLICY, actual)
    return StageOutcome(f.result(StageId.LOSS_POLICY, ctx.rank))


def _check_on_policy(ctx: StageContext, f: Findings, loaded: dict[str, torch.Tensor]) -> None:
    """expect_on_policy: the current log-probs equal the old ones on every masked-in token (compared as field
    `ratio`, expected = old, actual = current); the first token where they differ is the first divergence, the
    signature of old log-probs computed by another policy than the one being trained."""
    inside = loaded["loss_mask"].to(torch.bool)
    zero = torch.zeros((), dtype=torch.float32)
    old = torch.where(inside, loaded["old_log_probs"].to(torch.float32), zero)
    current = torch.where(inside, loaded["log_probs"].to(torch.float32), zero)
    f.add(compare_tensors("ratio", old, current, ctx.cohort.token_layout, ctx.tol))


def _run_loss_value(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, Findings(), ctx.config
    returns, loaded = _upstream_or_payload(ctx, f, StageId.ADVANTAGE_ESTIMATE, "returns",
                                           ("values", "vpreds", "loss_mask"))
    if ctx.cohort.expected_map(StageId.LOSS_VALUE.value) is None:
        f.problem("expected has no loss.value map")
    if returns is None or loaded is None or f.failed:
        return StageOutcome(f.result(StageId.LOSS_VALUE, ctx.rank))
    actual = losses.value_loss_outputs(losses.ValueLossData(loaded["values"], loaded["vpreds"], returns,
                                                            loaded["loss_mask"], c.lengths), cfg, ctx.kernels)
    _compare_scalars(ctx, f, StageId.LOSS_VALUE, actual)
    return StageOutcome(f.result(StageId.LOSS_VALUE, ctx.rank))


STAGES: dict[StageId, Stage] = {s.id: s for s in (
    Stage(StageId.SAMPLE, "v1", compute=_run_sample),
    Stage(StageId.ROLLOUT_MISMATCH, "v1", cohort_level=True, compute=_run_rollout_mismatch),
    Stage(StageId.REWARD_RAW, "v1", compute=_run_reward_raw),
    Stage(StageId.REWARD_POST_PROCESS, "v1", compute=_run_reward_post_process, recorded=_recorded_rewards),
    Stage(StageId.ADVANTAGE_KL, "v1", compute=_run_advantage_kl),
    Stage(StageId.ADVANTAGE_ESTIMATE, "v1", compute=_run_advantage_estimate, recorded=_recorded_advantages),
    Stage(StageId.LOSS_POLICY, "v1", cohort_level=True, compute=_run_loss_policy),
    Stage(StageId.LOSS_VALUE, "v1", cohort_level=True, compute=_run_loss_value),
)}


__all__ = ["LOSS_FIELDS", "STAGES", "Stage", "StageContext", "StageOutcome"]
