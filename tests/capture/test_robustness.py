"""Training never waits and never sees a capture error; a crash never leaves a bundle that looks complete."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.capture.helpers import capture_step, normal_scheduling, rollout_kwargs
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import COMPLETE, complete_key
from trajectory_replay.errors import BundleError, TrajectoryReplayError
from trajectory_replay.replay import replay
from trajectory_replay.store.layout import INFLIGHT_DIR, OBJECTS_DIR

REPO = Path(__file__).resolve().parents[2]


def _completes(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
        if f == COMPLETE or f.startswith(f"{COMPLETE}.")
    )


def _slow_writes(backend, seconds: float, release: threading.Event) -> None:
    """Every write and create-once of `backend` sleeps `seconds` (or until `release` is set)."""
    create, write = backend._create, backend._write

    def slow_create(key, data):
        release.wait(seconds)
        return create(key, data)

    def slow_write(key, data, durable=True):
        release.wait(seconds)
        return write(key, data, durable)

    backend._create, backend._write = slow_create, slow_write


def test_slow_backend_never_blocks_training(tmp_path, make_manager):
    manager = make_manager(tmp_path, max_queue_records=2, writer="thread")  # the slowed backend is this process's
    release = threading.Event()
    stall = 20.0  # each write stalls this long, or until the end of the test sets `release`
    _slow_writes(manager.store.backend, stall, release)
    try:
        durations = []
        for r in range(6):
            t0 = time.perf_counter()
            manager.capture_rollout(r, **rollout_kwargs())
            durations.append(time.perf_counter() - t0)
        for s in range(3):
            t0 = time.perf_counter()
            capture_step(manager, 100, s, [[0, 1], [2, 3]])  # three hook calls
            durations.append((time.perf_counter() - t0) / 3)
        stats = manager.stats()
        # a hook that waited for the backend would take the whole stall: anything short of it did not wait
        assert max(durations) < stall, durations
        assert stats["max_enqueue_seconds"] < stall
        assert stats["enqueued"] <= 2 + 1  # two queued, at most one taken by the writer
        assert stats["dropped"] >= 6 and stats["enqueued"] + stats["dropped"] == 9
        assert stats["errors"] == 0
    finally:
        release.set()  # the backend becomes fast again
    assert manager.flush(30)
    stats = manager.stats()
    assert stats["written"] == stats["enqueued"] and stats["errors"] == 0
    for name in ("rollout-0", "rollout-1"):
        assert replay(open_native(str(tmp_path / name))).passed


def test_failing_backend_counts_errors(tmp_path, make_manager, caplog):
    caplog.set_level(logging.ERROR, logger="trajectory_replay.capture")
    manager = make_manager(tmp_path, writer="thread")
    backend = manager.store.backend

    def fail(*args, **kwargs):
        raise OSError("injected write failure")

    backend._create = backend._write = fail
    for r in range(3):
        assert manager.capture_rollout(r, **rollout_kwargs())  # training goes on
    assert capture_step(manager, 0, 0, [[0, 1, 2, 3]])
    assert manager.flush(30)
    stats = manager.stats()
    assert stats["errors"] == 4 and stats["written"] == 0 and stats["enqueued"] == 4
    assert _completes(tmp_path) == []
    assert caplog.text.count("injected write failure") >= 4
    for name in ("rollout-0", "step-0-0"):
        with pytest.raises(TrajectoryReplayError):
            open_native(str(tmp_path / name))


def test_failing_finalize_leaves_no_complete(tmp_path, make_manager):
    # payloads land, then the marker write fails: the bundle never looks complete, its in-flight record is gone
    manager = make_manager(tmp_path, writer="thread")
    backend = manager.store.backend
    create = backend._create

    def refuse_markers(key, data):
        if key == complete_key("rollout-1"):
            raise OSError("injected marker failure")
        return create(key, data)

    backend._create = refuse_markers
    assert manager.capture_rollout(1, **rollout_kwargs())
    assert manager.flush(30) and manager.stats()["errors"] == 1
    assert _completes(tmp_path) == [] and os.listdir(tmp_path / OBJECTS_DIR)
    assert os.listdir(tmp_path / INFLIGHT_DIR) == []
    with pytest.raises(TrajectoryReplayError):
        open_native(str(tmp_path / "rollout-1"))


CHILD = textwrap.dedent("""
    import sys, threading, time
    from trajectory_replay.capture import CaptureManager
    from tests.capture.helpers import rollout_kwargs
    manager = CaptureManager(sys.argv[1], atexit_timeout=None, writer="thread")
    backend = manager.store.backend
    create, write = backend._create, backend._write
    def slow_create(key, data):
        time.sleep(0.03)
        return create(key, data)
    def slow_write(key, data, durable=True):
        time.sleep(0.03)
        return write(key, data, durable)
    backend._create, backend._write = slow_create, slow_write
    for r in range(4):
        assert manager.capture_rollout(r, **rollout_kwargs())
    print("captured", flush=True)
    time.sleep(120)
""")


def _writing(root: Path, bundle: str) -> bool:
    """True when the in-flight record of `bundle` lists a few objects (the writer is busy with it)."""
    inflight = root / INFLIGHT_DIR
    if not inflight.exists():
        return False
    for path in inflight.iterdir():
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if doc.get("bundle") == bundle and len(doc.get("digests", [])) >= 3:
            return True
    return False


def test_killed_writer_leaves_no_complete_bundle(tmp_path):
    root = tmp_path / "cap"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        killed_mid_write = False
        while time.monotonic() < deadline and child.poll() is None:
            if _writing(root, "rollout-1"):
                child.send_signal(signal.SIGSTOP)  # frozen, so that rollout-1 cannot finish before the kill
                if complete_key("rollout-1") in _completes(root):
                    break
                child.send_signal(signal.SIGKILL)  # the writer is in the middle of rollout-1
                killed_mid_write = True
                break
            time.sleep(0.005)
        assert killed_mid_write, (
            child.communicate(timeout=10)
            if child.poll() is not None
            else "rollout-1 finished before the writer could be stopped"
        )
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    complete = _completes(root)
    assert complete_key("rollout-0") in complete and complete_key("rollout-1") not in complete
    assert _writing(root, "rollout-1")  # its in-flight record stays: garbage for gc, never a complete bundle
    assert replay(open_native(str(root / "rollout-0"))).passed  # finished before the kill: intact
    with pytest.raises(BundleError, match="incomplete bundle"):
        open_native(str(root / "rollout-1"))
    for name in ("rollout-1", "rollout-2", "rollout-3"):
        if complete_key(name) in complete:
            continue
        with pytest.raises(TrajectoryReplayError):
            open_native(str(root / name))


EXITING_CHILD = textwrap.dedent("""
    import sys
    from trajectory_replay.capture import CaptureManager
    from tests.capture.helpers import rollout_kwargs
    manager = CaptureManager(sys.argv[1])   # close() is registered with atexit
    assert manager.capture_rollout(0, **rollout_kwargs())
    print("exiting without close", flush=True)
""")


def test_atexit_writes_what_is_queued(tmp_path):
    root = tmp_path / "cap"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", EXITING_CHILD, str(root)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert replay(open_native(str(root / "rollout-0"))).passed


PROCESS_CHILD = textwrap.dedent("""
    import sys, time, torch
    from trajectory_replay.capture import CaptureManager
    from tests.capture.helpers import rollout_kwargs
    manager = CaptureManager(sys.argv[1], atexit_timeout=None)   # the default: a writer process
    big = torch.randn(4 << 20)   # 16 MiB per payload: each bundle takes a while to write
    for r in range(4):
        kwargs = rollout_kwargs()
        kwargs["response_lengths"] = [1 << 20] * 4
        kwargs["loss_masks"] = torch.ones(4 << 20)
        for name in ("old_log_probs", "ref_log_probs", "kl", "advantages"):
            kwargs[name] = big + r
        assert manager.capture_rollout(r, **kwargs)
    while getattr(manager._writer, "proc", None) is None:   # set once the writer process is started
        time.sleep(0.01)
    print("captured", manager._writer.proc.pid, flush=True)
    time.sleep(120)
""")


def test_killed_training_process_takes_its_writer_process_along(tmp_path):
    """Killing the training process mid-capture kills its writer process too: the bundle being written
    never completes (no orphan finishes it later), finished ones stay intact."""
    root = tmp_path / "cap"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", PROCESS_CHILD, str(root)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        writer_pid = int(child.stdout.readline().split()[1])
        normal_scheduling(writer_pid)  # idle, it may not write at all while a loaded host has no CPU to spare
        # Freeze the writer while it is busy with a bundle after the first, so that this bundle cannot finish
        # between this look and the kill (on a loaded machine it may otherwise complete in that gap); a stopped
        # process still dies of the SIGKILL its parent's death sends it.
        unfinished: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not unfinished:
            if not any(_writing(root, f"rollout-{r}") for r in range(1, 4)):
                time.sleep(0.005)
                continue
            os.kill(writer_pid, signal.SIGSTOP)
            complete = _completes(root)
            unfinished = [
                f"rollout-{r}"
                for r in range(1, 4)
                if _writing(root, f"rollout-{r}") and complete_key(f"rollout-{r}") not in complete
            ]
            if not unfinished:  # stopped between two bundles: let it go on to the next
                os.kill(writer_pid, signal.SIGCONT)
                time.sleep(0.005)
        assert unfinished, "the writer was never caught in the middle of a bundle after the first"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        os.kill(writer_pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and os.path.exists(f"/proc/{writer_pid}")
            and "zombie" not in open(f"/proc/{writer_pid}/status").read()
        ):
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{writer_pid}") or "zombie" in open(f"/proc/{writer_pid}/status").read()
        time.sleep(0.5)  # nothing may complete after the kill
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        try:
            os.kill(writer_pid, signal.SIGCONT)
        except (OSError, NameError):
            pass
    complete = _completes(root)
    assert complete_key("rollout-0") in complete
    assert not [name for name in unfinished if complete_key(name) in complete]
    [done] = open_native(str(root / "rollout-0"))  # finished before the kill: whole and verified
    assert done.load_payload("old_log_probs").shape == (4 << 20,)
    for name in unfinished:
        with pytest.raises(BundleError, match="incomplete bundle"):
            open_native(str(root / name))
