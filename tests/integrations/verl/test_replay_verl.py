"""Real verl 0.9.1 steps, built by verl's own functions and written through the public writer API, replay clean
under the verl profile; the canonical injected bug is named at its first stage, sample and token.

docs/integrations/verl.md lists every configuration tried, with those that do not replay clean yet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations.verl.bundles import write_bundle
from tests.integrations.verl.steps import MAX_PROMPT, PROMPTS, SAMPLES, StepOptions, build_step
from trajectory_replay.bundle import open_sources
from trajectory_replay.outcome import Status
from trajectory_replay.replay import replay

CLEAN = {
    "grpo token-mean": StepOptions(),
    "grpo without std normalization": StepOptions(norm_adv_by_std_in_grpo=False),
    "grpo multi-turn": StepOptions(multi_turn=True),
    "grpo kl loss low_var_kl": StepOptions(use_kl_loss=True, clip_ratio_low=0.1, clip_ratio_high=0.1),
    "grpo kl loss k3": StepOptions(use_kl_loss=True, kl_loss_type="k3"),
    "grpo kl loss k1": StepOptions(use_kl_loss=True, kl_loss_type="kl"),
    "grpo kl loss k2 multi-turn": StepOptions(use_kl_loss=True, kl_loss_type="mse", multi_turn=True),
    "rloo": StepOptions(adv_estimator="rloo"),
    "rloo multi-turn": StepOptions(adv_estimator="rloo", multi_turn=True),
    "reinforce++ baseline": StepOptions(adv_estimator="reinforce_plus_plus_baseline"),
    "reinforce++": StepOptions(adv_estimator="reinforce_plus_plus"),
    "reinforce++ kl in reward k1": StepOptions(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True),
    "reinforce++ kl in reward k3": StepOptions(
        adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, kl_penalty="k3"
    ),
    "gae": StepOptions(adv_estimator="gae"),
    "gae kl in reward low_var_kl": StepOptions(adv_estimator="gae", use_kl_in_reward=True, kl_penalty="low_var_kl"),
    "gae multi-turn discounted": StepOptions(adv_estimator="gae", multi_turn=True, gamma=0.99, lam=0.95),
    "grpo 4 micro-batches": StepOptions(micro_batches=4),
    "gae 2 micro-batches": StepOptions(adv_estimator="gae", micro_batches=2),
    "seq-mean-token-mean": StepOptions(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum": StepOptions(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-sum-norm with its factor": StepOptions(
        loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=64
    ),
    "token-sum": StepOptions(loss_agg_mode="token-sum"),
    "grpo kl in reward": StepOptions(use_kl_in_reward=True),
    "rloo kl in reward k3": StepOptions(adv_estimator="rloo", use_kl_in_reward=True, kl_penalty="k3"),
    "reinforce++ multi-turn": StepOptions(adv_estimator="reinforce_plus_plus", multi_turn=True),
    "no entropy (verl's default)": StepOptions(entropy_coeff=0.0, calculate_entropy=False),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_a_verl_step_replays_clean(name: str, tmp_path: Path) -> None:
    step = build_step(CLEAN[name])
    report = replay(open_sources(write_bundle(step, tmp_path)))
    assert report.status is Status.PASS, (report.first_divergent_stage, report.first_divergence)
    compared = {s.stage for s in report.stages if s.status == "pass" and s.compared > 0}
    assert {"reward.post_process", "advantage.estimate", "loss.policy"} <= compared
    if step.vpreds is not None:
        assert "loss.value" in compared
    if step.reward_kl is not None:
        assert "advantage.kl" in compared


def test_the_bundle_holds_only_valid_tokens_and_one_group_per_uid(tmp_path: Path) -> None:
    step = build_step(StepOptions(multi_turn=True))
    sources = open_sources(write_bundle(step, tmp_path))
    (source,) = sources
    attention = step.batch.batch["attention_mask"]
    valid = attention[:, MAX_PROMPT:].bool()
    assert source.load_payload("old_log_probs").numel() == int(valid.sum())
    # verl's padding holds junk: none of it reaches the bundle
    assert torch.equal(source.load_payload("old_log_probs"), step.batch.batch["old_log_probs"][valid])
    records = source.index.samples
    assert len({r.group_index for r in records}) == PROMPTS
    uids = step.batch.non_tensor_batch["uid"].tolist()
    for i, record in enumerate(records):
        assert record.sample_id.startswith(uids[i])
        assert record.total_length == int(attention[i].sum())
    mask = step.batch.batch["response_mask"]
    assert torch.equal(source.load_payload("loss_mask").bool(), mask[valid].bool())
    assert len(records) == PROMPTS * SAMPLES


def test_grpo_normalized_over_the_whole_batch_is_named_at_reward_post_process(tmp_path: Path) -> None:
    step = build_step(StepOptions(batch_wide_grpo=True))
    report = replay(open_sources(write_bundle(step, tmp_path)))
    assert report.status is Status.DIVERGED
    first_sample = f"{step.batch.non_tensor_batch['uid'][0]}-0"
    assert report.first_divergence == {
        "bundle": "verl-step",
        "stage": "reward.post_process",
        "rank": None,
        "sample": first_sample,
        "field": "reward",
        "token": None,
    }
    # per token it shows downstream, from the first token of the same sample
    estimate = report.stage("advantage.estimate")
    assert estimate.failed
    first = estimate.divergences[0]
    assert (first.field, first.sample_id, first.token_offset) == ("advantages", first_sample, 0)
