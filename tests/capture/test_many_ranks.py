"""One step captured by 64 producer ranks at once: the multi-rank COMPLETE protocol at scale.

Each producer is a writer as capture runs it (the writer process's code: its own `ObjectStore`, hence its own S3
client and connections, committing a `BundleJob` with `commit_bundle`), for its own rank's shard of the step.
`_run_producers` runs them as threads of this process or spread over spawned processes; they are released together twice:
once before their payloads and documents are written, and once more right before each lands its COMPLETE.<r>,
so that all 64 rank markers land at the same moment and every producer then races to write the final COMPLETE.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import traceback
from typing import Any

import torch

from trajectory_replay.backends import open_backend
from trajectory_replay.backends.base import CREATED, SAME
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import (
    COMPLETE, RANK_MARKER, RankMarker, complete_key, rank_key, read_complete, read_marker,
)
from trajectory_replay.bundle.status import COMPLETE_STATUS, bundle_status
from trajectory_replay.capture.commit import BundleJob, commit_bundle
from trajectory_replay.capture.records import Columns, MicroBatch, Provenance, StepRecord, step_bundle_id
from trajectory_replay.replay import replay
from trajectory_replay.replay.validate import validate_bundle
from trajectory_replay.store import ObjectStore
from tests.capture.helpers import CONFIG, CURRENT, OLD, loss_scalars, microbatch_kwargs

WORLD = 64
ROLLOUT, STEP = 5, 3
BARRIER_TIMEOUT = 60.0


def _offset(rank: int) -> float:
    """A per-rank shift of the log-probs (exact in float32: ratios and losses stay the canonical ones), so that
    every rank's old and current log-probs are payloads of its own."""
    return -rank / WORLD


def _record(rank: int) -> StepRecord:
    """Rank `rank`'s shard of step (ROLLOUT, STEP): two samples of its own prompt group, one micro-batch."""
    kwargs = microbatch_kwargs([0, 1])
    kwargs.update(sample_ids=[f"s-{2 * rank}", f"s-{2 * rank + 1}"], group_index=[rank, rank])
    shift = _offset(rank)
    kwargs["old_log_probs"] = kwargs["old_log_probs"] + shift
    kwargs["log_probs"] = kwargs["log_probs"] + shift
    payload_names = ("old_log_probs", "log_probs", "entropy", "advantages")
    payloads = {name: kwargs.pop(name) for name in payload_names}
    columns = Columns(**kwargs)
    micro_batch = MicroBatch(f"mb-{rank:04d}", columns, payloads)
    return StepRecord(ROLLOUT, STEP, (micro_batch,), loss_scalars([0, 1]), CONFIG, {"actor_weight": 7},
                      Provenance())


def _produce(url: str, storage_options: dict, ranks: list[int], start: Any, landing: Any, results: Any) -> None:
    """Run the producers of `ranks`, one thread each, and put one result per rank on `results`:
    (rank, error or None, outcome of its create of the final COMPLETE or None, seconds)."""

    if url.startswith("s3://"):
        # Every producer gets a client of its own (its own connections); the producers of one process share the
        # botocore session, so that the service model is loaded once per process, not 64 times on two cores.
        from aiobotocore.session import AioSession

        storage_options = {**storage_options, "session": AioSession()}

    def one(rank: int) -> None:
        began, final = time.monotonic(), None
        try:
            store = ObjectStore.open(url, **storage_options)   # as the writer process opens it: a client of its own
            backend = store.backend
            if backend.capabilities.atomic_create:
                assert backend.probe().ok
            create_status = backend.create_status
            marker = f"{step_bundle_id(ROLLOUT, STEP)}/{COMPLETE}.{rank}"
            final_key = complete_key(step_bundle_id(ROLLOUT, STEP))

            def watched(key: str, data: bytes) -> str:
                nonlocal final
                if key == marker:
                    landing.wait(BARRIER_TIMEOUT)   # every rank lands its marker at the same moment
                status = create_status(key, data)
                if key == final_key:
                    final = status
                return status

            backend.create_status = watched   # create_if_absent goes through it
            job = BundleJob(url, _record(rank), rank=rank, expected_ranks=tuple(range(WORLD)))
            start.wait(BARRIER_TIMEOUT)
            commit_bundle(store, job)
            results.put((rank, None, final, time.monotonic() - began))
        except BaseException:   # noqa: BLE001 - reported to the test, which fails on it
            landing.abort()
            start.abort()
            results.put((rank, traceback.format_exc(), final, time.monotonic() - began))

    threads = [threading.Thread(target=one, args=(r,), name=f"producer-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _run_producers(url: str, storage_options: dict, processes: int) -> dict[int, tuple]:
    """All WORLD producers, spread over `processes` spawned processes (0: threads of this process)."""
    ctx = multiprocessing.get_context("spawn")
    start, landing, results = ctx.Barrier(WORLD), ctx.Barrier(WORLD), ctx.Queue()
    shares = [list(range(WORLD))[i::max(processes, 1)] for i in range(max(processes, 1))]
    children = []
    if processes:
        for share in shares:
            child = ctx.Process(target=_produce, args=(url, storage_options, share, start, landing, results),
                                daemon=True)
            child.start()
            children.append(child)
    else:
        _produce(url, storage_options, shares[0], start, landing, results)
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + 3 * BARRIER_TIMEOUT
    while len(got) < WORLD and time.monotonic() < deadline:
        try:
            rank, error, final, seconds = results.get(timeout=1.0)
        except Exception:   # queue.Empty: a child that died says so below
            if children and not any(c.is_alive() for c in children):
                break
            continue
        got[rank] = (error, final, seconds)
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0, f"producer process {child.pid} exited with {child.exitcode}"
    return got


def _check(url: str, storage_options: dict, got: dict[int, tuple]) -> None:
    errors = {r: e for r, (e, _, _) in got.items() if e}
    assert not errors, f"{len(errors)} producer(s) raised; first:\n{next(iter(errors.values()))}"
    assert sorted(got) == list(range(WORLD)), f"no result from ranks {sorted(set(range(WORLD)) - set(got))}"
    outcomes = [final for _, final, _ in got.values()]
    attempts = [o for o in outcomes if o is not None]
    # the final COMPLETE is created by exactly one producer; every other one that tried found the same bytes
    assert attempts.count(CREATED) == 1, outcomes
    assert set(attempts) <= {CREATED, SAME}, outcomes

    name = step_bundle_id(ROLLOUT, STEP)
    backend = open_backend(url, **storage_options)
    keys = backend.list(f"{name}/")
    assert sorted(keys) == sorted([complete_key(name)] + [rank_key(name, r) for r in range(WORLD)]), keys
    final = read_complete(backend, name)
    assert final is not None and final.multi_rank and final.bundle_id == name
    assert final.expected_ranks == list(range(WORLD))
    assert sorted(final.shards, key=int) == [str(r) for r in range(WORLD)]
    for r in range(WORLD):
        marker = read_marker(backend, rank_key(name, r), RankMarker)
        assert marker is not None and marker.rank == r and marker.expected_ranks == list(range(WORLD))
        assert final.shards[str(r)] == marker.documents, f"COMPLETE pins other documents for rank {r}"
    state = bundle_status(backend, name)
    assert state is not None and state.status == COMPLETE_STATUS and state.landed_ranks == list(range(WORLD))
    assert all(RANK_MARKER.fullmatch(k.rsplit("/", 1)[1]) for k in keys if not k.endswith(f"/{COMPLETE}"))

    report = validate_bundle(f"{url}/{name}", **storage_options)   # every byte of every rank, from the store
    assert report.valid, report.problems
    assert sorted(report.ranks) == list(range(WORLD)) and report.payloads_checked >= WORLD * 5

    sources = open_native(f"{url}/{name}", **storage_options)
    assert [s.rank for s in sources] == list(range(WORLD))
    for source in sources:
        r = source.rank
        assert [s.sample_id for s in source.index.samples] == [f"s-{2 * r}", f"s-{2 * r + 1}"]
        assert torch.equal(source.load_payload("old_log_probs"), torch.full((4,), OLD + _offset(r)))
        assert torch.equal(source.load_payload("log_probs"), torch.full((4,), CURRENT + _offset(r)))
    report = replay(sources)
    assert report.passed, [(s.stage, s.status, s.message) for s in report.stages]


def _summary(got: dict[int, tuple]) -> str:
    finals = [final for _, final, _ in got.values()]
    return (f"{sum(f is not None for f in finals)} producers tried the final COMPLETE, "
            f"{finals.count(CREATED)} created it; slowest producer {max(s for _, _, s in got.values()):.1f}s")


def test_64_ranks_of_one_step_to_local_disk(local_root):
    got = _run_producers(local_root, {}, 0)
    print(f"\n64 ranks to local disk: {_summary(got)}")
    _check(local_root, {}, got)
