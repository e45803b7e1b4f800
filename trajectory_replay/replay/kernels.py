"""The algorithm kernels replay recomputes with: pure, vectorised torch functions over flat tensors.

Per-token tensors are flat concatenations of the samples' responses (REPLAY_SEMANTICS.md notation);
per-sample reductions are segment sums through `index_add_` over a token -> sample vector, never a
Python loop per token. They run on millions of tokens, so intermediates are updated in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from trajectory_replay.errors import UnsupportedError

GRPO_STD_EPS = 1e-6
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_CLAMP = 10.0


def dense_group_ids(group_index: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """Each sample's group as a dense id (groups numbered in order of first appearance) and the group keys."""
    keys: dict[int, int] = {}
    ids = [keys.setdefault(g, len(keys)) for g in group_index]
    return torch.tensor(ids, dtype=torch.int64), list(keys)


def segment_sum(values: torch.Tensor, segment: torch.Tensor, num_segments: int,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of `values` per segment id (`segment[i]` is the segment of `values[i]`)."""
    return torch.zeros(num_segments, dtype=dtype).index_add_(0, segment, values.to(dtype))


def normalize_group_rewards(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                            std_normalization: bool = False) -> torch.Tensor:
    """GRPO reward post-processing in float32: subtract the group mean, optionally divide by (std + 1e-6).

    std is unbiased (N - 1); a group of one then yields NaN, left in place for comparison to report.
    """
    r = rewards.to(torch.float32)
    counts = segment_sum(torch.ones_like(r), group_ids, num_groups)
    centered = r - (segment_sum(r, group_ids, num_groups) / counts)[group_ids]
    if std_normalization:
        std = (segment_sum(centered.square(), group_ids, num_groups) / (counts - 1)).sqrt_()
        centered /= std.add_(GRPO_STD_EPS)[group_ids]
    return centered


def kl_estimate(old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of the rollout policy against the reference (k1, k2, k3, low_var_kl)."""
    check_kl_type(kl_type)
    r = old_log_probs.to(torch.float32) - ref_log_probs.to(torch.float32)
    if kl_type == "k1":
        return r
    if kl_type == "k2":
        return r.square_().mul_(0.5)
    # exp(-r) - 1 + r written as production writes it (not expm1) so rounding matches
    kl = torch.exp(-r).sub_(1.0).add_(r)
    if kl_type == "low_var_kl":
        kl.clamp_(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def check_kl_type(kl_type: str) -> None:
    """Raise UnsupportedError for a KL estimator replay does not know."""
    if kl_type not in KL_TYPES:
        raise UnsupportedError(f"unsupported kl_loss_type {kl_type!r}: replay knows {', '.join(KL_TYPES)}")


def grpo_advantages(rewards: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """GRPO advantages: each sample's post-processed reward broadcast to every token of its response."""
    return torch.repeat_interleave(rewards.to(torch.float32), response_lengths.to(torch.int64))


def token_sample_ids(response_lengths: torch.Tensor) -> torch.Tensor:
    """The sample position of every token of the flat concatenation."""
    lengths = response_lengths.to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def sum_of_masked_means(values: torch.Tensor, mask: torch.Tensor, token_sample: torch.Tensor,
                        num_samples: int) -> float:
    """V1 reduction R(x) = sum_i [ sum_t x_it m_it / max(T_i, 1) ]: a sum of per-sample masked means.

    Accumulated in float64 so that our own rounding stays far below the comparison tolerance.
    """
    m = mask.to(torch.float64, copy=True)  # multiplied in place below
    tokens = segment_sum(m, token_sample, num_samples, torch.float64).clamp_(min=1.0)
    sums = segment_sum(m.mul_(values.to(torch.float64)), token_sample, num_samples, torch.float64)
    return float(sums.div_(tokens).sum())


@dataclass(frozen=True)
class PolicyLossTokens:
    """Per-token terms of the PPO clipped policy loss."""

    pg: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor


def ppo_policy_loss_tokens(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                           eps_clip: float, eps_clip_high: float, eps_clip_c: Optional[float] = None
                           ) -> PolicyLossTokens:
    """PPO clipped surrogate per token with asymmetric clip and optional dual clip (A < 0: min(-c*A, pg))."""
    a = advantages.to(torch.float32)
    ppo_kl = old_log_probs.to(torch.float32) - log_probs.to(torch.float32)
    ratio = torch.exp(-ppo_kl)
    unclipped = ratio.mul(a).neg_()
    clipped = ratio.clamp_(1.0 - eps_clip, 1.0 + eps_clip_high).mul_(a).neg_()
    del ratio  # clamped in place above
    clipfrac = (clipped > unclipped).to(torch.float32)
    pg = torch.maximum(unclipped, clipped)
    del unclipped, clipped
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise UnsupportedError(f"dual clip eps_clip_c={eps_clip_c} must be greater than 1")
        pg = torch.where(a < 0, torch.minimum(a.mul(-eps_clip_c), pg), pg)
    return PolicyLossTokens(pg=pg, clipfrac=clipfrac, ppo_kl=ppo_kl)


def policy_loss_outputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        entropy: torch.Tensor, mask: torch.Tensor, response_lengths: torch.Tensor, *,
                        eps_clip: float, eps_clip_high: float, eps_clip_c: Optional[float],
                        entropy_coef: float) -> dict[str, float]:
    """The loss.policy scalars: loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl (reduced with R)."""
    terms = ppo_policy_loss_tokens(log_probs, old_log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c)
    token_sample = token_sample_ids(response_lengths)
    n = response_lengths.numel()
    out = {"pg_loss": sum_of_masked_means(terms.pg, mask, token_sample, n),
           "pg_clipfrac": sum_of_masked_means(terms.clipfrac, mask, token_sample, n),
           "ppo_kl": sum_of_masked_means(terms.ppo_kl, mask, token_sample, n),
           "entropy_loss": sum_of_masked_means(entropy, mask, token_sample, n)}
    out["loss"] = out["pg_loss"] - entropy_coef * out["entropy_loss"]
    return out


__all__ = ["GRPO_STD_EPS", "KL_TYPES", "PolicyLossTokens", "check_kl_type", "dense_group_ids", "grpo_advantages",
           "kl_estimate", "normalize_group_rewards", "policy_loss_outputs", "ppo_policy_loss_tokens",
           "segment_sum", "sum_of_masked_means", "token_sample_ids"]
