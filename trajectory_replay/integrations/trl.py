"""TRL (1.16): capture a `GRPOTrainer`'s generations and optimizer steps as bundles, switched on with one line.

    from trajectory_replay.integrations.trl import enable_capture
    enable_capture(trainer, "s3://bucket/run-42")          # before trainer.train()

`enable_capture` attaches a `TrlCapture` to the trainer instance: every generation batch becomes a rollout-level
bundle `rollout-<R>` (R counts the trainer's generation batches from 0) and every optimizer step fed from it a
step-level bundle `step-<R>-<S>` (S counts the optimizer steps fed from generation batch R, iterations included),
written asynchronously by a `CaptureManager` (any store URL; each process of a multi-process run is a producer
rank of the same bundles). The recompute config is TRL's own options through the `trl` profile
(`RecomputeConfig.from_profile("trl", loss_type=..., beta=..., ...)`), the installed TRL version recorded, with the
denominators TRL's `_compute_loss` divides by (`loss_config`). Settings no bundle reproduces are refused in one
line naming the TRL option, when capture is enabled (`refusals`).

What TRL computed is recorded as it computed it: the rewards it normalized, its advantages, the reference and old
log-probs of the generation batch, the current log-probs and entropies of each micro-batch, the loss each
`compute_loss` returned, and the metrics it logged for the step (clip ratios, `kl`, `entropy`). Sample and group
identity survive TRL's shuffle and split of the generation batch: each row carries its rollout and its position
in the batch gathered over processes (TRL's group is that position // num_generations).

TRL offers public seams for part of this (`compute_loss`, the trainer callbacks, the inputs `compute_loss` is
handed); the rest exists only inside private methods. Those are touched in ONE place, `TrlInternals`, checked when
capture is enabled against the methods and parameters TRL 1.16.0 has: a TRL that changed them is refused in one
line naming what changed. Capture never raises into training after that: a problem is logged on
`trajectory_replay.capture` and counted in `stats()["errors"]`.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.capture.config import ENV_SPOOL, choose_policy, parse_spool
from trajectory_replay.capture.manager import CaptureManager

log = logging.getLogger("trajectory_replay.capture")

PROFILE = "trl"

TESTED_VERSION = "1.16.0"
"""The TRL release whose private methods `TrlInternals` was written against."""

ROWS_KEY = "trajectory_replay_rows"
"""The column added to TRL's generation batch: per row, its rollout id and its position in the batch gathered over
processes. TRL shuffles and splits it with the other columns; `compute_loss` ignores it."""

ALWAYS = (
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "delta",
    "num_generations",
    "scale_rewards",
    "use_bias_correction_kl",
    "importance_sampling_level",
    "mask_truncated_completions",
    "top_entropy_quantile",
)
"""Options recorded whatever their value (None, TRL's "not set", left out: `epsilon_high` then follows `epsilon` as
in TRL); the others only where the run sets them otherwise than GRPOConfig's default."""

OPTIONS = ALWAYS + ("entropy_coef", "multi_objective_aggregation", "off_policy_mask_threshold")
"""The GRPOConfig options that shape advantages or the loss, handed to the `trl` profile under TRL's names."""

METRICS = {"pg_clipfrac": ("clip_ratio/region_mean", "cispo_clip_ratio"), "kl_loss": ("kl",), "entropy": ("entropy",)}
"""Step scalar -> the metrics `_compute_loss` logs it under (one per micro-batch), by loss type where they differ."""


def refusals(trainer: Any) -> list[str]:
    """One line per setting of `trainer` that capture cannot record so that replay reproduces it, each naming the TRL
    option (empty: capture can be enabled)."""
    args = trainer.args
    out = []
    if getattr(args, "use_vllm", False):
        out.append("TRL option use_vllm=True: the engine's log-probs and vLLM importance sampling are not captured")
    if getattr(args, "use_adaptive_entropy", False):
        out.append(
            "TRL option use_adaptive_entropy=True: the entropy coefficient changes every step and is not recorded"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        out.append("TRL option router_aux_loss_coef: the router's auxiliary loss is not captured")
    ga, spg = int(args.gradient_accumulation_steps), int(args.steps_per_generation)
    if ga > spg:
        out.append(
            f"TRL option gradient_accumulation_steps={ga} > steps_per_generation={spg}: one optimizer step would "
            "span several generation batches"
        )
    if args.loss_type == "bnpo" and ga > 1:
        out.append(
            f"TRL option loss_type='bnpo' with gradient_accumulation_steps={ga}: each micro-batch is a token mean of "
            "its own, which no recorded denominator expresses"
        )
    return out


def recompute_config(args: Any) -> RecomputeConfig:
    """The recompute config of a `GRPOConfig` (TRL's options through the `trl` profile, the installed TRL version
    recorded), without the per-step denominators (`loss_config`). ValueError in one line naming a TRL option whose
    value no field expresses."""
    return RecomputeConfig.from_profile(PROFILE, framework_version=version("trl"), **trl_options(args))


def trl_options(args: Any) -> dict[str, Any]:
    """The options of `OPTIONS` a `GRPOConfig` holds, by TRL's names: `ALWAYS`, and the others where they differ
    from GRPOConfig's defaults (None left out)."""
    defaults = {f.name: f.default for f in _dataclass_fields(type(args))}
    options = {}
    for name in OPTIONS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in ALWAYS or name not in defaults or value != defaults[name]:
            options[name] = value
    return options


def _dataclass_fields(cls: type) -> list[Any]:
    import dataclasses

    return list(dataclasses.fields(cls))


def loss_config(
    base: RecomputeConfig, args: Any, *, rows: int, num_items_in_batch: float, num_processes: int, on_policy: bool
) -> RecomputeConfig:
    """`base` with the denominators of one optimizer step of this process, as TRL 1.16's `_compute_loss` divides
    (each micro-batch's loss over `gradient_accumulation_steps` (GA) of them summed):

    - grpo: each row's masked token mean, over the rows of the micro-batch (empty rows included) and GA: the step's
      rows (`loss_denominator`);
    - dr_grpo: the masked token sum over rows x max_completion_length x GA (`loss_scale_factor`);
    - dapo, cispo: the masked token sum over `num_items_in_batch` (the generation batch's tokens over every
      process) / processes x GA / steps_per_generation (`loss_denominator`);
    - bnpo: the micro-batch's own token mean (GA 1 only: `refusals`).

    With several processes TRL logs its clip ratios and entropy only as token means over every process
    (`metrics_per_rank` false): the step records no rank's own.
    """
    ga, spg = int(args.gradient_accumulation_steps), int(args.steps_per_generation)
    update: dict[str, Any] = {"expect_on_policy": on_policy, "metrics_per_rank": num_processes == 1}
    if args.loss_type == "grpo":
        update["loss_denominator"] = float(rows)
    elif args.loss_type == "dr_grpo":
        update["loss_scale_factor"] = float(rows * int(args.max_completion_length))
    elif args.loss_type in ("dapo", "cispo"):
        update["loss_denominator"] = max(float(num_items_in_batch), 1.0) / num_processes * ga / spg
    return base.model_copy(update=update)


class TrlInternals:
    """Every use of TRL's private methods and state, in one place: the calls that exist only inside
    `GRPOTrainer` (TRL 1.16.0) and that capture needs.

    - `_calculate_rewards` returns each reward function's rewards of the generation batch gathered over processes
      (NaN where a function returned None): the rewards TRL normalizes.
    - `_generate_and_score_completions` returns the generation batch before TRL shuffles and splits it: the column
      `ROWS_KEY` is added to it there, and the rollout-level bundle taken from it.
    - `_get_per_token_logps_and_entropies`, called by `_compute_loss` with `compute_entropy=True`, gives the current
      log-probs and entropies of the micro-batch.
    - `_metrics` holds the metrics `_compute_loss` logs (clip ratios, kl, entropy), one value per micro-batch.

    `check` refuses, in one line naming what changed, a TRL whose methods lack the parameters used here."""

    METHODS: Mapping[str, tuple[str, ...]] = {
        "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        "_generate_and_score_completions": ("inputs",),
        "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep"),
    }

    ATTRIBUTES = ("_metrics", "reward_weights", "accelerator", "num_generations")

    @classmethod
    def check(cls, trainer: Any) -> None:
        """ValueError in one line when `trainer` lacks a method, a parameter or an attribute used here."""
        installed = version("trl")
        for name, params in cls.METHODS.items():
            method = getattr(trainer, name, None)
            if method is None:
                raise ValueError(_changed(installed, f"GRPOTrainer has no {name}"))
            signature = inspect.signature(method).parameters
            missing = [p for p in params if p not in signature]
            if missing:
                raise ValueError(_changed(installed, f"GRPOTrainer.{name} has no parameter {missing[0]}"))
        if "compute_entropy" not in inspect.signature(trainer._get_per_token_logps_and_entropies).parameters:
            raise ValueError(
                _changed(installed, "GRPOTrainer._get_per_token_logps_and_entropies has no parameter compute_entropy")
            )
        for name in cls.ATTRIBUTES:
            if not hasattr(trainer, name):
                raise ValueError(_changed(installed, f"GRPOTrainer has no {name}"))

    def __init__(self, trainer: Any, capture: TrlCapture) -> None:
        self.check(trainer)
        self.trainer = trainer
        self.capture = capture
        self.rewards_per_func: torch.Tensor | None = None
        self.current: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.in_loss = False
        calculate = trainer._calculate_rewards
        generate = trainer._generate_and_score_completions
        logps = trainer._get_per_token_logps_and_entropies

        def _calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            rewards = calculate(*args, **kwargs)
            self.rewards_per_func = rewards
            return rewards

        def _generate_and_score_completions(inputs: Any) -> Any:
            self.rewards_per_func = None
            output = generate(inputs)
            if trainer.model.training and self.rewards_per_func is not None:
                self.capture.generated(output, self.rewards_per_func)
            return output

        def _get_per_token_logps_and_entropies(*args: Any, **kwargs: Any) -> Any:
            result = logps(*args, **kwargs)
            if self.in_loss and kwargs.get("compute_entropy"):
                self.current = (result[0].detach(), None if result[1] is None else result[1].detach())
            return result

        trainer._calculate_rewards = _calculate_rewards
        trainer._generate_and_score_completions = _generate_and_score_completions
        trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies

    def metric_count(self) -> dict[str, int]:
        """How many values each logged training metric holds now."""
        return {k: len(v) for k, v in self.trainer._metrics["train"].items()}

    def metrics_since(self, counts: Mapping[str, int]) -> dict[str, list[float]]:
        """The training metrics logged since `counts` (`metric_count`)."""
        return {k: list(v[counts.get(k, 0) :]) for k, v in self.trainer._metrics["train"].items()}

    def raw_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Each row's reward as TRL normalizes it (`sum_then_normalize`): the weighted sum of its reward functions'
        values over those that gave one, NaN where none did."""
        weights = self.trainer.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards


def _changed(installed: str, what: str) -> str:
    return f"TRL {installed}: {what} (capture uses it as TRL {TESTED_VERSION} has it)"


@dataclass
class _Rollout:
    """What capture keeps of one generation batch for the steps it feeds (this process's rows)."""

    first_row: int
    sample_ids: list[str]
    groups: list[int]
    raw_rewards: list[float]
    rewards: list[float]
    """Each row's post-processed reward r': its advantage, as TRL normalized it (0 for an unscorable row)."""
    prompt_lengths: list[int]
    next_step: int = 0


@dataclass
class _Step:
    rollout_id: int
    step_id: int
    micro_batches: int = 0
    rows: int = 0
    loss: torch.Tensor | float = 0.0
    num_items_in_batch: float = 0.0
    on_policy: bool = True
    metrics: dict[str, list[float]] = field(default_factory=dict)
    broken: bool = False


class TrlCapture:
    """Capture attached to one `GRPOTrainer` (made by `enable_capture`). `manager` writes the bundles; `close()`
    writes what is queued and stops it."""

    KEEP_ROLLOUTS = 8
    """Generation batches kept for the steps they feed (TRL feeds each to the steps right after it)."""

    def __init__(self, trainer: Any, manager: CaptureManager) -> None:
        self.trainer = trainer
        self.manager = manager
        self.args = trainer.args
        self.base = recompute_config(trainer.args)
        self.rollouts: dict[int, _Rollout] = {}
        self.next_rollout = 0
        self.step: _Step | None = None
        self.internals = TrlInternals(trainer, self)
        compute_loss = trainer.compute_loss

        def capturing_compute_loss(
            model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            if not (trainer.model.training and isinstance(inputs, Mapping) and ROWS_KEY in inputs):
                return compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            self.internals.in_loss, self.internals.current = True, None
            counts = self.internals.metric_count()
            try:
                loss = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            finally:
                self.internals.in_loss = False
            self._guarded("compute_loss", lambda: self.microbatch(inputs, loss, counts))
            return loss

        trainer.compute_loss = capturing_compute_loss
        trainer.add_callback(_StepCallback(self))

    # ---- generation batch -> rollout-level bundle --------------------------------------------------

    def generated(self, output: dict[str, Any], rewards_per_func: torch.Tensor) -> None:
        """Called with TRL's generation batch (this process's rows) and its gathered rewards: tags the rows and
        enqueues the rollout-level bundle."""
        rollout_id, self.next_rollout = self.next_rollout, self.next_rollout + 1
        n = int(output["completion_ids"].shape[0])
        first = self.trainer.accelerator.process_index * n
        rows = torch.arange(first, first + n, dtype=torch.long)
        output[ROWS_KEY] = torch.stack([torch.full_like(rows, rollout_id), rows], dim=1).to(
            output["completion_ids"].device
        )
        self._guarded(f"rollout {rollout_id}", lambda: self._rollout(rollout_id, first, output, rewards_per_func))

    def _rollout(self, rollout_id: int, first: int, output: Mapping[str, Any], rewards_per_func: torch.Tensor) -> None:
        n = int(output["completion_ids"].shape[0])
        g = int(self.trainer.num_generations)
        raw = self.internals.raw_rewards(rewards_per_func)[first : first + n].detach().cpu().tolist()
        mask = _loss_mask(output)
        width = int(mask.shape[1])
        prompts = output["prompt_mask"].sum(dim=1).tolist()
        record = _Rollout(
            first_row=first,
            sample_ids=[f"s-{rollout_id}-{first + i}" for i in range(n)],
            groups=[(first + i) // g for i in range(n)],
            raw_rewards=[float(r) for r in raw],
            rewards=_per_row(output["advantages"]),
            prompt_lengths=[int(p) for p in prompts],
        )
        self.rollouts[rollout_id] = record
        for old in [r for r in self.rollouts if r <= rollout_id - self.KEEP_ROLLOUTS]:
            del self.rollouts[old]
        advantages = output["advantages"]
        self.manager.capture_rollout(
            rollout_id,
            sample_ids=record.sample_ids,
            group_index=record.groups,
            response_lengths=[width] * n,
            total_lengths=[p + width for p in record.prompt_lengths],
            loss_masks=[m for m in mask.to(torch.int64)],
            raw_rewards=record.raw_rewards,
            rewards=record.rewards,
            config=self.base,
            old_log_probs=_rows(output.get("old_per_token_logps")),
            ref_log_probs=_rows(output.get("ref_per_token_logps")),
            advantages=_per_token(advantages, width),
        )

    # ---- micro-batch and optimizer step -> step-level bundle ---------------------------------------

    def microbatch(self, inputs: Mapping[str, Any], loss: Any, counts: Mapping[str, int]) -> None:
        """One `compute_loss` call of an optimizer step: the micro-batch as the loss saw it."""
        tags = inputs[ROWS_KEY].detach().cpu()
        rollout_id = int(tags[0, 0])
        if self.step is None:
            rollout = self.rollouts.get(rollout_id)
            if rollout is None:
                raise ValueError(f"rows of generation batch {rollout_id}, which capture did not record")
            self.step = _Step(rollout_id, rollout.next_step)
            rollout.next_step += 1
        step = self.step
        metrics = self.internals.metrics_since(counts)
        for name, values in metrics.items():
            step.metrics.setdefault(name, []).extend(float(v) for v in values)
        step.loss = step.loss + loss.detach()
        if bool((tags[:, 0] != step.rollout_id).any()):
            step.broken = True
            raise ValueError(f"optimizer step ({step.rollout_id}, {step.step_id}) mixes generation batches")
        current = self.internals.current
        if current is None:
            step.broken = True
            raise ValueError("compute_loss computed no current log-probs (TRL's _compute_loss changed)")
        log_probs, entropy = current
        mask = _loss_mask(inputs)
        old = inputs.get("old_per_token_logps")
        step.on_policy = step.on_policy and old is None
        old = log_probs if old is None else old.detach()  # TRL's rule: no old log-probs means on-policy
        n, width = int(mask.shape[0]), int(mask.shape[1])
        step.rows += n
        step.num_items_in_batch = float(inputs["num_items_in_batch"])
        rollout = self.rollouts[step.rollout_id]
        local = [int(r) - rollout.first_row for r in tags[:, 1]]
        mb_index, step.micro_batches = step.micro_batches, step.micro_batches + 1
        mb_id = f"mb-{self.manager.rank}-{mb_index:04d}" if self.manager.multi_producer else f"mb-{mb_index:04d}"
        ok = self.manager.capture_microbatch(
            step.rollout_id,
            step.step_id,
            mb_id,
            sample_ids=[rollout.sample_ids[i] for i in local],
            group_index=[rollout.groups[i] for i in local],
            response_lengths=[width] * n,
            total_lengths=[rollout.prompt_lengths[i] + width for i in local],
            loss_masks=[m for m in mask.to(torch.int64)],
            raw_rewards=[rollout.raw_rewards[i] for i in local],
            rewards=[rollout.rewards[i] for i in local],
            old_log_probs=_rows(old),
            log_probs=_rows(log_probs),
            advantages=_per_token(inputs["advantages"], width),
            entropy=_rows(entropy),
            ref_log_probs=_rows(inputs.get("ref_per_token_logps")),
        )
        if ok is False and self.manager.wants_step(step.rollout_id, step.step_id):
            step.broken = True

    def end_step(self) -> bool | None:
        """The optimizer step ended: enqueue its step-level bundle with TRL's scalars. None when no step is open."""
        step, self.step = self.step, None
        if step is None:
            return None
        if step.broken:
            log.error(
                "capture: TRL step (%d, %d) lost a micro-batch; its step-level bundle is not written",
                step.rollout_id,
                step.step_id,
            )
            return False
        config = loss_config(
            self.base,
            self.args,
            rows=step.rows,
            num_items_in_batch=step.num_items_in_batch,
            num_processes=int(self.trainer.accelerator.num_processes),
            on_policy=step.on_policy,
        )
        scalars = {name: _mean(step.metrics, names) for name, names in METRICS.items()}
        if self.trainer.accelerator.num_processes > 1:
            scalars = dict.fromkeys(scalars)  # TRL logs them over every process: no rank's own value
        return self.manager.capture_step_end(
            step.rollout_id,
            step.step_id,
            config=config,
            loss=step.loss,
            pg_loss=None,
            ppo_kl=None,
            pg_clipfrac=scalars["pg_clipfrac"],
            kl_loss=scalars["kl_loss"] if float(self.args.beta) != 0.0 else None,
            entropy_loss=scalars["entropy"],
        )

    # ---- plumbing ----------------------------------------------------------------------------------

    def _guarded(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:
            if self.step is not None and what == "compute_loss":
                self.step.broken = True
            self.manager._hook_error(f"TRL capture ({what})", exc)

    def stats(self) -> dict[str, Any]:
        """The manager's counters (`CaptureManager.stats`)."""
        return self.manager.stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Write what is queued (up to `timeout`); True when all was written."""
        return self.manager.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (up to `timeout`) and stop the writer; True when all was written."""
        return self.manager.close(timeout)


def _step_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class _StepCallback(_step_callback_base()):  # type: ignore[misc]
    """The trainer's public seam for optimizer-step boundaries and the end of training."""

    def __init__(self, capture: TrlCapture) -> None:
        self.capture = capture

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.capture._guarded("step end", self.capture.end_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.capture.flush()


def enable_capture(trainer: Any, store_url: str, **manager_options: Any) -> TrlCapture:
    """Capture `trainer` (a TRL `GRPOTrainer`) into the store at `store_url` (a path, `file://`, `s3://` or
    `memory://` URL): call once, before `trainer.train()`. Each process of a multi-process run is a producer rank of
    the same bundles. `manager_options` go to `CaptureManager` (`writer`, `storage_options`, `steps`, `rollouts`,
    `policy`, `spool`, ...); as for any capture, TRAJECTORY_REPLAY_CAPTURE_POLICY wins over `policy` when it is
    set, and TRAJECTORY_REPLAY_CAPTURE_SPOOL is the spool unless `spool` is given: e.g. `policy="recorder:8"`
    keeps only the steps before a trigger (docs/capture.md). ValueError in one line naming the TRL option for a
    setting capture refuses (`refusals`), or naming what changed in a TRL whose private methods differ from
    1.16's (`TrlInternals.check`)."""
    refused = refusals(trainer)
    if refused:
        raise ValueError(refused[0])
    TrlInternals.check(trainer)
    recompute_config(trainer.args)  # a refused option fails here, not in training
    accelerator = trainer.accelerator
    manager_options["policy"] = choose_policy(os.environ, manager_options.get("policy"))
    if "spool" not in manager_options:
        manager_options["spool"] = parse_spool(os.environ.get(ENV_SPOOL))
    manager = CaptureManager(
        store_url,
        rank=int(accelerator.process_index),
        expected_ranks=list(range(int(accelerator.num_processes))),
        **manager_options,
    )
    return TrlCapture(trainer, manager)


def _loss_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    """The mask `_compute_loss` weighs tokens by: `completion_mask`, times `tool_mask` when present."""
    mask = batch["completion_mask"]
    if batch.get("tool_mask") is not None:
        mask = mask * batch["tool_mask"]
    return mask.detach()


def _rows(tensor: torch.Tensor | None) -> list[torch.Tensor] | None:
    """A (rows, width) tensor as one 1-D tensor per row (None stays None)."""
    return None if tensor is None else [row for row in tensor.detach()]


def _per_token(advantages: torch.Tensor, width: int) -> list[torch.Tensor]:
    """TRL's advantages, one per row (or per token), on every token of the row as `_compute_loss` broadcasts them."""
    a = advantages.detach()
    if a.dim() == 1:
        a = a.unsqueeze(1).expand(-1, width)
    return [row for row in a]


def _per_row(advantages: torch.Tensor) -> list[float]:
    """Each row's advantage (TRL's are one per row; per-token ones give their first token's)."""
    a = advantages.detach()
    return [float(v) for v in (a if a.dim() == 1 else a[:, 0]).cpu()]


def _mean(metrics: Mapping[str, list[float]], names: tuple[str, ...]) -> float | None:
    """The mean over the step's micro-batches of the first of `names` TRL logged, None when it logged none."""
    for name in names:
        values = [v for v in metrics.get(name, []) if not math.isnan(v)]
        if values:
            return sum(values) / len(values)
    return None


__all__ = [
    "OPTIONS",
    "TrlCapture",
    "TrlInternals",
    "enable_capture",
    "loss_config",
    "recompute_config",
    "refusals",
    "trl_options",
]
