"""The `verl` profile against the verl that is installed: its version, its own defaults given as options, and the
KL clamps of its estimators."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos

from trajectory_replay.bundle.profiles import CONVENTION_FIELDS, NEWEST, PROFILES, installed_version
from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.replay.kernels import kl_estimate


@pytest.fixture(scope="module")
def trainer_defaults():
    """verl's own trainer config as it ships (the generated PPO trainer config, interpolations resolved)."""
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def test_the_newest_verl_profile_models_the_installed_release():
    assert installed_version("verl") == verl.__version__
    modelled = PROFILES[NEWEST["verl"]].framework_version
    assert verl.__version__.split(".")[:2] == modelled.split(".")[:2] == ["0", "9"]


def test_verls_own_defaults_given_as_options_are_the_profile(trainer_defaults):
    algorithm = trainer_defaults["algorithm"]
    actor = trainer_defaults["actor_rollout_ref"]["actor"]
    correction = algorithm["rollout_correction"]
    options = {
        "adv_estimator": algorithm["adv_estimator"],
        "norm_adv_by_std_in_grpo": algorithm["norm_adv_by_std_in_grpo"],
        "gamma": algorithm["gamma"],
        "lam": algorithm["lam"],
        "use_kl_in_reward": algorithm["use_kl_in_reward"],
        "kl_penalty": algorithm["kl_penalty"],
        "clip_ratio_low": actor["clip_ratio_low"],
        "clip_ratio_high": actor["clip_ratio_high"],
        "clip_ratio_c": actor["clip_ratio_c"],
        "loss_agg_mode": actor["loss_agg_mode"],
        "entropy_coeff": actor["entropy_coeff"],
        "kl_loss_type": actor["kl_loss_type"],
        "loss_mode": actor["policy_loss"]["loss_mode"],
        "cliprange_value": trainer_defaults["critic"]["cliprange_value"],
        **{k: correction[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")},
        **{k: correction[k] for k in ("rollout_is_batch_normalize", "bypass_mode")},
    }
    config, profile = RecomputeConfig.from_profile("verl", **options), RecomputeConfig.from_profile("verl")
    assert {f: getattr(config, f) for f in CONVENTION_FIELDS} == {f: getattr(profile, f) for f in CONVENTION_FIELDS}
    assert (config.advantage_estimator, config.rollout_is, config.rollout_rs, config.cliprange_value) == (
        "gae",
        "none",
        "none",
        0.5,
    )


@pytest.mark.parametrize("estimator", ["low_var_kl", "k3"])
def test_the_profiles_kl_clamps_are_verls(estimator):
    log_probs = torch.tensor([0.0, 0.0, -1.0, -0.5, 0.0])
    ref_log_probs = torch.tensor([30.0, -30.0, -1.2, -0.1, -15.0])
    profile = RecomputeConfig.from_profile("verl", kl_loss_type=estimator)
    ours = kl_estimate(
        log_probs, ref_log_probs, profile.kl_loss_estimator, profile.kl_log_ratio_clamp, profile.kl_output_clamp
    )
    theirs = core_algos.kl_penalty(log_probs, ref_log_probs, estimator)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0.0)  # the same up to the order of operations
    assert float(theirs.abs().max()) == 10.0  # the clamp was reached
