"""Flight recorder benchmarks: the example's step time under `recorder:8` against capture off, the spool's bytes
against its bound over 200 steps, and the objects a promotion of 8 steps sends to S3."""

from __future__ import annotations

import shutil
import time
from typing import Any

from benchmarks.bench_capture import STEP_TIME_WORLD, ModeTimes, run_example
from benchmarks.common import Context, Row, fmt_bytes, median

GROUP = "recorder"
TITLE = "recorder: step time, spool bound, promotion"
STEP_MODEL = ("--d-model", "256", "--layers", "4")
"""A model whose optimizer step takes tens of milliseconds here: the recorder's writer has a step's time to commit
the step into the spool (the example's small default steps take a few milliseconds, faster than any writer)."""

HOW = """\
**step time**: the example (`examples/tiny_grpo.py --d-model 256 --layers 4`, one training rank, 4 optimizer steps
per rollout) in fresh processes, capture off against the policy `recorder:8` with the spool and the store on
local disk, and (for comparison) capture of every step (`all`) to local disk, the modes interleaved in each round
(their order rotating); the figure is the median step wall
time of rank 0's training thread over every step but each run's first (it waits for the first rollout), against the
same for capture off; the detail gives the range of the per-run medians. The recorder's writer is the capture
writer process (the default) at idle priority. **spool bound**: 200 steps of 8 samples x 1,024 tokens (fresh
random float32 payloads each step, about 130 KiB of payloads a step) driven through the capture hooks into
`recorder:8,max_bytes=640K` (a bound of five steps: the byte bound evicts before the step bound does), the
spool's bytes on disk measured after every step (the writer flushed): the figure is the largest, against the
bound. **promotion**: 24 steps into `recorder:8` with the store on the local S3 server, the user trigger at step
12 and again at step 20 (the two windows share steps' chunks); the figure is the objects the promotions sent
against the keys the store gained (equal when nothing already there is sent again), with the objects they found
there."""


MODES = ("off", "all", "recorder")


def _times(ctx: Context, reps: int, rollouts: int) -> dict[str, ModeTimes]:
    times = {mode: ModeTimes() for mode in MODES}
    for rep in range(reps):
        for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:  # the order rotates round by round
            env: dict[str, str] = {}
            if mode != "off":
                where = ctx.path(f"recorder-run-{mode}")
                env = {
                    "TRAJECTORY_REPLAY_CAPTURE": "1",
                    "TRAJECTORY_REPLAY_CAPTURE_DIR": str(where / "store"),
                    "TRAJECTORY_REPLAY_CAPTURE_SPOOL": str(where / "spool"),
                    "TRAJECTORY_REPLAY_CAPTURE_POLICY": "recorder:8" if mode == "recorder" else "all",
                }
            ctx.log(f"recorder step time: round {rep + 1}/{reps}, {mode}")
            times[mode].add(run_example(ctx, mode, rollouts, env, world=STEP_TIME_WORLD, model=STEP_MODEL))
    return times


def _step_time_row(ctx: Context) -> Row:
    times = _times(ctx, max(ctx.reps(6), 1), ctx.size(4, 2))
    off, every, rec = (times[m] for m in MODES)
    ratio = median(rec.step) / median(off.step)
    return Row(
        GROUP,
        "step time, recorder:8 vs capture off (local spool and store, W=1)",
        f"{ratio:.3f}x",
        "<= 1.05x",
        ratio <= 1.05,
        f"median step {median(rec.step) * 1e3:.1f} ms vs {median(off.step) * 1e3:.1f} ms over {len(rec.step)} and "
        f"{len(off.step)} steps; per-run medians {min(rec.run_medians) * 1e3:.1f}-{max(rec.run_medians) * 1e3:.1f}"
        f" ms vs {min(off.run_medians) * 1e3:.1f}-{max(off.run_medians) * 1e3:.1f} ms; capture of every step (all) "
        f"{median(every.step) / median(off.step):.3f}x",
    )


def _step(manager: Any, r: int, s: int, n: int = 8, tokens: int = 1024) -> None:
    import torch

    ids = [f"s-{r}-{s}-{i}" for i in range(n)]
    flat = n * tokens
    manager.capture_microbatch(
        r,
        s,
        "mb-0",
        sample_ids=ids,
        group_index=[i // 4 for i in range(n)],
        response_lengths=[tokens] * n,
        total_lengths=[tokens + 8] * n,
        loss_masks=torch.ones(flat, dtype=torch.uint8),
        raw_rewards=[float(i % 3) for i in range(n)],
        rewards=[float(i % 3) - 1.0 for i in range(n)],
        old_log_probs=torch.randn(flat),
        log_probs=torch.randn(flat),
        entropy=torch.rand(flat),
        advantages=torch.randn(flat),
    )
    manager.capture_step_end(
        r,
        s,
        loss=-0.5,
        pg_loss=-0.5,
        entropy_loss=0.5,
        pg_clipfrac=0.0,
        ppo_kl=0.0,
        config={"advantage_estimator": "grpo", "n_samples_per_prompt": 4},
    )


def _dir_bytes(path: Any) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _spool_row(ctx: Context) -> Row:
    from trajectory_replay.capture.manager import CaptureManager

    where = ctx.path("recorder-spool")
    bound = 640 << 10
    steps = ctx.size(200, 40)
    manager = CaptureManager(
        str(where / "store"),
        policy=f"recorder:8,max_bytes={bound}",
        spool=str(where / "spool"),
        writer="thread",
        atexit_timeout=None,
    )
    peak = 0
    try:
        for i in range(steps):
            _step(manager, i // 4, i % 4)
            manager.flush(120)
            peak = max(peak, _dir_bytes(where / "spool"))
    finally:
        manager.close(120)
        shutil.rmtree(where, ignore_errors=True)
    return Row(
        GROUP,
        f"spool bytes over {steps} steps, recorder:8,max_bytes=640K",
        fmt_bytes(peak),
        f"<= {fmt_bytes(bound)}",
        peak <= bound,
        "largest after any step; payloads about 130 KiB a step",
    )


def _promotion_row(ctx: Context) -> Row:
    from trajectory_replay.backends import open_backend
    from trajectory_replay.capture.manager import CaptureManager

    bucket = ctx.s3_bucket()
    options = ctx.s3_options()
    url = f"s3://{bucket}/recorder-{int(time.time() * 1000)}"
    where = ctx.path("recorder-promote")
    manager = CaptureManager(
        url,
        policy="recorder:8",
        spool=str(where / "spool"),
        writer="thread",
        atexit_timeout=None,
        storage_options=options,
    )
    dest = open_backend(url, **options)
    try:
        for i in range(24):
            if i in (12, 20):
                manager.trigger(f"benchmark trigger at step {i}")
            _step(manager, i // 4, i % 4, n=4, tokens=256)
        manager.flush(300)
        counts = manager._writer.recorder.counts  # type: ignore[union-attr]
    finally:
        manager.close(120)
    gained = len([k for k in dest.list("") if k.startswith(("objects/", "blobs/"))])
    sent, present = counts["objects_sent"], counts["objects_present"]
    return Row(
        GROUP,
        "promotion of 8 steps (twice, overlapping) to S3: keys sent vs keys the store gained",
        f"{sent} sent, {gained} gained",
        "sent == gained",
        sent == gained and counts["promoted"] > 0,
        f"{counts['promoted']} bundles promoted, {present} objects found already there, {counts['triggers']} triggers",
    )


def run(ctx: Context) -> list[Row]:
    return [_step_time_row(ctx), _spool_row(ctx), _promotion_row(ctx)]
