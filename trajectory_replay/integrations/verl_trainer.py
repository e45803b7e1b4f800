"""verl (0.9): capture switched on in a `RayPPOTrainer` by one call, `enable_capture(trainer)`, made once at the end
of the subclass's `init_workers()`. It joins the two sides: the trainer's `_update_critic`/`_update_actor` capture
the batch they are given as the rollout-level bundle (`integrations.verl.rollout_bundle`) through the capture
manager (the training thread only lays it out and enqueues) and tag it with the rollout id and each sample's id
and r', and the worker groups get verl's `ppo_loss`/`value_loss` wrapped by `integrations.verl_loss`, which switch
capture on in each worker process by themselves. Imports verl when called; docs/integrations/verl.md shows the use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trajectory_replay.bundle.schema import RecomputeConfig, SampleRecord
from trajectory_replay.integrations.verl import _MISSING, _container, _get, recompute_config, rollout_bundle
from trajectory_replay.integrations.verl_loss import (
    REWARDS_KEY,
    ROLLOUT_KEY,
    SAMPLE_IDS_KEY,
    WorkerCapture,
    capture_loss,
    capture_value_loss,
)

if TYPE_CHECKING:
    from verl import DataProto

_CAPTURE_VARIABLES = ("TRAJECTORY_REPLAY_", "RELAX_REPLAY_")
"""Prefixes of the environment variables the workers are handed (the capture configuration and the run id)."""

_NOT_CAPTURED: dict[str, tuple[Any, str]] = {
    "algorithm.rollout_correction.rollout_is": (None, "a trainer-side rollout correction is not captured"),
    "algorithm.rollout_correction.rollout_rs": (
        None,
        "the mask before rejection is not visible to the trainer's update; write the rollout-level bundle with "
        "write_rollout_bundle(pre_rejection_mask=...) instead",
    ),
    "distillation.enabled": (False, "the distillation loss is not captured"),
}
"""verl options `enable_capture` cannot capture unless they hold the value given, with the reason."""


def _capture_rollout(
    batch: DataProto, config: RecomputeConfig, rollout_id: int
) -> tuple[bool | None, list[SampleRecord]]:
    """Enqueue `batch` as rollout-level bundle `rollout-<R>` through the capture manager (`capture_rollout`); also
    its sample records, one per row of the batch."""
    import torch

    from trajectory_replay import capture

    laid = rollout_bundle(batch, config, rollout_id)
    samples = laid.samples
    payloads = dict(laid.payloads)
    named = {k: payloads.pop(k, None) for k in ("old_log_probs", "ref_log_probs", "kl", "advantages")}
    if named["kl"] is None:  # a rollout-level capture contracts advantage.kl: no KL reached the rewards
        named["kl"] = torch.zeros_like(payloads["advantages"] if named["advantages"] is None else named["advantages"])
    enqueued = capture.capture_rollout(
        rollout_id,
        sample_ids=[s.sample_id for s in samples],
        group_index=[s.group_index for s in samples],
        response_lengths=[s.response_length for s in samples],
        total_lengths=[s.total_length for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        raw_rewards=[s.raw_reward for s in samples],
        rewards=[s.reward for s in samples],
        config=config,
        mismatch_metrics=laid.expected.get("rollout.mismatch"),
        payloads=payloads,
        **named,
    )
    return enqueued, samples


class TrainerCapture:
    """The trainer side of `enable_capture`: what the wrapped `_update_critic`/`_update_actor` do with the batch
    before verl's own method gets it. The first of them to see rollout R (the trainer's `global_steps`) enqueues
    the rollout-level bundle; each hands verl a shallow copy of the batch with `meta_info["global_steps"]` and the
    `sample_ids` and `sample_rewards` columns set, which the loss wrappers read in the workers (the caller's batch
    is left as it was). Never raises into training: a problem is logged
    and counted (`capture.stats()["errors"]`), and the batch then goes to verl untagged."""

    def __init__(self, trainer: Any, config: RecomputeConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.samples: dict[int, list[SampleRecord]] = {}

    def prepare(self, batch: DataProto) -> DataProto:
        """The batch verl's update is given (see the class docstring)."""
        from trajectory_replay import capture

        manager = capture.get_manager()
        if manager is None:
            return batch
        try:
            rollout_id = int(self.trainer.global_steps)
            if rollout_id not in self.samples:
                self.samples = {rollout_id: _capture_rollout(batch, self.config, rollout_id)[1]}
            return _tagged(batch, rollout_id, self.samples[rollout_id])
        except Exception as exc:
            manager._hook_error("verl enable_capture (the rollout-level bundle)", exc)
            return batch

    def wrap(self, name: str) -> None:
        """Replace the trainer's bound method `name` by one that prepares the batch first."""
        original = getattr(self.trainer, name)

        def update(batch: DataProto) -> DataProto:
            return original(self.prepare(batch))

        update.__name__ = name
        update.__doc__ = original.__doc__
        setattr(self.trainer, name, update)


def _tagged(batch: DataProto, rollout_id: int, samples: list[SampleRecord]) -> DataProto:
    """A shallow copy of `batch` whose meta_info holds the rollout id and whose non-tensor batch each sample's id
    and reward (r') as the rollout-level bundle records them."""
    import numpy as np
    from verl import DataProto

    if len(samples) != len(batch):
        raise ValueError(f"the batch has {len(batch)} rows, the rollout-level bundle {len(samples)} samples")
    non_tensor = dict(batch.non_tensor_batch)
    non_tensor[SAMPLE_IDS_KEY] = np.array([s.sample_id for s in samples], dtype=object)
    non_tensor[REWARDS_KEY] = np.array([s.reward for s in samples], dtype=object)
    meta = dict(batch.meta_info)
    meta[ROLLOUT_KEY] = rollout_id
    return DataProto(batch=batch.batch, non_tensor_batch=non_tensor, meta_info=meta)


def enable_capture(
    trainer: Any,
    store_url: str | os.PathLike[str] | None = None,
    *,
    critic: bool = True,
    environ: Mapping[str, str] | None = None,
    **manager_options: Any,
) -> bool:
    """Switch capture on in a verl `RayPPOTrainer` (`trainer`, after its `init_workers()`); True when it is on.

    With `store_url` capture writes there; without it the capture environment variables decide
    (TRAJECTORY_REPLAY_CAPTURE=1 and TRAJECTORY_REPLAY_CAPTURE_DIR, read from `environ`, default `os.environ`; off
    means nothing changes and False). The driver gets a capture manager for the rollout-level bundles
    (`TrainerCapture`), the actor worker group `ppo_loss` and the critic's `value_loss` wrapped with capture
    (`capture_loss`, `capture_value_loss`), carrying the capture variables (and `manager_options`, which go to every
    `CaptureManager`) so that each worker process switches capture on by itself as its dp rank. `critic=False`
    leaves the critic's loss as it is (no `critic-<R>-<S>` bundles, anchored `critic R:S` and picked by
    `--critic R:S`). A bad capture
    variable raises CaptureConfigError naming it; a verl option capture cannot take a one-line ValueError naming
    it."""

    from trajectory_replay import capture
    from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, load_config

    env = dict(os.environ if environ is None else environ)
    if store_url is not None:
        env.update({ENV_CAPTURE: "1", ENV_DIR: os.fspath(store_url)})
    if not load_config(env).enabled:
        return False
    config = _container(trainer.config)
    for path, (allowed, reason) in _NOT_CAPTURED.items():
        value = _get(config, path)
        if value is not _MISSING and value != allowed:
            raise ValueError(f"verl option {path}={value!r}: {reason}")
    step_config = recompute_config(trainer.config)
    worker = WorkerCapture({k: v for k, v in env.items() if k.startswith(_CAPTURE_VARIABLES)}, dict(manager_options))
    loss_fns: list[tuple[Any, Any]] = [(trainer.actor_rollout_wg, _actor_loss(trainer, capture_loss, worker))]
    critic = critic and bool(getattr(trainer, "use_critic", False))
    if critic:
        loss_fns.append((trainer.critic_wg, _critic_loss(trainer, capture_value_loss, worker)))
    for group, _ in loss_fns:
        if not hasattr(group, "set_loss_fn"):
            raise ValueError(
                "verl option trainer.use_legacy_worker_impl: enable_capture needs verl's engine workers "
                f"(a worker group with set_loss_fn), not {type(group).__name__}"
            )
    capture.maybe_enable_for_actor(0, True, [0], environ=env, **manager_options)
    for group, loss_fn in loss_fns:
        group.set_loss_fn(loss_fn)
    state = TrainerCapture(trainer, step_config)
    state.wrap("_update_actor")
    if getattr(trainer, "use_critic", False):  # the critic's update comes first: it captures the rollout then
        state.wrap("_update_critic")
    return True


def _actor_loss(trainer: Any, wrap: Any, worker: Any) -> Any:
    """verl's `ppo_loss` with capture, bound to the actor's config as verl's engine worker binds it."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    return partial(
        wrap(ppo_loss, worker=worker), config=omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor)
    )


def _critic_loss(trainer: Any, wrap: Any, worker: Any) -> Any:
    """verl's `value_loss` with capture, bound to the critic's config as `init_workers` binds it (the model section
    left out: the loss reads none of it, and building it loads a tokenizer)."""
    from functools import partial

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import value_loss

    section = trainer.config.critic
    options = OmegaConf.masked_copy(section, [k for k in section.keys() if k != "model"])
    return partial(wrap(value_loss, worker=worker), config=omega_conf_to_dataclass(options))


__all__ = ["TrainerCapture", "enable_capture"]
