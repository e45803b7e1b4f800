"""CaptureManager: the training thread snapshots and enqueues; a daemon thread hands each bundle to the writer
process (by default), which commits it.

Guarantees:

- The training thread never waits on storage. A hook call snapshots its tensors (async device-to-host
  copies into pinned memory for CUDA, one clone for CPU) and appends the record to a queue bounded in
  bytes and in records. When the queue is full the record is dropped, counted and logged; the copy is
  not even made (the size is known from the tensors' shapes).
- Each hook's capture becomes a typed record (`capture.records`) in a `BundleJob` (`capture.commit`).
  The daemon writer thread waits on the snapshot's CUDA events and hands the job to the writer process
  (`capture.worker`), which builds the documents, hashes, encodes, uploads and commits (BundleWriter)
  without holding training's GIL; with `writer="thread"` the thread does that work itself, with the
  same `commit_bundle`. Every error is counted and logged on the logger `trajectory_replay.capture`,
  never raised into training.
- A record that is dropped or fails never yields a bundle that looks complete: a failure calls
  `BundleWriter.abort()`; what it leaves (an in-flight record, objects, a cohort with missing rank
  markers) is garbage for gc. A killed process leaves the same.
- With more than one expected rank every bundle is written as rank `rank` of a multi-producer bundle
  (completion markers of the bundle layer); a rank never waits for its peers.
- A store that cannot be used (no answer within the backend's bounded timeouts, credentials, access, an unknown
  bucket: `StorageUnavailableError`) costs training those timeouts once, not once per bundle: after such a failure
  capture backs off (STORE_RETRY_FIRST doubling to STORE_RETRY_MAX seconds). Meanwhile hooks drop what they are
  given (counted, nothing copied), records already queued wait, and `close` drops them instead of waiting; when
  the backoff ends the next record tries the store again. Each kind of failure is logged once as a warning line
  (no traceback); repeats go to the debug level, and the recovery is logged with the number of drops.

This module owns the queue, its byte and record budget, pending steps and the store's backoff; the option
checks are in `capture.config`, the writer, threads and exit hook in `capture.runtime`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trajectory_replay.bundle.schema import ProducerInfo, RankTopology
from trajectory_replay.capture.commit import BundleJob, storage_failure
from trajectory_replay.capture.config import (
    CapturePolicy,
    choose_writer,
    default_spool,
    policy_of,
    producer_ranks,
    run_identity,
)
from trajectory_replay.capture.recorder import RecorderSettings, TriggerSettings
from trajectory_replay.capture.records import (
    STEP_KINDS,
    CaptureRecord,
    Columns,
    MicroBatch,
    Provenance,
    RolloutRecord,
    StepRecord,
    check_mismatch_metrics,
    given_payloads,
    rollout_bundle_id,
    step_bundle_id,
    step_scalars,
)
from trajectory_replay.capture.runtime import (
    Writer,
    close_at_exit,
    forget_at_exit,
    lower_thread_priority,
    open_store,
    start_writer,
)
from trajectory_replay.capture.snapshot import Snapshot, estimate_nbytes
from trajectory_replay.store import ObjectStore

log = logging.getLogger("trajectory_replay.capture")

DEFAULT_MAX_QUEUE_BYTES = 2 << 30
DEFAULT_MAX_QUEUE_RECORDS = 64
DEFAULT_MAX_PENDING_STEPS = 8
DEFAULT_ATEXIT_TIMEOUT = 60.0
STORE_RETRY_FIRST = 1.0
STORE_RETRY_MAX = 8.0
"""Backoff (seconds) after the store could not be used: doubling from the first to the max while failures go on."""


@dataclass
class _Queued:
    """A job waiting for the writer thread, the snapshot its tensors are copied into, and the bytes it holds."""

    job: BundleJob
    snapshot: Snapshot
    nbytes: int

    @property
    def bundle_id(self) -> str:
        return self.job.bundle_id


class _PendingStep:
    """Micro-batches of one actor step, accumulated until `capture_step_end`."""

    __slots__ = ("micro_batches", "ids", "snapshot", "nbytes", "dropped")

    def __init__(self) -> None:
        self.micro_batches: list[MicroBatch] = []
        self.ids: set[str] = set()
        self.snapshot = Snapshot()
        self.nbytes = 0
        self.dropped = False


class CaptureManager:
    """One capture writer for one producer rank. Thread-safe; every public method is safe to call from training."""

    def __init__(
        self,
        capture_dir: str | os.PathLike,
        *,
        rank: int = 0,
        expected_ranks: Sequence[int] | None = None,
        steps: frozenset[tuple[int, int]] | None = None,
        rollouts: frozenset[int] | None = None,
        store: ObjectStore | None = None,
        storage_options: Mapping[str, Any] | None = None,
        max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
        max_queue_records: int = DEFAULT_MAX_QUEUE_RECORDS,
        max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS,
        producer: ProducerInfo | None = None,
        topology: RankTopology | Mapping[str, int] | None = None,
        atexit_timeout: float | None = DEFAULT_ATEXIT_TIMEOUT,
        start: bool = True,
        writer: str = "auto",
        writer_priority: str = "idle",
        run_id: str | None = None,
        policy: CapturePolicy | str | None = None,
        spool: str | os.PathLike | None = None,
        triggers: TriggerSettings | None = None,
    ) -> None:
        self.capture_dir = os.fspath(capture_dir)
        # the launch this capture belongs to, in every rank marker it writes (default: what the environment says)
        self.run_id = run_id if run_id is not None else run_identity()
        self.writer_mode = choose_writer(writer, writer_priority, self.capture_dir, store is not None)
        self.writer_priority = writer_priority
        self._writer: Writer | None = None
        self._scheduling = threading.Lock()  # the writer's scheduling: hurried while the program waits for it
        self._hurry_wanted = False
        self.rank = int(rank)
        self.expected_ranks = producer_ranks(self.rank, expected_ranks)
        self.multi_producer = len(self.expected_ranks) > 1
        self.policy = policy_of(policy) or CapturePolicy()
        if self.policy.kind == "steps" and steps is None:
            steps = self.policy.steps
        self.steps, self.rollouts = steps, rollouts
        self._step_ordinals: dict[tuple[int, int], int] = {}  # every:N: the order this rank first saw each step
        self._steps_seen = 0
        self._user_trigger: str | None = None
        self.recorder: RecorderSettings | None = None
        if self.policy.recorder:
            root = os.fspath(spool) if spool is not None else default_spool(self.capture_dir)
            self.recorder = RecorderSettings(
                spool=os.path.join(root, f"rank-{self.rank}"),
                keep=self.policy.keep,
                after=self.policy.after,
                max_bytes=self.policy.max_bytes,
                rank=self.rank,
                expected_ranks=tuple(producer_ranks(self.rank, expected_ranks)),
                run_id=run_id if run_id is not None else run_identity(),
                triggers=triggers or TriggerSettings(),
            )
        self.max_queue_bytes, self.max_queue_records = int(max_queue_bytes), int(max_queue_records)
        self.max_pending_steps = int(max_pending_steps)
        # one store per manager (and one in its writer process): the create-once probe runs once per process
        self._storage_options = dict(storage_options or {})
        self.store = (
            store if store is not None else open_store(self.capture_dir, self._storage_options, self.writer_mode)
        )
        self.provenance = Provenance.of(producer, topology)

        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Queued] = deque()
        self._bytes_in_use = 0  # queued + being written + pending micro-batches
        self._active: _Queued | None = None
        self._closing = False
        self._pending: OrderedDict[tuple[int, int, str], _PendingStep] = OrderedDict()
        self._counts = dict(
            enqueued=0,
            dropped=0,
            written=0,
            errors=0,
            filtered=0,
            ignored_microbatches=0,
            bytes_enqueued=0,
            hook_calls=0,
        )
        self._max_enqueue = 0.0
        self._total_enqueue = 0.0
        # the store's health as the writer last saw it: no new captures are taken until _retry_at
        self._retry_at = 0.0
        self._retry_delay = 0.0
        self._down_drops = 0
        self._warned: set[str] = set()
        self._thread: threading.Thread | None = None
        self._atexit_timeout = atexit_timeout
        if start:
            self.start()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread (a daemon) and have `close(atexit_timeout)` run at interpreter exit."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"trajectory-replay-capture-{self.rank}", daemon=True)
        self._thread.start()
        if self._atexit_timeout is not None:
            close_at_exit(self._close_at_exit)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every enqueued record is written or has failed; True if done within `timeout`.

        Micro-batches of a step not yet ended are not records yet and are not waited for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._hurry_writer()
        try:
            with self._cond:
                while self._queue or self._active is not None:
                    if not self.running:
                        return False
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining if remaining is not None else 1.0)
            return True
        finally:
            if not self._closing:
                self._relax_writer()

    def _hurry_writer(self) -> None:
        """While the program waits for the writer (flush, close), a writer process runs at normal priority where
        that is permitted: its usual idle priority, which keeps it off training's CPUs, could starve it of every
        CPU on a busy host, and nothing it could take CPU from runs now. A process still starting is hurried as
        soon as it exists (and one restarted later starts hurried)."""
        with self._scheduling:
            self._hurry_wanted = True
            hurry = getattr(self._writer, "hurry", None)
            if hurry is not None:
                hurry()

    def _relax_writer(self) -> None:
        with self._scheduling:
            self._hurry_wanted = False
            relax = getattr(self._writer, "relax", None)
            if relax is not None:
                relax()

    def _writer_made(self, writer: Writer) -> None:
        """A writer process made, not started yet: the manager's until it has started (so a flush can hurry it)."""
        with self._scheduling:
            self._writer = writer
            if self._hurry_wanted:
                writer.hurry()  # type: ignore[union-attr]

    def close(self, timeout: float | None = None) -> bool:
        """Stop accepting records, write what is queued (up to `timeout`), stop the thread. True if all done.

        Steps whose micro-batches were captured but that never ended are dropped (counted). While the store is
        backed off (it just failed), queued records are dropped too instead of waited for: closing then costs at
        most the record being written. True means nothing is left to do, not that everything landed: see `stats()`
        (written, errors, dropped)."""
        with self._cond:
            self._closing = True
            pending = list(self._pending.items())
            self._pending.clear()
            for key, step in pending:
                self._bytes_in_use -= step.nbytes
                if not step.dropped:
                    self._counts["dropped"] += 1
                    log.warning("capture: %s never ended (no capture_step_end before close); dropped", _name(key))
            self._cond.notify_all()
        forget_at_exit(self)
        if self._thread is None:
            return not self._queue
        self._hurry_writer()
        self._thread.join(timeout)
        with self._cond:
            left = len(self._queue) + (self._active is not None)
        if left:
            log.warning(
                "capture: writer still busy after %.1fs with %d record(s) left; they will not complete "
                "if the process exits now",
                timeout or 0.0,
                left,
            )
        return left == 0

    def _close_at_exit(self) -> None:
        try:
            self.close(self._atexit_timeout)
        except Exception:  # never let capture disturb interpreter shutdown
            log.exception("capture: close at exit failed")

    def stats(self) -> dict[str, Any]:
        """Counters: enqueued, dropped, written, errors, filtered, ignored_microbatches, bytes_enqueued,
        hook_calls, max_enqueue_seconds, total_enqueue_seconds, queued_records, bytes_in_use, pending_steps."""
        with self._cond:
            out: dict[str, Any] = dict(self._counts)
            out.update(
                max_enqueue_seconds=self._max_enqueue,
                total_enqueue_seconds=self._total_enqueue,
                queued_records=len(self._queue) + (self._active is not None),
                bytes_in_use=self._bytes_in_use,
                pending_steps=len(self._pending),
            )
        return out

    # ---- accounting ----------------------------------------------------------------------------
    def _count(self, key: str, n: int = 1) -> None:
        with self._cond:
            self._counts[key] += n

    def _hook_done(self, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        with self._cond:
            self._counts["hook_calls"] += 1
            self._total_enqueue += elapsed
            if elapsed > self._max_enqueue:
                self._max_enqueue = elapsed

    def _hook_error(self, what: str, exc: BaseException) -> None:
        self._count("errors")
        log.error(
            "capture: %s failed on the training thread (nothing written): %s: %s",
            what,
            type(exc).__name__,
            exc,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def _refusal(self, nbytes: int, record: bool) -> tuple[str, str] | None:
        """(lock held) (kind, reason) why a capture of `nbytes` cannot be taken now, or None."""
        if self._closing:
            return "closed", "the capture manager is closed"
        if time.monotonic() < self._retry_at:
            return "store", (
                f"the store failed {self._retry_delay:.0f}s ago or less; capture resumes once it answers again"
            )
        if record and len(self._queue) >= self.max_queue_records:
            return "queue", f"the queue holds {len(self._queue)} records (max {self.max_queue_records})"
        if self._bytes_in_use + nbytes > self.max_queue_bytes:
            return "queue", (
                f"{self._bytes_in_use + nbytes} bytes would exceed the queue's {self.max_queue_bytes} bytes"
            )
        return None

    def _log_drop(self, kind: str, what: str, reason: str) -> None:
        # while the store is down every capture is dropped, and a slow store fills the queue step after step:
        # the first drop of those kinds is a warning, the rest would only repeat it
        if kind == "store" or (kind == "queue" and kind in self._warned):
            log.debug("capture: dropped %s: %s", what, reason)
            return
        if kind == "queue":
            self._warned.add(kind)
            reason += " (further drops for this reason are logged at the debug level; stats() counts them)"
        log.warning("capture: dropped %s: %s", what, reason)

    def _reserve(self, nbytes: int, what: str, record: bool) -> bool:
        """Take `nbytes` (and a queue slot if `record`) from the budget, or count and log a drop."""
        with self._cond:
            refusal = self._refusal(nbytes, record)
            if refusal is None:
                self._bytes_in_use += nbytes
                return True
            self._counts["dropped"] += 1
            self._down_drops += refusal[0] == "store"
        self._log_drop(refusal[0], what, refusal[1])
        return False

    def _job(self, record: CaptureRecord, signals: Mapping[str, Any] | None = None) -> BundleJob:
        return BundleJob(
            self.capture_dir, record, self.rank, tuple(self.expected_ranks), self.run_id, dict(signals or {})
        )

    def trigger(self, reason: str) -> bool:
        """Fire the flight recorder's `user` trigger with `reason`, at the next step bundle this rank ends (the
        step is kept with the K before it). False (nothing done) unless the policy is `recorder:K`."""
        if self.recorder is None:
            log.warning("capture: trigger(%r) ignored: the capture policy is %s, not recorder:K", reason, self.policy)
            return False
        with self._cond:
            self._user_trigger = str(reason) if self._user_trigger is None else f"{self._user_trigger}; {reason}"
        return True

    def _enqueue(self, job: BundleJob, snapshot: Snapshot, nbytes: int) -> bool:
        """Queue a job whose `nbytes` are reserved; a closed manager, a store backing off or a full queue drops it
        (counted)."""
        with self._cond:
            refusal = self._refusal(0, True)
            if refusal is None:
                self._queue.append(_Queued(job, snapshot, nbytes))
                self._counts["enqueued"] += 1
                self._counts["bytes_enqueued"] += nbytes
                self._cond.notify_all()
                return True
            self._bytes_in_use -= nbytes
            self._counts["dropped"] += 1
            self._down_drops += refusal[0] == "store"
        self._log_drop(refusal[0], job.bundle_id, refusal[1])
        return False

    # ---- hooks (training thread) ---------------------------------------------------------------
    def wants_rollout(self, rollout_id: int) -> bool:
        return self.rollouts is None or rollout_id in self.rollouts

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        if self.steps is not None and (rollout_id, step_id) not in self.steps:
            return False
        if self.policy.kind != "every":
            return True
        key = (int(rollout_id), int(step_id))
        with self._cond:
            ordinal = self._step_ordinals.get(key)
            if ordinal is None:
                ordinal = self._step_ordinals[key] = self._steps_seen
                self._steps_seen += 1
                while len(self._step_ordinals) > 4 * self.max_pending_steps:  # only open steps' ordinals matter
                    del self._step_ordinals[next(iter(self._step_ordinals))]
        return ordinal % self.policy.every == 0

    def capture_rollout(
        self,
        rollout_id: int,
        *,
        sample_ids: Sequence[str],
        group_index: Any,
        response_lengths: Any,
        total_lengths: Any,
        loss_masks: Any,
        raw_rewards: Any,
        rewards: Any,
        config: Any,
        weight_lineage: Any = None,
        micro_batch_ids: Any = None,
        policy_versions: Any = None,
        mismatch_metrics: Mapping[str, Any] | None = None,
        payloads: Mapping[str, Any] | None = None,
        **named_payloads: Any,
    ) -> bool:
        """Enqueue the rollout-level bundle `rollout-<R>` (this rank's shard). True if enqueued. Its per-token payloads
        are given by name, as keywords or in `payloads`: any payload the stage table declares for a rollout-level
        bundle (`records.bundle_payloads`); another name is refused (a counted error, nothing written)."""
        t0 = time.perf_counter()
        try:
            if not self.wants_rollout(rollout_id):
                self._count("filtered")
                return False
            check_mismatch_metrics(mismatch_metrics or {})  # here, in the hook: a counted error, not a write
            tensors = given_payloads("rollout", named_payloads, payloads)
            cols = dict(
                sample_ids=sample_ids,
                group_index=group_index,
                response_lengths=response_lengths,
                total_lengths=total_lengths,
                loss_masks=loss_masks,
                raw_rewards=raw_rewards,
                rewards=rewards,
                micro_batch_ids=micro_batch_ids,
                policy_versions=policy_versions,
            )
            nbytes = Columns.estimate(**cols) + sum(estimate_nbytes(v) for v in tensors.values())
            bundle_id = rollout_bundle_id(rollout_id)
            if not self._reserve(nbytes, bundle_id, record=True):
                return False
            try:
                snap = Snapshot()
                columns = Columns.take(snap, **cols)
                payloads = {k: snap.flat(v, k) for k, v in tensors.items()}
                metrics = {
                    k: snap.tensor(v) if isinstance(v, torch.Tensor) else v for k, v in (mismatch_metrics or {}).items()
                }
                snap.finish()
                job = self._job(
                    RolloutRecord(
                        int(rollout_id),
                        columns,
                        payloads,
                        _freeze(config),
                        _freeze(weight_lineage),
                        self.provenance,
                        metrics,
                    )
                )
            except BaseException:
                self._release(nbytes)
                raise
            return self._enqueue(job, snap, nbytes)
        except Exception as exc:
            self._hook_error(f"capture_rollout({rollout_id})", exc)
            return False
        finally:
            self._hook_done(t0)

    def capture_microbatch(
        self,
        rollout_id: int,
        step_id: int,
        micro_batch_id: str,
        *,
        sample_ids: Sequence[str],
        group_index: Any,
        response_lengths: Any,
        total_lengths: Any,
        loss_masks: Any,
        raw_rewards: Any,
        rewards: Any,
        policy_versions: Any = None,
        payloads: Mapping[str, Any] | None = None,
        kind: str = "step",
        **named_payloads: Any,
    ) -> bool:
        """Snapshot one micro-batch of actor step (R, S) (of a critic's step with `kind="critic"`). A repeated
        micro_batch_id of the same step is ignored. Its per-token payloads are given by name, as keywords or in
        `payloads`: any payload the stage table declares for a step-level bundle of `kind`; another name is refused
        (a counted error)."""
        t0 = time.perf_counter()
        try:
            if not self.wants_step(rollout_id, step_id):
                self._count("filtered")
                return False
            key = (int(rollout_id), int(step_id), _kind(kind))
            mb_id = str(micro_batch_id)
            with self._cond:
                step = self._pending.get(key)
                if step is None:
                    step = self._new_pending(key)
            if step.dropped:
                return False
            if mb_id in step.ids:
                self._count("ignored_microbatches")
                log.debug("capture: micro-batch %s of %s already captured; ignored", mb_id, _name(key))
                return False
            tensors = given_payloads(key[2], named_payloads, payloads)
            cols = dict(
                sample_ids=sample_ids,
                group_index=group_index,
                response_lengths=response_lengths,
                total_lengths=total_lengths,
                loss_masks=loss_masks,
                raw_rewards=raw_rewards,
                rewards=rewards,
                policy_versions=policy_versions,
            )
            nbytes = Columns.estimate(**cols) + sum(estimate_nbytes(v) for v in tensors.values())
            if not self._reserve(
                nbytes, f"{_name(key)} (micro-batch {mb_id}; the whole step is dropped)", record=False
            ):
                self._drop_pending(key, step)
                return False
            try:
                columns = Columns.take(step.snapshot, **cols)
                payloads = {k: step.snapshot.flat(v, k) for k, v in tensors.items()}
            except BaseException:
                self._release(nbytes)
                raise
            step.nbytes += nbytes
            step.ids.add(mb_id)
            step.micro_batches.append(MicroBatch(mb_id, columns, payloads))
            return True
        except Exception as exc:
            self._hook_error(f"capture_microbatch({rollout_id}, {step_id}, {micro_batch_id!r})", exc)
            return False
        finally:
            self._hook_done(t0)

    def capture_step_end(
        self,
        rollout_id: int,
        step_id: int,
        *,
        config: Any,
        weight_lineage: Any = None,
        kind: str = "step",
        grad_norm: Any = None,
        **scalars: Any,
    ) -> bool:
        """Enqueue the step-level bundle `step-<R>-<S>` (`critic-<R>-<S>` with `kind="critic"`) from the micro-batches
        captured for it, with the loss scalars production reported, by name (the outputs the stage table declares
        for the loss stages of a bundle of `kind`; those not given are reported by validate and replay).
        `grad_norm`, the gradient norm the trainer computed (a number, or a tensor copied with the snapshot), feeds
        the flight recorder's triggers. True if enqueued."""
        t0 = time.perf_counter()
        try:
            if not self.wants_step(rollout_id, step_id):
                self._count("filtered")
                return False
            key = (int(rollout_id), int(step_id), _kind(kind))
            given = step_scalars(scalars, key[2])
            with self._cond:
                step = self._pending.pop(key, None)
            if step is None:
                self._count("errors")
                log.error(
                    "capture: capture_step_end of %s without any captured micro-batch; nothing written", _name(key)
                )
                return False
            if step.dropped:
                return False
            try:
                snap = step.snapshot
                reported = {name: snap.tensor(v) if isinstance(v, torch.Tensor) else v for name, v in given.items()}
                signals: dict[str, Any] = {}
                if self.recorder is not None:
                    if grad_norm is not None:
                        signals["grad_norm"] = (
                            snap.tensor(grad_norm) if isinstance(grad_norm, torch.Tensor) else grad_norm
                        )
                    with self._cond:
                        if self._user_trigger is not None:
                            signals["trigger"], self._user_trigger = self._user_trigger, None
                snap.finish()
                job = self._job(
                    StepRecord(
                        key[0],
                        key[1],
                        tuple(step.micro_batches),
                        reported,
                        _freeze(config),
                        _freeze(weight_lineage),
                        self.provenance,
                        key[2],
                    ),
                    signals,
                )
            except BaseException:
                self._release(step.nbytes)
                raise
            return self._enqueue(job, snap, step.nbytes)
        except Exception as exc:
            self._hook_error(f"capture_step_end({rollout_id}, {step_id})", exc)
            return False
        finally:
            self._hook_done(t0)

    def _new_pending(self, key: tuple[int, int, str]) -> _PendingStep:
        """(lock held) A new pending step; the oldest unfinished one is dropped past max_pending_steps."""
        while len(self._pending) >= self.max_pending_steps:
            old_key, old = self._pending.popitem(last=False)
            self._bytes_in_use -= old.nbytes
            if not old.dropped:
                self._counts["dropped"] += 1
                log.warning(
                    "capture: %s never ended (more than %d steps open); dropped", _name(old_key), self.max_pending_steps
                )
        step = _PendingStep()
        if self._closing:  # counted once; the step's later micro-batches are ignored
            step.dropped = True
            self._counts["dropped"] += 1
            log.warning("capture: dropped %s: the capture manager is closed", _name(key))
        self._pending[key] = step
        return step

    def _drop_pending(self, key: tuple[int, int, str], step: _PendingStep) -> None:
        """Forget a step's micro-batches (its drop is already counted); later ones are ignored cheaply."""
        with self._cond:
            self._bytes_in_use -= step.nbytes
            step.nbytes = 0
            step.micro_batches = []
            step.dropped = True

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._bytes_in_use -= nbytes
            self._cond.notify_all()

    # ---- writer thread -------------------------------------------------------------------------
    def _run(self) -> None:
        lower_thread_priority()
        # started from this thread, so that a writer process dies with it (WriterProcess.start sets its priority)
        writer, failure = start_writer(
            self.writer_mode,
            self.store,
            self.capture_dir,
            self._storage_options,
            self.writer_priority,
            made=self._writer_made,
            recorder=self.recorder,
        )
        with self._scheduling:
            self._writer, self.writer_mode = writer, writer.mode
        if failure is not None:  # said now; the first record still tries (the store may be back by then)
            self._store_failed(failure, "the writer's first contact with the store", back_off=False)
        try:
            self._serve()
        finally:
            writer.stop()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                # the store failed a moment ago: queued records wait for the backoff to end, or are dropped at close
                while self._queue and not self._closing and time.monotonic() < self._retry_at:
                    self._cond.wait(self._retry_at - time.monotonic())
                if self._closing and time.monotonic() < self._retry_at:
                    self._drop_queued()
                if not self._queue:
                    return
                queued = self._queue.popleft()
                self._active = queued
            try:
                self._write(queued)
            except BaseException as exc:  # noqa: BLE001 - the writer thread must survive anything
                with self._cond:
                    self._counts["errors"] += 1
                failure = storage_failure(exc)
                if failure is not None:
                    self._store_failed(failure, f"writing {queued.bundle_id}")
                else:
                    log.error(
                        "capture: writing %s failed; it is not complete (left as garbage for gc): %s: %s",
                        queued.bundle_id,
                        type(exc).__name__,
                        exc,
                        exc_info=True,
                    )
            else:
                with self._cond:
                    self._counts["written"] += 1
                self._store_ok()
            finally:
                with self._cond:
                    self._bytes_in_use -= queued.nbytes
                    self._active = None
                    self._cond.notify_all()

    def _drop_queued(self) -> None:
        """(lock held) Drop every queued record: the store is down and the manager is closing."""
        while self._queue:
            queued = self._queue.popleft()
            self._bytes_in_use -= queued.nbytes
            self._counts["dropped"] += 1
            self._down_drops += 1
            log.debug("capture: dropped %s: the store is down and capture is closing", queued.bundle_id)
        self._cond.notify_all()

    def _store_failed(self, failure: BaseException, doing: str, back_off: bool = True) -> None:
        """The store could not be used: back off, and say so once per kind of failure."""
        kind = str(getattr(failure, "kind", "storage"))
        with self._cond:
            if back_off:
                self._retry_delay = min(STORE_RETRY_MAX, 2 * self._retry_delay or STORE_RETRY_FIRST)
                self._retry_at = time.monotonic() + self._retry_delay
            first = kind not in self._warned
            self._warned.add(kind)
        if not first:
            log.debug("capture: %s failed: %s", doing, failure)
        elif back_off:
            log.warning(
                "capture: %s failed, nothing of it was written: %s; until the store answers again (tried "
                "after %.0fs, backing off up to %.0fs) captures are dropped and counted",
                doing,
                failure,
                self._retry_delay,
                STORE_RETRY_MAX,
            )
        else:
            log.warning("capture: %s failed: %s; capture goes on, and backs off if writing fails too", doing, failure)

    def _store_ok(self) -> None:
        with self._cond:
            if not self._retry_delay:
                return
            self._retry_delay = self._retry_at = 0.0
            drops, self._down_drops = self._down_drops, 0
        log.info("capture: the store answers again; %d capture(s) were dropped while it did not", drops)

    def _write(self, queued: _Queued) -> None:
        queued.snapshot.wait()
        assert self._writer is not None  # the loop that calls this starts the writer first
        url = self._writer.write(queued.job)
        log.info("capture: wrote %s%s", url, f" (rank {self.rank})" if self.multi_producer else "")

    def __repr__(self) -> str:
        return f"CaptureManager({self.capture_dir!r}, rank={self.rank}, expected_ranks={self.expected_ranks})"


def _kind(kind: str) -> str:
    """`kind` when it is a kind of step-level bundle, else ValueError naming it."""
    if kind not in STEP_KINDS:
        raise ValueError(f"kind: {kind!r} is not a kind of step-level bundle ({', '.join(STEP_KINDS)})")
    return kind


def _name(key: tuple[int, int, str]) -> str:
    """The bundle id of a pending step's key (rollout, step, kind)."""
    return step_bundle_id(key[0], key[1], key[2])


def _freeze(value: Any) -> Any:
    """A copy of a small config/lineage argument, so a later change by training is harmless."""
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_copy"):
        return value.model_copy()
    return value


__all__ = ["CaptureManager", "DEFAULT_MAX_QUEUE_BYTES", "DEFAULT_MAX_QUEUE_RECORDS", "log"]
