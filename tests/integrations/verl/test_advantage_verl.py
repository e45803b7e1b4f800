"""The reward and advantage side of a verl 0.9 step, computed by verl itself and replayed under the verl profile.

A multi-turn step of steps.py (16 prompts x 4 samples, observation spans of mask 0 inside the responses, one
response ending on an observation, a prompt's samples interleaved with the others' in the batch, two log ratios
beyond verl's KL clamp) goes through verl's own `apply_kl_penalty` (the KL in the reward) and `compute_advantage`;
the adapter writes its rollout side (valid tokens only, uid -> group, the KL as verl forms it, kld * response_mask)
and it is replayed. Every configuration replays clean at default tolerances, and the config field that expresses
verl's behaviour is shown to matter: the other choice diverges at its stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from verl.trainer.ppo import core_algos

from tests.integrations.verl.bundles import recompute_config, write_rollout
from tests.integrations.verl.steps import BEYOND_CLAMP, ENDS_ON_OBSERVATION, MAX_PROMPT, StepOptions, build_step
from trajectory_replay.bundle import open_sources
from trajectory_replay.bundle.schema import StageId
from trajectory_replay.replay import kernels, replay
from trajectory_replay.replay.source import ReplaySource

STAGES = (
    StageId.SAMPLE,
    StageId.REWARD_RAW,
    StageId.REWARD_POST_PROCESS,
    StageId.ADVANTAGE_KL,
    StageId.ADVANTAGE_ESTIMATE,
)

CONFIGS = [
    pytest.param("grpo", "low_var_kl", {}, id="grpo-low_var_kl"),
    pytest.param("grpo", "kl", {"norm_adv_by_std_in_grpo": False}, id="grpo-unnormalized-k1"),
    pytest.param("rloo", "k3", {}, id="rloo-k3"),
    pytest.param("reinforce_plus_plus_baseline", "mse", {}, id="rf++-baseline-k2"),
    pytest.param("reinforce_plus_plus", "kl", {"gamma": 0.9}, id="rf++-multi-turn-k1"),
    pytest.param("reinforce_plus_plus", "low_var_kl", {}, id="rf++-multi-turn-low_var_kl"),
]


def _options(estimator: str, kl_penalty: str, options: dict[str, Any], seed: int = 3) -> StepOptions:
    return StepOptions(
        adv_estimator=estimator,
        kl_penalty=kl_penalty,
        use_kl_in_reward=True,
        multi_turn=True,
        interleaved_uids=True,
        ref_beyond_clamp=True,
        seed=seed,
        **options,
    )


def _replayed(tmp_path: Path, estimator: str, kl_penalty: str, options: dict[str, Any]) -> ReplaySource:
    step = build_step(_options(estimator, kl_penalty, options))
    (source,) = open_sources(write_rollout(step, tmp_path))
    return source


def test_the_step_has_what_these_tests_are_about():
    step = build_step(_options("grpo", "kl", {}))
    batch = step.batch.batch
    valid = batch["attention_mask"][:, MAX_PROMPT:].bool()
    observation = valid & ~batch["response_mask"].bool()
    assert observation.any(-1).sum() >= 10
    last = int(valid[ENDS_ON_OBSERVATION].sum()) - 1
    assert bool(observation[ENDS_ON_OBSERVATION, last])
    uids = step.batch.non_tensor_batch["uid"].tolist()
    assert all(uids[i] != uids[i + 1] for i in range(len(uids) - 1))  # no two members of a group adjacent
    for row, token, _ in BEYOND_CLAMP:
        assert abs(float(batch["ref_log_prob"][row, token] - batch["old_log_probs"][row, token])) > 20


@pytest.mark.parametrize("estimator, kl_penalty, options", CONFIGS)
def test_verls_reward_kl_and_advantages_replay_clean(tmp_path, estimator, kl_penalty, options):
    report = replay([_replayed(tmp_path, estimator, kl_penalty, options)])
    assert report.passed, report.render_text()
    assert [s.stage for s in report.stages] == [s.value for s in STAGES]


@pytest.mark.parametrize(
    "estimator, kl_penalty, options, override, stage",
    [
        ("grpo", "low_var_kl", {}, {"kl_in_score": False}, "reward.post_process"),
        ("rloo", "k3", {}, {"kl_coef": StepOptions().kl_coef * 1.1}, "reward.post_process"),
        ("reinforce_plus_plus", "kl", {"gamma": 0.9}, {"masked_return": "restart"}, "advantage.estimate"),
        ("reinforce_plus_plus", "kl", {"gamma": 0.9}, {"kl_clamped": None}, "advantage.kl"),
    ],
    ids=["kl-not-in-score", "unrecorded-kl-coefficient", "return-restarted", "k1-clamped"],
)
def test_the_other_choice_diverges_where_it_differs(tmp_path, estimator, kl_penalty, options, override, stage):
    source = _replayed(tmp_path, estimator, kl_penalty, options)
    report = replay([source], overrides=override)
    assert report.first_divergent_stage == stage, report.render_text()


def test_verls_kl_of_a_masked_out_token_is_not_compared(tmp_path):
    """verl forms only kld * response_mask: on observation tokens the recorded KL is 0 while the log-probs give
    another value, which is no divergence."""
    source = _replayed(tmp_path, "grpo", "low_var_kl", {})
    mask = source.load_payload("loss_mask").bool()
    ours = kernels.kl_estimate(
        source.load_payload("old_log_probs"),
        source.load_payload("ref_log_probs"),
        "low_var_kl",
        20.0,
        10.0,
        ("low_var_kl",),
    )
    assert (ours[~mask] != source.load_payload("kl")[~mask]).any()
    assert replay([source]).stage("advantage.kl").status == "pass"


_TYPES = {"kl": "k1", "mse": "k2", "abs": "abs", "k3": "k3", "low_var_kl": "low_var_kl"}


@pytest.mark.parametrize("kl_penalty", list(_TYPES))
def test_kl_estimates_match_verls_kl_penalty_with_the_verl_profiles_clamps(kl_penalty):
    """Every estimator over log ratios from -40 to 40: verl clamps only k3 and low_var_kl."""
    config = recompute_config(build_step(_options("grpo", kl_penalty, {})))
    log_probs = torch.linspace(-40.0, 0.0, 801)
    ref = torch.flip(log_probs, (0,))
    theirs = core_algos.kl_penalty(log_probs, ref, kl_penalty)
    ours = kernels.kl_estimate(
        log_probs,
        ref,
        config.kl_loss_type,
        config.kl_log_ratio_clamp,
        config.kl_output_clamp,
        config.kl_clamped,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
