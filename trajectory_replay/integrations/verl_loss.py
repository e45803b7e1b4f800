"""The trainer side of a verl 0.9 step: `capture_loss` wraps verl's engine loss function so that each micro-batch it
sees is also captured (`capture.capture_microbatch`) and each mini-batch ends in a step-level bundle
(`capture.capture_step_end`) holding this rank's reported scalars, reduced over the micro-batches as verl reduces
them. `capture_value_loss` does the same for the critic's `value_loss`: a critic's step-level bundle
`critic-<R>-<S>` (sample and loss.value) per critic mini-batch.

    from verl.workers.utils.losses import ppo_loss, value_loss
    worker.loss_fn = partial(capture_loss(ppo_loss), config=actor_config)
    critic.loss_fn = partial(capture_value_loss(value_loss), config=critic_config)

A wrapper made with `worker=WorkerCapture(...)` (what `integrations.verl_trainer.enable_capture` sends the workers)
pickles and switches capture on by itself in the process that first calls it, as dp rank r of dp_size producer
ranks.

The wrapper keeps verl's signature `(config, model_output, data, dp_group=None)` and returns exactly what the
wrapped function returns. It owns the mapping of verl's micro-batch `TensorDict` (no-padding layout, as the engine
hands it the loss) onto the capture hooks' per-sample arguments, and of the actor config and the global batch
information (`dp_size`, `batch_num_tokens`, `global_batch_size`, `loss_scale_factor`) onto the step's
`RecomputeConfig`. Capture never raises into training: a problem is logged on `trajectory_replay.capture` and
counted in `capture.stats()["errors"]`; while capture is off (no manager) a call costs one check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from trajectory_replay import capture
from trajectory_replay.bundle import profiles
from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.bundle.stage_io import PRE_REJECTION_MASK, rollout_correction
from trajectory_replay.integrations.verl import actor_options

log = logging.getLogger("trajectory_replay.capture")

ROLLOUT_KEY = "global_steps"
"""The non-tensor entry of verl's batch read as the rollout id when none was set (`LossCapture.set_rollout`)."""

SAMPLE_IDS_KEY = "sample_ids"
"""The per-sample non-tensor column read as each sample's id (`integrations.verl_trainer.enable_capture` adds the
ids of the rollout-level bundle, so that a step chains to its rollout); without it ids are made of the rollout,
step and micro-batch."""

REWARDS_KEY = "sample_rewards"
"""The per-sample non-tensor column read as each sample's reward after post-processing (r', as the rollout-level
bundle records it; `integrations.verl_trainer.enable_capture` adds it), which a chained replay links to the
rollout; without it the score is recorded."""

PRE_REJECTION_KEY = "pre_rejection_mask"
"""The padded tensor column read as each sample's response mask before verl's rollout correction rejected tokens
(`integrations.verl_trainer.enable_capture` adds it when the step rejected, since verl overwrites
`response_mask`); recorded as the step's `pre_rejection_mask` payload."""

_SCALARS = {
    "pg_loss": "actor/pg_loss",
    "pg_clipfrac": "actor/pg_clipfrac",
    "ppo_kl": "actor/ppo_kl",
    "entropy_loss": "actor/entropy_loss",
    "kl_loss": "kl_loss",
}
"""Step-end scalar -> the metric verl's ppo_loss reports it under."""

_VALUE_SCALARS = {"vf_loss": "critic/vf_loss", "vf_clipfrac": "critic/vf_clipfrac"}
"""Critic step-end scalar -> the metric verl's value_loss reports it under."""


@dataclass(frozen=True)
class WorkerCapture:
    """How a worker process switches capture on by itself (picklable: it travels to verl's workers inside the loss
    function): the capture variables (TRAJECTORY_REPLAY_CAPTURE* as the driver resolved them, since a worker need not
    inherit the driver's environment) and further `CaptureManager` options."""

    environ: Mapping[str, str]
    manager_options: Mapping[str, Any] = field(default_factory=dict)

    def enable(self, dp_group: Any, dp_size: int) -> Any:
        """Switch capture on in this process as dp rank r (of `dp_group` when torch.distributed is initialized, else
        0) of `dp_size` producer ranks; the manager, or None when the variables switch it off."""
        return capture.maybe_enable_for_actor(
            _dp_rank(dp_group), True, list(range(dp_size)), environ=dict(self.environ), **dict(self.manager_options)
        )


def _dp_rank(dp_group: Any) -> int:
    """This process's rank in verl's data-parallel group (0 without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return int(dist.get_rank(group=dp_group))


class LossCapture:
    """verl's loss function with capture: one step-level bundle `step-<R>-<S>` per mini-batch of this rank, R the
    rollout id (`set_rollout`, else the batch's `global_steps`), S the mini-batch's number within the rollout.

    A mini-batch ends by itself once this rank has seen `global_batch_size / dp_size` sequences (verl's per-rank
    mini-batch), or by `end_step()`. `overrides` are further `RecomputeConfig.from_profile("verl", ...)` options
    recorded with every step (e.g. verl's rollout correction: `rollout_is`, `rollout_is_threshold`, `rollout_rs`,
    `rollout_rs_threshold`; the micro-batch then gives `rollout_log_probs` and, with rejection, the
    `PRE_REJECTION_KEY` column). With `worker`, the first call in a process where capture is off
    switches it on (`WorkerCapture.enable`); a failure to is logged once and capture stays off."""

    KIND: ClassVar[str] = "step"
    """The kind of step-level bundle written (`capture.records.STEP_KINDS`)."""
    SCALARS: ClassVar[Mapping[str, str]] = _SCALARS
    """Step-end scalar -> the metric the wrapped loss reports it under."""

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        profile: str = "verl",
        worker: WorkerCapture | None = None,
        **overrides: Any,
    ) -> None:
        self.loss_fn = loss_fn
        self.profile = profile
        self.worker = worker
        self.overrides = overrides
        self._enabling = worker is not None
        self._rollout: int | None = None
        self._open: tuple[int, int] | None = None
        self._next_step: dict[int, int] = {}
        self._reset()

    def _reset(self) -> None:
        self._micro = 0
        self._sequences = 0
        self._loss: torch.Tensor | float = 0.0
        self._metrics: dict[str, Any] = {}
        self._groups: dict[str, int] = {}
        self._config: RecomputeConfig | None = None
        self._broken = False

    def set_rollout(self, rollout_id: int) -> None:
        """The rollout id of the steps that follow (overrides the batch's `global_steps`)."""
        self._rollout = int(rollout_id)

    def __call__(self, config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
        result = self.loss_fn(config, model_output, data, dp_group=dp_group)
        manager = capture.get_manager()
        if manager is None:
            if not self._enabling:
                return result
            manager = self._enable(data, dp_group)
            if manager is None:
                return result
        try:
            self._capture(manager, config, model_output, data, result)
        except Exception as exc:
            self._broken = True  # a step missing a micro-batch is not written
            manager._hook_error("verl capture_loss", exc)
        try:
            share = _non_tensor(data, "global_batch_size")
            if self._open is not None and share is not None and self._sequences >= int(share) // int(data["dp_size"]):
                self.end_step()
        except Exception as exc:
            manager._hook_error("verl capture_loss", exc)
        return result

    def _enable(self, data: Any, dp_group: Any) -> Any:
        """Switch capture on in this process (once): the manager, or None."""
        self._enabling = False
        assert self.worker is not None
        try:
            return self.worker.enable(dp_group, int(data["dp_size"]))
        except Exception as exc:
            log.error("capture: could not switch capture on in this worker: %s: %s", type(exc).__name__, exc)
            return None

    def end_step(self) -> bool | None:
        """End the open mini-batch now: enqueue its step-level bundle. None when no step is open or capture is off."""
        manager = capture.get_manager()
        if self._open is None or manager is None:
            self._open = None
            self._reset()
            return None
        key, config, metrics, loss, broken = self._open, self._config, self._metrics, self._loss, self._broken
        self._open = None
        self._reset()
        if broken:
            log.error("capture: verl step (%d, %d) lost a micro-batch; its step-level bundle is not written", *key)
            return False
        try:
            scalars: dict[str, Any] = {name: _reduced(metrics[m]) for name, m in self.SCALARS.items() if m in metrics}
            if self.KIND == "step":
                scalars["loss"] = loss
            return capture.capture_step_end(key[0], key[1], config=config, kind=self.KIND, **scalars)
        except Exception as exc:
            manager._hook_error(f"verl capture_loss step end ({key[0]}, {key[1]})", exc)
            return False

    # ---- one micro-batch --------------------------------------------------------------------------

    def _capture(self, manager: Any, config: Any, model_output: Any, data: Any, result: Any) -> None:
        loss, metrics = result
        if self._open is None:
            rollout = self._rollout if self._rollout is not None else _non_tensor(data, ROLLOUT_KEY)
            if rollout is None:
                raise ValueError(
                    f"no rollout id: call set_rollout(...) or put {ROLLOUT_KEY!r} into the batch's meta_info"
                )
            step = self._next_step.get(int(rollout), 0)
            self._next_step[int(rollout)] = step + 1
            self._open = (int(rollout), step)
        rollout_id, step_id = self._open
        n = int(data.batch_size[0])
        dp_size = int(data["dp_size"])
        self._sequences += n
        if self._config is None:
            self._config = self._recompute_config(config, data, dp_size)
        mb_index, self._micro = self._micro, self._micro + 1
        self._loss = self._loss + loss.detach()
        for key, value in metrics.items():
            if key in self.SCALARS.values():
                self._metrics.setdefault(key, []).append(value)
        mb_id = f"mb-{mb_index:04d}" if not manager.multi_producer else f"mb-{manager.rank}-{mb_index:04d}"
        self._capture_tensors(config, model_output, data, rollout_id, step_id, mb_id)

    def _columns(self, data: Any, rollout_id: int, step_id: int, mb_id: str) -> dict[str, Any]:
        """The micro-batch's per-sample columns as `capture.capture_microbatch` takes them (sample ids, groups,
        valid response and total lengths, scores), the loss masks aside."""
        n = int(data.batch_size[0])
        prompt_lens, response_lens = _lengths(data)
        uids = _per_sample(data, "uid")
        sample_ids = _per_sample(data, SAMPLE_IDS_KEY)
        if sample_ids is None:
            sample_ids = [f"s-{rollout_id}-{step_id}-{mb_id}-{i}" for i in range(n)]
        groups = [self._groups.setdefault(str(u), len(self._groups)) for u in uids] if uids is not None else None
        if groups is None:
            groups = [len(self._groups) + i for i in range(n)]
            self._groups.update({f"\0{mb_id}-{i}": g for i, g in enumerate(groups)})
        scores = _scores(data, response_lens)
        rewards = _per_sample(data, REWARDS_KEY)
        return dict(
            sample_ids=[str(s) for s in sample_ids],
            group_index=groups,
            response_lengths=response_lens,
            total_lengths=[p + r for p, r in zip(prompt_lens, response_lens)],
            raw_rewards=scores,
            rewards=scores if rewards is None else [float(r) for r in rewards],
        )

    def _capture_tensors(
        self, config: Any, model_output: Any, data: Any, rollout_id: int, step_id: int, mb_id: str
    ) -> None:
        """Capture the micro-batch's per-sample columns and per-token payloads (the policy loss's)."""
        from verl.workers.utils.padding import no_padding_2_padding

        columns = self._columns(data, rollout_id, step_id, mb_id)
        lengths = columns["response_lengths"]
        fields = ["response_mask", "old_log_probs", "advantages"]
        fields += ["ref_log_prob"] if config.use_kl_loss else []
        corrected = self._corrected_fields(data)
        padded = data.select(*fields, *corrected).to_padded_tensor()
        log_probs = no_padding_2_padding(model_output["log_probs"], data)
        entropy = model_output.get("entropy", None)
        entropy = None if entropy is None else no_padding_2_padding(entropy, data)

        def rows(t: torch.Tensor) -> list[torch.Tensor]:
            return _rows(t, lengths)

        capture.capture_microbatch(
            rollout_id,
            step_id,
            mb_id,
            loss_masks=[m.to(torch.int64) for m in rows(padded["response_mask"])],
            old_log_probs=rows(padded["old_log_probs"]),
            log_probs=rows(log_probs),
            advantages=rows(padded["advantages"]),
            entropy=None if entropy is None else rows(entropy),
            ref_log_probs=rows(padded["ref_log_prob"]) if config.use_kl_loss else None,
            rollout_log_probs=rows(padded["rollout_log_probs"]) if corrected else None,
            payloads={PRE_REJECTION_MASK: [m.to(torch.uint8) for m in rows(padded[PRE_REJECTION_KEY])]}
            if PRE_REJECTION_KEY in corrected
            else None,
            **columns,
        )

    def _corrected_fields(self, data: Any) -> list[str]:
        """The micro-batch's fields a rollout correction needs (the step's config says whether it has one):
        `rollout_log_probs`, and the mask before rejection when the correction rejects. A micro-batch whose
        correction the config does not describe is refused."""
        assert self._config is not None
        config = self._config
        if "rollout_is_weights" in data.keys() and config.rollout_is == "none":
            raise ValueError(
                "rollout_is_weights in the micro-batch, but the step's config has rollout_is 'none': pass verl's "
                "algorithm.rollout_correction options to capture_loss (rollout_is=..., rollout_is_threshold=...)"
            )
        if not rollout_correction(config):
            return []
        if "rollout_log_probs" not in data.keys():
            raise ValueError("a rollout correction is configured, but the micro-batch holds no rollout_log_probs")
        if config.rollout_rs == "none":
            return ["rollout_log_probs"]
        if PRE_REJECTION_KEY not in data.keys():
            raise ValueError(
                f"rollout_rs={config.rollout_rs!r} rejected tokens from response_mask: the micro-batch needs the mask "
                f"before rejection as its {PRE_REJECTION_KEY!r} column"
            )
        return ["rollout_log_probs", PRE_REJECTION_KEY]

    def _recompute_config(self, config: Any, data: Any, dp_size: int) -> RecomputeConfig:
        """The step's config: the actor's options through the verl profile, with the global loss denominators."""
        options, _ = actor_options(config)
        options.update(
            {
                "loss_denominator": _denominator(config.loss_agg_mode, data),
                "loss_scale": float(dp_size),
                **self.overrides,
            }
        )
        return RecomputeConfig.from_profile(
            self.profile, framework_version=profiles.installed_version(self.profile), **options
        )


class ValueLossCapture(LossCapture):
    """verl's critic loss function with capture: one critic step-level bundle `critic-<R>-<S>` per critic mini-batch
    of this rank (stages sample and loss.value), S counting the critic's mini-batches of rollout R from 0. Each
    micro-batch records the critic's old values (`values`), its current ones (the model output's `values`, as
    `vpreds`), the `returns` and the response mask; the step end verl's `critic/vf_loss` (summed over micro-batches)
    and `critic/vf_clipfrac` (averaged). The config is the critic's options (`loss_agg_mode`, `cliprange_value`,
    `loss_scale_factor`) through the verl profile with the global batch information, estimator gae."""

    KIND: ClassVar[str] = "critic"
    SCALARS: ClassVar[Mapping[str, str]] = _VALUE_SCALARS

    def _capture_tensors(
        self, config: Any, model_output: Any, data: Any, rollout_id: int, step_id: int, mb_id: str
    ) -> None:
        from verl.workers.utils.padding import no_padding_2_padding

        columns = self._columns(data, rollout_id, step_id, mb_id)
        lengths = columns["response_lengths"]
        padded = data.select("values", "returns", "response_mask").to_padded_tensor()
        vpreds = no_padding_2_padding(model_output["values"], data)
        capture.capture_microbatch(
            rollout_id,
            step_id,
            mb_id,
            kind=self.KIND,
            loss_masks=[m.to(torch.int64) for m in _rows(padded["response_mask"], lengths)],
            old_log_probs=None,
            log_probs=None,
            advantages=None,
            values=_rows(padded["values"], lengths),
            vpreds=_rows(vpreds, lengths),
            returns=_rows(padded["returns"], lengths),
            **columns,
        )

    def _recompute_config(self, config: Any, data: Any, dp_size: int) -> RecomputeConfig:
        """The critic step's config: the critic's options through the verl profile, with the global denominators."""
        options: dict[str, Any] = {
            "adv_estimator": "gae",
            "loss_agg_mode": config.loss_agg_mode,
            "cliprange_value": config.cliprange_value,
            "loss_scale_factor": config.loss_scale_factor,
            "loss_denominator": _denominator(config.loss_agg_mode, data),
            "loss_scale": float(dp_size),
            **self.overrides,
        }
        return RecomputeConfig.from_profile(
            self.profile, framework_version=profiles.installed_version(self.profile), **options
        )


def capture_loss(
    loss_fn: Callable[..., Any], *, profile: str = "verl", worker: WorkerCapture | None = None, **overrides: Any
) -> LossCapture:
    """verl's engine loss function `loss_fn` (`verl.workers.utils.losses.ppo_loss`) with capture (`LossCapture`)."""
    return LossCapture(loss_fn, profile=profile, worker=worker, **overrides)


def capture_value_loss(
    loss_fn: Callable[..., Any], *, profile: str = "verl", worker: WorkerCapture | None = None, **overrides: Any
) -> ValueLossCapture:
    """verl's critic loss function `loss_fn` (`verl.workers.utils.losses.value_loss`) with capture
    (`ValueLossCapture`)."""
    return ValueLossCapture(loss_fn, profile=profile, worker=worker, **overrides)


def _denominator(mode: str, data: Any) -> int | None:
    """The global loss denominator verl hands `agg_loss` for aggregation `mode`: `batch_num_tokens` (token-mean),
    `global_batch_size` (seq-mean modes), else None."""
    value = None
    if mode == "token-mean":
        value = _non_tensor(data, "batch_num_tokens")
    elif mode.startswith("seq-mean"):
        value = _non_tensor(data, "global_batch_size")
    return None if value is None else int(value)


def _rows(tensor: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Each sample's first `lengths[i]` values of a padded (samples, width) tensor."""
    return [tensor[i, :n].detach() for i, n in enumerate(lengths)]


def _non_tensor(data: Any, key: str) -> Any:
    from verl.utils import tensordict_utils as tu

    value = tu.get_non_tensor_data(data=data, key=key, default=None)
    return value.item() if isinstance(value, torch.Tensor) else value


def _per_sample(data: Any, key: str) -> list[Any] | None:
    """A per-sample non-tensor column of the micro-batch (verl's uid strings, sample ids), or None."""
    if key not in data.keys():
        return None
    value = data.get(key)
    listed = value.tolist() if hasattr(value, "tolist") else list(value)
    return list(listed)


def _lengths(data: Any) -> tuple[list[int], list[int]]:
    """Each sample's prompt and valid response length, as verl's no_padding_2_padding reads them."""
    prompts, responses = data["prompts"], data["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().tolist(), responses.offsets().diff().tolist()
    attention = data["attention_mask"]
    width = prompts.shape[1]
    return attention[:, :width].sum(-1).tolist(), attention[:, width:].sum(-1).tolist()


def _scores(data: Any, response_lens: list[int]) -> list[float]:
    """Each sample's score (`token_level_scores` summed over its response) when the batch carries it, else 0.0: a
    step-level bundle compares no reward."""
    if "token_level_scores" not in data.keys():
        return [0.0] * len(response_lens)
    scores = data.select("token_level_scores").to_padded_tensor()["token_level_scores"]
    return [float(scores[i, :n].sum()) for i, n in enumerate(response_lens)]


def _reduced(values: list[Any]) -> float:
    """This rank's value of a metric over its micro-batches, as verl aggregates a `Metric` (its own sum or mean)."""
    from verl.utils.metric import Metric

    merged: Metric | None = None
    plain: list[float] = []
    for value in values:
        if isinstance(value, Metric):
            if merged is None:
                merged = Metric(value.aggregation)
            merged.extend(value)
        else:
            plain.append(float(value))
    if merged is not None:
        return float(merged.aggregate())
    return float(sum(plain) / len(plain))


__all__ = ["LossCapture", "ValueLossCapture", "WorkerCapture", "capture_loss", "capture_value_loss"]
