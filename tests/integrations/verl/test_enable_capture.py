"""`enable_capture` on a real verl `RayPPOTrainer` subclass, made without its `__init__` (which needs Ray, GPUs and
an inference engine): its config is verl's own generated `ppo_trainer.yaml`, its `_update_actor`/`_update_critic`
are verl's, and its worker groups are in-process stand-ins that receive the loss function as Ray would (pickled)
and call it per micro-batch as verl's engine does (mini-batches of `global_batch_size` rows, split into
micro-batches, each with `dp_size`, `batch_num_tokens` and `global_batch_size`).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import verl
from omegaconf import OmegaConf
from tensordict import TensorDict
from typer.testing import CliRunner
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, apply_kl_penalty, compute_advantage
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss, value_loss

from tests.integrations.verl.steps import PROMPTS, SAMPLES, StepOptions, VerlStep, _flat_model_output, build_step
from trajectory_replay import capture
from trajectory_replay.bundle import open_sources
from trajectory_replay.bundle.stage_io import OFF_POLICY_FIELDS, PRE_REJECTION_MASK
from trajectory_replay.cli import app
from trajectory_replay.integrations.verl_loss import WorkerCapture, capture_loss, capture_value_loss
from trajectory_replay.integrations.verl_trainer import CorrectionTap, enable_capture
from trajectory_replay.replay import replay

ROLLOUT = 3
MICRO = 32
"""Rows per micro-batch: each mini-batch (the whole batch of 64) in two."""
ROOT = Path(__file__).resolve().parents[3]


def verl_config(adv_estimator: str) -> Any:
    """verl's generated trainer config with the step's options (steps.StepOptions' defaults)."""
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(path)
    config.algorithm.adv_estimator = adv_estimator
    config.actor_rollout_ref.rollout.n = SAMPLES
    actor = config.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = PROMPTS
    actor.ppo_micro_batch_size_per_gpu = MICRO
    actor.clip_ratio_low, actor.clip_ratio_high = 0.2, 0.28
    actor.entropy_coeff, actor.calculate_entropy = 0.01, True
    config.critic.ppo_mini_batch_size = PROMPTS
    config.critic.ppo_micro_batch_size_per_gpu = MICRO
    return config


def critic_config(config: Any) -> Any:
    """The critic's config as `init_workers` binds it to value_loss (its model section left out: it loads a
    tokenizer, and the loss reads none of it)."""
    return omega_conf_to_dataclass(OmegaConf.masked_copy(config.critic, [k for k in config.critic if k != "model"]))


class WorkerGroup:
    """A worker group of one dp rank in this process: `set_loss_fn` as a ONE_TO_ALL call (the function pickled,
    as Ray sends it), and the engine's training loop over the no-padding TensorDict `_update_*` hands it."""

    def __init__(self, step: VerlStep, output: str, loss_fn: Any) -> None:
        self.step, self.output = step, output
        self.loss_fn = loss_fn
        self.results: list[tuple[Any, Any]] = []

    def set_loss_fn(self, loss_fn: Any) -> None:
        self.loss_fn = pickle.loads(pickle.dumps(loss_fn))

    def _train(self, data: TensorDict) -> TensorDict:
        size = int(tu.get(data, "global_batch_size"))
        for start in range(0, len(data), size):
            mini = list(range(start, start + size))
            tokens = int(self.step.batch.batch["response_mask"][mini].sum())
            for first in range(0, size, MICRO):
                rows = mini[first : first + MICRO]
                micro = tu.index_select_tensor_dict(data, rows)
                tu.assign_non_tensor(micro, dp_size=1, batch_num_tokens=tokens, global_batch_size=size)
                tensor = self.step.log_probs if self.output == "log_probs" else self.step.vpreds
                assert tensor is not None
                output = {self.output: _flat_model_output(tensor, self.step.batch, rows)}
                if self.output == "log_probs" and self.step.entropy is not None:
                    output["entropy"] = _flat_model_output(self.step.entropy, self.step.batch, rows)
                self.results.append(self.loss_fn(model_output=output, data=micro, dp_group=None))
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def update_actor(self, data: TensorDict) -> TensorDict:
        return self._train(data)

    def train_mini_batch(self, data: TensorDict) -> Any:
        return Pending(partial(self._train, data))


class Pending:
    """What a non-blocking Ray call returns: `get()` gives the result."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def get(self) -> Any:
        return self.call()


class CapturingTrainer(RayPPOTrainer):
    """A verl trainer subclass that switches capture on at the end of `init_workers`."""

    def init_workers(self) -> None:
        """The worker groups (in-process here), with the loss functions verl binds, then capture."""
        step: VerlStep = self.step
        actor = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.actor_rollout_wg = WorkerGroup(step, "log_probs", partial(ppo_loss, config=actor))
        if self.use_critic:
            self.critic_wg = WorkerGroup(step, "values", partial(value_loss, config=critic_config(self.config)))
        self.capturing = enable_capture(self, **self.capture_options)


def trainer(step: VerlStep, algorithm: dict[str, Any] | None = None, **capture_options: Any) -> CapturingTrainer:
    """A trainer of `step`, its config's `algorithm` section updated by `algorithm` (dotted keys), its reward-side KL
    controller made from the config as verl's `__init__` makes it."""
    made = object.__new__(CapturingTrainer)
    made.config = verl_config(step.options.adv_estimator)
    for key, value in (algorithm or {}).items():
        OmegaConf.update(made.config.algorithm, key, value)
    if made.config.algorithm.use_kl_in_reward:
        made.kl_ctrl_in_reward = core_algos.get_kl_controller(made.config.algorithm.kl_ctrl)
    made.use_critic = step.options.adv_estimator == "gae"
    made.global_steps = ROLLOUT
    made.step = step
    made.capture_options = capture_options
    made.init_workers()
    return made


@pytest.fixture(scope="module")
def grpo() -> VerlStep:
    return build_step(StepOptions())


@pytest.fixture(scope="module")
def gae() -> VerlStep:
    return build_step(StepOptions(adv_estimator="gae"))


@pytest.fixture(autouse=True)
def capture_off(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TRAJECTORY_REPLAY_", "RELAX_REPLAY_")):
            monkeypatch.delenv(name)
    capture.shutdown(timeout=10)
    yield
    capture.shutdown(timeout=10)


def _failed(report: Any) -> list[Any]:
    return [(s.stage, s.message) for s in report.stages if s.status != "pass"]


def test_the_env_var_switches_capture_on_and_the_bundles_replay_clean_and_chain(tmp_path, monkeypatch, grpo):
    monkeypatch.setenv("TRAJECTORY_REPLAY_CAPTURE", "1")
    monkeypatch.setenv("TRAJECTORY_REPLAY_CAPTURE_DIR", str(tmp_path))
    monkeypatch.setenv("TRAJECTORY_REPLAY_CAPTURE_WRITER", "thread")
    made = trainer(grpo)
    assert made.capturing is True
    meta = dict(grpo.batch.meta_info)
    output = made._update_actor(grpo.batch)
    assert output.meta_info["metrics"]["perf/mfu/actor"] == 0.0  # verl's own _update_actor ran
    assert grpo.batch.meta_info == meta and set(grpo.batch.non_tensor_batch) == {"uid"}  # the batch is kept
    assert capture.stats()["errors"] == 0
    assert capture.shutdown(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("rollout-", "step-"))) == [
        f"rollout-{ROLLOUT}",
        f"step-{ROLLOUT}-0",
    ]
    rollout = open_sources(str(tmp_path / f"rollout-{ROLLOUT}"))
    assert replay(rollout).status == "pass", _failed(replay(rollout))
    [step] = open_sources(str(tmp_path / f"step-{ROLLOUT}-0"))
    assert step.index.identity.micro_batch_ids == ["mb-0000", "mb-0001"]
    assert {s.sample_id for s in step.index.samples} == {s.sample_id for s in rollout[0].index.samples}
    result = CliRunner().invoke(app, ["replay", str(tmp_path), "--step", f"{ROLLOUT}:0", "--json"])
    assert result.exit_code == 0, result.output
    chain = json.loads(result.output)
    assert [(entry["bundle"], entry["role"]) for entry in chain["chain"]] == [
        (f"rollout-{ROLLOUT}", "upstream"),
        (f"step-{ROLLOUT}-0", "step"),
    ]
    assert chain["link"]["status"] == "pass"
    assert chain["status"] == "pass"


def test_the_critic_and_the_actor_are_captured_apart_and_replay_clean(tmp_path, gae):
    made = trainer(gae, store_url=tmp_path, writer="thread")
    made._update_critic(gae.batch)
    made._update_actor(gae.batch)
    assert capture.stats()["errors"] == 0
    assert capture.shutdown(timeout=60)
    for name in (f"rollout-{ROLLOUT}", f"step-{ROLLOUT}-0", f"critic-{ROLLOUT}-0"):
        report = replay(open_sources(str(tmp_path / name)))
        assert report.status == "pass", (name, _failed(report))
    result = CliRunner().invoke(app, ["replay", str(tmp_path / f"critic-{ROLLOUT}-0")])
    assert result.exit_code == 0, result.output
    for flag, bundle in (("--step", f"step-{ROLLOUT}-0"), ("--critic", f"critic-{ROLLOUT}-0")):
        result = CliRunner().invoke(app, ["replay", str(tmp_path), flag, f"{ROLLOUT}:0", "--json"])
        assert result.exit_code == 0, result.output
        chain = json.loads(result.output)
        assert [(entry["bundle"], entry["role"]) for entry in chain["chain"]] == [
            (f"rollout-{ROLLOUT}", "upstream"),
            (bundle, "step"),
        ]
        assert chain["link"]["status"] == "pass" and chain["status"] == "pass"
    text = CliRunner().invoke(app, ["replay", str(tmp_path), "--critic", f"{ROLLOUT}:0"]).output
    assert f"chain rollout-{ROLLOUT} -> critic-{ROLLOUT}-0" in text and f"{SAMPLES * PROMPTS} samples linked" in text
    copy = ["cp", str(tmp_path), str(tmp_path / "copy"), "--critic", f"{ROLLOUT}:0", "--quiet", "--json"]
    copied = CliRunner().invoke(app, copy)
    assert copied.exit_code == 0, copied.output
    assert json.loads(copied.stdout)["bundles"] == [f"critic-{ROLLOUT}-0"]
    [critic] = open_sources(str(tmp_path / f"critic-{ROLLOUT}-0"))
    assert critic.index.identity.anchor() == f"critic {ROLLOUT}:0"
    assert {s.value for s in critic.manifest.stage_contracts} == {"sample", "loss.value"}
    reported = critic.expected["loss.value"]
    assert reported["vf_loss"] == pytest.approx(gae.value_metrics["critic/vf_loss"], rel=1e-5)
    assert reported["vf_clipfrac"] == pytest.approx(gae.value_metrics["critic/vf_clipfrac"], rel=1e-5)


def test_critic_false_leaves_the_critic_loss_alone(tmp_path, gae):
    made = trainer(gae, store_url=tmp_path, writer="thread", critic=False)
    assert made.critic_wg.loss_fn.func is value_loss  # as init_workers bound it: nothing sent
    made._update_critic(gae.batch)  # the rollout-level bundle is still captured here, before the actor's update
    made._update_actor(gae.batch)
    assert capture.shutdown(timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("rollout-", "step-", "critic-"))) == [
        f"rollout-{ROLLOUT}",
        f"step-{ROLLOUT}-0",
    ]


def test_with_capture_off_nothing_changes_and_nothing_is_written(tmp_path, grpo):
    made = trainer(grpo)
    assert made.capturing is False
    assert "_update_actor" not in made.__dict__
    assert made.actor_rollout_wg.loss_fn.func is ppo_loss
    made._update_actor(grpo.batch)
    assert len(made.actor_rollout_wg.results) == 2
    assert capture.get_manager() is None
    assert not list(tmp_path.iterdir())


def test_the_update_returns_while_the_store_write_is_held(tmp_path, grpo):
    made = trainer(grpo, store_url=tmp_path, writer="thread")
    manager = capture.get_manager()
    assert manager is not None
    gate = threading.Event()
    write = manager._write

    def held(queued: Any) -> None:
        gate.wait()
        write(queued)

    manager._write = held  # the store does not answer until the gate opens
    made._update_actor(grpo.batch)
    stats = manager.stats()
    assert stats["enqueued"] == 2 and stats["written"] == 0  # the rollout and the step: queued, not written
    assert not (tmp_path / f"rollout-{ROLLOUT}").exists()
    gate.set()
    assert manager.flush(60)
    assert manager.stats()["written"] == 2


def test_the_loss_wrappers_pickle_and_switch_capture_on_in_a_fresh_process(tmp_path, grpo):
    worker = WorkerCapture({"TRAJECTORY_REPLAY_CAPTURE": "1", "TRAJECTORY_REPLAY_CAPTURE_DIR": str(tmp_path)})
    actor = omega_conf_to_dataclass(verl_config("grpo").actor_rollout_ref.actor)
    loss_fn = partial(capture_loss(ppo_loss, worker=worker), config=actor)
    assert pickle.loads(pickle.dumps(capture_value_loss(value_loss, worker=worker))).worker == worker
    (tmp_path / "loss.pkl").write_bytes(pickle.dumps(loss_fn))
    script = f"""
import pickle
from verl.utils import tensordict_utils as tu
from tests.integrations.verl.steps import StepOptions, build_step
from tests.integrations.verl.test_enable_capture import WorkerGroup
from trajectory_replay import capture
assert capture.get_manager() is None
step = build_step(StepOptions())
group = WorkerGroup(step, "log_probs", pickle.load(open({str(tmp_path / "loss.pkl")!r}, "rb")))
data = step.batch.to_tensordict()
from verl.workers.utils.padding import left_right_2_no_padding
data = left_right_2_no_padding(data)
tu.assign_non_tensor(data, global_batch_size=len(step.batch), global_steps={ROLLOUT})
group.update_actor(data)
assert capture.get_manager() is not None and capture.get_manager().expected_ranks == [0]
assert capture.shutdown(60)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAJECTORY_REPLAY_", "RELAX_REPLAY_"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = replay(open_sources(str(tmp_path / f"step-{ROLLOUT}-0")))
    assert report.status == "pass", _failed(report)


def test_value_loss_run_on_stale_old_values_is_named_at_loss_value(tmp_path, gae):
    def stale(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        """value_loss given old values of an earlier critic than the ones the batch (and so the capture) holds."""
        moved = data.clone()
        moved["values"] = data["values"] + 0.3
        return value_loss(config, model_output, moved, dp_group=dp_group)

    capture.set_manager(capture.CaptureManager(tmp_path, writer="thread", atexit_timeout=None))
    group = WorkerGroup(gae, "values", partial(capture_value_loss(stale), config=critic_config(verl_config("gae"))))
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(gae.batch.to_tensordict())
    tu.assign_non_tensor(data, global_batch_size=len(gae.batch), global_steps=ROLLOUT)
    group.train_mini_batch(data).get()
    assert capture.shutdown(60)
    report = replay(open_sources(str(tmp_path / f"critic-{ROLLOUT}-0")))
    assert report.first_divergent_stage == "loss.value"
    assert "vf_loss" in {d.field for s in report.stages if s.status == "fail" for d in s.divergences}


CORRECTIONS = {
    "token-tis-asymmetric-k1": {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.9_1.2",
    },
    "icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "icepop-and-chained": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.8_1.5",
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "0.85_1.1,0.03",
    },
}


def _before(step: VerlStep, *drop: str) -> DataProto:
    """The step's batch as `fit` holds it before the tensors `drop` (and the advantages) were made: response_mask
    before any rejection."""
    gone = {"advantages", "returns", "rollout_is_weights", *drop}
    tensors = {k: v.clone() for k, v in step.batch.batch.items() if k not in gone}
    if step.pre_rejection_mask is not None:
        tensors["response_mask"] = step.pre_rejection_mask.clone()
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": step.batch.non_tensor_batch["uid"].copy()})


def _advantages(made: CapturingTrainer, batch: DataProto) -> DataProto:
    """`compute_advantage` as `fit` calls it."""
    algorithm = made.config.algorithm
    return compute_advantage(
        batch,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=SAMPLES,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
        config=algorithm,
    )


def _fit_with_correction(made: CapturingTrainer, step: VerlStep, correction: Any) -> dict[str, float]:
    """What `fit` does from the rollout correction on: the correction imported in the body and called with the
    config `correction`, compute_advantage, then the actor's update; verl's rollout_corr metrics."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    batch, metrics = compute_rollout_correction_and_add_to_batch(_before(step), correction)
    batch = _advantages(made, batch)
    made._update_actor(batch)
    return metrics


@pytest.mark.parametrize("options", CORRECTIONS.values(), ids=CORRECTIONS.keys())
def test_rollout_correction_is_captured_with_its_mask_and_metrics_and_replays_clean(tmp_path, options):
    step = build_step(StepOptions(rollout_correction=tuple(options.items())))
    made = trainer(step, {f"rollout_correction.{k}": v for k, v in options.items()}, store_url=tmp_path)
    metrics = _fit_with_correction(made, step, made.config.algorithm.rollout_correction)
    assert metrics == pytest.approx(step.rollout_corr_metrics)  # verl's correction ran as in steps.py
    assert capture.stats()["errors"] == 0
    assert capture.shutdown(timeout=60)
    rollout = open_sources(str(tmp_path / f"rollout-{ROLLOUT}"))
    report = replay(rollout)
    assert report.status == "pass", _failed(report)
    stage = report.stage("rollout.mismatch")
    recorded = {name for name in OFF_POLICY_FIELDS if f"rollout_corr/{name}" in metrics}
    assert {"chi2_token", "rollout_is_mean"} <= recorded
    assert ("rollout_rs_masked_fraction" in recorded) == ("rollout_rs" in options)
    for name in recorded | {"kl_k1", "kl_k3"}:
        assert f"{name} matches" in stage.message, name
    assert rollout[0].expected["rollout.mismatch"]["kl_k1"] == metrics["rollout_corr/kl"]
    [actor] = open_sources(str(tmp_path / f"step-{ROLLOUT}-0"))
    assert actor.index.config.rollout_is == "token"
    assert ("rollout_rs" in options) == actor.has_payload(PRE_REJECTION_MASK)
    result = CliRunner().invoke(app, ["replay", str(tmp_path), "--step", f"{ROLLOUT}:0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["status"] == "pass"


def test_a_wrong_rollout_is_threshold_is_named_at_rollout_mismatch(tmp_path):
    options = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1"}
    options["rollout_rs_threshold"] = "0.9_1.2"
    step = build_step(StepOptions(rollout_correction=tuple(options.items())))
    recorded = {**options, "rollout_is_threshold": 1.5}
    made = trainer(step, {f"rollout_correction.{k}": v for k, v in recorded.items()}, store_url=tmp_path)
    ran = OmegaConf.create(dict(made.config.algorithm.rollout_correction))
    ran.rollout_is_threshold = 2.0  # what verl's correction was given
    _fit_with_correction(made, step, ran)
    assert capture.shutdown(timeout=60)
    report = replay(open_sources(str(tmp_path / f"rollout-{ROLLOUT}")))
    assert report.first_divergent_stage == "rollout.mismatch"
    failed = {d.field for d in report.stage("rollout.mismatch").divergences}
    assert "rollout_is_weights" in failed, report.render_text()


def test_the_correction_tap_is_put_back_once_capture_is_off(tmp_path):
    from verl.trainer.ppo import rollout_corr_helper

    step = build_step(StepOptions(rollout_correction=tuple(CORRECTIONS["icepop"].items())))
    made = trainer(step, {f"rollout_correction.{k}": v for k, v in CORRECTIONS["icepop"].items()}, store_url=tmp_path)
    tap = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    assert isinstance(tap, CorrectionTap)
    capture.shutdown(timeout=60)
    _fit_with_correction(made, step, made.config.algorithm.rollout_correction)
    assert rollout_corr_helper.compute_rollout_correction_and_add_to_batch is tap.original
    assert not list(tmp_path.glob("rollout-*"))


def test_a_fit_that_does_not_call_verls_correction_through_its_module_is_refused(tmp_path, grpo):
    class OwnFit(CapturingTrainer):
        def fit(self) -> None:
            """A training loop of its own."""

    made = object.__new__(OwnFit)
    made.config = verl_config("grpo")
    made.config.algorithm.rollout_correction.rollout_rs = "token_k1"
    made.use_critic = False
    made.actor_rollout_wg = WorkerGroup(grpo, "log_probs", None)
    with pytest.raises(ValueError) as raised:
        enable_capture(made, tmp_path)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("verl option algorithm.rollout_correction.rollout_rs='token_k1': ")
    assert "compute_rollout_correction_and_add_to_batch" in message


def test_an_adaptive_kl_coefficient_is_recorded_as_it_penalized_each_step_and_replays_clean(tmp_path, grpo):
    algorithm = {
        "use_kl_in_reward": True,
        "kl_penalty": "kl",
        "kl_ctrl.type": "adaptive",
        "kl_ctrl.kl_coef": 0.05,
        "kl_ctrl.target_kl": 1e-4,  # far below the step's KL: each update raises the coefficient by 20%
        "kl_ctrl.horizon": len(grpo.batch),
    }
    made = trainer(grpo, algorithm, store_url=tmp_path)
    used = []
    for rollout in (ROLLOUT, ROLLOUT + 1):
        made.global_steps = rollout
        batch, kl_metrics = apply_kl_penalty(  # as fit calls it
            _before(grpo, "token_level_rewards"), kl_ctrl=made.kl_ctrl_in_reward, kl_penalty="kl"
        )
        used.append(kl_metrics["actor/reward_kl_penalty_coeff"])
        made._update_actor(_advantages(made, batch))
    assert used == pytest.approx([0.05, 0.06])
    assert made.kl_ctrl_in_reward.value == pytest.approx(0.072)
    assert capture.stats()["errors"] == 0
    assert capture.shutdown(timeout=60)
    for rollout, coef in zip((ROLLOUT, ROLLOUT + 1), used):
        sources = open_sources(str(tmp_path / f"rollout-{rollout}"))
        assert sources[0].index.config.kl_coef == coef
        report = replay(sources)
        assert report.status == "pass", _failed(report)
        assert report.stage("reward.post_process").status == "pass"
        step = replay(open_sources(str(tmp_path / f"step-{rollout}-0")))
        assert step.status == "pass", _failed(step)


@pytest.mark.parametrize(
    ("env_policy", "given", "driver"),
    [
        ("recorder:8", None, "all"),
        (None, "recorder:4,after=1", "all"),
        ("every:2", None, None),
        (None, None, None),
    ],
)
def test_under_a_recorder_policy_the_driver_writes_every_rollout_bundle(env_policy, given, driver):
    """The driver writes only rollout-level bundles, which no worker's recorder holds: under recorder:K it keeps
    them all (the workers' step bundles follow the policy); any other policy reaches it unchanged."""
    from trajectory_replay.capture.config import ENV_POLICY
    from trajectory_replay.integrations.verl_trainer import _driver_policy

    env = {"TRAJECTORY_REPLAY_CAPTURE": "1", "TRAJECTORY_REPLAY_CAPTURE_DIR": "/unused"}
    env.update({ENV_POLICY: env_policy} if env_policy else {})
    options = {"policy": given} if given else {}
    driver_env, driver_options = _driver_policy(env, options)
    if driver is None:
        assert (driver_env, driver_options) == (env, options)
    else:
        assert ENV_POLICY not in driver_env and driver_options["policy"] == driver
        assert driver_env["TRAJECTORY_REPLAY_CAPTURE"] == "1"
