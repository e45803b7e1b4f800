"""Capture through an S3 outage: a server that could not be reached is asked again, not written off.

The server here is a SeaweedFS of this test's own, on a port chosen up front and started only once
capture has failed: the writer process has opened its store and run the create-once self-test while
nothing answered there. Once the server is back, every bundle captured from then on must be COMPLETE
and valid.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import s3fs

from tests.backends.test_s3_specifics import ConditionIgnoringS3
from tests.capture.helpers import capture_step, idle_writer
from tests.s3server import ACCESS_KEY, SECRET_KEY, _free_ports, start_server
from trajectory_replay.backends import open_backend
from trajectory_replay.backends import s3 as s3_backend
from trajectory_replay.backends.s3 import S3Backend
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import read_complete
from trajectory_replay.capture.manager import STORE_RETRY_MAX
from trajectory_replay.errors import BackendError
from trajectory_replay.replay.validate import validate_sources
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.cache import ENV_DIR

pytestmark = pytest.mark.s3

STEP_EVERY = 0.25
AFTER_RECOVERY = 3.0
SERVER_START = 60.0
"""The longest the test's SeaweedFS may take to start."""
AT_LEAST = 3
"""Bundles captured after the recovery: the writer may still be in a retry's back-off for a moment (steps it
has no room for meanwhile are dropped, as any full queue drops them), so steps go on until this many were taken."""


def test_capture_started_during_an_outage_completes_its_bundles_once_the_server_is_back(
    tmp_path, make_manager, monkeypatch
):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cache"))
    port = _free_ports(1)[0]
    # one attempt per request: botocore's own retries of a refused connection (up to about 15 s) would decide
    # by chance whether the writer's first self-test meets the outage or outlasts it
    options = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}/run"
    servers: list = []
    started = threading.Event()

    def start() -> None:
        try:
            servers.append(start_server(tmp_path / "weed", timeout=SERVER_START, s3_port=port))
        finally:
            started.set()

    launcher = threading.Thread(target=start, daemon=True)
    t0 = time.monotonic()
    manager, _ = idle_writer(
        lambda: make_manager(url, storage_options=options, max_queue_records=4, default_writer=True)
    )
    assert manager.writer_mode == "process"  # the default for S3: it probes as soon as it has started
    try:
        watcher = open_backend(url, **options)
        down = watcher.probe()
        assert down.transient and not down.ok, down
        assert watcher.probe() is down  # within its back-off: no new request
        with pytest.raises(BackendError, match="could not check that create-if-absent is atomic"):
            watcher.require_atomic_create(patience=0)

        recovered = None
        after: list[str] = []
        step = 0
        while recovered is None or time.monotonic() < recovered + AFTER_RECOVERY or len(after) < AT_LEAST:
            if not launcher.ident and manager.stats()["errors"]:  # the writer met the outage: end it
                launcher.start()
            if recovered is None and started.is_set():
                assert servers, "the outage test's SeaweedFS did not start"
                s3fs.S3FileSystem(skip_instance_cache=True, **options).makedirs(bucket, exist_ok=True)
                recovered = time.monotonic()
            step += 1
            if capture_step(manager, 40, step, [[0, 1], [2, 3]]) and recovered is not None:
                after.append(f"step-40-{step}")
            time.sleep(STEP_EVERY)
            if recovered is None:  # the writer meets the outage at once; the server's start has a timeout of its own
                assert time.monotonic() - t0 < 2 * SERVER_START, f"the server never came back: {manager.stats()}"
            else:  # capture resumes once the writer's back-off ends (twice over, for a loaded host)
                assert time.monotonic() - recovered < 2 * (STORE_RETRY_MAX + AFTER_RECOVERY + AT_LEAST * STEP_EVERY), (
                    f"capture never resumed: {manager.stats()}"
                )
        assert manager.flush(20), manager.stats()
        watcher.require_atomic_create()  # the same backend: its failed probe was not remembered
        completed = [b for b in after if read_complete(watcher, b) is not None]
        verifying = ObjectStore.open(url, trust_cache=False, **options)  # as validate_bundle opens it
        reports = {b: validate_sources(b, open_native(f"{url}/{b}", store=verifying)) for b in completed}
    finally:
        if launcher.ident:
            started.wait(60)
        for server in servers:
            server.stop()  # a short grace, then SIGKILL (weed waits about 10 s on SIGTERM)

    assert manager.stats()["errors"] > 0, manager.stats()  # what was captured during the outage failed
    assert completed == after, (after, manager.stats())
    assert all(r.valid for r in reports.values()), {b: r.problems for b, r in reports.items()}


def test_a_server_that_ignores_conditional_writes_is_refused_at_once_and_remembered(s3_root):
    url, options = s3_root
    backend = S3Backend(url, fs=ConditionIgnoringS3(skip_instance_cache=True, use_listings_cache=False, **options))
    result = backend.probe()
    assert not result.ok and not result.transient, result
    backend.stats.reset()
    assert backend.probe() is result and backend.stats.writes == 0
    t = time.monotonic()
    with pytest.raises(BackendError, match="create-if-absent is not atomic on this target"):
        backend.require_atomic_create()
    # no retries: the server's answer stands (a retry would first have waited out the shortest backoff)
    assert time.monotonic() - t < s3_backend.RETRY_FIRST
    assert backend.stats.writes == backend.stats.reads == 0
