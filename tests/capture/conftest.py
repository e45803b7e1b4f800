"""Capture fixtures: managers that are always closed, hooks that are always switched off, a clean environment."""

from __future__ import annotations

import pytest

from trajectory_replay import capture
from trajectory_replay.capture import CaptureManager
from trajectory_replay.capture.config import OLDER_NAMES


@pytest.fixture(autouse=True)
def clean_capture(monkeypatch):
    for name in (*OLDER_NAMES, *OLDER_NAMES.values()):
        monkeypatch.delenv(name, raising=False)
    capture.shutdown(timeout=10)
    yield
    capture.shutdown(timeout=10)


@pytest.fixture
def make_manager():
    """CaptureManager factory; every manager is closed at teardown. Its managers write in a thread unless a test
    asks for a writer (`writer=`) or for the product's default (`default_writer=True`): a writer process is a
    second interpreter per manager, which only the tests of the process itself need to start."""
    made: list[CaptureManager] = []

    def make(capture_dir, default_writer: bool = False, **options) -> CaptureManager:
        options.setdefault("atexit_timeout", None)
        if not default_writer:
            options.setdefault("writer", "thread")
        manager = CaptureManager(capture_dir, **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.close(timeout=10)
