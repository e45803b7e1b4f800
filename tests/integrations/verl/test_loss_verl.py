"""verl 0.9.1's own losses and metrics against loss.policy and loss.value.

One mini-batch of 16 prompts x 4 samples (left-padded prompts and right-padded responses with junk in the padding,
8-64 response tokens, observation spans masked out, one response masked out entirely), GRPO advantages from
verl's `compute_grpo_outcome_advantage`, run through verl's `ppo_loss` and `value_loss` micro-batch by
micro-batch as its engine worker runs them: each dp rank's micro-batches converted with `left_right_2_no_padding`,
with `dp_size`, the global `batch_num_tokens` and `global_batch_size`, the metrics collected with
`append_to_dict` per rank and reduced over ranks with `Metric.aggregate_dp` (the clip fractions of the critic as
plain floats, averaged). Each rank's scalars are the expected values of its rank of one step bundle, written with
`RecomputeConfig.from_profile("verl", ...)`; replay must pass at default tolerances.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.config import CriticConfig, FSDPActorConfig
from verl.workers.utils.losses import ppo_loss, value_loss
from verl.workers.utils.padding import left_right_2_no_padding

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

PROMPTS, SAMPLES = 16, 4
BATCH = PROMPTS * SAMPLES
PROMPT_WIDTH, RESPONSE_WIDTH = 12, 64
MASKED_OUT = 9
"""The sample whose every response token is masked out."""
LOSS_SCALE_FACTOR = 64


def _step(seed: int = 0) -> dict[str, Any]:
    """The padded tensors of one mini-batch, and its valid response lengths."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(3, PROMPT_WIDTH + 1, (BATCH,), generator=g)
    response_lens = torch.randint(8, RESPONSE_WIDTH + 1, (BATCH,), generator=g)
    prompt_mask = (torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - prompt_lens[:, None]).long()  # left-padded
    response_attention = (torch.arange(RESPONSE_WIDTH) < response_lens[:, None]).long()  # right-padded
    response_mask = response_attention.clone()
    for i in range(0, BATCH, 3):  # a tool observation in some responses: attended, not trained on
        start = int(torch.randint(1, int(response_lens[i]) - 2, (1,), generator=g))
        response_mask[i, start : start + 3] = 0
    response_mask[MASKED_OUT] = 0
    junk = torch.randn((BATCH, RESPONSE_WIDTH), generator=g) * 1e3  # padding holds garbage, never read

    def per_token(scale: float, shift: float = 0.0) -> torch.Tensor:
        values = torch.randn((BATCH, RESPONSE_WIDTH), generator=g) * scale + shift
        return torch.where(response_attention.bool(), values, junk)

    old = per_token(0.5, -1.5).clamp(max=-0.01)
    current = torch.where(response_attention.bool(), old + torch.randn(old.shape, generator=g) * 0.3, junk)
    scores = torch.zeros((BATCH, RESPONSE_WIDTH))
    scores[torch.arange(BATCH), response_lens - 1] = torch.randint(0, 2, (BATCH,), generator=g).float()
    uid = np.array([f"prompt-{i // SAMPLES}" for i in range(BATCH)], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(scores, response_mask, uid)
    return {
        "prompts": torch.where(prompt_mask.bool(), torch.randint(5, 1000, prompt_mask.shape, generator=g), 0),
        "responses": torch.randint(5, 1000, (BATCH, RESPONSE_WIDTH), generator=g),
        "prompt_mask": prompt_mask,
        "response_attention": response_attention,
        "response_mask": response_mask,
        "old_log_probs": old,
        "log_probs": current,
        "advantages": torch.where(response_attention.bool(), advantages, junk),
        "entropy": per_token(0.3, 1.0).abs(),
        "ref_log_prob": per_token(0.5, -1.5),
        "values": per_token(1.0),
        "vpreds": per_token(1.0),
        "returns": per_token(1.0),
        "scores": scores.sum(-1),
        "prompt_lens": prompt_lens,
        "response_lens": response_lens,
    }


@pytest.fixture(scope="module")
def step() -> dict[str, Any]:
    return _step()


def _micro_batch(step: dict[str, Any], rows: list[int], info: dict[str, Any]):
    """(the TensorDict verl's engine hands the loss for these rows, model outputs over the packed sequences)."""
    t = {k: v[rows] for k, v in step.items() if isinstance(v, torch.Tensor)}
    attention = torch.cat([t["prompt_mask"], t["response_attention"]], dim=1)
    proto = DataProto.from_dict(
        tensors={
            "prompts": t["prompts"],
            "responses": t["responses"],
            "input_ids": torch.cat([t["prompts"], t["responses"]], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": t["response_mask"],
            "old_log_probs": t["old_log_probs"],
            "advantages": t["advantages"],
            "ref_log_prob": t["ref_log_prob"],
            "values": t["values"],
            "returns": t["returns"],
        }
    )
    data = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(data, **info)

    def packed(name: str) -> torch.Tensor:
        """The model's per-token output over each packed sequence, shifted as a causal LM's (position p predicts
        token p + 1), the prompt positions junk."""
        parts = []
        for i in range(len(rows)):
            p, r = int(t["prompt_lens"][i]), int(t["response_lens"][i])
            part = torch.full((p + r,), 7.0)
            part[p - 1 : p - 1 + r] = t[name][i, :r]
            parts.append(part)
        return torch.cat(parts)

    return data, packed


def _run_verl(step, actor: FSDPActorConfig, critic: CriticConfig, dp: int, micro: int, entropy: bool):
    """verl's losses over the mini-batch split into `dp` ranks of `micro` micro-batches: per rank its metrics
    (after append_to_dict), and the metrics reported for the step (reduced over ranks as the engine worker does)."""
    per_rank = BATCH // dp
    batch_num_tokens = int(step["response_mask"].sum())
    info = {"dp_size": dp, "batch_num_tokens": batch_num_tokens, "global_batch_size": BATCH}
    ranks = []
    for r in range(dp):
        metrics: dict[str, Any] = {}
        rows = list(range(r * per_rank, (r + 1) * per_rank))
        size = per_rank // micro
        for m in range(micro):
            data, packed = _micro_batch(step, rows[m * size : (m + 1) * size], info)
            output = {"log_probs": packed("log_probs")} | ({"entropy": packed("entropy")} if entropy else {})
            loss, actor_metrics = ppo_loss(actor, output, data)
            append_to_dict(metrics, {**actor_metrics, "loss": loss.item()})
            critic_loss, critic_metrics = value_loss(critic, {"values": packed("vpreds")}, data)
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


def _write(tmp_path, step, ranks, config: RecomputeConfig, dp: int, micro: int) -> list:
    """The step bundle: every dp rank a rank, each with its samples' valid tokens and its own scalars."""
    per_rank, size = BATCH // dp, BATCH // dp // micro
    path = tmp_path / "verl-step"
    stages = (StageId.SAMPLE, StageId.LOSS_POLICY, StageId.LOSS_VALUE)
    manifest = Manifest(bundle_id="verl-step", stage_contracts={s: StageContract(stage=s) for s in stages})
    for r in range(dp):
        rows = range(r * per_rank, (r + 1) * per_rank)
        lengths = [int(step["response_lens"][i]) for i in rows]
        records = [
            SampleRecord(
                sample_id=f"s-{i}",
                group_index=i // SAMPLES,
                response_length=n,
                total_length=n + int(step["prompt_lens"][i]),
                loss_mask=step["response_mask"][i, :n].tolist(),
                raw_reward=float(step["scores"][i]),
                reward=float(step["scores"][i]),
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
        payloads = {
            name: torch.cat([step[name][i, :n] for i, n in zip(rows, lengths)])
            for name in ("old_log_probs", "log_probs", "advantages", "ref_log_prob", "values", "vpreds", "returns")
            + (("entropy",) if "entropy_loss" in ranks[r]["loss.policy"] else ())
        }
        payloads["ref_log_probs"] = payloads.pop("ref_log_prob")
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
    denominator = int(step["response_mask"].sum()) if actor.loss_agg_mode == "token-mean" else BATCH
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
