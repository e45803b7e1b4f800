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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import (
    LOSS_FIELDS,
    MISMATCH_FIELDS,
    OFF_POLICY_FIELDS,
    PRE_REJECTION_MASK,
    STAGE_IO,
    Setting,
    StageIO,
    kl_in_reward,
    kl_in_score,
    rollout_correction,
)
from trajectory_replay.replay import kernels, losses, mismatch
from trajectory_replay.replay.blocks import Block
from trajectory_replay.replay.cohort import Cohort
from trajectory_replay.replay.compare import (
    EXACT,
    FieldComparison,
    SampleLayout,
    StageChecks,
    Tolerances,
    compare_scalar,
    compare_tensors,
)
from trajectory_replay.replay.estimators import AdvantageInputs, RewardInputs, Whitening
from trajectory_replay.replay.registry import Kernels
from trajectory_replay.replay.report import Divergence, StageResult
from trajectory_replay.replay.structure import payload_size_problems, record_problems

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
    rank: int | None = None
    kernels: Kernels = field(default=None)  # type: ignore[assignment]  # set by the runner from the plan
    """The estimator, policy loss and aggregation the config names."""
    block: Block | None = None
    """The rows computed, and where they lie in the whole cohort (None: the cohort is the whole)."""
    whitening: Whitening | None = None
    """How whitened advantages are whitened (None: over this cohort's own tokens)."""

    @property
    def setting(self) -> Setting:
        """What the stage table's conditions ask: the config and the flags of the estimator replay computes with."""
        return Setting(self.config, self.kernels.estimator.flags)

    @property
    def streamed(self) -> bool:
        """True when the cohort is one block of several: comparisons keep what merging them needs."""
        return self.block is not None

    def compare(
        self,
        name: str,
        expected: torch.Tensor,
        actual: torch.Tensor,
        layout: SampleLayout,
        tol: Tolerances | None = None,
    ) -> FieldComparison:
        return compare_tensors(
            name, expected, actual, layout, self.tol if tol is None else tol, sample_errors=self.streamed
        )

    def position(self, flat: int) -> int:
        """A flat per-token position of this cohort's, in the whole cohort's per-token layout."""
        if self.block is None:
            return flat
        return self.block.to_whole(flat)


@dataclass(frozen=True)
class StageOutcome:
    """What one run of a stage over some rows found, the outputs it hands downstream (empty when it could not
    compute them) and, for a stage that reduces over the cohort, its partial sums (`partial`, None when the rows
    could not be computed); the verdict is made by the stage's `finish` over every run's outcome."""

    findings: StageChecks
    outputs: Outputs = field(default_factory=dict)
    passed: str = ""
    partial: Any = None


Finish = Callable[["StageContext", StageChecks, "Sequence[tuple[StageOutcome, Block]]"], StageResult]
"""(context over the whole cohort, the runs' findings merged, each run's outcome and block) -> the verdict."""


@dataclass(frozen=True)
class Stage:
    """One replay stage: how it computes (its inputs and outputs are its row of `STAGE_IO`)."""

    id: StageId
    version: str
    cohort_level: bool = False
    """Reduces over the whole cohort: not replayable under a partial selection, runs per rank."""
    compute: Callable[[StageContext], StageOutcome] | None = None
    """None: replay cannot compute this stage."""
    recorded: Callable[[StageContext], Outputs] | None = None
    """The outputs a recorded-only contract hands downstream instead of recomputing."""
    finish: Finish | None = None
    """Makes the verdict from the runs over the blocks (None: their merged findings, with the passed message)."""
    per_block: bool = True
    """Runs block by block in a streamed replay; False: once over the whole cohort, before the blocks (it reads no
    payload, or reads its payloads whole)."""

    def verdict(
        self, ctx: StageContext, merged: StageChecks, runs: Sequence[tuple[StageOutcome, Block]]
    ) -> StageResult:
        """The stage's result over the whole cohort (`ctx`) from its runs."""
        if self.finish is not None:
            return self.finish(ctx, merged, runs)
        return merged.result(self.id, ctx.rank, passed_message=runs[-1][0].passed if runs else "")

    @property
    def io(self) -> StageIO:
        return STAGE_IO[self.id]

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.io.outputs

    def dependencies(self, setting: Setting) -> tuple[StageId, ...]:
        """The stages that must be planned before it under `setting`: the sample check (every stage lays values out
        by the records it checks) and the stages whose outputs it consumes under that setting."""
        if self.id == StageId.SAMPLE:
            return ()
        return (StageId.SAMPLE,) + tuple(dict.fromkeys(stage for stage, _ in self.io.consumes(setting)))

    def loaded(self, setting: Setting, *elsewhere: str) -> tuple[str, ...]:
        """The payloads the stage loads itself under `setting`: those it needs, less the ones it takes `elsewhere`
        (from an upstream stage, or only when the bundle holds them)."""
        return tuple(n for n in self.io.needed_payloads(setting) if n not in elsewhere)


def _load_payloads(ctx: StageContext, findings: StageChecks, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
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


def _upstream(ctx: StageContext, findings: StageChecks, stage: StageId, key: str) -> torch.Tensor | None:
    """A recomputed upstream output, or None after recording why it is not there."""
    produced = ctx.outputs.get(stage, {}).get(key)
    if produced is None:
        why = "produced none" if stage in ctx.contracted else "is not contracted by the bundle"
        findings.problem(f"needs {key} from upstream stage {stage}, which {why}")
    return produced


def _compare_per_sample(
    ctx: StageContext, f: StageChecks, stage: StageId, key: str, actual: torch.Tensor, nan_equal: bool = False
) -> None:
    """Compare `actual` with the expected per-sample list `stage.key` (length-checked, indexed down), reported as
    the record field that carries it; with `nan_equal`, a NaN on both sides of a sample is equal (a value recorded
    as NaN and recomputed as NaN)."""
    field_name = STAGE_IO[stage].in_records[key]
    expected, problems = ctx.cohort.expected_list(stage.value, key)
    for p in problems:
        f.problem(p)
    if expected is not None:
        if nan_equal and expected.numel() == actual.numel():
            both = torch.isnan(expected.to(torch.float32)) & torch.isnan(actual.to(torch.float32))
            zero = torch.zeros((), dtype=torch.float32)
            expected, actual = torch.where(both, zero, expected.to(torch.float32)), torch.where(both, zero, actual)
        f.add(ctx.compare(field_name, expected, actual, ctx.cohort.sample_layout))


def _run_sample(ctx: StageContext) -> StageOutcome:
    """The rows' loss masks: as many values as response tokens, and equal to what older records still carry."""
    c, f = ctx.cohort, StageChecks()
    mask = c.load("loss_mask")
    if mask.numel() != c.num_tokens:
        f.problem(
            f"loss_mask_length: loss_mask payload has {mask.numel()} values, the responses have {c.num_tokens} tokens"
        )
    else:
        _check_record_masks(ctx, mask, f)
    return StageOutcome(f)


def _finish_sample(ctx: StageContext, merged: StageChecks, runs: Sequence[tuple[StageOutcome, Block]]) -> StageResult:
    """The records' own checks over the whole cohort (lengths, duplicate ids, payload sizes), then the masks'."""
    c, f = ctx.cohort, StageChecks()
    for p in record_problems(c.records):
        f.problem(
            p.message, Divergence(p.field, p.sample_id, None, p.expected, p.actual, p.abs_error) if p.field else None
        )
    for part in c.parts:
        for message in payload_size_problems(part.source.index.samples, part.source.manifest.payloads.values()):
            f.problem(part.rank_prefix + message)
    f.problems += merged.problems
    f.divergences += merged.divergences
    f.comparisons += merged.comparisons
    return f.result(StageId.SAMPLE, ctx.rank, passed_message=f"{len(c.records)} samples, {c.num_tokens} tokens")


def _check_record_masks(ctx: StageContext, mask: torch.Tensor, f: StageChecks) -> None:
    """Records that still carry a loss_mask (older bundles) must agree with the payload (the "expected" side); the
    samples whose record carries none are compared with the payload itself."""
    c = ctx.cohort
    carries = [bool(r.loss_mask and len(r.loss_mask) == r.response_length) for r in c.records]
    if not any(carries):
        return
    listed = mask.to(torch.float32, copy=True)  # the records' masks are written over it
    rows = torch.repeat_interleave(torch.tensor(carries), c.lengths)
    listed[rows] = torch.tensor(
        [v for r, has in zip(c.records, carries) if has for v in r.loss_mask], dtype=torch.float32
    )
    f.add(ctx.compare("loss_mask", mask, listed, c.token_layout, EXACT))


def _run_rollout_mismatch(ctx: StageContext) -> StageOutcome:
    """The rows' log ratios d: their per-sample sums, worst tokens, first non-finite one, tokens over the ceiling,
    and production's importance weights compared."""
    c, f, cfg = ctx.cohort, StageChecks(), ctx.config
    if not c.has_payload("rollout_log_probs"):
        return StageOutcome(f)
    before_rejection = c.has_payload(PRE_REJECTION_MASK)
    names = ("rollout_log_probs", "old_log_probs", "loss_mask") + ((PRE_REJECTION_MASK,) if before_rejection else ())
    loaded = _load_payloads(ctx, f, names)
    if loaded is None:
        return StageOutcome(f)
    rollout_lp, old_lp = loaded["rollout_log_probs"], loaded["old_log_probs"]
    mask = loaded[PRE_REJECTION_MASK] if before_rejection else loaded["loss_mask"]  # as verl takes its metrics
    found = mismatch.mismatch_pass(old_lp, rollout_lp, mask, c.lengths, ceiling=cfg.mismatch_max_token_log_ratio)
    sums, worst = found.sums, found.worst
    nonfinite = None
    if found.nonfinite is not None:
        at, count = found.nonfinite
        nonfinite = (ctx.position(at), float(mismatch.log_ratio(old_lp[at], rollout_lp[at])), count)
    ratios = mismatch.log_ratio(old_lp[worst], rollout_lp[worst]).tolist()  # d of each, as the pass computed it
    rows = [
        (
            ctx.position(int(p)),
            {
                "sample_id": sid,
                "token_offset": tok,
                "rollout_log_prob": float(rollout_lp[p]),
                "trainer_log_prob": float(old_lp[p]),
                "log_ratio": r,
            },
        )
        for p, r, (sid, tok) in zip(worst, ratios, c.token_layout.locate(worst))
    ]
    over = found.over
    with_weights = c.has_payload("rollout_is_weights") and cfg.rollout_is != "none"
    recorded_metrics = (c.expected_map(StageId.ROLLOUT_MISMATCH.value) if len(c.parts) == 1 else None) or {}
    off_policy = any(recorded_metrics.get(name) is not None for name in OFF_POLICY_FIELDS)
    fix = None
    if with_weights or before_rejection or (off_policy and cfg.rollout_is != "none"):
        # a masked-out token's d counts as 0, whatever it holds
        masked = torch.where(mask.to(torch.bool), mismatch.log_ratio(old_lp, rollout_lp), 0.0)
        fix = mismatch.correction(masked, mask, c.lengths, cfg)
        if before_rejection:  # the rejection the mask before it leads to is the loss mask production trained on
            f.add(ctx.compare("loss_mask", loaded["loss_mask"].to(torch.float32), fix.mask, c.token_layout, EXACT))
        recorded = _load_payloads(ctx, f, ("rollout_is_weights",)) if with_weights else None
        if recorded is not None:
            weights = mismatch.recorded_weights(fix, mask)
            assert weights is not None  # a config with rollout_is other than 'none' has its weights
            f.add(ctx.compare("rollout_is_weights", recorded["rollout_is_weights"], weights, c.token_layout))
    off = None
    if off_policy:  # verl's rollout-correction metrics, recomputed only when production's are recorded
        weights = None if fix is None else fix.weights
        kept = fix.mask if fix is not None and before_rejection else None
        off = mismatch.off_policy_sums(old_lp, rollout_lp, mask, c.lengths, weights=weights, kept=kept)
    partial = {"sums": sums, "rows": rows, "nonfinite": nonfinite, "over": over, "off_policy": off}
    return StageOutcome(f, partial=partial)


def _finish_rollout_mismatch(
    ctx: StageContext, merged: StageChecks, runs: Sequence[tuple[StageOutcome, Block]]
) -> StageResult:
    """The metrics of the whole cohort, the 10 worst tokens, the ceilings, staleness, and the expected values."""
    c, f, cfg = ctx.cohort, StageChecks(), ctx.config
    has_log_probs = c.has_payload("rollout_log_probs")
    if not has_log_probs and all(r.policy_version is None for r in c.records):
        f.problem("bundle has no payload 'rollout_log_probs' and no sample records a policy_version")
        return f.result(StageId.ROLLOUT_MISMATCH, ctx.rank)
    f.problems += merged.problems
    actual: dict[str, float | None] = {}
    rows: list[dict] = []
    tokens = 0
    if has_log_probs:
        parts = [(outcome.partial, block) for outcome, block in runs]
        if any(partial is None for partial, _ in parts):  # a payload could not be read
            f.comparisons += merged.comparisons
            return f.result(StageId.ROLLOUT_MISMATCH, ctx.rank)
        sums = mismatch.MismatchSums.combine(
            [(block.index, partial["sums"]) for partial, block in parts], len(c.records)
        )
        tokens = sums.tokens
        _check_finite(f, c, [partial["nonfinite"] for partial, _ in parts])
        actual.update(mismatch.metrics_of(sums).as_dict())
        offs = [(block.index, partial["off_policy"]) for partial, block in parts]
        if all(off is not None for _, off in offs) and offs:
            off = mismatch.OffPolicySums.combine(offs, len(c.records))
            actual.update(mismatch.off_policy_metrics(sums, off, cfg))
        candidates = [row for partial, _ in parts for row in partial["rows"]]
        candidates.sort(key=lambda pr: mismatch.worst_first(abs(pr[1]["log_ratio"]), pr[0]))
        rows = [row for _, row in candidates[: mismatch.WORST_TOKENS]]
        _check_thresholds(cfg, f, actual, rows, sum(partial["over"] for partial, _ in parts))
        if c.has_payload("rollout_is_weights") and cfg.rollout_is == "none":
            f.problem(
                "bundle holds production's rollout_is_weights, but the config's rollout_is is 'none' "
                "(replay --set rollout_is=token or sequence)"
            )
        f.comparisons += merged.comparisons
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
    metrics: dict[str, object] = dict(actual)
    if has_log_probs:
        metrics["worst_tokens"] = rows
    passed = (f"{tokens} tokens" if has_log_probs else "no rollout log-probs") + (
        f", staleness max {actual['staleness_max']}" if actual["staleness_max"] is not None else ""
    )
    return f.result(StageId.ROLLOUT_MISMATCH, ctx.rank, passed_message=passed, metrics=metrics)


def _check_finite(f: StageChecks, c: Cohort, found: list[tuple[int, float, int] | None]) -> None:
    """A masked-in token whose log ratio is NaN or infinite (a broken log-prob on either side) fails the stage:
    `found` holds each block's first such token (position in the cohort, its log ratio, how many)."""
    found_any = [x for x in found if x is not None]
    if found_any:
        at, value, _ = min(found_any, key=lambda x: x[0])
        ((sid, tok),) = c.token_layout.locate(torch.tensor([at]))
        f.problem(f"log ratio is {value} at {sid} token {tok} ({sum(x[2] for x in found_any)} tokens not finite)")


def _check_thresholds(
    cfg: RecomputeConfig, f: StageChecks, actual: dict[str, float | None], rows: list[dict], over: int
) -> None:
    """Fail when kl_k3 or a token's |d| exceeds its configured ceiling (`over`: how many tokens do). The divergences
    are the worst tokens, largest |d| first (expected = the rollout log-prob, actual = the trainer's): those over the
    token ceiling when it tripped, else all of them (each adds to kl_k3)."""
    kl_k3, kl_limit, limit = actual["kl_k3"], cfg.mismatch_max_kl_k3, cfg.mismatch_max_token_log_ratio
    kl_tripped = kl_limit is not None and kl_k3 is not None and not kl_k3 <= kl_limit
    if kl_tripped:
        f.problem(f"kl_k3 {kl_k3:.6g} exceeds mismatch_max_kl_k3 {kl_limit:g}")
    if over:
        f.problem(f"{over} tokens have |log ratio| above mismatch_max_token_log_ratio {limit:g}")
    if over or kl_tripped:
        listed = [r for r in rows if not abs(r["log_ratio"]) <= limit] if over else rows
        f.divergences.extend(
            Divergence(
                "log_ratio",
                r["sample_id"],
                r["token_offset"],
                r["rollout_log_prob"],
                r["trainer_log_prob"],
                abs(r["log_ratio"]),
            )
            for r in listed
        )


def _check_staleness(cfg: RecomputeConfig, f: StageChecks, c: Cohort) -> float | None:
    """The largest actor_version - policy_version; a sample from a newer policy, or older than max_staleness, fails."""
    lags = mismatch.staleness([r.policy_version for r in c.records], cfg.actor_version)
    known = [(r, lag) for r, lag in zip(c.records, lags) if lag is not None]
    for r, lag in known:
        assert r.policy_version is not None and cfg.actor_version is not None  # a lag is known only from both
        if lag < 0:
            f.problem(
                f"sample {r.sample_id} has policy_version {r.policy_version}, newer than actor_version "
                f"{cfg.actor_version}",
                Divergence(
                    "policy_version", r.sample_id, None, float(cfg.actor_version), float(r.policy_version), float(-lag)
                ),
            )
        elif cfg.max_staleness is not None and lag > cfg.max_staleness:
            f.problem(
                f"sample {r.sample_id} has policy_version {r.policy_version}, {lag} versions behind actor_version "
                f"{cfg.actor_version} (max_staleness {cfg.max_staleness})",
                Divergence(
                    "policy_version", r.sample_id, None, float(cfg.actor_version), float(r.policy_version), float(lag)
                ),
            )
    return float(max(lag for _, lag in known)) if known else None


def _run_reward_raw(ctx: StageContext) -> StageOutcome:
    f = StageChecks()
    actual = _in_records(ctx, StageId.REWARD_RAW, "raw_rewards")  # scalar rewards: the recorded one is the recompute
    _compare_per_sample(ctx, f, StageId.REWARD_RAW, "raw_rewards", actual, nan_equal=True)
    return StageOutcome(f, {"raw_rewards": actual})


def _in_records(ctx: StageContext, stage: StageId, output: str) -> torch.Tensor:
    """Production's values of a per-sample output, as the sample records carry them."""
    record_field = STAGE_IO[stage].in_records[output]
    return torch.tensor([getattr(r, record_field) for r in ctx.cohort.records], dtype=torch.float32)


def _run_reward_post_process(ctx: StageContext) -> StageOutcome:
    c, f, cfg, estimator = ctx.cohort, StageChecks(), ctx.config, ctx.kernels.estimator
    if estimator.grouped:
        for r in c.records:
            if r.group_index is None:
                f.problem(f"sample {r.sample_id} has no group_index")
        if f.failed:
            return StageOutcome(f)
        group_ids, keys = kernels.dense_group_ids([r.group_index for r in c.records if r.group_index is not None])
    else:  # the estimator works on token rewards: groups play no part
        group_ids, keys = torch.zeros(len(c.records), dtype=torch.int64), [0] if c.records else []
    sizes = torch.bincount(group_ids, minlength=len(keys)).tolist()
    if estimator.grouped and cfg.group_size_check == "exact":
        for key, size in zip(keys, sizes):
            if size != cfg.n_samples_per_prompt:
                f.problem(f"reward group g-{key} has {size} samples, expected {cfg.n_samples_per_prompt}")
        if f.failed:
            return StageOutcome(f)
    raw = ctx.outputs.get(StageId.REWARD_RAW, {}).get("raw_rewards")
    raw = raw if raw is not None else _in_records(ctx, StageId.REWARD_RAW, "raw_rewards")
    if kl_in_score(ctx.setting):
        loaded = _load_payloads(ctx, f, STAGES[StageId.REWARD_POST_PROCESS].loaded(ctx.setting))
        if loaded is None:
            return StageOutcome(f)
        raw = _score_with_kl(raw, loaded["kl"], loaded["loss_mask"], c.lengths, cfg.kl_coef)
    rewards = estimator.post_process(RewardInputs(raw, group_ids, len(keys), cfg))
    _compare_per_sample(ctx, f, StageId.REWARD_POST_PROCESS, "rewards", rewards)
    passed = (
        f"{len(keys)} groups" + (f" of {cfg.n_samples_per_prompt}" if cfg.group_size_check == "exact" else "")
        if estimator.grouped
        else f"{len(c.records)} samples, {estimator.name} keeps raw rewards"
    )
    return StageOutcome(f, {"rewards": rewards}, passed=passed)


ROW_ALIGN = 64
"""Width multiple of the padded rows `_score_with_kl` sums: torch's CPU float32 row sum accumulates element i in
the same lane whatever the row's width when the width is a multiple of 64 (4 vectors of up to 16 lanes), so trailing
zeros leave the result's bits as they are."""

ROW_CHUNK = 1 << 20
"""Padded values `_score_with_kl` lays out at a time."""


def _score_with_kl(
    raw: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Each sample's reward less kl_coef * kl on each of its masked-in tokens, as verl 0.9 forms it: the token
    rewards in float32 (-kl_coef * kl * m on every token, the reward less its penalty at the last one), laid out in
    zero-padded rows (the width a multiple of `ROW_ALIGN`) and summed along the row in float32 by torch, as verl's
    `compute_grpo_outcome_advantage` / `compute_rloo_outcome_advantage` sum `token_level_rewards` on the trainer's
    CPU. A float64 sum would differ from verl's by float32 rounding, which the group normalization divides by a
    near-tied group's small std."""
    penalty = kl.to(torch.float32) * kl_coef * mask.to(torch.float32)
    lengths = lengths.to(torch.int64)
    n = int(lengths.numel())
    width = max(ROW_ALIGN, -(-int(lengths.max()) // ROW_ALIGN) * ROW_ALIGN) if n else ROW_ALIGN
    ends = kernels.sample_ends(lengths)
    out = torch.zeros(n, dtype=torch.float32)
    step = max(1, ROW_CHUNK // width)
    for first in range(0, n, step):  # a few rows at a time: the padded layout of a whole cohort can be large
        last = min(n, first + step)
        lens = lengths[first:last]
        start = int(ends[first] - lengths[first])
        rows = torch.zeros((last - first, width), dtype=torch.float32)
        columns = torch.arange(int(lens.sum())) - torch.repeat_interleave(ends[first:last] - lens - start, lens)
        rows[torch.repeat_interleave(torch.arange(last - first), lens), columns] = -penalty[start : int(ends[last - 1])]
        nonempty = lens > 0
        rows[nonempty.nonzero().flatten(), lens[nonempty] - 1] += raw[first:last].to(torch.float32)[nonempty]
        out[first:last] = rows.sum(dim=-1)
    return out


def _recorded_rewards(ctx: StageContext) -> Outputs:
    return {"rewards": _in_records(ctx, StageId.REWARD_POST_PROCESS, "rewards")}


def _run_advantage_kl(ctx: StageContext) -> StageOutcome:
    c, f, cfg = ctx.cohort, StageChecks(), ctx.config
    # kl_coef == 0: the reward-side KL is zeros and the log-probs are not needed (not loaded)
    loaded = _load_payloads(ctx, f, STAGES[StageId.ADVANTAGE_KL].loaded(ctx.setting))
    if loaded is None:
        return StageOutcome(f)
    if "kl" not in loaded and c.has_payload("kl"):  # left out of what it needs: compared when there
        recorded = _load_payloads(ctx, f, ("kl",))
        if recorded is None:
            return StageOutcome(f)
        loaded.update(recorded)
    if cfg.kl_coef == 0:
        actual = torch.zeros(c.num_tokens, dtype=torch.float32)
    else:
        actual = kernels.kl_estimate(
            loaded["old_log_probs"],
            loaded["ref_log_probs"],
            cfg.kl_loss_type,
            cfg.kl_log_ratio_clamp,
            cfg.kl_output_clamp,
            cfg.kl_clamped,
        )
    if "kl" not in loaded:
        return StageOutcome(f, {"kl": actual}, passed="no reward-side KL is used and production recorded none")
    # a masked-out token's KL reaches no reward: it is compared as 0 on both sides, whatever either holds
    inside, zero = loaded["loss_mask"].to(torch.bool), torch.zeros((), dtype=torch.float32)
    f.add(
        ctx.compare(
            "kl",
            torch.where(inside, loaded["kl"], zero),
            torch.where(inside, actual, zero),
            c.token_layout,
        )
    )
    return StageOutcome(f, {"kl": actual})


def _reward_kl(ctx: StageContext, f: StageChecks) -> torch.Tensor | None:
    """The reward-side KL the token rewards take: advantage.kl's when it ran, else the recorded `kl` payload."""
    produced = ctx.outputs.get(StageId.ADVANTAGE_KL, {}).get("kl")
    if produced is not None:
        return produced
    loaded = _load_payloads(ctx, f, ("kl",))
    return None if loaded is None else loaded["kl"]


def _run_advantage_estimate(ctx: StageContext) -> StageOutcome:
    c, f, cfg, estimator = ctx.cohort, StageChecks(), ctx.config, ctx.kernels.estimator
    rewards = _upstream(ctx, f, StageId.REWARD_POST_PROCESS, "rewards")
    # the estimator's flags decide whether it reads values (and so produces returns) and takes the reward-side KL
    loaded = _load_payloads(ctx, f, STAGES[StageId.ADVANTAGE_ESTIMATE].loaded(ctx.setting, "kl"))
    kl = _reward_kl(ctx, f) if kl_in_reward(ctx.setting) else None
    if rewards is None or loaded is None or f.failed:
        return StageOutcome(f)
    actual = estimator.advantages(
        AdvantageInputs(
            rewards,
            c.lengths,
            loaded["loss_mask"],
            cfg,
            kl=kl,
            values=loaded.get("values"),
            whitening=ctx.whitening,
            payloads=loaded,
        )
    )
    f.add(ctx.compare("advantages", loaded["advantages"], actual.advantages, c.token_layout))
    outputs = {"advantages": actual.advantages}
    if actual.returns is not None:
        f.add(ctx.compare("returns", loaded["returns"], actual.returns, c.token_layout))
        outputs["returns"] = actual.returns
    return StageOutcome(f, outputs)


def _recorded_advantages(ctx: StageContext) -> Outputs:
    out = {"advantages": ctx.cohort.load("advantages")}
    if ctx.cohort.has_payload("returns"):
        out["returns"] = ctx.cohort.load("returns")
    return out


def _upstream_or_payload(
    ctx: StageContext, f: StageChecks, stage: StageId, key: str, payloads: tuple[str, ...]
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """(`key` from `stage` when the bundle contracts it, else from the payload of that name; the other payloads)."""
    if stage in ctx.contracted:
        return _upstream(ctx, f, stage, key), _load_payloads(ctx, f, payloads)
    loaded = _load_payloads(ctx, f, payloads + (key,))
    return (loaded[key] if loaded is not None else None), loaded


def _compare_scalars(ctx: StageContext, f: StageChecks, stage: StageId, actual: dict[str, float]) -> None:
    """Compare every scalar the stage produces under the config with its expected map: a missing field fails
    unless the table lets the bundle leave it out under the setting; an expected field that replay could not
    compute (its payload left out) fails too."""
    expected = ctx.cohort.expected_map(stage.value)
    if expected is None:
        f.problem(f"expected has no {stage} map")
        return
    io = STAGE_IO[stage]
    for name in io.outputs_for(ctx.setting):
        if expected.get(name) is None:
            if not io.is_optional(name, ctx.setting):
                f.problem(f"expected {stage} has no field {name!r}")
        elif name not in actual:
            f.problem(f"expected {stage} has {name!r}, which the bundle's payloads cannot recompute")
        else:
            f.add(compare_scalar(name, float(expected[name]), actual[name], ctx.tol))


def _run_loss_policy(ctx: StageContext) -> StageOutcome:
    """The rows' per-sample sums of every loss.policy term (and the on-policy check, when asked for)."""
    c, f, cfg = ctx.cohort, StageChecks(), ctx.config
    names = STAGES[StageId.LOSS_POLICY].loaded(ctx.setting, "advantages")
    advantages, loaded = _upstream_or_payload(ctx, f, StageId.ADVANTAGE_ESTIMATE, "advantages", names)
    if ctx.cohort.expected_map(StageId.LOSS_POLICY.value) is None:
        f.problem("expected has no loss.policy map")
    if advantages is None or loaded is None or f.failed:
        return StageOutcome(f)
    if cfg.expect_on_policy:
        _check_on_policy(ctx, f, loaded)
    if "entropy" not in loaded and c.has_payload("entropy"):  # left out of what it needs: used when there
        entropy = _load_payloads(ctx, f, ("entropy",))
        if entropy is None:
            return StageOutcome(f)
        loaded.update(entropy)
    if rollout_correction(cfg) and c.has_payload(PRE_REJECTION_MASK):
        before = _load_payloads(ctx, f, (PRE_REJECTION_MASK,))
        if before is None:
            return StageOutcome(f)
        loaded = {**loaded, **before}
    sums = losses.policy_loss_sums(
        losses.PolicyLossData(
            loaded["log_probs"],
            loaded["old_log_probs"],
            advantages,
            loaded.get("entropy"),
            loaded["loss_mask"],
            c.lengths,
            loaded.get("ref_log_probs"),
            loaded.get("rollout_log_probs"),
            loaded,
        ),
        cfg,
        ctx.kernels,
    )
    return StageOutcome(f, partial=sums)


def _check_on_policy(ctx: StageContext, f: StageChecks, loaded: dict[str, torch.Tensor]) -> None:
    """expect_on_policy: the current log-probs equal the old ones on every masked-in token (reported as field
    `log_probs`, the one compared: expected = old, actual = current); the first token where they differ is the
    first divergence, the signature of old log-probs computed by another policy than the one being trained."""
    inside = loaded["loss_mask"].to(torch.bool)
    zero = torch.zeros((), dtype=torch.float32)
    old = torch.where(inside, loaded["old_log_probs"].to(torch.float32), zero)
    current = torch.where(inside, loaded["log_probs"].to(torch.float32), zero)
    f.add(ctx.compare("log_probs", old, current, ctx.cohort.token_layout))


def _run_loss_value(ctx: StageContext) -> StageOutcome:
    """The rows' per-sample sums of the clipped value loss and its clip indicator."""
    c, f, cfg = ctx.cohort, StageChecks(), ctx.config
    returns, loaded = _upstream_or_payload(
        ctx, f, StageId.ADVANTAGE_ESTIMATE, "returns", STAGES[StageId.LOSS_VALUE].loaded(ctx.setting, "returns")
    )
    if ctx.cohort.expected_map(StageId.LOSS_VALUE.value) is None:
        f.problem("expected has no loss.value map")
    if returns is None or loaded is None or f.failed:
        return StageOutcome(f)
    sums = losses.value_loss_sums(
        losses.ValueLossData(loaded["values"], loaded["vpreds"], returns, loaded["loss_mask"], c.lengths), cfg
    )
    return StageOutcome(f, partial=sums)


def _loss_finish(
    stage: StageId,
    scalars: Callable[[losses.LossSums, RecomputeConfig, Kernels, torch.Tensor | None], dict[str, float]],
) -> Finish:
    """The verdict of a loss stage: its scalars from every block's per-sample sums, against the expected map."""

    def finish(ctx: StageContext, merged: StageChecks, runs: Sequence[tuple[StageOutcome, Block]]) -> StageResult:
        if any(outcome.partial is None for outcome, _ in runs):  # the rows could not be computed: said why
            return merged.result(stage, ctx.rank)
        n = len(ctx.cohort.records)
        whole = losses.LossSums.empty(runs[0][0].partial.sums, n) if runs else losses.LossSums.empty((), n)
        for outcome, block in runs:
            whole.put(block.index, outcome.partial)
        _compare_scalars(ctx, merged, stage, scalars(whole, ctx.config, ctx.kernels, ctx.cohort.micro_batches))
        return merged.result(stage, ctx.rank)

    return finish


STAGES: dict[StageId, Stage] = {
    s.id: s
    for s in (
        Stage(StageId.SAMPLE, "v1", compute=_run_sample, finish=_finish_sample),
        Stage(
            StageId.ROLLOUT_MISMATCH,
            "v1",
            cohort_level=True,
            compute=_run_rollout_mismatch,
            finish=_finish_rollout_mismatch,
        ),
        Stage(StageId.REWARD_RAW, "v1", compute=_run_reward_raw, per_block=False),
        Stage(
            StageId.REWARD_POST_PROCESS,
            "v1",
            compute=_run_reward_post_process,
            recorded=_recorded_rewards,
            per_block=False,
        ),
        Stage(StageId.ADVANTAGE_KL, "v1", compute=_run_advantage_kl),
        Stage(StageId.ADVANTAGE_ESTIMATE, "v1", compute=_run_advantage_estimate, recorded=_recorded_advantages),
        Stage(
            StageId.LOSS_POLICY,
            "v1",
            cohort_level=True,
            compute=_run_loss_policy,
            finish=_loss_finish(StageId.LOSS_POLICY, losses.policy_loss_scalars),
        ),
        Stage(
            StageId.LOSS_VALUE,
            "v1",
            cohort_level=True,
            compute=_run_loss_value,
            finish=_loss_finish(StageId.LOSS_VALUE, losses.value_loss_scalars),
        ),
    )
}


__all__ = ["LOSS_FIELDS", "STAGES", "Stage", "StageContext", "StageOutcome"]
