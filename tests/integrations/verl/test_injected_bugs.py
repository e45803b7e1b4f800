"""Bugs injected into a real verl 0.9.1 step are named at their first stage, sample and token.

Each bug changes what verl computes the way a real bug would (in the batch verl's functions are given, or in the
arguments of the call), while the bundle records the step as production would: the recorded config, uids, scores
and old log-probs are the intended ones. Where the first difference lies is read from verl itself: the bugged step
is compared with the same step built without the bug, and replay must name that stage, sample and token.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.verl.bundles import recompute_config, sample_id, write_bundle, write_rollout
from tests.integrations.verl.steps import MAX_PROMPT, SAMPLES, StepOptions, VerlStep, build_step
from trajectory_replay.bundle import open_sources
from trajectory_replay.outcome import Status
from trajectory_replay.replay import replay
from trajectory_replay.replay.report import ReplayReport

CLEAN = StepOptions()
KL_IN_REWARD = StepOptions(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True)


@pytest.fixture(scope="module")
def clean() -> VerlStep:
    return build_step(CLEAN)


def _first_changed(clean: VerlStep, bugged: VerlStep, key: str) -> tuple[int, int]:
    """The first (row, token) of the valid response tokens where verl's `key` differs between the two steps."""
    valid = clean.batch.batch["attention_mask"][:, MAX_PROMPT:].bool()
    changed = ~torch.isclose(clean.batch.batch[key], bugged.batch.batch[key], rtol=1e-5, atol=1e-6) & valid
    row = int(changed.any(-1).nonzero()[0])
    return row, int(changed[row].nonzero()[0])


def _replay(step: VerlStep, root: Path) -> ReplayReport:
    report = replay(open_sources(write_bundle(step, root)))
    assert report.status is Status.DIVERGED
    return report


def _first(stage: str, sample: str | None, field: str, token: int | None, bundle: str = "verl-step") -> dict[str, Any]:
    return {"bundle": bundle, "stage": stage, "rank": None, "sample": sample, "field": field, "token": token}


def test_uids_swapped_between_two_prompts_are_named_at_the_first_sample_they_regroup(clean, tmp_path: Path) -> None:
    # sample 1 of prompt 0 and sample 0 of prompt 1 trade uids in compute_advantage
    bugged = build_step(replace(CLEAN, swapped_uids=(1, SAMPLES)))
    row, _ = _first_changed(clean, bugged, "advantages")
    assert row in (0, 1, 2, 3)
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("reward.post_process", sample_id(bugged, row), "reward", None)
    first = report.stage("advantage.estimate").divergences[0]
    assert (first.sample_id, first.token_offset) == (sample_id(bugged, row), 0)


def test_uids_shifted_by_one_sample_are_named_at_the_first_sample_they_regroup(clean, tmp_path: Path) -> None:
    bugged = build_step(replace(CLEAN, shifted_uids=True))
    row, _ = _first_changed(clean, bugged, "advantages")
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("reward.post_process", sample_id(bugged, row), "reward", None)


def test_stale_old_log_probs_are_named_at_the_policy_loss(clean, tmp_path: Path) -> None:
    bugged = build_step(replace(CLEAN, stale_old_log_probs=True))
    # the batch (advantages included) is the clean one: only the loss verl reported moved
    assert torch.equal(bugged.batch.batch["advantages"], clean.batch.batch["advantages"])
    assert bugged.policy_metrics["loss"] != clean.policy_metrics["loss"]
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("loss.policy", None, "loss", None)
    assert [s.stage for s in report.stages if s.failed] == ["loss.policy"]


def test_a_loss_aggregated_other_than_recorded_is_named_at_the_policy_loss(clean, tmp_path: Path) -> None:
    bugged = build_step(replace(CLEAN, loss_agg_mode_run="seq-mean-token-mean"))
    assert torch.equal(bugged.batch.batch["advantages"], clean.batch.batch["advantages"])
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("loss.policy", None, "loss", None)
    assert [s.stage for s in report.stages if s.failed] == ["loss.policy"]


def test_eos_dropped_from_the_advantage_mask_is_named_at_its_token(clean, tmp_path: Path) -> None:
    bugged = build_step(replace(CLEAN, eos_dropped=True))
    row, token = _first_changed(clean, bugged, "advantages")
    length = int(clean.batch.batch["attention_mask"][row, MAX_PROMPT:].sum())
    assert token == length - 1  # the last response token, and the loss mask recorded is verl's own
    assert torch.equal(bugged.batch.batch["response_mask"], clean.batch.batch["response_mask"])
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("advantage.estimate", sample_id(bugged, row), "advantages", token)


def test_an_unrecorded_adaptive_kl_coefficient_is_named_at_the_advantage(tmp_path: Path) -> None:
    intended = build_step(KL_IN_REWARD)
    bugged = build_step(replace(KL_IN_REWARD, kl_coef_run=0.1))
    assert torch.equal(bugged.reward_kl, intended.reward_kl)  # the KL itself is what verl formed: advantage.kl holds
    row, token = _first_changed(intended, bugged, "advantages")
    report = _replay(bugged, tmp_path)
    assert report.stage("advantage.kl").status == "pass"
    assert report.first_divergence == _first("advantage.estimate", sample_id(bugged, row), "advantages", token)


def test_a_lost_score_is_named_at_its_group(clean, tmp_path: Path) -> None:
    scores = clean.batch.batch["token_level_scores"].sum(-1)
    lost = int(scores.nonzero()[SAMPLES])  # a sample past the first group whose score is not 0
    bugged = build_step(replace(CLEAN, lost_score=lost))
    assert torch.equal(bugged.batch.batch["token_level_scores"], clean.batch.batch["token_level_scores"])
    row, _ = _first_changed(clean, bugged, "advantages")
    assert row == lost // SAMPLES * SAMPLES  # the whole group's baseline moved
    report = _replay(bugged, tmp_path)
    assert report.first_divergence == _first("reward.post_process", sample_id(bugged, row), "reward", None)


def test_a_wrong_is_threshold_is_named_at_the_first_weight_it_changes(tmp_path: Path) -> None:
    ran = replace(CLEAN, rollout_correction=(("rollout_is", "token"), ("rollout_is_threshold", 2.0)))
    intended = replace(ran, rollout_correction=(("rollout_is", "token"), ("rollout_is_threshold", 1.5)))
    bugged, recorded = build_step(ran), build_step(intended)
    row, token = _first_changed(recorded, bugged, "rollout_is_weights")
    config = recompute_config(recorded)
    report = replay(open_sources(write_rollout(bugged, tmp_path, config=config)))
    assert report.first_divergence == _first(
        "rollout.mismatch", sample_id(bugged, row), "rollout_is_weights", token, "rollout-1"
    )
