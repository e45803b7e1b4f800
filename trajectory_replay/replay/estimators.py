"""Advantage estimators: reward post-processing (r -> r') and per-token advantages, one kernel per estimator.

Each estimator is an `EstimatorKernel` (see `replay.registry`): `post_process` maps the samples' raw
rewards to r' (the group estimators normalize within prompt groups), `advantages` maps r' and the
per-token inputs to A (and, for gae, the returns). Math in float32, as production computes it; sums
that span a whole cohort are accumulated in float64. docs/algorithms.md states every formula.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.replay.kernels import masked_whiten, reverse_scan_order, sample_ends, segment_sum


@dataclass(frozen=True)
class RewardInputs:
    """What reward post-processing reads: one raw reward per sample and its dense prompt-group id."""

    rewards: torch.Tensor
    group_ids: torch.Tensor
    num_groups: int
    config: RecomputeConfig


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads, per sample (rewards r', lengths) and per token (the rest)."""

    rewards: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor
    config: RecomputeConfig
    kl: torch.Tensor | None = None
    """The reward-side KL per token; given when the config puts it into the token rewards."""
    values: torch.Tensor | None = None
    """The old value estimates per token (gae)."""
    whitening: Whitening | None = None
    """How a whitened estimator whitens: None, over these inputs' own masked tokens; a streamed replay passes the
    statistics of the whole cohort (and, in its first pass, collects them)."""
    payloads: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Every per-token payload advantage.estimate loaded, by its name in the stage table (`bundle.stage_io`): a
    kernel reads a payload added to the stage's entry here."""


Whitening = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(values, mask, lengths) -> the values whitened."""


def whiten_advantages(inputs: AdvantageInputs, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` whitened over the cohort's masked tokens, the way `inputs.whitening` says."""
    if inputs.whitening is not None:
        return inputs.whitening(values, mask, inputs.lengths)
    return masked_whiten(values, mask, inputs.lengths)


@dataclass(frozen=True)
class AdvantageOutputs:
    """Per-token advantages, and the returns of an estimator that has them."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None


# --------------------------------------------------------------------------- reward post-processing


def _group_stats(inputs: RewardInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards in float32, each group's size, each group's mean); under nan_rewards=exclude a NaN reward counts in
    neither (a group of NaNs has size 0 and mean NaN)."""
    r = inputs.rewards.to(torch.float32)
    if inputs.config.nan_rewards == "exclude":
        valid = ~torch.isnan(r)
        counts = segment_sum(valid.to(torch.float32), inputs.group_ids, inputs.num_groups)
        sums = segment_sum(torch.where(valid, r, torch.zeros_like(r)), inputs.group_ids, inputs.num_groups)
        return r, counts, sums / counts
    counts = segment_sum(torch.ones_like(r), inputs.group_ids, inputs.num_groups)
    return r, counts, segment_sum(r, inputs.group_ids, inputs.num_groups) / counts


def _unit_singletons(inputs: RewardInputs, counts: torch.Tensor, stat: torch.Tensor, value: float) -> torch.Tensor:
    """`stat` with the groups of one set to `value` under singleton_group=unit (as is, under nan)."""
    if inputs.config.singleton_group == "unit":
        stat = torch.where(counts == 1, torch.full_like(stat, value), stat)
    return stat


def _excluded(inputs: RewardInputs, out: torch.Tensor) -> torch.Tensor:
    """`out` with every NaN set to 0 under nan_rewards=exclude (a NaN reward, or a group with no spread to divide
    by, carries no signal), as is under propagate."""
    return out.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf")) if _excluding(inputs) else out


def _excluding(inputs: RewardInputs) -> bool:
    return inputs.config.nan_rewards == "exclude"


def _batch_std(inputs: RewardInputs, r: torch.Tensor) -> torch.Tensor:
    """The std of every reward of the cohort around the cohort's mean (NaN rewards left out under exclude), unbiased
    unless std_unbiased is false; NaN with no degree of freedom left."""
    kept = r[~torch.isnan(r)] if _excluding(inputs) else r
    n = kept.numel()
    dof = n - 1 if inputs.config.std_unbiased else n
    if dof <= 0:
        return torch.tensor(float("nan"))
    return ((kept - kept.mean()).square().sum() / dof).sqrt()


def grpo_rewards(inputs: RewardInputs) -> torch.Tensor:
    """r - mean_G, divided by (std + std_eps) with std normalization, the std that of the group or of the whole
    cohort (std_scope; unbiased unless std_unbiased is false); a group of one per singleton_group (nan: the formula
    literally; unit: mean 0, std 1); NaN rewards per nan_rewards."""
    cfg = inputs.config
    r, counts, mean = _group_stats(inputs)
    out = r - _unit_singletons(inputs, counts, mean, 0.0)[inputs.group_ids]
    if cfg.grpo_std_normalization and cfg.std_scope == "batch":
        out /= _batch_std(inputs, r).add_(cfg.std_eps)
    elif cfg.grpo_std_normalization:
        centered = r - mean[inputs.group_ids]  # the spread, around the group's true mean
        if _excluding(inputs):
            centered = torch.where(torch.isnan(r), torch.zeros_like(r), centered)
        dof = counts - 1 if cfg.std_unbiased else counts
        std = (segment_sum(centered.square(), inputs.group_ids, inputs.num_groups) / dof).sqrt_()
        if _excluding(inputs):
            std = torch.where(dof > 0, std, torch.full_like(std, float("nan")))
        out /= _unit_singletons(inputs, counts, std, 1.0).add_(cfg.std_eps)[inputs.group_ids]
    return _excluded(inputs, out)


def mean_baseline_rewards(inputs: RewardInputs) -> torch.Tensor:
    """r - mean_G (dr_grpo, reinforce_plus_plus_baseline); a group of one has mean 0 under unit; NaN rewards per
    nan_rewards."""
    r, counts, mean = _group_stats(inputs)
    return _excluded(inputs, r - _unit_singletons(inputs, counts, mean, 0.0)[inputs.group_ids])


def rloo_rewards(inputs: RewardInputs) -> torch.Tensor:
    """Leave-one-out baseline, r - (sum_G r - r) / (n_G - 1), written n/(n-1) r - n/(n-1) mean_G as production
    writes it; a group of one keeps r under unit and is NaN under nan."""
    r, counts, mean = _group_stats(inputs)
    factor = (counts / (counts - 1))[inputs.group_ids]
    out = r * factor - mean[inputs.group_ids] * factor
    single = (counts == 1)[inputs.group_ids]
    fill = r if inputs.config.singleton_group == "unit" else torch.full_like(r, float("nan"))
    return torch.where(single, fill, out)


def raw_rewards(inputs: RewardInputs) -> torch.Tensor:
    """r' = r: the estimator works on token rewards, not on prompt groups."""
    return inputs.rewards.to(torch.float32)


# --------------------------------------------------------------------------- advantages


def broadcast_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """Each sample's r' on every token of its response (times the loss mask with mask_advantages)."""
    rewards, lengths = inputs.rewards.to(torch.float32), inputs.lengths.to(torch.int64)
    if lengths.numel() and bool((lengths == lengths[0]).all()):  # equal lengths (a padded layout): a plain copy
        a = rewards[:, None].expand(-1, int(lengths[0])).reshape(-1)
    else:
        a = torch.repeat_interleave(rewards, lengths)
    if inputs.config.mask_advantages:
        a.mul_(inputs.mask.to(torch.float32))
    return a


def outcome_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """grpo, dr_grpo, rloo: the post-processed reward is every token's advantage."""
    return AdvantageOutputs(broadcast_advantages(inputs))


def token_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """rho_t: the sample's reward at its last token, minus kl_coef * kl * mask on every token when the
    reward-side KL is given."""
    lengths = inputs.lengths.to(torch.int64)
    rho = torch.zeros(int(lengths.sum()), dtype=torch.float32)
    if inputs.kl is not None:
        rho.sub_(inputs.kl.to(torch.float32) * inputs.mask.to(torch.float32) * inputs.config.kl_coef)
    nonempty = lengths > 0
    rho.index_add_(0, sample_ends(lengths)[nonempty] - 1, inputs.rewards.to(torch.float32)[nonempty])
    return rho


SCAN_BLOCK = 64
"""Token positions a reverse scan gathers at once: one gather and one scatter per block, not per position."""

ScanStep = Callable[[int, list[np.ndarray]], np.ndarray]


def reverse_scan(lengths: torch.Tensor, inputs: Sequence[torch.Tensor], step: ScanStep) -> torch.Tensor:
    """Scan every sample backwards from its last token, all samples together: `step(n, rows)` gets each input's
    values at the current token of the n samples that still have one (longest first, see `reverse_scan_order`)
    and returns those tokens' outputs; the outputs come back laid out like the inputs.

    A step is a dozen elementwise operations on at most one value per sample, so per-call overhead is the
    whole cost of a scan: it runs on numpy arrays (views of the tensors), whose calls cost a fraction of
    torch's. Both do the same IEEE float32 operations, so the results are the same bits.
    """
    last, active = reverse_scan_order(lengths)
    ends, arrays = last.numpy(), [t.contiguous().numpy() for t in inputs]
    out = np.empty_like(arrays[0])
    back = np.arange(len(active), dtype=ends.dtype)
    with np.errstate(all="ignore"):  # NaN and inf propagate as they do in torch, without warnings
        for first in range(0, len(active), SCAN_BLOCK):
            counts = active[first : first + SCAN_BLOCK]
            # sample j, column i: the position first + i tokens before its end (clipped where it has none left);
            # sample by sample, so a block reads and writes short contiguous runs of each tensor
            at = ends[: counts[0], None] - back[first : first + len(counts)]
            if counts[-1] != counts[0]:
                np.maximum(at, 0, out=at)
            blocks = [np.ascontiguousarray(a[at].T) for a in arrays]
            produced = np.empty(at.shape, dtype=out.dtype)  # laid out like `at`: it scatters from contiguous rows
            for i, n in enumerate(counts):
                produced[:n, i] = step(n, [b[i, :n] for b in blocks])
            if counts[-1] == counts[0]:
                out[at] = produced
            else:
                live = np.arange(counts[0])[:, None] < np.array(counts)
                out[at[live]] = produced[live]
    return torch.from_numpy(out)


def discounted_returns(
    rho: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, gamma: float, carry: bool = False
) -> torch.Tensor:
    """G_t = rho_t + gamma * R_{t+1} within each sample, scanning all samples backwards together, where R is the
    running return after each token: by default G_t m_t (it restarts after a masked-out token); with `carry`,
    G_t where m_t = 1 and R_{t+1} unchanged where m_t = 0 (a masked-out token neither discounts it nor adds its
    reward), written G_t m_t + R_{t+1} (1 - m_t) as production writes it, and G_t m_t returned."""
    running = np.zeros(lengths.numel(), dtype=np.float32)

    def restart(n: int, rows: list[np.ndarray]) -> np.ndarray:
        r, m = rows
        g = r + np.float32(gamma) * running[:n]
        np.multiply(g, m, out=running[:n])
        return g

    def carried(n: int, rows: list[np.ndarray]) -> np.ndarray:
        r, m = rows
        before = running[:n]
        g = r + np.float32(gamma) * before
        kept = g * m
        before *= np.float32(1.0) - m
        before += kept
        return kept

    return reverse_scan(lengths, [rho, mask.to(torch.float32)], carried if carry else restart)


def reinforce_plus_plus_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Discounted returns of the token rewards (across masked-out tokens as masked_return says), whitened over the
    cohort's masked tokens, then masked."""
    mask = inputs.mask.to(torch.float32)
    carry = inputs.config.masked_return == "carry"
    returns = discounted_returns(token_rewards(inputs), mask, inputs.lengths, inputs.config.gamma, carry)
    return AdvantageOutputs(whiten_advantages(inputs, returns, mask).mul_(mask))


def reinforce_plus_plus_baseline_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """The group-baselined reward on every masked token, whitened over the cohort's masked tokens, then masked."""
    mask = inputs.mask.to(torch.float32)
    scores = torch.repeat_interleave(inputs.rewards.to(torch.float32), inputs.lengths.to(torch.int64)).mul_(mask)
    return AdvantageOutputs(whiten_advantages(inputs, scores, mask).mul_(mask))


def gae_advantages(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Generalized advantage estimation, backwards within each sample; a token with mask 0 (an observation)
    neither takes a TD step nor moves the next value: both carry over it. returns = A + values before the
    advantages are whitened (not re-masked)."""
    if inputs.values is None:
        raise ValueError("gae needs the values payload")
    cfg, mask = inputs.config, inputs.mask.to(torch.float32)
    rho, values = token_rewards(inputs), inputs.values.to(torch.float32)
    next_value = np.zeros(inputs.lengths.numel(), dtype=np.float32)
    running = np.zeros(inputs.lengths.numel(), dtype=np.float32)
    gamma, decay = np.float32(cfg.gamma), np.float32(cfg.gamma * cfg.lam)

    def step(n: int, rows: list[np.ndarray]) -> np.ndarray:
        r, v, m = rows
        upcoming, carried = next_value[:n], running[:n]
        delta = r + gamma * upcoming - v
        advanced = delta + decay * carried
        keep = np.float32(1.0) - m
        upcoming *= keep  # v m + (1 - m) next: the sums are the same in either order
        upcoming += v * m
        carried *= keep
        carried += advanced * m
        return carried

    adv = reverse_scan(inputs.lengths, [rho, values, mask], step)
    returns = adv + values
    return AdvantageOutputs(whiten_advantages(inputs, adv, mask), returns)


__all__ = [
    "AdvantageInputs",
    "AdvantageOutputs",
    "RewardInputs",
    "SCAN_BLOCK",
    "broadcast_advantages",
    "discounted_returns",
    "gae_advantages",
    "grpo_rewards",
    "mean_baseline_rewards",
    "outcome_advantages",
    "raw_rewards",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reverse_scan",
    "rloo_rewards",
    "token_rewards",
    "whiten_advantages",
    "Whitening",
]
