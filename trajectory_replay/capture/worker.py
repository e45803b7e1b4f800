"""The capture writer process: builds, encodes, hashes, uploads and commits bundles outside training's process.

Everything the writer does is Python (pydantic documents, hashing and encoding calls, and for S3 every
request through botocore). Run as a thread of the training process it holds the GIL in many short bursts,
and the training thread waits for it between its own operations. In a process of its own it only competes
for a CPU, and by default only for CPU time nothing else wants (Linux's idle scheduling class).

Protocol, over the child's stdin/stdout: length-prefixed pickles. The parent sends `WriterSettings` once;
the child answers (READY, failure or None) once it has opened and probed the store. Then the parent sends
one `Request` per bundle (a sequence number and a `BundleJob`), which the child commits with
`capture.commit.commit_bundle`, exactly as a writer thread would, and answers with a `Reply`. A failure is a
storage failure (the store cannot be used: `StorageUnavailableError`) as (message, kind, transient), so that
the parent can back off. Tensors travel as raw bytes (dtype, shape, bytes), not through torch's own pickling,
and arrive as `codec.RawTensor`s: the child builds and encodes bundles without importing torch, so it starts in
a fraction of a second and holds a fraction of the memory.
The child dies with the thread that started it (Linux: PR_SET_PDEATHSIG), so a killed training process
never leaves a writer behind that would complete a bundle after it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

from trajectory_replay.bundle.codec import RawTensor
from trajectory_replay.capture.commit import BundleJob, commit_bundle, storage_failure
from trajectory_replay.capture.recorder import Recorder, RecorderSettings
from trajectory_replay.capture.records import check_fields
from trajectory_replay.errors import StorageUnavailableError
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.layout import PROBE_DIR

log = logging.getLogger("trajectory_replay.capture")

_LENGTH = struct.Struct("<Q")
READY = "ready"


# ---- framing ---------------------------------------------------------------------------------------
class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        torch = sys.modules.get("torch")  # whoever sends a tensor has imported torch; the child never does
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return RawTensor, (str(t.dtype), tuple(t.shape), raw)
        return NotImplemented


def send(stream: IO[bytes], obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    data = buf.getbuffer()
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the other side closed the pipe")
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


# ---- messages ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WriterSettings:
    """Sent once: the store the writer process opens (and keeps) for every job."""

    capture_dir: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    recorder: RecorderSettings | None = None
    """The flight recorder's settings (policy `recorder:K`): every job goes to its spool, triggers promote."""

    def __post_init__(self) -> None:
        check_fields(self, capture_dir=str, storage_options=Mapping)
        if self.recorder is not None and not isinstance(self.recorder, RecorderSettings):
            raise TypeError(f"WriterSettings.recorder: expected RecorderSettings, got {type(self.recorder).__name__}")


class Request(NamedTuple):
    """One bundle for the writer process to commit."""

    seq: int
    job: BundleJob


Failure = tuple[str, str, bool]
"""A storage failure as it crosses the pipe: (message, kind, transient)."""


class Reply(NamedTuple):
    """The writer process's answer to the Request of the same `seq`: the bundle's URL, or what went wrong."""

    seq: int
    url: str | None = None
    error: str | None = None
    failure: Failure | None = None


# ---- storage failures ------------------------------------------------------------------------------
class WriterStorageError(StorageUnavailableError):
    """A storage failure the writer process met, with its kind (the class itself stays in the child)."""

    def __init__(self, message: str, kind: str = "storage", transient: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.transient = transient


def _describe(failure: StorageUnavailableError | None) -> Failure | None:
    if failure is None:
        return None
    return str(failure), str(getattr(failure, "kind", "storage")), bool(getattr(failure, "transient", False))


def _rebuild(described: Failure | None) -> WriterStorageError | None:
    return None if described is None else WriterStorageError(*described)


# ---- parent side -----------------------------------------------------------------------------------
class WriterProcess:
    """The parent's handle on one writer process. Used by one thread only (the manager's writer thread)."""

    mode = "process"

    def __init__(self, settings: WriterSettings, priority: str = "idle") -> None:
        self.settings = settings
        self.priority = priority
        self.proc: subprocess.Popen | None = None
        self._seq = 0
        self._scheduling = threading.Lock()
        self._hurried = False

    def start(self) -> WriterStorageError | None:
        """Start the process and wait until it has opened the store (and probed it: create-once markers).

        Returns the storage failure its first contact with the store met, if any (the process still serves)."""
        env = dict(os.environ)
        # the child must import this package exactly as the parent did
        paths = [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        proc = subprocess.Popen(
            [sys.executable, "-c", "from trajectory_replay.capture.worker import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        # its scheduling is set here, at once (before its imports), and only here: a flush waiting meanwhile may
        # have asked for it to run normally, which the process itself could not know
        with self._scheduling:
            self._schedule(proc)
            self.proc = proc
        stdin, stdout = _pipes(proc)
        send(stdin, self.settings)
        answer = receive(stdout)
        if not (isinstance(answer, tuple) and answer and answer[0] == READY):
            self.stop()
            raise RuntimeError(f"capture writer process failed to start: {answer}")
        return _rebuild(answer[1])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def hurry(self) -> bool:
        """Give the process normal scheduling while the program waits for it (a flush, the close at exit): then it
        takes no CPU from training, and idle it may get none at all on a host whose CPUs never idle. Raising a
        priority needs privilege (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it): True when it was raised,
        False when it could not be (it goes on at its own priority). A process started while the program waits
        starts at normal scheduling too."""
        with self._scheduling:
            self._hurried = True
            return self._schedule(self.proc)

    def relax(self) -> None:
        """Back to the priority it was started with, once the program no longer waits (always permitted)."""
        with self._scheduling:
            self._hurried = False
            self._schedule(self.proc)

    def _schedule(self, proc: subprocess.Popen | None) -> bool:
        """Set the scheduling of `proc`, this writer's process (the caller holds `_scheduling`): normal while hurried
        where permitted, else its priority (idle: only a CPU with nothing else to run; low: nice 10). True when it
        runs normally."""
        if proc is None:
            return False
        threads = _threads(proc.pid)
        if self._hurried:
            try:
                for tid in threads:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
                return True
            except (AttributeError, OSError):  # not permitted, not Linux, or the process just ended
                pass
        for tid in threads:
            _lower(tid, self.priority)
        return False

    def write(self, job: BundleJob) -> str:
        """Have the process commit one bundle; its URL. Raises with the process's error if it failed."""
        if not self.alive:
            self.start()
        self._seq += 1
        assert self.proc is not None  # started just above
        try:
            stdin, stdout = _pipes(self.proc)
            send(stdin, Request(self._seq, job))
            reply: Reply = receive(stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            code = self.proc.poll() if self.proc is not None else None
            self.stop()
            raise RuntimeError(
                f"the capture writer process ended (exit {code}) while writing {job.bundle_id}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if reply.seq != self._seq:
            self.stop()
            raise RuntimeError(f"capture writer process answered record {reply.seq}, expected {self._seq}")
        if reply.failure is not None:
            raise WriterStorageError(*reply.failure)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        assert reply.url is not None  # a reply without a failure or an error names the bundle
        return reply.url

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        stdin, stdout = _pipes(proc)
        try:
            stdin.close()  # end of input: the child exits
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stdout.close()


def _pipes(proc: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """The writer process's stdin and stdout (it is always started with both piped)."""
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


# ---- child side ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _threads(pid: int) -> list[int]:
    """The threads of process `pid` (scheduling is per thread on Linux, and a new thread takes its creator's): its
    main thread alone where they cannot be listed."""
    try:
        return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
    except (OSError, ValueError):
        return [pid]


def _lower(pid: int, priority: str) -> None:
    """Lower thread (or process) `pid`'s priority: "idle", scheduled only when a CPU has nothing else to run
    (Linux), else (or where that is refused) nice 10 at least. Best effort."""
    if priority == "idle":
        try:
            os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, max(10, os.getpriority(os.PRIO_PROCESS, pid)))
    except (AttributeError, OSError):
        pass


def main() -> None:
    _die_with_parent()  # its priority is set by the parent that started it (WriterProcess.start)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training program's to handle
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the protocol stream
    settings: WriterSettings = receive(stdin)
    try:
        store = ObjectStore.open(settings.capture_dir, **settings.storage_options)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs it
        send(stdout, f"{type(exc).__name__}: {exc}")
        return
    # connect and probe now, not during the first record. One attempt only: a target that cannot be reached
    # yet (an outage) is probed again, with backoff, when a bundle is committed; a refusal fails each record.
    failure = None
    # the parent logs a failure of this first contact (once per kind); the probe's own warning would repeat it here
    probe_log = logging.getLogger("trajectory_replay.backends.base")
    level = probe_log.level
    probe_log.setLevel(logging.ERROR)
    try:
        if store.backend.capabilities.atomic_create and store.backend.probe().transient:
            # what kept the probe from the store, for the parent's backoff: the backend remembers an endpoint
            # that just gave no answer, so this fails at once
            store.backend.exists(f"{PROBE_DIR}/ready")
    except Exception as exc:  # noqa: BLE001
        failure = storage_failure(exc)
    finally:
        probe_log.setLevel(level)
    try:
        recorder = None if settings.recorder is None else Recorder(settings.recorder, store)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which logs it
        send(stdout, f"the flight recorder's spool cannot be used: {type(exc).__name__}: {exc}")
        return
    commit = commit_bundle if recorder is None else (lambda _store, job: recorder.commit(job))
    send(stdout, (READY, _describe(failure)))
    while True:
        try:
            seq, job = receive(stdin)
        except EOFError:
            return
        try:
            reply = Reply(seq, url=commit(store, job))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
            reply = Reply(seq, error=f"{type(exc).__name__}: {exc}", failure=_describe(storage_failure(exc)))
        send(stdout, reply)
