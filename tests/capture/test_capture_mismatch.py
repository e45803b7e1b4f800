"""Capture of the training-inference mismatch: the engine's log-probs, each sample's policy version and
production's mismatch metrics contract rollout.mismatch; the bundles replay, and a stale sample is caught."""

from __future__ import annotations

import pytest
import torch

from tests.capture.helpers import CONFIG, OLD, TOKENS, loss_scalars, microbatch_kwargs, rollout_kwargs
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.schema import StageId
from trajectory_replay.capture.hooks import slime_rollout_arguments
from trajectory_replay.replay import replay

N_TOKENS = 4 * TOKENS
ENGINE = OLD - 0.125  # the engine's log-prob of every token: d = 0.125 everywhere
WRITER = "thread"


def _rollout(config, **extra) -> dict:
    return {**rollout_kwargs(), "config": config, "rollout_log_probs": torch.full((N_TOKENS,), ENGINE), **extra}


def test_rollout_bundle_with_engine_log_probs_and_versions_replays(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    config = CONFIG.model_copy(update={"actor_version": 7, "max_staleness": 1})
    metrics = {"kl_k1": -0.125, "log_ratio_max_abs": torch.tensor(0.125), "staleness_max": 1}
    assert manager.capture_rollout(3, **_rollout(config, policy_versions=[7, 6, 6, 7], mismatch_metrics=metrics))
    assert manager.flush(30)
    (source,) = open_native(str(tmp_path / "rollout-3"))
    assert StageId.ROLLOUT_MISMATCH in source.manifest.stage_contracts
    assert [r.policy_version for r in source.index.samples] == [7, 6, 6, 7]
    assert source.expected["rollout.mismatch"] == {"kl_k1": -0.125, "log_ratio_max_abs": 0.125, "staleness_max": 1.0}
    report = replay([source])
    assert report.passed, report.render_text()
    assert report.stage("rollout.mismatch").metrics["kl_k1"] == pytest.approx(-0.125)


def test_a_sample_from_a_future_policy_is_caught_at_rollout_mismatch(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    config = CONFIG.model_copy(update={"actor_version": 7})
    assert manager.capture_rollout(4, **_rollout(config, policy_versions=[7, 8, 7, 7]))
    assert manager.flush(30)
    report = replay(open_native(str(tmp_path / "rollout-4")))
    assert report.first_divergent_stage == "rollout.mismatch"
    assert report.stage("rollout.mismatch").divergences[0].sample_id == "s-1"


def test_without_engine_log_probs_or_versions_nothing_changes(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_rollout(5, **rollout_kwargs())
    assert manager.flush(30)
    (source,) = open_native(str(tmp_path / "rollout-5"))
    assert StageId.ROLLOUT_MISMATCH not in source.manifest.stage_contracts
    assert "rollout.mismatch" not in source.expected


def test_unknown_mismatch_metric_is_a_counted_hook_error_not_a_bundle(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_rollout(6, **_rollout(CONFIG, mismatch_metrics={"kl": 0.1})) is False
    assert manager.flush(30)
    assert manager.stats()["errors"] == 1 and not (tmp_path / "rollout-6").exists()


def test_step_bundle_with_a_token_correction_replays(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    config = CONFIG.model_copy(update={"rollout_is": "token", "rollout_is_threshold": 2.0})
    kwargs = {**microbatch_kwargs(range(4)), "rollout_log_probs": torch.full((N_TOKENS,), ENGINE)}
    assert manager.capture_microbatch(1, 0, "mb-0000", **kwargs)
    scalars = loss_scalars(range(4))
    weight = float(torch.exp(torch.tensor(0.125)))
    scalars = {
        **scalars,
        "pg_loss": scalars["pg_loss"] * weight,
        "loss": scalars["loss"] + scalars["pg_loss"] * (weight - 1),
    }  # every token's pg times e^0.125
    assert manager.capture_step_end(1, 0, config=config, **scalars)
    assert manager.flush(30)
    (source,) = open_native(str(tmp_path / "step-1-0"))
    assert "rollout_log_probs" in source.manifest.payloads
    assert StageId.ROLLOUT_MISMATCH in source.manifest.stage_contracts
    report = replay([source])
    assert report.passed, report.render_text()


def test_the_slime_layout_maps_the_engine_log_probs_beside_the_trainers():
    data = {
        "response_lengths": [2],
        "total_lengths": [4],
        "loss_masks": [[1, 1]],
        "raw_reward": [1.0],
        "rewards": [1.0],
        "advantages": [torch.ones(2)],
        "group_index": [0],
        "kl": [torch.zeros(2)],
        "log_probs": [torch.zeros(2)],
        "rollout_log_probs": [torch.full((2,), -0.1)],
        "policy_versions": [3],
    }
    args = slime_rollout_arguments(1, data)
    assert args["old_log_probs"] is data["log_probs"] and args["rollout_log_probs"] is data["rollout_log_probs"]
    assert args["policy_versions"] == [3]
    only_engine = {k: v for k, v in data.items() if k != "log_probs"}
    args = slime_rollout_arguments(1, only_engine)
    assert args["old_log_probs"] is data["rollout_log_probs"] and args["rollout_log_probs"] is None
