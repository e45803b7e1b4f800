"""The algorithm kernels replay recomputes with: pure, vectorised torch functions over flat tensors.

Per-token tensors are flat concatenations of the samples' responses;
per-sample reductions are segment reductions over the response lengths (per-group ones `index_add_`
over a sample -> group vector), never a Python loop per token. They run on millions of tokens, so intermediates are updated in place.
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


class MaskedMeans:
    """V1 reduction R(x) = sum_i [ sum_t x_it m_it / max(T_i, 1) ]: a sum of per-sample masked means.

    The token counts are computed once and shared by every reduction of one cohort; sums are
    segment reductions over the response lengths, accumulated in float64 so that our own rounding
    stays far below the comparison tolerance. `sample_sums` gives the per-sample masked sums, so a
    caller may reduce a cohort block by block and add the results.
    """

    def __init__(self, mask: torch.Tensor, response_lengths: torch.Tensor) -> None:
        self.lengths = response_lengths.to(torch.int64)
        self.mask = mask.to(torch.float64)  # callers reduce block by block, so this stays small
        self.tokens = torch.segment_reduce(self.mask, "sum", lengths=self.lengths).clamp_(min=1.0)

    def sample_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample sums of values * mask, in float64."""
        weighted = values.to(torch.float64).mul_(self.mask)
        return torch.segment_reduce(weighted, "sum", lengths=self.lengths)

    def __call__(self, values: torch.Tensor) -> float:
        return float(self.sample_sums(values).div_(self.tokens).sum())


def sum_of_masked_means(values: torch.Tensor, mask: torch.Tensor, response_lengths: torch.Tensor) -> float:
    """R(values) for one tensor (see MaskedMeans, which shares the mask work across several)."""
    return MaskedMeans(mask, response_lengths)(values)


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
    pg = ratio.mul(a).neg_()  # the unclipped term, turned into pg in place below
    clipped = ratio.clamp_(1.0 - eps_clip, 1.0 + eps_clip_high).mul_(a).neg_()
    del ratio  # clamped in place above
    clipfrac = clipped > pg  # bool: a quarter of the memory of a float tensor; reductions promote it
    torch.maximum(pg, clipped, out=pg)
    del clipped
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise UnsupportedError(f"dual clip eps_clip_c={eps_clip_c} must be greater than 1")
        pg = torch.where(a < 0, torch.minimum(a.mul(-eps_clip_c), pg), pg)
    return PolicyLossTokens(pg=pg, clipfrac=clipfrac, ppo_kl=ppo_kl)


def policy_loss_outputs(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        entropy: torch.Tensor, mask: torch.Tensor, response_lengths: torch.Tensor, *,
                        eps_clip: float, eps_clip_high: float, eps_clip_c: Optional[float],
                        entropy_coef: float) -> dict[str, float]:
    """The loss.policy scalars: loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl (reduced with R).

    Computed over blocks of whole samples (about `BLOCK_TOKENS` tokens each), so the per-token
    temporaries stay a small fraction of the inputs however large the cohort; per-sample sums are
    exact to float64 either way, so the result does not depend on the blocking.
    """
    lengths = response_lengths.to(torch.int64)
    fields = ("entropy_loss", "ppo_kl", "pg_clipfrac", "pg_loss")
    per_sample = {f: [] for f in fields}
    tokens: list[torch.Tensor] = []
    for first, last, start, end in _sample_blocks(lengths):
        reduce = MaskedMeans(mask[start:end], lengths[first:last])
        terms = ppo_policy_loss_tokens(log_probs[start:end], old_log_probs[start:end], advantages[start:end],
                                       eps_clip, eps_clip_high, eps_clip_c)
        per_sample["entropy_loss"].append(reduce.sample_sums(entropy[start:end]))
        per_sample["ppo_kl"].append(reduce.sample_sums(terms.ppo_kl))
        per_sample["pg_clipfrac"].append(reduce.sample_sums(terms.clipfrac))
        per_sample["pg_loss"].append(reduce.sample_sums(terms.pg))
        tokens.append(reduce.tokens)
        del terms
    count = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.float64)
    out = {f: float((torch.cat(v) if v else count).div(count).sum()) if v else 0.0 for f, v in per_sample.items()}
    out["loss"] = out["pg_loss"] - entropy_coef * out["entropy_loss"]
    return out


BLOCK_TOKENS = 1 << 19


def _sample_blocks(lengths: torch.Tensor):
    """(first sample, end sample, first token, end token) of consecutive blocks of whole samples."""
    first, start, acc = 0, 0, 0
    ends = torch.cumsum(lengths, 0).tolist()
    for i, end in enumerate(ends):
        acc = end - start
        if acc >= BLOCK_TOKENS or i == len(ends) - 1:
            yield first, i + 1, start, end
            first, start = i + 1, end


__all__ = ["GRPO_STD_EPS", "KL_TYPES", "PolicyLossTokens", "check_kl_type", "dense_group_ids", "grpo_advantages",
           "kl_estimate", "normalize_group_rewards", "policy_loss_outputs", "ppo_policy_loss_tokens",
           "segment_sum", "sum_of_masked_means", "MaskedMeans"]
