"""The replay fields a framework's own semantics need (TRL's among them), against the independent float64
reference: each setting replays clean where production used it, and the same bundle replayed without it diverges at
the stage where the difference shows."""

from __future__ import annotations

from typing import Any

import pytest

from tests.replay.conftest import MemorySource
from tests.replay.reference64 import algorithm_case
from trajectory_replay.bundle.schema import BundleIndex, RecomputeConfig
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import replay

GRPO = {"advantage_estimator": "grpo", "grpo_std_normalization": True, "n_samples_per_prompt": 4}
KL_LOSS = {**GRPO, "kl_loss_coef": 0.1}
MICRO_BATCHES = ("mb-0",) * 5 + ("mb-1",) * 4 + ("mb-2",) * 3


def _recorded_as(case: Any, config: dict[str, Any]) -> MemorySource:
    manifest, index, expected, payloads = case
    index = BundleIndex.model_validate({**index.model_dump(), "config": config})
    return MemorySource(manifest, index, expected, payloads)


CASES = [
    # (name, production's config, builder options, a field as it was before, the stage that shows the difference)
    ("std-batch", {**GRPO, "std_scope": "batch"}, {}, {"std_scope": "group"}, "reward.post_process"),
    (
        "std-batch-biased",
        {**GRPO, "std_scope": "batch", "std_unbiased": False},
        {},
        {"std_scope": "group"},
        "reward.post_process",
    ),
    (
        "nan-rewards-excluded",
        {**GRPO, "nan_rewards": "exclude"},
        {"nan_rewards_at": (0, 3, 7)},
        {"nan_rewards": "propagate"},
        "reward.post_process",
    ),
    (
        "nan-rewards-excluded-batch",
        {**GRPO, "nan_rewards": "exclude", "std_scope": "batch"},
        {"nan_rewards_at": (1,)},
        {"nan_rewards": "propagate"},
        "reward.post_process",
    ),
    (
        "nan-rewards-dr-grpo",
        {**GRPO, "advantage_estimator": "dr_grpo", "nan_rewards": "exclude"},
        {"nan_rewards_at": (2,)},
        {"nan_rewards": "propagate"},
        "reward.post_process",
    ),
    (
        "cispo-cap",
        {**GRPO, "policy_loss": "cispo", "cispo_clip": "cap", "eps_clip_high": 1.3},
        {},
        {"cispo_clip": "window"},
        "loss.policy",
    ),
    (
        "kl-ratio-weighted",
        {**KL_LOSS, "kl_loss_ratio_weighted": True},
        {},
        {"kl_loss_ratio_weighted": False},
        "loss.policy",
    ),
    (
        "kl-ratio-weighted-gspo",
        {**KL_LOSS, "policy_loss": "gspo", "kl_loss_ratio_weighted": True},
        {},
        {"kl_loss_ratio_weighted": False},
        "loss.policy",
    ),
    (
        "entropy-token-mean",
        {**GRPO, "entropy_coef": 0.01, "entropy_agg": "token_mean"},
        {},
        {"entropy_agg": "loss_agg_mode"},
        "loss.policy",
    ),
    (
        "entropy-per-micro-batch",
        {**GRPO, "entropy_coef": 0.01, "loss_agg_mode": "token_mean", "entropy_agg": "micro_batch_token_mean"},
        {"micro_batches": MICRO_BATCHES},
        {"entropy_agg": "token_mean"},
        "loss.policy",
    ),
]


@pytest.mark.parametrize("production, options, before, first", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_each_setting_replays_clean_and_its_absence_diverges(production, options, before, first):
    case = algorithm_case(production, seed=21, **options)
    report = replay([MemorySource(*case)])
    assert report.passed, report.render_text()
    without = replay([_recorded_as(case, {**production, **before})])
    assert without.first_divergent_stage == first


def test_a_nan_reward_under_propagate_spreads_and_is_named_at_post_processing_not_at_the_raw_rewards():
    case = algorithm_case(GRPO, seed=22, nan_rewards_at=(0,))
    report = replay([MemorySource(*case)])
    assert report.stage("reward.raw").status == "pass"  # NaN recorded, NaN recomputed: the same raw reward
    assert report.first_divergent_stage == "reward.post_process"  # its group's rewards are NaN: reported there


def test_loss_terms_production_does_not_report_may_be_left_out():
    config = {**KL_LOSS, "loss_terms_reported": False}
    manifest, index, expected, payloads = algorithm_case(config, seed=23)
    for name in ("pg_loss", "ppo_kl", "kl_loss"):
        del expected["loss.policy"][name]
    assert replay([MemorySource(manifest, index, expected, payloads)]).passed
    reported = {**config, "loss_terms_reported": True}
    report = replay([_recorded_as((manifest, index, expected, payloads), reported)])
    assert report.first_divergent_stage == "loss.policy"
    assert "has no field 'pg_loss'" in report.stage("loss.policy").message


def test_metrics_logged_over_every_process_may_be_left_out():
    config = {**GRPO, "entropy_coef": 0.01, "metrics_per_rank": False}
    manifest, index, expected, payloads = algorithm_case(config, seed=29)
    for name in ("pg_clipfrac", "entropy_loss"):
        del expected["loss.policy"][name]
    report = replay([MemorySource(manifest, index, expected, payloads)])
    assert report.passed and report.stage("loss.policy").compared > 0
    per_rank = {**config, "metrics_per_rank": True}
    report = replay([_recorded_as((manifest, index, expected, payloads), per_rank)])
    assert report.first_divergent_stage == "loss.policy"
    assert "has no field 'entropy_loss'" in report.stage("loss.policy").message


@pytest.mark.parametrize(
    "field, value", [("std_scope", "prompt"), ("nan_rewards", "drop"), ("cispo_clip", "both"), ("entropy_agg", "max")]
)
def test_a_value_replay_does_not_implement_is_refused_naming_the_field(field, value):
    case = algorithm_case(GRPO, seed=24)
    with pytest.raises(UnsupportedError, match=f"unsupported {field} '{value}'"):
        replay([_recorded_as(case, {**GRPO, field: value})])


def test_the_trl_profile_is_replayable_with_every_new_semantic_at_once():
    trl = RecomputeConfig.from_profile("trl", num_generations=4, beta=0.1, entropy_coef=0.01, scale_rewards="batch")
    case = algorithm_case(trl.model_dump(), seed=25, nan_rewards_at=(4,), micro_batches=MICRO_BATCHES)
    assert replay([MemorySource(*case)]).passed
