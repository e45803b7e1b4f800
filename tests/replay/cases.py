"""A 12-sample, 3-group bundle with non-adjacent group members, ragged lengths and partial masks.

Its expected values are computed here with plain Python loops, independently of the replay kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from trajectory_replay.bundle.schema import (
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay.fixtures import CanonicalCase

GROUPS = [2, 0, 1, 0, 2, 1, 1, 0, 2, 0, 1, 2]
LENGTHS = [3, 1, 4, 2, 5, 2, 1, 3, 2, 4, 1, 3]
RAW = [0.5, 1.0, -0.3, 2.0, 0.7, 0.0, 1.5, -1.0, 0.2, 0.9, 3.0, -0.4]
# s-6 is fully masked out (T = 0: its mean divides by max(T, 1))
MASKS = [
    [1, 1, 0],
    [1],
    [0, 1, 1, 1],
    [1, 1],
    [1, 0, 1, 0, 1],
    [1, 1],
    [0],
    [1, 1, 1],
    [0, 1],
    [1, 1, 1, 0],
    [1],
    [1, 0, 1],
]
CONFIG = dict(
    advantage_estimator="grpo",
    n_samples_per_prompt=4,
    grpo_std_normalization=True,
    kl_loss_type="k3",
    kl_coef=0.05,
    eps_clip=0.2,
    eps_clip_high=0.28,
    eps_clip_c=3.0,
    entropy_coef=0.01,
)
STAGES = [s for s in StageId if s not in (StageId.LOSS_VALUE, StageId.ROLLOUT_MISMATCH)]


def reference_rewards(raw: Sequence[float], groups: Sequence[int], std: bool) -> list[float]:
    """GRPO group normalization, one group at a time."""
    out = [0.0] * len(raw)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        mean = sum(raw[i] for i in idx) / len(idx)
        centered = {i: raw[i] - mean for i in idx}
        if std:
            sd = math.sqrt(sum(c * c for c in centered.values()) / (len(idx) - 1))
            centered = {i: c / (sd + 1e-6) for i, c in centered.items()}
        for i, c in centered.items():
            out[i] = c
    return out


def reference_kl(old: Sequence[float], ref: Sequence[float]) -> list[float]:
    """k3 per token."""
    return [math.exp(-(o - r)) - 1 + (o - r) for o, r in zip(old, ref)]


def reference_loss(
    rewards: Sequence[float],
    lengths: Sequence[int],
    masks: Sequence[Sequence[int]],
    old: Sequence[float],
    cur: Sequence[float],
    entropy: Sequence[float],
    cfg: dict,
) -> dict:
    """The loss.policy scalars, token by token."""
    sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "entropy_loss": 0.0}
    t0 = 0
    for a, n, mask in zip(rewards, lengths, masks):
        acc = dict.fromkeys(sums, 0.0)
        for t in range(n):
            kl = old[t0 + t] - cur[t0 + t]
            ratio = math.exp(-kl)
            l1 = -ratio * a
            l2 = -min(max(ratio, 1 - cfg["eps_clip"]), 1 + cfg["eps_clip_high"]) * a
            pg = max(l1, l2)
            if a < 0:
                pg = min(-cfg["eps_clip_c"] * a, pg)
            for key, value in (
                ("pg_loss", pg),
                ("pg_clipfrac", float(l2 > l1)),
                ("ppo_kl", kl),
                ("entropy_loss", entropy[t0 + t]),
            ):
                acc[key] += value * mask[t]
        for key in sums:
            sums[key] += acc[key] / max(sum(mask), 1)
        t0 += n
    sums["loss"] = sums["pg_loss"] - cfg["entropy_coef"] * sums["entropy_loss"]
    return sums


def _token_lists() -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(7)
    n = sum(LENGTHS)
    old = torch.randn(n, generator=g) * 0.3 - 1.0
    lists = {
        "old_log_probs": old.tolist(),
        "ref_log_probs": (old + torch.randn(n, generator=g) * 0.2).tolist(),
        "log_probs": (old + torch.randn(n, generator=g) * 0.4).tolist(),
        "entropy": torch.rand(n, generator=g).tolist(),
    }
    lists["log_probs"][0] = lists["old_log_probs"][0] + 1.5  # a ratio above the dual clip c
    return lists


def twelve_case() -> CanonicalCase:
    """The passing 12-sample case: (manifest, index, expected, payloads)."""
    tokens = _token_lists()
    rewards = reference_rewards(RAW, GROUPS, CONFIG["grpo_std_normalization"])
    records = [
        SampleRecord(
            sample_id=f"q-{i}",
            group_index=GROUPS[i],
            response_length=LENGTHS[i],
            total_length=LENGTHS[i] + 5,
            loss_mask=MASKS[i],
            raw_reward=RAW[i],
            reward=rewards[i],
            micro_batch_id=f"mb-{i // 4:04d}",
        )
        for i in range(12)
    ]
    index = BundleIndex(
        bundle_id="b-twelve", identity=Identity(rollout_id=3), samples=records, config=RecomputeConfig(**CONFIG)
    )
    manifest = Manifest(
        bundle_id="b-twelve",
        stage_contracts={s: StageContract(stage=s) for s in STAGES},
        comparison_policy=ComparisonPolicy(exact_fields=["sample_id", "loss_mask", "group_index"]),
    )
    # float32 round trip first, so the reference sees the values replay sees
    payloads = {k: torch.tensor(v, dtype=torch.float32) for k, v in tokens.items()}
    tokens = {k: t.tolist() for k, t in payloads.items()}
    payloads["kl"] = torch.tensor(reference_kl(tokens["old_log_probs"], tokens["ref_log_probs"]))
    payloads["advantages"] = torch.tensor([rewards[i] for i in range(12) for _ in range(LENGTHS[i])])
    expected: dict[str, Any] = {
        "reward.raw": {"raw_rewards": list(RAW)},
        "reward.post_process": {"rewards": rewards},
        "loss.policy": reference_loss(
            rewards, LENGTHS, MASKS, tokens["old_log_probs"], tokens["log_probs"], tokens["entropy"], CONFIG
        ),
    }
    return CanonicalCase(manifest, index, expected, payloads)


def token_position(sample: int, offset: int) -> int:
    """Flat position of token `offset` of sample `sample` in the 12-sample case."""
    return sum(LENGTHS[:sample]) + offset


def split_ranks(case: CanonicalCase, ranks: Sequence[Sequence[int]]) -> list[CanonicalCase]:
    """Data-parallel shards of `case`: each rank gets its samples' rows and its own expected values."""
    manifest, index, expected, payloads = case
    starts = [sum(LENGTHS[:i]) for i in range(12)]
    shards = []
    for positions in ranks:
        rows = torch.cat([torch.arange(starts[i], starts[i] + LENGTHS[i]) for i in positions])
        sub_payloads = {k: v[rows] for k, v in payloads.items()}
        sub = [index.samples[i] for i in positions]
        rewards = [expected["reward.post_process"]["rewards"][i] for i in positions]
        sub_expected = {
            "reward.raw": {"raw_rewards": [RAW[i] for i in positions]},
            "reward.post_process": {"rewards": rewards},
            "loss.policy": reference_loss(
                rewards,
                [LENGTHS[i] for i in positions],
                [MASKS[i] for i in positions],
                sub_payloads["old_log_probs"].tolist(),
                sub_payloads["log_probs"].tolist(),
                sub_payloads["entropy"].tolist(),
                CONFIG,
            ),
        }
        shards.append(CanonicalCase(manifest, index.model_copy(update={"samples": sub}), sub_expected, sub_payloads))
    return shards
