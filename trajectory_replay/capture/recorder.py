"""The flight recorder: every step into a local spool, and only the steps before something went wrong into the store.

With the capture policy `recorder:K[,after=M][,max_bytes=B]` (`config.CapturePolicy`) the capture writer (the
writer process, or the writer thread) commits every bundle into a spool, a content-addressed store on local disk
(TRAJECTORY_REPLAY_CAPTURE_SPOOL, one root per rank: `<spool>/rank-<r>`), so that payloads shared between steps
are kept once. After each commit it evaluates the triggers (`TriggerSettings`) on the record it just wrote, on
the writer's side of the snapshot (values already on the host: no trigger adds a device sync, and the training
thread only snapshots and enqueues). When one fires:

- the trigger is written once, create-once, to the configured store as `.recorder/<step bundle>` (a JSON
  `TriggerRecord`), and the writer of every rank looks there after each of its commits: a trigger on any rank
  promotes the same steps on every rank, with no collective, so the promoted multi-rank bundles complete;
- the K step bundles up to the trigger's step (that step included: the newest K in the spool) and the next M
  are promoted to the store, with the rollout-level bundles they name, by `cp`'s object copy (verified against
  their digests, only the objects the store lacks), then the markers last (`promote`). Each promoted bundle's
  manifest records the trigger (`Manifest.trigger`: name, value, threshold, step, rank), its only difference
  from the spool's bundle.

A trigger fired by a step record is at that step. One fired by a rollout-level record (reward collapse, the
mismatch metrics) or by `trigger(reason)` is at the next step bundle the rank ends: the first step that trains on
that rollout.

The spool is bounded: it holds at most K step bundles (the oldest evicted before a step is committed), with the
rollout-level bundles that one of them names or that no step has named yet, and at most `max_bytes` bytes on
disk (older steps are evicted until it fits; the newest step always stays). Eviction removes a bundle's markers;
the store's own gc (`ops.gc`, grace 0) then removes what no kept bundle names, once every K evictions (a sweep
lists the whole spool: amortized, it costs about one listing per K steps) and at once whenever the spool is over
its bytes. So the spool's bytes never stay above `max_bytes` past a commit (unless its newest step alone is
larger), and between sweeps it holds the objects of at most 2K steps. A recorder starting on a spool
left by an earlier launch (or a killed process) removes everything in it first (`_clear`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trajectory_replay.backends import Backend
from trajectory_replay.bundle.anchor import Anchor
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import (
    CompleteMarker,
    DocRef,
    Documents,
    RankMarker,
    complete_key,
    rank_key,
    read_complete,
    read_trigger,
    trigger_key,
    try_finalize,
)
from trajectory_replay.bundle.schema import BundleIndex, TriggerRecord
from trajectory_replay.bundle.status import COMPLETE_STATUS, bundle_status
from trajectory_replay.capture.commit import BundleJob, commit_bundle
from trajectory_replay.capture.records import RolloutRecord, StepRecord
from trajectory_replay.capture.values import materialize_float, materialize_list
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.cp import CopyReport, copy_objects
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.ops.walk import Walker
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.layout import RECORDER_DIR

log = logging.getLogger("trajectory_replay.capture")

LOSS_SCALARS = ("loss", "pg_loss", "entropy_loss", "kl_loss", "vf_loss")
"""The reported scalars the NaN trigger reads."""
SPIKE_SIGNALS = {"loss": ("loss",), "kl": ("kl_loss",), "grad_norm": ("grad_norm",)}
"""The spike trigger's signals and the scalars each is read from (the first one reported)."""


@dataclass(frozen=True)
class TriggerSettings:
    """What fires the recorder; a threshold of None switches that trigger off.

    - `nan`: a loss scalar the step reported, or the gradient norm (`capture_step_end(grad_norm=...)`), is NaN or
      infinite (trigger `nan_loss`, `nan_grad_norm`);
    - `nan_payloads`: a floating payload of the step (log-probs, advantages, ...) holds a NaN or infinite value
      (trigger `nan_payload`; its detail names the payload);
    - `spike_z`, `spike_window`: loss, KL loss (kl_loss: the policy ratio's ppo_kl, near 0 and noisy, is not read)
      or gradient norm further than `spike_z`
      standard deviations from the mean of the last `spike_window` steps (computed once `spike_min_steps` are
      there; trigger `loss_spike`, `kl_spike`, `grad_norm_spike`, value the z-score);
    - `mismatch_kl_k3`, `mismatch_log_ratio_max_abs`: the rollout.mismatch metrics a rollout reported above these
      (trigger `mismatch_kl_k3`, `mismatch_log_ratio_max_abs`);
    - `collapse_share`: the share of a rollout's prompt groups (of this rank's samples) whose raw rewards are all
      equal is above it (trigger `reward_collapse`).

    `trigger(reason)` (trigger `user`) is always on."""

    nan: bool = True
    nan_payloads: bool = True
    spike_z: float | None = 8.0
    spike_window: int = 20
    spike_min_steps: int = 8
    mismatch_kl_k3: float | None = 0.5
    mismatch_log_ratio_max_abs: float | None = 20.0
    collapse_share: float | None = 0.9

    def __post_init__(self) -> None:
        if self.spike_window < 2 or not 2 <= self.spike_min_steps <= self.spike_window:
            raise ValueError(
                f"TriggerSettings: spike_window {self.spike_window} and spike_min_steps {self.spike_min_steps} "
                "need 2 <= spike_min_steps <= spike_window"
            )
        for name in ("spike_z", "mismatch_kl_k3", "mismatch_log_ratio_max_abs", "collapse_share"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"TriggerSettings.{name}: expected a non-negative number or None, got {value!r}")


@dataclass(frozen=True)
class RecorderSettings:
    """What a capture writer needs to run the recorder: the policy's bounds, the spool root of this rank, the
    rank and its peers (promoted bundles land as that rank of a multi-producer bundle) and the triggers."""

    spool: str
    keep: int
    after: int = 0
    max_bytes: int = 8 << 30
    rank: int = 0
    expected_ranks: tuple[int, ...] = (0,)
    run_id: str | None = None
    triggers: TriggerSettings = field(default_factory=TriggerSettings)


@dataclass(frozen=True)
class Trigger:
    """A trigger that fired: `name`, the `value` it saw, the `threshold` it compares with, and the step bundle
    it is at (None until the rank ends its next step)."""

    name: str
    value: float | str | None
    threshold: float | None = None
    step: str | None = None
    rank: int | None = None
    detail: str | None = None

    def record(self) -> TriggerRecord:
        assert self.step is not None  # a trigger is recorded only once it is at a step
        value = self.value
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no NaN
        return TriggerRecord(
            name=self.name, value=value, threshold=self.threshold, step=self.step, rank=self.rank, detail=self.detail
        )


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


_BF16_EXPONENT = 0x7F80
_F16_EXPONENT = 0x7C00


def nonfinite_count(tensor: Any) -> int:
    """How many values of a snapshotted tensor (a host `torch.Tensor`, or the writer process's `RawTensor`) are NaN
    or infinite; 0 for an integer or boolean one."""
    if tensor is None:
        return 0
    dtype = str(getattr(tensor, "dtype", ""))
    if not any(kind in dtype for kind in ("float", "bfloat")):
        return 0
    data = getattr(tensor, "data", None)
    if isinstance(data, (bytes, bytearray, memoryview)):  # a RawTensor: its bytes, without torch
        import numpy

        if dtype == "torch.bfloat16" or dtype == "torch.float16":
            bits = numpy.frombuffer(data, dtype="<u2")
            mask = _BF16_EXPONENT if dtype == "torch.bfloat16" else _F16_EXPONENT
            return int(numpy.count_nonzero((bits & mask) == mask))
        array = numpy.frombuffer(data, dtype="<f8" if dtype == "torch.float64" else "<f4")
        return int(array.size - numpy.count_nonzero(numpy.isfinite(array)))
    return int(tensor.numel() - int(tensor.isfinite().sum()))  # a torch tensor on the host (the snapshot's copy)


DOCUMENT_BYTES = 4096
"""What a bundle's documents, records and markers may take beyond their payloads, per sample and per bundle."""


def _nbytes(tensor: Any) -> int:
    if tensor is None:
        return 0
    data = getattr(tensor, "data", None)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return len(data)
    return int(tensor.numel()) * int(tensor.element_size())


def record_bytes(record: Any) -> int:
    """An upper bound of the bytes committing `record` adds to a store: its payloads, and its documents (bounded by
    DOCUMENT_BYTES per sample and per bundle)."""
    if isinstance(record, StepRecord):
        parts = [(mb.payloads, mb.columns) for mb in record.micro_batches]
    else:
        parts = [(record.payloads, record.columns)]
    total = DOCUMENT_BYTES
    for payloads, columns in parts:
        samples = len(materialize_list(columns.sample_ids, "sample_ids") or [])
        tokens = sum(int(n) for n in materialize_list(columns.response_lengths, "response_lengths") or [])
        total += sum(_nbytes(t) for t in payloads.values()) + samples * DOCUMENT_BYTES + tokens
    return total


class Triggers:
    """Evaluates the triggers of `TriggerSettings` on the records a writer commits, keeping the rolling windows."""

    def __init__(self, settings: TriggerSettings, rank: int = 0) -> None:
        self.settings, self.rank = settings, rank
        self.history: dict[str, list[float]] = {name: [] for name in SPIKE_SIGNALS}
        self.holding: dict[str, set[str]] = {"step": set(), "rollout": set()}

    def _edge(self, kind: str, met: list[Trigger]) -> list[Trigger]:
        """The triggers of `met` (conditions that hold now, on a record of `kind`) that did not hold on the previous
        record of that kind: a condition that holds step after step fires once."""
        before, self.holding[kind] = self.holding[kind], {t.name for t in met}
        return [t for t in met if t.name not in before]

    def of_step(self, record: StepRecord, signals: Mapping[str, Any]) -> list[Trigger]:
        s, step, fired = self.settings, record.bundle_id, []
        scalars = {name: materialize_float(v) for name, v in record.scalars.items()}
        grad_norm = materialize_float(signals.get("grad_norm"))
        if s.nan:
            for name in LOSS_SCALARS:
                value = scalars.get(name)
                if not _finite(value):
                    fired.append(Trigger("nan_loss", value, None, step, self.rank, f"{name} = {value}"))
                    break
            if not _finite(grad_norm):
                fired.append(Trigger("nan_grad_norm", grad_norm, None, step, self.rank))
        if s.nan_payloads:
            for mb in record.micro_batches:
                bad = [(name, n) for name, t in mb.payloads.items() if (n := nonfinite_count(t))]
                if bad:
                    name, n = bad[0]
                    fired.append(
                        Trigger(
                            "nan_payload",
                            float(n),
                            0.0,
                            step,
                            self.rank,
                            f"{name} of micro-batch {mb.micro_batch_id}: {n} NaN/inf value(s)",
                        )
                    )
                    break
        values = {"grad_norm": grad_norm}
        for signal, names in SPIKE_SIGNALS.items():
            if signal != "grad_norm":
                values[signal] = next((scalars[n] for n in names if scalars.get(n) is not None), None)
        for signal, value in values.items():
            if value is None or not math.isfinite(value):
                continue
            window = self.history[signal]
            if s.spike_z is not None and len(window) >= s.spike_min_steps:
                mean = sum(window) / len(window)
                std = math.sqrt(sum((v - mean) ** 2 for v in window) / len(window))
                z = abs(value - mean) / std if std > 0 else (0.0 if value == mean else math.inf)
                if z > s.spike_z:
                    fired.append(
                        Trigger(
                            f"{signal}_spike",
                            z,
                            s.spike_z,
                            step,
                            self.rank,
                            f"{signal} {value:.6g} against the mean {mean:.6g} of the last {len(window)} steps",
                        )
                    )
            window.append(value)
            del window[: -s.spike_window]
        return self._edge("step", fired)

    def of_rollout(self, record: RolloutRecord) -> list[Trigger]:
        s, fired = self.settings, []
        metrics = {name: materialize_float(v) for name, v in record.mismatch_metrics.items()}
        for name, threshold in (("kl_k3", s.mismatch_kl_k3), ("log_ratio_max_abs", s.mismatch_log_ratio_max_abs)):
            value = metrics.get(name)
            if threshold is not None and value is not None and not value <= threshold:
                fired.append(Trigger(f"mismatch_{name}", value, threshold, None, self.rank, record.bundle_id))
        if s.collapse_share is not None:
            groups: dict[Any, set[float]] = {}
            raw = materialize_list(record.columns.raw_rewards, "raw_rewards") or []
            index = materialize_list(record.columns.group_index, "group_index") or []
            for g, r in zip(index, raw):
                if g is not None:
                    groups.setdefault(g, set()).add(float(r))
            if groups:
                share = sum(len(v) == 1 for v in groups.values()) / len(groups)
                if share > s.collapse_share:
                    fired.append(
                        Trigger(
                            "reward_collapse",
                            share,
                            s.collapse_share,
                            None,
                            self.rank,
                            f"{record.bundle_id}: {share:.0%} of {len(groups)} groups have one reward",
                        )
                    )
        return self._edge("rollout", fired)


@dataclass
class _Window:
    """A trigger being served: the steps it still promotes after its own."""

    trigger: Trigger
    after_left: int


def _clear(spool: str) -> None:
    """Remove whatever an earlier launch (or a killed process) left in `spool`: bundles, objects, in-flight records
    and interrupted writes alike. A rank's spool is its own (one job per spool directory), so nothing there belongs
    to a live writer, and gc, which must keep what a live writer's in-flight record names until it expires, would
    leave a killed writer's last objects behind."""
    if os.path.isdir(spool):
        shutil.rmtree(spool)


class Recorder:
    """The recorder of one capture writer (one rank): commits jobs into the spool, fires triggers, promotes
    windows to `store` (the configured store), evicts. Used by one thread (the writer's)."""

    def __init__(self, settings: RecorderSettings, store: ObjectStore) -> None:
        self.settings, self.store = settings, store
        self.multi = len(settings.expected_ranks) > 1
        _clear(settings.spool)
        os.makedirs(settings.spool, exist_ok=True)
        self.spool = ObjectStore.open(settings.spool)
        self.triggers = Triggers(settings.triggers, settings.rank)
        self.steps: list[tuple[str, int]] = []  # step bundles in the spool, oldest first, with their rollout id
        self.rollouts: list[int] = []  # rollout ids of the rollout-level bundles in the spool
        self.promoted: set[str] = set()
        self.seen_markers: set[str] = set()
        self.waiting: list[Trigger] = []  # fired, not yet at a step (the next step bundle)
        self.remote: dict[str, Trigger] = {}  # other ranks' triggers at steps this rank has not ended yet
        self.open: list[_Window] = []
        self.wanted: dict[int, Trigger] = {}  # rollouts of promoted steps, not in the spool yet
        self.signals: dict[str, Any] = {}
        self.counts = dict.fromkeys(
            (
                "triggers",
                "promoted",
                "promotion_errors",
                "objects_sent",
                "objects_present",
                "evicted",
                "sweeps",
                "peak_bytes",
            ),
            0,
        )
        self.unswept = 0
        self.measured = self.added = 0
        self._measure()

    # ---- the spool -----------------------------------------------------------------------------------
    def spool_bytes(self) -> int:
        """Bytes the spool holds on disk now."""
        total = 0
        for root, _, files in os.walk(self.settings.spool):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return total

    def _evict(self, room: int = 0) -> None:
        """Evict the oldest steps beyond K (`room` fewer: a step is about to be committed), then beyond the bytes."""
        s = self.settings
        gone: list[str] = []
        while len(self.steps) > s.keep - room:
            gone.append(self.steps.pop(0)[0])
        gone += self._unnamed_rollouts()
        if gone:
            self._drop(gone)
        if self.unswept >= s.keep:
            self._sweep()
        # the spool's bytes: counted on disk after a sweep, else the last count plus what was committed since (an
        # upper bound: a commit stores at most its payloads' bytes and its documents), counted again when that
        # bound is over max_bytes
        size = self.measured + self.added
        if size > s.max_bytes:
            size = self._measure()
        while size > s.max_bytes and (self.unswept or len(self.steps) > 1):
            if not self.unswept:
                self._drop([self.steps.pop(0)[0], *self._unnamed_rollouts()])
            self._sweep()
            size = self.measured
        self.counts["peak_bytes"] = max(self.counts["peak_bytes"], size)

    def _measure(self) -> int:
        self.measured, self.added = self.spool_bytes(), 0
        return self.measured

    def _unnamed_rollouts(self) -> list[str]:
        """Forget the rollout-level bundles that no kept step names, the newest aside (its steps are to come)."""
        named = {r for _, r in self.steps}
        newest = max(self.rollouts, default=None)
        gone = [r for r in self.rollouts if r not in named and r != newest]
        self.rollouts = [r for r in self.rollouts if r not in gone]
        return [f"rollout-{r}" for r in gone]

    def _drop(self, names: list[str]) -> None:
        """Remove the markers of `names`: from now on nothing names their objects but kept bundles; gc reclaims the
        rest every `keep` evictions, or at once when the spool is over its bytes."""
        backend = self.spool.backend
        for name in names:
            backend.delete(complete_key(name))
        self.counts["evicted"] += len(names)
        self.unswept += len(names)

    def _sweep(self) -> None:
        collect_garbage(self.settings.spool, grace=0)
        self.unswept = 0
        self.counts["sweeps"] += 1
        self._measure()

    # ---- committing ------------------------------------------------------------------------------------
    def commit(self, job: BundleJob) -> str:
        """Commit `job`'s bundle into the spool, fire and serve triggers, evict; the spool bundle's URL."""
        record = job.record
        spool_job = replace(job, capture_dir=self.settings.spool, rank=0, expected_ranks=(0,), run_id=None)
        if self.multi:  # other ranks' triggers first, while the steps before them are still in the spool
            self._poll_markers()
        if isinstance(record, StepRecord):
            self._evict(room=1)  # the spool never holds more than K steps, even while this one is committed
        url = commit_bundle(self.spool, spool_job)
        self.added += record_bytes(record)
        fired: list[Trigger] = []
        if "trigger" in job.signals:
            fired.append(Trigger("user", str(job.signals["trigger"]), None, None, self.settings.rank))
        if isinstance(record, StepRecord):
            fired += self.triggers.of_step(record, job.signals)
            step = record.bundle_id
            self.steps.append((step, record.rollout_id))
            if record.rollout_id not in self.rollouts and self.spool.backend.exists(
                complete_key(f"rollout-{record.rollout_id}")
            ):
                self.rollouts.append(record.rollout_id)
            fired = [replace(t, step=step) for t in self.waiting + fired]
            self.waiting = []
            self._serve_open(step)
        elif isinstance(record, RolloutRecord):
            if record.rollout_id not in self.rollouts:
                self.rollouts.append(record.rollout_id)
            if record.rollout_id in self.wanted:
                self._promote([record.bundle_id], self.wanted.pop(record.rollout_id))
            self.waiting += self.triggers.of_rollout(record)
        for trigger in fired:
            self._fire(trigger)
        if self.multi:  # a single rank has no other rank's trigger to look for
            self._poll_markers()
        self._evict()
        return url

    def _serve_open(self, step: str) -> None:
        """A new step: promote it for every open window that still wants steps after its trigger."""
        for window in self.open:
            if window.after_left > 0:
                self._promote_step(step, window.trigger)
                window.after_left -= 1
        self.open = [w for w in self.open if w.after_left > 0]

    def _fire(self, trigger: Trigger) -> None:
        """A trigger fired on this rank at a step it has ended: say so to every rank (create-once), then serve it."""
        assert trigger.step is not None
        self.counts["triggers"] += 1
        log.warning(
            "capture: trigger %s fired at %s (value %s, threshold %s)%s; keeping the last %d steps and %d after",
            trigger.name,
            trigger.step,
            trigger.value,
            trigger.threshold,
            f": {trigger.detail}" if trigger.detail else "",
            self.settings.keep,
            self.settings.after,
        )
        key = trigger_key(trigger.step)
        document = compact_json(trigger.record().model_dump(mode="json"))
        if not self.store.backend.create_if_absent(key, document):
            trigger = self._read_marker(key) or trigger  # another rank fired at this step first: its trigger
        self.seen_markers.add(key.rsplit("/", 1)[1])
        self._serve(trigger)

    def _read_marker(self, key: str) -> Trigger | None:
        try:
            record = read_trigger(self.store.backend, key)
        except BundleError as exc:  # a marker that cannot be read is skipped, and said
            log.warning("capture: %s", exc)
            return None
        value = record.value
        if isinstance(value, str) and value in ("nan", "inf", "-inf"):
            value = float(value)
        return Trigger(record.name, value, record.threshold, record.step, record.rank, record.detail)

    def _poll_markers(self) -> None:
        """Triggers other ranks fired: each is served once, when this rank has ended its step."""
        try:
            names = self.store.backend.list_dir(RECORDER_DIR)
        except Exception:  # noqa: BLE001 - none yet (or a listing that failed: the next commit looks again)
            names = []
        for name in names:
            if name in self.seen_markers or name in self.remote:
                continue
            trigger = self._read_marker(trigger_key(name))
            if trigger is not None:
                self.remote[name] = trigger
        ended = {step for step, _ in self.steps}
        for name in [n for n in self.remote if n in ended]:
            self.seen_markers.add(name)
            self._serve(self.remote.pop(name))

    def _serve(self, trigger: Trigger) -> None:
        """Promote the K steps up to the trigger's step (with it) and open a window for the M after."""
        names = [step for step, _ in self.steps]
        assert trigger.step is not None
        end = names.index(trigger.step) + 1 if trigger.step in names else len(names)
        for step in names[max(0, end - self.settings.keep) : end]:
            self._promote_step(step, trigger)
        after = names[end : end + self.settings.after]
        for step in after:
            self._promote_step(step, trigger)
        if self.settings.after - len(after) > 0:
            self.open.append(_Window(trigger, self.settings.after - len(after)))

    def _promote_step(self, step: str, trigger: Trigger) -> None:
        """Promote `step` and the rollout-level bundle it names; one that has not arrived yet (a trainer may end
        its rollout's steps before it captures the rollout) is promoted when it does."""
        rollout = next(r for s, r in self.steps if s == step)
        if rollout not in self.rollouts:
            self.wanted.setdefault(rollout, trigger)
        self._promote([f"rollout-{rollout}", step], trigger)

    def _promote(self, names: list[str], trigger: Trigger) -> None:
        for name in names:
            if name in self.promoted or not self.spool.backend.exists(complete_key(name)):
                continue
            try:
                report = promote(
                    self.spool.backend,
                    self.store,
                    name,
                    trigger.record(),
                    self.settings.rank,
                    list(self.settings.expected_ranks),
                    self.settings.run_id,
                )
            except Exception as exc:  # noqa: BLE001 - the spool goes on; a later trigger may promote it again
                self.counts["promotion_errors"] += 1
                log.error(
                    "capture: promoting %s (trigger %s at %s) failed; nothing of it is complete in the store: %s: %s",
                    name,
                    trigger.name,
                    trigger.step,
                    type(exc).__name__,
                    exc,
                )
                continue
            self.promoted.add(name)
            self.counts["promoted"] += 1
            self.counts["objects_sent"] += report.objects_copied
            self.counts["objects_present"] += report.objects_skipped


class RecorderWriter:
    """The writer of `writer="thread"` under the recorder policy: commits each job through `recorder`."""

    mode = "thread"

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def write(self, job: BundleJob) -> str:
        return self.recorder.commit(job)

    def stop(self) -> None:
        """Nothing to stop: the stores belong to the manager and the recorder."""


def promote(
    spool: Backend,
    store: ObjectStore,
    name: str,
    trigger: TriggerRecord,
    rank: int,
    expected_ranks: list[int],
    run_id: str | None = None,
) -> CopyReport:
    """Copy the complete spool bundle `name` into `store` as rank `rank` of `expected_ranks` (the whole bundle
    when that is one rank), its manifest recording `trigger`: the objects the store lacks first (`cp`'s copy,
    verified), then the manifest, then the markers (COMPLETE, or COMPLETE.<rank> and the final COMPLETE once
    every rank landed)."""
    state = bundle_status(spool, name)
    if state is None or state.status != COMPLETE_STATUS:
        raise BundleError(f"{spool.url}/{name}: not a complete bundle of the spool; nothing promoted")
    tree = Walker(spool).trees([state])[name]
    if tree.problems or tree.missing or tree.corrupt:
        raise BundleError(f"{spool.url}/{name}: damaged in the spool ({'; '.join(tree.problems)}); nothing promoted")
    (_, documents), *_ = state.documents()
    report = CopyReport(spool.url, store.url, bundles=[name])
    copy_objects(
        spool,
        store.backend,
        [*tree.documents[1:], *(node for _, _, node in tree.payloads)],
        report,
    )
    source = ObjectStore(spool)
    manifest = json.loads(bytes(source.get(documents.manifest.blob_ref())))
    manifest["trigger"] = trigger.model_dump(mode="json")
    plan = store.plan(compact_json(manifest))
    report.objects_copied += len(store.missing_keys(plan.keys()))  # the manifest's chunk, record and ref, if new
    ref = store.commit(plan)
    shard = Documents(manifest=DocRef.of(ref), index=documents.index, expected=documents.expected)
    index = BundleIndex.model_validate(json.loads(bytes(source.get(documents.index.blob_ref()))))
    anchor = Anchor.of(index.identity)
    backend = store.backend
    backend.require_atomic_create()
    if len(expected_ranks) == 1:
        marker = CompleteMarker(
            bundle_id=name,
            anchor=anchor,
            expected_ranks=[0],
            multi_rank=False,
            shards={"0": shard},
            attempt=f"recorder-{time.time_ns()}",
        )
        if not backend.create_if_absent(complete_key(name), compact_json(marker.model_dump(mode="json"))):
            existing = read_complete(backend, name)
            if existing is None or existing.all_digests()[1:] != marker.all_digests()[1:]:
                raise BundleError(f"{store.url}/{name}: a different bundle with this name exists; not promoted")
            report.markers_skipped += 1
        else:
            report.markers_written += 1
        return report
    rank_marker = RankMarker(
        bundle_id=name,
        rank=rank,
        anchor=anchor,
        expected_ranks=expected_ranks,
        documents=shard,
        attempt=f"recorder-{time.time_ns()}",
        created=time.time(),
        run=run_id,
    )
    document = rank_marker.model_dump(mode="json", exclude={"run"} if run_id is None else set())
    if backend.create_if_absent(rank_key(name, rank), compact_json(document)):
        report.markers_written += 1
    try_finalize(backend, name, expected_ranks, claim=rank)
    return report


__all__ = [
    "LOSS_SCALARS",
    "Recorder",
    "RecorderSettings",
    "RecorderWriter",
    "SPIKE_SIGNALS",
    "Trigger",
    "TriggerSettings",
    "Triggers",
    "nonfinite_count",
    "promote",
]
