"""verl (0.9): the trainer's config as a `RecomputeConfig`, and a batch after `compute_advantage` as a rollout-level
bundle. Imports verl (and torch) when called; docs/integrations/verl.md shows the use.

- `recompute_config(verl_config)`: the trainer config (an OmegaConf `DictConfig` or a plain mapping with the keys
  of verl's `ppo_trainer.yaml`) through the `verl` profile, with verl's feature gates applied (`use_kl_loss` off
  means no KL loss, `use_kl_in_reward` off means no reward-side KL) and the installed verl version recorded. An
  option no field expresses is a one-line ValueError naming the verl option by its path in the config.
- `rollout_bundle(batch, config, rollout_id)` / `write_rollout_bundle(...)`: the `DataProto` verl holds after
  `compute_advantage`, laid out as a bundle: each sample's valid response tokens only, uid strings as group
  indices, stable sample ids, r' as verl's estimator saw it, the reward-side KL as `apply_kl_penalty` formed it,
  the masks and importance weights of rollout correction when the batch holds them; the padding samples verl's
  `pad_dataproto_to_divisor` appended (`pad_size` of them, at the end) are dropped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.profiles import installed_version
from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)

if TYPE_CHECKING:
    import torch
    from verl import DataProto

PROFILE = "verl"

GROUPED = ("grpo", "rloo")
"""verl estimators whose advantages hold r' on every loss token (no whitening after the group baseline)."""

SAMPLE_ID_KEY = "sample_id"
"""The non-tensor batch key whose strings become sample ids when the batch has it."""

_OPTIONS: dict[str, str] = {
    "algorithm.adv_estimator": "adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo": "norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward": "use_kl_in_reward",
    "algorithm.kl_penalty": "kl_penalty",
    "algorithm.gamma": "gamma",
    "algorithm.lam": "lam",
    "algorithm.rollout_correction.rollout_is": "rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "rollout_is_threshold",
    "algorithm.rollout_correction.rollout_rs": "rollout_rs",
    "algorithm.rollout_correction.rollout_rs_threshold": "rollout_rs_threshold",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "rollout_is_batch_normalize",
    "algorithm.rollout_correction.bypass_mode": "bypass_mode",
    "actor_rollout_ref.rollout.n": "n_samples_per_prompt",
    "critic.cliprange_value": "cliprange_value",
}
"""verl config paths -> the verl profile's option names, where the value is taken as verl holds it (the actor's
options: `actor_options`)."""

ACTOR = "actor_rollout_ref.actor"
"""The trainer config's section of the actor's options, which verl's engine worker hands its loss as ActorConfig."""

_ACTOR_OPTIONS: dict[str, str] = {
    "clip_ratio_c": "clip_ratio_c",
    "loss_agg_mode": "loss_agg_mode",
    "entropy_coeff": "entropy_coeff",
    "kl_loss_type": "kl_loss_type",
    "policy_loss.loss_mode": "loss_mode",
    "loss_scale_factor": "loss_scale_factor",
}
"""Keys of the actor's section -> the verl profile's option names, where the value is taken as verl holds it."""

_REFUSED: dict[str, tuple[Any, str]] = {
    "algorithm.use_pf_ppo": (False, "replay has no priority-weighted resampling of the batch"),
}
"""verl options replay cannot express unless they hold the value given, with the reason."""

_VERL_KL = {"k1": "kl", "k2": "mse", "k3": "k3", "abs": "abs", "low_var_kl": "low_var_kl"}
"""Our KL estimator names -> verl's `kl_penalty` names."""


def _container(verl_config: Any) -> Mapping[str, Any]:
    """A plain nested mapping of `verl_config` (an OmegaConf config is resolved)."""
    if not isinstance(verl_config, Mapping):
        raise TypeError(f"a verl trainer config is a mapping or an OmegaConf DictConfig, not {type(verl_config)}")
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return verl_config
    if isinstance(verl_config, DictConfig):
        container = OmegaConf.to_container(verl_config, resolve=True)
        assert isinstance(container, dict)
        return {str(k): v for k, v in container.items()}
    return verl_config


_MISSING = object()


def _get(config: Mapping[str, Any], path: str) -> Any:
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def actor_options(actor: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The verl profile's options of the actor's section (`actor_rollout_ref.actor` of the trainer config, or the
    ActorConfig verl hands its loss), with verl's own rules: `clip_ratio_low`/`clip_ratio_high` fall back to
    `clip_ratio`, and `kl_loss_coef` reaches nothing unless `use_kl_loss`. Also each option's key in the section,
    for the messages that name it."""
    options: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, name in _ACTOR_OPTIONS.items():
        value = _get(actor, key)
        if value is not _MISSING:
            options[name], keys[name] = value, key
    clip = _get(actor, "clip_ratio")
    for side in ("low", "high"):
        value = _get(actor, f"clip_ratio_{side}")
        value = clip if value in (None, _MISSING) else value
        if value not in (None, _MISSING):
            options[f"clip_ratio_{side}"], keys[f"clip_ratio_{side}"] = value, f"clip_ratio_{side}"
    if _get(actor, "use_kl_loss") is True:
        value = _get(actor, "kl_loss_coef")
        options["kl_loss_coef"], keys["kl_loss_coef"] = (0.001 if value is _MISSING else value), "kl_loss_coef"
    else:
        options["kl_loss_coef"] = 0.0
    return options, keys


def recompute_config(verl_config: Any, *, kl_coef: float | None = None) -> RecomputeConfig:
    """The recompute config of a verl trainer config (see the module docstring). `kl_coef`: the reward-side KL
    coefficient the step used, needed with `algorithm.kl_ctrl.type=adaptive` (verl changes it every step).

    ValueError in one line naming the verl option for a value no field expresses."""
    config = _container(verl_config)
    for path, (allowed, reason) in _REFUSED.items():
        value = _get(config, path)
        if value is not _MISSING and value != allowed:
            raise ValueError(f"verl option {path}={value!r}: {reason}")
    options: dict[str, Any] = {}
    names: dict[str, str] = {}
    for path, name in _OPTIONS.items():
        value = _get(config, path)
        if value is not _MISSING:
            options[name], names[name] = value, path
    actor = _get(config, ACTOR)
    found, keys = actor_options(actor if isinstance(actor, Mapping) else {})
    options.update(found)
    names.update({name: f"{ACTOR}.{key}" for name, key in keys.items()})
    if _get(config, "algorithm.use_kl_in_reward") is True:
        kind = _get(config, "algorithm.kl_ctrl.type")
        if kind not in (_MISSING, "fixed") and kl_coef is None:
            raise ValueError(
                f"verl option algorithm.kl_ctrl.type={kind!r}: the coefficient changes every step; "
                "pass the step's coefficient as kl_coef="
            )
        value = _get(config, "algorithm.kl_ctrl.kl_coef") if kl_coef is None else kl_coef
        options["kl_coef"] = 0.001 if value is _MISSING else value
        names["kl_coef"] = "algorithm.kl_ctrl.kl_coef"
    else:
        options["kl_coef"] = 0.0
    try:
        return RecomputeConfig.from_profile(PROFILE, framework_version=installed_version(PROFILE), **options)
    except ValueError as exc:
        raise ValueError(_by_path(str(exc), names)) from None


def _by_path(message: str, names: Mapping[str, str]) -> str:
    """A profile's refusal with the option named by its path in the verl config."""
    for name, path in sorted(names.items(), key=lambda item: -len(item[0])):
        for spelled in (f"verl option {name}=", f"config field {name}="):
            if spelled in message:
                return message.replace(spelled, f"verl option {path}=", 1)
    return message


@dataclass
class RolloutBundle:
    """A verl batch laid out as a bundle: its records, payloads, stages and the values verl computed; `write`
    stores it. A caller may add stages and payloads (the trainer side) before writing."""

    bundle_id: str
    rollout_id: int
    config: RecomputeConfig
    samples: list[SampleRecord]
    stages: list[StageId]
    payloads: dict[str, torch.Tensor]
    expected: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    """The batch row of each sample (padding rows are left out)."""
    valid: torch.Tensor | None = None
    """The batch's valid response tokens, (rows, response width)."""

    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """A padded per-response-token tensor of the batch, (rows, response width), as a payload: the valid tokens
        of every kept row, in sample order, as float32."""
        assert self.valid is not None
        rows = tensor[self.rows]
        return rows[self.valid[self.rows].bool()].float()

    def write(self, store_url: str | os.PathLike[str], **storage_options: Any) -> str:
        """Write the bundle under the store at `store_url` (a path or URL); returns the bundle's address."""
        path = f"{os.fspath(store_url).rstrip('/')}/{self.bundle_id}"
        index = BundleIndex(
            bundle_id=self.bundle_id,
            identity=Identity(rollout_id=self.rollout_id),
            samples=self.samples,
            config=self.config,
        )
        manifest = Manifest(bundle_id=self.bundle_id, stage_contracts={s: StageContract(stage=s) for s in self.stages})
        writer = BundleWriter(path, manifest, index, self.expected, **storage_options)
        writer.finalize(payloads=self.payloads)
        return path


def _sample_ids(batch: DataProto, rows: list[int], uids: list[str]) -> list[str]:
    """Stable sample ids: the batch's `SAMPLE_ID_KEY` strings, else the uid and the index within its group."""
    if SAMPLE_ID_KEY in batch.non_tensor_batch:
        ids = [str(batch.non_tensor_batch[SAMPLE_ID_KEY][i]) for i in rows]
    else:
        seen: dict[str, int] = {}
        ids = []
        for uid in uids:
            ids.append(f"{uid}-{seen.get(uid, 0)}")
            seen[uid] = seen.get(uid, 0) + 1
    if len(set(ids)) != len(ids):
        raise ValueError("the verl batch gives two samples the same sample id")
    return ids


def rollout_bundle(
    batch: DataProto,
    config: RecomputeConfig,
    rollout_id: int,
    *,
    bundle_id: str | None = None,
    pre_rejection_mask: torch.Tensor | None = None,
    metrics: Mapping[str, Any] | None = None,
    pad_size: int = 0,
) -> RolloutBundle:
    """The rollout-level bundle of `batch`, a verl `DataProto` after `compute_advantage` (see the module
    docstring). `pre_rejection_mask`: the response mask before rollout correction rejected tokens, needed when the
    batch holds `rollout_log_probs` and `config` rejects (verl overwrites `response_mask`); `metrics`: verl's step
    metrics, whose `rollout_corr/kl` and `rollout_corr/k3_kl` become rollout.mismatch's expected values;
    `pad_size`: the padding rows `pad_dataproto_to_divisor` appended, left out."""
    import torch
    from verl.trainer.ppo import core_algos

    tensors = batch.batch
    response_mask = tensors["response_mask"]
    width = response_mask.shape[-1]
    valid = tensors["attention_mask"][:, -width:]
    rows = list(range(len(batch) - pad_size))
    uids = [str(u) for u in batch.non_tensor_batch["uid"][: len(rows)]]
    groups = {uid: g for g, uid in enumerate(dict.fromkeys(uids))}
    lengths = valid.sum(-1).tolist()
    totals = tensors["attention_mask"].sum(-1).tolist()
    raw = tensors["token_level_scores"].sum(-1).tolist()
    scores = tensors["token_level_rewards"].sum(-1).tolist()
    advantages = tensors["advantages"]
    estimator = config.advantage_estimator
    if estimator in GROUPED:  # r' as the estimator broadcast it over the sample's loss tokens
        first = [int(response_mask[i].nonzero()[0]) if response_mask[i].any() else 0 for i in rows]
        post = [float(advantages[i, t]) for i, t in zip(rows, first)]
    elif estimator == "reinforce_plus_plus_baseline":  # the score less its uid group's mean, before verl whitens
        by_uid: dict[str, list[float]] = {}
        for uid, score in zip(uids, scores):
            by_uid.setdefault(uid, []).append(score)
        post = [score - sum(by_uid[uid]) / len(by_uid[uid]) for uid, score in zip(uids, scores)]
    else:  # token-reward estimators take the score, and the KL per token
        post = [raw[i] for i in rows]
    ids = _sample_ids(batch, rows, uids)
    samples = [
        SampleRecord(
            sample_id=ids[k],
            group_index=groups[uids[k]],
            response_length=lengths[i],
            total_length=totals[i],
            loss_mask=response_mask[i, : lengths[i]].tolist(),
            raw_reward=raw[i],
            reward=post[k],
        )
        for k, i in enumerate(rows)
    ]
    out = RolloutBundle(
        bundle_id=bundle_id or f"rollout-{rollout_id}",
        rollout_id=rollout_id,
        config=config,
        samples=samples,
        stages=[StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS],
        payloads={},
        expected={
            "reward.raw": {"raw_rewards": [raw[i] for i in rows]},
            "reward.post_process": {"rewards": post},
        },
        rows=rows,
        valid=valid,
    )
    out.payloads["old_log_probs"] = out.flat(tensors["old_log_probs"])
    if "ref_log_prob" in tensors.keys():
        out.payloads["ref_log_probs"] = out.flat(tensors["ref_log_prob"])
    if config.kl_in_reward and config.kl_coef != 0:  # the KL apply_kl_penalty formed (it keeps only the rewards)
        kl = core_algos.kl_penalty(
            tensors["old_log_probs"], tensors["ref_log_prob"], kl_penalty=_VERL_KL[config.kl_loss_type]
        )
        out.payloads["kl"] = out.flat(kl)
        out.stages.append(StageId.ADVANTAGE_KL)
    out.stages.append(StageId.ADVANTAGE_ESTIMATE)
    out.payloads["advantages"] = out.flat(advantages)
    if "values" in tensors.keys():
        out.payloads["values"] = out.flat(tensors["values"])
        out.payloads["returns"] = out.flat(tensors["returns"])
    if "rollout_log_probs" in tensors.keys():
        if pre_rejection_mask is None and config.rollout_rs != "none":
            raise ValueError(
                f"rollout_rs={config.rollout_rs!r} rejected tokens from response_mask: pass the mask from before "
                "rollout correction as pre_rejection_mask="
            )
        before = response_mask if pre_rejection_mask is None else pre_rejection_mask
        out.stages.insert(1, StageId.ROLLOUT_MISMATCH)
        out.payloads["rollout_log_probs"] = out.flat(tensors["rollout_log_probs"])
        out.payloads["pre_rejection_mask"] = out.flat(before).to(torch.uint8)
        if "rollout_is_weights" in tensors.keys():
            out.payloads["rollout_is_weights"] = out.flat(tensors["rollout_is_weights"])
        if metrics is not None and "rollout_corr/kl" in metrics:
            out.expected["rollout.mismatch"] = {
                "kl_k1": float(metrics["rollout_corr/kl"]),
                "kl_k3": float(metrics["rollout_corr/k3_kl"]),
            }
    return out


def write_rollout_bundle(
    batch: DataProto,
    config: RecomputeConfig,
    store_url: str | os.PathLike[str],
    rollout_id: int,
    *,
    bundle_id: str | None = None,
    pre_rejection_mask: torch.Tensor | None = None,
    metrics: Mapping[str, Any] | None = None,
    pad_size: int = 0,
    **storage_options: Any,
) -> str:
    """Write `batch` (a verl `DataProto` after `compute_advantage`) as the rollout-level bundle `rollout_bundle`
    lays out, under the store at `store_url`; returns the bundle's address."""
    bundle = rollout_bundle(
        batch,
        config,
        rollout_id,
        bundle_id=bundle_id,
        pre_rejection_mask=pre_rejection_mask,
        metrics=metrics,
        pad_size=pad_size,
    )
    return bundle.write(store_url, **storage_options)


__all__ = ["RolloutBundle", "recompute_config", "rollout_bundle", "write_rollout_bundle"]
