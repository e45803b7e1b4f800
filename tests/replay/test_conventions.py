"""Convention profiles, and the search that names the convention production followed."""

from __future__ import annotations

import pytest

from tests.replay.conftest import MemorySource
from tests.replay.reference64 import algorithm_case
from trajectory_replay.bundle.profiles import PROFILES
from trajectory_replay.bundle.schema import BundleIndex, ConventionsRecord, RecomputeConfig
from trajectory_replay.errors import UsageError
from trajectory_replay.replay.convention_search import find_conventions
from trajectory_replay.replay.runner import replay


def _recorded_as(case, recorded: dict) -> MemorySource:
    """The bundle of `case` (expected values from production's config) recording `recorded` as its config."""
    manifest, index, expected, payloads = case
    recorded = {"n_samples_per_prompt": index.config.n_samples_per_prompt, **recorded}
    index = BundleIndex.model_validate({**index.model_dump(), "config": recorded})
    return MemorySource(manifest, index, expected, payloads)


BASE = {"advantage_estimator": "grpo", "grpo_std_normalization": True, "kl_coef": 0.05, "entropy_coef": 0.01}


def test_from_profile_maps_the_frameworks_names_and_remembers_the_profile():
    config = RecomputeConfig.from_profile(
        "verl",
        norm_adv_by_std_in_grpo=False,
        loss_agg_mode="seq-mean-token-mean",
        clip_ratio=0.3,
        kl_loss_type="mse",
        kl_coef=0.001,
    )
    assert (config.grpo_std_normalization, config.loss_agg_mode, config.eps_clip, config.eps_clip_high) == (
        False,
        "seq_mean_token_mean",
        0.3,
        0.3,
    )
    assert config.kl_loss_estimator == "k2" and config.kl_loss_type == "k1"  # verl's kl_loss_type is the loss's
    assert (config.singleton_group, config.mask_advantages, config.eps_clip_c, config.kl_coef) == (
        "unit",
        True,
        3.0,
        0.001,
    )
    assert config.profile == "verl" and RecomputeConfig().profile is None
    trl = RecomputeConfig.from_profile("trl", loss_type="grpo", beta=0.04, scale_rewards="none")
    assert (trl.loss_agg_mode, trl.kl_loss_coef, trl.grpo_std_normalization, trl.std_eps) == (
        "seq_mean_token_mean",
        0.04,
        False,
        1e-4,
    )


def test_from_profile_refuses_unknown_profiles_and_options_by_name():
    with pytest.raises(ValueError, match="unknown convention profile 'veryl': profiles are relax, verl"):
        RecomputeConfig.from_profile("veryl")
    with pytest.raises(ValueError, match="'clip_ratio' is neither a recompute config field nor a TRL option"):
        RecomputeConfig.from_profile("trl", clip_ratio=0.3)


def test_relax_is_the_default_config_and_every_profile_is_replayable():
    assert RecomputeConfig.from_profile("relax").model_dump() == RecomputeConfig().model_dump()
    for name in PROFILES:
        case = algorithm_case({**BASE, **PROFILES[name].settings, "n_samples_per_prompt": 4})
        source = MemorySource(*case)
        assert replay([source]).passed, name


def test_with_conventions_of_a_profile_changes_conventions_and_keeps_the_runs_hyperparameters():
    recorded = RecomputeConfig(
        kl_coef=0.3, eps_clip=0.1, n_samples_per_prompt=8, loss_agg_mode="token_mean", loss_denominator=512
    )
    applied = recorded.with_conventions_of("trl")
    assert (applied.kl_coef, applied.eps_clip, applied.n_samples_per_prompt, applied.loss_denominator) == (
        0.3,
        0.1,
        8,
        512,
    )
    assert (applied.std_eps, applied.grpo_std_normalization) == (1e-4, True)
    assert applied.with_conventions_of("relax").loss_agg_mode == "sum_of_sample_means"


@pytest.mark.parametrize(
    "production, named",
    [
        ({"std_unbiased": False}, "std_unbiased=False"),
        ({"std_eps": 1e-4}, "std_eps=0.0001"),
    ],
)
def test_search_names_the_single_field_production_used(production, named):
    source = _recorded_as(algorithm_case({**BASE, **production}, seed=3), BASE)
    found = find_conventions([source])
    assert found.candidates[0].stages["reward.post_process"] == "fail"
    assert found.best is not None and found.best.name == named
    assert found.reproducing("reward.post_process")[0] == named


def test_search_solves_a_global_token_denominator():
    production = {**BASE, "loss_agg_mode": "token_mean", "loss_denominator": 96.0}
    source = _recorded_as(algorithm_case(production, seed=5), {**BASE, "loss_agg_mode": "token_mean"})
    found = find_conventions([source])
    assert found.best is not None and found.best.changes == {"loss_denominator": 96.0}
    assert "loss_denominator=96.0" in found.render_text()


def test_search_names_the_profile_of_a_bundle_built_with_verl_defaults():
    verl = RecomputeConfig.from_profile("verl", kl_coef=0.05, entropy_coef=0.01, n_samples_per_prompt=4)
    source = _recorded_as(
        algorithm_case(verl.model_dump(), seed=7, singleton=True),
        {**BASE, "n_samples_per_prompt": 4, "group_size_check": "any"},
    )
    found = find_conventions([source])
    assert found.best is not None and found.best.name == "profile verl"
    everything = [c.name for c in found.candidates if c.reproduces_all]
    assert everything == ["profile verl"]
    as_dict = found.to_dict()
    assert as_dict["best"] == "profile verl" and as_dict["reproduced_by"]["loss.policy"][-1] == "profile verl"


def test_a_bug_that_is_no_convention_is_reproduced_by_no_candidate():
    from trajectory_replay.replay.fixtures import canonical_case

    found = find_conventions([MemorySource(*canonical_case(buggy=True))])
    assert found.best is None and found.reproducing("reward.post_process") == []
    assert "every stage reproduced by: no candidate" in found.render_text()


def test_the_search_reads_each_payload_once():
    source = _recorded_as(algorithm_case({**BASE, "std_eps": 1e-4}, seed=3), BASE)
    find_conventions([source])
    names = [name for name, _ in source.loads]
    assert len(names) == len(set(names))


def test_verl_profiles_are_versioned_and_the_bare_name_is_the_newest():
    from trajectory_replay.bundle.profiles import NEWEST

    newest, pinned, older = PROFILES["verl"], PROFILES["verl-0.9"], PROFILES["verl-0.8"]
    assert NEWEST["verl"] == "verl-0.9"
    assert (newest.settings, newest.options, newest.framework_version) == (
        pinned.settings,
        pinned.options,
        pinned.framework_version,
    )
    assert pinned.framework_version == "0.9.1" and older.framework_version == "0.8.0.dev (b178a3cd)"
    assert {p.framework for p in (newest, pinned, older)} == {"verl"}
    # 0.8's rollout correction (a ratio window with its lower bound) is its own
    config = RecomputeConfig.from_profile("verl-0.8", rollout_rs="sequence", rollout_rs_threshold_lower=0.8)
    assert (config.rollout_rs, config.rollout_rs_lower, config.profile) == ("sequence", 0.8, "verl-0.8")
    with pytest.raises(ValueError, match="'rollout_rs_threshold_lower' is neither"):
        RecomputeConfig.from_profile("verl", rollout_rs_threshold_lower=0.8)


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("rollout_rs_threshold", "0.9_1.1", "expected a number"),
        ("rollout_is_threshold", "wide_5.0", "expected a number"),
        ("rollout_is", "geometric", "known values: null, token, sequence"),
        ("loss_agg_mode", "token-max", "known values: token-mean"),
        ("adv_estimator", "gpg", "known values: gae, grpo"),
        ("kl_loss_type", "full", "known values: kl, k1"),
        ("loss_mode", "sapo", "known values: vanilla, gspo, cispo"),
        ("clip_ratio", "wide", "expected a number"),
        ("rollout_is_batch_normalize", True, "replayable only as False"),
        ("norm_adv_by_std_in_grpo", "sometimes", "field grpo_std_normalization refuses it"),
    ],
)
def test_a_verl_option_value_no_field_expresses_is_one_line_naming_the_option(option, value, says):
    with pytest.raises(ValueError) as raised:
        RecomputeConfig.from_profile("verl", **{option: value})
    message = str(raised.value)
    assert message.startswith(f"verl option {option}={value!r} (profile verl): "), message
    assert says in message and "\n" not in message and "pydantic" not in message


def test_a_config_field_value_its_type_refuses_is_one_line_naming_the_field():
    with pytest.raises(ValueError) as raised:
        RecomputeConfig.from_profile("verl", std_eps="tiny")
    message = str(raised.value)
    assert message.startswith("config field std_eps='tiny': field std_eps refuses it (") and "\n" not in message


def test_verl_0_9_translates_the_values_it_knows():
    config = RecomputeConfig.from_profile(
        "verl",
        adv_estimator="grpo",
        loss_agg_mode="seq-mean-token-mean",
        kl_loss_type="k3+",
        kl_penalty="kl",
        loss_mode="vanilla",
        rollout_is="token",
        rollout_is_threshold="2.5",
        rollout_rs=None,
        rollout_rs_threshold=None,
        clip_ratio=0.28,
        bypass_mode=False,
    )
    assert (config.advantage_estimator, config.loss_agg_mode, config.kl_loss_estimator, config.kl_loss_type) == (
        "grpo",
        "seq_mean_token_mean",
        "k3",
        "k1",
    )
    assert (config.policy_loss, config.rollout_is, config.rollout_is_threshold, config.rollout_rs) == (
        "ppo_clip",
        "token",
        2.5,
        "none",
    )
    assert (config.eps_clip, config.eps_clip_high) == (0.28, 0.28)


def test_a_recorded_profile_is_resolved_by_the_version_it_modelled():
    from trajectory_replay.bundle.schema import ConventionsRecord

    assert ConventionsRecord.of_profile("verl").resolved() == "verl"
    assert ConventionsRecord.of_profile("verl-0.8").resolved() == "verl-0.8"
    # written when `verl` modelled the 0.8 commit
    old = ConventionsRecord(profile="verl", framework="verl", framework_version="0.8.0.dev (b178a3cd)")
    assert old.resolved() == "verl-0.8"
    assert ConventionsRecord(profile="verl", framework_version="0.7.0").resolved() == "verl"
    assert ConventionsRecord(profile="megatron").resolved() is None


def _with_record(case, profile: str) -> MemorySource:
    """The bundle of `case`, its manifest recording that its config was built from `profile`."""
    from trajectory_replay.bundle.schema import ConventionsRecord

    manifest, index, expected, payloads = case
    manifest = manifest.model_copy(update={"conventions": ConventionsRecord.of_profile(profile)})
    return MemorySource(manifest, index, expected, payloads)


def test_a_verl_option_the_run_changed_stays_as_recorded_when_the_profile_is_tried():
    verl = RecomputeConfig.from_profile(
        "verl",
        norm_adv_by_std_in_grpo=False,
        kl_loss_type="mse",
        kl_loss_coef=0.02,
        kl_coef=0.05,
        entropy_coef=0.01,
        n_samples_per_prompt=4,
    )
    assert verl.set_by_run("verl") == ["grpo_std_normalization", "kl_loss_estimator"]
    found = find_conventions([_with_record(algorithm_case(verl.model_dump(), seed=11, singleton=True), "verl")])
    tried = {c.name: c for c in found.candidates}
    assert tried["profile verl"].changes == {} and tried["profile verl"].reproduces_all
    assert "grpo_std_normalization" not in tried["profile nemo_rl"].changes
    assert found.profile == "verl" and found.to_dict()["profile"] == "verl"
    assert found.render_text().split("\n")[1] == "recorded config (profile verl): reproduces every stage"
    assert "profile verl-0.9" not in tried and "profile verl-0.8" not in tried  # the same config as `verl`


def test_the_recorded_profile_is_named_before_a_profile_that_changes_fewer_fields():
    from trajectory_replay.replay.convention_search import Candidate, ConventionsReport

    passing = {"reward.post_process": "pass", "loss.policy": "pass"}
    candidates = (
        Candidate("recorded", "recorded", {}, {"reward.post_process": "fail", "loss.policy": "pass"}, compared=4),
        Candidate("profile nemo_rl", "profile", {"mask_advantages": False}, passing, compared=4),
        Candidate("profile verl", "profile", {"mask_advantages": True, "std_eps": 1e-6}, passing, compared=4),
    )
    assert ConventionsReport("b", candidates).best.name == "profile nemo_rl"
    recorded = ConventionsReport("b", candidates, profile="verl")
    assert recorded.best.name == "profile verl"
    assert recorded.reproducing("reward.post_process") == ["profile verl", "profile nemo_rl"]


def _trl_bundle(production: dict, recorded: dict, seed: int = 13) -> MemorySource:
    """A bundle whose values are those of TRL run with `production` (its option names), recording the config TRL
    run with `recorded` would have, and the trl profile in its manifest."""
    built = RecomputeConfig.from_profile("trl", num_generations=4, beta=0.04, **production)
    manifest, index, expected, payloads = algorithm_case(built.model_dump(), seed=seed)
    config = RecomputeConfig.from_profile("trl", num_generations=4, beta=0.04, **recorded)
    index = BundleIndex.model_validate({**index.model_dump(), "config": config.model_dump()})
    manifest = manifest.model_copy(update={"conventions": ConventionsRecord.of_profile("trl")})
    return MemorySource(manifest, index, expected, payloads)


def test_replay_set_takes_the_frameworks_option_names_on_a_bundle_built_from_its_profile():
    source = _trl_bundle({"loss_type": "grpo"}, {})
    assert replay([source]).first_divergent_stage == "loss.policy"
    report = replay([source], overrides={"loss_type": "grpo"})
    assert report.passed and report.overrides == {"loss_agg_mode": "seq_mean_token_mean", "policy_loss": "ppo_clip"}
    assert replay([source], overrides={"loss_agg_mode": "seq_mean_token_mean"}).passed  # a field keeps its name
    with pytest.raises(UsageError) as info:
        replay([source], overrides={"loss_type": "sapo"})
    assert str(info.value).startswith("TRL option loss_type='sapo' (profile trl)") and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="'clip_ratio' is neither a recompute config field nor a TRL option"):
        replay([source], overrides={"clip_ratio": 0.3})


def test_replay_set_takes_only_field_names_on_a_bundle_that_records_no_profile():
    source = _recorded_as(algorithm_case(BASE, seed=3), BASE)
    with pytest.raises(UsageError, match="unknown config field 'loss_type'"):
        replay([source], overrides={"loss_type": "grpo"})


@pytest.mark.parametrize(
    "production, named",
    [
        ({"loss_type": "grpo"}, "loss_type=grpo"),
        ({"scale_rewards": "batch"}, "scale_rewards=batch"),
        ({"use_bias_correction_kl": False}, "use_bias_correction_kl=False"),
    ],
)
def test_conventions_names_the_trl_setting_before_an_equivalent_rewrite(production, named):
    found = find_conventions([_trl_bundle(production, {})])
    assert found.profile == "trl"
    assert found.best is not None and found.best.name == named and found.best.kind == "option"
    rewrites = [c for c in found.candidates if c.reproduces_all and c.kind in ("variant", "inferred")]
    ordered = [c["name"] for c in found.to_dict()["candidates"]]
    assert all(ordered.index(named) < ordered.index(c.name) for c in rewrites)
