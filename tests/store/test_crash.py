"""A writer killed with SIGKILL at any step leaves exactly what that step implies, never a partial object at a
final key and never a COMPLETE marker, and gc removes what it left once nothing protects it.

The writer is a real child process on a real local store. It wraps its backend's mutations (the temporary
file, create-once, write and delete) so that every one of them runs under one lock and is announced; at the
chosen step (`<event>:<key prefix>:<n>`: the n-th such event on a key starting with the prefix) it reports
the key on stdout and stops, still holding the lock, so none of its threads can change the store any more.
The test then kills it: the kill lands exactly there, whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.errors import TrajectoryReplayError
from trajectory_replay.ops.gc import TEMPORARY_MIN_AGE, collect_garbage
from trajectory_replay.store import ObjectStore, hash_bytes, object_key
from trajectory_replay.store.digest import blob_ref_key
from trajectory_replay.store.layout import OBJECTS_DIR, REFS_DIR
from trajectory_replay.store.liveness import GC_PREFIX, INFLIGHT_PREFIX

REPO = Path(__file__).resolve().parents[2]
BUNDLE = "b-crash"
PUT_BYTES = 1 << 20
PUT_BOUNDARIES = list(range(128 << 10, PUT_BYTES, 128 << 10))  # eight chunks, so a kill can fall between them

CHILD = r"""
import json, random, sys, threading
from trajectory_replay.store import ObjectStore

root, scenario, stop, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
event, prefix, nth = stop.split(":") if stop != "done" else ("done", "", "0")
lock, seen = threading.RLock(), [0]

def pause_at(kind, key):
    if kind == event and key.startswith(prefix):
        seen[0] += 1
        if seen[0] == int(nth):
            print(json.dumps({"paused": kind, "key": key}), flush=True)
            threading.Event().wait()   # holding the lock: no thread of this writer changes the store again

def hooked(backend):
    temp_file, create, write, delete = backend._temp_file, backend._create, backend._write, backend._delete
    def _temp_file(key, data, durable=True):
        with lock:
            path = temp_file(key, data, durable)
            pause_at("temp", key)   # bytes on disk under a temporary name, not linked or renamed yet
            return path
    def _create(key, data):
        with lock:
            pause_at("create", key)
            return create(key, data)
    def _write(key, data, durable=True):
        with lock:
            pause_at("write", key)
            return write(key, data, durable)
    def _delete(key):
        with lock:
            pause_at("delete", key)
            return delete(key)
    backend._temp_file, backend._create, backend._write, backend._delete = _temp_file, _create, _write, _delete

store = ObjectStore.open(root)
hooked(store.backend)
if scenario == "put":
    size = int(sys.argv[5])
    store.put(random.Random(7).randbytes(size), boundaries=list(range(128 << 10, size, 128 << 10)))
else:
    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.replay.fixtures import canonical_case
    case = canonical_case(buggy=False)
    writer = BundleWriter(f"{root}/{sys.argv[5]}", case.manifest, case.index, case.expected, store=store,
                          inflight_ttl=ttl)
    writer.write_payloads(case.payloads)
    writer.finalize()
print(json.dumps({"paused": "done", "key": ""}), flush=True)
threading.Event().wait()
"""


def start_writer(root: Path, scenario: str, stop: str, *, ttl: float = 3600.0) -> subprocess.Popen:
    """The writer of `scenario` on `root`, running until it reaches `stop`."""
    extra = str(PUT_BYTES) if scenario == "put" else BUNDLE
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), scenario, stop, str(ttl), extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_when_stopped(proc: subprocess.Popen) -> str:
    """Wait until the writer reports its stop, SIGKILL it there; the key it stopped at ('' once it finished)."""
    stop = proc.args[5]
    try:
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, stderr
    assert line, f"the writer ended before reaching {stop}:\n{stderr}"
    reached = json.loads(line)
    assert reached["paused"] == stop.split(":")[0], reached
    return reached["key"]


def crash_at(root: Path, scenario: str, stop: str, *, ttl: float = 3600.0) -> str:
    return kill_when_stopped(start_writer(root, scenario, stop, ttl=ttl))


def keys_of(root: Path) -> set[str]:
    return set(ObjectStore.open(str(root)).backend.list(""))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".tmp-*") if p.is_file())


def assert_whole(root: Path, keys: set[str]) -> None:
    """Every object key holds bytes that hash to its name."""
    for key in keys:
        if key.startswith(f"{OBJECTS_DIR}/"):
            assert key == object_key(hash_bytes((root / key).read_bytes())), key


# ---- ObjectStore.put -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def put_plan(tmp_path_factory):
    """What the child's put writes: its chunks, record and ref (planned on a scratch store: nothing written)."""
    data = random.Random(7).randbytes(PUT_BYTES)
    plan = ObjectStore.open(str(tmp_path_factory.mktemp("plan"))).plan(data, boundaries=PUT_BOUNDARIES)
    chunks = {object_key(c.digest) for c, _ in plan.chunks}
    assert len(chunks) == 8
    return data, plan, chunks, object_key(plan.ref.record), blob_ref_key(plan.ref.digest)


def _gc_empties(root: Path) -> None:
    report = collect_garbage(str(root), grace=0)
    assert report.kept_everything is False and report.unreadable_bundles == []
    assert {k for k in keys_of(root) if not k.startswith(GC_PREFIX)} == set()


def test_killed_while_writing_a_chunk_leaves_only_an_unlisted_temporary_file(tmp_path, put_plan):
    data, plan, chunks, _, _ = put_plan
    key = crash_at(tmp_path, "put", f"temp:{OBJECTS_DIR}/:1")
    assert key in chunks
    assert keys_of(tmp_path) == set()  # nothing is listed: the store holds no object yet
    [tmp] = temp_files(tmp_path)  # the chunk's bytes, under a name no reader looks up
    assert tmp.parent == tmp_path / os.path.dirname(key)
    assert tmp.name.startswith(f".tmp-{os.path.basename(key)}.")
    assert object_key(hash_bytes(tmp.read_bytes())) == key
    assert not (tmp_path / key).exists()
    _gc_empties(tmp_path)
    assert temp_files(tmp_path) == [tmp]  # young: it might be a write in progress, so gc keeps it
    old = time.time() - TEMPORARY_MIN_AGE - 60
    os.utime(tmp, (old, old))
    report = collect_garbage(str(tmp_path), grace="0s")
    assert report.temporaries_removed == [str(tmp.relative_to(tmp_path))]
    assert temp_files(tmp_path) == []  # an hour old, it can only be a killed writer's leftover
    store = ObjectStore.open(str(tmp_path))  # the interrupted put completes when run again
    assert store.get(store.put(data, boundaries=PUT_BOUNDARIES)) == data


def test_killed_between_chunks_leaves_whole_chunks_and_no_record_or_ref(tmp_path, put_plan):
    data, plan, chunks, record, ref = put_plan
    key = crash_at(tmp_path, "put", f"create:{OBJECTS_DIR}/:3")
    assert key in chunks
    left = keys_of(tmp_path)
    assert len(left) == 2 and left < chunks - {key}  # exactly the two chunks created before the stop
    assert_whole(tmp_path, left)
    assert temp_files(tmp_path) == []  # each create cleans up its temporary file
    store = ObjectStore.open(str(tmp_path))
    assert not store.has(plan.ref.digest)
    _gc_empties(tmp_path)
    assert store.get(store.put(data, boundaries=PUT_BOUNDARIES)) == data


def test_killed_before_the_ref_leaves_chunks_and_record_but_no_blob(tmp_path, put_plan):
    data, plan, chunks, record, ref = put_plan
    assert crash_at(tmp_path, "put", f"create:{REFS_DIR}/:1") == ref
    assert keys_of(tmp_path) == chunks | {record}  # the ref is what makes the blob exist: not there
    assert_whole(tmp_path, chunks | {record})
    store = ObjectStore.open(str(tmp_path))
    assert not store.has(plan.ref.digest)
    _gc_empties(tmp_path)  # chunks and record nobody names are garbage
    assert store.get(store.put(data, boundaries=PUT_BOUNDARIES)) == data


def test_killed_after_the_put_leaves_the_whole_blob_which_gc_removes_when_no_bundle_names_it(tmp_path, put_plan):
    data, plan, chunks, record, ref = put_plan
    assert crash_at(tmp_path, "put", "done") == ""
    assert keys_of(tmp_path) == chunks | {record, ref}
    store = ObjectStore.open(str(tmp_path))
    assert store.get(plan.ref.digest) == data
    _gc_empties(tmp_path)
    assert not store.has(plan.ref.digest)


# ---- BundleWriter ----------------------------------------------------------------------------------------

BUNDLE_STOPS = {  # test -> (where its writer stops, the TTL of its in-flight record)
    "listed": (f"create:{OBJECTS_DIR}/:1", 3600.0),
    "before ref": (f"create:{REFS_DIR}/:1", 3600.0),
    "before complete": (f"create:{complete_key(BUNDLE)}:1", 0.0),
    "after complete": (f"delete:{INFLIGHT_PREFIX}:1", 0.0),
}


@pytest.fixture(scope="module")
def bundle_writers(tmp_path_factory):
    """One bundle writer per stop, all started at once (each imports torch: side by side, not in turn)."""
    started = {}
    for name, (stop, ttl) in BUNDLE_STOPS.items():
        root = tmp_path_factory.mktemp("bundle")
        started[name] = (root, start_writer(root, "bundle", stop, ttl=ttl))
    yield started
    for _, proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def crashed_bundle(bundle_writers, name: str) -> tuple[Path, str]:
    root, proc = bundle_writers[name]
    return root, kill_when_stopped(proc)


def _inflight(root: Path) -> dict:
    [key] = [k for k in keys_of(root) if k.startswith(INFLIGHT_PREFIX)]
    doc = json.loads((root / key).read_bytes())
    assert doc["bundle"] == BUNDLE
    return doc


def _named_keys(doc: dict) -> set[str]:
    """The object keys an in-flight record protects (refs are named by the blob digest)."""
    return {object_key(d) for d in doc["digests"]}


def _assert_not_complete(root: Path) -> None:
    assert not [k for k in keys_of(root) if k.startswith(f"{BUNDLE}/")]  # no marker of any kind
    with pytest.raises(TrajectoryReplayError) as refused:
        open_native(str(root / BUNDLE))
    assert BUNDLE in str(refused.value) and "\n" not in str(refused.value)


def _split(keys: set[str]) -> tuple[set[str], set[str], set[str]]:
    return (
        {k for k in keys if k.startswith(f"{OBJECTS_DIR}/")},
        {k for k in keys if k.startswith(f"{REFS_DIR}/")},
        {k for k in keys if not k.startswith((f"{OBJECTS_DIR}/", f"{REFS_DIR}/"))},
    )


def test_bundle_killed_after_listing_its_objects_has_written_none(bundle_writers):
    # the in-flight record is written before the first object
    tmp_path, _ = crashed_bundle(bundle_writers, "listed")
    objects, refs, other = _split(keys_of(tmp_path))
    assert objects == refs == set() and temp_files(tmp_path) == []
    doc = _inflight(tmp_path)
    assert other == {f"{INFLIGHT_PREFIX}{doc['attempt']}.json"} and doc["digests"]
    _assert_not_complete(tmp_path)
    report = collect_garbage(str(tmp_path), grace=0)  # a live record: gc leaves it alone
    assert report.active_captures == 1 and report.inflight_removed == 0
    assert keys_of(tmp_path) - {k for k in keys_of(tmp_path) if k.startswith(GC_PREFIX)} == other


def test_bundle_killed_before_its_first_ref_leaves_only_listed_objects_which_gc_spares(bundle_writers):
    tmp_path, key = crashed_bundle(bundle_writers, "before ref")
    assert key.startswith(f"{REFS_DIR}/")
    objects, refs, other = _split(keys_of(tmp_path))
    doc = _inflight(tmp_path)
    assert objects and refs == set() and other == {f"{INFLIGHT_PREFIX}{doc['attempt']}.json"}
    assert objects <= _named_keys(doc)  # nothing is written before it is listed
    assert_whole(tmp_path, objects)
    _assert_not_complete(tmp_path)
    before = keys_of(tmp_path)
    report = collect_garbage(str(tmp_path), grace=0)
    assert report.objects_removed == report.refs_removed == report.inflight_removed == 0
    assert report.protected_by_inflight == len(objects)
    assert {k for k in keys_of(tmp_path) if not k.startswith(GC_PREFIX)} == before


def test_bundle_killed_before_complete_is_garbage_once_its_record_expires(bundle_writers):
    tmp_path, key = crashed_bundle(bundle_writers, "before complete")
    assert key == complete_key(BUNDLE)
    objects, refs, other = _split(keys_of(tmp_path))
    doc = _inflight(tmp_path)
    assert objects and refs and other == {f"{INFLIGHT_PREFIX}{doc['attempt']}.json"}
    assert objects | refs <= _named_keys(doc) | {blob_ref_key(d) for d in doc["digests"]}
    assert_whole(tmp_path, objects)
    _assert_not_complete(tmp_path)
    report = collect_garbage(str(tmp_path), grace=0)  # the record expired: nothing protects the objects
    assert report.inflight_removed == 1
    assert report.objects_removed == len(objects) and report.refs_removed == len(refs)
    assert {k for k in keys_of(tmp_path) if not k.startswith(GC_PREFIX)} == set()


def test_bundle_killed_after_complete_opens_and_gc_removes_only_its_record(bundle_writers):
    tmp_path, key = crashed_bundle(bundle_writers, "after complete")
    assert key.startswith(INFLIGHT_PREFIX)
    objects, refs, other = _split(keys_of(tmp_path))
    doc = _inflight(tmp_path)
    assert other == {f"{INFLIGHT_PREFIX}{doc['attempt']}.json", complete_key(BUNDLE)}
    [reader] = open_native(str(tmp_path / BUNDLE))
    for payload in reader.manifest.payloads:
        reader.load_payload(payload)
    report = collect_garbage(str(tmp_path), grace=0)  # the bundle names every object: only the record goes
    assert report.inflight_removed == 1 and report.objects_removed == report.refs_removed == 0
    assert {k for k in keys_of(tmp_path) if not k.startswith(GC_PREFIX)} == objects | refs | {complete_key(BUNDLE)}
    [reader] = open_native(str(tmp_path / BUNDLE))
    assert set(reader.manifest.payloads)
