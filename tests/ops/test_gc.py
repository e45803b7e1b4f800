"""gc: crashed captures are collected, captures in progress and other bundles are never touched,
abandoned cohorts go, and a gc loop with --grace 0s racing a multi-rank capture breaks nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import rank_writer, reachable, renamed_case, validates, write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.errors import UsageError
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.gc import collect_garbage, parse_duration
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.store.digest import blob_ref_key, object_key
from trajectory_replay.store.layout import OBJECTS_DIR


def test_parse_duration():
    assert parse_duration("0s") == 0 and parse_duration("30m") == 1800 and parse_duration("24h") == 86400
    assert parse_duration("7d") == 7 * 86400 and parse_duration("1h30m") == 5400
    for bad in ("", "5", "5x", "-1h", "h", "1h 2m", "1.h"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def _crashed_capture(root: str, how: str) -> BundleWriter:
    """A writer that stored payloads (some shared, one of its own) and its documents, then died."""
    case = renamed_case("crashed")
    writer = BundleWriter(
        f"{root}/crashed", case.manifest, case.index, case.expected, inflight_ttl=0.0 if how == "expired" else 3600.0
    )
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    writer.write_payload("only_mine", torch.arange(5000, dtype=torch.float32))
    writer._write_documents()  # the last step before the markers: then the process dies
    if how == "removed":
        writer.inflight.remove()
    return writer


@pytest.mark.parametrize("how", ["removed", "expired"])
def test_crashed_capture_is_collected_and_other_bundles_stay_valid(tmp_path, how):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, buggy=True)
    keep = reachable(root, "b-00001") | reachable(root, "b-00065")
    writer = _crashed_capture(root, how)
    backend = open_backend(root)
    unshared = {
        k for d in writer.inflight.digests for k in (object_key(d), blob_ref_key(d)) if backend.exists(k)
    } - keep
    assert unshared
    dry = collect_garbage(root, grace="0s", dry_run=True)
    assert set(dry.removed) >= unshared and all(backend.exists(k) for k in unshared)
    report = collect_garbage(root, grace="0s")
    assert set(report.removed) - {writer.inflight.key} == unshared
    assert report.bytes_freed > 20000 and report.objects_removed > 0 and report.refs_removed > 0
    assert not any(backend.exists(k) for k in unshared)
    assert backend.exists(writer.inflight.key) is False
    assert report.inflight_removed == (1 if how == "expired" else 0)
    assert all(backend.exists(k) for k in keep)
    assert validates(f"{root}/b-00001") and validates(f"{root}/b-00065")
    fsck = check_store(root)
    assert fsck.healthy and not fsck.orphaned
    assert collect_garbage(root, grace="0s").removed == []


def test_capture_in_progress_survives_grace_zero(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    case = renamed_case("in-progress")
    writer = BundleWriter(f"{root}/in-progress", case.manifest, case.index, case.expected)
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    # 2-D: a 1-D payload is per-token, and one of 5000 rows for 8 tokens would make the bundle invalid
    writer.write_payload("only_mine", torch.arange(5000, dtype=torch.float32).reshape(50, 100))
    backend = open_backend(root)
    listed = [object_key(d) for d in writer.inflight.digests if backend.exists(object_key(d))]
    report = collect_garbage(root, grace="0s")
    assert report.removed == [] and report.active_captures == 1 and report.protected_by_inflight > 0
    assert all(backend.exists(k) for k in listed)
    writer.finalize()
    assert validates(f"{root}/in-progress")
    assert collect_garbage(root, grace="0s").removed == []


def test_grace_keeps_young_garbage_and_abandoned_cohorts_go(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_ranks(root, "cohort", land=[1], expected_ranks=[0, 1])
    _crashed_capture(root, "removed")
    young = collect_garbage(root)  # default 24h: everything is younger
    assert young.removed == [] and young.too_young > 0 and young.abandoned_bundles == []
    assert [b.status for b in list_bundles(root).bundles] == ["complete", "incomplete"]
    old = collect_garbage(root, grace="0s")
    assert old.abandoned_bundles == ["cohort"] and old.markers_removed == 1
    assert [b.name for b in list_bundles(root).bundles] == ["b-00001"]
    assert validates(f"{root}/b-00001")
    assert check_store(root).orphaned == []


def test_gc_loop_with_grace_zero_races_a_multirank_capture(tmp_path):
    """Ranks reuse blobs and chunks left orphaned in the store while gc --grace 0s runs in a loop."""
    root = str(tmp_path / "store")
    write_canonical(root)
    stop = threading.Event()
    errors: list[BaseException] = []
    runs = []

    def gc_loop():
        while not stop.is_set():
            try:
                runs.append(collect_garbage(root, grace=0.0))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    completed = []
    for round_ in range(3):
        orphan = _crashed_capture(root, "removed")  # orphans with the same payload bytes
        name = f"mr-{round_}"
        case = renamed_case(name)
        writers = [rank_writer(root, name, r, [0, 1, 2, 3]) for r in range(4)]
        started = threading.Barrier(4)

        def capture(writer, case=case, started=started):
            try:
                items = list(case.payloads.items())
                writer.write_payload(*items[0])
                started.wait(timeout=30)  # every rank has its in-flight record before any lands
                for payload, tensor in items[1:]:
                    writer.write_payload(payload, tensor)
                writer.finalize()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        gc_thread = threading.Thread(target=gc_loop)
        gc_thread.start()
        threads = [threading.Thread(target=capture, args=(w,)) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        stop.set()
        gc_thread.join(timeout=60)
        stop.clear()
        assert not errors, errors
        assert orphan is not None
        if open_backend(root).exists(complete_key(name)):
            completed.append(name)
    assert len(runs) >= 3 and sum(len(r.removed) for r in runs) > 0
    assert completed, "no cohort completed"
    for name in completed:
        from trajectory_replay.bundle import open_sources

        assert len(open_sources(f"{root}/{name}")) == 4
        assert validates(f"{root}/{name}")
    assert validates(f"{root}/b-00001")
    collect_garbage(root, grace="0s")
    for name in completed:
        assert validates(f"{root}/{name}")


def test_gc_on_s3(s3_root):
    url, options = s3_root
    write_canonical(url, storage_options=options)
    case = renamed_case("crashed")
    writer = BundleWriter(f"{url}/crashed", case.manifest, case.index, case.expected, **options)
    writer.write_payload("only_mine", torch.arange(3000, dtype=torch.float32))
    listed = set(writer.inflight.digests)
    assert collect_garbage(url, grace="0s", **options).removed == []  # in progress
    writer.abort()
    report = collect_garbage(url, grace="0s", **options)
    assert {k.rsplit("/", 1)[1] for k in report.removed} == {d[7:] for d in listed}
    assert validates(f"{url}/b-00001", **options, cache=False)


def test_reused_blob_removed_between_check_and_listing_is_stored_again(tmp_path):
    """ObjectStore.put: gc removes a reused blob after plan() saw it and before the writer listed it."""
    from trajectory_replay.store import ObjectStore

    root = str(tmp_path / "store")
    store = ObjectStore(open_backend(root))
    data = torch.arange(20000, dtype=torch.float32).numpy().tobytes()
    store.put(data)  # an orphan: no bundle names it
    calls = []

    def list_then_gc_strikes(plan):
        calls.append(plan.existing)
        if len(calls) == 1:
            assert collect_garbage(root, grace="0s").objects_removed > 0  # this capture had listed nothing yet

    ref = store.put(data, before_write=list_then_gc_strikes)
    assert calls == [True, False]  # re-planned and listed again as a new blob
    assert store.get(ref) == data and store.has(ref.digest)


def test_a_capture_that_starts_reusing_inside_a_batch_window_is_reported(tmp_path, monkeypatch):
    """The residual race, forced: a capture lists an orphan after gc's last re-read and before its delete."""
    import uuid

    from trajectory_replay.ops import gc as gc_mod
    from trajectory_replay.store.digest import digest_from_key
    from trajectory_replay.store.liveness import InflightRecord

    root = str(tmp_path / "store")
    write_canonical(root)
    writer = _crashed_capture(root, "removed")
    backend = open_backend(root)
    target = next(
        object_key(d)
        for d in writer.inflight.digests
        if backend.exists(object_key(d)) and object_key(d) not in reachable(root, "b-00001")
    )
    real_delete = gc_mod._Collector._delete

    def delete_after_a_capture_listed(self, keys):
        if target in keys:
            InflightRecord(backend, uuid.uuid4().hex, "late", ttl=3600).add([digest_from_key(target)])
        real_delete(self, keys)

    monkeypatch.setattr(gc_mod._Collector, "_delete", delete_after_a_capture_listed)
    report = collect_garbage(root, grace="0s")
    assert target in report.conflicts and "WARNING" in report.render_text()


def test_writer_refuses_to_commit_when_a_sweep_removed_what_it_no_longer_holds(tmp_path):
    """An object the writer listed and found present, removed by a sweep before the commit: a payload written
    earlier (whose bytes the writer no longer holds) cannot be stored again, so nothing is committed."""
    from trajectory_replay.bundle.writer import BundleWriter
    from trajectory_replay.errors import BundleError
    from trajectory_replay.replay import canonical_case
    from trajectory_replay.store.liveness import SweepLease

    root = str(tmp_path / "store")
    case = canonical_case(False)
    writer = BundleWriter(f"{root}/b-00001", case.manifest, case.index, case.expected)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    backend = open_backend(root)
    with SweepLease(backend):  # a sweep that deletes after the writer found the record present
        backend.delete(object_key(writer.payloads["kl"].record))
    with pytest.raises(BundleError, match="removed by a concurrent gc"):
        writer.finalize()
    assert not backend.exists(complete_key("b-00001"))


def test_writer_waits_for_a_running_sweep_before_committing(tmp_path, caplog):
    import json
    import logging
    import threading
    import time as _time

    from tests.bundle.helpers import write_canonical
    from trajectory_replay.store.liveness import LEASE_PREFIX

    root = str(tmp_path / "store")
    backend = open_backend(root)
    lease = f"{LEASE_PREFIX}{'a' * 32}"
    backend.write(lease, json.dumps({"expires": _time.time() + 60}).encode())
    threading.Timer(0.6, lambda: backend.delete(lease)).start()
    started = _time.monotonic()
    with caplog.at_level(logging.WARNING):
        write_canonical(root)
    assert _time.monotonic() - started >= 0.5
    assert backend.exists(complete_key("b-00001"))
    waits = [r.getMessage() for r in caplog.records if "waiting for gc sweep" in r.getMessage()]
    assert len(waits) == 1 and lease in waits[0] and "until" in waits[0]

    def writing(name: str) -> float:
        started = _time.monotonic()
        write_canonical(root, name=name)
        return _time.monotonic() - started

    before = writing("b-1")  # with no lease: what a write costs on this host now
    backend.write(f"{LEASE_PREFIX}{'d' * 32}", json.dumps({"expires": _time.time() - 1}).encode())
    elapsed = writing("b-2")  # an expired lease (its gc died) is not waited for
    backend.delete(f"{LEASE_PREFIX}{'d' * 32}")
    baseline = max(before, writing("b-3"))
    assert backend.exists(complete_key("b-2")) and elapsed < 3 * baseline, (elapsed, baseline)


def test_leftover_temporary_files_go_once_old_and_never_through_a_link(tmp_path):
    """A writer killed between writing a temporary file and linking it leaves the file; gc removes it once it is
    older than TEMPORARY_MIN_AGE (a write in progress is never that old), lists it with --dry-run, and never
    reaches through a linked directory."""
    import os
    import time

    from trajectory_replay.ops.gc import TEMPORARY_MIN_AGE

    root = tmp_path / "store"
    write_canonical(str(root))
    old = time.time() - TEMPORARY_MIN_AGE - 60
    leftover_key = f"{OBJECTS_DIR}/ab/.tmp-deadbeef.0123456789ab"
    leftover = root / leftover_key
    young = root / "b-00001" / ".tmp-COMPLETE.fedcba987654"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    for path in (leftover, young):
        path.write_bytes(b"partial")
    os.utime(leftover, (old, old))
    outside = tmp_path / "outside"
    outside.mkdir()
    foreign = outside / ".tmp-theirs.000000000000"
    foreign.write_bytes(b"not ours")
    os.utime(foreign, (old, old))
    (root / "b-00001" / "linked").symlink_to(outside)

    dry = collect_garbage(str(root), grace="0s", dry_run=True)
    assert dry.temporaries_removed == [leftover_key]
    assert leftover_key in dry.render_text()
    assert leftover.exists()

    report = collect_garbage(str(root), grace="0s")
    assert report.temporaries_removed == [leftover_key]
    assert "1 partial writes left by killed writers" in report.render_text()
    assert not leftover.exists() and young.exists() and foreign.exists()
    assert validates(str(root / "b-00001"))
