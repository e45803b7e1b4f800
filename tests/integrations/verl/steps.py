"""One verl 0.9.1 training step built with verl's own functions: the batch a verl trainer holds after
`compute_advantage`, and the loss scalars its engine worker reports for it.

The batch is a `DataProto` of 16 prompts x 4 samples: prompts left-padded and responses right-padded, with junk
token ids and junk log-probs wherever the attention mask is 0, responses of 8-64 tokens, a uid string per prompt
and the outcome score on each response's last valid token (`token_level_scores`). The reward side is verl's
`apply_kl_penalty` (when `use_kl_in_reward`) and `compute_advantage`; the trainer side is
`verl.workers.utils.losses.ppo_loss` (and `value_loss` for gae), called once per micro-batch with the
`TensorDict` and the global batch information (`dp_size`, `batch_num_tokens`, `global_batch_size`) the FSDP engine
gives it, and reduced over micro-batches as verl's metrics are (`Metric` SUM for the losses, MEAN for the clip
fraction and ppo_kl). With rollout correction (`StepOptions.rollout_correction`) the batch also holds the inference
engine's `rollout_log_probs`, and verl's `compute_rollout_correction_and_add_to_batch` adds the importance weights and
rejects tokens from the response mask before `compute_advantage`.

The injected-bug options of `StepOptions` change only what verl's functions are given (the uids, masks, scores,
coefficients or old log-probs of one call); the built batch keeps what production would record.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage, compute_response_mask
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils import tensordict_utils as tu
from verl.workers.config import CriticConfig, FSDPActorConfig, FSDPCriticConfig
from verl.workers.utils.losses import ppo_loss, value_loss

PROMPTS = 16
SAMPLES = 4
MAX_PROMPT = 12
MAX_RESPONSE = 64
VOCAB = 1000
ENDS_ON_OBSERVATION = 5
"""In a multi-turn step, the sample whose response ends on an observation (its last two tokens have mask 0)."""
BEYOND_CLAMP = ((7, 1, 25.0), (9, 2, -30.0))
"""(row, token, ref - old) of the log ratios `StepOptions.ref_beyond_clamp` puts beyond verl's KL clamp at 20."""


@dataclass(frozen=True)
class StepOptions:
    """The verl options one step is built with (verl's own option names)."""

    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_coef: float = 0.05
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.01
    entropy_coeff: float = 0.01
    calculate_entropy: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    micro_batches: int = 1
    gamma: float = 1.0
    lam: float = 1.0
    multi_turn: bool = False
    """Responses hold observation spans (response_mask 0 inside the response)."""
    batch_wide_grpo: bool = False
    """The injected bug: GRPO normalized over the whole batch instead of per uid group."""
    swapped_uids: tuple[int, int] | None = None
    """Injected bug: these two samples trade uids in compute_advantage (each is grouped with the other's prompt)."""
    shifted_uids: bool = False
    """Injected bug: compute_advantage sees the uids shifted by one sample (each sample takes the previous one's)."""
    stale_old_log_probs: bool = False
    """Injected bug: ppo_loss is given old log-probs of another policy than the ones recorded as old."""
    loss_agg_mode_run: str | None = None
    """Injected bug: the loss aggregation ppo_loss ran with, when it is not the recorded `loss_agg_mode`."""
    eos_dropped: bool = False
    """Injected bug: each response's last token is masked out of compute_advantage's response_mask only."""
    kl_coef_run: float | None = None
    """Injected bug: the (adaptive) KL coefficient apply_kl_penalty used, when it is not the recorded `kl_coef`."""
    lost_score: int | None = None
    """Injected bug: this sample's score is zeroed before compute_advantage; the recorded score is the original."""
    masked_out: int | None = None
    """This sample's every response token has mask 0 (attended, never trained on)."""
    interleaved_uids: bool = False
    """A prompt's samples are not adjacent in the batch: row i belongs to prompt (7 i) mod PROMPTS."""
    ref_beyond_clamp: bool = False
    """The reference log-probs of a few tokens lie far from the old ones (`BEYOND_CLAMP`)."""
    rollout_correction: tuple[tuple[str, Any], ...] = ()
    """verl's rollout-correction options (`RolloutCorrectionConfig` keys and values); with any, the batch holds the
    inference engine's `rollout_log_probs` and `compute_rollout_correction_and_add_to_batch` runs between
    `apply_kl_penalty` and `compute_advantage`, as in verl's `fit`."""
    seed: int = 0


@dataclass
class VerlStep:
    """A built step: the batch after compute_advantage, the current log-probs (and entropy, vpreds) the actor's
    forward produced, and the scalars verl reported."""

    options: StepOptions
    batch: DataProto
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    vpreds: torch.Tensor | None
    reward_kl: torch.Tensor | None
    """kl_penalty(old, ref) as apply_kl_penalty forms it, before the response mask."""
    micro_batches: list[list[int]]
    policy_metrics: dict[str, float] = field(default_factory=dict)
    value_metrics: dict[str, float] = field(default_factory=dict)
    pre_rejection_mask: torch.Tensor | None = None
    """With rollout correction: the response mask before its rejection (the batch's is the one after it)."""
    rollout_corr_metrics: dict[str, float] = field(default_factory=dict)
    """With rollout correction: the `rollout_corr/*` metrics verl computed."""


def _layout(gen: torch.Generator, rnd: random.Random, multi_turn: bool) -> dict[str, torch.Tensor]:
    n = PROMPTS * SAMPLES
    prompt_lens = [rnd.randint(3, MAX_PROMPT) for _ in range(PROMPTS)]
    prompts = torch.randint(1, VOCAB, (n, MAX_PROMPT), generator=gen)  # junk where the mask is 0
    prompt_mask = torch.zeros(n, MAX_PROMPT, dtype=torch.long)
    for i in range(n):
        p = prompt_lens[i // SAMPLES]
        prompt_mask[i, MAX_PROMPT - p :] = 1
        prompts[i, MAX_PROMPT - p :] = prompts[(i // SAMPLES) * SAMPLES, MAX_PROMPT - p :]  # a group shares its prompt
    responses = torch.randint(1, VOCAB, (n, MAX_RESPONSE), generator=gen)
    attn = torch.zeros(n, MAX_RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(n, MAX_RESPONSE, dtype=torch.long)
    for i in range(n):
        length = rnd.randint(8, MAX_RESPONSE)
        attn[i, :length] = 1
        response_mask[i, :length] = 1
        if multi_turn and length >= 16:  # one observation span inside the response
            start = rnd.randint(2, length - 8)
            response_mask[i, start : start + rnd.randint(2, 5)] = 0
    if multi_turn:  # and one response ends on an observation
        response_mask[ENDS_ON_OBSERVATION, int(attn[ENDS_ON_OBSERVATION].sum()) - 2 :] = 0
    attention_mask = torch.cat([prompt_mask, attn], dim=1)
    position_ids = torch.clamp(attention_mask.cumsum(-1) - 1, min=0)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
    }


def _rollout_log_probs(old: torch.Tensor, valid: torch.Tensor, seed: int) -> torch.Tensor:
    """The inference engine's log-probs of the sampled tokens: the trainer's old ones, off by a little on most tokens
    and by a lot on about 2% of them, junk in the padding (from a generator of their own: the step's other tensors
    stay what they are without rollout correction)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    noise = torch.randn(old.shape, generator=gen) * 0.08
    outliers = torch.rand(old.shape, generator=gen) < 0.02
    noise = torch.where(outliers, torch.randn(old.shape, generator=gen) * 1.5, noise)
    return _junk_outside(old - noise, valid, gen)


def _junk_outside(values: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    junk = torch.randn(values.shape, generator=gen) * 50.0
    return torch.where(mask.bool(), values, junk)


def build_step(options: StepOptions = StepOptions()) -> VerlStep:
    """The step `options` describe, computed by verl."""
    gen = torch.Generator().manual_seed(options.seed)
    rnd = random.Random(options.seed)
    n = PROMPTS * SAMPLES
    tensors = _layout(gen, rnd, options.multi_turn)
    if options.masked_out is not None:
        tensors["response_mask"][options.masked_out] = 0
    valid = tensors["attention_mask"][:, MAX_PROMPT:]
    uids = np.array([f"{rnd.getrandbits(64):016x}" for _ in range(PROMPTS)], dtype=object).repeat(SAMPLES)
    if options.interleaved_uids:
        uids = uids[(np.arange(n) * 7) % PROMPTS * SAMPLES]
    lengths = valid.sum(-1)
    scores = torch.zeros(n, MAX_RESPONSE)
    for i in range(n):
        scores[i, lengths[i] - 1] = float(rnd.choice([0.0, 0.0, 1.0, 1.0, 0.5, -1.0]))
    old = -torch.rand(n, MAX_RESPONSE, generator=gen) * 2.0
    ref = old + torch.randn(n, MAX_RESPONSE, generator=gen) * 0.1
    if options.ref_beyond_clamp:
        for row, token, shift in BEYOND_CLAMP:
            ref[row, token] = old[row, token] + shift
    cur = old + torch.randn(n, MAX_RESPONSE, generator=gen) * 0.15
    tensors.update(
        token_level_scores=scores,
        old_log_probs=_junk_outside(old, valid, gen),
        ref_log_prob=_junk_outside(ref, valid, gen),
    )
    if options.adv_estimator == "gae":
        tensors["values"] = _junk_outside(torch.randn(n, MAX_RESPONSE, generator=gen) * 0.5, valid, gen)
    batch = DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids})
    assert torch.equal(compute_response_mask(batch), valid)
    response_mask = batch.batch["response_mask"].clone()

    pre_rejection_mask, corr_metrics = None, {}
    if options.rollout_correction:
        batch.batch["rollout_log_probs"] = _rollout_log_probs(old, valid, options.seed)
    reward_kl = None
    if options.use_kl_in_reward:
        reward_kl = core_algos.kl_penalty(
            batch.batch["old_log_probs"], batch.batch["ref_log_prob"], kl_penalty=options.kl_penalty
        )
        kl_coef = options.kl_coef if options.kl_coef_run is None else options.kl_coef_run
        batch, _ = apply_kl_penalty(batch, core_algos.FixedKLController(kl_coef), options.kl_penalty)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"].clone()
    if options.rollout_correction:
        pre_rejection_mask = batch.batch["response_mask"].clone()
        correction = RolloutCorrectionConfig(**dict(options.rollout_correction))
        batch, corr_metrics = compute_rollout_correction_and_add_to_batch(batch, correction)
        response_mask = batch.batch["response_mask"].clone()
    if options.lost_score is not None:
        batch.batch["token_level_rewards"][options.lost_score] = 0.0
    algo = AlgoConfig(
        gamma=options.gamma,
        lam=options.lam,
        adv_estimator=options.adv_estimator,
        norm_adv_by_std_in_grpo=options.norm_adv_by_std_in_grpo,
        use_kl_in_reward=options.use_kl_in_reward,
        kl_penalty=options.kl_penalty,
    )
    if options.batch_wide_grpo:
        batch.non_tensor_batch["uid"] = np.array(["all"] * n, dtype=object)
    if options.swapped_uids is not None:
        a, b = options.swapped_uids
        batch.non_tensor_batch["uid"] = uids.copy()
        batch.non_tensor_batch["uid"][[a, b]] = uids[[b, a]]
    if options.shifted_uids:
        batch.non_tensor_batch["uid"] = np.roll(uids, 1)
    if options.eos_dropped:
        batch.batch["response_mask"] = response_mask.clone()
        batch.batch["response_mask"][torch.arange(n), valid.sum(-1) - 1] = 0
    batch = compute_advantage(
        batch,
        adv_estimator=options.adv_estimator,
        gamma=options.gamma,
        lam=options.lam,
        num_repeat=SAMPLES,
        norm_adv_by_std_in_grpo=options.norm_adv_by_std_in_grpo,
        config=algo,
    )
    batch.non_tensor_batch["uid"] = uids
    batch.batch["response_mask"] = response_mask

    step = VerlStep(
        options=options,
        batch=batch,
        log_probs=_junk_outside(cur, valid, gen),
        entropy=_junk_outside(torch.rand(n, MAX_RESPONSE, generator=gen) * 3.0, valid, gen)
        if options.calculate_entropy or options.entropy_coeff != 0
        else None,
        vpreds=_junk_outside(torch.randn(n, MAX_RESPONSE, generator=gen) * 0.5, valid, gen)
        if options.adv_estimator == "gae"
        else None,
        reward_kl=reward_kl,
        micro_batches=[list(r) for r in np.array_split(np.arange(n), options.micro_batches)],
        pre_rejection_mask=pre_rejection_mask,
        rollout_corr_metrics=corr_metrics,
    )
    step.policy_metrics = _policy_loss(step)
    if step.vpreds is not None:
        step.value_metrics = _value_loss(step)
    return step


def balanced(batch: DataProto, dp_size: int) -> DataProto:
    """A copy of `batch` reordered by verl's own `RayPPOTrainer._balance_batch` for `dp_size` ranks (verl's
    dispatch then gives rank r chunk r), with each row's index in `batch` as the tensor `row`."""
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    out = DataProto.from_dict(
        tensors={**dict(batch.batch.items()), "row": torch.arange(len(batch))},
        non_tensors={k: v.copy() for k, v in batch.non_tensor_batch.items()},
    )
    trainer = SimpleNamespace(_get_dp_size=lambda worker_group, role: dp_size, actor_rollout_wg=None)
    RayPPOTrainer._balance_batch(trainer, out, metrics={})  # type: ignore[arg-type]
    return out


def _flat_model_output(tensor: torch.Tensor, batch: DataProto, rows: list[int]) -> torch.Tensor:
    """A per-response-token tensor as the actor's unpadded forward returns it: every sequence's valid tokens,
    concatenated, each response token's value at the position before it (no_padding_2_padding undoes this)."""
    mask = batch.batch["attention_mask"]
    parts = []
    for i in rows:
        prompt_len = int(mask[i, :MAX_PROMPT].sum())
        response_len = int(mask[i, MAX_PROMPT:].sum())
        seq = torch.full((prompt_len + response_len,), 123.0)
        seq[prompt_len - 1 : prompt_len - 1 + response_len] = tensor[i, :response_len]
        parts.append(seq)
    return torch.cat(parts)


def _micro_batch_data(step: VerlStep, rows: list[int], fields: list[str]) -> TensorDict:
    batch = step.batch.batch
    idx = torch.tensor(rows)
    data = TensorDict({k: batch[k][idx] for k in fields}, batch_size=len(rows))
    tu.assign_non_tensor(
        data,
        dp_size=1,
        batch_num_tokens=int(batch["response_mask"].sum()),
        global_batch_size=PROMPTS * SAMPLES,
    )
    return data


def engine_micro_batch(step: VerlStep, rows: list[int], **info: Any) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """(the TensorDict verl's engine hands its loss for `rows` of the step: the no-padding layout of
    `left_right_2_no_padding` with the global batch information `info` (`dp_size`, `batch_num_tokens`,
    `global_batch_size`), the actor's and critic's unpadded model output for those rows: `log_probs`, `entropy`
    when the step has it, `values` (the current value predictions) when it has them)."""
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(step.batch[rows].to_tensordict())
    tu.assign_non_tensor(data, **info)
    output = {"log_probs": _flat_model_output(step.log_probs, step.batch, rows)}
    if step.entropy is not None:
        output["entropy"] = _flat_model_output(step.entropy, step.batch, rows)
    if step.vpreds is not None:
        output["values"] = _flat_model_output(step.vpreds, step.batch, rows)
    return data, output


def actor_config(options: StepOptions) -> FSDPActorConfig:
    """The actor config of the step, as the trainer's yaml would build it."""
    n = PROMPTS * SAMPLES
    return FSDPActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=n // options.micro_batches,
        rollout_n=SAMPLES,
        use_dynamic_bsz=False,
        clip_ratio_low=options.clip_ratio_low,
        clip_ratio_high=options.clip_ratio_high,
        loss_agg_mode=options.loss_agg_mode_run or options.loss_agg_mode,
        loss_scale_factor=options.loss_scale_factor,
        entropy_coeff=options.entropy_coeff,
        calculate_entropy=options.calculate_entropy,
        use_kl_loss=options.use_kl_loss,
        kl_loss_type=options.kl_loss_type,
        kl_loss_coef=options.kl_loss_coef,
    )


def _reduce(per_micro_batch: list[dict[str, Any]]) -> dict[str, float]:
    """verl's reduction over micro-batches: Metric SUM values added, everything else averaged."""
    from verl.utils.metric import AggregationType, Metric

    out: dict[str, float] = {}
    for key in per_micro_batch[0]:
        values = [m[key] for m in per_micro_batch]
        if isinstance(values[0], Metric):
            nums = [float(v.values[0]) if isinstance(v.values, list) else float(v.values) for v in values]
            total = sum(nums)
            out[key] = total if values[0].aggregation == AggregationType.SUM else total / len(nums)
        else:
            out[key] = float(np.mean([float(v) for v in values]))
    return out


def _policy_loss(step: VerlStep) -> dict[str, float]:
    config = actor_config(step.options)
    fields = ["prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages"]
    if step.options.use_kl_loss:
        fields.append("ref_log_prob")
    metrics, losses = [], []
    for rows in step.micro_batches:
        data = _micro_batch_data(step, rows, fields)
        if step.options.stale_old_log_probs:  # another policy's log-probs: the recorded old ones, moved
            stale = torch.Generator().manual_seed(step.options.seed + 1)
            data["old_log_probs"] = (
                data["old_log_probs"] + torch.randn(data["old_log_probs"].shape, generator=stale) * 0.05
            )
        output = {"log_probs": _flat_model_output(step.log_probs, step.batch, rows)}
        if step.entropy is not None:
            output["entropy"] = _flat_model_output(step.entropy, step.batch, rows)
        loss, m = ppo_loss(config, output, data)
        losses.append(float(loss))
        metrics.append({k: v for k, v in m.items() if k != "kl_coef"})
    out = _reduce(metrics)
    out["loss"] = sum(losses)
    return out


def _value_loss(step: VerlStep) -> dict[str, float]:
    config: CriticConfig = FSDPCriticConfig(
        strategy="fsdp",
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=PROMPTS * SAMPLES // step.options.micro_batches,
        rollout_n=SAMPLES,
        use_dynamic_bsz=False,
        loss_agg_mode=step.options.loss_agg_mode,
        loss_scale_factor=step.options.loss_scale_factor,
    )
    fields = ["prompts", "responses", "attention_mask", "response_mask", "values", "returns"]
    metrics = []
    assert step.vpreds is not None
    for rows in step.micro_batches:
        data = _micro_batch_data(step, rows, fields)
        _, m = value_loss(config, {"values": _flat_model_output(step.vpreds, step.batch, rows)}, data)
        metrics.append(m)
    return _reduce(metrics)
