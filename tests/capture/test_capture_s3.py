"""Capture to a real S3 server (SeaweedFS): settings from the usual environment, or explicit storage options."""

from __future__ import annotations

import pytest

from tests.capture.helpers import capture_step, idle_writer, rollout_kwargs
from trajectory_replay import capture
from trajectory_replay.bundle import open_native
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR
from trajectory_replay.replay import replay

pytestmark = pytest.mark.s3


def _passes(url: str, **storage_options) -> list:
    sources = open_native(url, **storage_options)
    report = replay(sources)
    assert report.passed, [(s.stage, s.status, s.message) for s in report.stages]
    return sources


def test_capture_to_s3_from_the_environment(s3_root, s3_env, monkeypatch):
    url, storage_options = s3_root
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, url)  # endpoint and credentials come from AWS_* (s3_env)
    manager, _ = idle_writer(lambda: capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None))
    assert capture.capture_rollout(11, **rollout_kwargs())
    assert capture_step(capture, 11, 2, [[0, 1], [2, 3]])
    assert manager.flush(60), manager.stats()
    assert manager.stats()["written"] == 2 and manager.stats()["errors"] == 0
    assert capture.shutdown(timeout=10)
    [rollout] = _passes(f"{url}/rollout-11", **storage_options)
    assert rollout.index.identity.rollout_id == 11
    [step] = _passes(f"{url}/step-11-2", **storage_options)
    assert step.index.identity.micro_batch_ids == ["mb-0000", "mb-0001"]


def test_two_ranks_to_s3_with_storage_options(s3_root, make_manager):
    url, storage_options = s3_root
    shards = {0: [0, 1, 2], 1: [3]}
    managers = [
        idle_writer(
            lambda r=r: make_manager(
                url, rank=r, expected_ranks=[0, 1], storage_options=storage_options, default_writer=True
            )
        )[0]
        for r in shards
    ]
    for r, m in enumerate(managers):
        assert m.capture_rollout(12, **rollout_kwargs(shards[r], flat=True))
    for m in managers:
        assert m.flush(60) and m.stats()["written"] == 1, m.stats()
    sources = _passes(f"{url}/rollout-12", **storage_options)
    assert [s.rank for s in sources] == [0, 1]
