"""An unstreamed replay reads the next stage's payloads on a thread of its own: each payload is still read once,
never more than one stage ahead, and a read that fails there fails the stage that loads it."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from tests.replay.cases import twelve_case
from tests.replay.conftest import MemorySource, source_of
from trajectory_replay.replay import replay
from trajectory_replay.replay.cohort import Cohort, CohortPart, PayloadCache
from trajectory_replay.replay.runner import _ReadAhead


def _part(source: MemorySource) -> CohortPart:
    return CohortPart(source, tuple(range(len(source.index.samples))))


def _wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_every_payload_of_a_replay_is_read_once():
    for _ in range(20):   # the reading thread and the stages race differently each time
        source = source_of(twelve_case())
        report = replay([source])
        assert report.passed
        counts = Counter(source.loads)
        assert counts and set(counts.values()) == {1}, counts
        assert {name for name, _ in source.loads} >= {"loss_mask", "old_log_probs", "log_probs", "advantages", "kl"}


class _SlowSource(MemorySource):
    """Holds every read of `slow` until `release` is set."""

    def __init__(self, *args, slow: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.release, self.reading = slow, threading.Event(), threading.Event()

    def load_payload(self, name, samples=None):
        if name == self.slow:
            self.reading.set()
            assert self.release.wait(10)
        return super().load_payload(name, samples)


def test_a_load_of_rows_being_read_waits_for_that_read():
    source = _SlowSource(*twelve_case(), slow="log_probs")
    cache, part = PayloadCache(), _part(source)
    got: list[torch.Tensor] = []
    first = threading.Thread(target=lambda: got.append(cache.load(part, "log_probs")))
    first.start()
    assert source.reading.wait(10)
    second = threading.Thread(target=lambda: got.append(cache.load(part, "log_probs")))
    second.start()
    time.sleep(0.05)
    source.release.set()
    first.join(10)
    second.join(10)
    assert len(got) == 2 and got[0] is got[1]
    assert source.loads == [("log_probs", None)]


def test_the_read_ahead_stays_one_stage_ahead():
    source = source_of(twelve_case())
    part = _part(source)
    whole = Cohort([part], PayloadCache())
    ahead = _ReadAhead(whole, [[(part, "loss_mask")], [(part, "old_log_probs")], [(part, "log_probs")]])
    try:
        _wait_for(lambda: source.loaded_names() == {"loss_mask"})
        time.sleep(0.2)
        assert source.loaded_names() == {"loss_mask"}   # stage 1's payloads wait until stage 0 starts
        ahead.reached(0)
        _wait_for(lambda: "old_log_probs" in source.loaded_names())
        time.sleep(0.2)
        assert "log_probs" not in source.loaded_names()
        ahead.reached(1)
        _wait_for(lambda: "log_probs" in source.loaded_names())
    finally:
        ahead.close()
    assert len(source.loads) == 3


class _Broken(MemorySource):
    """Every read of `log_probs` fails (a store that went away mid-replay)."""

    def load_payload(self, name, samples=None):
        if name == "log_probs":
            self.loads.append((name, None))
            raise OSError("connection reset")
        return super().load_payload(name, samples)


def test_a_read_that_fails_ahead_fails_its_stage_with_its_error_once():
    source = _Broken(*twelve_case())
    with pytest.raises(OSError, match="connection reset"):
        replay([source])
    assert source.loads.count(("log_probs", None)) == 1   # not tried again: a silent store costs one timeout
    assert not [t for t in threading.enumerate() if t.name == "replay-read-ahead"]   # none outlives the replay
