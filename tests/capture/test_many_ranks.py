"""One step captured by 64 producer ranks at once: the multi-rank COMPLETE protocol at scale.

Each producer is a writer as capture runs it (the writer process's code: its own `ObjectStore`, hence its own S3
client and connections, committing a `BundleJob` with `commit_bundle`), for its own rank's shard of the step.
`_run_producers` runs them as threads of this process or spread over spawned processes; they are released together
twice:
once before their payloads and documents are written, and once more right before each lands its COMPLETE.<r>,
so that all 64 rank markers land at the same moment. All of them then race for the FINALIZER claim before reading
any other rank's marker: the losers return at once, and only the claimant reads the markers, checks them and writes
the final COMPLETE (handing the claim back, should it find a rank not landed yet).
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
import traceback
from collections import Counter
from typing import Any

import pytest
import torch

from tests.capture.helpers import CONFIG, CURRENT, OLD, loss_scalars, microbatch_kwargs
from trajectory_replay.backends import open_backend
from trajectory_replay.backends.base import CREATED, DIFFERENT
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import (
    COMPLETE,
    FINALIZER,
    FINALIZER_FORMAT,
    RANK_MARKER,
    RankMarker,
    complete_key,
    finalizer_claim,
    finalizer_key,
    rank_key,
    read_complete,
    read_marker,
)
from trajectory_replay.bundle.status import COMPLETE_STATUS, FINALIZABLE, bundle_status
from trajectory_replay.capture.commit import BundleJob, commit_bundle
from trajectory_replay.capture.records import Columns, MicroBatch, Provenance, StepRecord, step_bundle_id
from trajectory_replay.replay import replay
from trajectory_replay.replay.validate import validate_bundle
from trajectory_replay.store import ObjectStore

WORLD = 64
DELETED = "deleted"
CLAIM_PATHS = {(DIFFERENT,), (CREATED,), (CREATED, DELETED), (CREATED, DELETED, CREATED), (CREATED, DELETED, DIFFERENT)}
"""What a producer may do with the FINALIZER claim, in order (see `markers.try_finalize`)."""
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
    return StepRecord(ROLLOUT, STEP, (micro_batch,), loss_scalars([0, 1]), CONFIG, {"actor_weight": 7}, Provenance())


def _produce(
    url: str,
    storage_options: dict,
    ranks: list[int],
    start: Any,
    landing: Any,
    results: Any,
    requests: Counter | None = None,
) -> None:
    """Run the producers of `ranks`, one thread each, and put one result per rank on `results`: (rank, error or
    None, outcome of its create of the final COMPLETE or None, what it did with the FINALIZER claim in order (the
    outcome of each create of it, DELETED for each delete), seconds). `requests`, when given, counts the S3
    requests the producers send, by (operation, where): where is "marker" for the rank markers, "claim" for
    FINALIZER, "COMPLETE" for the final marker, and "store" for every other key."""
    if url.startswith("s3://"):
        # Every producer gets a client of its own (its own connections); the producers of one process share the
        # botocore session, so that the service model is loaded once per process, not 64 times on two cores.
        from aiobotocore.session import AioSession

        session = AioSession()
        if requests is not None:
            lock, directory = threading.Lock(), f"/{step_bundle_id(ROLLOUT, STEP)}/"

            def count(model: Any, params: dict, **_: Any) -> None:
                key = f"/{params.get('Key', '')}"
                where = "store"
                if directory in key:
                    leaf = key.rsplit("/", 1)[1]
                    where = "marker" if RANK_MARKER.fullmatch(leaf) else "claim" if leaf == FINALIZER else leaf
                with lock:
                    requests[model.name, where] += 1

            session.register("before-parameter-build.s3", count)
        storage_options = {**storage_options, "session": session}

    def one(rank: int) -> None:
        began, final, claim = time.monotonic(), None, []
        try:
            store = ObjectStore.open(url, **storage_options)  # as the writer process opens it: a client of its own
            backend = store.backend
            if backend.capabilities.atomic_create:
                assert backend.probe().ok
            create_status, delete = backend.create_status, backend.delete
            name = step_bundle_id(ROLLOUT, STEP)
            marker, final_key, claim_key = rank_key(name, rank), complete_key(name), finalizer_key(name)

            def watched(key: str, data: bytes) -> str:
                nonlocal final
                if key == marker:
                    landing.wait(BARRIER_TIMEOUT)  # every rank lands its marker at the same moment
                status = create_status(key, data)
                if key == final_key:
                    final = status
                elif key == claim_key:
                    claim.append(status)
                return status

            def deleted(key: str) -> None:
                delete(key)
                if key == claim_key:
                    claim.append(DELETED)

            backend.create_status, backend.delete = watched, deleted  # create_if_absent goes through it
            job = BundleJob(url, _record(rank), rank=rank, expected_ranks=tuple(range(WORLD)))
            start.wait(BARRIER_TIMEOUT)
            commit_bundle(store, job)
            results.put((rank, None, final, claim, time.monotonic() - began))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            landing.abort()
            start.abort()
            results.put((rank, traceback.format_exc(), final, claim, time.monotonic() - began))

    threads = [threading.Thread(target=one, args=(r,), name=f"producer-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _run_producers(
    url: str, storage_options: dict, processes: int, requests: Counter | None = None
) -> dict[int, tuple]:
    """All WORLD producers, spread over `processes` spawned processes (0: threads of this process, whose S3
    requests `requests` counts)."""
    ctx = multiprocessing.get_context("spawn")
    start, landing, results = ctx.Barrier(WORLD), ctx.Barrier(WORLD), ctx.Queue()
    shares = [list(range(WORLD))[i :: max(processes, 1)] for i in range(max(processes, 1))]
    children = []
    if processes:
        for share in shares:
            child = ctx.Process(
                target=_produce, args=(url, storage_options, share, start, landing, results), daemon=True
            )
            child.start()
            children.append(child)
    else:
        _produce(url, storage_options, shares[0], start, landing, results, requests)
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + 3 * BARRIER_TIMEOUT
    while len(got) < WORLD and time.monotonic() < deadline:
        try:
            rank, error, final, claim, seconds = results.get(timeout=1.0)
        except Exception:  # queue.Empty: a child that died says so below
            if children and not any(c.is_alive() for c in children):
                break
            continue
        got[rank] = (error, final, claim, seconds)
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0, f"producer process {child.pid} exited with {child.exitcode}"
    return got


def _check(url: str, storage_options: dict, got: dict[int, tuple]) -> None:
    errors = {r: e for r, (e, *_) in got.items() if e}
    assert not errors, f"{len(errors)} producer(s) raised; first:\n{next(iter(errors.values()))}"
    assert sorted(got) == list(range(WORLD)), f"no result from ranks {sorted(set(range(WORLD)) - set(got))}"
    claims = {r: claim for r, (_, _, claim, _) in got.items()}
    finals = {r: final for r, (_, final, _, _) in got.items() if final is not None}
    # every producer tries the claim right after landing: a loser stops there; a claimant that found a rank missing
    # handed the claim back and, having then found every rank, tried it once more. Exactly one holds it at the end.
    assert set(map(tuple, claims.values())) <= CLAIM_PATHS, claims
    winners = [r for r, c in claims.items() if c[-1] == CREATED]
    assert len(winners) == 1, claims
    # only the claimant tries the final COMPLETE, and creates it
    assert finals == {winners[0]: CREATED}, finals

    name = step_bundle_id(ROLLOUT, STEP)
    backend = open_backend(url, **storage_options)
    keys = backend.list(f"{name}/")
    assert sorted(keys) == sorted(
        [complete_key(name), finalizer_key(name)] + [rank_key(name, r) for r in range(WORLD)]
    ), keys
    claim = backend.read(finalizer_key(name))
    assert claim == finalizer_claim(winners[0])
    assert json.loads(claim) == {"format": FINALIZER_FORMAT, "rank": winners[0]}
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
    assert state.finalizer_key == finalizer_key(name) and finalizer_key(name) not in state.marker_keys
    assert all(RANK_MARKER.fullmatch(k.rsplit("/", 1)[1]) for k in state.marker_keys if k != complete_key(name))

    report = validate_bundle(f"{url}/{name}", **storage_options)  # every byte of every rank, from the store
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
    claims = [claim for _, _, claim, _ in got.values()]
    finals = [final for _, final, _, _ in got.values()]
    return (
        f"{sum(bool(c) for c in claims)} producers tried the claim, {sum(c[:1] == [CREATED] for c in claims)} got "
        f"it, {sum(c.count(DELETED) for c in claims)} handed it back; "
        f"{sum(f is not None for f in finals)} tried the final COMPLETE, {finals.count(CREATED)} created it; "
        f"slowest producer {max(s for _, _, _, s in got.values()):.1f}s"
    )


def test_a_producer_that_loses_the_claim_commits_its_job_cleanly(local_root):
    """A capture job whose rank landed but whose FINALIZER claim another rank holds succeeds: its rank is in, and
    the bundle is finalizable (the claimant writes COMPLETE, or, should it die, the next reader does)."""
    name = step_bundle_id(ROLLOUT, STEP)
    store = ObjectStore.open(local_root)
    jobs = [BundleJob(local_root, _record(r), rank=r, expected_ranks=(0, 1)) for r in (0, 1)]
    assert commit_bundle(store, jobs[0]) == f"{local_root}/{name}"
    assert store.backend.create_if_absent(finalizer_key(name), finalizer_claim(0))
    assert commit_bundle(store, jobs[1]) == f"{local_root}/{name}"
    assert store.backend.exists(rank_key(name, 1)) and not store.backend.exists(complete_key(name))
    assert bundle_status(store.backend, name).status == FINALIZABLE
    sources = open_native(f"{local_root}/{name}")
    assert [s.rank for s in sources] == [0, 1] and replay(sources).passed


def test_64_ranks_of_one_step_to_local_disk(local_root):
    got = _run_producers(local_root, {}, 0)
    print(f"\n64 ranks to local disk: {_summary(got)}")
    _check(local_root, {}, got)


@pytest.mark.s3
def test_64_ranks_of_one_step_to_s3(s3_root):
    url, storage_options = s3_root
    requests: Counter = Counter()
    began = time.monotonic()
    got = _run_producers(url, storage_options, 0, requests)
    took = time.monotonic() - began
    in_bundle = {f"{op} {where}": n for (op, where), n in sorted(requests.items()) if where != "store"}
    print(
        f"\n64 ranks to S3: {_summary(got)}; all done in {took:.1f}s with {sum(requests.values())} requests, "
        f"{sum(in_bundle.values())} of them to the bundle's markers and claim {in_bundle}"
    )
    _check(url, storage_options, got)
    # Each producer lands its marker, looks for COMPLETE (one HEAD) and tries the claim: a loser reads the claim
    # (one GET) and stops. Only the claimant reads the rank markers (one GET each, no size request first) and their
    # documents (6 reads a rank), and writes COMPLETE; where it found a rank not landed yet it handed the claim back
    # and read on from that rank. Reading every marker before claiming cost 64 x 64 = 4,096 marker GETs, and with a
    # size request per marker and every producer checking every document, about 30,000 requests for this one
    # step. (The bounds leave room for hand-backs and the client's retries of a request.)
    marker_reads = requests["GetObject", "marker"] + requests["HeadObject", "marker"]
    assert marker_reads <= 3 * WORLD, in_bundle
    assert requests["PutObject", "marker"] <= WORLD + 8 and requests["PutObject", COMPLETE] <= 2, in_bundle
    assert requests["PutObject", "claim"] + requests["GetObject", "claim"] <= 3 * WORLD, in_bundle
    assert requests["HeadObject", COMPLETE] + requests["GetObject", COMPLETE] <= 2 * WORLD, in_bundle
    assert sum(in_bundle.values()) <= 10 * WORLD, in_bundle
    assert sum(requests.values()) <= 8_000, requests
