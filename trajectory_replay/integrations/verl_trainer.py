"""verl (0.9): capture switched on in a `RayPPOTrainer` by one call, `enable_capture(trainer)`, made once at the end
of the subclass's `init_workers()`. It joins the two sides: the trainer's `_update_critic`/`_update_actor` capture
the batch they are given as the rollout-level bundle (`integrations.verl.rollout_bundle`) through the capture
manager (the training thread only lays it out and enqueues) and tag it with the rollout id and each sample's id
and r', and the worker groups get verl's `ppo_loss`/`value_loss` wrapped by `integrations.verl_loss`, which switch
capture on in each worker process by themselves. Two driver-side taps see what `fit` keeps in its locals: verl's
rollout correction (`CorrectionTap`, in place of `rollout_corr_helper.compute_rollout_correction_and_add_to_batch`,
which `fit` imports in its body at each step) gives the mask before rejection and the `rollout_corr/*` metrics, and an
adaptive reward-side KL controller (`KLTap`) the coefficient that penalized the batch. This module is the one place
that relies on verl's internals; `enable_capture` checks them against verl's installed source and refuses in one line
when they changed. Imports verl when called; docs/integrations/verl.md shows the use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trajectory_replay.bundle.schema import RecomputeConfig, SampleRecord
from trajectory_replay.integrations.verl import _MISSING, _container, _get, recompute_config, rollout_bundle
from trajectory_replay.integrations.verl_loss import (
    PRE_REJECTION_KEY,
    REWARDS_KEY,
    ROLLOUT_KEY,
    SAMPLE_IDS_KEY,
    WorkerCapture,
    capture_loss,
    capture_value_loss,
)

if TYPE_CHECKING:
    import torch
    from verl import DataProto

_CAPTURE_VARIABLES = ("TRAJECTORY_REPLAY_", "RELAX_REPLAY_")
"""Prefixes of the environment variables the workers are handed (the capture configuration and the run id)."""

_NOT_CAPTURED: dict[str, tuple[Any, str]] = {
    "distillation.enabled": (False, "the distillation loss is not captured"),
}
"""verl options `enable_capture` cannot capture unless they hold the value given, with the reason."""

CORRECTION = "algorithm.rollout_correction"
"""The trainer config's section of verl's rollout correction."""

_CORRECTION_OPTIONS = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")
"""The rollout-correction options the step-level capture records with each step (the actor's loss applies the
importance weights and trains on the mask after rejection)."""

_CORRECTION_MODULE = "verl.trainer.ppo.rollout_corr_helper"
_CORRECTION_FUNCTION = "compute_rollout_correction_and_add_to_batch"
_CORRECTION_IMPORT = f"from {_CORRECTION_MODULE} import {_CORRECTION_FUNCTION}"
"""What verl 0.9's `RayPPOTrainer.fit` runs, in its body, before `compute_advantage` when the batch holds
`rollout_log_probs`: the import is made at each step, so the module attribute `CorrectionTap` replaces is what fit
calls."""

_KL_READ, _KL_UPDATE = "beta = kl_ctrl.value", "kl_ctrl.update("
"""verl 0.9's `apply_kl_penalty` reads the coefficient (`beta`) before it updates the controller: the value that
penalized the batch is the controller's value when `update` is called."""
_KL_CALL = "kl_ctrl=self.kl_ctrl_in_reward"
"""How `fit` hands `apply_kl_penalty` the trainer's controller."""


def _capture_rollout(
    batch: DataProto,
    config: RecomputeConfig,
    rollout_id: int,
    pre_rejection_mask: torch.Tensor | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> tuple[bool | None, list[SampleRecord]]:
    """Enqueue `batch` as rollout-level bundle `rollout-<R>` through the capture manager (`capture_rollout`); also
    its sample records, one per row of the batch."""
    import torch

    from trajectory_replay import capture

    laid = rollout_bundle(batch, config, rollout_id, pre_rejection_mask=pre_rejection_mask, metrics=metrics)
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
    """The driver side of `enable_capture`: what the wrapped `_update_critic`/`_update_actor` do with the batch
    before verl's own method gets it, and what the driver's taps keep for it. The first of them to see rollout R
    (the trainer's `global_steps`) enqueues the rollout-level bundle; each hands verl a shallow copy of the batch
    with `meta_info["global_steps"]` and the `sample_ids` and `sample_rewards` columns set (and, when rollout
    correction rejected tokens, the `pre_rejection_mask` column), which the loss wrappers read in the workers (the
    caller's batch is left as it was). With rollout correction, `CorrectionTap` hands it the mask before rejection
    and verl's `rollout_corr/*` metrics of rollout R (`corrected`); with an adaptive reward-side KL controller,
    `KLTap` the coefficient that penalized rollout R (`kl_used`). Never raises into training: a problem is logged
    and counted (`capture.stats()["errors"]`), and the batch then goes to verl untagged."""

    def __init__(self, trainer: Any, config: RecomputeConfig, *, adaptive_kl: bool = False) -> None:
        self.trainer = trainer
        self.config = config
        self.adaptive_kl = adaptive_kl
        self.manager: Any = None
        self.samples: dict[int, list[SampleRecord]] = {}
        self.corrections: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = {}
        self.kl_coefs: dict[int, float] = {}

    def corrected(self, before: torch.Tensor, after: torch.Tensor, metrics: Mapping[str, Any]) -> None:
        """verl's rollout correction of the current rollout: the response mask before and after its rejection, and
        the metrics it returned (kept until that rollout's bundle is laid out; only the latest rollout's)."""
        self.corrections = {int(self.trainer.global_steps): (before, after.clone(), dict(metrics))}

    def kl_used(self, value: float) -> None:
        """The reward-side KL coefficient `apply_kl_penalty` penalized the current rollout with."""
        self.kl_coefs = {int(self.trainer.global_steps): float(value)}

    def _config(self, rollout_id: int) -> RecomputeConfig:
        """The rollout's config: the trainer's, with the coefficient that penalized it under an adaptive KL."""
        if not self.adaptive_kl:
            return self.config
        if rollout_id not in self.kl_coefs:
            raise ValueError(
                f"no reward-side KL coefficient was recorded for rollout {rollout_id}: apply_kl_penalty did not "
                "update trainer.kl_ctrl_in_reward"
            )
        return recompute_config(self.trainer.config, kl_coef=self.kl_coefs[rollout_id])

    def prepare(self, batch: DataProto) -> DataProto:
        """The batch verl's update is given (see the class docstring)."""
        from trajectory_replay import capture

        manager = capture.get_manager()
        if manager is None:
            return batch
        try:
            rollout_id = int(self.trainer.global_steps)
            before = self._pre_rejection_mask(batch, rollout_id)
            if rollout_id not in self.samples:
                metrics = self.corrections[rollout_id][2] if rollout_id in self.corrections else None
                laid = _capture_rollout(batch, self._config(rollout_id), rollout_id, before, metrics)[1]
                self.samples = {rollout_id: laid}
            return _tagged(batch, rollout_id, self.samples[rollout_id], before)
        except Exception as exc:
            manager._hook_error("verl enable_capture (the rollout-level bundle)", exc)
            return batch

    def _pre_rejection_mask(self, batch: DataProto, rollout_id: int) -> torch.Tensor | None:
        """The mask before rejection of rollout `rollout_id`, when its correction rejected any token; the batch's
        response mask must be the one the correction left."""
        import torch

        if rollout_id not in self.corrections:
            return None
        before, after, _ = self.corrections[rollout_id]
        if not torch.equal(batch.batch["response_mask"], after):
            raise ValueError(
                f"the batch of rollout {rollout_id} is not the one verl's rollout correction returned (its "
                "response_mask differs)"
            )
        return None if torch.equal(before, after) else before

    def wrap(self, name: str) -> None:
        """Replace the trainer's bound method `name` by one that prepares the batch first."""
        original = getattr(self.trainer, name)

        def update(batch: DataProto) -> DataProto:
            return original(self.prepare(batch))

        update.__name__ = name
        update.__doc__ = original.__doc__
        setattr(self.trainer, name, update)


class CorrectionTap:
    """verl's `compute_rollout_correction_and_add_to_batch`, installed in its module (`verl.trainer.ppo.
    rollout_corr_helper`) in the driver process while capture is on: it calls verl's function and hands the
    trainer's `TrainerCapture` the response mask from before (verl overwrites it with the rejection) and after,
    with the metrics verl returned. Returns exactly what verl's function returns; once capture is off (or another
    capture manager is on) its first call puts verl's function back."""

    def __init__(self, original: Any, state: TrainerCapture) -> None:
        self.original = original
        self.state = state
        self.__name__ = _CORRECTION_FUNCTION
        self.__doc__ = original.__doc__

    @classmethod
    def install(cls, state: TrainerCapture) -> CorrectionTap:
        """Install a tap for `state` in verl's module (in place of verl's function, or of an earlier tap)."""
        import importlib

        module = importlib.import_module(_CORRECTION_MODULE)
        current = getattr(module, _CORRECTION_FUNCTION)
        tap = cls(current.original if isinstance(current, CorrectionTap) else current, state)
        setattr(module, _CORRECTION_FUNCTION, tap)
        return tap

    def uninstall(self) -> None:
        """Put verl's function back (when this tap is the one installed)."""
        import importlib

        module = importlib.import_module(_CORRECTION_MODULE)
        if getattr(module, _CORRECTION_FUNCTION) is self:
            setattr(module, _CORRECTION_FUNCTION, self.original)

    def __call__(self, batch: DataProto, rollout_corr_config: Any) -> Any:
        from trajectory_replay import capture

        manager = capture.get_manager()
        if manager is None or manager is not self.state.manager:
            self.uninstall()
            return self.original(batch, rollout_corr_config)
        before = batch.batch["response_mask"].clone()
        result = self.original(batch, rollout_corr_config)
        try:
            corrected, metrics = result
            self.state.corrected(before, corrected.batch["response_mask"], metrics)
        except Exception as exc:
            manager._hook_error("verl enable_capture (the rollout correction)", exc)
        return result


class KLTap:
    """The `update` of the trainer's adaptive reward-side KL controller (`trainer.kl_ctrl_in_reward`), installed on
    the controller while capture is on: verl's `apply_kl_penalty` penalizes the batch with the controller's value
    and then updates it, so the value at `update` is the one that penalized the current rollout; handed to the
    trainer's `TrainerCapture`, then the controller's own update runs. Once capture is off its first call removes
    it."""

    def __init__(self, controller: Any, state: TrainerCapture) -> None:
        self.controller = controller
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from trajectory_replay import capture

        manager = capture.get_manager()
        if manager is not None and manager is self.state.manager:
            self.state.kl_used(self.controller.value)
        elif self.controller.__dict__.get("update") is self:
            del self.controller.update
        return type(self.controller).update(self.controller, *args, **kwargs)


def _check_correction(trainer: Any, config: Mapping[str, Any]) -> None:
    """Refuse (one line naming the option) when rollout correction is on and the trainer's `fit` does not call verl's
    correction through its module as verl 0.9's does (the tap would see nothing)."""
    import inspect

    for option in ("rollout_is", "rollout_rs"):
        value = _get(config, f"{CORRECTION}.{option}")
        if value not in (_MISSING, None, "none", ""):
            break
    else:
        return
    fit = type(trainer).fit
    if _CORRECTION_IMPORT not in inspect.getsource(fit):
        raise ValueError(
            f"verl option {CORRECTION}.{option}={value!r}: {fit.__qualname__} does not run `{_CORRECTION_IMPORT}` "
            "in its body, so the mask before rejection and the rollout_corr metrics cannot be captured"
        )


def _check_adaptive_kl(trainer: Any, config: Mapping[str, Any]) -> bool:
    """True when the reward-side KL coefficient is adaptive (then `KLTap` records it); refuses (one line naming the
    option) when verl's `apply_kl_penalty` or the trainer's `fit` no longer use the controller as verl 0.9 does."""
    import inspect

    kind = _get(config, "algorithm.kl_ctrl.type")
    if _get(config, "algorithm.use_kl_in_reward") is not True or kind in (_MISSING, "fixed"):
        return False
    from verl.trainer.ppo import ray_trainer

    penalty = inspect.getsource(ray_trainer.apply_kl_penalty)
    fit = inspect.getsource(type(trainer).fit)
    sound = _KL_READ in penalty and _KL_UPDATE in penalty and penalty.index(_KL_READ) < penalty.index(_KL_UPDATE)
    if not (sound and _KL_CALL in fit and hasattr(trainer, "kl_ctrl_in_reward")):
        raise ValueError(
            f"verl option algorithm.kl_ctrl.type={kind!r}: verl's apply_kl_penalty no longer reads "
            "trainer.kl_ctrl_in_reward.value before updating it, so the coefficient of a step cannot be recorded"
        )
    return True


def _tagged(
    batch: DataProto, rollout_id: int, samples: list[SampleRecord], before: torch.Tensor | None = None
) -> DataProto:
    """A shallow copy of `batch` whose meta_info holds the rollout id and whose non-tensor batch each sample's id
    and reward (r') as the rollout-level bundle records them; with `before`, its tensors also the mask before
    rejection (`PRE_REJECTION_KEY`)."""
    import numpy as np
    from verl import DataProto

    if len(samples) != len(batch):
        raise ValueError(f"the batch has {len(batch)} rows, the rollout-level bundle {len(samples)} samples")
    non_tensor = dict(batch.non_tensor_batch)
    non_tensor[SAMPLE_IDS_KEY] = np.array([s.sample_id for s in samples], dtype=object)
    non_tensor[REWARDS_KEY] = np.array([s.reward for s in samples], dtype=object)
    meta = dict(batch.meta_info)
    meta[ROLLOUT_KEY] = rollout_id
    tensors = batch.batch
    if before is not None:
        tensors = tensors.clone(recurse=False)
        tensors[PRE_REJECTION_KEY] = before
    return DataProto(batch=tensors, non_tensor_batch=non_tensor, meta_info=meta)


def _driver_policy(env: Mapping[str, str], options: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The capture variables and manager options of the driver's manager. It writes only rollout-level bundles;
    under a flight-recorder policy (recorder:K) the workers spool their step bundles and promote the kept ones,
    but a worker's recorder never holds the rollout-level bundles the driver wrote, so the driver writes every
    rollout-level bundle to the store (policy all) and a promoted step always finds its rollout there."""
    from trajectory_replay.capture.config import ENV_POLICY, choose_policy

    if choose_policy(env, options.get("policy")).kind != "recorder":
        return dict(env), dict(options)
    return {k: v for k, v in env.items() if k != ENV_POLICY}, {**options, "policy": "all"}


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
    `--critic R:S`). A capture policy (`policy=` or TRAJECTORY_REPLAY_CAPTURE_POLICY) applies to the workers' step
    bundles; under recorder:K the driver still writes every rollout-level bundle (`_driver_policy`). A bad capture
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
    _check_correction(trainer, config)
    adaptive_kl = _check_adaptive_kl(trainer, config)
    step_config = recompute_config(trainer.config, kl_coef=trainer.kl_ctrl_in_reward.value if adaptive_kl else None)
    worker = WorkerCapture({k: v for k, v in env.items() if k.startswith(_CAPTURE_VARIABLES)}, dict(manager_options))
    correction = {k: v for k in _CORRECTION_OPTIONS if (v := _get(config, f"{CORRECTION}.{k}")) is not _MISSING}
    actor_loss = _actor_loss(trainer, capture_loss, worker, correction)
    loss_fns: list[tuple[Any, Any]] = [(trainer.actor_rollout_wg, actor_loss)]
    critic = critic and bool(getattr(trainer, "use_critic", False))
    if critic:
        loss_fns.append((trainer.critic_wg, _critic_loss(trainer, capture_value_loss, worker)))
    for group, _ in loss_fns:
        if not hasattr(group, "set_loss_fn"):
            raise ValueError(
                "verl option trainer.use_legacy_worker_impl: enable_capture needs verl's engine workers "
                f"(a worker group with set_loss_fn), not {type(group).__name__}"
            )
    driver_env, driver_options = _driver_policy(env, manager_options)
    manager = capture.maybe_enable_for_actor(0, True, [0], environ=driver_env, **driver_options)
    for group, loss_fn in loss_fns:
        group.set_loss_fn(loss_fn)
    state = TrainerCapture(trainer, step_config, adaptive_kl=adaptive_kl)
    state.manager = manager
    CorrectionTap.install(state)
    if adaptive_kl:
        trainer.kl_ctrl_in_reward.update = KLTap(trainer.kl_ctrl_in_reward, state)
    state.wrap("_update_actor")
    if getattr(trainer, "use_critic", False):  # the critic's update comes first: it captures the rollout then
        state.wrap("_update_critic")
    return True


def _actor_loss(trainer: Any, wrap: Any, worker: Any, correction: Mapping[str, Any]) -> Any:
    """verl's `ppo_loss` with capture (recording the rollout-correction options `correction` with each step),
    bound to the actor's config as verl's engine worker binds it."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss

    return partial(
        wrap(ppo_loss, worker=worker, **correction),
        config=omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor),
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


__all__ = ["CorrectionTap", "KLTap", "TrainerCapture", "enable_capture"]
