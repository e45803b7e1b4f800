"""Capture fixtures: managers that are always closed, hooks that are always switched off, a clean environment."""

from __future__ import annotations

import pytest

from trajectory_replay import capture
from trajectory_replay.capture import CaptureManager
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, ENV_ROLLOUTS, ENV_STEPS


@pytest.fixture(autouse=True)
def clean_capture(monkeypatch):
    for name in (ENV_CAPTURE, ENV_DIR, ENV_STEPS, ENV_ROLLOUTS):
        monkeypatch.delenv(name, raising=False)
    capture.shutdown(timeout=10)
    yield
    capture.shutdown(timeout=10)


@pytest.fixture
def make_manager():
    """CaptureManager factory; every manager is closed at teardown."""
    made: list[CaptureManager] = []

    def make(capture_dir, **options) -> CaptureManager:
        options.setdefault("atexit_timeout", None)
        manager = CaptureManager(capture_dir, **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close(timeout=10)
