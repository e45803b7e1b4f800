"""verl's own ppo_loss through `capture_loss`: each micro-batch handed to the wrapper as verl's engine hands it the
loss (the no-padding TensorDict of `left_right_2_no_padding` with the global batch information), captured by a
manager on a local store, the mini-batch ended when this rank has seen its share of `global_batch_size`; the
step-level bundle replays clean and the wrapper returns exactly what ppo_loss returns."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from tests.integrations.verl.steps import (
    PROMPTS,
    SAMPLES,
    StepOptions,
    VerlStep,
    actor_config,
    build_step,
    engine_micro_batch,
)
from trajectory_replay import capture
from trajectory_replay.bundle import open_sources
from trajectory_replay.capture import CaptureManager
from trajectory_replay.integrations.verl_loss import capture_loss
from trajectory_replay.replay import replay

ROLLOUT = 7


@pytest.fixture(scope="module")
def step() -> VerlStep:
    return build_step(StepOptions(micro_batches=2))


@pytest.fixture(autouse=True)
def capture_off():
    capture.shutdown(timeout=10)
    yield
    capture.shutdown(timeout=10)


def _engine_micro_batch(step: VerlStep, rows: list[int]) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the TensorDict verl's FSDP engine hands the loss for `rows`, the actor's unpadded model output), one rank of
    the whole step's mini-batch, the rollout id in the batch."""
    return engine_micro_batch(
        step,
        rows,
        dp_size=1,
        batch_num_tokens=int(step.batch.batch["response_mask"].sum()),
        global_batch_size=PROMPTS * SAMPLES,
        global_steps=ROLLOUT,
    )


def _run(step: VerlStep, loss_fn) -> list[tuple[Any, Any]]:
    config = actor_config(step.options)
    return [loss_fn(config, *reversed(_engine_micro_batch(step, rows))) for rows in step.micro_batches]


def test_captured_step_replays_clean_and_the_loss_is_verls(tmp_path, step):
    manager = CaptureManager(tmp_path, writer="thread", atexit_timeout=None)
    capture.set_manager(manager)
    wrapped = _run(step, capture_loss(ppo_loss))
    plain = _run(step, ppo_loss)
    for (loss, metrics), (loss_0, metrics_0) in zip(wrapped, plain):
        assert torch.equal(loss, loss_0)
        assert metrics.keys() == metrics_0.keys()
        for key, value in metrics.items():
            assert getattr(value, "values", value) == getattr(metrics_0[key], "values", metrics_0[key])
    assert manager.flush(30)
    assert manager.stats()["errors"] == 0
    [source] = open_sources(str(tmp_path / f"step-{ROLLOUT}-0"))
    assert source.index.identity.micro_batch_ids == ["mb-0000", "mb-0001"]
    assert len(source.index.samples) == PROMPTS * SAMPLES
    assert source.index.config.loss_agg_mode == "token_mean"
    assert source.index.config.loss_denominator == int(step.batch.batch["response_mask"].sum())
    reported = source.expected["loss.policy"]
    for field in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss"):
        assert reported[field] == pytest.approx(step.policy_metrics[f"actor/{field}"], rel=1e-6)
    assert reported["loss"] == pytest.approx(step.policy_metrics["loss"], rel=1e-6)
    report = replay([source])
    assert report.status == "pass", [(s.stage, s.message) for s in report.stages if s.status != "pass"]
    assert report.stage("loss.policy").status == "pass"


def test_a_loss_that_uses_other_advantages_than_it_was_given_is_found(tmp_path, step):
    def buggy_loss(config, model_output, data, dp_group=None):
        """ppo_loss run on advantages scaled by 1.5: not what the batch (and so the capture) holds."""
        scaled = data.clone()
        scaled["advantages"] = data["advantages"] * 1.5
        return ppo_loss(config, model_output, scaled, dp_group=dp_group)

    manager = CaptureManager(tmp_path, writer="thread", atexit_timeout=None)
    capture.set_manager(manager)
    _run(step, capture_loss(buggy_loss))
    assert manager.flush(30)
    [source] = open_sources(str(tmp_path / f"step-{ROLLOUT}-0"))
    report = replay([source])
    assert report.first_divergent_stage == "loss.policy"
    failed = {d.field for s in report.stages if s.status == "fail" for d in s.divergences}
    assert "pg_loss" in failed


def test_capture_off_costs_nothing_and_writes_nothing(tmp_path, step):
    assert capture.get_manager() is None
    wrapped = _run(step, capture_loss(ppo_loss))
    plain = _run(step, ppo_loss)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(wrapped, plain))
    assert not list(tmp_path.iterdir())


def test_a_batch_without_a_rollout_id_is_counted_never_raised(tmp_path, step, caplog):
    manager = CaptureManager(tmp_path, writer="thread", atexit_timeout=None)
    capture.set_manager(manager)
    data, output = _engine_micro_batch(step, step.micro_batches[0])
    del data["global_steps"]
    loss, _ = capture_loss(ppo_loss)(actor_config(step.options), output, data)
    assert torch.isfinite(loss)
    assert manager.stats()["errors"] == 1
    assert "set_rollout" in caplog.text


def test_two_dp_ranks_make_one_step_bundle_that_replays_clean(tmp_path, step):
    """dp = 2 as two producer ranks of one bundle, each its own manager and wrapper, each rank's half of the
    mini-batch in two micro-batches with the global batch information of the whole mini-batch."""
    config = actor_config(step.options)
    n = PROMPTS * SAMPLES
    for rank in (0, 1):
        manager = CaptureManager(tmp_path, rank=rank, expected_ranks=[0, 1], writer="thread", atexit_timeout=None)
        capture.set_manager(manager)
        wrapped = capture_loss(ppo_loss)
        half = list(range(rank * n // 2, (rank + 1) * n // 2))
        for rows in (half[: n // 4], half[n // 4 :]):
            data, output = _engine_micro_batch(step, rows)
            tu.assign_non_tensor(data, dp_size=2)
            wrapped(config, output, data)
        assert manager.flush(30) and manager.stats()["errors"] == 0
        capture.shutdown(timeout=10)
    sources = open_sources(str(tmp_path / f"step-{ROLLOUT}-0"))
    assert len(sources) == 2
    assert sources[1].index.identity.micro_batch_ids == ["mb-1-0000", "mb-1-0001"]
    report = replay(sources)
    assert report.status == "pass", [(s.stage, s.rank, s.message) for s in report.stages if s.status != "pass"]
    assert len([s for s in report.stages if s.stage == "loss.policy" and s.status == "pass"]) == 2


def test_a_refused_micro_batch_leaves_its_step_unwritten(tmp_path, step):
    manager = CaptureManager(tmp_path, writer="thread", atexit_timeout=None)
    capture.set_manager(manager)
    wrapped = capture_loss(ppo_loss)
    config = actor_config(step.options)
    for k, rows in enumerate(step.micro_batches):
        data, output = _engine_micro_batch(step, rows)
        if k == 1:  # importance weights the step's config does not describe (no rollout_is) are refused
            data["rollout_is_weights"] = torch.ones_like(data["advantages"])
        wrapped(config, output, data)
    assert manager.flush(30)
    assert manager.stats()["errors"] == 1
    assert not (tmp_path / f"step-{ROLLOUT}-0").exists()
    # the next mini-batch of the rollout is captured again, as step 1
    for rows in step.micro_batches:
        wrapped(config, *reversed(_engine_micro_batch(step, rows)))
    assert manager.flush(30)
    assert replay(open_sources(str(tmp_path / f"step-{ROLLOUT}-1"))).status == "pass"
