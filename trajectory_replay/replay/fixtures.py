"""The canonical case as pure data: manifest, index, expected values and payload tensors.

The case is the physical-batch bug: prompt groups reward-normalized against the batch instead of their group.

Used by the `demo` command, the bundle tests and the replay tests. Nothing here touches storage; hand the
parts to `bundle.BundleWriter` (which moves the records' loss_mask into the `loss_mask` payload) or to an
in-memory source. The expected loss scalars are computed here with plain Python, independently of the
replay kernels, from the rewards the (correct or buggy) production code produced.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
)

CANONICAL_STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
    StageId.LOSS_POLICY,
)
RAW_REWARDS = (1.0, 3.0, 10.0, 12.0)
CORRECT_REWARDS = (-1.0, 1.0, -1.0, 1.0)
"""Normalized per prompt group (group_index [0, 0, 1, 1])."""
BUGGY_REWARDS = (-5.5, -3.5, 3.5, 5.5)
"""Normalized over the whole physical batch (mean 6.5): the bug."""
TOKENS_PER_SAMPLE = 2
OLD_LOG_PROB, REF_LOG_PROB, ENTROPY = 0.0, 0.25, 0.5
KL_COEF, EPS_CLIP, ENTROPY_COEF = 0.1, 0.2, 0.01


class CanonicalCase(NamedTuple):
    """The four parts of a bundle: manifest, index, expected.json content and per-token payloads."""

    manifest: Manifest
    index: BundleIndex  # type: ignore[assignment]  # a NamedTuple field may shadow tuple.index; mypy refuses it
    expected: dict[str, Any]
    payloads: dict[str, torch.Tensor]


def canonical_case(buggy: bool, current_logprob: float = 0.0) -> CanonicalCase:
    """The canonical step; expected values from the buggy code when `buggy`, current log-probs `current_logprob`.

    With current_logprob 0 (ratio 1) the final loss hides the bug; with 0.5 (ratio e^0.5) loss.policy
    diverges too. bundle_id is b-00065 for the buggy variant, b-00001 for the correct one.
    """
    rewards = BUGGY_REWARDS if buggy else CORRECT_REWARDS
    bundle_id = "b-00065" if buggy else "b-00001"
    n = len(RAW_REWARDS)
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=120, step_id=0), rank={"cp": 1}),
        samples=[
            SampleRecord(
                sample_id=f"s-{i}",
                group_index=i // 2,
                response_length=TOKENS_PER_SAMPLE,
                total_length=TOKENS_PER_SAMPLE + 1,
                loss_mask=[1] * TOKENS_PER_SAMPLE,
                raw_reward=RAW_REWARDS[i],
                reward=rewards[i],
                micro_batch_id="mb-0007" if i < 2 else "mb-0008",
            )
            for i in range(n)
        ],
        config=RecomputeConfig(
            advantage_estimator="grpo",
            n_samples_per_prompt=2,
            kl_loss_type="k1",
            kl_coef=KL_COEF,
            eps_clip=EPS_CLIP,
            eps_clip_high=EPS_CLIP,
            entropy_coef=ENTROPY_COEF,
        ),
    )
    manifest = Manifest(
        bundle_id=bundle_id,
        stage_contracts={s: StageContract(stage=s, capability=StageCapability.RECOMPUTE) for s in CANONICAL_STAGES},
        comparison_policy=ComparisonPolicy(exact_fields=["sample_id", "loss_mask", "group_index"]),
    )
    tokens = n * TOKENS_PER_SAMPLE
    payloads = {
        "old_log_probs": torch.full((tokens,), OLD_LOG_PROB),
        "log_probs": torch.full((tokens,), float(current_logprob)),
        "ref_log_probs": torch.full((tokens,), REF_LOG_PROB),
        "entropy": torch.full((tokens,), ENTROPY),
        "kl": torch.full((tokens,), OLD_LOG_PROB - REF_LOG_PROB),
        "advantages": torch.tensor([r for r in rewards for _ in range(TOKENS_PER_SAMPLE)]),
    }
    expected = {
        "reward.raw": {"raw_rewards": list(RAW_REWARDS)},
        "reward.post_process": {"rewards": list(rewards)},
        "loss.policy": _expected_loss(rewards, current_logprob),
    }
    return CanonicalCase(manifest, index, expected, payloads)


def _expected_loss(rewards: tuple[float, ...], current_logprob: float) -> dict[str, float]:
    # every token of a sample is identical and fully masked, so each per-sample masked mean is the token value
    ratio = math.exp(current_logprob - OLD_LOG_PROB)
    clipped_ratio = min(max(ratio, 1 - EPS_CLIP), 1 + EPS_CLIP)
    pg_loss = clipfrac = 0.0
    for advantage in rewards:
        unclipped, clipped = -ratio * advantage, -clipped_ratio * advantage
        pg_loss += max(unclipped, clipped)
        clipfrac += 1.0 if clipped > unclipped else 0.0
    entropy_loss = ENTROPY * len(rewards)
    return {
        "loss": pg_loss - ENTROPY_COEF * entropy_loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": clipfrac,
        "ppo_kl": (OLD_LOG_PROB - current_logprob) * len(rewards),
    }


__all__ = ["BUGGY_REWARDS", "CORRECT_REWARDS", "CanonicalCase", "RAW_REWARDS", "canonical_case"]
