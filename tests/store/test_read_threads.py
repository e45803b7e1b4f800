"""Where a read's work runs: a store's pools fan out, except for CPU work on a thread given one core of its own.

Replay's read-ahead thread reads the next block while the kernels compute on the other cores; reading a local file
and hashing it are CPU work, so under `one_core_for_cpu_work` they stay on that thread instead of fanning out to
pool threads that would take the kernels' cores. A pool that waits on a remote store keeps fanning out.
"""

from __future__ import annotations

import os
import threading

from trajectory_replay.backends.base import WorkerPool
from trajectory_replay.cpus import one_core_for_cpu_work
from trajectory_replay.store import ObjectStore


def _threads_of(pool: WorkerPool, items: int = 16) -> set[int]:
    """The threads the pool ran `items` items on."""
    return set(pool.map(lambda _: threading.get_ident(), range(items)))


def test_cpu_work_runs_on_the_calling_thread_only_inside_the_context():
    here = threading.get_ident()
    cpu, remote = WorkerPool(4, cpu_work=True), WorkerPool(4, cpu_work=False)
    assert here not in _threads_of(cpu) and here not in _threads_of(remote)
    with one_core_for_cpu_work():
        assert _threads_of(cpu) == {here}
        assert here not in _threads_of(remote)  # waiting on a server: still concurrent
        with one_core_for_cpu_work():
            pass
        assert _threads_of(cpu) == {here}  # a nested context leaves the outer one in force
    assert here not in _threads_of(cpu)  # and leaving it restores the fan-out


def test_a_local_ranged_read_stays_on_the_reading_thread(tmp_path):
    store = ObjectStore.open(str(tmp_path / "s"))
    data = os.urandom(2 << 20)
    ref = store.put(data, cuts=range(0, len(data), 4096))  # content-defined chunks of about 160 KiB
    assert len(store.record(ref).chunks) > 4
    seen: list[int] = []
    read_into = store.backend.read_into

    def recording(key, target):
        seen.append(threading.get_ident())
        return read_into(key, target)

    store.backend.read_into = recording
    assert store.read_range(ref, 100, len(data) - 100) == data[100:-100]
    assert threading.get_ident() not in seen  # fanned out to the store's pool
    seen.clear()
    with one_core_for_cpu_work():
        assert store.read_range(ref, 100, len(data) - 100) == data[100:-100]
    assert seen and set(seen) == {threading.get_ident()}
