"""Policy losses, loss aggregation and the clipped value loss: the loss.policy and loss.value kernels.

Every aggregation mode is a weighted sum of per-sample masked sums, Agg(x) = sum_i w_i sum_t x_it m_it,
with weights that depend only on the cohort's token counts (and the config's recorded denominators).
So a loss is computed over blocks of whole samples (`BLOCK_TOKENS` tokens each: per-token temporaries
stay a small fraction of the inputs), the per-sample sums kept exact in float64, and weighted once at
the end; the result does not depend on the blocking.

The clip metrics (`CLIP_METRICS`) are aggregated like the loss, or, with `clip_metric_agg`
micro_batch_token_mean, as a token mean per micro-batch averaged over the micro-batches: from the same
per-sample sums, summed per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.bundle.stage_io import PRE_REJECTION_MASK, rollout_correction
from trajectory_replay.replay.kernels import Workspace, kl_estimate, sample_blocks, stacked_sample_sums
from trajectory_replay.replay.mismatch import correction, log_ratio

BLOCK_TOKENS = 1 << 16
SEQ_MEAN_EPS = 1e-8
MICRO_BATCH_MEAN_EPS = 1e-8
"""Added to a micro-batch's token count when its token mean is taken (a micro-batch without tokens gives 0)."""
CLIP_METRICS = ("pg_clipfrac", "ppo_kl", "vf_clipfrac")
"""The loss-stage outputs `clip_metric_agg` decides the aggregation of."""
CLIP_METRIC_AGGS = ("loss_agg_mode", "micro_batch_token_mean", "micro_batch_seq_mean")
"""The values of `clip_metric_agg` replay implements."""
GSPO_LOG_RATIO_MAX = 10.0


@dataclass(frozen=True)
class PolicyInputs:
    """One block of whole samples: per-token log-probs and advantages, the mask, and each sample's length."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    config: RecomputeConfig
    payloads: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """The block's rows of every per-token payload loss.policy loaded, by its name in the stage table
    (`bundle.stage_io`): a kernel reads a payload added to the stage's entry here."""


@dataclass(frozen=True)
class PolicyLossTokens:
    """Per-token terms of a policy loss: the loss, whether the token was clipped, and old - current log-prob."""

    pg: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor


def _log_ratio(inputs: PolicyInputs) -> torch.Tensor:
    """cur - old in float32, clamped to [-c, c] with ratio_log_clamp."""
    log_ratio = inputs.log_probs.to(torch.float32) - inputs.old_log_probs.to(torch.float32)
    c = inputs.config.ratio_log_clamp
    return log_ratio.clamp_(-c, c) if c is not None else log_ratio


def ppo_clip_tokens(inputs: PolicyInputs) -> PolicyLossTokens:
    """PPO clipped surrogate with asymmetric clip, max(-ratio A, -clip(ratio) A), and the optional dual clip
    (where A < 0: min(-c A, pg)); clipped where the clipped term is strictly larger.

    Computed as -min(ratio A, clip(ratio) A), the same numbers (negation is exact), with clipfrac as a float 0/1
    tensor: on a CPU torch compares into a float tensor several times faster than into a bool one."""
    cfg = inputs.config
    a = inputs.advantages.to(torch.float32)
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    unclipped = ratio.mul(a)
    clipped = ratio.clamp_(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high).mul_(a)  # in place: ratio is not needed
    del ratio
    clipfrac = torch.lt(clipped, unclipped, out=torch.empty_like(clipped))  # -clipped > -unclipped
    pg = torch.minimum(unclipped, clipped, out=unclipped).neg_()
    del clipped
    if cfg.eps_clip_c is not None:
        pg = torch.where(a < 0, torch.minimum(a.mul(-cfg.eps_clip_c), pg), pg)
    return PolicyLossTokens(pg=pg, clipfrac=clipfrac, ppo_kl=log_ratio.neg_())


def gspo_tokens(inputs: PolicyInputs) -> PolicyLossTokens:
    """GSPO: one importance ratio per sequence, s_i = exp(mean over its masked tokens of cur - old), the log
    capped at 10, clipped like PPO on every token of the sequence."""
    cfg = inputs.config
    a = inputs.advantages.to(torch.float32)
    log_ratio = inputs.log_probs.to(torch.float32) - inputs.old_log_probs.to(torch.float32)
    mask = inputs.mask.to(torch.float32)
    lengths = inputs.lengths.to(torch.int64)
    seq = torch.segment_reduce(log_ratio * mask, "sum", lengths=lengths)
    seq /= torch.segment_reduce(mask, "sum", lengths=lengths).clamp_(min=1.0)
    ratio = torch.repeat_interleave(torch.exp(seq.clamp_(max=GSPO_LOG_RATIO_MAX)), lengths)
    pg = ratio.mul(a).neg_()
    clipped = ratio.clamp_(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high).mul_(a).neg_()
    clipfrac = clipped > pg
    torch.maximum(pg, clipped, out=pg)
    return PolicyLossTokens(pg=pg, clipfrac=clipfrac, ppo_kl=log_ratio.neg_())


def cispo_tokens(inputs: PolicyInputs) -> PolicyLossTokens:
    """CISPO: the clipped ratio as a constant weight on the log-prob, pg = -clip(ratio) A cur; clipped where
    the clip changed the ratio. With cispo_clip=cap the weight is min(ratio, eps_clip_high), and a token is clipped
    where the ratio exceeds the cap and its advantage is positive."""
    cfg = inputs.config
    log_ratio = _log_ratio(inputs)
    ratio = torch.exp(log_ratio)
    a = inputs.advantages.to(torch.float32)
    if cfg.cispo_clip == "cap":
        weight = ratio.clamp(max=cfg.eps_clip_high)
        clipfrac = (ratio > cfg.eps_clip_high) & (a > 0)
    else:
        weight = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
        clipfrac = weight != ratio
    pg = weight.mul_(a).mul_(inputs.log_probs.to(torch.float32)).neg_()
    return PolicyLossTokens(pg=pg, clipfrac=clipfrac, ppo_kl=log_ratio.neg_())


# --------------------------------------------------------------------------- aggregation weights


def _denominator(config: RecomputeConfig, counted: torch.Tensor) -> torch.Tensor:
    """The recorded global denominator when there is one, else the local count (0 stays 0: nothing to divide)."""
    if config.loss_denominator is not None:
        return torch.tensor(float(config.loss_denominator), dtype=torch.float64)
    return counted


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x != 0, 1.0 / x, torch.zeros_like(x))


def sum_of_sample_means_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """sum_i mean_i: each sample's masked sum over max(T_i, 1)."""
    return 1.0 / tokens.clamp(min=1.0)


def token_mean_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """sum x m / (loss_denominator or sum m)."""
    return _safe_reciprocal(_denominator(config, tokens.sum())).expand_as(tokens).clone()


def seq_mean_token_mean_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """Mean over the sequences with T_i > 0 (or loss_denominator) of each sequence's masked mean (T_i + 1e-8)."""
    present = (tokens > 0).to(torch.float64)
    return present / (tokens + SEQ_MEAN_EPS) * _safe_reciprocal(_denominator(config, present.sum()))


def seq_mean_token_sum_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """Mean over the sequences with T_i > 0 (or loss_denominator) of each sequence's masked sum."""
    present = (tokens > 0).to(torch.float64)
    return present * _safe_reciprocal(_denominator(config, present.sum()))


def seq_mean_token_sum_norm_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """sum x m / loss_scale_factor (the padded width production divided by; replay refuses it unrecorded)."""
    if config.loss_scale_factor is None:
        raise ValueError("seq_mean_token_sum_norm needs loss_scale_factor")
    return torch.full_like(tokens, 1.0 / float(config.loss_scale_factor))


def seq_mean_token_sum_scaled_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """seq_mean_token_sum / loss_scale_factor: the mean over the sequences with T_i > 0 (or loss_denominator) of
    each sequence's masked sum, divided by the scale factor (replay refuses it unrecorded)."""
    if config.loss_scale_factor is None:
        raise ValueError("seq_mean_token_sum_scaled needs loss_scale_factor")
    return seq_mean_token_sum_weights(tokens, config) / float(config.loss_scale_factor)


def token_sum_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """sum x m: every masked-in token with weight 1."""
    return torch.ones_like(tokens)


# --------------------------------------------------------------------------- the stage outputs


class _TokensKernel(Protocol):
    @property
    def tokens(self) -> Callable[[PolicyInputs], PolicyLossTokens]: ...


class _WeightsKernel(Protocol):
    @property
    def weights(self) -> Callable[[torch.Tensor, RecomputeConfig], torch.Tensor]: ...


class LossKernels(Protocol):
    """What the losses compute with: a policy loss's per-token terms and an aggregation's sample weights (the
    kernels a replay resolved, `replay.registry.Kernels`, are one)."""

    @property
    def policy_loss(self) -> _TokensKernel: ...

    @property
    def aggregation(self) -> _WeightsKernel: ...


@dataclass(frozen=True)
class PolicyLossData:
    """The per-token inputs of loss.policy over a whole cohort (ref_log_probs only with a KL loss)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    entropy: torch.Tensor | None
    """None when the bundle holds no entropy (allowed with entropy_coef 0): no entropy_loss then."""
    mask: torch.Tensor
    lengths: torch.Tensor
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    """The inference engine's log-probs: with rollout_is / rollout_rs, the loss corrects for the mismatch."""
    payloads: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Every per-token payload the stage loaded, by name: the policy loss kernel gets each block's rows of them.
    With a rollout correction, `pre_rejection_mask` (when there) is the mask its weights and rejection are taken
    over; without it, `mask` is."""
    micro_batches: torch.Tensor | None = None
    """Each sample's micro-batch as a dense id, for `clip_metric_agg` micro_batch_token_mean (None: one)."""


@dataclass(frozen=True)
class LossSums:
    """A loss stage's per-sample masked sums (float64, one entry per sample, each field) and token counts T_i:
    everything its scalars are made of. Sums of samples computed apart are put together by position."""

    sums: dict[str, torch.Tensor]
    counts: torch.Tensor

    @staticmethod
    def empty(fields: Sequence[str], n: int) -> LossSums:
        return LossSums({f: torch.zeros(n, dtype=torch.float64) for f in fields}, torch.zeros(n, dtype=torch.float64))

    def put(self, at: torch.Tensor, part: LossSums) -> None:
        """Write `part`'s samples at positions `at`."""
        for name, values in part.sums.items():
            self.sums[name][at] = values
        self.counts[at] = part.counts


def policy_loss_sums(data: PolicyLossData, config: RecomputeConfig, kernels: LossKernels) -> LossSums:
    """The per-sample masked sums of every loss.policy term (kl_loss only with kl_loss_coef), over blocks of
    whole samples; rejection (rollout_rs) changes the mask every term and count is taken over."""
    lengths = data.lengths.to(torch.int64)
    with_kl = config.kl_loss_coef != 0
    with_entropy = data.entropy is not None
    fields = (
        ("pg_loss", "pg_clipfrac", "ppo_kl")
        + (("entropy_loss",) if with_entropy else ())
        + (("kl_loss",) if with_kl else ())
    )
    table = torch.zeros((len(fields) + 1, lengths.numel()), dtype=torch.float64)  # each field's sums, then T_i
    corrected = rollout_correction(config)
    pre_rejection = data.payloads.get(PRE_REJECTION_MASK)
    indicator = kernels.policy_loss.tokens in _INDICATOR_CLIPFRAC  # a plugin's clipfrac is summed as any value
    workspace = Workspace()
    for first, last, start, end in sample_blocks(lengths, BLOCK_TOKENS):
        block_lengths = lengths[first:last]
        block_mask, weights = data.mask[start:end], None
        if corrected:  # rejection changes the mask every term and count is taken over; weights scale pg
            if data.rollout_log_probs is None:
                raise ValueError("a rollout correction needs the rollout_log_probs payload")
            before = pre_rejection[start:end] if pre_rejection is not None else block_mask
            fix = correction(
                log_ratio(data.old_log_probs[start:end], data.rollout_log_probs[start:end]),
                before,
                block_lengths,
                config,
            )
            block_mask, weights = fix.mask, fix.weights
        inputs = PolicyInputs(
            data.log_probs[start:end],
            data.old_log_probs[start:end],
            data.advantages[start:end],
            block_mask,
            block_lengths,
            config,
            {name: t[start:end] for name, t in data.payloads.items()},
        )
        terms = kernels.policy_loss.tokens(inputs)
        pg = terms.pg if weights is None else terms.pg.to(torch.float32) * weights
        rows = [pg, terms.clipfrac, terms.ppo_kl]
        if data.entropy is not None:
            rows.append(data.entropy[start:end])
        del terms
        if with_kl:
            assert data.ref_log_probs is not None
            kl = kl_estimate(
                data.log_probs[start:end],
                data.ref_log_probs[start:end],
                config.kl_loss_estimator,
                config.kl_log_ratio_clamp,
                config.kl_output_clamp,
                config.kl_clamped,
            )
            if config.kl_loss_ratio_weighted:
                kl.mul_(importance_ratio(inputs, sequence=kernels.policy_loss.tokens in _SEQUENCE_RATIO))
            rows.append(kl)
        stacked_sample_sums(
            rows, block_mask, block_lengths, workspace, out=table[:, first:last], counts=(1,) if indicator else ()
        )
    return LossSums(dict(zip(fields, table[:-1])), table[-1])


def importance_ratio(inputs: PolicyInputs, sequence: bool = False) -> torch.Tensor:
    """The policy loss's importance ratio on each token: exp(cur - old) (the log clamped by ratio_log_clamp), or with
    `sequence` each sequence's exp(mean over its masked tokens of cur - old), its log capped as gspo caps it."""
    if not sequence:
        return torch.exp(_log_ratio(inputs))
    log_ratio = inputs.log_probs.to(torch.float32) - inputs.old_log_probs.to(torch.float32)
    mask, lengths = inputs.mask.to(torch.float32), inputs.lengths.to(torch.int64)
    seq = torch.segment_reduce(log_ratio * mask, "sum", lengths=lengths)
    seq /= torch.segment_reduce(mask, "sum", lengths=lengths).clamp_(min=1.0)
    return torch.repeat_interleave(torch.exp(seq.clamp_(max=GSPO_LOG_RATIO_MAX)), lengths)


_SEQUENCE_RATIO = (gspo_tokens,)
"""The policy losses whose importance ratio is one per sequence (the KL loss's weight under kl_loss_ratio_weighted)."""

_INDICATOR_CLIPFRAC = (ppo_clip_tokens, gspo_tokens, cispo_tokens)
"""The policy losses whose clipfrac is a 0/1 indicator per token (its sums are counts: see `stacked_sample_sums`)."""


def policy_loss_scalars(
    sums: LossSums, config: RecomputeConfig, kernels: LossKernels, micro_batches: torch.Tensor | None = None
) -> dict[str, float]:
    """The loss.policy scalars from the per-sample sums of the whole cohort: each term aggregated by the config's
    mode (the clip metrics by `clip_metric_agg`, over `micro_batches`: see `micro_batch_token_means`), loss_scale
    on the loss terms, loss = pg - ec ent + klc kl."""
    out = _aggregate(sums, config, kernels, micro_batches)
    for term in ("pg_loss", "entropy_loss", "kl_loss"):
        if term in out:
            out[term] *= config.loss_scale
    if "entropy_loss" in out and config.entropy_agg != "loss_agg_mode":
        out["entropy_loss"] = entropy_mean(sums, config.entropy_agg, micro_batches)
    out["loss"] = out["pg_loss"]
    if "entropy_loss" in out:
        out["loss"] -= config.entropy_coef * out["entropy_loss"]
    if "kl_loss" in out:
        out["loss"] += config.kl_loss_coef * out["kl_loss"]
    return out


def policy_loss_outputs(data: PolicyLossData, config: RecomputeConfig, kernels: LossKernels) -> dict[str, float]:
    """The loss.policy scalars: pg_loss, pg_clipfrac, ppo_kl, entropy_loss (and kl_loss with kl_loss_coef),
    each aggregated by the config's mode; loss_scale on the loss terms; loss = pg - ec ent + klc kl."""
    return policy_loss_scalars(policy_loss_sums(data, config, kernels), config, kernels, data.micro_batches)


@dataclass(frozen=True)
class ValueLossData:
    """The per-token inputs of loss.value over a whole cohort."""

    values: torch.Tensor
    vpreds: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor


def value_loss_sums(data: ValueLossData, config: RecomputeConfig) -> LossSums:
    """Per-sample masked sums of the clipped value loss vf = max((v' - R)^2, (clip(v', v - c, v + c) - R)^2)
    and of its clip indicator (clipped term strictly larger)."""
    lengths = data.lengths.to(torch.int64)
    c = config.cliprange_value
    table = torch.zeros((3, lengths.numel()), dtype=torch.float64)  # vf_loss, vf_clipfrac, T_i
    workspace = Workspace()
    for first, last, start, end in sample_blocks(lengths, BLOCK_TOKENS):
        values, vpreds = data.values[start:end].to(torch.float32), data.vpreds[start:end].to(torch.float32)
        returns = data.returns[start:end].to(torch.float32)
        clipped = torch.maximum(torch.minimum(vpreds, values + c), values - c).sub_(returns).square_()
        unclipped = vpreds.sub(returns).square_()
        clipfrac = torch.lt(unclipped, clipped, out=torch.empty_like(clipped))  # a float 0/1, as in ppo_clip_tokens
        stacked_sample_sums(
            [torch.maximum(unclipped, clipped, out=unclipped), clipfrac],
            data.mask[start:end],
            lengths[first:last],
            workspace,
            out=table[:, first:last],
            counts=(1,),
        )
    return LossSums({"vf_loss": table[0], "vf_clipfrac": table[1]}, table[2])


def value_loss_scalars(
    sums: LossSums, config: RecomputeConfig, kernels: LossKernels, micro_batches: torch.Tensor | None = None
) -> dict[str, float]:
    """vf_loss = 0.5 Agg(vf) (times loss_scale), vf_clipfrac = Agg(clipped) (or by `clip_metric_agg`), from the
    whole cohort's sums."""
    out = _aggregate(sums, config, kernels, micro_batches)
    out["vf_loss"] *= 0.5 * config.loss_scale
    return out


def value_loss_outputs(data: ValueLossData, config: RecomputeConfig, kernels: LossKernels) -> dict[str, float]:
    """Clipped value loss: vf = max((v' - R)^2, (clip(v', v - c, v + c) - R)^2), vf_loss = 0.5 Agg(vf) (times
    loss_scale), vf_clipfrac = Agg(clipped term strictly larger)."""
    return value_loss_scalars(value_loss_sums(data, config), config, kernels)


def _aggregate(
    sums: LossSums, config: RecomputeConfig, kernels: LossKernels, micro_batches: torch.Tensor | None
) -> dict[str, float]:
    """Each field's per-sample masked sums weighted by the aggregation mode, as a Python float; the clip metrics
    by `clip_metric_agg`."""
    weights = kernels.aggregation.weights(sums.counts, config).to(torch.float64)
    out = {name: float(values.mul(weights).sum()) for name, values in sums.sums.items()}
    if config.clip_metric_agg == "micro_batch_token_mean":
        out.update(micro_batch_token_means(sums, micro_batches))
    elif config.clip_metric_agg == "micro_batch_seq_mean":
        out.update(micro_batch_seq_means(sums, micro_batches))
    return out


def micro_batch_seq_means(sums: LossSums, micro_batches: torch.Tensor | None) -> dict[str, float]:
    """Each clip metric as the mean over micro-batches of the mean over the micro-batch's samples of each sample's
    token mean (S_i / max(T_i, 1): a sample without masked-in tokens counts as 0), for a metric that is one value
    per sequence (TRL's clip ratios under importance_sampling_level=sequence)."""
    n = sums.counts.numel()
    groups = torch.zeros(n, dtype=torch.int64) if micro_batches is None else micro_batches.to(torch.int64)
    k = int(groups.max()) + 1 if n else 0
    rows = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, torch.ones(n, dtype=torch.float64))
    out = {}
    for name in CLIP_METRICS:
        if name in sums.sums:
            means = sums.sums[name] / sums.counts.clamp(min=1.0)
            totals = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, means)
            out[name] = float((totals / rows.clamp(min=1.0)).mean()) if k else 0.0
    return out


ENTROPY_AGGS = ("loss_agg_mode", "token_mean", "micro_batch_token_mean")
"""The values of `entropy_agg` replay implements."""


def entropy_mean(sums: LossSums, entropy_agg: str, micro_batches: torch.Tensor | None) -> float:
    """entropy_loss aggregated on its own (not scaled by loss_scale): token_mean, its masked sum over the cohort's
    masked-in tokens (0 without any); micro_batch_token_mean, the mean over micro-batches of each one's token mean
    (`micro_batch_token_means`)."""
    if entropy_agg == "token_mean":
        tokens = float(sums.counts.sum())
        return float(sums.sums["entropy_loss"].sum()) / tokens if tokens else 0.0
    return micro_batch_token_means(sums, micro_batches, ("entropy_loss",))["entropy_loss"]


def micro_batch_token_means(
    sums: LossSums, micro_batches: torch.Tensor | None, names: Sequence[str] = CLIP_METRICS
) -> dict[str, float]:
    """Each clip metric (each of `names`) as the mean over micro-batches of its token mean within the micro-batch:
    mean_g (sum_{i in g} S_i / (sum_{i in g} T_i + 1e-8)). `micro_batches`: each sample's micro-batch as a dense
    id 0..k-1 (None: the samples are one micro-batch); a micro-batch without masked-in tokens counts as 0."""
    n = sums.counts.numel()
    groups = torch.zeros(n, dtype=torch.int64) if micro_batches is None else micro_batches.to(torch.int64)
    if groups.numel() != n:
        raise ValueError(f"micro_batches has {groups.numel()} entries for {n} samples")
    k = int(groups.max()) + 1 if n else 0
    tokens = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, sums.counts)
    out = {}
    for name in names:
        if name in sums.sums:
            totals = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, sums.sums[name])
            out[name] = float((totals / (tokens + MICRO_BATCH_MEAN_EPS)).mean()) if k else 0.0
    return out


__all__ = [
    "BLOCK_TOKENS",
    "CLIP_METRICS",
    "CLIP_METRIC_AGGS",
    "ENTROPY_AGGS",
    "LossKernels",
    "LossSums",
    "PolicyInputs",
    "PolicyLossData",
    "PolicyLossTokens",
    "ValueLossData",
    "cispo_tokens",
    "entropy_mean",
    "importance_ratio",
    "gspo_tokens",
    "micro_batch_seq_means",
    "micro_batch_token_means",
    "policy_loss_outputs",
    "policy_loss_scalars",
    "policy_loss_sums",
    "ppo_clip_tokens",
    "seq_mean_token_mean_weights",
    "seq_mean_token_sum_norm_weights",
    "seq_mean_token_sum_scaled_weights",
    "seq_mean_token_sum_weights",
    "sum_of_sample_means_weights",
    "token_mean_weights",
    "token_sum_weights",
    "value_loss_outputs",
    "value_loss_scalars",
    "value_loss_sums",
]
