"""The storage interface every layer above speaks: keys are validated relative paths under a root.

Modelled on zarr's store ABC: a small set of operations, capabilities declared as values that
callers check, and the guarantee of each method written next to it. Subclasses implement the
`_`-prefixed primitives; the public methods validate keys, count bytes and requests (the
benchmarks count every byte fetched at this layer) and translate "not found" uniformly.
"""

from __future__ import annotations

import builtins
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from trajectory_replay.backends.probe import ProbeResult, run_probe
from trajectory_replay.cpus import on_one_core
from trajectory_replay.errors import BackendError, InvalidKeyError, ValueTooLargeError

log = logging.getLogger(__name__)


_PROBES: dict[tuple[Any, ...], ProbeResult] = {}
_PROBE_LOCK = threading.Lock()

PROBE_RETRY_FIRST = 0.5
PROBE_RETRY_MAX = 8.0
"""Backoff (seconds) before a probe that could not reach its target runs again: doubling from the first to the max."""
PROBE_PATIENCE = 10.0
"""How long `require_atomic_create` keeps retrying a probe that could not reach its target before it gives up."""

BytesLike = bytes | bytearray | memoryview
"""What a write accepts: any contiguous bytes (a view of a larger buffer is written without a copy where it can be)."""

_T = TypeVar("_T")
_R = TypeVar("_R")


class WorkerPool:
    """A long-lived thread pool created on first use (one per backend or store, not one per call).

    Runs a single item inline; falls back to running inline when the interpreter is shutting down
    (flushes at exit still complete) and starts afresh in a forked child, which inherits no threads.
    A pool of `cpu_work` (local reads, hashing) runs inline under `cpus.one_core_for_cpu_work`."""

    def __init__(self, max_workers: int, cpu_work: bool = False) -> None:
        self.max_workers = max_workers
        self.cpu_work = cpu_work
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """`[fn(item) for item in items]`, concurrently, in order."""
        if len(items) <= 1 or self.max_workers <= 1 or (self.cpu_work and on_one_core()):
            return [fn(item) for item in items]
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="trajectory-replay-io")
                self._pid = os.getpid()
            pool = self._pool
        try:
            return list(pool.map(fn, items))
        except RuntimeError as exc:  # "cannot schedule new futures after interpreter shutdown"
            if "shutdown" not in str(exc):
                raise
            return [fn(item) for item in items]


def validate_key(key: str) -> str:
    """Return `key` if it is a clean relative path, else raise InvalidKeyError saying what is wrong."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}: must be a non-empty string")
    if key.startswith("/") or key.startswith("\\") or (len(key) > 1 and key[1] == ":"):
        raise InvalidKeyError(f"invalid key {key!r}: must be relative, not absolute")
    if "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"invalid key {key!r}: backslashes and NUL are not allowed")
    for part in key.split("/"):
        if part == "":
            raise InvalidKeyError(f"invalid key {key!r}: empty path segment")
        if part in (".", ".."):
            raise InvalidKeyError(f"invalid key {key!r}: '{part}' segments are not allowed")
    return key


def validate_prefix(prefix: str) -> str:
    """A listing prefix: empty (the whole root) or a valid key, optionally ending in '/'."""
    if prefix == "":
        return prefix
    validate_key(prefix.rstrip("/"))
    return prefix


@dataclass(frozen=True)
class ByteRange:
    """A request for bytes [start, end) of one key."""

    key: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start <= self.end):
            raise InvalidKeyError(f"invalid byte range [{self.start}, {self.end}) of {self.key!r}")


CREATED, SAME, DIFFERENT = "created", "same", "different"
"""Outcomes of `Backend.create_status`."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees. Callers check these instead of guessing from exceptions."""

    atomic_create: bool
    """create_if_absent is atomic against concurrent writers (still confirm with `probe()`)."""
    ranged_reads: bool
    listing: bool
    deletes: bool
    remote: bool
    """Reads cross a network: the object store serves them through its local cache."""


@dataclass
class IOStats:
    """Bytes and requests that crossed this backend, for benchmarks and tests."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def count_write(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n
            self.writes += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes_read = self.bytes_written = self.reads = self.writes = 0


class KeyStat(NamedTuple):
    """A stored value's size and age, as `Backend.stat` finds them together."""

    size: int
    mtime: float
    """Last modification time, POSIX seconds."""


def raise_too_large(url: str, key: str, limit: int, size: int | None = None) -> None:
    """Refuse the value at `key` for being over the `limit` its reader allows (`size`: its size, when known)."""
    held = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    raise ValueTooLargeError(f"{url}: {key!r} holds {held}, over the {limit}-byte bound for what is stored there")


class Backend(ABC):
    """A root prefix on one storage system. Thread-safe; keys are '/'-separated relative paths."""

    capabilities: Capabilities
    url: str
    max_workers: int = 8

    def __init__(self) -> None:
        self.stats = IOStats()
        self.pool = WorkerPool(self.max_workers, cpu_work=self.reads_are_cpu_work)
        self._probe: ProbeResult | None = None
        self._probe_lock = threading.Lock()
        self._probe_delay = 0.0
        self._probe_retry_at = 0.0

    @property
    def reads_are_cpu_work(self) -> bool:
        """True when a read costs CPU time rather than waiting on a server (local files, memory)."""
        return not self.capabilities.remote

    # ---- primitives (subclasses) -------------------------------------------------------------
    @abstractmethod
    def _read(self, key: str) -> bytes: ...

    @abstractmethod
    def _read_range(self, key: str, start: int, end: int) -> bytes: ...

    @abstractmethod
    def _write(self, key: str, data: BytesLike, durable: bool = True) -> None: ...

    @abstractmethod
    def _create(self, key: str, data: BytesLike) -> bool:
        """Store `data` at `key` only if nothing is there; True if this call created it."""

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _size(self, key: str) -> int: ...

    @abstractmethod
    def _mtime(self, key: str) -> float: ...

    def _size_and_mtime(self, key: str) -> KeyStat:
        """Both in one request where the backend can (subclasses that can override this)."""
        return KeyStat(self._size(key), self._mtime(key))

    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _list_dir(self, prefix: str) -> list[str]: ...

    # ---- public API ----------------------------------------------------------------------------
    def read(self, key: str, limit: int | None = None) -> bytes:
        """The whole value at `key`; NotFoundError if absent. With `limit`, a value larger than `limit` bytes is
        refused (ValueTooLargeError naming the key and the bound) having read no more than `limit` + 1 bytes of it:
        a reader that knows how large a value can be passes that bound, so hostile content costs nothing."""
        key = validate_key(key)
        data = self._read(key) if limit is None else self._read_limited(key, limit)
        self.stats.count_read(len(data))
        if limit is not None and len(data) > limit:
            raise_too_large(self.url, key, limit)
        return data

    def _read_limited(self, key: str, limit: int) -> bytes:
        """The value at `key`, or its first `limit` + 1 bytes when it is larger (backends that know a value's size
        before reading it refuse one over `limit` from the size alone)."""
        if not self.capabilities.ranged_reads:
            return self._read(key)
        try:
            return self._read_range(key, 0, limit + 1)
        except OSError:
            # an object store refuses every range of an empty value (416): that one case is asked by size
            if not self.capabilities.remote or self._size(key) != 0:
                raise
            return b""

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `key` (end exclusive; clipped at the value's end)."""
        ByteRange(key, start, end)
        if start == end:
            return b""
        data = self._read_range(validate_key(key), start, end)
        self.stats.count_read(len(data))
        return data

    def read_into(self, key: str, target: memoryview) -> int:
        """Read the value at `key` into `target` (at most len(target) bytes); returns the value's size.

        A value larger than `target` is an error (NotFoundError if absent); backends that can read
        straight into memory do so without an intermediate copy."""
        size = self._read_into(validate_key(key), target)
        self.stats.count_read(min(size, len(target)))
        return size

    def _read_into(self, key: str, target: memoryview) -> int:
        data = self._read(key)
        if len(data) <= len(target):
            target[: len(data)] = data
        return len(data)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of several keys, fetched concurrently, in the order given. NotFoundError if any is absent."""
        for key in keys:
            validate_key(key)
        return self._map(self.read, keys)

    def read_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Several byte ranges fetched concurrently, in the order given."""
        return self._map(lambda r: self.read_range(r.key, r.start, r.end), ranges)

    def write(self, key: str, data: BytesLike, *, durable: bool = True) -> None:
        """Store `data` at `key`, replacing any value. Atomic: a reader sees the old value or all of the new one.

        `durable=False` skips flushing to stable storage where a backend would (local disks): for
        bookkeeping that only other live processes need to see, such as in-flight records."""
        self._write(validate_key(key), data, durable)
        self.stats.count_write(len(data))

    def create_if_absent(self, key: str, data: BytesLike) -> bool:
        """Create-once. True when `key` now holds exactly `data` and held nothing else before (a retry, or a
        concurrent writer of identical bytes, also gets True); False when different bytes were there.
        Among concurrent writers of different bytes exactly one gets True, provided the backend's
        `probe()` passed (see `require_atomic_create`)."""
        return self.create_status(key, data) != DIFFERENT

    def create_status(self, key: str, data: BytesLike) -> str:
        """`create_if_absent` with the outcome spelled out: CREATED (this call stored `data`), SAME (`key`
        already held exactly `data`), or DIFFERENT (it holds other bytes; nothing was changed)."""
        validate_key(key)
        if self._create(key, data):
            self.stats.count_write(len(data))
            return CREATED
        try:
            existing = self.read(key)
        except KeyError:
            # deleted between the refusal and our read: a rare race with gc; try once more
            if self._create(key, data):
                self.stats.count_write(len(data))
                return CREATED
            return DIFFERENT
        return SAME if existing == bytes(data) else DIFFERENT

    def exists(self, key: str) -> bool:
        """True when `key` holds a value."""
        return self._exists(validate_key(key))

    def size(self, key: str) -> int:
        """Size in bytes of the value at `key`; NotFoundError if absent."""
        return self._size(validate_key(key))

    def mtime(self, key: str) -> float:
        """Last modification time (POSIX seconds) of `key`; NotFoundError if absent."""
        return self._mtime(validate_key(key))

    def stat(self, key: str) -> KeyStat:
        """Size in bytes and last modification time of `key`, asked together (one request on local disk and S3);
        NotFoundError if absent."""
        return self._size_and_mtime(validate_key(key))

    def list(self, prefix: str = "") -> list[str]:
        """All keys under `prefix` (recursively), sorted. Temporary files of in-progress writes are never listed."""
        return sorted(self._list(validate_prefix(prefix)))

    def list_dir(self, prefix: str = "") -> builtins.list[str]:
        """Names directly under `prefix` (keys and sub-prefixes, one level, no trailing '/'), sorted."""
        if prefix:
            validate_key(prefix.rstrip("/"))
        return sorted(set(self._list_dir(prefix.rstrip("/"))))

    def delete(self, key: str) -> None:
        """Remove `key` if present. Idempotent (S3 does not say whether a key existed)."""
        self._delete(validate_key(key))

    def escapes_root(self, prefix: str) -> bool:
        """True when `prefix` resolves to storage outside this root (a symbolic link on local disk).

        Object stores have no links: False."""
        return False

    def leftover_temporaries(self, older_than: float) -> builtins.list[str]:
        """Partial writes that a killed writer left behind, as paths relative to the root, last changed before
        `older_than` (a POSIX time). They are never keys: listing and reading never see them.

        Only a backend that writes through temporary files has any; an object store writes whole objects: []."""
        return []

    def remove_temporary(self, path: str) -> None:
        """Delete one path `leftover_temporaries` returned (gone already is fine)."""
        raise NotImplementedError(f"{type(self).__name__} writes no temporary files")

    def child(self, prefix: str) -> Backend:
        """A backend rooted at `prefix` under this one (same storage, same options)."""
        raise NotImplementedError

    # ---- create-once safety --------------------------------------------------------------------
    def probe(self) -> ProbeResult:
        """Self-test on the real target: sequential and concurrent create_if_absent of different bytes.

        A pass is remembered for every backend of the same scope, a failure the target answered (it does not
        honor create-once) for this backend. A probe that could not reach the target (`transient`) runs again
        once a backoff has passed (PROBE_RETRY_FIRST, doubling up to PROBE_RETRY_MAX); until then this returns
        that result without a request, so an outage is not met with a probe per caller."""
        with self._probe_lock:
            last = self._probe
            if last is not None and not (last.transient and time.monotonic() >= self._probe_retry_at):
                return last
            scope = self.probe_scope()
            with _PROBE_LOCK:
                cached = _PROBES.get(scope)
            result = cached or run_probe(self)
            if result.ok:  # a failure is never shared: the next backend probes for itself
                with _PROBE_LOCK:
                    _PROBES[scope] = result
            if result.transient:
                self._probe_delay = min(PROBE_RETRY_MAX, 2 * self._probe_delay or PROBE_RETRY_FIRST)
                self._probe_retry_at = time.monotonic() + self._probe_delay
                log.warning(
                    "%s: create-once self-test could not reach the target (%s); retrying in %.1fs",
                    self.url,
                    result.detail,
                    self._probe_delay,
                )
            else:
                self._probe_delay = 0.0
            self._probe = result
            return result

    def transient_error(self, exc: BaseException) -> bool:
        """True when `exc` says the target could not be reached or could not answer just now (a lost
        connection, a timeout), not that it refused something: worth retrying later."""
        return isinstance(exc, (ConnectionError, TimeoutError))

    def probe_scope(self) -> tuple[Any, ...]:
        """What a probe result holds for: this root by default (S3: the endpoint and bucket)."""
        return (type(self).__name__, self.url)

    def require_atomic_create(self, *, unsafe: bool = False, patience: float = PROBE_PATIENCE) -> None:
        """Raise BackendError unless create-once markers can be trusted here; `unsafe=True` downgrades to a logged
        warning.

        A probe that could not reach the target is retried, with its backoff, for up to `patience` seconds:
        a writer whose data just went through should not lose its bundle to a brief outage."""
        deadline = time.monotonic() + patience
        result = (
            self.probe()
            if self.capabilities.atomic_create
            else ProbeResult(False, {"declared": False}, "backend does not declare atomic create")
        )
        while result.transient and not unsafe:
            wait = max(0.0, self._probe_retry_at - time.monotonic())
            if time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
            result = self.probe()
        if result.ok:
            return
        if result.transient:
            message = f"{self.url}: could not check that create-if-absent is atomic here ({result.detail})"
            refusal = "; nothing was marked complete (the check is retried once the target answers)"
        else:
            message = f"{self.url}: create-if-absent is not atomic on this target ({result.detail})"
            refusal = "; refusing to write completion markers (pass the unsafe override to force)"
        if unsafe:
            log.warning("%s; continuing because the unsafe override was given", message)
            return
        raise BackendError(message + refusal)

    # ---- helpers -------------------------------------------------------------------------------
    def _map(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> builtins.list[_R]:
        return self.pool.map(fn, items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
