"""The `trl` profile against the TRL that is installed: its version, GRPOConfig's own defaults given as options, the
options it translates and the ones it refuses by name."""

from __future__ import annotations

import dataclasses

import pytest
import trl
from trl import GRPOConfig

from trajectory_replay.bundle.profiles import CONVENTION_FIELDS, NEWEST, PROFILES, installed_version, recorded_profile
from trajectory_replay.bundle.schema import ConventionsRecord, RecomputeConfig


def _defaults() -> dict:
    """GRPOConfig's declared defaults of the options the profile translates (no GRPOConfig is built: its
    __post_init__ needs a device)."""
    options = PROFILES["trl"].options
    return {
        f.name: f.default
        for f in dataclasses.fields(GRPOConfig)
        if f.name in options and f.default is not dataclasses.MISSING
    }


def test_the_newest_trl_profile_models_the_installed_release():
    assert installed_version("trl") == trl.__version__
    assert NEWEST["trl"] == "trl-1.16"
    assert trl.__version__.split(".")[:2] == PROFILES["trl"].framework_version.split(".")[:2] == ["1", "16"]
    config = RecomputeConfig.from_profile("trl", framework_version=installed_version("trl"))
    assert config.framework_version == trl.__version__
    assert ConventionsRecord.of_profile("trl").framework_version == "1.16.0"


def test_a_bundle_that_recorded_the_older_trl_profile_still_means_it():
    assert recorded_profile("trl", "1.10.0.dev0 (f2cd5771)") == "trl-1.10"
    assert recorded_profile("trl", "1.16.0") == "trl"
    assert PROFILES["trl-1.10"].settings == {
        "grpo_std_normalization": True,
        "std_eps": 1e-4,
        "loss_agg_mode": "token_mean",
    }


def test_grpo_configs_own_defaults_given_as_options_are_the_profile():
    defaults = _defaults()
    assert {"loss_type", "beta", "epsilon", "epsilon_high", "scale_rewards", "use_bias_correction_kl"} <= set(defaults)
    config, profile = RecomputeConfig.from_profile("trl", **defaults), RecomputeConfig.from_profile("trl")
    assert {f: getattr(config, f) for f in CONVENTION_FIELDS} == {f: getattr(profile, f) for f in CONVENTION_FIELDS}
    assert (config.loss_agg_mode, config.policy_loss, config.kl_loss_ratio_weighted) == ("token_mean", "ppo_clip", True)
    assert (config.eps_clip, config.eps_clip_high, config.eps_clip_c, config.kl_loss_coef) == (0.2, 0.2, None, 0.0)
    assert (config.grpo_std_normalization, config.std_scope, config.std_eps, config.nan_rewards) == (
        True,
        "group",
        1e-4,
        "exclude",
    )
    assert (config.entropy_agg, config.cispo_clip, config.loss_terms_reported) == (
        "micro_batch_token_mean",
        "cap",
        False,
    )


@pytest.mark.parametrize(
    "options, fields",
    [
        ({"epsilon": 0.3}, {"eps_clip": 0.3, "eps_clip_high": 0.3}),  # epsilon_high None: epsilon's value
        ({"epsilon_high": 0.28, "epsilon": 0.1}, {"eps_clip": 0.1, "eps_clip_high": 0.28}),
        ({"epsilon": 0.1, "epsilon_high": None}, {"eps_clip": 0.1, "eps_clip_high": 0.1}),
        (
            {"loss_type": "cispo", "epsilon_high": 5.0},
            {"policy_loss": "cispo", "eps_clip_high": 5.0, "cispo_clip": "cap"},
        ),
        ({"loss_type": "grpo"}, {"loss_agg_mode": "seq_mean_token_mean", "policy_loss": "ppo_clip"}),
        ({"loss_type": "dr_grpo"}, {"loss_agg_mode": "seq_mean_token_sum_norm"}),
        ({"loss_type": "bnpo"}, {"loss_agg_mode": "token_mean"}),
        ({"scale_rewards": "batch"}, {"grpo_std_normalization": True, "std_scope": "batch"}),
        ({"scale_rewards": True}, {"grpo_std_normalization": True, "std_scope": "group"}),
        ({"scale_rewards": False}, {"grpo_std_normalization": False}),
        ({"scale_rewards": "none"}, {"grpo_std_normalization": False}),
        ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, {"policy_loss": "gspo"}),
        ({"delta": 1.5}, {"eps_clip_c": 1.5}),
        ({"beta": 0.04, "use_bias_correction_kl": False}, {"kl_loss_coef": 0.04, "kl_loss_ratio_weighted": False}),
        ({"num_generations": 8, "entropy_coef": 0.01}, {"n_samples_per_prompt": 8, "entropy_coef": 0.01}),
        ({"mask_truncated_completions": True, "num_iterations": 2}, {}),
        ({"use_vllm": True, "vllm_importance_sampling_correction": False}, {"policy_loss": "ppo_clip"}),
    ],
)
def test_trl_options_translate_to_fields(options, fields):
    config = RecomputeConfig.from_profile("trl", **options)
    assert {f: getattr(config, f) for f in fields} == fields
    assert config.profile == "trl"


@pytest.mark.parametrize(
    "options, named",
    [
        ({"loss_type": "sapo"}, "TRL option loss_type='sapo' (profile trl)"),
        ({"loss_type": "vespo"}, "TRL option loss_type='vespo'"),
        ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "TRL option loss_type='luspo'"),
        ({"scale_rewards": "prompt"}, "TRL option scale_rewards='prompt'"),
        ({"top_entropy_quantile": 0.2}, "TRL option top_entropy_quantile=0.2"),
        ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, "TRL option importance_sampling_level"),
        ({"use_vllm": True}, "TRL option use_vllm=True"),
        ({"use_adaptive_entropy": True}, "TRL option use_adaptive_entropy=True"),
        ({"off_policy_mask_threshold": 0.5}, "TRL option off_policy_mask_threshold=0.5"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "TRL option multi_objective_aggregation"),
        ({"use_bias_correction_kl": "yes"}, "TRL option use_bias_correction_kl='yes'"),
        ({"beta": "a lot"}, "TRL option beta='a lot'"),
        ({"delta": 1.2, "epsilon": 0.2}, "TRL option delta=1.2"),
        ({"delta": 1.5, "epsilon_high": 0.6}, "TRL option delta=1.5"),
    ],
)
def test_what_no_field_expresses_is_refused_in_one_line_naming_the_trl_option(options, named):
    with pytest.raises(ValueError) as info:
        RecomputeConfig.from_profile("trl", **options)
    message = str(info.value)
    assert message.startswith(named) and "\n" not in message
