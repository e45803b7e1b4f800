"""Real TRL 1.16 GRPOTrainer runs (CPU, offline, a tiny random-weight Qwen2) captured through `enable_capture` and
replayed: each setting TRL ships replays clean, and bugs injected into TRL's own computation are named at their
first stage and sample. One trainer run per setting (module-scoped), every assertion on it in one test."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trl

from tests.integrations.trl import tiny
from trajectory_replay.bundle.resolve import open_for_replay
from trajectory_replay.integrations.trl import ROWS_KEY, TrlInternals, enable_capture
from trajectory_replay.replay import replay
from trajectory_replay.replay.chain import replay_chain

OFF_POLICY = {"num_iterations": 2}
"""A second iteration on the same generation batch: the ratio moves off 1, so clipping and the KL's importance
weight show."""

CLEAN: dict[str, dict[str, Any]] = {
    "defaults (dapo)": {},
    "bnpo": {"loss_type": "bnpo"},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.1, **OFF_POLICY},
    "beta 0.1, use_bias_correction_kl (default)": {"beta": 0.1, **OFF_POLICY},
    "beta 0.1, use_bias_correction_kl=False": {"beta": 0.1, "use_bias_correction_kl": False, **OFF_POLICY},
    "epsilon alone": {"epsilon": 0.05, **OFF_POLICY},
    "scale_rewards=none": {"scale_rewards": "none"},
    "scale_rewards=batch": {"scale_rewards": "batch"},
    "a reward of None": {"reward_funcs": tiny.reward_or_none},
    **{
        f"entropy bonus, {loss}": {"loss_type": loss, "entropy_coef": 0.01}
        for loss in ("dapo", "bnpo", "grpo", "dr_grpo", "cispo")
    },
    "gradient_accumulation_steps=2": {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
    "num_iterations=2": OFF_POLICY,
    "GSPO": {"importance_sampling_level": "sequence", "loss_type": "grpo", **OFF_POLICY},
    "mask_truncated_completions": {"mask_truncated_completions": True},
}
"""The settings that must replay clean, as GRPOConfig options (plus the reward function)."""


def _run(tmp: Path, before: Callable[[Any], None] | None = None, **options: Any) -> str:
    store = str(tmp / "store")
    tiny.run(store, str(tmp / "out"), before=before, **options)
    return store


def _bundles(store: str) -> list[str]:
    return sorted(p.name for p in Path(store).iterdir() if p.name.startswith(("rollout-", "step-")))


def _chain(store: str, step: str) -> Any:
    sources, _ = open_for_replay(store, step=step)

    def open_rollout(rollout_id: int) -> Any:
        return open_for_replay(store, rollout=rollout_id)[0]

    return replay_chain(sources, open_rollout, replay_step=lambda s: replay(s))


def _failures(report: Any) -> list[tuple[str, str]]:
    return [(s.stage, s.message) for s in report.stages if s.status != "pass"]


@pytest.fixture(scope="module", params=list(CLEAN), ids=list(CLEAN))
def clean_run(request, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    options = CLEAN[request.param]
    return _run(tmp_path_factory.mktemp("trl"), **options), options


def test_a_setting_trl_ships_replays_clean(clean_run):
    store, options = clean_run
    bundles = _bundles(store)
    steps = [b for b in bundles if b.startswith("step-")]
    assert len(steps) == 2, bundles
    assert "rollout-0" in bundles
    for step in steps:
        [source] = open_for_replay(store, step=step.removeprefix("step-").replace("-", ":"))[0]
        assert source.manifest.conventions is not None and source.manifest.conventions.profile == "trl"
        assert source.manifest.producer.framework_version == trl.__version__
        chain = _chain(store, step.removeprefix("step-").replace("-", ":"))
        assert chain.linked  # the step's samples found in their rollout bundle: identity kept through the shuffle
        assert chain.link is not None and chain.link.status == "pass", chain.link
        for entry in (*chain.upstream, chain.step):
            assert entry.report is not None and entry.report.status == "pass", (entry.bundle, _failures(entry.report))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> str:
    return _run(tmp_path_factory.mktemp("trl"), **OFF_POLICY)


def test_the_bundles_hold_trls_values_and_identity(default_run):
    [rollout] = open_for_replay(default_run, rollout=0)[0]
    records = {r.sample_id: r for r in rollout.index.samples}
    assert len(records) == 8
    # TRL groups rows by their position in the gathered generation batch: 2 prompts x 4 generations
    assert sorted(r.group_index for r in records.values()) == [0, 0, 0, 0, 1, 1, 1, 1]
    for step in ("0:0", "0:1"):
        [source] = open_for_replay(default_run, step=step)[0]
        assert source.index.config.loss_agg_mode == "token_mean"
        assert source.index.config.loss_denominator is not None
        for record in source.index.samples:
            upstream = records[record.sample_id]
            assert (record.group_index, record.raw_reward, record.reward) == (
                upstream.group_index,
                upstream.raw_reward,
                upstream.reward,
            )
        expected = source.expected["loss.policy"]
        assert {"loss", "pg_clipfrac", "entropy_loss"} <= set(expected)
    [first] = open_for_replay(default_run, step="0:0")[0]
    assert first.index.config.expect_on_policy is False  # num_iterations 2: TRL computed the old log-probs


def test_conventions_names_profile_trl(default_run):
    result = subprocess.run(
        [sys.executable, "-m", "trajectory_replay", "conventions", default_run, "--step", "0:0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert "profile trl" in result.stdout, result.stdout + result.stderr


# ---- bugs injected into TRL's own computation ---------------------------------------------------------------


def _batch_wide_normalization(trainer: Any) -> None:
    """TRL's advantage computation run with its group spanning the whole generation batch (8 rows) instead of
    num_generations (4): rewards normalized over the batch."""
    generate = trainer._generate_and_score_completions

    def buggy(inputs: Any) -> Any:
        trainer.num_generations = len(inputs)
        try:
            return generate(inputs)
        finally:
            trainer.num_generations = trainer.args.num_generations

    trainer._generate_and_score_completions = buggy


def _dropped_kl(trainer: Any) -> None:
    """TRL's loss computed without its KL term (beta 0 inside compute_loss) while the run's beta is recorded."""
    compute_loss = trainer.compute_loss

    def buggy(model: Any, inputs: Any, **kwargs: Any) -> Any:
        beta, trainer.beta = trainer.beta, 0.0
        try:
            return compute_loss(model, inputs, **kwargs)
        finally:
            trainer.beta = beta

    trainer.compute_loss = buggy


def _wrong_loss_type(trainer: Any) -> None:
    """TRL's loss computed as grpo while the run's loss_type (dapo) is recorded."""
    trainer.loss_type = "grpo"


def test_batch_wide_normalization_is_named_at_reward_post_process(tmp_path):
    store = _run(tmp_path, before=_batch_wide_normalization)
    report = replay(open_for_replay(store, rollout=0)[0])
    assert report.first_divergent_stage == "reward.post_process"
    assert report.first_divergence["sample"] == "s-0-0"
    assert report.stage("reward.raw").status == "pass"


def test_a_dropped_kl_term_is_named_at_loss_policy(tmp_path):
    store = _run(tmp_path, before=_dropped_kl, beta=0.1, **OFF_POLICY)
    chain = _chain(store, "0:1")
    assert chain.first_divergent_stage == "loss.policy"
    failed = {d.field for s in chain.step.report.stages if s.status == "fail" for d in s.divergences}
    assert "loss" in failed


def test_a_wrong_loss_type_recorded_is_named_at_loss_policy(tmp_path):
    store = _run(tmp_path, before=_wrong_loss_type)
    chain = _chain(store, "0:0")
    assert chain.first_divergent_stage == "loss.policy"
    failed = {d.field for s in chain.step.report.stages if s.status == "fail" for d in s.divergences}
    assert "loss" in failed


# ---- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"use_adaptive_entropy": True, "entropy_coef": 0.01}, "use_adaptive_entropy"),
        ({"loss_type": "bnpo", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}, "loss_type='bnpo'"),
        ({"loss_type": "sapo"}, "loss_type"),
    ],
)
def test_a_setting_capture_cannot_record_is_refused_in_one_line(tmp_path, options, named):
    trainer = tiny.trainer(str(tmp_path / "out"), **options)
    with pytest.raises(ValueError) as caught:
        enable_capture(trainer, str(tmp_path / "store"), writer="thread")
    message = str(caught.value)
    assert named in message and "\n" not in message
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


def test_a_trl_whose_private_methods_changed_is_refused_in_one_line(tmp_path):
    trainer = tiny.trainer(str(tmp_path / "out"))
    trainer._calculate_rewards = lambda batch: None  # as if TRL had renamed the parameters
    with pytest.raises(ValueError) as caught:
        enable_capture(trainer, str(tmp_path / "store"), writer="thread")
    message = str(caught.value)
    assert "GRPOTrainer._calculate_rewards has no parameter inputs" in message and "\n" not in message
    assert trl.__version__ in message


def test_the_installed_trl_has_what_capture_uses(tmp_path):
    trainer = tiny.trainer(str(tmp_path / "out"))
    TrlInternals.check(trainer)  # the installed TRL: the methods and parameters the adapter touches are there
    handle = enable_capture(trainer, str(tmp_path / "store"), writer="thread")
    trainer.train()
    assert handle.close(timeout=60)
    assert handle.stats()["errors"] == 0
    assert ROWS_KEY not in trainer.args.to_dict()


@pytest.mark.s3
def test_a_step_captured_into_s3_replays_by_url(tmp_path, s3_root, s3_env):
    url, storage_options = s3_root
    handle = tiny.run(url, str(tmp_path / "out"), capture_options={"storage_options": storage_options}, **OFF_POLICY)
    assert handle.manager.writer_mode == "process"  # the default: bundles written by a process of their own
    assert handle.stats()["written"] == 3 and handle.stats()["errors"] == 0  # rollout-0, step-0-0, step-0-1
    result = subprocess.run(
        [sys.executable, "-m", "trajectory_replay", "replay", url, "--step", "0:1", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(result.stdout)
    stages = [(s["bundle"], s["stage"], s["status"]) for s in report["stages"]]
    assert ("rollout-0", "reward.post_process", "pass") in stages
    assert ("step-0-1", "link", "pass") in stages
    assert report["status"] == "pass", stages


def test_the_capture_policy_variable_keeps_only_the_steps_before_a_trigger(tmp_path, monkeypatch):
    """TRAJECTORY_REPLAY_CAPTURE_POLICY=recorder:1 reaches a GRPOTrainer's capture: of three steps only the one a
    trigger fired at reaches the store, with its rollout, and its manifest says which trigger kept it."""
    from transformers import TrainerCallback

    from trajectory_replay.capture.config import ENV_POLICY, ENV_SPOOL

    monkeypatch.setenv(ENV_POLICY, "recorder:1")
    monkeypatch.setenv(ENV_SPOOL, str(tmp_path / "spool"))
    handles: list[Any] = []

    class TriggerAtSecondStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                assert handles[0].manager.trigger("second step") is True

    def before(trainer: Any) -> None:
        trainer.add_callback(TriggerAtSecondStep())

    store = str(tmp_path / "store")
    t = tiny.trainer(str(tmp_path / "out"), steps=3)
    before(t)
    handles.append(enable_capture(t, store, writer="thread"))
    t.train()
    assert handles[0].close(timeout=120)
    assert _bundles(store) == ["rollout-1", "step-1-0"]
    sources = open_for_replay(store, step="1:0")[0]
    trigger = sources[0].manifest.trigger
    assert trigger is not None and trigger.name == "user" and trigger.step == "step-1-0", trigger
    report = replay(sources)
    assert report.status == "pass", _failures(report)
