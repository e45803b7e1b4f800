"""The protocol between writers and gc: what keeps an object alive before a bundle names it.

Writers take no lock and gc stops no writer, so three kinds of key under the store root carry
the whole agreement:

    .inflight/<attempt>.json   a writer's in-flight record: every digest it is about to write or
                               reuse, written before the first such write or reuse and removed
                               only after the bundle's marker exists (or when the writer gives up).
                               gc treats each listed object, ref, record and chunk as live until
                               the record is removed or passes its own TTL.
    .gc/lease-<run>            held by a sweep from before its first delete until its last:
                               {"expires", "renewed", "host", "pid"}. A heartbeat thread renews it
                               every LEASE_RENEW_SECONDS; it expires LEASE_SECONDS after the last
                               renewal, so a killed gc stalls nobody for long. A sweep deletes a
                               batch only while its own last renewal is recent (`SweepLease.check`).
    .gc/epoch-<id>             a new one is created by every sweep right after it takes its lease
                               and before its first delete (older ones are then removed).

The commit rule (`GcWatch`): a writer notes the `.gc/` keys when it starts and, just before it
writes its marker, waits while a live lease exists and looks again. If it saw any lease, or the
set of epochs changed, a sweep may have deleted something after the writer found it present, so
the writer checks that every object its bundle references exists (re-uploading what it can).
Otherwise no sweep deleted anything since the writer started, and what it found present is
still there. Any sweep that starts later reads the writer's in-flight record before deleting.

Lease times are wall-clock seconds compared across hosts: the hosts sharing a store are assumed
to keep their clocks within a few seconds of each other (NTP), well inside the margin between a
lease's expiry and the last moment its sweep may delete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trajectory_replay.backends import Backend
from trajectory_replay.errors import NotFoundError, TrajectoryReplayError
from trajectory_replay.store.digest import parse_digest
from trajectory_replay.store.layout import GC_DIR, INFLIGHT_DIR

log = logging.getLogger(__name__)

INFLIGHT_PREFIX = f"{INFLIGHT_DIR}/"
INFLIGHT_FORMAT = "trajectory-replay.inflight/1"
INFLIGHT_KEY = re.compile(re.escape(INFLIGHT_PREFIX) + r"[0-9a-f]{32}\.json")
"""The only in-flight keys gc removes: those a writer of this store names itself."""
DEFAULT_INFLIGHT_TTL = 24 * 3600.0

GC_PREFIX = f"{GC_DIR}/"
LEASE_PREFIX = f"{GC_PREFIX}lease-"
EPOCH_PREFIX = f"{GC_PREFIX}epoch-"
LEASE_KEY = re.compile(re.escape(LEASE_PREFIX) + r"[0-9a-f]{32}")
EPOCH_KEY = re.compile(re.escape(EPOCH_PREFIX) + r"[0-9a-f]{32}")
LEASE_SECONDS = 30.0
"""A lease expires this long after its last renewal."""
LEASE_RENEW_SECONDS = 5.0
LEASE_DELETE_MARGIN = 15.0
"""A sweep deletes only within this long of its last renewal: the rest of LEASE_SECONDS covers one
delete batch and the clock difference between hosts."""
WAIT_LIMIT_SECONDS = 30 * 60.0
"""A writer waits this long at most for sweeps that keep renewing their leases, then refuses to commit."""


# ---- in-flight records ----------------------------------------------------------------------------


class InflightRecord:
    """A writer's `.inflight/<attempt>.json`: every object digest it is about to write or reuse."""

    def __init__(self, backend: Backend, attempt: str, bundle: str, ttl: float = DEFAULT_INFLIGHT_TTL) -> None:
        if not re.fullmatch(r"[0-9a-f]{32}", attempt):
            raise ValueError(f"in-flight attempt id {attempt!r} is not 32 hex digits")
        self.backend, self.attempt, self.bundle, self.ttl = backend, attempt, bundle, ttl
        self.key = f"{INFLIGHT_PREFIX}{attempt}.json"
        self.created = time.time()
        self.digests: list[str] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def add(self, digests: Sequence[str]) -> None:
        """List `digests` durably before the objects they name are written or reused."""
        with self._lock:
            new = [d for d in dict.fromkeys(digests) if d not in self._seen]
            if not new:
                return
            self.digests.extend(new)
            self._seen.update(new)
            doc = {
                "format": INFLIGHT_FORMAT,
                "attempt": self.attempt,
                "bundle": self.bundle,
                "created": self.created,
                "updated": time.time(),
                "ttl_seconds": self.ttl,
                "digests": self.digests,
            }
            # visible to gc at once; a writer that crashes needs no protection, so no flush to disk
            self.backend.write(self.key, json.dumps(doc, separators=(",", ":")).encode(), durable=False)

    def remove(self) -> None:
        self.backend.delete(self.key)


@dataclass(frozen=True)
class InflightState:
    """One in-flight record as gc and readers see it."""

    key: str
    digests: tuple[str, ...]
    bundle: str | None
    expires: float

    def live(self, now: float) -> bool:
        return now <= self.expires

    @property
    def removable(self) -> bool:
        """Named the way this store's writers name their records: gc removes no other in-flight key."""
        return bool(INFLIGHT_KEY.fullmatch(self.key))


def is_inflight_key(key: str) -> bool:
    """True for a key under the in-flight directory (a writer's record, or something stored there)."""
    return key.startswith(INFLIGHT_PREFIX)


def read_inflight(backend: Backend) -> list[InflightState]:
    """Every in-flight record of the root (one removed while being read is skipped: its writer is done).

    A record that cannot be parsed names nothing gc could protect; it expires by its age alone."""
    # every record is read (a writer's record is never ignored), but gc removes only those named its own way
    keys = [k for k in backend.list(INFLIGHT_PREFIX) if k.endswith(".json")]

    def one(key: str) -> InflightState | None:
        try:
            mtime, data = backend.mtime(key), backend.read(key)
        except NotFoundError:
            return None
        try:
            doc = json.loads(data)
            if doc.get("format") != INFLIGHT_FORMAT:
                raise ValueError("unknown format")
            digests = tuple(d for d in doc.get("digests", []) if _is_digest(d))
            stamp = max(float(doc.get("created", 0)), float(doc.get("updated", 0)))
            bundle = doc.get("bundle") if isinstance(doc.get("bundle"), str) else None
            return InflightState(key, digests, bundle, stamp + float(doc["ttl_seconds"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return InflightState(key, (), None, mtime + DEFAULT_INFLIGHT_TTL)

    return [r for r in backend._map(one, keys) if r is not None]


def _is_digest(value: Any) -> bool:
    try:
        parse_digest(value)
        return True
    except TrajectoryReplayError:
        return False


# ---- the sweep lease and epoch (gc side) ------------------------------------------------------------


class LeaseLostError(TrajectoryReplayError):
    """A sweep could not renew its lease in time; it must stop deleting."""


class SweepLease:
    """`.gc/lease-<run>`, renewed by a heartbeat thread while a sweep may delete."""

    def __init__(
        self,
        backend: Backend,
        *,
        seconds: float = LEASE_SECONDS,
        renew_every: float = LEASE_RENEW_SECONDS,
        delete_margin: float = LEASE_DELETE_MARGIN,
    ) -> None:
        self.backend, self.seconds, self.renew_every = backend, seconds, renew_every
        self.delete_margin = min(delete_margin, seconds / 2)
        self.run = uuid.uuid4().hex
        self.key = f"{LEASE_PREFIX}{self.run}"
        self._renewed = 0.0  # monotonic time of the last successful write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease, start its heartbeat, then open a new epoch (so writers that started before see it)."""
        self._renew()
        self._thread = threading.Thread(target=self._heartbeat, name=f"gc-lease-{self.run[:8]}", daemon=True)
        self._thread.start()
        new_epoch = f"{EPOCH_PREFIX}{uuid.uuid4().hex}"
        self.backend.write(new_epoch, b"")
        for key in self.backend.list(EPOCH_PREFIX):
            if key != new_epoch and EPOCH_KEY.fullmatch(key):
                self.backend.delete(key)

    def check(self) -> None:
        """Raise LeaseLostError unless the lease was renewed recently enough to delete one more batch."""
        age = time.monotonic() - self._renewed
        if age > self.delete_margin:
            raise LeaseLostError(
                f"{self.backend.url}: gc lease {self.key} was last renewed {age:.0f} s ago; stopped "
                "deleting (writers may treat the sweep as dead)"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.backend.delete(self.key)
        except TrajectoryReplayError as exc:  # it expires on its own
            log.warning("%s: could not remove gc lease %s (%s)", self.backend.url, self.key, exc)

    def _renew(self) -> None:
        started = time.monotonic()
        now = time.time()
        doc = {"expires": now + self.seconds, "renewed": now, "host": socket.gethostname(), "pid": os.getpid()}
        self.backend.write(self.key, json.dumps(doc).encode(), durable=False)
        self._renewed = started  # measured from before the write: the lease may be seen from then on

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.renew_every):
            try:
                self._renew()
            except Exception as exc:  # noqa: BLE001 - a failed renewal only makes check() refuse sooner
                log.warning("%s: could not renew gc lease %s (%s)", self.backend.url, self.key, exc)

    def __enter__(self) -> SweepLease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


DEAD_LEASE_AGE = 5.0
"""A lease expired this long ago is removed by the next sweep (the margin covers clock differences)."""


def remove_dead_leases(backend: Backend, older_than: float = DEAD_LEASE_AGE) -> list[str]:
    """Remove leases that expired more than `older_than` seconds ago (their gc died); returns their keys.

    Call only while holding a lease of one's own: its epoch tells writers a sweep ran."""
    now, removed = time.time(), []
    for key, expires in lease_expiries(backend).items():
        if expires is not None and expires + older_than < now:
            backend.delete(key)
            removed.append(key)
    return removed


def lease_expiries(backend: Backend, keys: Sequence[str] | None = None) -> dict[str, float | None]:
    """Lease key -> expiry time (None when unreadable; a vanished lease is left out)."""
    keys = [k for k in (backend.list(LEASE_PREFIX) if keys is None else keys) if LEASE_KEY.fullmatch(k)]
    out: dict[str, float | None] = {}
    for key in keys:
        try:
            out[key] = float(json.loads(backend.read(key))["expires"])
        except NotFoundError:
            continue
        except (ValueError, KeyError, TypeError, RecursionError, TrajectoryReplayError):
            try:  # a lease being rewritten or damaged: judge it by its age
                out[key] = backend.mtime(key) + LEASE_SECONDS
            except NotFoundError:
                continue
    return out


# ---- the commit rule (writer side) ------------------------------------------------------------------


class GcWatch:
    """What a writer saw of gc when it started, and whether a sweep may have run since."""

    def __init__(self, backend: Backend, *, wait_limit: float = WAIT_LIMIT_SECONDS) -> None:
        self.backend, self.wait_limit = backend, wait_limit
        self.start_keys = self._gc_keys()

    def _gc_keys(self) -> frozenset[str]:
        return frozenset(self.backend.list(GC_PREFIX))

    def settle(self, what: str) -> bool:
        """Wait while a live sweep lease exists; True when a sweep may have deleted since the watch began.

        `what` names the waiting writer in the one line logged when it has to wait."""
        deadline = time.monotonic() + self.wait_limit
        announced = False
        while True:
            keys = self._gc_keys()
            leases = lease_expiries(self.backend, [k for k in keys if k.startswith(LEASE_PREFIX)])
            live = {k: e for k, e in leases.items() if e is None or e > time.time()}
            if not live:
                break
            if time.monotonic() > deadline:
                raise TrajectoryReplayError(
                    f"{what}: gc sweep(s) {', '.join(sorted(live))} still running after {self.wait_limit:.0f} s; "
                    "nothing was committed, write the bundle again"
                )
            if not announced:
                until = max((e for e in live.values() if e is not None), default=time.time() + LEASE_SECONDS)
                log.warning(
                    "%s: waiting for gc sweep %s to finish (its lease runs until %s unless renewed)",
                    what,
                    ", ".join(sorted(live)),
                    time.strftime("%H:%M:%S", time.localtime(until)),
                )
                announced = True
            time.sleep(0.2)
        start_leases = {k for k in self.start_keys if k.startswith(LEASE_PREFIX)}
        epochs = {k for k in keys if k.startswith(EPOCH_PREFIX)}
        start_epochs = {k for k in self.start_keys if k.startswith(EPOCH_PREFIX)}
        return bool(start_leases or leases or announced or epochs != start_epochs)


__all__ = [
    "DEFAULT_INFLIGHT_TTL",
    "GcWatch",
    "INFLIGHT_FORMAT",
    "INFLIGHT_KEY",
    "INFLIGHT_PREFIX",
    "InflightRecord",
    "InflightState",
    "LEASE_KEY",
    "LEASE_PREFIX",
    "LEASE_SECONDS",
    "LeaseLostError",
    "SweepLease",
    "is_inflight_key",
    "lease_expiries",
    "read_inflight",
    "remove_dead_leases",
]
