"""`scan --engine ray`: one Ray task per bundle (ray is the optional extra `trajectory-replay[ray]`).

The cluster is the one at `--ray-address` (or `RAY_ADDRESS`), else the one this process is already connected to,
else a local Ray started for the scan (with `--workers` CPUs) and stopped after it. Each task gets the scan's job
(`ScanJob`: the store's URL, its storage options) and one bundle name; the worker reads the bundle straight from the
store and answers its verdict, which the driver keeps, so no bundle data passes through the driver. A Ray worker
process keeps its opened store and its imported torch between tasks (`_REPLAYERS`), as the local engine's workers
do.

A task that raises, or whose worker process dies, is retried once by Ray (`max_retries`, `retry_exceptions`);
after that the bundle is reported as `error` with Ray's reason, never dropped. A task that cannot use the store
(`StorageUnavailableError`) ends the scan with that error, as in the local engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from trajectory_replay.errors import StorageUnavailableError, UsageError
from trajectory_replay.ops.scan.engine import ATTEMPTS, OnVerdict, ScanJob, given_up
from trajectory_replay.ops.scan.replayer import Replayer, prepare_worker
from trajectory_replay.ops.scan.verdicts import one_line

_REPLAYERS: dict[tuple, Replayer] = {}
"""Per Ray worker process: one Replayer per job identity (`ScanJob.identity`)."""


def require_ray() -> None:
    """UsageError (one line) when ray cannot be imported here."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError(
            "--engine ray needs ray, which is not installed: pip install 'trajectory-replay[ray]'"
        ) from None


def replay_task(job: ScanJob, name: str) -> dict[str, Any]:
    """The body of one Ray task: the verdict of bundle `name` (see `Replayer.replay_one`)."""
    replayer = _REPLAYERS.get(job.identity)
    if replayer is None:
        prepare_worker()
        replayer = _REPLAYERS[job.identity] = job.open()
    return replayer.replay_one(name)


_REMOTE: list = []


def _remote():
    """The Ray task (defined once per driver: every scan of this process sends the same function)."""
    if not _REMOTE:
        import ray

        _REMOTE.append(
            ray.remote(num_cpus=1, max_retries=ATTEMPTS - 1, retry_exceptions=True)(replay_task).options(
                name="trajectory-replay-scan"
            )
        )
    return _REMOTE[0]


def _connect(address: str | None, workers: int) -> bool:
    """Connect to (or start) a cluster; True when this call started one that the scan must stop."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = dict(
        include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=True
    )
    if address:
        problem = _unreachable(address)
        if problem:
            raise ConnectionError(
                f"cannot reach the Ray cluster at {address}: {problem} (check --ray-address or RAY_ADDRESS)"
            )
    try:
        if address:
            ray.init(address=address, **kwargs)
            return False
        ray.init(num_cpus=workers, **kwargs)
        return True
    except Exception as exc:  # noqa: BLE001 - Ray's own errors (ConnectionError, RuntimeError, ...) as one line
        where = f"Ray cluster at {address}" if address else "a local Ray cluster"
        raise ConnectionError(f"cannot connect to {where}: {one_line(exc)}") from None


CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a TCP connection to `--ray-address` before giving up (Ray itself waits for minutes)."""


def _unreachable(address: str) -> str | None:
    """Why nothing answers at `host:port` (or `ray://host:port`), or None (also for `auto` and other forms Ray
    resolves itself)."""
    import socket

    target = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = target.rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            return None
    except OSError as exc:
        return one_line(exc.strerror or exc) or type(exc).__name__


class RayEngine:
    """One Ray task per bundle on the cluster at `address` (see the module docstring)."""

    def __init__(self, workers: int, address: str | None) -> None:
        self.workers, self.address = workers, address

    def run(self, job: ScanJob, names: Sequence[str], on_verdict: OnVerdict) -> float:
        """Replay `names` as Ray tasks; `on_verdict` gets every verdict as it comes. Returns the seconds the
        cluster took to connect to or start."""
        require_ray()
        import ray

        started = time.perf_counter()
        stop = _connect(self.address, self.workers)
        start_seconds = time.perf_counter() - started
        try:
            task = _remote()
            refs = {task.remote(job, name): name for name in names}
            waiting = list(refs)
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=min(len(waiting), 16), timeout=0.5)
                for ref in ready:
                    on_verdict(_result(ray, ref, refs[ref], waiting))
        finally:
            if stop:
                ray.shutdown()
        return start_seconds


def _result(ray, ref, name: str, waiting: list) -> dict[str, Any]:
    """The verdict of the task `ref` (bundle `name`), or `error` when it failed on every try; a task that could
    not use the store cancels the `waiting` ones and ends the scan with the store's error."""
    try:
        result = ray.get(ref)
        result["attempts"] = result.get("attempts") or 1
        return result
    except Exception as exc:  # noqa: BLE001 - the task failed or its worker died, retries spent
        cause = getattr(exc, "cause", None)
        if isinstance(cause, StorageUnavailableError):  # the store, not the bundle
            for other in waiting:
                ray.cancel(other, force=True)
            raise StorageUnavailableError(one_line(cause)) from None
        return given_up(name, _ray_reason(exc), ATTEMPTS)


def _ray_reason(exc: BaseException) -> str:
    """Why a task failed, one line: Ray's worker-died errors say so; a task's own exception is named."""
    kind = type(exc).__name__
    if "WorkerCrashed" in kind or "ActorDied" in kind or "NodeDied" in kind or "OutOfMemory" in kind:
        return f"its Ray worker died while replaying it ({kind})"
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"its Ray task failed: {type(cause).__name__}: {one_line(cause)}"[:500]
    return f"its Ray task failed: {kind}: {one_line(exc)}"[:500]


__all__ = ["RayEngine", "replay_task", "require_ray"]
