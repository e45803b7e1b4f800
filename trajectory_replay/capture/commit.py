"""The bundle commit: one `BundleJob` in, one BundleWriter run out (payloads, documents, completion marker).

The manager turns every captured record into a `BundleJob`: the record plus where it goes (the capture
directory) and as which producer rank. A job is a frozen, picklable value; its writer commits it with
`commit_bundle`, in the manager's writer thread (`InThreadWriter`) or in the writer process
(`capture.worker`), the same code either way. A job that fails calls `BundleWriter.abort()`: nothing
it leaves looks complete, and what is left is garbage for gc.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trajectory_replay.bundle.writer import BundleWriter
from trajectory_replay.capture.records import CAPTURE_RECORDS, CaptureRecord, check_fields
from trajectory_replay.errors import StorageUnavailableError
from trajectory_replay.store import ObjectStore

log = logging.getLogger("trajectory_replay.capture")


@dataclass(frozen=True)
class BundleJob:
    """One bundle to write: `record`'s bundle under `capture_dir`, as rank `rank` of `expected_ranks`.

    With one expected rank the bundle is written whole; with more, as that rank's shard of a
    multi-producer bundle."""

    capture_dir: str
    record: CaptureRecord
    rank: int = 0
    expected_ranks: tuple[int, ...] = (0,)
    run_id: str | None = None
    """The launch that captured it (`config.run_identity`), recorded in its rank marker."""
    signals: Mapping[str, Any] = field(default_factory=dict)
    """What the trainer reported beside the record for the flight recorder's triggers (`capture.recorder`):
    `grad_norm` (a number), `trigger` (the reason a user gave)."""

    def __post_init__(self) -> None:
        check_fields(self, capture_dir=str, record=CAPTURE_RECORDS, rank=int, expected_ranks=tuple)
        if self.run_id is not None and not isinstance(self.run_id, str):
            raise ValueError(f"BundleJob.run_id: expected a string or None, got {type(self.run_id).__name__}")
        if not self.capture_dir.strip():
            raise ValueError("BundleJob.capture_dir is empty")
        ranks = self.expected_ranks
        if not ranks or any(type(r) is not int or r < 0 for r in ranks) or list(ranks) != sorted(set(ranks)):
            raise ValueError(f"BundleJob.expected_ranks: expected increasing non-negative ints, got {ranks!r}")
        if self.rank not in ranks:
            raise ValueError(f"BundleJob.rank: {self.rank} is not among expected ranks {list(ranks)}")

    @property
    def bundle_id(self) -> str:
        return self.record.bundle_id

    @property
    def multi_producer(self) -> bool:
        return len(self.expected_ranks) > 1


def commit_bundle(store: ObjectStore, job: BundleJob) -> str:
    """Build `job`'s bundle and write it through `store` (opened on `job.capture_dir`); its URL (credentials
    redacted). On failure nothing looks complete: the writer is aborted and the error raised."""
    parts = job.record.build()
    forget = getattr(store.backend, "forget_outage", None)
    if forget is not None:  # each record asks the store again; the manager's backoff spaced the attempts out
        forget()
    multi = job.multi_producer  # a single producer's bundle names no rank
    writer = BundleWriter(
        f"{job.capture_dir.rstrip('/')}/{job.bundle_id}",
        parts.manifest,
        parts.index,
        parts.expected,
        store=store,
        rank=job.rank if multi else None,
        expected_ranks=list(job.expected_ranks) if multi else None,
        run_id=job.run_id if multi else None,
    )
    try:
        writer.finalize(payloads=parts.payloads)  # payloads and documents in one batch
    except BaseException:
        try:
            writer.abort()
        except Exception as exc:  # the in-flight record stays; gc removes it after its TTL
            log.warning("capture: could not remove the in-flight record of %s: %s", job.bundle_id, exc)
        raise
    return writer.url


class InThreadWriter:
    """The writer of `writer="thread"`: commits each job in the calling thread, through the manager's store."""

    mode = "thread"

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def write(self, job: BundleJob) -> str:
        return commit_bundle(self.store, job)

    def stop(self) -> None:
        """Nothing to stop: the store belongs to the manager."""


def storage_failure(exc: BaseException | None) -> StorageUnavailableError | None:
    """The StorageUnavailableError behind `exc` (itself, or one it was raised from), if any: the store could not
    be used, so the manager backs off instead of failing record after record."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, StorageUnavailableError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


__all__ = ["BundleJob", "InThreadWriter", "commit_bundle", "storage_failure"]
