"""`scan --engine local`: a pool of worker processes on this machine.

Workers come from a fork server that has imported torch and the replay code once (`WORKER_MODULES`): a worker
starts in milliseconds, and nothing of the driver's threads (an S3 client's event loop) is forked. Each worker
replays the bundle names it receives, one answer per name, holding at most PREFETCH of them, and answers them in
order; so when one dies (a crash, the OOM killer) the bundle it was replaying is its first unanswered name: that
bundle is retried once on a fresh worker and then reported as `error` with the reason; the others it held go back
to the queue untouched. The driver handles Ctrl-C and stops its workers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from trajectory_replay.cpus import free_cpus
from trajectory_replay.errors import StorageUnavailableError
from trajectory_replay.ops.scan.engine import ATTEMPTS, OnVerdict, ScanJob, given_up
from trajectory_replay.ops.scan.replayer import WORKER_MODULES, Replayer, prepare_worker
from trajectory_replay.ops.scan.verdicts import one_line

PREFETCH = 2
"""Bundles handed to a worker ahead: one it replays, one waiting, so it never waits for the driver."""

STORAGE_ENV = ("AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_", "RELAX_REPLAY_")
"""Prefixes of the environment variables that say how to reach a store (endpoint, credentials, timeouts, cache):
handed to local workers as the driver has them now (a fork server keeps the environment it started with)."""


def storage_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV)}


# ---- a worker process -------------------------------------------------------------------------------


def _local_worker(conn: Connection, job: ScanJob, env: dict[str, str], threads: int) -> None:
    """A worker process: replays the bundle names it receives, one answer per name, until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C and stops its workers
    for key in [k for k in os.environ if k.startswith(STORAGE_ENV) and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    try:
        replayer: Replayer | str = _open_replayer(job, threads)
    except BaseException as exc:  # no torch, a store that cannot be opened: every bundle says why
        replayer = one_line(f"{type(exc).__name__}: {exc}")
    while True:
        try:
            name = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if name is None:
            return
        conn.send(_answer(replayer, name))


def _open_replayer(job: ScanJob, threads: int) -> Replayer:
    prepare_worker()
    import torch

    # the workers share the CPUs: each runs its tensor operations on its own share of them (a pool of N workers
    # each running torch's default of one thread per CPU would oversubscribe them N times)
    torch.set_num_threads(threads)
    return job.open()


def _answer(replayer: Replayer | str, name: str) -> tuple[str, str, Any]:
    """(kind, name, payload): ("done", name, the verdict), ("failed", name, why) or ("storage", name, the store's
    error); `replayer` is why there is none when the worker could not make one."""
    if isinstance(replayer, str):
        return "failed", name, replayer
    try:
        return "done", name, replayer.replay_one(name)
    except StorageUnavailableError as exc:  # the store, not the bundle: the driver ends the scan with it
        return "storage", name, one_line(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which retries, then reports
        return "failed", name, one_line(f"{type(exc).__name__}: {exc}")


# ---- the driver's side ------------------------------------------------------------------------------


def _context():
    """The fork server the workers come from, with the replay code imported once."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*WORKER_MODULES, __name__])
    return ctx


class _Worker:
    """One worker process, its pipe, and the names it holds, in the order it answers them."""

    def __init__(self, ctx, args: tuple) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_local_worker, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self.assigned: list[str] = []

    def send(self, name: str | None) -> None:
        self.conn.send(name)
        if name is not None:
            self.assigned.append(name)

    def stop(self, wait: float = 5.0) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(wait)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(wait)
        self.conn.close()


def death_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "its worker process stopped answering"
    if exitcode < 0:
        import signal

        try:
            return f"its worker process was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"its worker process was killed by signal {-exitcode}"
    return f"its worker process died (exit code {exitcode})"


class _Pool:
    """The workers of one scan, the names still to hand out, and the tries of each name."""

    def __init__(self, job: ScanJob, names: Sequence[str], workers: int, on_verdict: OnVerdict) -> None:
        self.pending = list(names)
        self.attempts: dict[str, int] = {}
        self.size = workers
        self.on_verdict = on_verdict
        self.ctx = _context()
        self.args = (job, storage_env(), max(1, free_cpus() // max(1, workers)))
        self.workers: list[_Worker] = []

    def run(self) -> None:
        """Hand out every name and take every answer; stop the workers whatever happens."""
        from multiprocessing.connection import wait

        grace = 5.0
        try:
            for _ in range(min(self.size, len(self.pending))):
                self.workers.append(_Worker(self.ctx, self.args))
            self._feed_all()
            while any(w.assigned for w in self.workers):
                busy = [w for w in self.workers if w.assigned]
                owners = {**{w.conn: w for w in busy}, **{w.process.sentinel: w for w in busy}}
                for ready in wait(list(owners)):
                    self._serve(owners[ready], answered=ready is owners[ready].conn)
        except StorageUnavailableError:
            grace = 0.1  # the other workers wait for the same store: nothing of theirs is worth waiting for
            raise
        finally:
            for worker in self.workers:
                worker.stop(grace)

    def _serve(self, worker: _Worker, answered: bool) -> None:
        """Take `worker`'s answer when it `answered`; when there is none (its pipe closed, or it ended), bury it."""
        if worker not in self.workers:  # buried while serving an earlier ready object of the same wait
            return
        if answered:
            try:
                self._take(worker, worker.conn.recv())
                return
            except (EOFError, OSError):
                pass
        self._bury(worker)

    def _feed(self, worker: _Worker) -> None:
        while self.pending and len(worker.assigned) < PREFETCH:
            name = self.pending.pop(0)
            self.attempts[name] = self.attempts.get(name, 0) + 1
            worker.send(name)

    def _feed_all(self) -> None:
        for worker in self.workers:
            self._feed(worker)

    def _take(self, worker: _Worker, message: tuple[str, str, Any]) -> None:
        """One answer of `worker`: a verdict, a failure (retried, then reported), or the store's failure."""
        kind, name, payload = message
        worker.assigned.remove(name)
        if kind == "storage":  # no other bundle can be judged either: the scan ends with the store's failure
            raise StorageUnavailableError(payload)
        if kind == "done":
            payload["attempts"] = self.attempts[name]
            self.on_verdict(payload)
        else:
            self._failed(name, payload)
        self._feed(worker)

    def _failed(self, name: str, reason: str) -> None:
        if self.attempts[name] < ATTEMPTS:
            self.pending.insert(0, name)
        else:
            self.on_verdict(given_up(name, reason, self.attempts[name]))

    def _bury(self, worker: _Worker) -> None:
        """`worker` died: take what it answered before it went, retry what it was replaying, hand back what it
        never started, and start a fresh worker while there is work."""
        try:
            while worker.assigned and worker.conn.poll():
                self._take(worker, worker.conn.recv())
        except (EOFError, OSError):
            pass
        worker.process.join(5.0)
        self.workers.remove(worker)
        if worker.assigned:
            culprit, *innocent = worker.assigned
            for name in innocent:  # handed over, never started: back to the queue, no attempt spent
                self.attempts[name] -= 1
            self.pending[:0] = innocent
            worker.assigned = []
            self._failed(culprit, f"{death_reason(worker.process.exitcode)} while replaying it")
        worker.stop(0.1)
        if self.pending and len(self.workers) < self.size:
            self.workers.append(_Worker(self.ctx, self.args))
        self._feed_all()


class LocalEngine:
    """`workers` processes on this machine (see the module docstring)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def run(self, job: ScanJob, names: Sequence[str], on_verdict: OnVerdict) -> float:
        """Replay `names`; `on_verdict` gets every verdict (as a dict) as it comes. Starts in no time: 0.0."""
        _Pool(job, names, self.workers, on_verdict).run()
        return 0.0


__all__ = ["LocalEngine", "PREFETCH", "STORAGE_ENV", "death_reason", "storage_env"]
