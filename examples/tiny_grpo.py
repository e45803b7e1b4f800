#!/usr/bin/env python
"""A tiny, deterministic, asynchronous GRPO run on CPU: the end-to-end example for trajectory_replay.

Task: the prompt is N random digits (--digits, default 4) and a separator; the response should be the digits
sorted, then EOS. Reward = (correct digit positions + 1/4 per prompt digit in a wrong place + 1 if EOS is exactly
at position N) / (N + 1): partial credit, so prompt groups have reward variance.

Shape of the run (slime-like, one-version-lag async):
- Rank 0 runs a rollout producer thread. Rollout k is generated with policy version max(k-1, 0) while the
  trainer is still training on rollout k-1 (version v = number of rollouts trained on). The producer waits for
  exactly that version, so the lag is fixed and the run is deterministic whatever the thread timing.
- Rewards are post-processed by the producer (the group estimators need whole prompt groups), then the rollout
  is streamed in consumer batches of --consumer-batch samples, which is deliberately not a multiple of
  n_samples_per_prompt: prompt groups straddle consumer batches, and each consumer batch is split into W
  disjoint, contiguous rank shards, so groups straddle ranks too. One consumer batch = one optimizer step
  (actor step (rollout, step)).
- Old log-probs are *recomputed by the trainer* with the actor's weights as they are when it starts on the rollout
  (version k, a snapshot, as slime's actor does before training), one micro-batch at a time like the loss, so
  the first optimizer step of each rollout is on-policy: its current log-probs equal the old ones bit for bit
  (its step bundles say so: expect_on_policy). The generator's own log-probs of its responses, under the weights
  it sampled with (version max(k-1, 0), one behind), are rollout_log_probs, computed by the same function the
  trainer uses, so the weights version is their only difference from the old log-probs: a real
  training-inference mismatch d = old - rollout from rollout 1 on. Each sample's policy_version is the version
  that generated it; the bundles' config carries actor_version = k. Current log-probs come from the live model,
  reference log-probs from the frozen initial model.
- --rollout-is token|sequence corrects the mismatch in the policy loss: each token's pg term is multiplied, before
  aggregation, by the constant w = min(exp(clamp(d, -20, 20)), --rollout-is-threshold), d per token or summed
  over the sample's loss tokens (sequence: one weight on every token of the sample); clipfrac and ppo_kl are
  not weighted.
- KL (k1/k2/k3/low_var_kl, gated by kl_coef) is computed and recorded per token as in V1's GRPO; it enters the
  token rewards of reinforce_plus_plus and gae only with --kl-in-reward, and the loss only with --kl-loss-coef.
- Advantages (--estimator): grpo, dr_grpo and rloo put the sample's post-processed reward on every token;
  reinforce_plus_plus(_baseline) and gae work on token rewards and whiten over the whole rollout (every rank's
  shard of it), so for them the trainer receives a rollout's consumer batches before its first step. gae adds a
  value head on the model's hidden states: old values from the version-k snapshot, current ones from the live
  model, and 0.5 * vf_loss in the training loss.
- Loss scalars are aggregated by --loss-agg-mode; the default is the V1 reduction R(x) = sum over samples of the
  per-sample masked mean, whose backward pass uses R(.)/consumer_batch (an average per sample). The other modes
  divide by the step's global token or sequence count (recorded as loss_denominator) or by the longest response
  (loss_scale_factor). Gradients are all-reduced over gloo (summed).

The algorithms are this file's own code (it plays the training framework), not trajectory_replay's.
`--fault pr65` reproduces the canonical bug: rewards are normalized over each physical consumer batch.
`--fault stale-old-logprobs` computes the old log-probs with the generator's stale weights (version max(k-1, 0))
while the bundles still claim actor version k and an on-policy first step (replay: loss.policy, field ratio, from
rollout 1 on). `--fault future-version` stamps the first sample of each rollout k with policy_version k + 1, ahead
of the actor consuming it (replay: rollout.mismatch). `--fault nan-loss` makes the loss each step reports NaN (the
update itself is unchanged, so the run goes on: a NaN in the logged loss, which the flight recorder's nan_loss
trigger catches; replay: loss.policy, field loss). `--fault-from-step N` injects the fault from rollout N on only
(the rollouts before it are clean), as a bug that a change brought in mid-run.

Capture (trajectory_replay.capture) is off unless TRAJECTORY_REPLAY_CAPTURE=1 and TRAJECTORY_REPLAY_CAPTURE_DIR are
set (`--capture-dir URL` sets both for the run); `--capture-policy POLICY` chooses which steps are kept (e.g.
`recorder:8`, the flight recorder of docs/capture.md). Every trainer rank then writes its own shard of a rollout-level
bundle `rollout-<R>` per rollout and of a step-level bundle `step-<R>-<S>` per optimizer step, and flushes its
writer at the end. Besides torch and the standard library, only trajectory_replay is used.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from trajectory_replay import capture
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, OLDER_NAMES

SEP, EOS, PAD, VOCAB = 10, 11, 12, 16
N_DIGITS = 4  # the default task size (--digits)
MIN_CONTEXT = 16
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Post-process rewards within prompt groups (so the producer needs whole groups; --fault pr65 breaks that)."""
WHOLE_ROLLOUT_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
"""Whiten their advantages over the whole rollout, every rank's shard of it."""
KL_REWARD_ESTIMATORS = ("reinforce_plus_plus", "gae")
LOSS_AGG_MODES = (
    "sum_of_sample_means",
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")
ROLLOUT_IS = ("none", "token", "sequence")
LOG_RATIO_CLAMP = 20.0  # rollout correction: log ratios are clamped to +-20 before exp
FAULTS = ("pr65", "stale-old-logprobs", "future-version", "nan-loss")
KL_LOSS_ESTIMATOR = "k3"
VF_CLIP, VF_COEF = 0.2, 0.5  # value clip range; weight of vf_loss in gae's training loss


def task_shape(digits: int) -> tuple[int, int, int]:
    """(prompt length, longest response, model context) for prompts of `digits` digits."""
    prompt_len = digits + 1  # digits + SEP
    max_response = digits + 1  # sorted digits + EOS
    return prompt_len, max_response, max(MIN_CONTEXT, prompt_len + max_response)


# --------------------------------------------------------------------------- capture hooks
# Capture is configured only by the TRAJECTORY_REPLAY_CAPTURE* environment variables (read by
# trajectory_replay.capture.maybe_enable_for_actor); `--capture-dir URL` is a shortcut that sets
# TRAJECTORY_REPLAY_CAPTURE=1 and TRAJECTORY_REPLAY_CAPTURE_DIR=URL for this run only (os.environ is not changed).
# While capture is off every hook below returns after one check; nothing is imported lazily, nothing is
# started. The hooks only snapshot (copy) what training already computed, so numerics never change.
_CAPTURE: dict[str, Any] = {"manager": None, "config": None, "seconds": 0.0}
CAPTURE_THREAD_PREFIX = "trajectory-replay-capture"


def capture_environ(capture_dir: str | None, run_id: str | None = None) -> dict[str, str]:
    """The environment capture is configured from: os.environ, plus what --capture-dir implies, plus this launch's
    identity (made once by the launching process, so every rank has the same one and a rerun another)."""
    env = dict(os.environ)
    if capture_dir:  # replaces the switch and directory however the environment spells them
        for name in (ENV_CAPTURE, ENV_DIR):
            env.pop(OLDER_NAMES[name], None)
        env.update({ENV_CAPTURE: "1", ENV_DIR: capture_dir})
    if run_id and not env.get("TRAJECTORY_REPLAY_RUN_ID"):
        env["TRAJECTORY_REPLAY_RUN_ID"] = run_id
    return env


def capture_threads() -> int:
    return sum(t.name.startswith(CAPTURE_THREAD_PREFIX) for t in threading.enumerate())


def _timed_hook(fn):
    """Accumulate the time the training thread spends inside a capture hook (for --out-json); with capture off,
    return after one check (no argument is even passed on)."""

    def wrapper(*args: Any, **kwargs: Any) -> None:
        if _CAPTURE["manager"] is None:
            return
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        finally:
            _CAPTURE["seconds"] += time.perf_counter() - t0

    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def _maybe_enable_capture(
    capture_dir: str | None,
    rank: int,
    expected_ranks: list[int],
    config: dict[str, Any],
    run_id: str | None = None,
    policy: str | None = None,
    queue_records: int | None = None,
) -> None:
    """Every trainer rank is a producer: each DP rank writes its own shard of every bundle. `policy`
    (--capture-policy) chooses which steps are kept, unless TRAJECTORY_REPLAY_CAPTURE_POLICY says."""
    _CAPTURE["config"] = dict(config)
    started = time.perf_counter()
    _CAPTURE["manager"] = capture.maybe_enable_for_actor(
        rank,
        is_producer=True,
        expected_ranks=expected_ranks,
        environ=capture_environ(capture_dir, run_id),
        topology={"dp": len(expected_ranks), "tp": 1, "pp": 1, "cp": 1},
        policy=policy,
        **({} if queue_records is None else {"max_queue_records": queue_records}),
    )
    _CAPTURE["start_seconds"] = time.perf_counter() - started


def _lineage(rollout_versions: list[int], actor_versions: list[int]) -> dict[str, Any]:
    """rollout_weight = the version that generated the samples, actor_weight = the live version."""

    def one(values: list[int]) -> int | str:
        distinct = sorted(set(values))
        return distinct[0] if len(distinct) == 1 else ",".join(map(str, distinct))

    return {"rollout_weight": one(rollout_versions), "actor_weight": one(actor_versions)}


@_timed_hook
def _capture_rollout(rollout_id: int, rollout_data: dict[str, list], actor_version: int) -> None:
    """Rollout-level data of this rank's shard of one rollout (dict of per-sample lists). The slime layout maps
    `rollout_log_probs` (beside `log_probs`) and `policy_versions`, which contract rollout.mismatch; the config
    adds the version of the trainer consuming the rollout."""
    capture.capture_slime_rollout(
        rollout_id,
        rollout_data,
        config={**_CAPTURE["config"], "actor_version": actor_version},
        weight_lineage=_lineage(rollout_data["rollout_weight_versions"], rollout_data["actor_weight_versions"]),
    )


def check_group_rewards(rollout_id: int, shard: dict[str, list], n_per_prompt: int, estimator: str) -> None:
    """The training program's own check of a rollout, which fires the flight recorder (capture.trigger, a no-op
    unless the capture policy is recorder:K) the first time it fails: a group estimator's post-processed rewards
    sum to 0 over each prompt group (checked on the groups whose every sample is in this rank's shard). --fault
    pr65 breaks it (rewards normalized per consumer batch), and none of the recorder's built-in triggers sees
    that: its rewards, losses and KL stay in their usual range."""
    if _CAPTURE.get("manager") is None or estimator not in GROUP_ESTIMATORS or _CAPTURE.get("flagged"):
        return
    groups: dict[int, list[float]] = {}
    for g, r in zip(shard["group_index"], shard["rewards"]):
        groups.setdefault(int(g), []).append(float(r))
    bad = [(g, sum(rs)) for g, rs in groups.items() if len(rs) == n_per_prompt and abs(sum(rs)) > 1e-4]
    if bad:
        _CAPTURE["flagged"] = True
        g, total = bad[0]
        capture.trigger(f"rollout {rollout_id}: rewards of group {g} sum to {total:.4g}, not 0")


OPTIONAL_STEP_PAYLOADS = ("ref_log_probs", "values", "vpreds", "returns")
"""Step payloads only some runs have (a KL loss, a value loss): passed only when present."""
_NOTHING: dict[str, Any] = {}


@_timed_hook
def _capture_microbatch(rollout_id: int, step_id: int, mb_id: str, data: dict[str, Any]) -> None:
    """Step-level data of one micro-batch, as the loss saw it (reference log-probs with a KL loss, values with
    a value loss), with the generator's log-probs and policy versions of its samples (rollout.mismatch, and the
    input of --rollout-is)."""
    capture.capture_microbatch(
        rollout_id,
        step_id,
        mb_id,
        sample_ids=data["sample_ids"],
        group_index=data["group_index"],
        response_lengths=data["response_lengths"],
        total_lengths=data["total_lengths"],
        loss_masks=data["loss_mask"],
        raw_rewards=data["raw_reward"],
        rewards=data["rewards"],
        old_log_probs=data["old_log_probs"],
        log_probs=data["log_probs"],
        entropy=data["entropy"],
        advantages=data["advantages"],
        rollout_log_probs=data["rollout_log_probs"],
        policy_versions=data["policy_versions"],
        **data.get("optional", _NOTHING),
    )


@_timed_hook
def _capture_step_end(
    rollout_id: int,
    step_id: int,
    scalars: dict[str, float],
    weight_lineage: dict[str, Any] | None = None,
    step_config: dict[str, Any] | None = None,
) -> None:
    """This rank's reported loss scalars for actor step (rollout_id, step_id); `step_config` adds what only this
    step knows (its global loss denominator, the actor version, whether it is on-policy)."""
    capture.capture_step_end(
        rollout_id,
        step_id,
        loss=scalars["loss"],
        pg_loss=scalars["pg_loss"],
        entropy_loss=scalars["entropy_loss"],
        pg_clipfrac=scalars["pg_clipfrac"],
        ppo_kl=scalars["ppo_kl"],
        kl_loss=scalars.get("kl_loss"),
        vf_loss=scalars.get("vf_loss"),
        vf_clipfrac=scalars.get("vf_clipfrac"),
        config={**_CAPTURE["config"], **(step_config or {})},
        weight_lineage=weight_lineage,
    )


def _shutdown_capture(timeout: float) -> dict[str, Any]:
    """End of training: flush and stop this rank's writer; what happened, for --out-json.

    "flushed" is true only when every captured record landed: `shutdown` also returns True once records failed
    or were dropped (a store that cannot be used), since nothing is left to do."""
    manager = _CAPTURE["manager"]
    threads = capture_threads()
    started = time.perf_counter()
    done = capture.shutdown(timeout)
    waited = time.perf_counter() - started
    stats = manager.stats() if manager is not None else None
    landed = stats is None or (stats["written"] == stats["enqueued"] and not stats["errors"] and not stats["dropped"])
    # the training process's own waits on capture outside the hooks: starting it, and flushing it at the end
    return {
        "enabled": manager is not None,
        "capture_threads": threads,
        "flushed": done and landed,
        "stats": stats,
        "start_seconds": _CAPTURE.get("start_seconds", 0.0),
        "shutdown_seconds": waited,
    }


# --------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Causal LM. Sequences are right-padded, so causal attention keeps padding out of real positions."""

    def __init__(self, d: int = 32, layers: int = 2, heads: int = 2, context: int = MIN_CONTEXT) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> final hidden states [B, T, d]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> logits [B, T, V]
        return self.head(self.features(tokens))


class ResponseOutputs(NamedTuple):
    """Per-sample tensors over the response tokens: log-probs, entropies, and values when a value head is given."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    values: list[torch.Tensor] | None


def response_outputs(
    model: TinyLM, tokens: list[torch.Tensor], resp_lens: list[int], critic: nn.Module | None = None
) -> ResponseOutputs:
    """Log-probs and entropies of the response tokens (one padded forward pass); with `critic`, its value of the
    state each response token is generated from."""
    x = torch.full((len(tokens), max(len(t) for t in tokens)), PAD, dtype=torch.long)
    for i, t in enumerate(tokens):
        x[i, : len(t)] = t
    hidden = model.features(x)
    logp = F.log_softmax(model.head(hidden)[:, :-1].float(), dim=-1)  # position j predicts token j+1
    tok_lp = logp.gather(-1, x[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    starts = [len(t) - r - 1 for t, r in zip(tokens, resp_lens)]

    def responses(per_position: torch.Tensor) -> list[torch.Tensor]:
        return [per_position[i, s : s + r] for i, (s, r) in enumerate(zip(starts, resp_lens))]

    values = None if critic is None else responses(critic(hidden[:, :-1]).squeeze(-1).float())
    return ResponseOutputs(responses(tok_lp), responses(ent), values)


# --------------------------------------------------------------------------- RL math (independent of the package)
def _cohort_rewards(r: torch.Tensor, estimator: str, std: bool) -> torch.Tensor:
    """One cohort's post-processed rewards: r - mean (grpo optionally / (unbiased std + 1e-6)), or rloo's
    leave-one-out baseline r - mean of the others."""
    if estimator == "rloo":
        return r - (r.sum() - r) / (len(r) - 1)
    centered = r - r.mean()
    return centered / (centered.std() + 1e-6) if estimator == "grpo" and std else centered


def post_process_rewards(raw: torch.Tensor, cohorts: list[int], estimator: str, std: bool) -> torch.Tensor:
    """r' per sample, float32: the group estimators normalize within each cohort (by label); the token-reward
    estimators keep r."""
    if estimator not in GROUP_ESTIMATORS:
        return raw.clone()
    out = torch.empty_like(raw)
    for c in dict.fromkeys(cohorts):
        idx = torch.tensor([i for i, x in enumerate(cohorts) if x == c])
        out[idx] = _cohort_rewards(raw[idx], estimator, std)
    return out


def kl_estimate(old: torch.Tensor, ref: torch.Tensor, kind: str, coef: float) -> torch.Tensor:
    if coef == 0.0:
        return torch.zeros_like(old)
    r = old.float() - ref.float()
    if kind == "k1":
        return r
    if kind == "k2":
        return r * r / 2
    if kind in ("k3", "low_var_kl"):
        k = torch.exp(-r) - 1 + r
        return k.clamp(-10, 10) if kind == "low_var_kl" else k
    raise ValueError(f"unknown kl type {kind!r}")


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample rows right-padded with zeros into [B, T] (padding acts as masked-out tokens)."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def token_rewards(
    rewards: list[float], mask: torch.Tensor, lens: list[int], kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """[B, T] token rewards: minus kl_coef * kl on every loss token (when the KL is in the reward), plus the
    sample's reward on its last response token."""
    rho = -kl_coef * kl * mask if kl is not None else torch.zeros_like(mask)
    for i, (n, r) in enumerate(zip(lens, rewards)):
        rho[i, n - 1] += r
    return rho


def discounted_returns(rho: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = rho_t + gamma * G_{t+1}, the running return zeroed after each masked-out token (REINFORCE++)."""
    out, running = torch.zeros_like(rho), torch.zeros(rho.shape[0])
    for t in reversed(range(rho.shape[1])):
        running = rho[:, t] + gamma * running
        out[:, t] = running
        running = running * mask[:, t]
    return out


def gae(
    rho: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by GAE; a masked-out token (an observation) takes no TD step and the next value and
    running advantage carry over it."""
    adv, next_value, last = torch.zeros_like(rho), torch.zeros(rho.shape[0]), torch.zeros(rho.shape[0])
    for t in reversed(range(rho.shape[1])):
        m = mask[:, t]
        delta = rho[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * last
        next_value = values[:, t] * m + (1 - m) * next_value
        last = step * m + (1 - m) * last
        adv[:, t] = last
    return adv, adv + values


def whiten_across_ranks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8), mean and unbiased variance over the masked tokens of every rank's x (sums
    all-reduced in float64); every token is whitened."""
    x64, m64 = x.double(), mask.double()
    sums = torch.stack([(x64 * m64).sum(), m64.sum()])
    dist.all_reduce(sums)
    mean, count = sums[0] / sums[1], sums[1]
    square = ((x64 - mean).square() * m64).sum().reshape(1)
    dist.all_reduce(square)
    var = square[0] / count * (count / (count - 1))
    return ((x64 - mean) * torch.rsqrt(var + 1e-8)).float()


def rollout_advantages(shard: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Set `advantages` (and gae's `returns`) of every sample of this rank's consumer batches of one rollout;
    whitened over the rollout's samples on every rank, the cohort a replay of the rollout-level bundle sees."""
    rewards = [r for mine in shard for r in mine["rewards"]]
    lens = [n for mine in shard for n in mine["response_lengths"]]
    mask = padded([torch.tensor(m, dtype=torch.float32) for mine in shard for m in mine["loss_masks"]])
    returns = None
    if args.estimator == "reinforce_plus_plus_baseline":
        scores = torch.tensor(rewards)[:, None] * mask
    else:
        kl = padded([k for mine in shard for k in mine["kl"]]) if args.kl_in_reward else None
        rho = token_rewards(rewards, mask, lens, kl, args.kl_coef)
        if args.estimator == "gae":
            scores, returns = gae(
                rho, padded([v for mine in shard for v in mine["values"]]), mask, args.gamma, args.lam
            )
        else:
            scores = discounted_returns(rho, mask, args.gamma)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([row[:n] for row, n in zip(x, lens)])

    flat_mask = flat(mask)
    adv = whiten_across_ranks(flat(scores), flat_mask)
    if args.estimator != "gae":  # gae's whitened advantages are not re-masked
        adv = adv * flat_mask
    per_sample = {"advantages": list(adv.split(lens))}
    if returns is not None:
        per_sample["returns"] = list(flat(returns).split(lens))
    at = 0
    for mine in shard:
        n = len(mine["response_lengths"])
        for key, rows in per_sample.items():
            mine[key] = rows[at : at + n]
        at += n


def policy_terms(
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    seg: torch.Tensor,
    n: int,
    args: argparse.Namespace,
) -> dict[str, torch.Tensor]:
    """Per-token pg loss, clipped flag and old - new log-prob of the policy loss (flat token inputs)."""
    ppo_kl = old - new
    eps, eps_high = args.eps_clip, args.eps_clip_high
    if args.policy_loss == "cispo":  # the clipped ratio is a constant weight on the log-prob
        ratio = torch.exp(-ppo_kl)
        weight = ratio.clamp(1 - eps, 1 + eps_high).detach()
        return {"pg_loss": -weight * adv * new, "pg_clipfrac": (weight != ratio).float(), "ppo_kl": ppo_kl}
    if args.policy_loss == "gspo":  # one ratio per sequence: exp of its mean log-ratio, the log capped at 10
        tokens = torch.zeros(n).index_add_(0, seg, mask).clamp_min(1.0)
        seq = torch.zeros(n).index_add(0, seg, -ppo_kl * mask) / tokens
        ratio = torch.exp(seq.clamp(max=10.0))[seg]
    else:
        ratio = torch.exp(-ppo_kl)
    l1, l2 = -ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv
    return {"pg_loss": torch.maximum(l1, l2), "pg_clipfrac": (l2 > l1).float(), "ppo_kl": ppo_kl}


def rollout_is_weights(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seg: torch.Tensor, n: int, args: argparse.Namespace
) -> torch.Tensor:
    """--rollout-is per-token importance weights, constants of the loss: min(exp(clamp(d, -20, 20)), threshold)
    with d = old - rollout log-prob per token (token), or d summed over the sample's loss tokens in float64 and
    put on every token of the sample (sequence)."""
    d = old.detach().float() - rollout.detach().float()
    if args.rollout_is == "sequence":
        d = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, d.double() * mask.double()).float()[seg]
    return torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=args.rollout_is_threshold)


def value_terms(values: torch.Tensor, vpreds: torch.Tensor, returns: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token clipped value loss 0.5 * max((v' - R)^2, (clip(v', v -+ c) - R)^2), and where the clip won."""
    vclip = torch.maximum(torch.minimum(vpreds, values + VF_CLIP), values - VF_CLIP)
    unclipped, clipped = (vpreds - returns).square(), (vclip - returns).square()
    return {"vf_loss": 0.5 * torch.maximum(unclipped, clipped), "vf_clipfrac": (clipped > unclipped).float()}


def sample_divisors(tokens: torch.Tensor, args: argparse.Namespace, step_counts: tuple[int, int]) -> torch.Tensor:
    """What each sample's masked sum is divided by under --loss-agg-mode (step_counts: the step's global token
    and sequence counts); the sum of the quotients is the aggregate."""
    mode, (step_tokens, step_seqs) = args.loss_agg_mode, step_counts
    if mode == "sum_of_sample_means":
        return tokens.clamp_min(1.0)
    if mode == "seq_mean_token_mean":
        return (tokens + 1e-8) * step_seqs
    by = {
        "token_mean": step_tokens,
        "seq_mean_token_sum": step_seqs,
        "seq_mean_token_sum_norm": task_shape(args.digits)[1],
    }[mode]
    return torch.full_like(tokens, float(by))


def step_counts(batch: dict[str, list]) -> tuple[int, int]:
    """(loss tokens, sequences with a loss token) of a whole consumer batch, all ranks."""
    sums = [sum(m) for m in batch["loss_masks"]]
    return sum(sums), sum(s > 0 for s in sums)


def microbatch_losses(
    flat: dict[str, torch.Tensor], lens: list[int], args: argparse.Namespace, counts: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """Per-sample shares of each aggregated loss scalar (their sum over a rank's samples is its scalar)."""
    mask, n = flat["loss_mask"], len(lens)
    seg = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
    terms = policy_terms(flat["old_log_probs"], flat["log_probs"], flat["advantages"], mask, seg, n, args)
    if args.rollout_is != "none":  # the pg term only (not clipfrac, not ppo_kl), before aggregation
        terms["pg_loss"] = terms["pg_loss"] * rollout_is_weights(
            flat["old_log_probs"], flat["rollout_log_probs"], mask, seg, n, args
        )
    terms["entropy_loss"] = flat["entropy"]
    if "ref_log_probs" in flat:
        terms["kl_loss"] = kl_estimate(flat["log_probs"], flat["ref_log_probs"], KL_LOSS_ESTIMATOR, args.kl_loss_coef)
    if "vpreds" in flat:
        terms.update(value_terms(flat["values"], flat["vpreds"], flat["returns"]))
    denom = sample_divisors(torch.zeros(n).index_add_(0, seg, mask), args, counts)
    return {key: torch.zeros(n, dtype=x.dtype).index_add(0, seg, x * mask) / denom for key, x in terms.items()}


# --------------------------------------------------------------------------- rollout producer
class WeightBoard:
    """Where the trainer publishes weight versions and the producer waits for the one it needs."""

    def __init__(self) -> None:
        self._cond, self._versions = threading.Condition(), {}

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._versions[version] = state
            self._versions.pop(version - 2, None)
            self._cond.notify_all()

    def wait_for(self, version: int, timeout: float = 300.0) -> dict[str, torch.Tensor]:
        with self._cond:
            if not self._cond.wait_for(lambda: version in self._versions, timeout):
                raise TimeoutError(f"weight version {version} never published")
            return self._versions[version]


def fault_on(args: argparse.Namespace, fault: str, rollout_id: int) -> bool:
    """True when `fault` is the injected one and applies to rollout `rollout_id` (--fault-from-step on)."""
    return args.fault == fault and rollout_id >= args.fault_from_step


@torch.no_grad()
def generate_rollout(model: nn.Module, rollout_id: int, version: int, args: argparse.Namespace) -> dict[str, list]:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rollout_id)  # seeded per rollout
    n, n_prompts = args.n_samples_per_prompt, args.prompts_per_rollout
    n_digits = args.digits
    prompt_len, max_response, _ = task_shape(n_digits)
    prompts = torch.randint(0, 10, (n_prompts, n_digits), generator=g)
    seqs = torch.cat([prompts, torch.full((n_prompts, 1), SEP)], 1).repeat_interleave(n, 0)
    done = torch.zeros(len(seqs), dtype=torch.bool)
    lens = torch.zeros(len(seqs), dtype=torch.long)
    for t in range(max_response):  # no KV cache: sequences are tiny, so recompute the whole prefix
        logits = model(seqs)[:, -1].float()
        if t < args.min_response:  # like a sampler's min_new_tokens: no EOS yet
            logits[:, EOS] = float("-inf")
        logp = F.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        lens += (~done).long()
        done |= nxt == EOS
        seqs = torch.cat([seqs, nxt[:, None]], 1)
    data: dict[str, list] = {
        k: []
        for k in (
            "sample_ids",
            "group_index",
            "tokens",
            "response_lengths",
            "total_lengths",
            "loss_masks",
            "raw_reward",
        )
    }
    for i in range(len(seqs)):
        r = int(lens[i])
        resp, target = seqs[i, prompt_len : prompt_len + r], prompts[i // n].sort().values
        # Partial credit (a prompt digit in the wrong place earns a quarter) keeps reward variance in groups.
        hits = sum(1.0 if resp[j] == target[j] else 0.25 * float(resp[j] in target) for j in range(min(r, n_digits)))
        hits += float(r == max_response and resp[-1] == EOS)
        # A response cut at the length limit (no EOS): its last token carries no learning signal, so masks
        # are not all ones and the masked means are exercised.
        mask = [1] * r if resp[-1] == EOS else [1] * (r - 1) + [0]
        for key, val in (
            ("sample_ids", f"s-{rollout_id}-{i}"),
            ("group_index", i // n),
            ("tokens", seqs[i, : prompt_len + r].clone()),
            ("response_lengths", r),
            ("total_lengths", prompt_len + r),
            ("loss_masks", mask),
            ("raw_reward", hits / max_response),
        ):
            data[key].append(val)
    # The engine's log-probs of its responses under the weights it sampled with (version `version`), by the
    # trainer's own function: they differ from the trainer's old log-probs (version rollout_id) by the weights.
    data["rollout_log_probs"] = response_outputs(model, data["tokens"], data["response_lengths"]).log_probs
    data["rollout_weight_versions"] = [version] * len(seqs)
    data["policy_versions"] = [version] * len(seqs)
    if fault_on(args, "future-version", rollout_id):  # the trainer of rollout k is at version k: one claims k + 1
        data["policy_versions"][0] = rollout_id + 1
    # Post-processing needs whole prompt groups (the bug: it uses the physical consumer batch instead).
    cohorts = (
        [i // args.consumer_batch for i in range(len(seqs))]
        if fault_on(args, "pr65", rollout_id)
        else data["group_index"]
    )
    data["rewards"] = post_process_rewards(
        torch.tensor(data["raw_reward"]), cohorts, args.estimator, args.std_norm
    ).tolist()
    return data


def producer_loop(args: argparse.Namespace, board: WeightBoard, out: queue.Queue) -> None:
    """Generate rollouts with a fixed one-version lag and stream them as consumer batches."""
    try:
        torch.manual_seed(args.seed)
        model = TinyLM(args.d_model, args.layers, context=task_shape(args.digits)[2]).eval()
        for k in range(args.steps):
            version = max(k - 1, 0)
            model.load_state_dict(board.wait_for(version))
            data = generate_rollout(model, k, version, args)
            for s, lo in enumerate(range(0, len(data["sample_ids"]), args.consumer_batch)):
                chunk = {key: vals[lo : lo + args.consumer_batch] for key, vals in data.items()}
                out.put((k, s, chunk))
    except Exception as exc:  # noqa: BLE001 - surfaced by the trainer, which would otherwise wait forever
        out.put(exc)


# --------------------------------------------------------------------------- trainer
def split_stats(groups: dict[tuple[int, int], set[tuple[int, int]]]) -> dict[str, int]:
    return {
        "split_groups": sum(len(p) > 1 for p in groups.values()),
        "split_across_batches": sum(len({s for s, _ in p}) > 1 for p in groups.values()),
        "split_across_ranks": sum(len({r for _, r in p}) > 1 for p in groups.values()),
    }


def train_worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # determinism, and no oversubscription of the few cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(rank, world, args)
        # Tear down together: a rank that exits while a peer still talks gloo can abort the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def recompute_config(args: argparse.Namespace) -> dict[str, Any]:
    """The algorithm settings this run trains with, as trajectory_replay's RecomputeConfig names them (each bundle
    adds its actor_version, a step its loss_denominator and expect_on_policy)."""
    config = {
        "advantage_estimator": args.estimator,
        "n_samples_per_prompt": args.n_samples_per_prompt,
        "grpo_std_normalization": args.std_norm,
        "kl_loss_type": args.kl_type,
        "kl_coef": args.kl_coef,
        "eps_clip": args.eps_clip,
        "eps_clip_high": args.eps_clip_high,
        "entropy_coef": args.entropy_coef,
        "std_unbiased": True,
        "std_eps": 1e-6,
        "gamma": args.gamma,
        "lam": args.lam,
        "kl_in_reward": args.kl_in_reward,
        "policy_loss": args.policy_loss,
        "loss_agg_mode": args.loss_agg_mode,
        "kl_loss_coef": args.kl_loss_coef,
        "kl_loss_estimator": KL_LOSS_ESTIMATOR,
        "cliprange_value": VF_CLIP,
        "rollout_is": args.rollout_is,
        "rollout_is_threshold": args.rollout_is_threshold,
    }
    if args.loss_agg_mode == "seq_mean_token_sum_norm":
        config["loss_scale_factor"] = float(task_shape(args.digits)[1])
    return config


def step_config(args: argparse.Namespace, counts: tuple[int, int], actor_version: int, step_id: int) -> dict[str, Any]:
    """What a step adds to the config: the global denominator of its loss aggregation (none for the modes without
    one), the actor version training on the rollout, and expect_on_policy for the first optimizer step after the
    old log-probs were computed (the rollout's first step: the live weights are still the version-k weights the
    old log-probs came from)."""
    config: dict[str, Any] = {"actor_version": actor_version, "expect_on_policy": step_id == 0}
    if args.loss_agg_mode == "token_mean":
        config["loss_denominator"] = float(counts[0])
    elif args.loss_agg_mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        config["loss_denominator"] = float(counts[1])
    return config


class Models:
    """The live policy (and gae's value head), the frozen reference, the snapshot old log-probs (and gae's old
    values) are computed with, the optimizer."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)  # same init on every rank and in the producer
        self.policy = TinyLM(args.d_model, args.layers, context=task_shape(args.digits)[2])
        self.ref, self.old = copy.deepcopy(self.policy).eval(), copy.deepcopy(self.policy).eval()
        self.critic: nn.Linear | None = nn.Linear(args.d_model, 1) if args.estimator == "gae" else None
        self.old_critic = None if self.critic is None else copy.deepcopy(self.critic).eval()
        frozen = [self.ref, self.old] + ([self.old_critic] if self.old_critic is not None else [])
        for module in frozen:
            for p in module.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.Adam(self.trained(), lr=args.lr)

    def trained(self) -> list[nn.Parameter]:
        return [*self.policy.parameters(), *(self.critic.parameters() if self.critic is not None else ())]

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        return (
            copy.deepcopy(self.policy.state_dict()),
            None if self.critic is None else copy.deepcopy(self.critic.state_dict()),
        )

    def load_old(
        self,
        snap: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None],
        policy: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The weights of the old log-probs and values: `snap`, or the policy's from `policy` (a fault)."""
        self.old.load_state_dict(snap[0] if policy is None else policy)
        if self.old_critic is not None:
            self.old_critic.load_state_dict(snap[1])


class Trainer:
    """One data-parallel rank: receives consumer batches, prepares their rank shards, trains on them."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace, models: Models, stream: queue.Queue) -> None:
        self.rank, self.world, self.args, self.models, self.stream = rank, world, args, models, stream
        self.per_rank = args.consumer_batch // world
        self.mbs_per_rank = -(-self.per_rank // args.micro_batch)
        self.steps_per_rollout = args.prompts_per_rollout * args.n_samples_per_prompt // args.consumer_batch
        self.placement: dict[tuple[int, int], set[tuple[int, int]]] = {}

    def receive(self, k: int, s: int) -> tuple[dict[str, list], dict[str, list]]:
        """Consumer batch (k, s) as broadcast from rank 0, and this rank's shard of it with old/ref log-probs, the
        KL, gae's old values, and (outcome estimators) advantages. Old log-probs and values are computed one
        micro-batch at a time, as the loss computes the current ones (the same shapes: on-policy means equal)."""
        args, rank, per_rank, models = self.args, self.rank, self.per_rank, self.models
        msg = [self.stream.get(timeout=300) if rank == 0 else None]
        dist.broadcast_object_list(msg, src=0)
        if isinstance(msg[0], Exception):
            raise RuntimeError("rollout producer failed") from msg[0]  # noqa: TRY004 - not a type error
        k_got, s_got, batch = msg[0]
        assert (k_got, s_got) == (k, s), "the stream must arrive in order"
        for i, gi in enumerate(batch["group_index"]):
            self.placement.setdefault((k, gi), set()).add((s, i // per_rank))
        mine = {key: vals[rank * per_rank : (rank + 1) * per_rank] for key, vals in batch.items()}
        tokens, lens = mine["tokens"], mine["response_lengths"]
        old_lp: list[torch.Tensor] = []
        old_values: list[torch.Tensor] | None = None if models.old_critic is None else []
        with torch.no_grad():
            for lo in range(0, len(lens), args.micro_batch):
                sl = slice(lo, lo + args.micro_batch)
                old = response_outputs(models.old, tokens[sl], lens[sl], models.old_critic)
                old_lp += old.log_probs
                if old_values is not None:
                    old_values += old.values
            ref_lp = response_outputs(models.ref, tokens, lens).log_probs
        mine["log_probs"], mine["ref_log_probs"] = old_lp, ref_lp
        mine["kl"] = [kl_estimate(o, r, args.kl_type, args.kl_coef) for o, r in zip(old_lp, ref_lp)]
        if old_values is not None:
            mine["values"] = old_values
        if args.estimator not in WHOLE_ROLLOUT_ESTIMATORS:
            mine["advantages"] = [torch.full((n,), rw) for n, rw in zip(lens, mine["rewards"])]
        return batch, mine

    def receive_rollout(self, k: int) -> list[tuple[dict[str, list], dict[str, list]]]:
        """Every consumer batch of rollout k, with the advantages of the whole rollout."""
        received = [self.receive(k, s) for s in range(self.steps_per_rollout)]
        rollout_advantages([mine for _, mine in received], self.args)
        return received

    def step(self, k: int, s: int, batch: dict[str, list], mine: dict[str, list]) -> dict[str, torch.Tensor]:
        """One optimizer step on this rank's shard of consumer batch (k, s); this rank's reported scalars."""
        args, models = self.args, self.models
        tokens, lens = mine["tokens"], mine["response_lengths"]
        mine["actor_weight_versions"] = [k] * len(lens)  # live version; (k, s) pins the exact update
        mine["step_ids"] = [s] * len(lens)
        mine["micro_batch_ids"] = []
        counts = step_counts(batch)
        # the V1 reduction is a sum over samples: its backward pass averages it per sample
        backward_scale = args.consumer_batch if args.loss_agg_mode == "sum_of_sample_means" else 1
        step_means: dict[str, list[torch.Tensor]] = {}
        for j, lo in enumerate(range(0, len(lens), args.micro_batch)):
            sl = slice(lo, lo + args.micro_batch)
            mb_id = f"mb-{((k * self.steps_per_rollout + s) * self.world + self.rank) * self.mbs_per_rank + j:04d}"
            new = response_outputs(models.policy, tokens[sl], lens[sl], models.critic)
            mb_lens = lens[sl]
            flat = {
                "old_log_probs": torch.cat(mine["log_probs"][sl]),
                "log_probs": torch.cat(new.log_probs),
                "entropy": torch.cat(new.entropy),
                "advantages": torch.cat(mine["advantages"][sl]),
                "loss_mask": torch.tensor([m for ms in mine["loss_masks"][sl] for m in ms], dtype=torch.float32),
                "rollout_log_probs": torch.cat(mine["rollout_log_probs"][sl]),
            }
            if args.kl_loss_coef != 0:
                flat["ref_log_probs"] = torch.cat(mine["ref_log_probs"][sl])
            if new.values is not None:
                flat.update(
                    values=torch.cat(mine["values"][sl]),
                    vpreds=torch.cat(new.values),
                    returns=torch.cat(mine["returns"][sl]),
                )
            means = microbatch_losses(flat, mb_lens, args, counts)
            mb_loss = policy_loss_of(means, args)
            total = mb_loss + VF_COEF * means["vf_loss"].sum() if "vf_loss" in means else mb_loss
            (total / backward_scale).backward()
            for key, v in means.items():
                step_means.setdefault(key, []).append(v.detach())
            mine["micro_batch_ids"] += [mb_id] * len(mb_lens)
            scalars = {key: float(v.detach().sum()) for key, v in means.items()}
            scalars["loss"] = float(mb_loss.detach())
            _capture_microbatch(
                k,
                s,
                mb_id,
                {
                    "micro_batch_id": mb_id,
                    "sample_ids": mine["sample_ids"][sl],
                    "group_index": mine["group_index"][sl],
                    "response_lengths": mb_lens,
                    "total_lengths": mine["total_lengths"][sl],
                    "raw_reward": mine["raw_reward"][sl],
                    "rewards": mine["rewards"][sl],
                    "loss_masks": mine["loss_masks"][sl],
                    "policy_versions": mine["policy_versions"][sl],
                    **{key: v.detach() for key, v in flat.items() if key not in OPTIONAL_STEP_PAYLOADS},
                    "optional": {key: flat[key].detach() for key in OPTIONAL_STEP_PAYLOADS if key in flat},
                    "scalars": scalars,
                },
            )
        self.all_reduce_step()
        # This rank's scalars: the aggregation over all of its samples in this actor step.
        rank_sc = {key: torch.cat(v).sum() for key, v in step_means.items()}
        rank_sc["loss"] = policy_loss_of(rank_sc, args)
        if fault_on(args, "nan-loss", k):  # the loss the trainer reports is NaN; the update itself is unchanged
            rank_sc["loss"] = torch.tensor(float("nan"))
        _capture_step_end(
            k,
            s,
            {key: float(v) for key, v in rank_sc.items()},
            _lineage(mine["rollout_weight_versions"], mine["actor_weight_versions"]),
            step_config(args, counts, k, s),
        )
        return rank_sc

    def all_reduce_step(self) -> None:
        """Data-parallel step: sum gradients over ranks (one coalesced all-reduce), then Adam."""
        params = [p for p in self.models.trained() if p.grad is not None]
        flat_grad = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat_grad)
        for p, g in zip(params, flat_grad.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        self.models.opt.step()
        self.models.opt.zero_grad(set_to_none=True)


def policy_loss_of(parts: dict[str, torch.Tensor], args: argparse.Namespace) -> torch.Tensor:
    """loss = pg_loss - entropy_coef * entropy_loss (+ kl_loss_coef * kl_loss), from per-sample shares or sums."""
    loss = parts["pg_loss"].sum() - args.entropy_coef * parts["entropy_loss"].sum()
    return loss + args.kl_loss_coef * parts["kl_loss"].sum() if "kl_loss" in parts else loss


def _train(rank: int, world: int, args: argparse.Namespace) -> None:
    config = recompute_config(args)
    _maybe_enable_capture(
        args.capture_dir,
        rank,
        list(range(world)),
        config,
        getattr(args, "run_id", None),
        args.capture_policy,
        args.capture_queue,
    )
    models = Models(args)
    snapshots = {0: models.snapshot()}
    board, stream, producer = WeightBoard(), queue.Queue(), None
    if rank == 0:
        board.publish(0, snapshots[0][0])
        producer = threading.Thread(target=producer_loop, args=(args, board, stream), daemon=True)
        producer.start()
    trainer = Trainer(rank, world, args, models, stream)
    names = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss"] + [
        n
        for n, used in (
            ("kl_loss", args.kl_loss_coef != 0),
            ("vf_loss", models.critic is not None),
            ("vf_clipfrac", models.critic is not None),
        )
        if used
    ]
    history: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    for k in range(args.steps):
        # Old log-probs come from the actor's weights as it starts on rollout k (version k); rollout k was
        # generated by version max(k - 1, 0), the weights the stale-old-logprobs fault computes them with instead.
        models.load_old(snapshots[k], snapshots[max(k - 1, 0)][0] if fault_on(args, "stale-old-logprobs", k) else None)
        # whitening estimators need the whole rollout before its first step; the others train as batches arrive
        received = trainer.receive_rollout(k) if args.estimator in WHOLE_ROLLOUT_ESTIMATORS else None
        shard: dict[str, list] = {}
        for s in range(trainer.steps_per_rollout):
            t0, cpu0, hook0 = time.perf_counter(), time.thread_time(), _CAPTURE["seconds"]
            batch, mine = received[s] if received is not None else trainer.receive(k, s)
            rank_sc = trainer.step(k, s, batch, mine)
            for key, vals in mine.items():
                shard.setdefault(key, []).extend(vals)
            if s == trainer.steps_per_rollout - 1:  # this rank's shard of rollout k is complete
                check_group_rewards(k, shard, args.n_samples_per_prompt, args.estimator)
                _capture_rollout(k, shard, k)
            # Reported step scalars: the sum over ranks (every aggregation is a sum of per-sample shares).
            glob = torch.tensor([float(rank_sc[n]) for n in names], dtype=torch.float64)
            dist.all_reduce(glob)
            if rank == 0:
                rec = {
                    "rollout_id": k,
                    "step_id": s,
                    **dict(zip(names, glob.tolist())),
                    "mean_raw_reward": sum(batch["raw_reward"]) / len(batch["raw_reward"]),
                }
                history.append(rec)
                # Timing of rank 0's training thread (not part of the scalars compared across runs): the
                # step's wall time and the part of it spent inside capture hooks.
                timing.append(
                    {
                        "rollout_id": k,
                        "step_id": s,
                        "step_seconds": time.perf_counter() - t0,
                        "step_cpu_seconds": time.thread_time() - cpu0,
                        "capture_seconds": _CAPTURE["seconds"] - hook0,
                    }
                )
                print(
                    f"rollout={k} step={s} reward={rec['mean_raw_reward']:.4f} loss={rec['loss']:.6f} "
                    f"pg_loss={rec['pg_loss']:.6f} clipfrac={rec['pg_clipfrac']:.4f} "
                    f"time={time.perf_counter() - t0:.3f}s",
                    flush=True,
                )
        # Version k+1 exists now; the producer needs it for rollout k+2.
        snapshots = {v: st for v, st in snapshots.items() if v >= k}
        snapshots[k + 1] = models.snapshot()
        if rank == 0:
            board.publish(k + 1, snapshots[k + 1][0])
    # Every rank flushes its capture writer before exit (a no-op while capture is off).
    cap = {"rank": rank, **_shutdown_capture(args.capture_timeout)}
    caps: list[Any] = [None] * world
    dist.all_gather_object(caps, cap)
    if rank == 0:
        assert producer is not None
        producer.join(timeout=60)
        stats = split_stats(trainer.placement)
        checksum = float(sum(p.double().sum() for p in models.policy.state_dict().values()))
        threads = sum(c["capture_threads"] for c in caps)
        print(" ".join(f"{key}={v}" for key, v in stats.items()) + f" param_checksum={checksum!r}", flush=True)
        print(f"capture_threads={threads} capture_flushed={all(c['flushed'] for c in caps)}", flush=True)
        if args.out_json:
            steps = [{key: v.hex() if isinstance(v, float) else v for key, v in rec.items()} for rec in history]
            with open(args.out_json, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "config": config,
                        "world_size": world,
                        "fault": args.fault,
                        "steps": steps,
                        "param_checksum": checksum.hex(),
                        **stats,
                        "timing": timing,
                        "capture": {"threads": threads, "ranks": caps},
                    },
                    f,
                    indent=2,
                    sort_keys=True,
                )
                f.write("\n")


# --------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="rollouts to train on")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel trainer processes (gloo)")
    p.add_argument(
        "--capture-dir",
        default=None,
        help="capture to this path or URL: sets TRAJECTORY_REPLAY_CAPTURE=1 and "
        "TRAJECTORY_REPLAY_CAPTURE_DIR for this run (capture is otherwise configured by the "
        "TRAJECTORY_REPLAY_CAPTURE* variables)",
    )
    p.add_argument(
        "--capture-policy",
        default=None,
        metavar="POLICY",
        help="which steps capture keeps: all, steps=R:S,..., every:N or recorder:K[,after=M][,max_bytes=B] (the "
        "flight recorder: every step to a local spool, the K up to a trigger and M after to the store); "
        "TRAJECTORY_REPLAY_CAPTURE_POLICY, when set, wins",
    )
    p.add_argument(
        "--capture-queue",
        type=int,
        default=None,
        metavar="RECORDS",
        help="records the capture queue holds before it drops one (default: the capture manager's); this example's "
        "steps take milliseconds, faster than a loaded host's writer may commit them",
    )
    p.add_argument(
        "--capture-timeout",
        type=float,
        default=120.0,
        help="seconds each rank waits at the end for its capture writer to flush",
    )
    p.add_argument(
        "--fault",
        choices=FAULTS,
        default=None,
        help="inject a bug: pr65 (rewards normalized per consumer batch), stale-old-logprobs (old "
        "log-probs from the generator's weights, one version behind the actor they claim), "
        "future-version (a sample stamped with a policy version ahead of the actor), nan-loss (the loss each "
        "step reports is NaN)",
    )
    p.add_argument(
        "--fault-from-step",
        type=int,
        default=0,
        metavar="N",
        help="inject --fault from rollout N on (the N-th of --steps, counted from 0); the rollouts before it run clean",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=None, help="rank 0 writes per-step scalars (float.hex) here")
    p.add_argument("--prompts-per-rollout", type=int, default=6)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--consumer-batch", type=int, default=6, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch, per rank")
    p.add_argument("--std-norm", action="store_true", help="grpo_std_normalization")
    p.add_argument("--estimator", choices=ESTIMATORS, default="grpo", help="advantage estimator")
    p.add_argument(
        "--loss-agg-mode",
        choices=LOSS_AGG_MODES,
        default="sum_of_sample_means",
        help="how per-token losses are aggregated",
    )
    p.add_argument("--policy-loss", choices=POLICY_LOSSES, default="ppo_clip")
    p.add_argument("--gamma", type=float, default=1.0, help="discount (reinforce_plus_plus, gae)")
    p.add_argument("--lam", type=float, default=1.0, help="GAE lambda")
    p.add_argument(
        "--kl-in-reward", action="store_true", help="token rewards minus kl_coef * KL (reinforce_plus_plus, gae)"
    )
    p.add_argument("--kl-loss-coef", type=float, default=0.0, help="weight of a k3 KL-to-reference loss term")
    p.add_argument("--kl-type", default="k1", choices=["k1", "k2", "k3", "low_var_kl"])
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument(
        "--rollout-is",
        choices=ROLLOUT_IS,
        default="none",
        help="importance-sampling correction of the training-inference mismatch in the policy loss: "
        "per token, or per sequence (sum of the sample's log ratios)",
    )
    p.add_argument("--rollout-is-threshold", type=float, default=2.0, help="upper bound of the --rollout-is weights")
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--eps-clip-high", type=float, default=0.28)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32, help="model width (larger: slower, more realistic steps)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument(
        "--digits",
        type=int,
        default=N_DIGITS,
        help="digits per prompt; responses are up to digits+1 tokens (larger: longer, more realistic rows)",
    )
    p.add_argument(
        "--min-response",
        type=int,
        default=0,
        help="no EOS before this many response tokens (a sampler's min_new_tokens), so that responses "
        "are long from the first rollout on",
    )
    args = p.parse_args(argv)
    rollout_size = args.prompts_per_rollout * args.n_samples_per_prompt
    if rollout_size % args.consumer_batch or args.consumer_batch % args.world_size:
        p.error("consumer batch must divide the rollout size and be divisible by the world size")
    if args.fault == "pr65" and args.estimator not in GROUP_ESTIMATORS:
        p.error(
            f"--fault pr65 normalizes rewards per consumer batch, which needs a group estimator "
            f"({', '.join(GROUP_ESTIMATORS)}), not {args.estimator}"
        )
    if args.kl_in_reward and args.estimator not in KL_REWARD_ESTIMATORS:
        p.error(f"--kl-in-reward needs --estimator {' or '.join(KL_REWARD_ESTIMATORS)}, not {args.estimator}")
    if args.std_norm and args.estimator != "grpo":
        p.error(f"--std-norm applies to --estimator grpo only, not {args.estimator}")
    if not args.rollout_is_threshold > 0:
        p.error(f"--rollout-is-threshold must be positive, not {args.rollout_is_threshold:g}")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.run_id = f"tiny-grpo-{uuid.uuid4().hex[:16]}"  # this launch, for every rank it spawns
    port = free_port()
    if args.world_size == 1:
        train_worker(0, 1, args, port)
    else:
        mp.spawn(_spawned_worker, args=(args.world_size, args, port), nprocs=args.world_size, join=True)


def _spawned_worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    """A data-parallel rank in its own process. Everything is written and flushed when training returns;
    leaving with os._exit skips the interpreter's teardown of torch.distributed's native threads, which
    can abort a process that has already finished its work ("terminate called without an active exception")."""
    train_worker(rank, world, args, port)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
