"""CaptureManager: the training thread snapshots and enqueues; a background writer thread commits bundles.

Guarantees:

- The training thread never waits on storage. A hook call snapshots its tensors (async device-to-host
  copies into pinned memory for CUDA, one clone for CPU) and appends the record to a queue bounded in
  bytes and in records. When the queue is full the record is dropped, counted and logged; the copy is
  not even made (the size is known from the tensors' shapes).
- The daemon writer thread waits on the snapshot's CUDA events and hands the record to the writer
  process (`capture.worker`), which builds the documents, hashes, encodes, uploads and commits
  (BundleWriter) without holding training's GIL; with `writer="thread"` the thread does that work
  itself. Every error is counted and logged on the logger `trajectory_replay.capture`, never raised
  into training.
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
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from trajectory_replay.bundle.schema import ProducerInfo, RankTopology
from trajectory_replay.bundle.writer import BundleWriter
from trajectory_replay.capture.records import (
    BundleParts, Columns, MicroBatch, Provenance, build_rollout, build_step, rollout_bundle_id,
    step_bundle_id,
)
from trajectory_replay.capture.snapshot import Snapshot, estimate_nbytes
from trajectory_replay.capture.worker import WriterProcess, storage_failure
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
class _Record:
    bundle_id: str
    snapshot: Snapshot
    builder: str        # a key of BUILDERS
    args: tuple         # its arguments (sent to the writer process as they are)
    nbytes: int


BUILDERS: dict[str, Callable[..., BundleParts]] = {"rollout": build_rollout, "step": build_step}
WRITER_MODES = ("auto", "process", "thread")
WRITER_PRIORITIES = ("idle", "low")
"""How the writer yields the CPU to training. "idle": the writer process runs in Linux's idle scheduling class
(SCHED_IDLE: it gets only CPU time nothing else wants); "low": it runs at nice 10. A writer thread, which shares
training's GIL and must not be starved while it holds it, always runs at nice 10."""


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

    def __init__(self, capture_dir: str | os.PathLike, *, rank: int = 0,
                 expected_ranks: Optional[Sequence[int]] = None,
                 steps: Optional[frozenset[tuple[int, int]]] = None, rollouts: Optional[frozenset[int]] = None,
                 store: Optional[ObjectStore] = None, storage_options: Optional[Mapping[str, Any]] = None,
                 max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES, max_queue_records: int = DEFAULT_MAX_QUEUE_RECORDS,
                 max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS, producer: Optional[ProducerInfo] = None,
                 topology: Optional[RankTopology | Mapping[str, int]] = None,
                 atexit_timeout: Optional[float] = DEFAULT_ATEXIT_TIMEOUT, start: bool = True,
                 writer: str = "auto", writer_priority: str = "idle") -> None:
        self.capture_dir = os.fspath(capture_dir)
        if writer not in WRITER_MODES:
            raise ValueError(f"writer must be one of {', '.join(WRITER_MODES)}, got {writer!r}")
        if writer_priority not in WRITER_PRIORITIES:
            raise ValueError(f"writer_priority must be one of {', '.join(WRITER_PRIORITIES)}, got {writer_priority!r}")
        self.writer_priority = writer_priority
        if writer == "process" and (store is not None or self.capture_dir.startswith("memory://")):
            raise ValueError("writer='process' needs a path or URL the writer process can open itself, "
                             "not a store object or a memory:// store")
        if writer == "auto":
            # a process of its own keeps the writer's Python work off training's GIL; a store object given
            # here (or an in-memory one) lives in this process only
            writer = "thread" if store is not None or self.capture_dir.startswith("memory://") else "process"
        self.writer_mode = writer
        self._process: Optional[WriterProcess] = None
        self.rank = int(rank)
        ranks = sorted({int(r) for r in expected_ranks}) if expected_ranks is not None else [self.rank]
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not among expected ranks {ranks}")
        self.expected_ranks = ranks
        self.multi_producer = len(ranks) > 1
        self.steps, self.rollouts = steps, rollouts
        self.max_queue_bytes, self.max_queue_records = int(max_queue_bytes), int(max_queue_records)
        self.max_pending_steps = int(max_pending_steps)
        # one store per manager (and one in its writer process): the create-once probe runs once per process
        self._storage_options = dict(storage_options or {})
        if store is None:
            options = dict(self._storage_options)
            if writer == "thread" and self.capture_dir.startswith("s3://") and "loop" not in options:
                # s3fs runs every request in an event loop thread; by default fsspec's shared one, started at
                # normal priority by whoever came first. Capture's requests run in a loop of their own that
                # yields the CPU to training, like the writer thread.
                options["loop"] = _background_loop()
            store = ObjectStore.open(self.capture_dir, **options)
        self.store = store
        prov = Provenance()
        if producer is not None:
            prov.producer = producer
        if topology is not None:
            prov.topology = topology if isinstance(topology, RankTopology) else RankTopology.model_validate(
                dict(topology))
        self.provenance = prov

        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Record] = deque()
        self._bytes_in_use = 0      # queued + being written + pending micro-batches
        self._active: Optional[_Record] = None
        self._closing = False
        self._pending: "OrderedDict[tuple[int, int], _PendingStep]" = OrderedDict()
        self._counts = dict(enqueued=0, dropped=0, written=0, errors=0, filtered=0, ignored_microbatches=0,
                            bytes_enqueued=0, hook_calls=0)
        self._max_enqueue = 0.0
        self._total_enqueue = 0.0
        # the store's health as the writer last saw it: no new captures are taken until _retry_at
        self._retry_at = 0.0
        self._retry_delay = 0.0
        self._down_drops = 0
        self._warned: set[str] = set()
        self._thread: Optional[threading.Thread] = None
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
            _register_exit_hook()
            _LIVE.add(self)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every enqueued record is written or has failed; True if done within `timeout`.

        Micro-batches of a step not yet ended are not records yet and are not waited for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._active is not None:
                if not self.running:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 1.0)
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
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
                    log.warning("capture: step %d:%d never ended (no capture_step_end before close); dropped", *key)
            self._cond.notify_all()
        _LIVE.discard(self)
        if self._thread is None:
            return not self._queue
        self._thread.join(timeout)
        with self._cond:
            left = len(self._queue) + (self._active is not None)
        if left:
            log.warning("capture: writer still busy after %.1fs with %d record(s) left; they will not complete "
                        "if the process exits now", timeout or 0.0, left)
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
            out.update(max_enqueue_seconds=self._max_enqueue, total_enqueue_seconds=self._total_enqueue,
                       queued_records=len(self._queue) + (self._active is not None), bytes_in_use=self._bytes_in_use,
                       pending_steps=len(self._pending))
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
        log.error("capture: %s failed on the training thread (nothing written): %s: %s", what,
                  type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def _refusal(self, nbytes: int, record: bool) -> Optional[tuple[str, str]]:
        """(lock held) (kind, reason) why a capture of `nbytes` cannot be taken now, or None."""
        if self._closing:
            return "closed", "the capture manager is closed"
        if time.monotonic() < self._retry_at:
            return "store", (f"the store failed {self._retry_delay:.0f}s ago or less; capture resumes once "
                             "it answers again")
        if record and len(self._queue) >= self.max_queue_records:
            return "queue", f"the queue holds {len(self._queue)} records (max {self.max_queue_records})"
        if self._bytes_in_use + nbytes > self.max_queue_bytes:
            return "queue", (f"{self._bytes_in_use + nbytes} bytes would exceed the queue's "
                             f"{self.max_queue_bytes} bytes")
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

    def _enqueue(self, rec: _Record) -> bool:
        """Append a record whose bytes are reserved; a closed manager, a store backing off or a full queue drops it
        (counted)."""
        with self._cond:
            refusal = self._refusal(0, True)
            if refusal is None:
                self._queue.append(rec)
                self._counts["enqueued"] += 1
                self._counts["bytes_enqueued"] += rec.nbytes
                self._cond.notify_all()
                return True
            self._bytes_in_use -= rec.nbytes
            self._counts["dropped"] += 1
            self._down_drops += refusal[0] == "store"
        self._log_drop(refusal[0], rec.bundle_id, refusal[1])
        return False

    # ---- hooks (training thread) ---------------------------------------------------------------
    def wants_rollout(self, rollout_id: int) -> bool:
        return self.rollouts is None or rollout_id in self.rollouts

    def wants_step(self, rollout_id: int, step_id: int) -> bool:
        return self.steps is None or (rollout_id, step_id) in self.steps

    def capture_rollout(self, rollout_id: int, *, sample_ids: Sequence[str], group_index: Any, response_lengths: Any,
                        total_lengths: Any, loss_masks: Any, raw_rewards: Any, rewards: Any, old_log_probs: Any,
                        ref_log_probs: Any, kl: Any, advantages: Any, config: Any, weight_lineage: Any = None,
                        micro_batch_ids: Any = None) -> bool:
        """Enqueue the rollout-level bundle `rollout-<R>` (this rank's shard). True if enqueued."""
        t0 = time.perf_counter()
        try:
            if not self.wants_rollout(rollout_id):
                self._count("filtered")
                return False
            cols = dict(sample_ids=sample_ids, group_index=group_index, response_lengths=response_lengths,
                        total_lengths=total_lengths, loss_masks=loss_masks, raw_rewards=raw_rewards, rewards=rewards,
                        micro_batch_ids=micro_batch_ids)
            tensors = dict(old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, kl=kl, advantages=advantages)
            nbytes = Columns.estimate(**cols) + sum(_estimate_flat(v) for v in tensors.values())
            bundle_id = rollout_bundle_id(rollout_id)
            if not self._reserve(nbytes, bundle_id, record=True):
                return False
            try:
                snap = Snapshot()
                columns = Columns.take(snap, **cols)
                payloads = {k: snap.flat(v, k) for k, v in tensors.items()}
                snap.finish()
                config, lineage, prov = _freeze(config), _freeze(weight_lineage), self.provenance
            except BaseException:
                self._release(nbytes)
                raise
            rec = _Record(bundle_id, snap, "rollout", (rollout_id, columns, payloads, config, lineage, prov), nbytes)
            return self._enqueue(rec)
        except Exception as exc:
            self._hook_error(f"capture_rollout({rollout_id})", exc)
            return False
        finally:
            self._hook_done(t0)

    def capture_microbatch(self, rollout_id: int, step_id: int, micro_batch_id: str, *, sample_ids: Sequence[str],
                           group_index: Any, response_lengths: Any, total_lengths: Any, loss_masks: Any,
                           raw_rewards: Any, rewards: Any, old_log_probs: Any, log_probs: Any, entropy: Any,
                           advantages: Any) -> bool:
        """Snapshot one micro-batch of actor step (R, S). A repeated micro_batch_id of the same step is ignored."""
        t0 = time.perf_counter()
        try:
            if not self.wants_step(rollout_id, step_id):
                self._count("filtered")
                return False
            key = (int(rollout_id), int(step_id))
            mb_id = str(micro_batch_id)
            with self._cond:
                step = self._pending.get(key)
                if step is None:
                    step = self._new_pending(key)
            if step.dropped:
                return False
            if mb_id in step.ids:
                self._count("ignored_microbatches")
                log.debug("capture: micro-batch %s of step %d:%d already captured; ignored", mb_id, *key)
                return False
            cols = dict(sample_ids=sample_ids, group_index=group_index, response_lengths=response_lengths,
                        total_lengths=total_lengths, loss_masks=loss_masks, raw_rewards=raw_rewards, rewards=rewards)
            tensors = dict(old_log_probs=old_log_probs, log_probs=log_probs, entropy=entropy, advantages=advantages)
            nbytes = Columns.estimate(**cols) + sum(_estimate_flat(v) for v in tensors.values())
            if not self._reserve(nbytes, f"{step_bundle_id(*key)} (micro-batch {mb_id}; the whole step is dropped)",
                                 record=False):
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

    def capture_step_end(self, rollout_id: int, step_id: int, *, loss: Any, pg_loss: Any, entropy_loss: Any,
                         pg_clipfrac: Any, ppo_kl: Any, config: Any, weight_lineage: Any = None) -> bool:
        """Enqueue the step-level bundle `step-<R>-<S>` from the micro-batches captured for it. True if enqueued."""
        t0 = time.perf_counter()
        try:
            if not self.wants_step(rollout_id, step_id):
                self._count("filtered")
                return False
            key = (int(rollout_id), int(step_id))
            with self._cond:
                step = self._pending.pop(key, None)
            if step is None:
                self._count("errors")
                log.error("capture: capture_step_end(%d, %d) without any captured micro-batch; nothing written", *key)
                return False
            if step.dropped:
                return False
            try:
                snap = step.snapshot
                reported = dict(loss=loss, pg_loss=pg_loss, entropy_loss=entropy_loss, pg_clipfrac=pg_clipfrac,
                                ppo_kl=ppo_kl)
                scalars = {name: snap.tensor(v) if _is_tensor(v) else v for name, v in reported.items()}
                snap.finish()
                config, lineage, prov = _freeze(config), _freeze(weight_lineage), self.provenance
                mbs = step.micro_batches
            except BaseException:
                self._release(step.nbytes)
                raise
            rec = _Record(step_bundle_id(*key), snap, "step", (key[0], key[1], mbs, scalars, config, lineage, prov),
                          step.nbytes)
            return self._enqueue(rec)
        except Exception as exc:
            self._hook_error(f"capture_step_end({rollout_id}, {step_id})", exc)
            return False
        finally:
            self._hook_done(t0)

    def _new_pending(self, key: tuple[int, int]) -> _PendingStep:
        """(lock held) A new pending step; the oldest unfinished one is dropped past max_pending_steps."""
        while len(self._pending) >= self.max_pending_steps:
            old_key, old = self._pending.popitem(last=False)
            self._bytes_in_use -= old.nbytes
            if not old.dropped:
                self._counts["dropped"] += 1
                log.warning("capture: step %d:%d never ended (more than %d steps open); dropped", *old_key,
                            self.max_pending_steps)
        step = _PendingStep()
        if self._closing:  # counted once; the step's later micro-batches are ignored
            step.dropped = True
            self._counts["dropped"] += 1
            log.warning("capture: dropped %s: the capture manager is closed", step_bundle_id(*key))
        self._pending[key] = step
        return step

    def _drop_pending(self, key: tuple[int, int], step: _PendingStep) -> None:
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
        _lower_thread_priority()
        if self.writer_mode == "process":
            self._start_process()
        try:
            self._serve()
        finally:
            if self._process is not None:
                self._process.stop()

    def _start_process(self) -> None:
        """Start the writer process (from this thread, so that it dies with it; it lowers its own priority)."""
        self._process = WriterProcess(dict(capture_dir=self.capture_dir, storage_options=self._storage_options,
                                           rank=self.rank, expected_ranks=self.expected_ranks),
                                      priority=self.writer_priority)
        try:
            failure = self._process.start()
        except Exception as exc:  # noqa: BLE001 - capture goes on in this thread rather than not at all
            log.warning("capture: the writer process could not start (%s: %s); writing from a thread instead",
                        type(exc).__name__, exc)
            self._process = None
            self.writer_mode = "thread"
            return
        if failure is not None:   # said now; the first record still tries (the store may be back by then)
            self._store_failed(failure, "the writer's first contact with the store", back_off=False)

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
                rec = self._queue.popleft()
                self._active = rec
            try:
                self._write(rec)
            except BaseException as exc:  # noqa: BLE001 - the writer thread must survive anything
                with self._cond:
                    self._counts["errors"] += 1
                failure = storage_failure(exc)
                if failure is not None:
                    self._store_failed(failure, f"writing {rec.bundle_id}")
                else:
                    log.error("capture: writing %s failed; it is not complete (left as garbage for gc): %s: %s",
                              rec.bundle_id, type(exc).__name__, exc, exc_info=True)
            else:
                with self._cond:
                    self._counts["written"] += 1
                self._store_ok()
            finally:
                with self._cond:
                    self._bytes_in_use -= rec.nbytes
                    self._active = None
                    self._cond.notify_all()

    def _drop_queued(self) -> None:
        """(lock held) Drop every queued record: the store is down and the manager is closing."""
        while self._queue:
            rec = self._queue.popleft()
            self._bytes_in_use -= rec.nbytes
            self._counts["dropped"] += 1
            self._down_drops += 1
            log.debug("capture: dropped %s: the store is down and capture is closing", rec.bundle_id)
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
            log.warning("capture: %s failed, nothing of it was written: %s; until the store answers again (tried "
                        "after %.0fs, backing off up to %.0fs) captures are dropped and counted", doing, failure,
                        self._retry_delay, STORE_RETRY_MAX)
        else:
            log.warning("capture: %s failed: %s; capture goes on, and backs off if writing fails too", doing, failure)

    def _store_ok(self) -> None:
        with self._cond:
            if not self._retry_delay:
                return
            self._retry_delay = self._retry_at = 0.0
            drops, self._down_drops = self._down_drops, 0
        log.info("capture: the store answers again; %d capture(s) were dropped while it did not", drops)

    def _write(self, rec: _Record) -> None:
        rec.snapshot.wait()
        if self._process is not None:
            self._process.write(rec.bundle_id, rec.builder, rec.args)
            log.info("capture: wrote %s/%s%s", self.store.url, rec.bundle_id,
                     f" (rank {self.rank})" if self.multi_producer else "")
        else:
            write_bundle(self.store, self.capture_dir, rec.bundle_id, rec.builder, rec.args, self.rank,
                         self.expected_ranks)

    def __repr__(self) -> str:
        return f"CaptureManager({self.capture_dir!r}, rank={self.rank}, expected_ranks={self.expected_ranks})"


def write_bundle(store: ObjectStore, capture_dir: str, bundle_id: str, builder: str, args: tuple, rank: int,
                 expected_ranks: Sequence[int]) -> None:
    """Build one captured record's bundle and write it (rank `rank`'s shard when several ranks are expected)."""
    parts = BUILDERS[builder](*args)
    forget = getattr(store.backend, "forget_outage", None)
    if forget is not None:   # each record asks the store again; the manager's backoff spaced the attempts out
        forget()
    rank_args: dict[str, Any] = {}
    if len(expected_ranks) > 1:
        rank_args = dict(rank=rank, expected_ranks=list(expected_ranks))
    writer = BundleWriter(f"{capture_dir.rstrip('/')}/{bundle_id}", parts.manifest, parts.index, parts.expected,
                          store=store, **rank_args)
    try:
        writer.finalize(payloads=parts.payloads)   # payloads and documents in one batch
    except BaseException:
        try:
            writer.abort()
        except Exception as exc:  # the in-flight record stays; gc removes it after its TTL
            log.warning("capture: could not remove the in-flight record of %s: %s", bundle_id, exc)
        raise
    log.info("capture: wrote %s%s", writer.url, f" (rank {rank})" if len(expected_ranks) > 1 else "")


_LIVE: "weakref.WeakSet[CaptureManager]" = weakref.WeakSet()
_exit_hook_registered = False
_exit_hook_lock = threading.Lock()


def _close_all_at_exit() -> None:
    for manager in list(_LIVE):
        manager._close_at_exit()


def _register_exit_hook() -> None:
    """Close live managers at interpreter exit, while thread pools still accept work.

    A plain `atexit` handler runs too late: `concurrent.futures` refuses new work once the
    interpreter's shutdown begins, and the object store hashes and uploads through thread pools.
    `threading._register_atexit` callbacks run first, in reverse order of registration, so this one
    (registered after `concurrent.futures.thread` imported, which the store does) runs before the
    pools shut down. Where that hook is missing, `atexit` is the fallback."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if _exit_hook_registered:
            return
        import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise AttributeError("threading._register_atexit")
            register(_close_all_at_exit)
        except (AttributeError, RuntimeError):
            atexit.register(_close_all_at_exit)
        _exit_hook_registered = True


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _estimate_flat(value: Any) -> int:
    return estimate_nbytes(value)


def _freeze(value: Any) -> Any:
    """A copy of a small config/lineage argument, so a later change by training is harmless."""
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_copy"):
        return value.model_copy()
    return value


__all__ = ["CaptureManager", "DEFAULT_MAX_QUEUE_BYTES", "DEFAULT_MAX_QUEUE_RECORDS", "log"]


_IO_LOOP: Optional[asyncio.AbstractEventLoop] = None
_IO_LOOP_LOCK = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    """The process-wide event loop of capture's remote I/O: one daemon thread at lowered priority."""
    global _IO_LOOP
    with _IO_LOOP_LOCK:
        if _IO_LOOP is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                _lower_thread_priority()
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="trajectory-replay-io", daemon=True).start()
            ready.wait()
            _IO_LOOP = loop
    return _IO_LOOP


def _lower_thread_priority(niceness: int = 10) -> None:
    """Make the writer (and the I/O threads it starts, which inherit it) yield the CPU to training.

    Linux schedules threads individually, so this lowers only the capture threads. Best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass
