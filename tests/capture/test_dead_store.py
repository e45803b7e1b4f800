"""Capture to a store that cannot be used: training pays the bounded timeouts once, not once per bundle.

The writer process (the default for S3) meets a closed local port, or a local socket that accepts connections and
never answers (small timeouts set through the documented variables). After the first failure capture backs off:
the hooks drop what they are given (counted, at once), queued records wait and are dropped at close, and the
failure is one warning line, not a traceback per bundle. The store coming back is tests/capture/test_outage.py.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest

from tests.capture.helpers import capture_step, idle_writer
from trajectory_replay.backends.s3 import ENV_CONNECT_TIMEOUT, ENV_MAX_ATTEMPTS, ENV_READ_TIMEOUT
from trajectory_replay.capture import manager as manager_module
from trajectory_replay.store.cache import ENV_DIR

pytestmark = pytest.mark.s3

STEP_EVERY = 0.05
QUEUE = 16
AFTER_FAILURE = 2.5
"""Seconds training goes on after capture's first failure: backoffs of 1 s then 2 s allow at most two more tries."""


@pytest.fixture
def dead_env(monkeypatch, tmp_path):
    """Credentials and small timeouts, as a user would set them; the endpoint is the test's to choose."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(ENV_CONNECT_TIMEOUT, "0.5")
    monkeypatch.setenv(ENV_READ_TIMEOUT, "1")
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "1")
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(manager) -> tuple[list[bool], int]:
    """Actor steps of two micro-batches each, as training would call the hooks, until AFTER_FAILURE seconds after
    the writer's first failure (the writer process needs a moment to start). Returns whether each step was taken,
    and how many steps came after that failure."""
    taken: list[bool] = []
    started, failed, after = time.monotonic(), None, 0
    while failed is None or time.monotonic() < failed + AFTER_FAILURE:
        taken.append(bool(capture_step(manager, 1, len(taken), [[0, 1], [2, 3]])))
        after += failed is not None
        if failed is None and manager.stats()["errors"]:
            failed = time.monotonic()
        assert time.monotonic() - started < 60, f"the writer never reported a failure: {manager.stats()}"
        time.sleep(STEP_EVERY)
    return taken, after


def _store_warnings(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "trajectory_replay.capture"
        and r.levelno >= logging.WARNING
        and "dropped" not in r.getMessage()[:20]
    ]


@pytest.mark.parametrize("endpoint", ["refused", "never answers"])
def test_capture_to_a_dead_store_backs_off_counts_drops_and_warns_once(endpoint, dead_env, make_manager, caplog):
    caplog.set_level(logging.DEBUG, logger="trajectory_replay.capture")
    if endpoint == "refused":
        dead_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
        silent = None
    else:
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(512)
        dead_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    try:
        manager, _ = idle_writer(
            lambda: make_manager("s3://capture-bucket/run", max_queue_records=QUEUE, default_writer=True)
        )
        assert manager.writer_mode == "process"
        taken, after = _train(manager)
        stats = manager.stats()
        started = time.monotonic()
        assert manager.close(timeout=30)  # nothing left: what could not be written was dropped
        closing = time.monotonic() - started
    finally:
        if silent is not None:
            silent.close()
    stats = manager.stats()

    # training never waited on the store: a wait would take at least the 0.5 s connect timeout (a silent endpoint:
    # the 1 s read timeout)
    assert stats["max_enqueue_seconds"] < 0.5, stats
    assert stats["written"] == 0 and stats["errors"] >= 1, stats
    # not one attempt per bundle: after the first failure the writer backs off (1 s, 2 s, ...) and drops meanwhile
    assert stats["errors"] <= 3 and stats["dropped"] >= after - 3 and after >= 10, (stats, after)
    # every step is accounted for: taken and then failed, or dropped by a hook, or taken and dropped at close
    refused_at_once = len(taken) - sum(taken)
    assert sum(taken) == stats["enqueued"] == stats["errors"] + stats["dropped"] - refused_at_once, (stats, taken)
    assert stats["queued_records"] == 0 and stats["bytes_in_use"] == 0, stats
    # closing waits at most for the record being written, which the timeouts bound (connect 0.5 s + read 1 s),
    # not for each queued record in turn (QUEUE x 1.5 s = 24 s): the bound is half of that, for a loaded host
    assert closing < QUEUE * (0.5 + 1.0) / 2, closing

    warnings = _store_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one kind of failure: one line
    line = warnings[0].getMessage()
    assert "\n" not in line and "s3://capture-bucket/run" in line and "AWS_ENDPOINT_URL" in line, line
    assert ("connection refused" if endpoint == "refused" else "no answer within the 1s read timeout") in line, line
    assert all(r.exc_info is None for r in caplog.records if r.name == "trajectory_replay.capture"), (
        "a storage failure is logged without a traceback"
    )


def test_a_store_that_comes_back_is_written_to_again(dead_env, make_manager, caplog, monkeypatch):
    """The backoff never gives up: a thread-mode writer whose store fails, then works, writes again and says so."""
    monkeypatch.setattr(manager_module, "STORE_RETRY_FIRST", 0.2)
    caplog.set_level(logging.INFO, logger="trajectory_replay.capture")
    manager = make_manager("memory://dead-then-alive", writer="thread")
    backend = manager.store.backend
    create, write = backend._create, backend._write
    from trajectory_replay.backends.s3 import StoreUnreachableError

    def unreachable(*args, **kwargs):
        raise StoreUnreachableError(
            "memory://dead-then-alive: S3 endpoint http://127.0.0.1:1: connection refused "
            "(1 attempt in 0.0s): check AWS_ENDPOINT_URL and that the server is running"
        )

    backend._create = backend._write = unreachable
    assert capture_step(manager, 2, 0, [[0, 1, 2, 3]])
    assert manager.flush(10)
    assert manager.stats()["errors"] == 1
    assert not capture_step(manager, 2, 1, [[0, 1, 2, 3]])  # backing off: dropped at once
    backend._create, backend._write = create, write  # the store is back
    time.sleep(0.3)
    assert capture_step(manager, 2, 2, [[0, 1, 2, 3]])
    assert manager.flush(10)
    stats = manager.stats()
    assert stats["written"] == 1 and stats["errors"] == 1 and stats["dropped"] == 1, stats
    messages = [r.getMessage() for r in caplog.records if r.name == "trajectory_replay.capture"]
    assert any("answers again; 1 capture(s) were dropped" in m for m in messages), messages
