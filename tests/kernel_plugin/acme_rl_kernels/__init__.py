"""A framework's own kernels, registered with trajectory-replay through an entry point.

`acme_grpo` is a group-mean baseline scaled by 2 (the advantage is the scaled reward on every token);
`acme_token_sum` aggregates a loss as the plain sum over every masked token of the cohort.
"""

from __future__ import annotations

import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.replay.estimators import AdvantageInputs, AdvantageOutputs, RewardInputs
from trajectory_replay.replay.registry import AggregationKernel, EstimatorKernel

BASELINE_SCALE = 2.0


def doubled_mean_baseline(inputs: RewardInputs) -> torch.Tensor:
    """r' = 2 (r - mean of the sample's prompt group)."""
    r = inputs.rewards.to(torch.float32)
    sums = torch.zeros(inputs.num_groups, dtype=torch.float32).index_add_(0, inputs.group_ids, r)
    sizes = torch.bincount(inputs.group_ids, minlength=inputs.num_groups).to(torch.float32)
    return (r - (sums / sizes)[inputs.group_ids]) * BASELINE_SCALE


def reward_on_every_token(inputs: AdvantageInputs) -> AdvantageOutputs:
    """A_t = r' on every token of the sample's response."""
    return AdvantageOutputs(torch.repeat_interleave(inputs.rewards.to(torch.float32), inputs.lengths))


def unit_weights(tokens: torch.Tensor, config: RecomputeConfig) -> torch.Tensor:
    """Weight 1 on every sample's masked sum: the loss is the sum over all masked tokens."""
    return torch.ones_like(tokens)


ACME_GRPO = EstimatorKernel("acme_grpo", doubled_mean_baseline, reward_on_every_token)
ACME_TOKEN_SUM = AggregationKernel("acme_token_sum", unit_weights)
