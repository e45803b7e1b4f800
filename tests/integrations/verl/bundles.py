"""A verl step (steps.py) written as one bundle: the rollout side through the adapter
(`trajectory_replay.integrations.verl.rollout_bundle`: valid tokens only, uid -> group, r', the reward-side KL),
the config from `RecomputeConfig.from_profile("verl", ...)` with verl's own option names, and the trainer side (the
actor's forward outputs, micro-batch ids and the loss scalars verl reported) added to it; or the rollout side alone
(`write_rollout`), rollout correction included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integrations.verl.steps import SAMPLES, VerlStep
from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.integrations.verl import rollout_bundle


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
        **dict(o.rollout_correction),
    }
    return RecomputeConfig.from_profile("verl", **options)


def write_rollout(
    step: VerlStep,
    root: Path | str,
    *,
    config: RecomputeConfig | None = None,
    bundle_id: str = "rollout-1",
    metrics: dict[str, float] | None = None,
) -> str:
    """Write the rollout side of `step` through the adapter (`rollout_bundle`, with the mask before rejection and
    verl's rollout-correction metrics) under `root`; `config` defaults to the step's own, `metrics` to the ones verl
    computed. Returns its path."""
    bundle = rollout_bundle(
        step.batch,
        config or recompute_config(step),
        1,
        bundle_id=bundle_id,
        pre_rejection_mask=step.pre_rejection_mask,
        metrics=step.rollout_corr_metrics if metrics is None else metrics,
    )
    return bundle.write(root)


def sample_id(step: VerlStep, row: int) -> str:
    """The adapter's sample id of the batch's `row` (the uid and the index within its group)."""
    return f"{step.batch.non_tensor_batch['uid'][row]}-{row % SAMPLES}"


def write_bundle(step: VerlStep, root: Path | str, bundle_id: str = "verl-step") -> str:
    """Write `step` under `root` as bundle `bundle_id`: the adapter's rollout side, with the trainer side (the
    current log-probs, entropy and vpreds, the micro-batches and the loss scalars verl reported) added; returns its
    path."""
    bundle = rollout_bundle(step.batch, recompute_config(step), 0, bundle_id=bundle_id)
    micro = {i: f"mb-{k:04d}" for k, rows in enumerate(step.micro_batches) for i in rows}
    for row, record in zip(bundle.rows, bundle.samples):
        record.micro_batch_id = micro[row]
    bundle.stages.append(StageId.LOSS_POLICY)
    bundle.payloads["log_probs"] = bundle.flat(step.log_probs)
    if step.entropy is not None:
        bundle.payloads["entropy"] = bundle.flat(step.entropy)
    if step.vpreds is not None:
        bundle.stages.append(StageId.LOSS_VALUE)
        bundle.payloads["vpreds"] = bundle.flat(step.vpreds)
    m = step.policy_metrics
    policy = {
        "loss": m["loss"],
        "pg_loss": m["actor/pg_loss"],
        "pg_clipfrac": m["actor/pg_clipfrac"],
        "ppo_kl": m["actor/ppo_kl"],
    }
    if "actor/entropy_loss" in m:  # verl reports it only when it computes entropy
        policy["entropy_loss"] = m["actor/entropy_loss"]
    if "kl_loss" in m:
        policy["kl_loss"] = m["kl_loss"]
    bundle.expected["loss.policy"] = policy
    if step.value_metrics:
        bundle.expected["loss.value"] = {
            "vf_loss": step.value_metrics["critic/vf_loss"],
            "vf_clipfrac": step.value_metrics["critic/vf_clipfrac"],
        }
    return bundle.write(root)
