"""Replay's reward post-processing against TRL 1.16's advantages: group, batch and no std scaling, with rewards of
None (NaN) that TRL leaves out of their group's statistics and gives advantage 0. TRL computes them inline in
GRPOTrainer._generate_and_score_completions; `_trl_advantages` is those lines (sum_then_normalize, one reward
function) around TRL's own nanstd."""

from __future__ import annotations

import math

import pytest
import torch
from trl.trainer.utils import nanstd

from tests.replay.conftest import MemorySource
from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay.runner import replay

GROUP = 4


def _trl_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """GRPOTrainer's advantages of TRL 1.16 (trainer/grpo_trainer.py, multi_objective_aggregation
    'sum_then_normalize')."""
    mean = torch.nanmean(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    if scale_rewards in ("group", "none"):
        std = nanstd(rewards.view(-1, GROUP), dim=1).repeat_interleave(GROUP, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _rewards() -> torch.Tensor:
    """Four groups: one with a None reward, one with three, one all None, one plain."""
    g = torch.Generator().manual_seed(3)
    r = torch.randn(4 * GROUP, generator=g) * 2.0
    r[1] = r[4] = r[5] = r[6] = math.nan
    r[8:12] = math.nan
    return r


def _bundle(config: RecomputeConfig, raw: torch.Tensor, advantages: torch.Tensor) -> MemorySource:
    """A rollout-level bundle of the rewards: the raw ones recorded as TRL had them (NaN for None) and TRL's
    advantages as the post-processed rewards."""
    records = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=i // GROUP,
            response_length=2,
            total_length=3,
            loss_mask=[1, 1],
            raw_reward=float(raw[i]),
            reward=float(advantages[i]),
        )
        for i in range(raw.numel())
    ]
    index = BundleIndex(bundle_id="rollout-0", identity=Identity(rollout_id=0), samples=records, config=config)
    stages = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS)
    manifest = Manifest(bundle_id="rollout-0", stage_contracts={s: StageContract(stage=s) for s in stages})
    expected = {
        "reward.raw": {"raw_rewards": raw.tolist()},
        "reward.post_process": {"rewards": advantages.tolist()},
    }
    return MemorySource(manifest, index, expected, {})


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_replay_reproduces_trls_advantages_with_none_rewards(scale_rewards):
    raw = _rewards()
    named = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    advantages = _trl_advantages(raw, named)
    assert (advantages[[1, 4, 5, 6, 8, 9, 10, 11]] == 0).all()  # unscorable, and alone in its group
    config = RecomputeConfig.from_profile("trl", scale_rewards=scale_rewards, num_generations=GROUP)
    report = replay([_bundle(config, raw, advantages)])
    assert report.passed, report.render_text()


@pytest.mark.parametrize(
    "scale_rewards, wrong, first",
    [
        ("group", {"nan_rewards": "propagate"}, "reward.post_process"),
        ("batch", {"std_scope": "group"}, "reward.post_process"),
        ("group", {"std_scope": "batch"}, "reward.post_process"),
    ],
)
def test_without_trls_treatment_replay_diverges_after_the_raw_rewards(scale_rewards, wrong, first):
    raw = _rewards()
    config = RecomputeConfig.from_profile("trl", scale_rewards=scale_rewards, num_generations=GROUP)
    config = RecomputeConfig.model_validate({**config.model_dump(), **wrong})
    report = replay([_bundle(config, raw, _trl_advantages(raw, scale_rewards))])
    assert report.first_divergent_stage == first
    assert report.stage("reward.raw").status == "pass"  # NaN recorded as NaN is the raw reward as it was


def test_a_nan_raw_reward_that_production_did_not_have_is_still_a_divergence():
    raw = _rewards()
    config = RecomputeConfig.from_profile("trl", num_generations=GROUP)
    source = _bundle(config, raw, _trl_advantages(raw, "group"))
    source.expected["reward.raw"]["raw_rewards"][0] = math.nan  # the records say otherwise
    report = replay([source])
    assert report.first_divergent_stage == "reward.raw"
