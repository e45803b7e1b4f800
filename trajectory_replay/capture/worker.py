"""The capture writer process: builds, encodes, hashes, uploads and commits bundles outside training's process.

Everything the writer does is Python (pydantic documents, hashing and encoding calls, and for S3 every
request through botocore). Run as a thread of the training process it holds the GIL in many short bursts,
and the training thread waits for it between its own operations. In a process of its own it only competes
for a CPU, and by default only for CPU time nothing else wants (Linux's idle scheduling class).

Protocol, over the child's stdin/stdout: length-prefixed pickles. The parent sends the store settings
once; the child answers (READY, failure or None) once it has opened and probed the store. Then the parent
sends one message per record: (sequence number, bundle id, builder name, builder arguments); the child
answers each with (sequence number, error or None, failure or None). A failure is a storage failure (the
store cannot be used: `StorageUnavailableError`) as (message, kind, transient), so that the parent can back
off. Tensors travel as raw bytes (dtype, shape, bytes), not through torch's own pickling. The child dies
with the thread that started it (Linux: PR_SET_PDEATHSIG), so a killed training process never leaves a
writer behind that would complete a bundle after it.
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
from typing import Any, BinaryIO, Optional

import torch

from trajectory_replay.errors import StorageUnavailableError

log = logging.getLogger("trajectory_replay.capture")

_LENGTH = struct.Struct("<Q")
READY = "ready"


# ---- framing ---------------------------------------------------------------------------------------
class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor_from_bytes, (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        return NotImplemented


def _tensor_from_bytes(dtype: str, shape: tuple, raw: bytes) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)


def send(stream: BinaryIO, obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    data = buf.getbuffer()
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the other side closed the pipe")
    (n,) = _LENGTH.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


# ---- storage failures ------------------------------------------------------------------------------
class WriterStorageError(StorageUnavailableError):
    """A storage failure the writer process met, with its kind (the class itself stays in the child)."""

    def __init__(self, message: str, kind: str = "storage", transient: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.transient = transient


def storage_failure(exc: Optional[BaseException]) -> Optional[StorageUnavailableError]:
    """The StorageUnavailableError behind `exc` (itself, or one it was raised from), if any."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, StorageUnavailableError):
            return exc
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _describe(failure: Optional[StorageUnavailableError]) -> Optional[tuple[str, str, bool]]:
    if failure is None:
        return None
    return str(failure), str(getattr(failure, "kind", "storage")), bool(getattr(failure, "transient", False))


def _rebuild(described: Optional[tuple[str, str, bool]]) -> Optional[WriterStorageError]:
    return None if described is None else WriterStorageError(*described)


# ---- parent side -----------------------------------------------------------------------------------
class WriterProcess:
    """The parent's handle on one writer process. Used by one thread only (the manager's writer thread)."""

    def __init__(self, settings: dict[str, Any], priority: str = "idle") -> None:
        self.settings = settings
        self.priority = priority
        self.proc: Optional[subprocess.Popen] = None
        self._seq = 0

    def start(self) -> Optional[WriterStorageError]:
        """Start the process and wait until it has opened the store (and probed it: create-once markers).

        Returns the storage failure its first contact with the store met, if any (the process still serves)."""
        env = dict(os.environ)
        # the child must import this package exactly as the parent did
        paths = [p for p in sys.path if p]
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen([sys.executable, "-c", "from trajectory_replay.capture.worker import main; main()",
                                      self.priority],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        send(self.proc.stdin, self.settings)
        answer = receive(self.proc.stdout)
        if not (isinstance(answer, tuple) and answer and answer[0] == READY):
            self.stop()
            raise RuntimeError(f"capture writer process failed to start: {answer}")
        return _rebuild(answer[1])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def write(self, bundle_id: str, builder: str, args: tuple) -> None:
        """Have the process write one bundle; raises with the process's error if it failed."""
        if not self.alive:
            self.start()
        self._seq += 1
        try:
            send(self.proc.stdin, (self._seq, bundle_id, builder, args))
            seq, error, failure = receive(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            code = self.proc.poll() if self.proc is not None else None
            self.stop()
            raise RuntimeError(f"the capture writer process ended (exit {code}) while writing {bundle_id}: "
                               f"{type(exc).__name__}: {exc}") from None
        if seq != self._seq:
            self.stop()
            raise RuntimeError(f"capture writer process answered record {seq}, expected {self._seq}")
        if failure is not None:
            raise _rebuild(failure)
        if error is not None:
            raise RuntimeError(error)

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()   # end of input: the child exits
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---- child side ------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:   # the parent died before prctl took effect
        os._exit(1)


def _yield_cpu(priority: str) -> None:
    """Lower this process's priority before it does any work (its imports included). Best effort."""
    if priority == "idle":
        try:   # Linux: scheduled only when a CPU has nothing else to run
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:   # the writer thread that started this process ran at nice 10 already
        os.setpriority(os.PRIO_PROCESS, 0, max(10, os.getpriority(os.PRIO_PROCESS, 0)))
    except (AttributeError, OSError):
        pass


def main() -> None:
    _die_with_parent()
    _yield_cpu(sys.argv[1] if len(sys.argv) > 1 else "low")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the training program's to handle
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # nothing else may write to the protocol stream
    from trajectory_replay.capture.manager import write_bundle
    from trajectory_replay.store import ObjectStore

    settings = receive(stdin)
    try:
        store = ObjectStore.open(settings["capture_dir"], **settings["storage_options"])
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
            store.backend.exists(".probe/ready")
    except Exception as exc:  # noqa: BLE001
        failure = storage_failure(exc)
    finally:
        probe_log.setLevel(level)
    send(stdout, (READY, _describe(failure)))
    while True:
        try:
            seq, bundle_id, builder, args = receive(stdin)
        except EOFError:
            return
        error = failure = None
        try:
            write_bundle(store, settings["capture_dir"], bundle_id, builder, args, settings["rank"],
                         settings["expected_ranks"])
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
            error = f"{type(exc).__name__}: {exc}"
            failure = _describe(storage_failure(exc))
        send(stdout, (seq, error, failure))

