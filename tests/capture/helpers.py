"""Consistent capture inputs built from the canonical numbers (the canonical case of docs/replay.md)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from trajectory_replay.bundle.schema import RecomputeConfig

RAW = [1.0, 3.0, 10.0, 12.0]
GROUPS = [0, 0, 1, 1]
REWARDS = [-1.0, 1.0, -1.0, 1.0]  # per-group normalized (n = 2, no std normalization)
TOKENS = 2
OLD, REF, ENTROPY, CURRENT = 0.0, 0.25, 0.5, 0.5
KL_COEF, EPS, ENTROPY_COEF = 0.1, 0.2, 0.01
CONFIG = RecomputeConfig(
    advantage_estimator="grpo",
    n_samples_per_prompt=2,
    kl_loss_type="k1",
    kl_coef=KL_COEF,
    eps_clip=EPS,
    eps_clip_high=EPS,
    entropy_coef=ENTROPY_COEF,
)
IDS = [f"s-{i}" for i in range(4)]


def rollout_kwargs(positions: Sequence[int] = range(4), device: str = "cpu", flat: bool = False) -> dict[str, Any]:
    """capture_rollout keyword arguments for the given canonical samples (per-sample lists, or flat tensors)."""
    pos = list(positions)

    def per_token(value_of) -> Any:
        parts = [torch.full((TOKENS,), float(value_of(i)), device=device) for i in pos]
        return torch.cat(parts) if flat else parts

    return dict(
        sample_ids=[IDS[i] for i in pos],
        group_index=[GROUPS[i] for i in pos],
        response_lengths=[TOKENS] * len(pos),
        total_lengths=[TOKENS + 1] * len(pos),
        loss_masks=[[1] * TOKENS for _ in pos],
        raw_rewards=[RAW[i] for i in pos],
        rewards=[REWARDS[i] for i in pos],
        old_log_probs=per_token(lambda i: OLD),
        ref_log_probs=per_token(lambda i: REF),
        kl=per_token(lambda i: OLD - REF),
        advantages=per_token(lambda i: REWARDS[i]),
        config=CONFIG,
        weight_lineage={"rollout_weight": 6, "actor_weight": 7},
    )


def microbatch_kwargs(positions: Sequence[int], device: str = "cpu") -> dict[str, Any]:
    """capture_microbatch keyword arguments (flat per-token tensors) for the given canonical samples."""
    pos = list(positions)
    n = len(pos) * TOKENS
    return dict(
        sample_ids=[IDS[i] for i in pos],
        group_index=[GROUPS[i] for i in pos],
        response_lengths=[TOKENS] * len(pos),
        total_lengths=[TOKENS + 1] * len(pos),
        loss_masks=[[1] * TOKENS for _ in pos],
        raw_rewards=[RAW[i] for i in pos],
        rewards=[REWARDS[i] for i in pos],
        old_log_probs=torch.full((n,), OLD, device=device),
        log_probs=torch.full((n,), CURRENT, device=device),
        entropy=torch.full((n,), ENTROPY, device=device),
        advantages=torch.tensor([REWARDS[i] for i in pos for _ in range(TOKENS)], device=device),
    )


def loss_scalars(positions: Sequence[int]) -> dict[str, float]:
    """The V1 loss scalars of the given samples (plain Python; every token of a sample is identical)."""
    ratio = math.exp(CURRENT - OLD)
    clipped = min(max(ratio, 1 - EPS), 1 + EPS)
    pg = clipfrac = 0.0
    for i in positions:
        a = REWARDS[i]
        pg += max(-ratio * a, -clipped * a)
        clipfrac += 1.0 if -clipped * a > -ratio * a else 0.0
    ent = ENTROPY * len(positions)
    return {
        "loss": pg - ENTROPY_COEF * ent,
        "pg_loss": pg,
        "entropy_loss": ent,
        "pg_clipfrac": clipfrac,
        "ppo_kl": (OLD - CURRENT) * len(positions),
    }


def capture_step(
    target,
    rollout_id: int,
    step_id: int,
    micro_batches: Sequence[Sequence[int]],
    first_mb: int = 0,
    device: str = "cpu",
) -> Any:
    """Feed micro-batches then end the step, through a manager or the hooks module."""
    for j, pos in enumerate(micro_batches):
        target.capture_microbatch(rollout_id, step_id, f"mb-{first_mb + j:04d}", **microbatch_kwargs(pos, device))
    everything = [p for pos in micro_batches for p in pos]
    return target.capture_step_end(
        rollout_id, step_id, config=CONFIG, weight_lineage={"actor_weight": 7}, **loss_scalars(everything)
    )


def writer_processes() -> set[int]:
    """The capture writer processes this process started."""
    found = set()
    for entry in os.scandir("/proc"):
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"capture.worker import main" in command:
            found.add(int(entry.name))
    return found


def idle_writer(make) -> tuple:
    """(manager `make()` made, its writer process's pid) once that process is idle (scheduled only on a CPU that has
    nothing else to do: set as it starts), then given normal scheduling back where this test may (as root, or with
    CAP_SYS_NICE). Idle, it would start, import and write only when the host has a CPU with nothing
    else to do, and a loaded test host may have none for minutes: what it writes is checked here, not when."""
    before = writer_processes()
    manager = make()
    waited = time.monotonic()
    while time.monotonic() - waited < 120:  # its start: a few milliseconds of work at nice 10 before it is idle
        started = [pid for pid in writer_processes() - before if os.sched_getscheduler(pid) == os.SCHED_IDLE]
        if started:
            break
        time.sleep(0.01)
    [pid] = started
    assert os.getpriority(os.PRIO_PROCESS, pid) >= 10
    normal_scheduling(pid)
    return manager, pid


def normal_scheduling(pid: int) -> None:
    """Give every thread of process `pid` normal scheduling where this test may (as root, or with CAP_SYS_NICE);
    scheduling is per thread, and the threads it started while idle are idle too. Elsewhere it writes when the
    host has a CPU with nothing else to do."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except ProcessLookupError:  # a thread that just ended
            continue
        except PermissionError:
            return
