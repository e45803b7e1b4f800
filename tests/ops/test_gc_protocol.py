"""The writer/gc protocol: a bundle is marked complete only if every object it references exists, whatever gc
does meanwhile; a killed gc stalls no writer for long; gc deletes only its own layout, never through a link out
of the root, and never on a guess about a bundle it cannot read."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import reachable, renamed_case, validates
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.bundle.status import scan_bundles
from trajectory_replay.cli import app
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.replay.validate import validate_sources
from trajectory_replay.store import ObjectStore, object_key
from trajectory_replay.store.digest import blob_ref_key
from trajectory_replay.store.layout import INFLIGHT_DIR, OBJECTS_DIR, REFS_DIR
from trajectory_replay.store.liveness import DEAD_LEASE_AGE, LEASE_PREFIX, SweepLease

REPO = Path(__file__).resolve().parents[2]
STRESS_SECONDS = 8.0
"""Per backend, kept short for CI: 13 rounds of 0.6 s. Against the protocol before reused blobs were listed
with their chunks, this shape committed broken bundles in 5 of 9 local runs (the earlier 10 s of 1.2 s rounds:
in 1 of 9); run `tests/ops/gc_stress.py` longer by hand for a deeper soak."""


def _crashed(root: str, name: str = "crashed") -> BundleWriter:
    """A writer that stored the canonical payloads plus one of its own, then gave up."""
    case = renamed_case(name)
    writer = BundleWriter(f"{root}/{name}", case.manifest, case.index, case.expected)
    writer.write_payloads({**case.payloads, "only_mine": torch.arange(5000, dtype=torch.float32)})
    writer.abort()
    return writer


# ---- 1. gc during writes --------------------------------------------------------------------------------


def test_a_reused_blob_whose_chunks_are_gone_is_stored_again(tmp_path):
    """The probe's deterministic case: the blob's ref and record are there, its chunks are not."""
    root = str(tmp_path / "store")
    case = renamed_case("first")
    writer = BundleWriter(f"{root}/first", case.manifest, case.index, case.expected)
    writer.write_payloads(case.payloads)
    writer.abort()
    backend = open_backend(root)
    store = ObjectStore(backend)
    removed = []
    for spec in writer.payloads.values():  # what a sweep stopped half-way leaves: refs and records, no chunks
        for chunk in store.record(spec.digest).chunks:
            backend.delete(object_key(chunk.digest))
            removed.append(object_key(chunk.digest))
    assert all(backend.exists(blob_ref_key(s.digest)) for s in writer.payloads.values())
    url = write_canonical(root, name="second")
    assert validates(url)
    assert all(backend.exists(k) for k in removed)


def test_commit_re_stores_what_an_overlapping_sweep_removed(tmp_path, caplog):
    """A sweep under way deletes an object right after the writer found it present; the writer waits for the
    sweep to end, finds the object gone, stores it again (its bytes are at hand) and commits a whole bundle."""
    root = str(tmp_path / "store")
    write_canonical(root, name="old")  # documents and payloads this bundle will reuse
    backend = open_backend(root)
    expected_doc = next(iter(scan_bundles(backend))).complete.documents().expected
    victim = object_key(ObjectStore(backend).record(expected_doc.digest).chunks[0].digest)
    backend.delete(complete_key("old"))  # now garbage, as the sweep sees it
    case = renamed_case("new")
    writer = BundleWriter(f"{root}/new", case.manifest, case.index, case.expected)
    lease = SweepLease(backend)
    real_commit = writer.store.commit_many

    def commit_then_sweep_strikes(plans):
        refs = real_commit(plans)
        if lease._thread is None and any(p.ref.digest == expected_doc.digest for p in plans):
            lease.acquire()
            backend.delete(victim)
            import threading

            threading.Timer(0.5, lease.release).start()
        return refs

    writer.store.commit_many = commit_then_sweep_strikes
    with caplog.at_level(logging.WARNING):
        writer.finalize(payloads=case.payloads)
    assert backend.exists(victim) and validates(f"{root}/new")
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for gc sweep" in m for m in messages)
    assert any("storing them again" in m for m in messages)


def _stress(root: str, options: dict, env: dict, seconds: float) -> list[dict]:
    roles = [("gc", "0"), ("aborter", "0"), ("writer", "1"), ("writer", "2")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.ops.gc_stress",
                role,
                root,
                "stdin",
                str(seconds),
                json.dumps(options),
                ident,
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role, ident in roles
    ]
    try:
        for proc in procs:  # the clocks start together once every process has imported and opened the store
            assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)[1][-3000:]
        start = time.time() + 0.1
        for proc in procs:
            proc.stdin.write(f"{start}\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=seconds + 120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # none is left waiting for a start that will not come
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(results)
    return results


def _check_stress(root: str, options: dict, results: list[dict]) -> None:
    by_role = {(r["role"], r["id"]): r for r in results}
    completed = sum(r["completed"] for r in results)
    assert by_role[("gc", "0")]["removed"] > 0 and by_role[("aborter", "0")]["aborted"] >= 3
    assert completed >= 2, results
    states = [s for s in scan_bundles(open_backend(root, **options)) if s.complete is not None and s.name != "seed"]
    assert len(states) == completed, (len(states), results)

    def validate(name: str):
        url = f"{root}/{name}"
        return validate_sources(url, open_sources(url, cache=False, **options))

    names = [s.name for s in states]
    with ThreadPoolExecutor(max_workers=4) as pool:  # the bundles are independent; a remote store's reads wait
        reports = dict(zip(names, pool.map(validate, names)))
    invalid = [(name, report.problems[:1]) for name, report in reports.items() if not report.valid]
    assert invalid == [], invalid


@pytest.mark.timeout(240)
def test_gc_stress_local(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root, name="seed")
    results = _stress(root, {}, dict(os.environ), seconds=STRESS_SECONDS)
    _check_stress(root, {}, results)


@pytest.mark.s3
@pytest.mark.timeout(240)
def test_gc_stress_s3(s3_root, s3_server):
    url, options = s3_root
    write_canonical(url, name="seed", storage_options=options)
    results = _stress(url, options, {**os.environ, **s3_server.env()}, seconds=STRESS_SECONDS)
    _check_stress(url, options, results)


# ---- 2. a killed gc does not stall writers -------------------------------------------------------------

_HOLD_LEASE = textwrap.dedent("""
    import sys, time
    from trajectory_replay.backends import open_backend
    from trajectory_replay.store.liveness import SweepLease
    lease = SweepLease(open_backend(sys.argv[1]), seconds=float(sys.argv[2]), renew_every=0.3)
    lease.acquire()
    print(lease.key, flush=True)
    time.sleep(float(sys.argv[3]))
    lease.release()
""")


def _lease_holder(root: str, seconds: float, hold: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LEASE, root, str(seconds), str(hold)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    key = proc.stdout.readline().strip()
    assert key.startswith(LEASE_PREFIX), key
    return proc, key


def test_a_killed_gc_stalls_writers_only_until_its_lease_expires(tmp_path, caplog):
    root = str(tmp_path / "store")
    started = time.monotonic()
    write_canonical(str(tmp_path / "quiet"))  # with no lease: what a write costs on this host now
    baseline = time.monotonic() - started
    open_backend(root).write("seed", b"")
    proc, key = _lease_holder(root, seconds=2.0, hold=600)
    os.kill(proc.pid, signal.SIGKILL)  # a gc killed mid-sweep: its lease stays, nobody renews it
    proc.wait()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        url = write_canonical(root)
    waited = time.monotonic() - started
    # at most the rest of the 2 s lease (twice over, for timers late on a loaded host), and the write itself
    assert 0.5 < waited < 2 * 2.0 + 3 * baseline, (waited, baseline)
    assert validates(url)
    lines = [r.getMessage() for r in caplog.records if "waiting for gc sweep" in r.getMessage()]
    assert len(lines) == 1 and key in lines[0] and "until" in lines[0]
    # the next gc removes the dead lease once it is well past its expiry
    time.sleep(max(0.0, 2.0 + DEAD_LEASE_AGE + 0.5 - waited))
    report = collect_garbage(root, grace="0s")
    assert report.dead_leases_removed == [key] and not open_backend(root).exists(key)


def test_a_live_gc_keeps_its_lease_by_heartbeat(tmp_path):
    root = str(tmp_path / "store")
    open_backend(root).write("seed", b"")
    proc, _key = _lease_holder(root, seconds=1.5, hold=3.5)  # lives past its lease's first expiry
    started = time.monotonic()
    write_canonical(root)
    assert time.monotonic() - started > 2.5  # waited for the renewals, not for the first expiry alone
    assert proc.wait(timeout=30) == 0


def test_a_sweep_that_cannot_renew_its_lease_stops_deleting(tmp_path):
    from trajectory_replay.store.liveness import LeaseLostError

    lease = SweepLease(open_backend(str(tmp_path)), seconds=1.0, renew_every=60)
    lease.acquire()
    lease.check()
    time.sleep(0.6)
    with pytest.raises(LeaseLostError, match="stopped deleting"):
        lease.check()
    lease.release()


# ---- 3. gc deletes only its own objects ---------------------------------------------------------------


@pytest.mark.parametrize("linked", [OBJECTS_DIR, REFS_DIR, INFLIGHT_DIR])
def test_gc_never_deletes_through_a_link_out_of_the_root(tmp_path, linked):
    from typer.testing import CliRunner

    root = tmp_path / "store"
    write_canonical(str(root))
    _crashed(str(root))
    outside = tmp_path / "outside"
    (root / linked).rename(outside)
    (root / linked).symlink_to(outside)
    before = sorted(p for p in outside.rglob("*"))
    result = CliRunner().invoke(app, ["gc", str(root), "--grace", "0s"])
    assert result.exit_code == 1 and "symbolic link out of the store root" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(p for p in outside.rglob("*")) == before


def test_gc_ignores_keys_that_are_not_its_layout_and_links_inside_it(tmp_path):
    root = tmp_path / "store"
    write_canonical(str(root))
    _crashed(str(root))
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    strangers = [
        root / OBJECTS_DIR / "notes.txt",
        root / OBJECTS_DIR / "ab" / "not-a-digest",
        root / REFS_DIR / "README",
        root / INFLIGHT_DIR / "someone-else.json",
    ]
    for path in strangers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    link = root / object_key("blake3:cd" + "0" * 62)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    old = time.time() - 10 * 86400
    for path in strangers:
        os.utime(path, (old, old))
    report = collect_garbage(str(root), grace="0s")
    assert report.objects_removed > 0
    assert all(p.exists() for p in strangers) and link.is_symlink() and victim.read_text() == "keep me"
    assert not any("notes" in k or "README" in k or "someone-else" in k for k in report.removed)


def test_dry_run_lists_what_it_would_delete(tmp_path):
    from typer.testing import CliRunner

    root = str(tmp_path / "store")
    write_canonical(root)
    writer = _crashed(root)
    backend = open_backend(root)
    garbage = {
        k for d in writer.inflight.digests for k in (object_key(d), blob_ref_key(d)) if backend.exists(k)
    } - reachable(root, "b-00001")
    result = CliRunner().invoke(app, ["gc", root, "--grace", "0s", "--dry-run"])
    assert result.exit_code == 0, result.output
    listed = {line.strip() for line in result.output.splitlines() if line.startswith("    ")}
    assert listed == garbage and all(backend.exists(k) for k in garbage)


def _damage_marker(root: str, name: str, text: bytes) -> None:
    path = Path(root) / complete_key(name)
    path.chmod(0o644)
    path.write_bytes(text)


def test_an_unparsable_bundle_keeps_what_it_names_and_the_sweep_goes_on(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, name="damaged", buggy=True)
    needed = reachable(root, "damaged") - {complete_key("damaged")}
    raw = (Path(root) / complete_key("damaged")).read_bytes()
    _damage_marker(root, "damaged", raw.replace(b'"shards"', b'"shards":"../../x","x"'))
    writer = _crashed(root)
    backend = open_backend(root)
    own = {object_key(d) for d in writer.inflight.digests} - needed - reachable(root, "b-00001")
    own = {k for k in own if backend.exists(k)}
    assert own
    report = collect_garbage(root, grace="0s")
    assert any(p.startswith("damaged: ") for p in report.unreadable_bundles) and not report.kept_everything
    assert all(backend.exists(k) for k in needed), "a key the damaged bundle names was removed"
    assert not any(backend.exists(k) for k in own)
    assert "unreadable bundle damaged" in report.render_text()
    assert validates(f"{root}/b-00001")


def test_a_bundle_whose_references_cannot_be_known_keeps_every_object(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, name="damaged", buggy=True)
    _damage_marker(root, "damaged", b"\x00garbage, not a marker")
    writer = _crashed(root)
    backend = open_backend(root)
    keys = set(backend.list(f"{OBJECTS_DIR}/")) | set(backend.list(f"{REFS_DIR}/"))
    report = collect_garbage(root, grace="0s")
    assert report.kept_everything and report.objects_removed == 0 and report.refs_removed == 0
    assert set(backend.list(f"{OBJECTS_DIR}/")) | set(backend.list(f"{REFS_DIR}/")) == keys
    assert any(p.startswith("damaged: ") for p in report.unreadable_bundles)
    assert writer.inflight.key  # the crashed capture's garbage waits for the damage to be dealt with


def test_a_bundle_with_an_unreadable_manifest_keeps_every_object(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, name="damaged", buggy=True)
    backend = open_backend(root)
    state = next(s for s in scan_bundles(backend) if s.name == "damaged")
    manifest = state.complete.documents().manifest
    for chunk in ObjectStore(backend).record(manifest.digest).chunks:
        backend.delete(object_key(chunk.digest))
    _crashed(root)
    report = collect_garbage(root, grace="0s")
    assert report.kept_everything and report.objects_removed == 0
    assert any(p.startswith("damaged: ") for p in report.unreadable_bundles)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_a_truncated_complete_keeps_every_object(tmp_path, cut):
    """A COMPLETE cut short still holds some of its digests, never surely all: what it named cannot be known."""
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, name="damaged", buggy=True)
    needed = reachable(root, "damaged") - {complete_key("damaged")}
    raw = (Path(root) / complete_key("damaged")).read_bytes()
    _damage_marker(root, "damaged", raw[: int(len(raw) * cut)])
    _crashed(root)
    backend = open_backend(root)
    keys = set(backend.list(f"{OBJECTS_DIR}/")) | set(backend.list(f"{REFS_DIR}/"))
    report = collect_garbage(root, grace="0s")
    assert report.kept_everything and report.objects_removed == 0 and report.refs_removed == 0
    assert all(backend.exists(k) for k in needed), "a key the damaged bundle names was removed"
    assert set(backend.list(f"{OBJECTS_DIR}/")) | set(backend.list(f"{REFS_DIR}/")) == keys
    [named] = [p for p in report.unreadable_bundles if p.startswith("damaged: ")]
    assert "damaged/COMPLETE: not valid JSON" in named
    assert "kept every object and ref: an unreadable bundle might reference any of them" in report.render_text()
