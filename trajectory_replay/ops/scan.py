"""`scan`: replay every complete bundle of a store root and summarize, resumably.

A scan lists the root's bundles (as `ls` does: finalizable ones are finalized on the way), replays each
complete one on its own (a step-level bundle as `replay --no-upstream` does: the rollout-level bundles are
replayed as bundles of their own) and keeps each outcome in the store as a **verdict**, a small JSON
object written create-once under

    <root>/.verdicts/<hex>     hex = BLAKE3 of {"bundle": digest of the bundle's COMPLETE marker,
                                                "replay": REPLAY_VERSION, "options": the scan's options}

The COMPLETE marker pins the bundle's documents by digest, and through them every payload, so the digest of
its bytes names the bundle's content: a bundle re-written with other content gets a new key, a new replay
version (a new package version or a change of replay semantics) or other options (`--atol`, `--rtol`) too.
Each verdict also holds the stamp of the bundle's objects (`object_stamps`: their keys, sizes and modification
times, taken before the replay) and an HMAC under this user's key (`verdict_secret`, kept outside the store). A
later scan reuses a stored verdict only when its MAC holds and the stamp still matches, and replays only the
bundles that have no such verdict (`force` replays all);
a scan that was interrupted therefore resumes where it stopped, and one run after new bundles landed
replays only them. Only outcomes that are a function of the bundle's content are kept: `pass`, `diverged`
and `unsupported`. `invalid` (a payload that does not match its digest, a missing object: `fsck
--repair-from` may mend it), `incomplete` and `error` are looked at again by every scan.

The driver writes each verdict whole as its worker answers: concurrent scans of one root by one user write
identical bytes for one key (the stored content has no names of hosts), and neither can damage the other's.
The `.verdicts/` prefix is a dot-name, which no command takes for a bundle; `gc` removes only the store's
objects and blob refs, so it keeps verdicts, and `cp` copies bundles, not verdicts (docs/scan.md).

Engines: `local` (a pool of worker processes on this machine; `workers` of them) and `ray` (one task per
bundle on a Ray cluster: `ops/scan_ray.py`). Either way a worker gets the store's URL, its storage options
and bundle names, never bundle data, and answers the verdict (the driver keeps it). The driver (this
process) never imports torch; the workers do, once each, and replay many bundles. A worker that dies while
replaying a bundle (a crash, the OOM killer) is replaced and the bundle is tried once more on a fresh worker,
then reported as `error` with the reason: a bundle is never silently dropped. A worker that cannot use the
store ends the scan with the store's error (`io`): that says nothing about any bundle.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field as dc_field
from typing import Any, Callable, Optional, Sequence

from trajectory_replay import __version__
from trajectory_replay.backends import Backend, redact_url, split_url
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS, CORRUPT, FINALIZABLE, BundleState, bundle_status, scan_bundles,
)
from trajectory_replay.cpus import free_cpus
from trajectory_replay.errors import BackendError, NoMatchingBundleError, StorageUnavailableError, UsageError
from trajectory_replay.ops.walk import open_root
from trajectory_replay.store.cache import default_cache_dir
from trajectory_replay.store.digest import hash_bytes
from trajectory_replay.store.inventory import fetch

VERDICTS_DIR = ".verdicts"
"""Top-level prefix of a store root holding scan verdicts (a dot-name: never taken for a bundle)."""
VERDICT_FORMAT = "trajectory-replay.verdict/2"
"""Version 2 holds the stamp of the bundle's objects and the scan's MAC; verdicts of version 1 are replayed."""
KEY_FILE = "scan-verdicts.key"
"""This user's key for the MAC of verdicts, in the read cache's directory (TRAJECTORY_REPLAY_CACHE_DIR)."""
SCAN_SEMANTICS = 3
"""Bumped whenever what a scan replays or how it judges changes without a package version change."""
REPLAY_VERSION = f"{__version__}+scan.{SCAN_SEMANTICS}"
"""Part of every verdict's key: a verdict of another version is not reused."""

PASS, DIVERGED, INVALID, INCOMPLETE, UNSUPPORTED, ERROR = "pass", "diverged", "invalid", "incomplete", \
    "unsupported", "error"
VERDICT_STATUSES = (PASS, DIVERGED, INVALID, INCOMPLETE, UNSUPPORTED, ERROR)
CACHEABLE = (PASS, DIVERGED, UNSUPPORTED)
"""Outcomes that depend on the bundle's content, the replay version and the options only: kept in the store."""
ENGINES = ("local", "ray")
ATTEMPTS = 2
"""Tries per bundle when its worker dies or its task fails: the first, and one retry on a fresh worker."""

TEST_DIE_ENV = "TRAJECTORY_REPLAY_SCAN_TEST_DIE"
"""Test hook: a bundle name; a worker about to replay that bundle leaves with os._exit(17), as a worker
killed mid-replay would. Read by the driver and handed to the workers with their task (so it reaches Ray
workers too); never set it outside tests."""
TEST_SLEEP_ENV = "TRAJECTORY_REPLAY_SCAN_TEST_SLEEP"
"""Test hook: seconds a worker sleeps before each bundle (to interrupt a scan mid-run); never set it outside
tests."""


# ---- options, keys, verdicts ------------------------------------------------------------------------

@dataclass(frozen=True)
class ScanOptions:
    """What a replay is asked for beyond the bundle itself; part of every verdict's key."""

    atol: Optional[float] = None
    rtol: Optional[float] = None

    def key(self) -> dict[str, Any]:
        return {"atol": self.atol, "rtol": self.rtol}


@dataclass(frozen=True)
class Hooks:
    """Test hooks (TEST_DIE_ENV, TEST_SLEEP_ENV), read once by the driver."""

    die_on: Optional[str] = None
    sleep: float = 0.0

    @classmethod
    def from_env(cls) -> "Hooks":
        try:
            sleep = float(os.environ.get(TEST_SLEEP_ENV) or 0.0)
        except ValueError:
            sleep = 0.0
        return cls(os.environ.get(TEST_DIE_ENV) or None, sleep)


def bundle_digest(complete: bytes) -> str:
    """The digest that names a bundle's content: of its final COMPLETE marker's bytes."""
    return hash_bytes(complete)


def verdict_key(digest: str, options: ScanOptions, version: str = REPLAY_VERSION) -> str:
    """Where the verdict of the bundle whose COMPLETE hashes to `digest` is kept."""
    identity = json.dumps({"bundle": digest, "replay": version, "options": options.key()}, sort_keys=True,
                          separators=(",", ":"))
    return f"{VERDICTS_DIR}/{hash_bytes(identity.encode()).split(':', 1)[1]}"


@dataclass
class Verdict:
    """The outcome of one bundle."""

    name: str
    status: str
    """pass | diverged | invalid | incomplete | unsupported | error"""
    rollout_id: Optional[int] = None
    step_id: Optional[int] = None
    digest: Optional[str] = None
    """Digest of the COMPLETE marker replayed (None when there is none)."""
    first_divergent_stage: Optional[str] = None
    rank: Optional[int] = None
    """Rank of the first divergent stage, where it ran per rank."""
    sample_id: Optional[str] = None
    field: Optional[str] = None
    token_offset: Optional[int] = None
    detail: str = ""
    missing_ranks: list[int] = dc_field(default_factory=list)
    expected_ranks: list[int] = dc_field(default_factory=list)
    cached: bool = False
    """Read from the store, not replayed by this scan."""
    attempts: int = 0
    seconds: float = 0.0

    @property
    def anchor(self) -> Optional[str]:
        if self.rollout_id is None:
            return None
        return f"step {self.rollout_id}:{self.step_id}" if self.step_id is not None else f"rollout {self.rollout_id}"

    @property
    def order(self) -> tuple:
        """Anchor order: by rollout, a rollout-level bundle before the steps of its rollout, then by name;
        bundles whose anchor cannot be read last."""
        if self.rollout_id is None:
            return (1, 0, 0, self.name)
        return (0, self.rollout_id, -1 if self.step_id is None else self.step_id, self.name)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["anchor"] = self.anchor
        return out

    def outcome(self) -> dict[str, Any]:
        """What a stored verdict keeps: the outcome, without names, times or hosts (identical for every scan)."""
        return {k: getattr(self, k) for k in ("status", "first_divergent_stage", "rank", "sample_id", "field",
                                               "token_offset", "detail")}


def verdict_secret() -> bytes:
    """This user's key for the MAC of verdicts: 32 random bytes in KEY_FILE, made (mode 0600) by the first scan.
    OSError when it can neither be read nor made."""
    path = default_cache_dir() / KEY_FILE
    try:
        secret = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{KEY_FILE}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(32))
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)   # whole or absent, and the first of concurrent scans wins
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
        secret = path.read_bytes()
    if len(secret) < 16:
        raise OSError(f"{path}: too short for a key (remove it: the next scan makes a new one)")
    return secret


def _mac(secret: bytes, document: dict[str, Any]) -> str:
    body = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def verdict_document(verdict: Verdict, options: ScanOptions, objects: str, secret: bytes) -> bytes:
    """A stored verdict: the outcome, what it was reached for (bundle, replay version, options, the stamp of the
    bundle's objects), and the MAC of all that under this user's key."""
    document = {"format": VERDICT_FORMAT, "bundle": verdict.digest, "replay": REPLAY_VERSION,
                "options": options.key(), "objects": objects, "verdict": verdict.outcome()}
    return json.dumps({**document, "mac": _mac(secret, document)}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False).encode()


def parse_verdict(data: bytes, digest: str, options: ScanOptions, secret: bytes) -> Optional[tuple[dict, str]]:
    """(outcome, stamp of the bundle's objects) of a stored verdict, or None when it is not one for (digest,
    version, options) or was not written by a scan holding `secret`."""
    try:
        doc = json.loads(data)
        mac = doc.pop("mac")
        outcome = doc["verdict"]
        if (doc.get("format") != VERDICT_FORMAT or doc.get("bundle") != digest or doc.get("replay") != REPLAY_VERSION
                or doc.get("options") != options.key() or outcome.get("status") not in CACHEABLE
                or not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, doc))):
            return None
        return ({k: outcome.get(k) for k in ("status", "first_divergent_stage", "rank", "sample_id", "field",
                                             "token_offset", "detail")}, doc["objects"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def object_stamps(backend: Backend, states: Sequence[BundleState]) -> dict[str, Optional[str]]:
    """Per bundle, the stamp of every object its markers reach (records, documents, chunks): a digest of their
    keys, sizes and modification times. An object rewritten, removed or truncated changes it; None when the walk
    already finds something missing or damaged. Costs the walk's reads of the small records and one look at
    each object's size and time, never its bytes."""
    from trajectory_replay.errors import NotFoundError
    from trajectory_replay.ops.walk import Walker

    trees = Walker(backend).trees(states)
    keys = sorted({k for tree in trees.values() for k in tree.keys})

    def stamp(key: str) -> Optional[tuple[int, float]]:
        try:
            return backend.size(key), backend.mtime(key)
        except NotFoundError:
            return None

    stamps = dict(zip(keys, backend._map(stamp, keys)))
    out: dict[str, Optional[str]] = {}
    for name, tree in trees.items():
        mine = [[k, *stamps[k]] for k in sorted(tree.keys) if stamps[k] is not None]
        sound = not (tree.problems or tree.missing or tree.corrupt) and len(mine) == len(tree.keys)
        out[name] = hash_bytes(json.dumps(mine, separators=(",", ":")).encode()) if sound else None
    return out


# ---- the worker side: one bundle --------------------------------------------------------------------

class Replayer:
    """Replays bundles of one store root in a worker: the store is opened once, torch imported once."""

    def __init__(self, url: str, storage_options: dict[str, Any], options: ScanOptions) -> None:
        from trajectory_replay.store import ObjectStore

        self.url, self.options = url, options
        # every byte from the store itself: a verdict is kept in the store for every host to reuse, so it must
        # say what the store holds, not what this host's read cache holds
        self.store = ObjectStore.open(url, **{"trust_cache": False, **storage_options})

    def replay_one(self, name: str, hooks: Hooks = Hooks()) -> dict[str, Any]:
        """The verdict of bundle `name` as a dict, with the stamp of its objects (`objects`) taken before the
        replay, for the driver to keep it. Errors that say something about the bundle are verdicts; any other
        exception (the storage, a bug) is raised, for the engine to retry and then report."""
        if hooks.sleep:
            time.sleep(hooks.sleep)
        if hooks.die_on == name:  # TEST_DIE_ENV: die as a worker killed mid-replay would
            os._exit(17)
        from trajectory_replay.bundle.markers import parse_complete
        from trajectory_replay.bundle.reader import native_readers
        from trajectory_replay.errors import (
            BackendError, IncompleteBundleError, NotFoundError, TrajectoryReplayError, UnsupportedError,
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
            verdict.rollout_id, verdict.step_id = anchor.rollout_id, anchor.step_id
            verdict.expected_ranks = list(marker.expected_ranks)
            # taken before the replay reads anything: what changes after it changes the stamp, and the verdict
            # is not trusted for it
            state = bundle_status(self.store.backend, name)
            objects = None if state is None else object_stamps(self.store.backend, [state])[name]
            report = replay(native_readers(self.store, name, marker=marker), atol=self.options.atol,
                            rtol=self.options.rtol)
            _judge(verdict, report)
        except IncompleteBundleError as exc:
            verdict.status, verdict.detail = INCOMPLETE, _one_line(exc)
        except UnsupportedError as exc:
            verdict.status, verdict.detail = UNSUPPORTED, _one_line(exc)
        except BackendError:
            raise  # the storage, not the bundle: retried, then reported
        except TrajectoryReplayError as exc:  # a digest mismatch, a missing object, a document that does not parse
            verdict.status, verdict.detail = INVALID, _one_line(exc)
        verdict.seconds = time.perf_counter() - started
        return {**verdict.to_dict(), "objects": objects}


def _judge(verdict: Verdict, report) -> None:
    """Fill `verdict` from a ReplayReport: pass, unsupported (nothing compared) with why, or the first divergent
    stage and its first divergence."""
    first = next((s for s in report.stages if s.failed), None)
    if first is None:
        reason = report.unsupported_reason
        verdict.status = PASS if reason is None else UNSUPPORTED
        verdict.detail = "" if reason is None else _one_line(reason)
        return
    verdict.status = DIVERGED
    verdict.first_divergent_stage, verdict.rank = str(getattr(first.stage, "value", first.stage)), first.rank
    verdict.detail = _one_line(first.message)
    if first.divergences:
        d = first.divergences[0]
        verdict.sample_id, verdict.field, verdict.token_offset = d.sample_id, d.field, d.token_offset


def _one_line(text: Any) -> str:
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


WORKER_MODULES = ("torch", "trajectory_replay.replay.runner", "trajectory_replay.bundle.reader",
                  "trajectory_replay.store", "trajectory_replay.ops.scan")
"""What a worker needs to replay (`trajectory_replay.replay` imports its parts lazily): imported once by the local
engine's fork server, before it forks any worker."""


def _import_torch() -> None:
    """Import torch once in a worker and keep the collector from rescanning what it imported (as the CLI does)."""
    import gc

    import importlib

    for module in WORKER_MODULES:
        importlib.import_module(module)
    gc.freeze()


# ---- the local engine ------------------------------------------------------------------------------

PREFETCH = 2
"""Bundles handed to a worker ahead: one it replays, one waiting, so it never waits for the driver."""


STORAGE_ENV = ("AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_", "RELAX_REPLAY_")
"""Prefixes of the environment variables that say how to reach a store (endpoint, credentials, timeouts, cache):
handed to local workers as the driver has them now (a fork server keeps the environment it started with)."""


def storage_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV)}


def _local_worker(conn, url: str, storage_options: dict[str, Any], options: ScanOptions, hooks: Hooks,
                  env: dict[str, str], threads: int) -> None:
    """A worker process: replays the bundle names it receives, one answer per name, until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C and stops its workers
    for key in [k for k in os.environ if k.startswith(STORAGE_ENV) and k not in env]:
        del os.environ[key]
    os.environ.update(env)
    try:
        _import_torch()
        import torch

        # the workers share the CPUs: each runs its tensor operations on its own share of them (a pool of N workers
        # each running torch's default of one thread per CPU would oversubscribe them N times)
        torch.set_num_threads(threads)
        replayer = Replayer(url, storage_options, options)
    except BaseException as exc:  # no torch, a store that cannot be opened: every bundle says why
        replayer, failure = None, _one_line(f"{type(exc).__name__}: {exc}")
    while True:
        try:
            name = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if name is None:
            return
        if replayer is None:
            conn.send(("failed", name, failure))
            continue
        try:
            conn.send(("done", name, replayer.replay_one(name, hooks)))
        except StorageUnavailableError as exc:  # the store, not the bundle: the driver ends the scan with it
            conn.send(("storage", name, _one_line(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which retries, then reports
            conn.send(("failed", name, _one_line(f"{type(exc).__name__}: {exc}")))


def _context():
    """Worker processes come from a fork server that has imported torch and the replay code once: a worker
    starts in milliseconds, and nothing of the driver's threads (an S3 client's event loop) is forked."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_MODULES))
    return ctx


class _Worker:
    def __init__(self, ctx, args: tuple) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_local_worker, args=(child, *args), daemon=True)
        self.process.start()
        child.close()
        self.assigned: list[str] = []

    def send(self, name: Optional[str]) -> None:
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


def death_reason(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "its worker process stopped answering"
    if exitcode < 0:
        import signal

        try:
            return f"its worker process was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"its worker process was killed by signal {-exitcode}"
    return f"its worker process died (exit code {exitcode})"


def run_local(url: str, storage_options: dict[str, Any], names: Sequence[str], options: ScanOptions, *,
              workers: int, hooks: Hooks, on_verdict: Callable[[dict[str, Any]], None]) -> None:
    """Replay `names` on `workers` local processes; `on_verdict` gets every verdict (as a dict) as it comes.

    Each worker holds at most PREFETCH names and answers them in order, so when one dies the bundle it was
    replaying is its first unanswered name: that bundle is retried once on a fresh worker and then reported as
    an error; the others it held go back to the queue untouched. A worker that cannot use the store
    (`StorageUnavailableError`: no answer, credentials, ...) ends the scan with that error: it says nothing about
    the bundle, and the next bundles would meet it too."""
    from multiprocessing.connection import wait

    pending = list(names)
    attempts: dict[str, int] = {}
    last_failure: dict[str, str] = {}
    ctx = _context()
    args = (url, storage_options, options, hooks, storage_env(), max(1, free_cpus() // max(1, workers)))
    pool: list[_Worker] = []

    def feed(worker: _Worker) -> None:
        while pending and len(worker.assigned) < PREFETCH:
            name = pending.pop(0)
            attempts[name] = attempts.get(name, 0) + 1
            worker.send(name)

    def failed(name: str, reason: str) -> None:
        last_failure[name] = reason
        if attempts[name] < ATTEMPTS:
            pending.insert(0, name)
        else:
            on_verdict(Verdict(name, ERROR, detail=f"{reason} (tried {attempts[name]} times)",
                               attempts=attempts[name]).to_dict())

    def answer(worker: _Worker, message: tuple) -> None:
        kind, name, payload = message
        worker.assigned.remove(name)
        if kind == "storage":  # no other bundle can be judged either: the scan ends with the store's failure
            raise StorageUnavailableError(payload)
        if kind == "done":
            payload["attempts"] = attempts[name]
            on_verdict(payload)
        else:
            failed(name, payload)
        feed(worker)

    grace = 5.0
    try:
        for _ in range(min(workers, len(pending))):
            pool.append(_Worker(ctx, args))
        for worker in pool:
            feed(worker)
        while any(w.assigned for w in pool):
            waiting = {w.conn: w for w in pool if w.assigned}
            sentinels = {w.process.sentinel: w for w in pool if w.assigned}
            for ready in wait([*waiting, *sentinels]):
                worker = waiting.get(ready) or sentinels[ready]
                if worker not in pool:
                    continue
                if ready in waiting:
                    try:
                        answer(worker, worker.conn.recv())
                        continue
                    except (EOFError, OSError):
                        pass
                # the worker died: take what it answered before it went, then retry what it was replaying
                try:
                    while worker.assigned and worker.conn.poll():
                        answer(worker, worker.conn.recv())
                except (EOFError, OSError):
                    pass
                worker.process.join(5.0)
                pool.remove(worker)
                if worker.assigned:
                    culprit, *innocent = worker.assigned
                    for name in innocent:  # handed over, never started: back to the queue, no attempt spent
                        attempts[name] -= 1
                    pending[:0] = innocent
                    worker.assigned = []
                    failed(culprit, f"{death_reason(worker.process.exitcode)} while replaying it")
                worker.stop(0.1)
                if pending and len(pool) < workers:
                    fresh = _Worker(ctx, args)
                    pool.append(fresh)
                for other in pool:
                    feed(other)
    except StorageUnavailableError:
        grace = 0.1   # the other workers wait for the same store: nothing of theirs is worth waiting for
        raise
    finally:
        for worker in pool:
            worker.stop(grace)


# ---- the driver -------------------------------------------------------------------------------------

class ScanProgress:
    """Receives a scan's progress; this base class ignores it."""

    def start(self, total: int) -> None:
        """`total` bundles to judge."""

    def done(self, verdict: Verdict) -> None:
        """One bundle judged (replayed, read from its stored verdict, or not replayable)."""


class RichScanProgress(ScanProgress):
    """A rich bar on stderr: bundles done / total and the running count of divergences."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn

        self._bar = Bar(TextColumn("scan"), BarColumn(), TextColumn("{task.completed}/{task.total} bundles"),
                        TextColumn("{task.fields[diverged]} diverged"), TimeElapsedColumn(),
                        console=console or Console(stderr=True), transient=False)
        self._task = None
        self._diverged = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "RichScanProgress":
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def start(self, total: int) -> None:
        self._task = self._bar.add_task("scan", total=total, diverged=0)

    def done(self, verdict: Verdict) -> None:
        with self._lock:
            self._diverged += verdict.status == DIVERGED
            if self._task is not None:
                self._bar.update(self._task, advance=1, diverged=self._diverged)


@dataclass
class ScanReport:
    """What a scan found."""

    root: str
    engine: str
    workers: int
    replay_version: str
    options: dict[str, Any]
    verdicts: list[Verdict] = dc_field(default_factory=list)
    """Every bundle, in anchor order."""
    finalized: list[str] = dc_field(default_factory=list)
    replayed: int = 0
    cached: int = 0
    seconds: float = 0.0
    engine_start_seconds: float = 0.0
    """Time the engine took to start (Ray: connecting to or starting a cluster), included in `seconds`."""
    forced: bool = False
    unkept: list[str] = dc_field(default_factory=list)
    """'<bundle>: why' for each verdict reached but not kept in the store (a store this user cannot write)."""

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(v.status == s for v in self.verdicts) for s in VERDICT_STATUSES}

    @property
    def earliest_divergence(self) -> Optional[Verdict]:
        """The first diverged bundle in anchor order."""
        return next((v for v in self.verdicts if v.status == DIVERGED), None)

    @property
    def incomplete(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.status == INCOMPLETE]

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and all(v.status == PASS for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def status(self) -> str:
        """The `--json` status: the worst outcome."""
        counts = self.counts
        for status, shown in ((DIVERGED, "diverged"), (INVALID, "invalid"), (ERROR, "invalid"),
                              (INCOMPLETE, "incomplete"), (UNSUPPORTED, "unsupported")):
            if counts[status]:
                return shown
        return "pass"

    def problems(self) -> list[str]:
        return [f"{v.name}: {v.status}" + (f" at {v.first_divergent_stage}" if v.first_divergent_stage else "")
                + (f": {v.detail}" if v.detail and v.status != DIVERGED else "")
                for v in self.verdicts if v.status != PASS]

    def to_dict(self) -> dict[str, Any]:
        first = self.earliest_divergence
        return {"root": self.root, "engine": self.engine, "workers": self.workers,
                "replay_version": self.replay_version, "options": self.options, "bundles": len(self.verdicts),
                "counts": self.counts, "replayed": self.replayed, "cached": self.cached, "forced": self.forced,
                "earliest_divergence": None if first is None else first.to_dict(),
                "incomplete": [{"name": v.name, "anchor": v.anchor, "missing_ranks": v.missing_ranks,
                                "expected_ranks": v.expected_ranks, "detail": v.detail} for v in self.incomplete],
                "finalized": self.finalized, "seconds": round(self.seconds, 3),
                "engine_start_seconds": round(self.engine_start_seconds, 3), "unkept": self.unkept,
                "verdicts": [v.to_dict() for v in self.verdicts]}

    def render_text(self) -> str:
        counts = self.counts
        lines = [f"scan {self.root}: {len(self.verdicts)} bundle(s): "
                 + ", ".join(f"{counts[s]} {s}" for s in VERDICT_STATUSES if counts[s] or s in (PASS, DIVERGED)),
                 f"  {self.replayed} replayed, {self.cached} from stored verdicts ({self.engine} engine, "
                 f"{self.workers} worker(s), {self.seconds:.1f} s; replay {self.replay_version})"]
        first = self.earliest_divergence
        if first is not None:
            where = ", ".join(x for x in (
                f"sample {first.sample_id}" if first.sample_id else "",
                f"field {first.field}" if first.field else "",
                f"token {first.token_offset}" if first.token_offset is not None else "",
                f"rank {first.rank}" if first.rank is not None else "") if x)
            lines.append(f"earliest divergence: {first.name} ({first.anchor or 'no anchor'}) at "
                         f"{first.first_divergent_stage}" + (f": {where}" if where else ""))
        else:
            lines.append("earliest divergence: none")
        for v in self.incomplete:
            lines.append(f"incomplete: {v.name} ({v.anchor or 'no anchor'}): "
                         + (f"missing ranks {v.missing_ranks} of {v.expected_ranks}" if v.missing_ranks
                            else v.detail))
        for name in self.finalized:
            lines.append(f"{name}: finalized (every rank had landed)")
        if self.unkept:
            lines.append(f"{len(self.unkept)} verdict(s) not kept in the store (the next scan replays them again): "
                         f"{self.unkept[0]}")
        if not self.verdicts:
            return "\n".join(lines)
        rows = [("BUNDLE", "ANCHOR", "STATUS", "FIRST DIVERGENT STAGE", "SAMPLE", "FROM")]
        for v in self.verdicts:
            rows.append((v.name, v.anchor or "-", v.status, v.first_divergent_stage or "-", v.sample_id or "-",
                         "stored" if v.cached else ("replayed" if v.status in (PASS, DIVERGED, INVALID, UNSUPPORTED)
                                                    or v.attempts else "-")))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines += [f"{v.name}: {v.status}: {v.detail}" for v in self.verdicts
                  if v.status in (INVALID, ERROR, UNSUPPORTED) and v.detail]
        return "\n".join(lines)


def check_workers(workers: Optional[int]) -> int:
    """`--workers`: at least 1 (default: the CPUs free for this process now)."""
    if workers is None:
        return free_cpus()
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1")
    return workers


def scan_store(root: str | os.PathLike, *, engine: str = "local", workers: Optional[int] = None,
               ray_address: Optional[str] = None, atol: Optional[float] = None, rtol: Optional[float] = None,
               force: bool = False, progress: Optional[ScanProgress] = None,
               **storage_options: Any) -> ScanReport:
    """Replay every complete bundle under `root` that has no stored verdict (all with `force`) and summarize
    every bundle of the root (see the module docstring)."""
    started = time.perf_counter()
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    workers = check_workers(workers)
    if engine == "ray":
        from trajectory_replay.ops.scan_ray import require_ray

        require_ray()
    options = ScanOptions(atol, rtol)
    progress = progress or ScanProgress()
    url = os.fspath(root).rstrip("/") or "/"
    if split_url(url)[0] == "memory":
        raise UsageError(f"{url}: a memory:// store lives in this process only, and scan replays in worker "
                         "processes: scan a path or an s3:// URL")
    backend = open_root(url, **storage_options)
    shown = redact_url(url)
    states, finalized = _finalize_landed(backend, scan_bundles(backend))
    if not states:
        raise NoMatchingBundleError(f"{shown}: no bundles found")
    report = ScanReport(shown, engine, workers, REPLAY_VERSION, options.key(), finalized=finalized, forced=force)
    by_name: dict[str, Verdict] = {}
    todo: list[str] = []
    completes = fetch(backend, [complete_key(s.name) for s in states if s.status == COMPLETE_STATUS])
    for state in states:
        verdict = _listed(state)
        by_name[state.name] = verdict
        if state.status == COMPLETE_STATUS:
            data = completes.get(complete_key(state.name))
            if data is None:
                verdict.status, verdict.detail = INCOMPLETE, "COMPLETE disappeared while the scan listed the root"
                continue
            verdict.digest = bundle_digest(data)
            todo.append(state.name)
    try:
        secret: bytes | str = verdict_secret()
    except OSError as exc:  # no key: no verdict can be trusted or kept, every bundle is replayed
        secret = f"no key for verdicts: {_one_line(exc)}"
    if not force and todo and isinstance(secret, bytes):
        todo = _reuse_verdicts(backend, {s.name: s for s in states}, todo, by_name, options, secret)
    progress.start(len(states))
    for verdict in by_name.values():
        if verdict.name not in todo:
            progress.done(verdict)
    report.cached = sum(v.cached for v in by_name.values())
    lock = threading.Lock()

    def on_verdict(result: dict[str, Any]) -> None:
        unkept = _keep(backend, result, options, secret)
        with lock:
            old = by_name[result["name"]]
            new = Verdict(**{k: result[k] for k in Verdict.__dataclass_fields__ if k in result})
            if new.rollout_id is None:  # an error or an early failure: the listing knows the anchor
                new.rollout_id, new.step_id = old.rollout_id, old.step_id
            new.digest = new.digest or old.digest
            new.expected_ranks = new.expected_ranks or old.expected_ranks
            by_name[new.name] = new
            report.replayed += 1
            if unkept:
                report.unkept.append(f"{new.name}: {unkept}")
        progress.done(new)

    if todo:
        hooks = Hooks.from_env()
        if engine == "local":
            run_local(url, storage_options, todo, options, workers=workers, hooks=hooks, on_verdict=on_verdict)
        else:
            from trajectory_replay.ops.scan_ray import run_ray

            report.engine_start_seconds = run_ray(url, storage_options, todo, options, workers=workers,
                                                  address=ray_address, hooks=hooks, on_verdict=on_verdict)
        missing = [n for n in todo if by_name[n].status == ERROR and not by_name[n].attempts]
        for name in missing:  # never expected: an engine that lost a bundle says so rather than dropping it
            by_name[name].detail = by_name[name].detail or "the engine returned no verdict for it"
    report.verdicts = sorted(by_name.values(), key=lambda v: v.order)
    report.seconds = time.perf_counter() - started
    return report


def _reuse_verdicts(backend: Backend, states: dict[str, BundleState], names: list[str], by_name: dict[str, Verdict],
                    options: ScanOptions, secret: bytes) -> list[str]:
    """Fill in the stored verdicts of `names` that this user's scans wrote (their MAC holds) for the bundle's
    objects as they are now (the stamp matches); return the names still to replay."""
    keys = {name: verdict_key(by_name[name].digest, options) for name in names}  # type: ignore[arg-type]
    stored = fetch(backend, keys.values())
    claims = {}
    for name in names:
        data = stored.get(keys[name])
        parsed = None if data is None else parse_verdict(data, by_name[name].digest, options, secret)  # type: ignore
        if parsed is not None:
            claims[name] = parsed
    stamps = object_stamps(backend, [states[name] for name in claims]) if claims else {}
    remaining = []
    for name in names:
        if name not in claims or stamps.get(name) is None or stamps[name] != claims[name][1]:
            remaining.append(name)
            continue
        verdict = by_name[name]
        for k, value in claims[name][0].items():
            setattr(verdict, k, value)
        verdict.cached = True
    return remaining


def _keep(backend: Backend, result: dict[str, Any], options: ScanOptions, secret: bytes | str) -> Optional[str]:
    """Write the verdict of one replayed bundle to the store when it can be reused; why not, when it could not
    (`secret`: the key of verdicts, or why there is none)."""
    verdict = Verdict(**{k: result[k] for k in Verdict.__dataclass_fields__ if k in result})
    if verdict.status not in CACHEABLE or verdict.digest is None or not result.get("objects"):
        return None
    if isinstance(secret, str):
        return secret
    try:
        # a whole-value replace, not flushed to disk: a verdict is a cache, and the fsync of every verdict
        # serialized a local scan on the file system's journal (see docs/scan.md)
        backend.write(verdict_key(verdict.digest, options),
                      verdict_document(verdict, options, result["objects"], secret), durable=False)
    except (BackendError, OSError) as exc:  # a store this user may read but not write: still a verdict
        if isinstance(exc, StorageUnavailableError) and getattr(exc, "transient", False):
            raise   # no answer: the scan ends with it, as when a worker meets it
        return _one_line(exc)
    return None


def _finalize_landed(backend: Backend, states: list[BundleState]) -> tuple[list[BundleState], list[str]]:
    from trajectory_replay.ops.ls import finalize_landed

    return finalize_landed(backend, states)


def _listed(state: BundleState) -> Verdict:
    """A bundle's verdict from its listing alone: complete ones are to be replayed (status `error` until then)."""
    anchor = state.anchor
    verdict = Verdict(state.name, ERROR, rollout_id=anchor.rollout_id if anchor else None,
                      step_id=anchor.step_id if anchor else None, expected_ranks=list(state.expected_ranks),
                      missing_ranks=list(state.missing_ranks))
    if state.status == CORRUPT:
        verdict.status, verdict.detail = INVALID, _one_line(state.detail)
    elif state.status == FINALIZABLE:  # every rank landed, but COMPLETE could not be written here
        verdict.status, verdict.detail = INCOMPLETE, _one_line(state.detail)
    elif state.status != COMPLETE_STATUS:
        verdict.status, verdict.detail = INCOMPLETE, _one_line(state.detail)
    return verdict


__all__ = [
    "ATTEMPTS", "CACHEABLE", "ENGINES", "REPLAY_VERSION", "Replayer", "RichScanProgress", "SCAN_SEMANTICS",
    "ScanOptions", "ScanProgress", "ScanReport", "TEST_DIE_ENV", "TEST_SLEEP_ENV", "VERDICTS_DIR",
    "VERDICT_STATUSES", "Verdict", "bundle_digest", "check_workers", "run_local", "scan_store", "verdict_key",
]
