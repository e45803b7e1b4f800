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
- Old log-probs are the rollout policy's log-probs *recomputed by the trainer* with a snapshot of the weights
  that generated the samples (the sampler's own values are kept as rollout_log_probs; they may differ by kernel
  rounding). Current log-probs come from the live model, reference log-probs from the frozen initial model.
- KL (k1/k2/k3/low_var_kl, gated by kl_coef) is computed and recorded per token as in V1's GRPO; it enters the
  token rewards of reinforce_plus_plus and gae only with --kl-in-reward, and the loss only with --kl-loss-coef.
- Advantages (--estimator): grpo, dr_grpo and rloo put the sample's post-processed reward on every token;
  reinforce_plus_plus(_baseline) and gae work on token rewards and whiten over the whole rollout (every rank's
  shard of it), so for them the trainer receives a rollout's consumer batches before its first step. gae adds a
  value head on the model's hidden states: old values from the behaviour snapshot, current ones from the live
  model, and 0.5 * vf_loss in the training loss.
- Loss scalars are aggregated by --loss-agg-mode; the default is the V1 reduction R(x) = sum over samples of the
  per-sample masked mean, whose backward pass uses R(.)/consumer_batch (an average per sample). The other modes
  divide by the step's global token or sequence count (recorded as loss_denominator) or by the longest response
  (loss_scale_factor). Gradients are all-reduced over gloo (summed).

The algorithms are this file's own code (it plays the training framework), not trajectory_replay's.
`--fault pr65` reproduces the canonical bug: rewards are normalized over each physical consumer batch.

Capture (trajectory_replay.capture) is off unless RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR are set
(`--capture-dir URL` sets both for the run). Every trainer rank then writes its own shard of a rollout-level
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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from trajectory_replay import capture

SEP, EOS, PAD, VOCAB = 10, 11, 12, 16
N_DIGITS = 4                    # the default task size (--digits)
MIN_CONTEXT = 16


def task_shape(digits: int) -> tuple[int, int, int]:
    """(prompt length, longest response, model context) for prompts of `digits` digits."""
    prompt_len = digits + 1          # digits + SEP
    max_response = digits + 1        # sorted digits + EOS
    return prompt_len, max_response, max(MIN_CONTEXT, prompt_len + max_response)

# --------------------------------------------------------------------------- capture hooks
# Capture is configured only by the RELAX_REPLAY_CAPTURE* environment variables (read by
# trajectory_replay.capture.maybe_enable_for_actor); `--capture-dir URL` is a shortcut that sets
# RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR=URL for this run only (os.environ is not changed).
# While capture is off every hook below returns after one check; nothing is imported lazily, nothing is
# started. The hooks only snapshot (copy) what training already computed, so numerics never change.
_CAPTURE: dict[str, Any] = {"manager": None, "config": None, "seconds": 0.0}
CAPTURE_THREAD_PREFIX = "trajectory-replay-capture"


def capture_environ(capture_dir: str | None) -> dict[str, str]:
    """The environment capture is configured from: os.environ, plus what --capture-dir implies."""
    env = dict(os.environ)
    if capture_dir:
        env.update(RELAX_REPLAY_CAPTURE="1", RELAX_REPLAY_CAPTURE_DIR=capture_dir)
    return env


def capture_threads() -> int:
    return sum(t.name.startswith(CAPTURE_THREAD_PREFIX) for t in threading.enumerate())


def _timed_hook(fn):
    """Accumulate the time the training thread spends inside a capture hook (for --out-json)."""
    def wrapper(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        finally:
            _CAPTURE["seconds"] += time.perf_counter() - t0
    wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
    return wrapper


def _maybe_enable_capture(capture_dir: str | None, rank: int, expected_ranks: list[int],
                          config: dict[str, Any]) -> None:
    """Every trainer rank is a producer: each DP rank writes its own shard of every bundle."""
    _CAPTURE["config"] = dict(config)
    _CAPTURE["manager"] = capture.maybe_enable_for_actor(
        rank, is_producer=True, expected_ranks=expected_ranks, environ=capture_environ(capture_dir),
        topology={"dp": len(expected_ranks), "tp": 1, "pp": 1, "cp": 1})


def _lineage(rollout_versions: list[int], actor_versions: list[int]) -> dict[str, Any]:
    """rollout_weight = the version that generated the samples, actor_weight = the live version."""
    def one(values: list[int]) -> int | str:
        distinct = sorted(set(values))
        return distinct[0] if len(distinct) == 1 else ",".join(map(str, distinct))
    return {"rollout_weight": one(rollout_versions), "actor_weight": one(actor_versions)}


@_timed_hook
def _capture_rollout(rollout_id: int, rollout_data: dict[str, list]) -> None:
    """Rollout-level data of this rank's shard of one rollout (dict of per-sample lists)."""
    capture.capture_slime_rollout(
        rollout_id, rollout_data, config=_CAPTURE["config"],
        weight_lineage=_lineage(rollout_data["rollout_weight_versions"], rollout_data["actor_weight_versions"]))


@_timed_hook
def _capture_microbatch(rollout_id: int, step_id: int, mb_id: str, data: dict[str, Any]) -> None:
    """Step-level data of one micro-batch, as the loss saw it (reference log-probs with a KL loss, values with
    a value loss)."""
    capture.capture_microbatch(
        rollout_id, step_id, mb_id, sample_ids=data["sample_ids"], group_index=data["group_index"],
        response_lengths=data["response_lengths"], total_lengths=data["total_lengths"],
        loss_masks=data["loss_mask"], raw_rewards=data["raw_reward"], rewards=data["rewards"],
        old_log_probs=data["old_log_probs"], log_probs=data["log_probs"], entropy=data["entropy"],
        advantages=data["advantages"], ref_log_probs=data.get("ref_log_probs"), values=data.get("values"),
        vpreds=data.get("vpreds"), returns=data.get("returns"))


@_timed_hook
def _capture_step_end(rollout_id: int, step_id: int, scalars: dict[str, float],
                      weight_lineage: dict[str, Any] | None = None, step_config: dict[str, Any] | None = None) -> None:
    """This rank's reported loss scalars for actor step (rollout_id, step_id); `step_config` adds what only this
    step knows (its global loss denominator)."""
    capture.capture_step_end(rollout_id, step_id, loss=scalars["loss"], pg_loss=scalars["pg_loss"],
                             entropy_loss=scalars["entropy_loss"], pg_clipfrac=scalars["pg_clipfrac"],
                             ppo_kl=scalars["ppo_kl"], kl_loss=scalars.get("kl_loss"),
                             vf_loss=scalars.get("vf_loss"), vf_clipfrac=scalars.get("vf_clipfrac"),
                             config={**_CAPTURE["config"], **(step_config or {})}, weight_lineage=weight_lineage)


def _shutdown_capture(timeout: float) -> dict[str, Any]:
    """End of training: flush and stop this rank's writer; what happened, for --out-json.

    "flushed" is true only when every captured record landed: `shutdown` also returns True once records failed
    or were dropped (a store that cannot be used), since nothing is left to do."""
    manager = _CAPTURE["manager"]
    threads = capture_threads()
    done = capture.shutdown(timeout)
    stats = manager.stats() if manager is not None else None
    landed = stats is None or (stats["written"] == stats["enqueued"] and not stats["errors"]
                               and not stats["dropped"])
    return {"enabled": manager is not None, "capture_threads": threads, "flushed": done and landed,
            "stats": stats}


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> logits [B, T, V]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def response_logprobs(model: nn.Module, tokens: list[torch.Tensor], resp_lens: list[int]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample log-probs and entropies of the response tokens (one padded forward pass)."""
    x = torch.full((len(tokens), max(len(t) for t in tokens)), PAD, dtype=torch.long)
    for i, t in enumerate(tokens):
        x[i, :len(t)] = t
    logp = F.log_softmax(model(x)[:, :-1].float(), dim=-1)       # position j predicts token j+1
    tok_lp = logp.gather(-1, x[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    starts = [len(t) - r - 1 for t, r in zip(tokens, resp_lens)]
    return ([tok_lp[i, s:s + r] for i, (s, r) in enumerate(zip(starts, resp_lens))],
            [ent[i, s:s + r] for i, (s, r) in enumerate(zip(starts, resp_lens))])


# --------------------------------------------------------------------------- GRPO math (independent of the package)
def normalize_rewards(raw: torch.Tensor, cohorts: list[int], std: bool) -> torch.Tensor:
    """r' = r - mean over the cohort, optionally / (unbiased std + 1e-6); float32, cohorts by label."""
    out = torch.empty_like(raw)
    for c in dict.fromkeys(cohorts):
        idx = torch.tensor([i for i, x in enumerate(cohorts) if x == c])
        r = raw[idx] - raw[idx].mean()
        out[idx] = r / (r.std() + 1e-6) if std else r
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


def policy_loss(old: torch.Tensor, new: torch.Tensor, adv: torch.Tensor, ent: torch.Tensor,
                mask: torch.Tensor, lens: list[int], eps: float, eps_high: float) -> dict[str, torch.Tensor]:
    """PPO clipped loss; returns per-sample masked means (V1 reduction = their sum). Flat token inputs."""
    ppo_kl = old - new
    ratio = torch.exp(-ppo_kl)
    l1, l2 = -ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    denom = torch.zeros(len(lens)).index_add_(0, seg, mask).clamp_min(1.0)

    def per_sample(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(lens), dtype=x.dtype).index_add(0, seg, x * mask) / denom

    return {"pg_loss": per_sample(torch.maximum(l1, l2)), "pg_clipfrac": per_sample((l2 > l1).float()),
            "ppo_kl": per_sample(ppo_kl), "entropy_loss": per_sample(ent)}


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


@torch.no_grad()
def generate_rollout(model: nn.Module, rollout_id: int, version: int, args: argparse.Namespace
                     ) -> dict[str, list]:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rollout_id)   # seeded per rollout
    n, n_prompts = args.n_samples_per_prompt, args.prompts_per_rollout
    n_digits = args.digits
    prompt_len, max_response, _ = task_shape(n_digits)
    prompts = torch.randint(0, 10, (n_prompts, n_digits), generator=g)
    seqs = torch.cat([prompts, torch.full((n_prompts, 1), SEP)], 1).repeat_interleave(n, 0)
    done = torch.zeros(len(seqs), dtype=torch.bool)
    lens, logps = torch.zeros(len(seqs), dtype=torch.long), []
    for t in range(max_response):   # no KV cache: sequences are tiny, so recompute the whole prefix
        logits = model(seqs)[:, -1].float()
        if t < args.min_response:   # like a sampler's min_new_tokens: no EOS yet
            logits[:, EOS] = float("-inf")
        logp = F.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        logps.append(logp.gather(1, nxt[:, None]).squeeze(1))
        lens += (~done).long()
        done |= nxt == EOS
        seqs = torch.cat([seqs, nxt[:, None]], 1)
    logps_t = torch.stack(logps, 1)
    data: dict[str, list] = {k: [] for k in ("sample_ids", "group_index", "tokens", "response_lengths",
                                             "total_lengths", "loss_masks", "raw_reward", "rollout_log_probs")}
    for i in range(len(seqs)):
        r = int(lens[i])
        resp, target = seqs[i, prompt_len:prompt_len + r], prompts[i // n].sort().values
        # Partial credit (a prompt digit in the wrong place earns a quarter) keeps reward variance in groups.
        hits = sum(1.0 if resp[j] == target[j] else 0.25 * float(resp[j] in target)
                   for j in range(min(r, n_digits)))
        hits += float(r == max_response and resp[-1] == EOS)
        # A response cut at the length limit (no EOS): its last token carries no learning signal, so masks
        # are not all ones and the masked means are exercised.
        mask = [1] * r if resp[-1] == EOS else [1] * (r - 1) + [0]
        for key, val in (("sample_ids", f"s-{rollout_id}-{i}"), ("group_index", i // n),
                         ("tokens", seqs[i, :prompt_len + r].clone()), ("response_lengths", r),
                         ("total_lengths", prompt_len + r), ("loss_masks", mask),
                         ("raw_reward", hits / max_response), ("rollout_log_probs", logps_t[i, :r].clone())):
            data[key].append(val)
    data["rollout_weight_versions"] = [version] * len(seqs)
    # Post-processing needs whole prompt groups (the bug: it uses the physical consumer batch instead).
    cohorts = ([i // args.consumer_batch for i in range(len(seqs))] if args.fault == "pr65"
               else data["group_index"])
    data["rewards"] = normalize_rewards(torch.tensor(data["raw_reward"]), cohorts, args.std_norm).tolist()
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
                chunk = {key: vals[lo:lo + args.consumer_batch] for key, vals in data.items()}
                out.put((k, s, chunk))
    except Exception as exc:  # noqa: BLE001 - surfaced by the trainer, which would otherwise wait forever
        out.put(exc)


# --------------------------------------------------------------------------- trainer
def split_stats(groups: dict[tuple[int, int], set[tuple[int, int]]]) -> dict[str, int]:
    return {"split_groups": sum(len(p) > 1 for p in groups.values()),
            "split_across_batches": sum(len({s for s, _ in p}) > 1 for p in groups.values()),
            "split_across_ranks": sum(len({r for _, r in p}) > 1 for p in groups.values())}


def train_worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)   # determinism, and no oversubscription of the few cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _train(rank, world, args)
        # Tear down together: a rank that exits while a peer still talks gloo can abort the peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, args: argparse.Namespace) -> None:
    config = {"advantage_estimator": "grpo", "n_samples_per_prompt": args.n_samples_per_prompt,
              "grpo_std_normalization": args.std_norm, "kl_loss_type": args.kl_type, "kl_coef": args.kl_coef,
              "eps_clip": args.eps_clip, "eps_clip_high": args.eps_clip_high, "entropy_coef": args.entropy_coef}
    _maybe_enable_capture(args.capture_dir, rank, list(range(world)), config)
    torch.manual_seed(args.seed)   # same init on every rank and in the producer
    policy = TinyLM(args.d_model, args.layers, context=task_shape(args.digits)[2])
    ref, behaviour = copy.deepcopy(policy).eval(), copy.deepcopy(policy).eval()
    for p in [*ref.parameters(), *behaviour.parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    snapshots = {0: copy.deepcopy(policy.state_dict())}
    per_rank = args.consumer_batch // world
    mbs_per_rank = -(-per_rank // args.micro_batch)
    steps_per_rollout = args.prompts_per_rollout * args.n_samples_per_prompt // args.consumer_batch
    board, stream, producer = WeightBoard(), queue.Queue(), None
    if rank == 0:
        board.publish(0, snapshots[0])
        producer = threading.Thread(target=producer_loop, args=(args, board, stream), daemon=True)
        producer.start()
    history: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    placement: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for k in range(args.steps):
        behaviour.load_state_dict(snapshots[max(k - 1, 0)])   # the weights that generated rollout k
        shard: dict[str, list] = {}
        for s in range(steps_per_rollout):
            t0, cpu0, hook0 = time.perf_counter(), time.thread_time(), _CAPTURE["seconds"]
            msg = [stream.get(timeout=300) if rank == 0 else None]
            dist.broadcast_object_list(msg, src=0)
            if isinstance(msg[0], Exception):
                raise RuntimeError("rollout producer failed") from msg[0]  # noqa: TRY004 - not a type error
            k_got, s_got, batch = msg[0]
            assert (k_got, s_got) == (k, s), "the stream must arrive in order"
            for i, gi in enumerate(batch["group_index"]):
                placement.setdefault((k, gi), set()).add((s, i // per_rank))
            mine = {key: vals[rank * per_rank:(rank + 1) * per_rank] for key, vals in batch.items()}
            tokens, lens = mine["tokens"], mine["response_lengths"]
            with torch.no_grad():
                old_lp, _ = response_logprobs(behaviour, tokens, lens)
                ref_lp, _ = response_logprobs(ref, tokens, lens)
            mine["log_probs"], mine["ref_log_probs"] = old_lp, ref_lp
            mine["kl"] = [kl_estimate(o, r, args.kl_type, args.kl_coef) for o, r in zip(old_lp, ref_lp)]
            mine["advantages"] = [torch.full((n,), rw) for n, rw in zip(lens, mine["rewards"])]
            mine["actor_weight_versions"] = [k] * len(lens)   # live version; (k, s) pins the exact update
            mine["step_ids"] = [s] * len(lens)
            mine["micro_batch_ids"] = []
            step_means: dict[str, list[torch.Tensor]] = {}
            for j, lo in enumerate(range(0, len(lens), args.micro_batch)):
                sl = slice(lo, lo + args.micro_batch)
                mb_id = f"mb-{((k * steps_per_rollout + s) * world + rank) * mbs_per_rank + j:04d}"
                new_lp, ent = response_logprobs(policy, tokens[sl], lens[sl])
                mb_lens = lens[sl]
                flat = {"old_log_probs": torch.cat(old_lp[sl]), "log_probs": torch.cat(new_lp),
                        "entropy": torch.cat(ent), "advantages": torch.cat(mine["advantages"][sl]),
                        "loss_mask": torch.tensor([m for ms in mine["loss_masks"][sl] for m in ms],
                                                  dtype=torch.float32)}
                means = policy_loss(flat["old_log_probs"], flat["log_probs"], flat["advantages"],
                                    flat["entropy"], flat["loss_mask"], mb_lens, args.eps_clip,
                                    args.eps_clip_high)
                mb_loss = means["pg_loss"].sum() - args.entropy_coef * means["entropy_loss"].sum()
                (mb_loss / args.consumer_batch).backward()
                for key, v in means.items():
                    step_means.setdefault(key, []).append(v.detach())
                mine["micro_batch_ids"] += [mb_id] * len(mb_lens)
                scalars = {key: float(v.detach().sum()) for key, v in means.items()}
                scalars["loss"] = float(mb_loss.detach())
                _capture_microbatch(k, s, mb_id, {
                    "micro_batch_id": mb_id, "sample_ids": mine["sample_ids"][sl],
                    "group_index": mine["group_index"][sl], "response_lengths": mb_lens,
                    "total_lengths": mine["total_lengths"][sl], "raw_reward": mine["raw_reward"][sl],
                    "rewards": mine["rewards"][sl], "loss_masks": mine["loss_masks"][sl],
                    **{key: v.detach() for key, v in flat.items()},
                    "ref_log_probs": torch.cat(ref_lp[sl]), "scalars": scalars})
            # Data-parallel step: sum gradients over ranks (one coalesced all-reduce), then Adam.
            params = [p for p in policy.parameters() if p.grad is not None]
            flat_grad = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat_grad)
            for p, g in zip(params, flat_grad.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
            opt.step()
            opt.zero_grad(set_to_none=True)
            # This rank's scalars: V1 reduction over all of its samples in this actor step.
            rank_sc = {key: torch.cat(v).sum() for key, v in step_means.items()}
            rank_sc["loss"] = rank_sc["pg_loss"] - args.entropy_coef * rank_sc["entropy_loss"]
            _capture_step_end(k, s, {key: float(v) for key, v in rank_sc.items()},
                              _lineage(mine["rollout_weight_versions"], mine["actor_weight_versions"]))
            for key, vals in mine.items():
                shard.setdefault(key, []).extend(vals)
            if s == steps_per_rollout - 1:   # this rank's shard of rollout k is complete
                _capture_rollout(k, shard)
            # Reported step scalars: the sum over ranks (the reduction is a sum over samples).
            names = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss"]
            glob = torch.tensor([float(rank_sc[n]) for n in names], dtype=torch.float64)
            dist.all_reduce(glob)
            if rank == 0:
                rec = {"rollout_id": k, "step_id": s, **dict(zip(names, glob.tolist())),
                       "mean_raw_reward": sum(batch["raw_reward"]) / len(batch["raw_reward"])}
                history.append(rec)
                # Timing of rank 0's training thread (not part of the scalars compared across runs): the
                # step's wall time and the part of it spent inside capture hooks.
                timing.append({"rollout_id": k, "step_id": s, "step_seconds": time.perf_counter() - t0,
                               "step_cpu_seconds": time.thread_time() - cpu0,
                               "capture_seconds": _CAPTURE["seconds"] - hook0})
                print(f"rollout={k} step={s} reward={rec['mean_raw_reward']:.4f} loss={rec['loss']:.6f} "
                      f"pg_loss={rec['pg_loss']:.6f} clipfrac={rec['pg_clipfrac']:.4f} "
                      f"time={time.perf_counter() - t0:.3f}s", flush=True)
        # Version k+1 exists now; the producer needs it for rollout k+2.
        snapshots = {v: st for v, st in snapshots.items() if v >= k}
        snapshots[k + 1] = copy.deepcopy(policy.state_dict())
        if rank == 0:
            board.publish(k + 1, snapshots[k + 1])
    # Every rank flushes its capture writer before exit (a no-op while capture is off).
    cap = {"rank": rank, **_shutdown_capture(args.capture_timeout)}
    caps: list[Any] = [None] * world
    dist.all_gather_object(caps, cap)
    if rank == 0:
        assert producer is not None
        producer.join(timeout=60)
        stats = split_stats(placement)
        checksum = float(sum(p.double().sum() for p in policy.state_dict().values()))
        threads = sum(c["capture_threads"] for c in caps)
        print(" ".join(f"{key}={v}" for key, v in stats.items()) + f" param_checksum={checksum!r}", flush=True)
        print(f"capture_threads={threads} capture_flushed={all(c['flushed'] for c in caps)}", flush=True)
        if args.out_json:
            steps = [{key: v.hex() if isinstance(v, float) else v for key, v in rec.items()} for rec in history]
            with open(args.out_json, "w", encoding="utf-8") as f:
                json.dump({"config": config, "world_size": world, "fault": args.fault, "steps": steps,
                           "param_checksum": checksum.hex(), **stats, "timing": timing,
                           "capture": {"threads": threads, "ranks": caps}}, f, indent=2, sort_keys=True)
                f.write("\n")


# --------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="rollouts to train on")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel trainer processes (gloo)")
    p.add_argument("--capture-dir", default=None,
                   help="capture to this path or URL: sets RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR for "
                        "this run (capture is otherwise configured by the RELAX_REPLAY_CAPTURE* variables)")
    p.add_argument("--capture-timeout", type=float, default=120.0,
                   help="seconds each rank waits at the end for its capture writer to flush")
    p.add_argument("--fault", choices=["pr65"], default=None, help="inject the per-batch normalization bug")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-json", default=None, help="rank 0 writes per-step scalars (float.hex) here")
    p.add_argument("--prompts-per-rollout", type=int, default=6)
    p.add_argument("--n-samples-per-prompt", type=int, default=4)
    p.add_argument("--consumer-batch", type=int, default=6, help="samples per optimizer step, all ranks")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch, per rank")
    p.add_argument("--std-norm", action="store_true", help="grpo_std_normalization")
    p.add_argument("--kl-type", default="k1", choices=["k1", "k2", "k3", "low_var_kl"])
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument("--eps-clip", type=float, default=0.2)
    p.add_argument("--eps-clip-high", type=float, default=0.28)
    p.add_argument("--entropy-coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32, help="model width (larger: slower, more realistic steps)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--digits", type=int, default=N_DIGITS,
                   help="digits per prompt; responses are up to digits+1 tokens (larger: longer, more realistic rows)")
    p.add_argument("--min-response", type=int, default=0,
                   help="no EOS before this many response tokens (a sampler's min_new_tokens), so that responses "
                        "are long from the first rollout on")
    args = p.parse_args(argv)
    rollout_size = args.prompts_per_rollout * args.n_samples_per_prompt
    if rollout_size % args.consumer_batch or args.consumer_batch % args.world_size:
        p.error("consumer batch must divide the rollout size and be divisible by the world size")
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
