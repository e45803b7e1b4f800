"""The worker side of `scan`: one bundle replayed from the store and judged, as a verdict.

Every engine's workers hold a `Replayer` (or a subclass of it that the scan was given) per store root: the store
is opened once and torch imported once, and many bundles are replayed. A worker gets the store's URL, its storage
options and bundle names, never bundle data, and answers each bundle's verdict for the driver to keep.
"""

from __future__ import annotations

import time
from typing import Any

from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.ops.scan.verdicts import (
    DIVERGED,
    ERROR,
    INCOMPLETE,
    INVALID,
    PASS,
    UNSUPPORTED,
    ScanOptions,
    Verdict,
    bundle_digest,
    object_stamps,
    one_line,
)

WORKER_MODULES = (
    "torch",
    "trajectory_replay.replay.runner",
    "trajectory_replay.bundle.reader",
    "trajectory_replay.store",
)
"""What a worker needs to replay (`trajectory_replay.replay` imports its parts lazily): imported once per worker
process (by the local engine's fork server, before it forks any worker)."""


def prepare_worker() -> None:
    """Import torch and the replay code once in a worker and keep the collector from rescanning what it imported
    (as the CLI does)."""
    import gc
    import importlib

    for module in WORKER_MODULES:
        importlib.import_module(module)
    gc.freeze()


class Replayer:
    """Replays bundles of one store root in a worker: the store is opened once, torch imported once."""

    def __init__(self, url: str, storage_options: dict[str, Any], options: ScanOptions) -> None:
        from trajectory_replay.store import ObjectStore

        self.url, self.options = url, options
        # every byte from the store itself: a verdict is kept in the store for every host to reuse, so it must
        # say what the store holds, not what this host's read cache holds
        self.store = ObjectStore.open(url, **{"trust_cache": False, **storage_options})

    def replay_one(self, name: str) -> dict[str, Any]:
        """The verdict of bundle `name` as a dict, with the stamp of its objects (`objects`) taken before the
        replay, for the driver to keep it. Errors that say something about the bundle are verdicts; any other
        exception (the storage, a bug) is raised, for the engine to retry and then report."""
        from trajectory_replay.bundle.markers import parse_complete
        from trajectory_replay.bundle.reader import native_readers
        from trajectory_replay.errors import (
            BackendError,
            IncompleteBundleError,
            NotFoundError,
            TrajectoryReplayError,
            UnsupportedError,
        )
        from trajectory_replay.replay import replay

        started = time.perf_counter()
        verdict = Verdict(name, ERROR)
        objects = None
        try:
            try:
                complete = self.store.backend.read(complete_key(name))
            except NotFoundError:
                raise IncompleteBundleError(f"{name}: COMPLETE is missing") from None
            verdict.digest = bundle_digest(complete)
            marker = parse_complete(complete)
            anchor = marker.anchor
            verdict.rollout_id, verdict.step_id, verdict.role = anchor.rollout_id, anchor.step_id, anchor.role
            verdict.expected_ranks = list(marker.expected_ranks)
            # taken before the replay reads anything: what changes after it changes the stamp, and the verdict
            # is not trusted for it
            state = bundle_status(self.store.backend, name)
            objects = None if state is None else object_stamps(self.store.backend, [state])[name]
            report = replay(
                native_readers(self.store, name, marker=marker), atol=self.options.atol, rtol=self.options.rtol
            )
            _judge(verdict, report)
        except IncompleteBundleError as exc:
            verdict.status, verdict.detail = INCOMPLETE, one_line(exc)
        except UnsupportedError as exc:
            verdict.status, verdict.detail = UNSUPPORTED, one_line(exc)
        except BackendError:
            raise  # the storage, not the bundle: retried, then reported
        except TrajectoryReplayError as exc:  # a digest mismatch, a missing object, a document that does not parse
            verdict.status, verdict.detail = INVALID, one_line(exc)
        verdict.seconds = time.perf_counter() - started
        return {**verdict.to_dict(), "objects": objects}


def _judge(verdict: Verdict, report) -> None:
    """Fill `verdict` from a ReplayReport: pass, unsupported (nothing compared) with why, or the first divergent
    stage and its first divergence."""
    first = next((s for s in report.stages if s.failed), None)
    if first is None:
        reason = report.unsupported_reason
        verdict.status = PASS if reason is None else UNSUPPORTED
        verdict.detail = "" if reason is None else one_line(reason)
        return
    verdict.status = DIVERGED
    verdict.first_divergent_stage, verdict.rank = str(getattr(first.stage, "value", first.stage)), first.rank
    verdict.detail = one_line(first.message)
    if first.divergences:
        d = first.divergences[0]
        verdict.sample_id, verdict.field, verdict.token_offset = d.sample_id, d.field, d.token_offset


__all__ = ["Replayer", "WORKER_MODULES", "prepare_worker"]
