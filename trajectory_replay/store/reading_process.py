"""Local chunk files read and verified by a helper process, into memory the two processes share.

A streamed replay reads the next block's payloads on one thread while its kernels run on another. Reading a
local store is thousands of small file reads and hashes per block, and each of those calls lets go of the
interpreter lock and takes it back. Next to a thread that takes the lock between every two torch operations, the two
threads hand it back and forth tens of thousands of times: on a two-core host a block's read took half again as
long as the same read alone, the difference spent waiting for the lock. The helper process has an interpreter of
its own: it opens, reads and hashes the chunk files of a payload straight into an arena of shared memory, and
the reading thread only waits for its answer, once per payload. The replay's tensors are made on the arena
itself (no copy); a part of the arena is written again only once no tensor refers to it any more.

`reading_process()` turns it on for the length of a `with` block (`ObjectStore.reading_ahead`, around a streamed
pass); `ObjectStore.read_joined` then reads a local store's payload rows through it (whole chunks checked against
their digests, the partial chunks at a run's edges by their blocks, each checked against its hash), and reads
exactly as before when it is off, when the store is not on local disk or has a read cache, when a payload does
not fit in the arena's free space, and after the helper failed in any way (whatever it read is read again in this
process; a helper is an optimisation, never a source of errors). Linux only (`os.memfd_create`); elsewhere reads
stay in this process.

The two processes speak in typed messages: a request is a list of `WholeChunk` and `ChunkBlocks`, the answer a
list of `ReadFailure`. On the pipe each request item travels as its kind and its fields by name (the helper is a
plain interpreter with nothing but the standard library and `blake3`: it imports nothing of this package).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, NamedTuple

log = logging.getLogger(__name__)

_CHILD = r"""
import os, sys, mmap, pickle, signal, struct
from stat import S_ISREG
signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the replay's to handle: the helper ends when its pipe does
if sys.path and sys.path[0] == "":   # nothing of the working directory may shadow what the helper imports
    del sys.path[0]
import blake3

arena = memoryview(mmap.mmap(int(sys.argv[1]), int(sys.argv[2])))
requests, answers = sys.stdin.buffer, sys.stdout.buffer
spare = bytearray(1)

def read_exactly(n):
    data = requests.read(n)
    return data if len(data) == n else None

def opened(path, read):
    # (read(fd), None) on the file at `path`, or (None, failure) for a file that is missing or cannot be read;
    # opened without blocking and read only if it is a regular file (a FIFO would block, a device never end)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None, ("missing", 0)
    except OSError as exc:
        return None, ("error", str(exc))
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            return None, ("error", "not a regular file")
        return read(fd), None
    except IsADirectoryError:
        return None, ("missing", 0)
    except OSError as exc:
        return None, ("error", str(exc))
    finally:
        os.close(fd)


def read_chunk(path, offset, size, digest):
    # a whole chunk file into the arena at `offset`, checked against its digest
    target = arena[offset:offset + size]

    def fill(fd):   # None once exactly `size` bytes were read, else the file's size
        done = 0
        while done < size:
            n = os.readv(fd, [target[done:], spare])
            if not n:
                break
            done += n
        if done == size and not os.readv(fd, [spare]):
            return None
        return os.fstat(fd).st_size

    wrong, failure = opened(path, fill)
    if failure is not None:
        return failure
    if wrong is not None:
        return ("size", wrong)
    if blake3.blake3(target).hexdigest() != digest:
        return ("digest", 0)
    return None


def read_blocks(path, offset, lo, hi, block_size, first, hashes, a, b):
    # bytes [lo, hi) of a chunk file (whole blocks from block `first` on), each checked against its hash; then
    # bytes [a, b) of the chunk into the arena at `offset`
    def pread(fd):
        data = b""
        while len(data) < hi - lo:
            more = os.pread(fd, hi - lo - len(data), lo + len(data))
            if not more:
                break
            data += more
        return data

    data, failure = opened(path, pread)
    if failure is not None:
        return failure
    if len(data) != hi - lo:
        return ("short", len(data))
    view = memoryview(data)
    for j in range(0, len(data), block_size):
        k = j // block_size
        if blake3.blake3(view[j:j + block_size]).digest() != hashes[32 * k:32 * k + 32]:
            return ("block", first + k)
    arena[offset:offset + b - a] = view[a - lo:b - lo]
    return None


READERS = {"WholeChunk": read_chunk, "ChunkBlocks": read_blocks}

while True:
    head = read_exactly(8)
    if head is None:
        break
    body = read_exactly(struct.unpack("<Q", head)[0])
    if body is None:
        break
    failures = []
    for i, (kind, fields) in enumerate(pickle.loads(body)):   # each item: its kind, and its fields by name
        failure = READERS[kind](**fields)
        if failure is not None:
            failures.append((i, *failure))
    reply = pickle.dumps(failures)
    answers.write(struct.pack("<Q", len(reply)) + reply)
    answers.flush()
"""


class WholeChunk(NamedTuple):
    """A request: a whole chunk file into the arena, checked against its digest."""

    path: str
    offset: int
    """Where in the arena its bytes go."""
    size: int
    digest: str
    """The chunk's BLAKE3, in hex."""


class ChunkBlocks(NamedTuple):
    """A request: bytes [lo, hi) of a chunk file, whole blocks from block `first` on, each checked against its
    32-byte hash; then the chunk's bytes [a, b) (within [lo, hi)) into the arena at `offset`."""

    path: str
    offset: int
    lo: int
    hi: int
    block_size: int
    first: int
    hashes: bytes
    """The hashes of blocks `first` on, 32 bytes each."""
    a: int
    b: int


ReadRequest = WholeChunk | ChunkBlocks

FailureKind = Literal["missing", "size", "digest", "short", "block", "error"]


class ReadFailure(NamedTuple):
    """The answer for a request item that failed."""

    item: int
    """Its position in the request."""
    kind: FailureKind
    detail: int | str
    """size: the file's size; short: the bytes there were; block: the block's index; error: what went wrong."""


class ArenaPart(NamedTuple):
    """A part of the arena handed out by `ReadingProcess.allocate`."""

    offset: int
    view: memoryview
    """Writable; the part is in use while this view, or anything made on it, lives."""


class _Region(NamedTuple):
    start: int
    end: int
    owner: weakref.ref
    """The array over the region that every view handed out is made on: the region is in use while it lives."""


class ReadingProcess:
    """A helper process and the shared arena it reads chunk files into."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()  # the arena's regions
        self._io_lock = threading.Lock()  # the helper's pipes: one request at a time
        self._regions: list[_Region] = []
        self.broken: str | None = None
        self.pid = os.getpid()  # a forked child of this process must not talk to this process's helper
        self._fd = os.memfd_create("trajectory-replay-reads", getattr(os, "MFD_CLOEXEC", 1))
        try:
            os.ftruncate(self._fd, capacity)
            self._map = mmap.mmap(self._fd, capacity)
            # the helper imports what this process can (its import path, not only the environment's)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(self._fd), str(capacity)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                pass_fds=(self._fd,),
                env=env,
            )
        except BaseException:
            os.close(self._fd)
            raise

    def allocate(self, size: int) -> ArenaPart | None:
        """A part of `size` bytes of the arena that nothing else uses, the lowest such run; None when
        there is none. The run is free again once nothing refers to the view or to anything made on it (a slice of
        it, a tensor on it): each of those keeps the array under the view alive, and the arena only holds a weak
        reference to that array."""
        import numpy

        if size <= 0 or size > self.capacity or self.broken is not None:
            return None
        with self._lock:
            self._regions = sorted((r for r in self._regions if r.owner() is not None), key=lambda r: r.start)
            at = 0
            for region in self._regions:
                if region.start - at >= size:
                    break
                at = max(at, region.end)
            if at + size > self.capacity:
                return None
            owner = numpy.frombuffer(self._map, dtype=numpy.uint8, count=size, offset=at)
            self._regions.append(_Region(at, at + size, weakref.ref(owner)))
            return ArenaPart(at, owner.data)

    def read(self, items: Sequence[ReadRequest]) -> list[ReadFailure] | None:
        """Have the helper read each item into the arena and check it; the failures of the items that failed (none:
        all were read and match). None when the helper cannot be used (it is then off for good, and the caller
        reads the items itself)."""
        if self.broken is not None:
            return None
        body = pickle.dumps([(type(item).__name__, item._asdict()) for item in items])
        with self._io_lock:
            if self.broken is not None:
                return None
            try:
                assert self._proc.stdin is not None and self._proc.stdout is not None
                self._proc.stdin.write(struct.pack("<Q", len(body)) + body)
                self._proc.stdin.flush()
                head = self._proc.stdout.read(8)
                reply = self._proc.stdout.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
                return [ReadFailure(*failure) for failure in pickle.loads(reply)]
            except Exception as exc:  # noqa: BLE001 - any failure of the helper only turns it off
                self.broken = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.debug("reading process stopped (%s); reading in this process", self.broken)
                self._stop()
                return None

    def close(self) -> None:
        """Stop the helper and let go of the arena (its memory is freed once no tensor refers to it)."""
        with self._io_lock:
            if self.broken is None:
                self.broken = "closed"
                self._stop()
        with self._lock:
            self._regions = []
        os.close(self._fd)  # the memory stays mapped while any view of it lives

    def _stop(self) -> None:
        proc = self._proc
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_active: ReadingProcess | None = None
_users = 0
_active_lock = threading.Lock()


def active() -> ReadingProcess | None:
    """The reading process turned on by `reading_process`, while one is and it works."""
    helper = _active
    return helper if helper is not None and helper.broken is None and helper.pid == os.getpid() else None


@contextmanager
def reading_process(capacity: int) -> Iterator[ReadingProcess | None]:
    """Within it, local chunk reads go through a helper process with an arena of `capacity` bytes (shared by the
    nested or concurrent uses within one process; started by the first, stopped after the last). Yields None
    where it cannot run (not Linux, or the helper could not be started)."""
    global _active, _users
    with _active_lock:
        if _active is not None and _active.pid != os.getpid():  # a forked child: its parent's helper is not its own
            _active, _users = None, 0
        if _active is None and hasattr(os, "memfd_create"):
            try:
                _active = ReadingProcess(capacity)
            except (OSError, ValueError) as exc:  # no memfd, no room, no interpreter to start
                log.debug("no reading process (%s); reading in this process", exc)
        if _active is not None:
            _users += 1
        helper = _active
    try:
        yield helper
    finally:
        if helper is not None:
            with _active_lock:
                _users -= 1
                if _users == 0:
                    _active = None
                    helper.close()


__all__ = [
    "ArenaPart",
    "ChunkBlocks",
    "FailureKind",
    "ReadFailure",
    "ReadRequest",
    "ReadingProcess",
    "WholeChunk",
    "active",
    "reading_process",
]
