"""`scan`: replay every complete bundle of a store root and summarize, resumably (the driver).

A scan lists the root's bundles (as `ls` does: finalizable ones are finalized on the way), replays each
complete one on its own (a step-level bundle as `replay --no-upstream` does: the rollout-level bundles are
replayed as bundles of their own) and keeps each outcome in the store as a verdict (`verdicts.py`). A scan
reuses the stored verdicts it can trust and replays only the bundles that have none (`force` replays all); a
scan that was interrupted therefore resumes where it stopped, and one run after new bundles landed replays only
them.

The driver (this process) picks the engine (`local` or `ray`, `engine.py`), never imports torch, and writes each
verdict whole as its worker answers: concurrent scans of one root by one user write identical bytes for one key,
and neither can damage the other's. `gc` removes only the store's objects and blob refs, so it keeps verdicts, and
`cp` copies bundles, not verdicts (docs/scan.md).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from trajectory_replay.backends import Backend, redact_url, split_url
from trajectory_replay.bundle.anchor import ACTOR
from trajectory_replay.bundle.markers import complete_key, read_triggers
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    BundleState,
    finalize_landed,
    scan_bundles,
)
from trajectory_replay.cpus import free_cpus
from trajectory_replay.errors import BackendError, NoMatchingBundleError, StorageUnavailableError, UsageError
from trajectory_replay.ops.scan.engine import Engine, ScanJob
from trajectory_replay.ops.scan.local import LocalEngine
from trajectory_replay.ops.scan.progress import ScanProgress
from trajectory_replay.ops.scan.replayer import Replayer
from trajectory_replay.ops.scan.report import ScanReport
from trajectory_replay.ops.scan.verdicts import (
    CACHEABLE,
    ERROR,
    INCOMPLETE,
    INVALID,
    REPLAY_VERSION,
    ScanOptions,
    Verdict,
    bundle_digest,
    object_stamps,
    one_line,
    parse_verdict,
    verdict_document,
    verdict_key,
    verdict_secret,
)
from trajectory_replay.ops.walk import Walker, open_root
from trajectory_replay.store.inventory import fetch

ENGINES = ("local", "ray")


def check_workers(workers: int | None) -> int:
    """`--workers`: at least 1 (default: the CPUs free for this process now)."""
    if workers is None:
        return free_cpus()
    if workers < 1:
        raise UsageError(f"--workers {workers}: must be at least 1")
    return workers


def scan_store(
    root: str | os.PathLike,
    *,
    engine: str = "local",
    workers: int | None = None,
    ray_address: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    force: bool = False,
    progress: ScanProgress | None = None,
    replayer: type[Replayer] = Replayer,
    **storage_options: Any,
) -> ScanReport:
    """Replay every complete bundle under `root` that has no stored verdict (all with `force`) and summarize
    every bundle of the root (see the module docstring). `replayer`: the class each worker replays bundles with
    (`Replayer` or a subclass, importable by the workers)."""
    started = time.perf_counter()
    check_engine(engine)
    workers = check_workers(workers)
    runner = _engine(engine, workers, ray_address)
    options = ScanOptions(atol, rtol)
    progress = progress or ScanProgress()
    url = os.fspath(root).rstrip("/") or "/"
    if split_url(url)[0] == "memory":
        raise UsageError(
            f"{url}: a memory:// store lives in this process only, and scan replays in worker "
            "processes: scan a path or an s3:// URL"
        )
    backend = open_root(url, **storage_options)
    shown = redact_url(url)
    states, finalized = finalize_landed(backend, scan_bundles(backend))
    if not states:
        raise NoMatchingBundleError(f"{shown}: no bundles found")
    report = ScanReport(shown, engine, workers, REPLAY_VERSION, options.key(), finalized=finalized, forced=force)
    by_name, todo = _listed_all(backend, states)
    secret = _secret()
    if not force and todo and isinstance(secret, bytes):
        todo = _reuse_verdicts(backend, {s.name: s for s in states}, todo, by_name, options, secret)
    progress.start(len(states))
    replaying = set(todo)
    for verdict in by_name.values():
        if verdict.name not in replaying:
            progress.done(verdict)
    report.cached = sum(v.cached for v in by_name.values())
    if todo:
        collect = _Collector(backend, options, secret, by_name, report, progress)
        report.engine_start_seconds = runner.run(ScanJob(url, storage_options, options, replayer), todo, collect)
        for name in todo:  # never expected: an engine that lost a bundle says so rather than dropping it
            if by_name[name].status == ERROR and not by_name[name].attempts:
                by_name[name].detail = by_name[name].detail or "the engine returned no verdict for it"
    report.verdicts = sorted(by_name.values(), key=lambda v: v.order)
    triggers, unreadable = read_triggers(backend)
    if triggers or unreadable:  # a flight recorder's store: which trigger kept each bundle (its manifest says)
        report.triggers = [t.model_dump(mode="json") for t in triggers]
        report.unreadable_triggers = unreadable
        trees = Walker(backend).trees([s for s in states if s.status == COMPLETE_STATUS])
        report.kept_by = {n: t.trigger.model_dump(mode="json") for n, t in trees.items() if t.trigger is not None}
    report.seconds = time.perf_counter() - started
    return report


def check_engine(engine: str) -> None:
    """UsageError unless `engine` names one of ENGINES."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: expected {' or '.join(ENGINES)}")


def _engine(engine: str, workers: int, ray_address: str | None) -> Engine:
    """The engine named `engine`, one of ENGINES (UsageError for `ray` where ray is not installed)."""
    if engine == "ray":
        from trajectory_replay.ops.scan.ray_engine import RayEngine, require_ray

        require_ray()
        return RayEngine(workers, ray_address)
    return LocalEngine(workers)


def _secret() -> bytes | str:
    """This user's key for verdicts, or why there is none (then no verdict can be trusted or kept, and every
    bundle is replayed)."""
    try:
        return verdict_secret()
    except OSError as exc:
        return f"no key for verdicts: {one_line(exc)}"


def _listed_all(backend: Backend, states: list[BundleState]) -> tuple[dict[str, Verdict], list[str]]:
    """Every bundle's verdict from the listing, and the names of the complete ones (to replay, or to find a stored
    verdict for), each with the digest of its COMPLETE."""
    by_name: dict[str, Verdict] = {}
    todo: list[str] = []
    completes = fetch(backend, [complete_key(s.name) for s in states if s.status == COMPLETE_STATUS])
    for state in states:
        verdict = by_name[state.name] = _listed(state)
        if state.status == COMPLETE_STATUS:
            data = completes.get(complete_key(state.name))
            if data is None:
                verdict.status, verdict.detail = INCOMPLETE, "COMPLETE disappeared while the scan listed the root"
                continue
            verdict.digest = bundle_digest(data)
            todo.append(state.name)
    return by_name, todo


class _Collector:
    """Takes each verdict an engine answers: keeps it in the store where it can be reused, puts it in the place of
    the listed one (with what the listing knew and the answer does not), counts it and shows it."""

    def __init__(
        self,
        backend: Backend,
        options: ScanOptions,
        secret: bytes | str,
        by_name: dict[str, Verdict],
        report: ScanReport,
        progress: ScanProgress,
    ) -> None:
        self.backend, self.options, self.secret = backend, options, secret
        self.by_name, self.report, self.progress = by_name, report, progress
        self.lock = threading.Lock()

    def __call__(self, result: dict[str, Any]) -> None:
        unkept = _keep(self.backend, result, self.options, self.secret)
        with self.lock:
            old = self.by_name[result["name"]]
            new = Verdict.from_dict(result)
            if new.rollout_id is None:  # an error or an early failure: the listing knows the anchor
                new.rollout_id, new.step_id, new.role = old.rollout_id, old.step_id, old.role
            new.digest = new.digest or old.digest
            new.expected_ranks = new.expected_ranks or old.expected_ranks
            self.by_name[new.name] = new
            self.report.replayed += 1
            if unkept:
                self.report.unkept.append(f"{new.name}: {unkept}")
        self.progress.done(new)


def _reuse_verdicts(
    backend: Backend,
    states: dict[str, BundleState],
    names: list[str],
    by_name: dict[str, Verdict],
    options: ScanOptions,
    secret: bytes,
) -> list[str]:
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


def _keep(backend: Backend, result: dict[str, Any], options: ScanOptions, secret: bytes | str) -> str | None:
    """Write the verdict of one replayed bundle to the store when it can be reused; why not, when it could not
    (`secret`: the key of verdicts, or why there is none)."""
    verdict = Verdict.from_dict(result)
    if verdict.status not in CACHEABLE or verdict.digest is None or not result.get("objects"):
        return None
    if isinstance(secret, str):
        return secret
    try:
        # a whole-value replace, not flushed to disk: a verdict is a cache, and the fsync of every verdict
        # serialized a local scan on the file system's journal (see docs/scan.md)
        backend.write(
            verdict_key(verdict.digest, options),
            verdict_document(verdict, options, result["objects"], secret),
            durable=False,
        )
    except (BackendError, OSError) as exc:  # a store this user may read but not write: still a verdict
        if isinstance(exc, StorageUnavailableError) and getattr(exc, "transient", False):
            raise  # no answer: the scan ends with it, as when a worker meets it
        return one_line(exc)
    return None


def _listed(state: BundleState) -> Verdict:
    """A bundle's verdict from its listing alone: complete ones are to be replayed (status `error` until then)."""
    anchor = state.anchor
    verdict = Verdict(
        state.name,
        ERROR,
        rollout_id=anchor.rollout_id if anchor else None,
        step_id=anchor.step_id if anchor else None,
        role=anchor.role if anchor else ACTOR,
        expected_ranks=list(state.expected_ranks),
        missing_ranks=list(state.missing_ranks),
    )
    if state.status == CORRUPT:
        verdict.status, verdict.detail = INVALID, one_line(state.detail)
    elif state.status == FINALIZABLE:  # every rank landed, but COMPLETE could not be written here
        verdict.status, verdict.detail = INCOMPLETE, one_line(state.detail)
    elif state.status != COMPLETE_STATUS:
        verdict.status, verdict.detail = INCOMPLETE, one_line(state.detail)
    return verdict


__all__ = ["ENGINES", "check_engine", "check_workers", "scan_store"]
