"""The verl adapter (`trajectory_replay.integrations.verl`) on verl 0.9.1 itself: verl's own trainer config
translated, options no field expresses refused in one line naming the verl option, and batches built by verl's own
functions written as rollout-level bundles that replay clean, recording the verl that produced them."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl.protocol import pad_dataproto_to_divisor

from tests.integrations.verl.steps import MAX_PROMPT, PROMPTS, SAMPLES, StepOptions, build_step
from trajectory_replay.bundle import open_sources
from trajectory_replay.bundle.profiles import CONVENTION_FIELDS
from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.integrations.verl import recompute_config, rollout_bundle, write_rollout_bundle
from trajectory_replay.outcome import Status
from trajectory_replay.replay import replay
from trajectory_replay.replay.convention_search import find_conventions


@pytest.fixture(scope="module")
def trainer_config():
    """verl's own PPO trainer config as it ships, as an OmegaConf config."""
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return OmegaConf.load(path)


def _changed(config: Any, **paths: Any) -> dict[str, Any]:
    """A plain copy of `config` with `paths` ('algorithm__adv_estimator') set."""
    out = copy.deepcopy(OmegaConf.to_container(config, resolve=True) if not isinstance(config, dict) else config)
    for path, value in paths.items():
        *parents, last = path.split("__")
        node = out
        for part in parents:
            node = node[part]
        node[last] = value
    return out


def test_verls_default_config_is_the_profile_with_its_features_off(trainer_config):
    config = recompute_config(trainer_config)
    profile = RecomputeConfig.from_profile("verl")
    assert {f: getattr(config, f) for f in CONVENTION_FIELDS} == {f: getattr(profile, f) for f in CONVENTION_FIELDS}
    assert (config.advantage_estimator, config.n_samples_per_prompt, config.cliprange_value) == ("gae", 1, 0.5)
    # use_kl_in_reward and use_kl_loss are off: their coefficients (0.001 in the yaml) reach nothing
    assert (config.kl_in_reward, config.kl_coef, config.kl_loss_coef) == (False, 0.0, 0.0)
    assert (config.entropy_coef, config.eps_clip, config.eps_clip_high) == (0, 0.2, 0.2)
    assert config.framework_version == verl.__version__ and config.profile == "verl"


def test_changed_options_reach_their_fields(trainer_config):
    changed = _changed(
        trainer_config,
        algorithm__adv_estimator="grpo",
        algorithm__norm_adv_by_std_in_grpo=False,
        algorithm__use_kl_in_reward=True,
        algorithm__kl_penalty="k3",
        actor_rollout_ref__rollout__n=8,
        actor_rollout_ref__actor__use_kl_loss=True,
        actor_rollout_ref__actor__kl_loss_coef=0.02,
        actor_rollout_ref__actor__kl_loss_type="mse",
        actor_rollout_ref__actor__clip_ratio=0.3,
        actor_rollout_ref__actor__clip_ratio_low=None,
        actor_rollout_ref__actor__clip_ratio_high=0.4,
        actor_rollout_ref__actor__loss_agg_mode="seq-mean-token-sum-norm",
        actor_rollout_ref__actor__loss_scale_factor=512,
    )
    changed["algorithm"]["rollout_correction"].update(rollout_rs="token_k1", rollout_rs_threshold="0.9_1.2")
    config = recompute_config(changed)
    assert (config.advantage_estimator, config.grpo_std_normalization, config.n_samples_per_prompt) == (
        "grpo",
        False,
        8,
    )
    assert (config.kl_in_reward, config.kl_coef, config.kl_loss_type) == (True, 0.001, "k3")
    assert (config.kl_loss_coef, config.kl_loss_estimator) == (0.02, "k2")
    assert (config.eps_clip, config.eps_clip_high) == (0.3, 0.4)  # clip_ratio_low unset: clip_ratio
    assert (config.loss_agg_mode, config.loss_scale_factor) == ("seq_mean_token_sum_scaled", 512)
    assert config.rollout_rs == "token_k1" and config.rollout_rs_bounds is not None
    # an adaptive controller's coefficient is the step's, given by the caller
    changed["algorithm"]["kl_ctrl"]["type"] = "adaptive"
    assert recompute_config(changed, kl_coef=0.0123).kl_coef == 0.0123


@pytest.mark.parametrize(
    ("paths", "named"),
    [
        ({"actor_rollout_ref__actor__loss_agg_mode": "seq-max"}, "actor_rollout_ref.actor.loss_agg_mode"),
        ({"algorithm__adv_estimator": "opo"}, "algorithm.adv_estimator"),
        ({"algorithm__kl_penalty": "full"}, "algorithm.kl_penalty"),
        ({"actor_rollout_ref__actor__loss_scale_factor": "wide"}, "actor_rollout_ref.actor.loss_scale_factor"),
        ({"algorithm__rollout_correction__rollout_is_threshold": "a_b"}, "algorithm.rollout_correction"),
        ({"algorithm__rollout_correction__bypass_mode": True}, "algorithm.rollout_correction.bypass_mode"),
        ({"algorithm__use_pf_ppo": True}, "algorithm.use_pf_ppo"),
        ({"algorithm__use_kl_in_reward": True, "algorithm__kl_ctrl__type": "adaptive"}, "algorithm.kl_ctrl.type"),
    ],
)
def test_what_no_field_expresses_is_one_line_naming_the_verl_option(trainer_config, paths, named):
    with pytest.raises(ValueError) as raised:
        recompute_config(_changed(trainer_config, **paths))
    message = str(raised.value)
    assert "\n" not in message and f"verl option {named}" in message, message


def _verl_config(options: StepOptions) -> dict[str, Any]:
    """The trainer config a run of `options` has (only the keys the adapter reads)."""
    return {
        "algorithm": {
            "adv_estimator": options.adv_estimator,
            "norm_adv_by_std_in_grpo": options.norm_adv_by_std_in_grpo,
            "use_kl_in_reward": options.use_kl_in_reward,
            "kl_penalty": options.kl_penalty,
            "kl_ctrl": {"type": "fixed", "kl_coef": options.kl_coef},
            "gamma": options.gamma,
            "lam": options.lam,
        },
        "actor_rollout_ref": {
            "rollout": {"n": SAMPLES},
            "actor": {
                "clip_ratio_low": options.clip_ratio_low,
                "clip_ratio_high": options.clip_ratio_high,
                "loss_agg_mode": options.loss_agg_mode,
                "entropy_coeff": options.entropy_coeff,
                "use_kl_loss": options.use_kl_loss,
                "kl_loss_type": options.kl_loss_type,
                "kl_loss_coef": options.kl_loss_coef,
            },
        },
    }


ROLLOUTS = {
    "grpo": StepOptions(),
    "grpo kl in reward": StepOptions(use_kl_in_reward=True, kl_penalty="low_var_kl"),
    "rloo": StepOptions(adv_estimator="rloo", multi_turn=True),
    "reinforce++ multi-turn kl in reward": StepOptions(
        adv_estimator="reinforce_plus_plus", multi_turn=True, use_kl_in_reward=True, gamma=0.99
    ),
    "reinforce++ baseline": StepOptions(adv_estimator="reinforce_plus_plus_baseline"),
    "gae": StepOptions(adv_estimator="gae", use_kl_in_reward=True, multi_turn=True, gamma=0.99, lam=0.95),
}


@pytest.mark.parametrize("name", list(ROLLOUTS))
def test_a_verl_batch_written_by_the_adapter_replays_clean(name: str, tmp_path: Path) -> None:
    options = ROLLOUTS[name]
    step = build_step(options)
    url = write_rollout_bundle(step.batch, recompute_config(_verl_config(options)), tmp_path, 3)
    report = replay(open_sources(url))
    assert report.status is Status.PASS, report.render_text()
    compared = {s.stage for s in report.stages if s.status == "pass" and s.compared > 0}
    assert {"reward.raw", "reward.post_process", "advantage.estimate"} <= compared
    assert ("advantage.kl" in compared) == options.use_kl_in_reward


def test_the_bundle_records_the_verl_that_produced_it_and_conventions_names_it(tmp_path: Path) -> None:
    options = StepOptions(norm_adv_by_std_in_grpo=False)  # a run's own option stays as recorded
    step = build_step(options)
    (source,) = open_sources(write_rollout_bundle(step.batch, recompute_config(_verl_config(options)), tmp_path, 1))
    producer = source.manifest.producer
    assert (producer.framework, producer.framework_version) == ("verl", verl.__version__)
    assert source.manifest.conventions is not None and source.manifest.conventions.profile == "verl"
    found = find_conventions([source])
    assert found.profile == "verl" and "recorded config (profile verl): reproduces every stage" in found.render_text()
    # trying the profile keeps the run's own norm_adv_by_std_in_grpo=False, so it reproduces the step too
    (tried,) = [c for c in found.candidates if c.name == "profile verl"]
    assert tried.reproduces_all, found.render_text()


def test_padding_rows_are_dropped_and_sample_ids_are_stable(tmp_path: Path) -> None:
    step = build_step(StepOptions(multi_turn=True))
    padded, pad_size = pad_dataproto_to_divisor(step.batch, PROMPTS * SAMPLES + 6)
    assert pad_size == 6
    config = recompute_config(_verl_config(step.options))
    bundle = rollout_bundle(padded, config, 2, pad_size=pad_size)
    assert len(bundle.samples) == PROMPTS * SAMPLES
    uids = step.batch.non_tensor_batch["uid"].tolist()
    assert [r.sample_id for r in bundle.samples] == [f"{u}-{i % SAMPLES}" for i, u in enumerate(uids)]
    assert len({r.group_index for r in bundle.samples}) == PROMPTS
    valid = step.batch.batch["attention_mask"][:, MAX_PROMPT:].bool()
    assert torch.equal(bundle.payloads["old_log_probs"], step.batch.batch["old_log_probs"][valid])
    # ids the batch carries win over uid positions
    step.batch.non_tensor_batch["sample_id"] = step.batch.non_tensor_batch["uid"].copy()
    step.batch.non_tensor_batch["sample_id"][:] = [f"s{i:03d}" for i in range(PROMPTS * SAMPLES)]
    ids = [r.sample_id for r in rollout_bundle(step.batch, config, 2).samples]
    assert ids == [f"s{i:03d}" for i in range(PROMPTS * SAMPLES)]
    assert replay(open_sources(bundle.write(tmp_path))).status is Status.PASS


NEAR_TIE_SEEDS = range(32)


def test_near_tied_groups_with_the_kl_in_the_score_replay_clean_over_many_seeds(tmp_path: Path) -> None:
    """grpo with use_kl_in_reward: a group whose scores differ only by their KL penalties has a std of a few 1e-3,
    which the normalization divides verl's float32 rounding of each score by. Replay sums the token rewards as verl
    does (float32, along zero-padded rows), so such groups replay clean at default tolerances; a float64 sum would
    not match verl's bits."""
    options = StepOptions(use_kl_in_reward=True, kl_penalty="low_var_kl")
    near_ties, rounded_apart = 0, 0
    for seed in NEAR_TIE_SEEDS:
        step = build_step(replace(options, seed=seed))
        rewards = step.batch.batch["token_level_rewards"]
        scores = rewards.sum(-1)
        near_ties += int((scores.view(PROMPTS, SAMPLES).std(-1) < 0.005).sum())
        rounded_apart += int((rewards.double().sum(-1).float() != scores).sum())
        url = write_rollout_bundle(step.batch, recompute_config(_verl_config(step.options)), tmp_path, seed)
        report = replay(open_sources(url))
        assert report.status is Status.PASS, (seed, report.first_divergence)
    assert near_ties >= 10 and rounded_apart > 0, (near_ties, rounded_apart)
