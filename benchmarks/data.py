"""A large, self-consistent GRPO bundle for the bundle and replay benchmarks.

2,048 samples x 2,048 response tokens by default: six float32 per-token payloads plus the uint8
mask, about 100 MB. Prompt groups of 8 whose members are scattered across the bundle (sample i is
in group i % (n / 8)), so reading one group touches rows far apart. Expected values are computed
here so that a replay passes (a benchmark of the full recompute, not of early failure).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    ProducerInfo,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
)

GROUP_SIZE = 8
STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
    StageId.LOSS_POLICY,
)


class BigCase(NamedTuple):
    manifest: Manifest
    index: BundleIndex
    expected: dict
    payloads: dict[str, torch.Tensor]
    loss_masks: torch.Tensor


def big_case(n_samples: int = 2048, tokens: int = 2048, bundle_id: str = "big", seed: int = 0) -> BigCase:
    """The bundle documents and payloads; loss masks are in the records (the writer moves them)."""
    g = torch.Generator().manual_seed(seed)
    n_groups = n_samples // GROUP_SIZE
    group_index = [i % n_groups for i in range(n_samples)]
    raw = torch.rand(n_samples, generator=g) * 10
    # per-group normalization (mean only), in float32 like replay
    sums = torch.zeros(n_groups).index_add_(0, torch.tensor(group_index), raw)
    rewards = raw - (sums / GROUP_SIZE)[torch.tensor(group_index)]
    masks = torch.ones(n_samples, tokens, dtype=torch.uint8)
    masks[:, tokens - tokens // 8 :] = 0  # padding tail: partial masks
    total = n_samples * tokens
    old = -torch.rand(total, generator=g)
    ref = old + 0.01 * torch.randn(total, generator=g)
    cur = old + 0.05 * torch.randn(total, generator=g)
    entropy = torch.rand(total, generator=g)
    kl = old - ref
    advantages = rewards.repeat_interleave(tokens)
    expected = {
        "reward.raw": {"raw_rewards": raw.tolist()},
        "reward.post_process": {"rewards": rewards.tolist()},
        "loss.policy": _loss(old, cur, entropy, advantages, masks.reshape(-1), n_samples, tokens),
    }
    samples = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=group_index[i],
            response_length=tokens,
            total_length=tokens + 16,
            loss_mask=masks[i].tolist(),
            raw_reward=float(raw[i]),
            reward=float(rewards[i]),
            micro_batch_id=f"mb-{i // 64:04d}",
        )
        for i in range(n_samples)
    ]
    config = RecomputeConfig(
        n_samples_per_prompt=GROUP_SIZE,
        kl_loss_type="k1",
        kl_coef=0.01,
        eps_clip=0.2,
        eps_clip_high=0.28,
        entropy_coef=0.001,
    )
    index = BundleIndex(
        bundle_id=bundle_id,
        identity=Identity(actor_step_id=ActorStepId(rollout_id=7, step_id=0)),
        samples=samples,
        config=config,
    )
    manifest = Manifest(
        bundle_id=bundle_id,
        producer=ProducerInfo(commit="bench"),
        stage_contracts={s: StageContract(stage=s, capability=StageCapability.RECOMPUTE) for s in STAGES},
        comparison_policy=ComparisonPolicy(tolerances={"loss.policy": {"atol": 1e-3, "rtol": 1e-4}}),
    )
    payloads = {
        "old_log_probs": old,
        "log_probs": cur,
        "ref_log_probs": ref,
        "entropy": entropy,
        "kl": kl,
        "advantages": advantages,
    }
    return BigCase(manifest, index, expected, payloads, masks.reshape(-1))


def _loss(old, cur, entropy, adv, mask, n, tokens) -> dict:
    """The loss scalars, computed straightforwardly in float64 (independent of the replay kernels)."""
    old, cur, entropy, adv, m = (t.double().reshape(n, tokens) for t in (old, cur, entropy, adv, mask))
    ratio = torch.exp(cur - old)
    l1, l2 = -ratio * adv, -ratio.clamp(0.8, 1.28) * adv
    pg = torch.maximum(l1, l2)
    clip = (l2 > l1).double()
    count = m.sum(1).clamp(min=1)

    def reduce(x):
        return float(((x * m).sum(1) / count).sum())

    pg_loss, entropy_loss = reduce(pg), reduce(entropy)
    return {
        "pg_loss": pg_loss,
        "pg_clipfrac": reduce(clip),
        "ppo_kl": reduce(old - cur),
        "entropy_loss": entropy_loss,
        "loss": pg_loss - 0.001 * entropy_loss,
    }
