"""An independent double-precision reference of replay's algorithm math, and random bundles built from it.

Everything here is plain Python floats (IEEE double), one loop per sample and per token, written from the
formulas themselves and never calling a replay kernel: when replay's vectorised float32 kernels and these
loops agree on random ragged bundles, both are right or both are wrong in the same way by coincidence.

Per-token values are kept per sample (`Ragged`: one list per sample, one float per response token); the
bundle builder flattens them into payloads at the end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay.fixtures import CanonicalCase

Ragged = list[list[float]]
"""Per-token values, one list per sample."""

WHITEN_EPS = 1e-8
SEQ_MEAN_EPS = 1e-8
LOW_VAR_KL_BOUND = 10.0
GSPO_LOG_CAP = 10.0
OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
TOKEN_REWARD_ESTIMATORS = ("reinforce_plus_plus", "gae")


@dataclass(frozen=True)
class Settings:
    """The recompute config with its documented defaults (kept here, not read from the schema)."""

    advantage_estimator: str = "grpo"
    n_samples_per_prompt: int = 1
    group_size_check: str = "exact"
    grpo_std_normalization: bool = False
    std_unbiased: bool = True
    std_eps: float = 1e-6
    singleton_group: str = "nan"
    std_scope: str = "group"
    nan_rewards: str = "propagate"
    mask_advantages: bool = False
    gamma: float = 1.0
    lam: float = 1.0
    masked_return: str = "restart"
    kl_in_reward: bool = False
    kl_in_score: bool = False
    kl_loss_type: str = "k1"
    kl_coef: float = 0.0
    kl_log_ratio_clamp: float | None = None
    kl_output_clamp: float | None = None
    kl_clamped: tuple[str, ...] | None = None
    policy_loss: str = "ppo_clip"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    ratio_log_clamp: float | None = None
    cispo_clip: str = "window"
    loss_agg_mode: str = "sum_of_sample_means"
    loss_denominator: float | None = None
    loss_scale_factor: float | None = None
    loss_scale: float = 1.0
    clip_metric_agg: str = "loss_agg_mode"
    entropy_coef: float = 0.0
    entropy_agg: str = "loss_agg_mode"
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_loss_ratio_weighted: bool = False
    loss_terms_reported: bool = True
    metrics_per_rank: bool = True
    cliprange_value: float = 0.2
    actor_version: int | None = None
    max_staleness: int | None = None
    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float | None = None
    rollout_rs: str = "none"
    rollout_rs_lower: float | None = None
    rollout_rs_upper: float | None = None
    rollout_rs_bounds: dict[str, Any] = field(default_factory=dict)
    mismatch_max_kl_k3: float | None = None
    mismatch_max_token_log_ratio: float | None = None
    expect_on_policy: bool = False

    @property
    def corrected(self) -> bool:
        return self.rollout_is != "none" or self.rollout_rs != "none"

    @classmethod
    def of(cls, config: dict[str, Any]) -> Settings:
        """Settings from a config dict; a key that is not a field is a typo in the test (KeyError)."""
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise KeyError(f"not a config field: {sorted(unknown)}")
        return cls(**config)


def clamp(x: float, low: float, high: float) -> float:
    """x limited to [low, high]."""
    return min(max(x, low), high)


# --------------------------------------------------------------------------- reward post-processing


def group_members(groups: Sequence[int | None]) -> dict[int | None, list[int]]:
    """The sample positions of each group key, groups in order of first appearance."""
    members: dict[int | None, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return members


def _kept(values: Sequence[float], s: Settings) -> list[float]:
    """The values the statistics are taken over: all, or those that are not NaN under nan_rewards=exclude."""
    return [v for v in values if not (s.nan_rewards == "exclude" and math.isnan(v))]


def _std(values: list[float], s: Settings) -> float:
    """The std of `values` around their own mean (unbiased unless std_unbiased is false); NaN with no dof."""
    n = len(values)
    dof = n - 1 if s.std_unbiased else n
    if dof <= 0:
        return math.nan  # 0/0 for one value, unbiased
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / dof)


def _grpo_one_group(values: list[float], s: Settings, batch_std: float | None = None) -> list[float]:
    """GRPO on one group: centred, divided by (std + eps) with std normalization (the group's, or `batch_std` under
    std_scope=batch); singletons per the config."""
    kept = _kept(values, s)
    n = len(kept)
    if n == 1 and s.singleton_group == "unit":
        mean, std = 0.0, 1.0
    else:
        mean = sum(kept) / n if n else math.nan
        std = _std(kept, s)
    if batch_std is not None:
        std = batch_std
    out = [v - mean for v in values]
    if s.grpo_std_normalization:
        out = [c / (std + s.std_eps) for c in out]
    return out


def _mean_baseline_one_group(values: list[float], s: Settings, batch_std: float | None = None) -> list[float]:
    """r - mean of the group (a singleton's mean is 0 under unit)."""
    kept = _kept(values, s)
    mean = 0.0 if len(kept) == 1 and s.singleton_group == "unit" else (sum(kept) / len(kept) if kept else math.nan)
    return [v - mean for v in values]


def _rloo_one_group(values: list[float], s: Settings, batch_std: float | None = None) -> list[float]:
    """r minus the mean of the other members; a singleton keeps r under unit and is NaN under nan."""
    n = len(values)
    if n == 1:
        return [values[0] if s.singleton_group == "unit" else math.nan]
    total = sum(values)
    return [v - (total - v) / (n - 1) for v in values]


_PER_GROUP = {
    "grpo": _grpo_one_group,
    "dr_grpo": _mean_baseline_one_group,
    "rloo": _rloo_one_group,
    "reinforce_plus_plus_baseline": _mean_baseline_one_group,
}


def post_process(raw: Sequence[float], groups: Sequence[int | None], s: Settings) -> list[float]:
    """r' per sample: normalized within prompt groups, or r itself for the token-reward estimators."""
    if s.advantage_estimator in TOKEN_REWARD_ESTIMATORS:
        return [float(r) for r in raw]
    per_group = _PER_GROUP[s.advantage_estimator]
    batch_std = _std(_kept([float(r) for r in raw], s), s) if s.std_scope == "batch" else None
    out = [0.0] * len(raw)
    for members in group_members(groups).values():
        for i, value in zip(members, per_group([float(raw[i]) for i in members], s, batch_std)):
            out[i] = value
    if s.nan_rewards == "exclude":  # a NaN reward, or a group without spread, carries no signal
        out = [0.0 if math.isnan(v) else v for v in out]
    return out


# --------------------------------------------------------------------------- KL


def kl_value(
    log_p: float, log_q: float, kind: str, log_ratio_clamp: float | None = None, output_clamp: float | None = None
) -> float:
    """One token's KL estimate from d = log_p - log_q, with the optional clamps on d and on the estimate."""
    d = log_p - log_q
    if log_ratio_clamp is not None:
        d = clamp(d, -log_ratio_clamp, log_ratio_clamp)
    if kind == "k1":
        k = d
    elif kind == "k2":
        k = 0.5 * d * d
    elif kind == "abs":
        k = abs(d)
    elif kind in ("k3", "low_var_kl"):
        k = math.exp(-d) - 1.0 + d
        if kind == "low_var_kl":
            k = clamp(k, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    else:
        raise ValueError(f"no KL estimator {kind!r}")
    if output_clamp is not None:
        k = clamp(k, -output_clamp, output_clamp)
    return k


def kl_tokens(
    log_p: Ragged, log_q: Ragged, kind: str, log_ratio_clamp: float | None = None, output_clamp: float | None = None
) -> Ragged:
    """The KL estimate of every token."""
    return [
        [kl_value(p, q, kind, log_ratio_clamp, output_clamp) for p, q in zip(ps, qs)] for ps, qs in zip(log_p, log_q)
    ]


def kl_clamps(kind: str, s: Settings) -> tuple[float | None, float | None]:
    """(log-ratio clamp, output clamp) for KL estimator `kind`: the config's, unless kl_clamped leaves `kind` out."""
    if s.kl_clamped is not None and kind not in s.kl_clamped:
        return None, None
    return s.kl_log_ratio_clamp, s.kl_output_clamp


def reward_kl(old: Ragged, ref: Ragged, s: Settings) -> Ragged:
    """advantage.kl: the reward-side KL of the rollout policy, zeros when kl_coef is 0."""
    if s.kl_coef == 0:
        return [[0.0] * len(row) for row in old]
    return kl_tokens(old, ref, s.kl_loss_type, *kl_clamps(s.kl_loss_type, s))


def scores(raw: Sequence[float], masks: Sequence[Sequence[int]], kl: Ragged, s: Settings) -> list[float]:
    """The rewards post-processing reads: r, less kl_coef * sum_t kl m when an outcome estimator (or the
    baseline variant) takes the reward-side KL into its score."""
    if not (s.kl_in_reward and s.kl_in_score and s.kl_coef != 0) or s.advantage_estimator in TOKEN_REWARD_ESTIMATORS:
        return [float(r) for r in raw]
    return [r - s.kl_coef * sum(k * m for k, m in zip(row, mask)) for r, row, mask in zip(raw, kl, masks)]


# --------------------------------------------------------------------------- advantages


def masked_whiten(x: Ragged, masks: Sequence[Sequence[int]]) -> Ragged:
    """(x - mean) / sqrt(var + 1e-8) over the cohort's masked tokens, var unbiased; every token whitened."""
    kept = [v for row, mask in zip(x, masks) for v, m in zip(row, mask) if m]
    count = len(kept)
    mean = sum(kept) / count
    var = sum((v - mean) ** 2 for v in kept) / (count - 1)
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [[(v - mean) * scale for v in row] for row in x]


def token_rewards(rewards: Sequence[float], masks: Sequence[Sequence[int]], kl: Ragged, s: Settings) -> Ragged:
    """rho: minus kl_coef * kl * m on every token when the KL goes into the reward, plus r at the last token."""
    with_kl = s.kl_in_reward and s.kl_coef != 0
    out = []
    for r, mask, kl_row in zip(rewards, masks, kl):
        rho = [-s.kl_coef * k * m if with_kl else 0.0 for k, m in zip(kl_row, mask)]
        if rho:
            rho[-1] += r
        out.append(rho)
    return out


def discounted_returns(rho: Ragged, masks: Sequence[Sequence[int]], gamma: float, carry: bool = False) -> Ragged:
    """G_t = rho_t + gamma * R_{t+1}, backwards within each sample; R restarts at 0 after a masked-out token, or with
    `carry` passes over it untouched (that token's G is then 0)."""
    out = []
    for row, mask in zip(rho, masks):
        returns = [0.0] * len(row)
        running = 0.0
        for t in reversed(range(len(row))):
            g = row[t] + gamma * running
            if carry:
                if mask[t]:
                    running = returns[t] = g
            else:
                returns[t] = g
                running = g * mask[t]
        out.append(returns)
    return out


def gae(rho: Ragged, values: Ragged, masks: Sequence[Sequence[int]], gamma: float, lam: float) -> tuple[Ragged, Ragged]:
    """(raw GAE advantages, returns): a masked-out token takes no TD step and keeps the next value and the
    running advantage of the token after it."""
    advantages, returns = [], []
    for row, vals, mask in zip(rho, values, masks):
        adv = [0.0] * len(row)
        next_value = last = 0.0
        for t in reversed(range(len(row))):
            delta = row[t] + gamma * next_value - vals[t]
            step = delta + gamma * lam * last
            if mask[t]:
                next_value, last = vals[t], step
            adv[t] = last
        advantages.append(adv)
        returns.append([a + v for a, v in zip(adv, vals)])
    return advantages, returns


def _times_mask(x: Ragged, masks: Sequence[Sequence[int]]) -> Ragged:
    """x * m, token by token."""
    return [[v * m for v, m in zip(row, mask)] for row, mask in zip(x, masks)]


def advantages(
    rewards: Sequence[float], masks: Sequence[Sequence[int]], kl: Ragged, s: Settings, values: Ragged | None = None
) -> tuple[Ragged, Ragged | None]:
    """(per-token advantages, returns or None) of the config's estimator from the post-processed rewards."""
    est = s.advantage_estimator
    if est in OUTCOME_ESTIMATORS:
        spread = [[r] * len(mask) for r, mask in zip(rewards, masks)]
        return (_times_mask(spread, masks) if s.mask_advantages else spread), None
    if est == "reinforce_plus_plus_baseline":
        scores = _times_mask([[r] * len(mask) for r, mask in zip(rewards, masks)], masks)
        return _times_mask(masked_whiten(scores, masks), masks), None
    rho = token_rewards(rewards, masks, kl, s)
    if est == "reinforce_plus_plus":
        returns = discounted_returns(rho, masks, s.gamma, s.masked_return == "carry")
        return _times_mask(masked_whiten(returns, masks), masks), None
    if est == "gae":
        assert values is not None, "gae needs values"
        raw, returns = gae(rho, values, masks, s.gamma, s.lam)
        return masked_whiten(raw, masks), returns
    raise ValueError(f"no estimator {est!r}")


# --------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class PolicyTerms:
    """Per-token policy-loss terms: the loss, clipped (0/1), and old - current log-prob."""

    pg: Ragged
    clipped: Ragged
    ppo_kl: Ragged


def _ppo_token(cur: float, old: float, a: float, s: Settings) -> tuple[float, float, float]:
    """(pg, clipped, ppo_kl) of one token under the PPO clipped surrogate (and the dual clip)."""
    log_ratio = cur - old
    if s.ratio_log_clamp is not None:
        log_ratio = clamp(log_ratio, -s.ratio_log_clamp, s.ratio_log_clamp)
    ratio = math.exp(log_ratio)
    plain = -ratio * a
    clipped = -clamp(ratio, 1 - s.eps_clip, 1 + s.eps_clip_high) * a
    pg = max(plain, clipped)
    if s.eps_clip_c is not None and a < 0:
        pg = min(-s.eps_clip_c * a, pg)
    return pg, float(clipped > plain), -log_ratio


def _cispo_token(cur: float, old: float, a: float, s: Settings) -> tuple[float, float, float]:
    """(pg, clipped, ppo_kl) of one token under CISPO."""
    log_ratio = cur - old
    if s.ratio_log_clamp is not None:
        log_ratio = clamp(log_ratio, -s.ratio_log_clamp, s.ratio_log_clamp)
    ratio = math.exp(log_ratio)
    if s.cispo_clip == "cap":  # capped at eps_clip_high itself, no lower bound
        weight = min(ratio, s.eps_clip_high)
        return -weight * a * cur, float(ratio > s.eps_clip_high and a > 0), -log_ratio
    weight = clamp(ratio, 1 - s.eps_clip, 1 + s.eps_clip_high)
    return -weight * a * cur, float(weight != ratio), -log_ratio


def _gspo_sample(
    cur: list[float], old: list[float], adv: list[float], mask: Sequence[int], s: Settings
) -> list[tuple[float, float, float]]:
    """One sequence's tokens under GSPO: one ratio, exp of the masked mean log ratio (log capped at 10)."""
    total = sum((c - o) * m for c, o, m in zip(cur, old, mask))
    ratio = math.exp(min(total / max(sum(mask), 1), GSPO_LOG_CAP))
    out = []
    for c, o, a in zip(cur, old, adv):
        plain = -ratio * a
        clipped = -clamp(ratio, 1 - s.eps_clip, 1 + s.eps_clip_high) * a
        out.append((max(plain, clipped), float(clipped > plain), o - c))
    return out


def importance_ratios(cur: Ragged, old: Ragged, masks: Sequence[Sequence[int]], s: Settings) -> Ragged:
    """The importance ratio of every token: exp(cur - old), or under gspo its sequence's one ratio."""
    out = []
    for c_row, o_row, mask in zip(cur, old, masks):
        if s.policy_loss == "gspo":
            total = sum((c - o) * m for c, o, m in zip(c_row, o_row, mask))
            out.append([math.exp(min(total / max(sum(mask), 1), GSPO_LOG_CAP))] * len(c_row))
        else:
            logs = [c - o for c, o in zip(c_row, o_row)]
            if s.ratio_log_clamp is not None:
                logs = [clamp(x, -s.ratio_log_clamp, s.ratio_log_clamp) for x in logs]
            out.append([math.exp(x) for x in logs])
    return out


def policy_terms(cur: Ragged, old: Ragged, adv: Ragged, masks: Sequence[Sequence[int]], s: Settings) -> PolicyTerms:
    """Every token's terms under the config's policy loss."""
    rows: list[list[tuple[float, float, float]]] = []
    for c_row, o_row, a_row, mask in zip(cur, old, adv, masks):
        if s.policy_loss == "gspo":
            rows.append(_gspo_sample(c_row, o_row, a_row, mask, s))
        else:
            token = {"ppo_clip": _ppo_token, "cispo": _cispo_token}[s.policy_loss]
            rows.append([token(c, o, a, s) for c, o, a in zip(c_row, o_row, a_row)])
    return PolicyTerms(*([[t[k] for t in row] for row in rows] for k in range(3)))


def aggregate(x: Ragged, masks: Sequence[Sequence[int]], s: Settings) -> float:
    """Agg(x) under the config's loss_agg_mode (with loss_denominator / loss_scale_factor)."""
    sums = [sum(v * m for v, m in zip(row, mask)) for row, mask in zip(x, masks)]
    counts = [sum(mask) for mask in masks]
    present = [i for i, n in enumerate(counts) if n > 0]
    mode, den = s.loss_agg_mode, s.loss_denominator
    if mode == "sum_of_sample_means":
        return sum(total / max(n, 1) for total, n in zip(sums, counts))
    if mode == "token_mean":
        return sum(sums) / (den if den is not None else sum(counts))
    if mode == "seq_mean_token_mean":
        return sum(sums[i] / (counts[i] + SEQ_MEAN_EPS) for i in present) / (den if den is not None else len(present))
    if mode == "seq_mean_token_sum":
        return sum(sums[i] for i in present) / (den if den is not None else len(present))
    if mode == "seq_mean_token_sum_norm":
        assert s.loss_scale_factor is not None
        return sum(sums) / s.loss_scale_factor
    if mode == "seq_mean_token_sum_scaled":
        assert s.loss_scale_factor is not None
        return sum(sums[i] for i in present) / (den if den is not None else len(present)) / s.loss_scale_factor
    if mode == "token_sum":
        return sum(sums)
    raise ValueError(f"no aggregation {mode!r}")


def clip_metric(
    x: Ragged, masks: Sequence[Sequence[int]], s: Settings, micro_batches: Sequence[str | None] | None = None
) -> float:
    """A clip metric (clip fraction, ppo_kl): aggregated like the loss, or with clip_metric_agg
    micro_batch_token_mean the mean over micro-batches of each one's token mean (its count + 1e-8)."""
    if s.clip_metric_agg == "loss_agg_mode":
        return aggregate(x, masks, s)
    assert s.clip_metric_agg == "micro_batch_token_mean"
    ids = list(micro_batches) if micro_batches is not None else [None] * len(masks)
    sums: dict[str | None, float] = {}
    counts: dict[str | None, float] = {}
    for mb, row, mask in zip(ids, x, masks):
        sums[mb] = sums.get(mb, 0.0) + sum(v * m for v, m in zip(row, mask))
        counts[mb] = counts.get(mb, 0.0) + sum(mask)
    return sum(sums[mb] / (counts[mb] + SEQ_MEAN_EPS) for mb in sums) / len(sums)


LOG_RATIO_SAFETY = 20.0


def rollout_correction(
    old: Ragged, rollout: Ragged, masks: Sequence[Sequence[int]], s: Settings
) -> tuple[Ragged | None, list[list[int]]]:
    """(importance weights per token or None, the loss masks after rejection) of the mismatch correction: truncated
    weights and the token and sequence modes of rejection (IcePop and the divergence criteria are checked against
    verl itself, in tests/integrations/verl)."""
    if s.rollout_is_threshold_lower is not None or s.rollout_rs not in ("none", "token", "sequence"):
        raise ValueError("the reference implements truncated weights and token or sequence rejection only")
    weights: Ragged = []
    kept: list[list[int]] = []
    upper = s.rollout_rs_upper if s.rollout_rs_upper is not None else s.rollout_is_threshold
    lower = s.rollout_rs_lower if s.rollout_rs_lower is not None else 1.0 / upper
    for o_row, r_row, mask in zip(old, rollout, masks):
        d = [o - r for o, r in zip(o_row, r_row)]
        seq = math.exp(clamp(sum(x * m for x, m in zip(d, mask)), -LOG_RATIO_SAFETY, LOG_RATIO_SAFETY))
        token = [math.exp(clamp(x, -LOG_RATIO_SAFETY, LOG_RATIO_SAFETY)) for x in d]
        ratios = {"token": token, "sequence": [seq] * len(d)}
        row_mask = list(mask)
        if s.rollout_rs != "none":
            row_mask = [m if lower <= q <= upper else 0 for m, q in zip(mask, ratios[s.rollout_rs])]
        kept.append(row_mask)
        if s.rollout_is != "none":
            weights.append([min(q, s.rollout_is_threshold) for q in ratios[s.rollout_is]])
    return (weights if s.rollout_is != "none" else None), kept


def mismatch_metrics(old: Ragged, rollout: Ragged, masks: Sequence[Sequence[int]]) -> dict[str, float]:
    """The rollout.mismatch metrics of d = old - rollout over the masked-in tokens."""
    ds = [[(o - r, m) for o, r, m in zip(o_row, r_row, mask)] for o_row, r_row, mask in zip(old, rollout, masks)]
    inside = [x for row in ds for x, m in row if m]
    return {
        "kl_k1": sum(-x for x in inside) / len(inside),
        "kl_k3": sum(math.exp(x) - 1 - x for x in inside) / len(inside),
        "log_ratio_max_abs": max(abs(x) for x in inside),
        "seq_log_ratio_max_abs": max(abs(sum(x for x, m in row if m)) for row in ds),
    }


def policy_loss(
    cur: Ragged,
    old: Ragged,
    ref: Ragged,
    adv: Ragged,
    entropy: Ragged | None,
    masks: Sequence[Sequence[int]],
    s: Settings,
    rollout: Ragged | None = None,
    micro_batches: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """The loss.policy scalars: loss_scale on the loss terms only, kl_loss only with a KL loss coefficient,
    entropy_loss only with an entropy; with a rollout correction, pg weighted by the importance weights and every
    term over the masks after rejection."""
    weights = None
    if s.corrected:
        assert rollout is not None
        weights, masks = rollout_correction(old, rollout, masks, s)
    terms = policy_terms(cur, old, adv, masks, s)
    pg = (
        terms.pg
        if weights is None
        else [[p * w for p, w in zip(p_row, w_row)] for p_row, w_row in zip(terms.pg, weights)]
    )
    out = {
        "pg_loss": aggregate(pg, masks, s) * s.loss_scale,
        "pg_clipfrac": clip_metric(terms.clipped, masks, s, micro_batches),
        "ppo_kl": clip_metric(terms.ppo_kl, masks, s, micro_batches),
    }
    out["loss"] = out["pg_loss"]
    if entropy is not None:
        if s.entropy_agg == "loss_agg_mode":
            out["entropy_loss"] = aggregate(entropy, masks, s) * s.loss_scale
        elif s.entropy_agg == "token_mean":
            tokens = sum(sum(mask) for mask in masks)
            out["entropy_loss"] = sum(v * m for row, mask in zip(entropy, masks) for v, m in zip(row, mask)) / tokens
        else:  # each micro-batch's token mean, averaged over the micro-batches
            per_mb = replace(s, clip_metric_agg="micro_batch_token_mean")
            out["entropy_loss"] = clip_metric(entropy, masks, per_mb, micro_batches)
        out["loss"] -= s.entropy_coef * out["entropy_loss"]
    if s.kl_loss_coef != 0:
        kl = kl_tokens(cur, ref, s.kl_loss_estimator, *kl_clamps(s.kl_loss_estimator, s))
        if s.kl_loss_ratio_weighted:  # times the policy loss's importance ratio, token by token
            kl = [
                [k * r for k, r in zip(k_row, r_row)] for k_row, r_row in zip(kl, importance_ratios(cur, old, masks, s))
            ]
        out["kl_loss"] = aggregate(kl, masks, s) * s.loss_scale
        out["loss"] += s.kl_loss_coef * out["kl_loss"]
    return out


def value_loss(
    values: Ragged,
    vpreds: Ragged,
    returns: Ragged,
    masks: Sequence[Sequence[int]],
    s: Settings,
    micro_batches: Sequence[str | None] | None = None,
) -> dict[str, float]:
    """The loss.value scalars: half the aggregated clipped squared error, and how often the clip won."""
    c = s.cliprange_value
    losses, clipped = [], []
    for v_row, p_row, r_row in zip(values, vpreds, returns):
        loss_row, clip_row = [], []
        for v, p, r in zip(v_row, p_row, r_row):
            plain = (p - r) ** 2
            held = (clamp(p, v - c, v + c) - r) ** 2
            loss_row.append(max(plain, held))
            clip_row.append(float(held > plain))
        losses.append(loss_row)
        clipped.append(clip_row)
    return {
        "vf_loss": 0.5 * aggregate(losses, masks, s) * s.loss_scale,
        "vf_clipfrac": clip_metric(clipped, masks, s, micro_batches),
    }


# --------------------------------------------------------------------------- the bundle builder

GROUPS = (5, 2, 9, 2, 5, 9, 9, 5, 2, 2, 9, 5)
"""Three prompt groups of four, members interleaved, keys not dense."""
FULLY_MASKED = 6
"""The sample whose every token is masked out (T = 0)."""
SINGLETON_GROUP = 7
"""The group key of the one-sample group `algorithm_case(singleton=True)` appends."""
ALL_STAGES = tuple(s for s in StageId if s not in (StageId.LOSS_VALUE, StageId.ROLLOUT_MISMATCH))


@dataclass(frozen=True)
class Draw:
    """The random inputs of one case, every float exactly representable in float32."""

    lengths: list[int]
    masks: list[list[int]]
    raw: list[float]
    tokens: dict[str, Ragged]


def _ragged(flat: torch.Tensor, lengths: Sequence[int]) -> Ragged:
    """A flat per-token tensor split into one list per sample."""
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n].tolist())
        start += n
    return out


def draw_inputs(num_samples: int, seed: int, empty_sample: bool = False) -> Draw:
    """Ragged lengths (1..6; sample 1 empty with `empty_sample`), partial masks (one sample fully masked out),
    rewards and per-token log-probs, entropies, old and current values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (num_samples,), generator=g).tolist()
    lengths[FULLY_MASKED] = max(lengths[FULLY_MASKED], 2)
    if empty_sample:
        lengths[1] = 0
    masks = [(torch.rand(n, generator=g) < 0.75).to(torch.int64).tolist() for n in lengths]
    masks[FULLY_MASKED] = [0] * lengths[FULLY_MASKED]
    for i, mask in enumerate(masks):
        if i != FULLY_MASKED and mask and not any(mask):
            mask[-1] = 1  # one fully masked sample is the case under test; others keep a token
    n = sum(lengths)
    old = -torch.rand(n, generator=g) * 1.5 - 0.1
    moved = old + torch.randn(n, generator=g) * 0.3
    moved[::4] += torch.randn(len(moved[::4]), generator=g)  # a few far-off ratios, so every clip engages
    tokens = {
        "old_log_probs": old,
        "ref_log_probs": old + torch.randn(n, generator=g) * 0.3,
        "log_probs": moved,
        "entropy": torch.rand(n, generator=g) * 2.0,
        "values": torch.randn(n, generator=g) * 0.5,
    }
    tokens["vpreds"] = tokens["values"] + torch.randn(n, generator=g) * 0.3
    raw = (torch.randn(num_samples, generator=g) * 1.5).tolist()
    rollout = old + torch.randn(n, generator=g) * 0.2  # the inference engine's log-probs of the same tokens
    rollout[1::5] -= torch.rand(len(rollout[1::5]), generator=g) * 1.5  # a few far off, so corrections engage
    tokens["rollout_log_probs"] = rollout
    return Draw(lengths, masks, raw, {k: _ragged(v.to(torch.float32), lengths) for k, v in tokens.items()})


def _flat(x: Ragged) -> torch.Tensor:
    """Per-sample lists as one flat float32 payload."""
    return torch.tensor([v for row in x for v in row], dtype=torch.float32)


def _rounded(x: Ragged) -> Ragged:
    """x as the float32 payload stores it."""
    return [[float(torch.tensor(v, dtype=torch.float32)) for v in row] for row in x]


def default_stages(s: Settings) -> tuple[StageId, ...]:
    """Every stage the config can be replayed with: all but loss.value, which only gae (with returns) has, and
    rollout.mismatch, which a config with a rollout correction or a mismatch ceiling has."""
    mismatch = s.corrected or s.mismatch_max_kl_k3 is not None or s.mismatch_max_token_log_ratio is not None
    return tuple(
        st
        for st in StageId
        if st in ALL_STAGES
        or (st == StageId.LOSS_VALUE and s.advantage_estimator == "gae")
        or (st == StageId.ROLLOUT_MISMATCH and mismatch)
    )


def algorithm_case(
    config: dict[str, Any],
    *,
    seed: int = 0,
    groups: Sequence[int | None] = GROUPS,
    singleton: bool = False,
    empty_sample: bool = False,
    stages: Sequence[StageId] | None = None,
    micro_batches: Sequence[str | None] | None = None,
    entropy: bool = True,
    nan_rewards_at: Sequence[int] = (),
) -> CanonicalCase:
    """A random bundle for `config` whose expected values are this module's: (manifest, index, expected, payloads).

    `singleton` appends a sample in a group of its own; `empty_sample` gives sample 1 no response tokens;
    `micro_batches` each sample's micro_batch_id; `entropy=False` leaves the entropy payload (and entropy_loss) out;
    `stages` the contracted stages (default: every stage the config supports); `nan_rewards_at` the samples whose
    raw reward is NaN (an unscorable completion). n_samples_per_prompt defaults to the size of the first group.
    """
    groups = list(groups) + ([SINGLETON_GROUP] if singleton else [])
    config = {"n_samples_per_prompt": groups.count(groups[0]), **config}
    s = Settings.of(config)
    d = draw_inputs(len(groups), seed, empty_sample)
    for i in nan_rewards_at:
        d.raw[i] = math.nan
    t = d.tokens
    kl = reward_kl(t["old_log_probs"], t["ref_log_probs"], s)
    rewards = post_process(scores(d.raw, d.masks, _rounded(kl), s), groups, s)
    adv, returns = advantages(rewards, d.masks, _rounded(kl), s, t["values"])
    chosen = tuple(stages) if stages is not None else default_stages(s)
    # the loss stages read what the bundle hands them: recomputed values, or the float32 payloads
    loss_adv = adv if StageId.ADVANTAGE_ESTIMATE in chosen else _rounded(adv)
    expected: dict[str, Any] = {
        "reward.raw": {"raw_rewards": list(d.raw)},
        "reward.post_process": {"rewards": rewards},
        "loss.policy": policy_loss(
            t["log_probs"],
            t["old_log_probs"],
            t["ref_log_probs"],
            loss_adv,
            t["entropy"] if entropy else None,
            d.masks,
            s,
            t["rollout_log_probs"],
            micro_batches,
        ),
    }
    names = ("old_log_probs", "log_probs", "ref_log_probs") + (("entropy",) if entropy else ())
    payloads = {name: _flat(t[name]) for name in names}
    if StageId.ROLLOUT_MISMATCH in chosen or s.corrected:
        payloads["rollout_log_probs"] = _flat(t["rollout_log_probs"])
        expected["rollout.mismatch"] = mismatch_metrics(t["old_log_probs"], t["rollout_log_probs"], d.masks)
    payloads["kl"], payloads["advantages"] = _flat(kl), _flat(adv)
    if s.advantage_estimator == "gae":
        assert returns is not None
        loss_returns = returns if StageId.ADVANTAGE_ESTIMATE in chosen else _rounded(returns)
        expected["loss.value"] = value_loss(t["values"], t["vpreds"], loss_returns, d.masks, s, micro_batches)
        payloads.update(values=_flat(t["values"]), vpreds=_flat(t["vpreds"]), returns=_flat(returns))
    records = [
        SampleRecord(
            sample_id=f"a-{i}",
            group_index=g,
            response_length=d.lengths[i],
            total_length=d.lengths[i] + 4,
            loss_mask=d.masks[i],
            raw_reward=d.raw[i],
            reward=rewards[i],
            micro_batch_id=None if micro_batches is None else micro_batches[i],
        )
        for i, g in enumerate(groups)
    ]
    bundle_id = f"b-alg-{seed}"
    index = BundleIndex(
        bundle_id=bundle_id, identity=Identity(rollout_id=seed), samples=records, config=RecomputeConfig(**config)
    )
    manifest = Manifest(bundle_id=bundle_id, stage_contracts={st: StageContract(stage=st) for st in chosen})
    return CanonicalCase(manifest, index, expected, payloads)


def token_position(index: BundleIndex, sample: int, offset: int) -> int:
    """Flat position of token `offset` of sample `sample` in the case's per-token payloads."""
    return sum(r.response_length for r in index.samples[:sample]) + offset


def token_with_mask(index: BundleIndex, sample: int, masked_in: bool = True) -> int:
    """The offset of the first token of `sample` whose loss mask is 1 (or 0 with masked_in=False)."""
    return index.samples[sample].loss_mask.index(1 if masked_in else 0)


__all__ = [
    "ALL_STAGES",
    "FULLY_MASKED",
    "GROUPS",
    "PolicyTerms",
    "Ragged",
    "SINGLETON_GROUP",
    "Settings",
    "advantages",
    "aggregate",
    "algorithm_case",
    "clip_metric",
    "clamp",
    "default_stages",
    "discounted_returns",
    "draw_inputs",
    "gae",
    "group_members",
    "kl_tokens",
    "kl_value",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss",
    "rollout_correction",
    "policy_terms",
    "post_process",
    "reward_kl",
    "token_position",
    "token_rewards",
    "token_with_mask",
    "value_loss",
]
