"""How capture runs beside training: its writer, its threads' priority, its S3 event loop, its exit hook.

- `start_writer`: the manager's writer thread hands each `BundleJob` to a writer, the writer process
  (`capture.worker`) or, for `writer="thread"` and when that process cannot start, the in-thread
  writer (`capture.commit`).
- `lower_thread_priority`: capture's threads yield the CPU to training.
- `open_store`: the manager's store; an in-thread writer's S3 requests run in `background_loop`, an
  event loop of capture's own at lowered priority, not in fsspec's shared one.
- `close_at_exit`: managers are closed at interpreter exit while thread pools still accept work.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from trajectory_replay.capture.commit import InThreadWriter
from trajectory_replay.capture.recorder import Recorder, RecorderSettings, RecorderWriter
from trajectory_replay.capture.worker import WriterProcess, WriterSettings
from trajectory_replay.errors import StorageUnavailableError
from trajectory_replay.store import ObjectStore

log = logging.getLogger("trajectory_replay.capture")

Writer = InThreadWriter | RecorderWriter | WriterProcess
"""What the manager's writer thread hands jobs to: `write(job) -> url`, `stop()`, and its `mode`."""


def start_writer(
    mode: str,
    store: ObjectStore,
    capture_dir: str,
    storage_options: Mapping[str, Any],
    priority: str,
    made: Callable[[Writer], None] | None = None,
    recorder: RecorderSettings | None = None,
) -> tuple[Writer, StorageUnavailableError | None]:
    """The writer for `mode` ("process" or "thread"), started, and the storage failure its first contact with the
    store met, if any (it still serves: the store may be back by the first job). The in-thread writer uses
    `store`; a writer process opens a store of its own, on `capture_dir` with `storage_options`.

    Call it from the manager's writer thread: the writer process dies with the thread that started it. `made` is
    handed a writer process before it starts (its start, at idle priority, may take long on a busy host: a flush
    meanwhile can hurry it). With `recorder`, every job goes to the flight recorder's spool (`capture.recorder`)."""
    if mode == "process":
        process = WriterProcess(WriterSettings(capture_dir, dict(storage_options), recorder), priority=priority)
        if made is not None:
            made(process)
        try:
            return process, process.start()
        except Exception as exc:  # noqa: BLE001 - capture goes on in this thread rather than not at all
            log.warning(
                "capture: the writer process could not start (%s: %s); writing from a thread instead",
                type(exc).__name__,
                exc,
            )
    if recorder is not None:
        return RecorderWriter(Recorder(recorder, store)), None
    return InThreadWriter(store), None


def lower_thread_priority(niceness: int = 10) -> None:
    """Make the calling thread (and the I/O threads it starts, which inherit it) yield the CPU to training.

    Linux schedules threads individually, so this lowers only the capture threads. Best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):
        pass


def open_store(capture_dir: str, storage_options: Mapping[str, Any], mode: str) -> ObjectStore:
    """The manager's store for writer mode `mode`."""
    options = dict(storage_options)
    if mode == "thread" and capture_dir.startswith("s3://") and "loop" not in options:
        # s3fs runs every request in an event loop thread; by default fsspec's shared one, started at
        # normal priority by whoever came first. Capture's requests run in a loop of their own that
        # yields the CPU to training, like the writer thread.
        options["loop"] = background_loop()
    return ObjectStore.open(capture_dir, **options)


_IO_LOOP: asyncio.AbstractEventLoop | None = None
_IO_LOOP_LOCK = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """The process-wide event loop of capture's remote I/O: one daemon thread at lowered priority."""
    global _IO_LOOP
    with _IO_LOOP_LOCK:
        if _IO_LOOP is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                lower_thread_priority()
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="trajectory-replay-io", daemon=True).start()
            ready.wait()
            _IO_LOOP = loop
    return _IO_LOOP


_AT_EXIT: weakref.WeakKeyDictionary[Any, weakref.WeakMethod] = weakref.WeakKeyDictionary()
_exit_hook_registered = False
_exit_hook_lock = threading.Lock()


def close_at_exit(close: Callable[[], None]) -> None:
    """Call the bound method `close` at interpreter exit, unless its object is gone or called `forget_at_exit`."""
    _register_exit_hook()
    owner = close.__self__  # type: ignore[attr-defined]  # mypy: a bound method is a plain callable
    _AT_EXIT[owner] = weakref.WeakMethod(close)


def forget_at_exit(owner: Any) -> None:
    _AT_EXIT.pop(owner, None)


def _close_all_at_exit() -> None:
    for ref in list(_AT_EXIT.values()):
        close = ref()
        if close is not None:
            close()


def _register_exit_hook() -> None:
    """Close live managers at interpreter exit, while thread pools still accept work.

    A plain `atexit` handler runs too late: `concurrent.futures` refuses new work once the
    interpreter's shutdown begins, and the object store hashes and uploads through thread pools.
    `threading._register_atexit` callbacks run first, in reverse order of registration, so this one
    (registered after `concurrent.futures.thread` imported, which the store does) runs before the
    pools shut down. Where that hook is missing, `atexit` is the fallback."""
    global _exit_hook_registered
    with _exit_hook_lock:
        if _exit_hook_registered:
            return
        import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise AttributeError("threading._register_atexit")
            register(_close_all_at_exit)
        except (AttributeError, RuntimeError):
            atexit.register(_close_all_at_exit)
        _exit_hook_registered = True


__all__ = [
    "Writer",
    "background_loop",
    "close_at_exit",
    "forget_at_exit",
    "lower_thread_priority",
    "open_store",
    "start_writer",
]
