"""A verl step (steps.py) written as one bundle through the public writer API: `BundleWriter` with the models of
`trajectory_replay.bundle.schema`, the config from `RecomputeConfig.from_profile("verl", ...)` with verl's own option
names. Every sample's valid response tokens are flattened (padding dropped), uid strings become group indices in
order of first appearance, r' is what verl's advantages hold at a sample's first loss token (the grouped estimators)
or the score itself (the token-reward estimators), and the reward-side KL is recorded as apply_kl_penalty formed it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.integrations.verl.steps import MAX_PROMPT, SAMPLES, VerlStep
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)

GROUPED = ("grpo", "rloo")
"""verl estimators whose advantages hold r' on every loss token (no whitening after the group baseline)."""


def recompute_config(step: VerlStep) -> RecomputeConfig:
    """The verl options of `step` through the verl profile."""
    o = step.options
    options: dict[str, Any] = {
        "adv_estimator": o.adv_estimator,
        "norm_adv_by_std_in_grpo": o.norm_adv_by_std_in_grpo,
        "loss_agg_mode": o.loss_agg_mode,
        "loss_scale_factor": o.loss_scale_factor,
        "clip_ratio_low": o.clip_ratio_low,
        "clip_ratio_high": o.clip_ratio_high,
        "entropy_coeff": o.entropy_coeff,
        "use_kl_in_reward": o.use_kl_in_reward,
        "kl_penalty": o.kl_penalty,
        "kl_coef": o.kl_coef if o.use_kl_in_reward else 0.0,
        "kl_loss_coef": o.kl_loss_coef if o.use_kl_loss else 0.0,
        "kl_loss_type": o.kl_loss_type,
        "n_samples_per_prompt": SAMPLES,
        "gamma": o.gamma,
        "lam": o.lam,
    }
    return RecomputeConfig.from_profile("verl", **options)


def _flat(tensor: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The valid response tokens of every row, concatenated in row order."""
    return tensor[valid.bool()].to(torch.float32)


def write_bundle(step: VerlStep, root: Path | str, bundle_id: str = "verl-step") -> str:
    """Write `step` under `root` as bundle `bundle_id`; returns its path."""
    batch = step.batch.batch
    valid = batch["attention_mask"][:, MAX_PROMPT:]
    mask = batch["response_mask"]
    lengths = valid.sum(-1).tolist()
    prompt_lengths = batch["attention_mask"][:, :MAX_PROMPT].sum(-1).tolist()
    uids = step.batch.non_tensor_batch["uid"].tolist()
    groups = {uid: g for g, uid in enumerate(dict.fromkeys(uids))}
    raw = batch["token_level_scores"].sum(-1).tolist()
    advantages = batch["advantages"]
    estimator = step.options.adv_estimator
    baseline = raw
    if estimator == "reinforce_plus_plus_baseline":  # r' = score - its uid group's mean, before verl whitens
        by_uid: dict[str, list[float]] = {}
        for uid, r in zip(uids, raw):
            by_uid.setdefault(uid, []).append(r)
        baseline = [r - sum(by_uid[uid]) / len(by_uid[uid]) for uid, r in zip(uids, raw)]
    micro = {i: f"mb-{k:04d}" for k, rows in enumerate(step.micro_batches) for i in rows}
    records = []
    for i, uid in enumerate(uids):
        first = int(mask[i].nonzero()[0]) if mask[i].any() else 0
        records.append(
            SampleRecord(
                sample_id=f"{uid}-{i % SAMPLES}",
                group_index=groups[uid],
                response_length=lengths[i],
                total_length=prompt_lengths[i] + lengths[i],
                loss_mask=mask[i, : lengths[i]].tolist(),
                raw_reward=raw[i],
                reward=float(advantages[i, first]) if estimator in GROUPED else baseline[i],
                micro_batch_id=micro[i],
            )
        )
    config = recompute_config(step)
    # verl forms a reward-side KL only with use_kl_in_reward: without it there is no advantage.kl to compare
    stages = [StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS]
    stages += [StageId.ADVANTAGE_KL] if step.reward_kl is not None else []
    stages += [StageId.ADVANTAGE_ESTIMATE, StageId.LOSS_POLICY]
    payloads = {
        "old_log_probs": _flat(batch["old_log_probs"], valid),
        "ref_log_probs": _flat(batch["ref_log_prob"], valid),
        "log_probs": _flat(step.log_probs, valid),
        "advantages": _flat(advantages, valid),
    }
    if step.entropy is not None:
        payloads["entropy"] = _flat(step.entropy, valid)
    if step.reward_kl is not None:
        payloads["kl"] = _flat(step.reward_kl, valid)
    if step.vpreds is not None:
        stages.append(StageId.LOSS_VALUE)
        payloads.update(
            values=_flat(batch["values"], valid),
            vpreds=_flat(step.vpreds, valid),
            returns=_flat(batch["returns"], valid),
        )
    m = step.policy_metrics
    policy = {
        "loss": m["loss"],
        "pg_loss": m["actor/pg_loss"],
        "entropy_loss": m.get("actor/entropy_loss", 0.0),
        "pg_clipfrac": m["actor/pg_clipfrac"],
        "ppo_kl": m["actor/ppo_kl"],
    }
    if "kl_loss" in m:
        policy["kl_loss"] = m["kl_loss"]
    expected: dict[str, Any] = {
        "reward.raw": {"raw_rewards": raw},
        "reward.post_process": {"rewards": [r.reward for r in records]},
        "loss.policy": policy,
    }
    if step.value_metrics:
        expected["loss.value"] = {
            "vf_loss": step.value_metrics["critic/vf_loss"],
            "vf_clipfrac": step.value_metrics["critic/vf_clipfrac"],
        }
    index = BundleIndex(bundle_id=bundle_id, identity=Identity(rollout_id=0), samples=records, config=config)
    manifest = Manifest(bundle_id=bundle_id, stage_contracts={s: StageContract(stage=s) for s in stages})
    path = f"{root}/{bundle_id}"
    writer = BundleWriter(path, manifest, index, expected)
    writer.finalize(payloads=payloads)
    return path
