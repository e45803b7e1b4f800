"""Rollout correction against verl 0.9's own `compute_rollout_correction_and_add_to_batch`, through the adapter.

A verl step (steps.py: 16 prompts x 4 samples, 8-64 response tokens, junk in the padding) whose batch holds the
inference engine's `rollout_log_probs` goes through verl's correction before `compute_advantage`; the adapter's
`rollout_bundle` writes it with the mask before rejection and verl's `rollout_corr/*` metrics (the config through the
verl profile, from verl's own option values), and replay must recompute what verl did: weights, rejection and the
metrics that are functions of the recorded payloads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.verl.bundles import recompute_config, sample_id, write_rollout
from tests.integrations.verl.steps import MAX_PROMPT, StepOptions, VerlStep, build_step
from trajectory_replay.bundle import open_sources
from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import OFF_POLICY_FIELDS
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import mismatch, replay

CONFIGURATIONS = {
    "token-tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "sequence-tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "token-icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "token-k1-asymmetric": {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.2"},
    "icepop-and-chained": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.8_1.5",
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "0.85_1.1,0.03",
    },
    "sequence-is-seq-sum-k1": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.3_2.5",
    },
    "divergences": {
        "rollout_is": "token",
        "rollout_rs": "token_k2, seq_sum_k3, seq_max_k2, seq_mean_k1, token_k3",
        "rollout_rs_threshold": "0.05,1.0,0.6,0.95_1.04,0.06",
    },
}


def _step(options: dict[str, Any], **step_options: Any) -> VerlStep:
    return build_step(StepOptions(rollout_correction=tuple(options.items()), **step_options))


def _flat(step: VerlStep, tensor: torch.Tensor) -> torch.Tensor:
    """The valid response tokens of a padded (rows, width) tensor of the step, sample after sample."""
    valid = step.batch.batch["attention_mask"][:, MAX_PROMPT:].bool()
    return tensor[valid]


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_replay_recomputes_what_verl_computed(tmp_path: Path, options: dict[str, Any]):
    step = _step(options)
    metrics = step.rollout_corr_metrics
    if options.get("rollout_rs"):  # the batch gives every criterion something to reject, and something to keep
        for name in options["rollout_rs"].replace(" ", "").split(","):
            assert 0 < metrics[f"rollout_corr/rollout_rs_{name}_masked_fraction"] < 0.5, name
    sources = open_sources(write_rollout(step, tmp_path))
    report = replay(sources)
    assert report.passed, report.render_text()
    stage = report.stage(StageId.ROLLOUT_MISMATCH.value)
    tokens = sum(r.response_length for r in sources[0].index.samples)
    for compared in ("kl_k1 matches", "kl_k3 matches", f"loss_mask: {tokens} values match"):
        assert compared in stage.message
    weights = f"rollout_is_weights: {tokens} values match"
    assert (weights in stage.message) == bool(options.get("rollout_is"))
    # every metric of verl's that replay recomputes was recorded and matches
    reported = {name for name in OFF_POLICY_FIELDS if f"rollout_corr/{name}" in metrics}
    assert {"log_ppl_diff", "chi2_token", "chi2_seq"} <= reported
    assert ("rollout_is_mean" in reported) == bool(options.get("rollout_is"))
    assert ("rollout_rs_masked_fraction" in reported) == bool(options.get("rollout_rs"))
    for name in reported:
        assert f"{name} matches" in stage.message, name
    # and the rest of the step (rewards and advantages over the mask after rejection) replays clean too
    assert report.stage("advantage.estimate").status == "pass"
    # streamed in blocks of a few groups, the metrics are put together to the same values
    streamed = replay(sources, block_tokens=300)
    assert streamed.passed, streamed.render_text()
    whole, parts = stage.metrics, streamed.stage(StageId.ROLLOUT_MISMATCH.value).metrics
    assert {name: parts[name] for name in reported} == pytest.approx({name: whole[name] for name in reported})


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_the_kernel_gives_verl_weights_and_mask_token_for_token(options: dict[str, Any]):
    step = _step(options)
    assert step.pre_rejection_mask is not None
    before = _flat(step, step.pre_rejection_mask)
    batch = step.batch.batch
    d = torch.where(before.bool(), _flat(step, batch["old_log_probs"]) - _flat(step, batch["rollout_log_probs"]), 0.0)
    lengths = batch["attention_mask"][:, MAX_PROMPT:].sum(-1)
    fix = mismatch.correction(d, before, lengths, RecomputeConfig.from_profile("verl", **options))
    assert torch.equal(fix.mask, _flat(step, batch["response_mask"]).to(torch.float32))
    if options.get("rollout_is"):
        weights = mismatch.recorded_weights(fix, before)
        torch.testing.assert_close(weights, _flat(step, batch["rollout_is_weights"]), rtol=2e-6, atol=0)


def test_a_wrong_threshold_is_found_at_the_first_token_it_changes(tmp_path: Path):
    verl_options = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1"}
    verl_options["rollout_rs_threshold"] = "0.9_1.2"
    recorded = {**verl_options, "rollout_rs_threshold": "0.8_1.2", "rollout_is_threshold": 1.5}
    step = _step(verl_options)
    config = recompute_config(replace(step, options=replace(step.options, rollout_correction=tuple(recorded.items()))))
    report = replay(open_sources(write_rollout(step, tmp_path, config=config)))
    assert report.first_divergent_stage == StageId.ROLLOUT_MISMATCH.value
    stage = report.stage(StageId.ROLLOUT_MISMATCH.value)
    assert "loss_mask: " in stage.message and "rollout_is_weights: " in stage.message
    assert "values differ" in stage.message.split("rollout_is_weights: ")[1], report.render_text()
    # the first divergence is a token verl rejected and the recorded window keeps
    first = next(d for d in stage.divergences if d.field == "loss_mask")
    row = [sample_id(step, i) for i in range(len(step.batch))].index(first.sample_id)
    batch = step.batch.batch
    ratio = torch.exp(batch["old_log_probs"][row] - batch["rollout_log_probs"][row])
    assert first.expected == 0.0 and first.actual == 1.0
    assert 1 / 1.2 <= float(ratio[first.token_offset]) <= 1 / 0.8 and not float(ratio[first.token_offset]) <= 1 / 0.9


def test_a_wrong_recorded_metric_is_named_at_rollout_mismatch(tmp_path: Path):
    options = CONFIGURATIONS["icepop-and-chained"]
    step = _step(options)
    metrics = dict(step.rollout_corr_metrics)
    metrics["rollout_corr/chi2_token"] *= 1.01
    report = replay(open_sources(write_rollout(step, tmp_path, metrics=metrics)))
    assert report.first_divergent_stage == StageId.ROLLOUT_MISMATCH.value
    failed = {d.field for d in report.stage(StageId.ROLLOUT_MISMATCH.value).divergences}
    assert failed == {"chi2_token"}, report.render_text()


def test_the_mask_before_rejection_is_what_the_metrics_are_taken_over(tmp_path: Path):
    """Without the pre-rejection mask, the metrics over the mask after rejection are not verl's."""
    options = {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1"}
    step = _step(options)
    assert replay(open_sources(write_rollout(step, tmp_path))).status == "pass"
    batch = step.batch.batch
    assert step.pre_rejection_mask is not None
    lengths = batch["attention_mask"][:, MAX_PROMPT:].sum(-1)
    d = _flat(step, batch["old_log_probs"]) - _flat(step, batch["rollout_log_probs"])
    verl = step.rollout_corr_metrics["rollout_corr/kl"]
    got = mismatch.mismatch_metrics(d, _flat(step, batch["response_mask"]), lengths)
    assert got.kl_k1 != pytest.approx(verl, rel=1e-3)
    got = mismatch.mismatch_metrics(d, _flat(step, step.pre_rejection_mask), lengths)
    assert got.kl_k1 == pytest.approx(verl, rel=1e-4)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rollout_is_threshold": "a_b"}, "rollout_is_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1.1,0.1,0.2"}, "rollout_rs_threshold"),
        ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
        ({"bypass_mode": True}, "bypass_mode"),
    ],
)
def test_what_no_field_expresses_is_refused_in_one_line_naming_the_verl_option(options, named):
    with pytest.raises(ValueError) as raised:
        RecomputeConfig.from_profile("verl", **options)
    message = str(raised.value)
    assert "\n" not in message and f"verl option {named}" in message


def test_an_unknown_criterion_is_unsupported_naming_it(tmp_path: Path):
    options = {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1"}
    step = _step(options)
    other = replace(step.options, rollout_correction=tuple({**options, "rollout_rs": "token_k1,seq_max_k1"}.items()))
    sources = open_sources(write_rollout(step, tmp_path, config=recompute_config(replace(step, options=other))))
    with pytest.raises(UnsupportedError, match="^unsupported rollout_rs criterion 'seq_max_k1': one of none, "):
        replay(sources)


def test_a_sample_rejected_whole_keeps_the_reward_verls_estimator_gives_it(tmp_path: Path):
    """A sequence-level criterion rejects every token of a sample: its advantages show no r', which the adapter
    takes from verl's estimator over a full mask; its group's baseline still counts its score."""
    step = _step(CONFIGURATIONS["icepop-and-chained"])
    assert step.pre_rejection_mask is not None
    whole = (step.pre_rejection_mask.sum(-1) > 0) & (step.batch.batch["response_mask"].sum(-1) == 0)
    assert whole.any()
    report = replay(open_sources(write_rollout(step, tmp_path)))
    stage = report.stage("reward.post_process")
    assert stage.status == "pass" and stage.compared == len(step.batch), report.render_text()
