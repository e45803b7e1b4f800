"""verl 0.9.1's own losses and metrics against loss.policy and loss.value.

One mini-batch of 16 prompts x 4 samples (steps.py's gae step: left-padded prompts and right-padded responses with
junk in the padding, 8-64 response tokens, observation spans masked out, one response masked out entirely), run
through verl's `ppo_loss` and `value_loss` micro-batch by micro-batch as its engine worker runs them: each dp rank's
micro-batches converted with `left_right_2_no_padding`, with `dp_size`, the global `batch_num_tokens` and
`global_batch_size`, the metrics collected with `append_to_dict` per rank and reduced over ranks with
`Metric.aggregate_dp` (the clip fractions of the critic as plain floats, averaged). Each rank's scalars are the
expected values of its rank of one step bundle, written with `RecomputeConfig.from_profile("verl", ...)`; replay
must pass at default tolerances.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import pytest
import torch
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.config import CriticConfig, FSDPActorConfig
from verl.workers.utils.losses import ppo_loss, value_loss

from tests.integrations.verl.steps import (
    MAX_PROMPT,
    PROMPTS,
    SAMPLES,
    StepOptions,
    VerlStep,
    build_step,
    engine_micro_batch,
)
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    Identity,
    Manifest,
    RankTopology,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.replay import replay

BATCH = PROMPTS * SAMPLES
MASKED_OUT = 9
"""The sample whose every response token is masked out."""
LOSS_SCALE_FACTOR = 64


@pytest.fixture(scope="module")
def step() -> VerlStep:
    built = build_step(StepOptions(adv_estimator="gae", multi_turn=True, masked_out=MASKED_OUT, gamma=0.99, lam=0.95))
    assert not built.batch.batch["response_mask"][MASKED_OUT].any()
    return built


def _tokens(step: VerlStep) -> int:
    return int(step.batch.batch["response_mask"].sum())


def _run_verl(step: VerlStep, actor: FSDPActorConfig, critic: CriticConfig, dp: int, micro: int, entropy: bool):
    """verl's losses over the mini-batch split into `dp` ranks of `micro` micro-batches: per rank its metrics
    (after append_to_dict), and the metrics reported for the step (reduced over ranks as the engine worker does)."""
    per_rank = BATCH // dp
    info = {"dp_size": dp, "batch_num_tokens": _tokens(step), "global_batch_size": BATCH}
    ranks = []
    for r in range(dp):
        metrics: dict[str, Any] = {}
        rows = list(range(r * per_rank, (r + 1) * per_rank))
        size = per_rank // micro
        for m in range(micro):
            data, output = engine_micro_batch(step, rows[m * size : (m + 1) * size], **info)
            policy_output = {"log_probs": output["log_probs"]} | ({"entropy": output["entropy"]} if entropy else {})
            loss, actor_metrics = ppo_loss(actor, policy_output, data)
            append_to_dict(metrics, {**actor_metrics, "loss": loss.item()})
            critic_loss, critic_metrics = value_loss(critic, {"values": output["values"]}, data)
            append_to_dict(metrics, critic_metrics)
        ranks.append(metrics)
    reported = {}
    for key, value in ranks[0].items():
        together = [rank[key] for rank in ranks]
        reported[key] = Metric.aggregate_dp(together) if isinstance(value, Metric) else np.mean(list(chain(*together)))
    return ranks, reported


def _rank_scalars(metrics: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One rank's expected loss.policy and loss.value, from its metrics over its micro-batches."""

    def reduced(key: str) -> float:
        value = metrics[key]
        return float(value.aggregate() if isinstance(value, Metric) else np.mean(value))

    policy = {
        "pg_loss": reduced("actor/pg_loss"),
        "pg_clipfrac": reduced("actor/pg_clipfrac"),
        "ppo_kl": reduced("actor/ppo_kl"),
        "loss": float(np.sum(metrics["loss"])),
    }
    if "actor/entropy_loss" in metrics:
        policy["entropy_loss"] = reduced("actor/entropy_loss")
    if "kl_loss" in metrics:
        policy["kl_loss"] = reduced("kl_loss")
    return {
        "loss.policy": policy,
        "loss.value": {"vf_loss": reduced("critic/vf_loss"), "vf_clipfrac": reduced("critic/vf_clipfrac")},
    }


def _write(tmp_path, step: VerlStep, ranks, config: RecomputeConfig, dp: int, micro: int) -> list:
    """The step bundle: every dp rank a rank, each with its samples' valid tokens and its own scalars."""
    per_rank, size = BATCH // dp, BATCH // dp // micro
    batch = step.batch.batch
    attention = batch["attention_mask"]
    uids = step.batch.non_tensor_batch["uid"].tolist()
    groups = {uid: g for g, uid in enumerate(dict.fromkeys(uids))}
    scores = batch["token_level_scores"].sum(-1)
    per_token = {
        "old_log_probs": batch["old_log_probs"],
        "log_probs": step.log_probs,
        "advantages": batch["advantages"],
        "ref_log_probs": batch["ref_log_prob"],
        "values": batch["values"],
        "vpreds": step.vpreds,
        "returns": batch["returns"],
        "entropy": step.entropy,
    }
    path = tmp_path / "verl-step"
    stages = (StageId.SAMPLE, StageId.LOSS_POLICY, StageId.LOSS_VALUE)
    manifest = Manifest(bundle_id="verl-step", stage_contracts={s: StageContract(stage=s) for s in stages})
    for r in range(dp):
        rows = range(r * per_rank, (r + 1) * per_rank)
        lengths = [int(attention[i, MAX_PROMPT:].sum()) for i in rows]
        records = [
            SampleRecord(
                sample_id=f"s-{i}",
                group_index=groups[uids[i]],
                response_length=n,
                total_length=int(attention[i].sum()),
                loss_mask=batch["response_mask"][i, :n].tolist(),
                raw_reward=float(scores[i]),
                reward=float(scores[i]),
                micro_batch_id=f"mb-{(i - r * per_rank) // size}",
            )
            for i, n in zip(rows, lengths)
        ]
        index = BundleIndex(
            bundle_id="verl-step",
            identity=Identity(actor_step_id=ActorStepId(rollout_id=0, step_id=0), rank=RankTopology(dp=dp)),
            samples=records,
            config=config,
        )
        with_entropy = "entropy_loss" in ranks[r]["loss.policy"]
        payloads = {
            name: torch.cat([tensor[i, :n] for i, n in zip(rows, lengths)])
            for name, tensor in per_token.items()
            if tensor is not None and (name != "entropy" or with_entropy)
        }
        BundleWriter(str(path), manifest, index, ranks[r], rank=r, expected_ranks=list(range(dp))).finalize(
            payloads=payloads
        )
    return open_sources(str(path))


MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
LAYOUTS = {"one-micro-batch": (1, 1), "four-micro-batches": (1, 4), "dp2-two-micro-batches-each": (2, 2)}
ENTROPY = {"no-entropy": (False, 0.0), "entropy-term": (True, 0.01)}


def _configs(mode: str, entropy_coeff: float, use_kl_loss: bool):
    actor = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=SAMPLES,
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=mode,
        entropy_coeff=entropy_coeff,
        use_kl_loss=use_kl_loss,
        kl_loss_coef=0.05,
        loss_scale_factor=LOSS_SCALE_FACTOR if mode == "seq-mean-token-sum-norm" else None,
    )
    critic = CriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=mode,
        loss_scale_factor=actor.loss_scale_factor,
    )
    return actor, critic


def _recompute_config(step, actor: FSDPActorConfig, critic: CriticConfig, dp: int, **fields: Any) -> RecomputeConfig:
    """What the run's options amount to, through the verl profile, with the step's global denominators."""
    denominator = _tokens(step) if actor.loss_agg_mode == "token-mean" else BATCH
    return RecomputeConfig.from_profile(
        "verl",
        loss_agg_mode=actor.loss_agg_mode,
        entropy_coeff=actor.entropy_coeff,
        clip_ratio=actor.clip_ratio,
        clip_ratio_c=actor.clip_ratio_c,
        kl_loss_type=actor.kl_loss_type,
        kl_loss_coef=actor.kl_loss_coef if actor.use_kl_loss else 0.0,
        cliprange_value=critic.cliprange_value,
        loss_denominator=None if actor.loss_agg_mode == "token-sum" else denominator,
        loss_scale_factor=actor.loss_scale_factor,
        loss_scale=float(dp),
        **fields,
    )


@pytest.mark.parametrize("entropy", ENTROPY, ids=list(ENTROPY))
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("mode", MODES)
def test_verl_losses_and_metrics_replay_clean(tmp_path, step, mode, layout, entropy):
    dp, micro = LAYOUTS[layout]
    with_entropy, coeff = ENTROPY[entropy]
    actor, critic = _configs(mode, coeff, use_kl_loss=mode == "token-mean")
    ranks, reported = _run_verl(step, actor, critic, dp, micro, with_entropy)
    scalars = [_rank_scalars(m) for m in ranks]
    # the ranks' scalars make what verl reports for the step: the mean over ranks
    for key, field in (("actor/pg_clipfrac", "pg_clipfrac"), ("actor/ppo_kl", "ppo_kl"), ("actor/pg_loss", "pg_loss")):
        assert reported[key] == pytest.approx(np.mean([s["loss.policy"][field] for s in scalars]), rel=1e-6)
    assert reported["critic/vf_clipfrac"] == pytest.approx(np.mean([s["loss.value"]["vf_clipfrac"] for s in scalars]))
    assert ("entropy_loss" in scalars[0]["loss.policy"]) == with_entropy
    sources = _write(tmp_path, step, scalars, _recompute_config(step, actor, critic, dp), dp, micro)
    report = replay(sources)
    assert report.passed, [(s.stage, s.rank, s.message) for s in report.stages if s.status != "pass"]
    checked = [s for s in report.stages if s.stage in ("loss.policy", "loss.value") and s.status == "pass"]
    assert len(checked) == 2 * dp


@pytest.mark.parametrize("layout", ["four-micro-batches", "dp2-two-micro-batches-each"])
def test_the_clip_metrics_aggregated_like_the_loss_diverge(tmp_path, step, layout):
    dp, micro = LAYOUTS[layout]
    actor, critic = _configs("token-mean", 0.0, use_kl_loss=False)
    ranks, _ = _run_verl(step, actor, critic, dp, micro, entropy=False)
    config = _recompute_config(step, actor, critic, dp, clip_metric_agg="loss_agg_mode")
    report = replay(_write(tmp_path, step, [_rank_scalars(m) for m in ranks], config, dp, micro))
    assert report.first_divergent_stage == "loss.policy"
    failed = [s for s in report.stages if s.status == "fail"]
    assert {d.field for s in failed for d in s.divergences} >= {"pg_clipfrac", "ppo_kl"}
    assert "pg_loss" not in {d.field for s in failed for d in s.divergences}


def test_the_verl_profile_maps_the_aggregation_modes():
    modes = {m: RecomputeConfig.from_profile("verl", loss_agg_mode=m).loss_agg_mode for m in MODES}
    assert modes == {
        "token-mean": "token_mean",
        "seq-mean-token-mean": "seq_mean_token_mean",
        "seq-mean-token-sum": "seq_mean_token_sum",
        "seq-mean-token-sum-norm": "seq_mean_token_sum_scaled",
        "token-sum": "token_sum",
    }
    assert RecomputeConfig.from_profile("verl").clip_metric_agg == "micro_batch_token_mean"
    assert RecomputeConfig().clip_metric_agg == "loss_agg_mode"
