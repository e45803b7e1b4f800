"""Files at a store's keys that are not regular files, or are far larger than what is stored there.

A FIFO at a key would block every reader until some writer came, a link to /dev/zero would be read without end,
and a sparse 1.5 GB file at a blob record's key would be read whole before the record bound was checked. Each
case puts the real thing (os.mkfifo, os.symlink, truncate) at a key the tool reads in a real store on disk and
runs the command line in-process: the command ends, nothing escapes as a traceback, and a command that has to
read the key fails with one line naming it.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

from tests.bundle.test_bad_input import NAME, write_bundle
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleReader
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.errors import IntegrityError, ValueTooLargeError
from trajectory_replay.store import BlobRef, ObjectStore
from trajectory_replay.store.digest import blob_ref_key, object_key
from trajectory_replay.store.layout import OBJECTS_DIR
from trajectory_replay.store.records import MAX_RECORD_BYTES, RecordError

runner = CliRunner()
SPARSE_BYTES = 1536 << 20
COMMANDS = ["ls", "inspect", "validate", "replay", "gc", "fsck", "cp"]
MUST_FAIL = {
    # (what sits at the key, the key) -> the commands that read it and so exit 1 naming it; the others do not
    # read it (ls lists a bundle from its marker's existence, gc marks from records, not chunks) and end as usual
    "marker": {"inspect", "validate", "replay", "gc", "fsck", "cp"},
    "record": set(COMMANDS),
    "chunk": {"validate", "replay", "fsck", "cp"},
    "document": {"inspect", "validate", "replay", "fsck", "cp"},  # the index's chunk
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "read-cache"))


def _key(store: ObjectStore, marker, place: str) -> str:
    manifest = json.loads(store.get(marker.documents().manifest.blob_ref()))
    kl = manifest["payloads"]["kl"]
    return {
        "marker": complete_key(NAME),
        "record": object_key(kl["record"]),
        "chunk": object_key(store.record(kl["digest"]).chunks[0].digest),
        "document": object_key(store.record(marker.documents().index.blob_ref()).chunks[0].digest),
    }[place]


def _replace(path: str, kind: str) -> None:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)  # sparse: no disk space, but every byte reads as zero


@contextmanager
def _unblocking(path: str, kind: str):
    """A reader blocked opening the FIFO (the fault) is let through with junk by a writer that opens it without
    blocking, which succeeds only while some reader has it open: the test then fails on what the command says,
    instead of hanging."""
    stop = threading.Event()

    def feed() -> None:
        while not stop.wait(0.2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader has it open
                continue
            try:
                os.write(fd, b"junk")
            except OSError:
                pass
            finally:
                os.close(fd)

    feeder = threading.Thread(target=feed, daemon=True) if kind == "fifo" else None
    if feeder:
        feeder.start()
    try:
        yield
    finally:
        stop.set()
        if feeder:
            feeder.join()


def _hostile_store(tmp_path, kind: str, place: str) -> tuple[str, str, str]:
    root = str(tmp_path / "store")
    url, writer, marker = write_bundle(root)
    key = _key(writer.store, marker, place)
    _replace(os.path.join(root, key), kind)
    return root, url, key


def _run(command: str, root: str, url: str, tmp_path):
    args = {
        "ls": ["ls", root],
        "inspect": ["inspect", url],
        "validate": ["validate", url],
        "replay": ["replay", url],
        "gc": ["gc", root, "--grace", "0s"],
        "fsck": ["fsck", root],
        "cp": ["cp", url, str(tmp_path / "copy")],
    }
    return runner.invoke(app, args[command])


def _check(result, command: str, must_fail: bool, *needles: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    if not must_fail:
        assert result.exit_code in (0, 1), result.output
        return
    assert result.exit_code == 1, result.output
    errors = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith(("trajectory-replay: warning:", "trajectory-replay: WARNING:"))
    ]
    if errors:  # a failed command: one line
        assert len(errors) == 1 and errors[0].startswith("trajectory-replay: error:"), result.stderr
        shown = errors[0]
    else:  # a report (validate, fsck) naming the problem
        shown = result.stdout
    for needle in needles:
        assert needle in shown, f"{needle!r} not in {shown!r}"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("place", sorted(MUST_FAIL))
@pytest.mark.parametrize("kind, what", [("fifo", "a FIFO"), ("devzero", "a character device")])
def test_key_that_is_not_a_regular_file(tmp_path, kind, what, place, command):
    root, url, key = _hostile_store(tmp_path, kind, place)
    with _unblocking(os.path.join(root, key), kind):
        result = _run(command, root, url, tmp_path)
    # fsck's report lists keys under what is wrong with them (missing, corrupt), not why
    _check(result, command, command in MUST_FAIL[place], key, *([] if command == "fsck" else [what]))
    assert os.path.lexists(os.path.join(root, key)), "a command removed what it could not read"


@pytest.mark.parametrize("command", sorted({"inspect", "validate", "replay", "fsck", "cp"}))
def test_sparse_file_far_over_the_record_bound(tmp_path, command):
    root, url, key = _hostile_store(tmp_path, "sparse", "record")
    _check(_run(command, root, url, tmp_path), command, True, key, f"over the {MAX_RECORD_BYTES}-byte bound")


def test_record_over_the_bound_is_refused_from_its_size_unread(tmp_path):
    """The store and the walk of gc, fsck and ls refuse it having read nothing of it."""
    root, url, key = _hostile_store(tmp_path, "sparse", "record")
    store = ObjectStore.open(root)
    record_digest = "blake3:" + key.rsplit("/", 1)[1]
    (blob,) = [
        s["digest"]
        for s in json.loads(store.get(BundleReader.open(url).documents.manifest.blob_ref()))["payloads"].values()
        if s["record"] == record_digest
    ]
    with pytest.raises(RecordError, match=f"{SPARSE_BYTES} bytes, over the {MAX_RECORD_BYTES}-byte bound"):
        store.record(BlobRef(blob, -1, record_digest))
    found = store.inventory.records([record_digest])[record_digest]
    assert isinstance(found, RecordError) and f"over the {MAX_RECORD_BYTES}-byte bound" in str(found)
    assert store.backend.stats.bytes_read < MAX_RECORD_BYTES


def test_blob_ref_over_its_bound_is_refused_unread(tmp_path):
    """A ref holds one digest: a sparse 1.5 GB file at a ref's key is refused from its size by replay and inspect
    alike, and the inventory (gc, fsck, inspect) reports it as a ref that holds no digest."""
    root = str(tmp_path / "store")
    url, writer, marker = write_bundle(root)
    store = writer.store
    manifest = json.loads(store.get(marker.documents().manifest.blob_ref()))
    digest = manifest["payloads"]["kl"]["digest"]
    with open(os.path.join(root, blob_ref_key(digest)), "wb") as f:
        f.truncate(SPARSE_BYTES)
    fresh = ObjectStore.open(root)
    with pytest.raises(ValueTooLargeError, match=f"holds {SPARSE_BYTES} bytes, over the 1024-byte bound"):
        fresh.ref(digest)
    found = fresh.inventory.read_refs([digest])[digest]
    assert isinstance(found, IntegrityError) and "does not hold a digest" in str(found)
    assert fresh.backend.stats.bytes_read < 1 << 20


@pytest.mark.parametrize("kind, what", [("fifo", "a FIFO"), ("devzero", "a character device")])
def test_backend_reads_refuse_what_is_not_a_regular_file(tmp_path, kind, what):
    backend = open_backend(str(tmp_path / "root"))
    backend.write("a/value", b"x")
    path = str(tmp_path / "root" / "a" / "value")
    _replace(path, kind)
    with _unblocking(path, kind):
        for read in (
            lambda: backend.read("a/value"),
            lambda: backend.read("a/value", 10),
            lambda: backend.read_range("a/value", 0, 4),
            lambda: backend.read_into("a/value", memoryview(bytearray(4))),
        ):
            with pytest.raises(IntegrityError, match=f"'a/value' is {what}, not a regular file"):
                read()
    assert backend.exists("a/value")  # something is there (and named when read), not an absent key


def test_backend_read_with_a_limit(tmp_path):
    backend = open_backend(str(tmp_path / "root"))
    backend.write("k", b"0123456789")
    assert backend.read("k", 10) == b"0123456789"
    with pytest.raises(ValueTooLargeError, match="'k' holds 10 bytes, over the 9-byte bound"):
        backend.read("k", 9)
    with open(tmp_path / "root" / "big", "wb") as f:
        f.truncate(SPARSE_BYTES)
    before = backend.stats.bytes_read
    with pytest.raises(ValueTooLargeError, match=f"holds {SPARSE_BYTES} bytes"):
        backend.read("big", 1 << 20)
    assert backend.stats.bytes_read == before  # refused from its size, unread


def test_inventory_read_with_a_bound_returns_the_refusal_unread(tmp_path):
    """What gc and fsck read by key (markers) can be bounded: a sparse 1.5 GB file comes back as its refusal."""
    from trajectory_replay.store.inventory import Inventory

    backend = open_backend(str(tmp_path / "root"))
    backend.write("b/k", b"small")
    with open(tmp_path / "root" / complete_key("b"), "wb") as f:
        f.truncate(SPARSE_BYTES)
    marker = complete_key("b")
    values = Inventory(backend).read([marker, "b/k", "b/absent"], limit=4 << 20)
    assert isinstance(values[marker], ValueTooLargeError) and marker in str(values[marker])
    assert values["b/k"] == b"small" and values["b/absent"] is None
    assert backend.stats.bytes_read < 1 << 20


def test_gc_reads_a_sparse_marker_no_further_than_the_marker_bound(tmp_path):
    """A 1.5 GB file at a bundle's COMPLETE: gc cannot know what that bundle references, so it keeps everything and
    names the bundle, having read no more of the file than a marker can hold."""
    import tracemalloc

    from trajectory_replay.bundle.markers import MAX_MARKER_BYTES
    from trajectory_replay.ops.gc import collect_garbage

    root, url, key = _hostile_store(tmp_path, "sparse", "marker")
    before = sorted(os.listdir(os.path.join(root, OBJECTS_DIR)))
    tracemalloc.start()
    try:
        report = collect_garbage(root, grace="0s")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.kept_everything and any(NAME in p for p in report.unreadable_bundles), report.unreadable_bundles
    assert sorted(os.listdir(os.path.join(root, OBJECTS_DIR))) == before
    assert peak < 8 * MAX_MARKER_BYTES, peak  # the bound and its copies, never the 1.5 GB


@pytest.mark.parametrize("kind, what", [("fifo", "a FIFO"), ("devzero", "a character device")])
def test_ls_lists_a_bundle_whose_marker_is_not_a_regular_file_as_corrupt(tmp_path, kind, what):
    """Something is at the key: the bundle is not passed over as if its marker were absent."""
    root, url, key = _hostile_store(tmp_path, kind, "marker")
    with _unblocking(os.path.join(root, key), kind):
        result = runner.invoke(app, ["ls", root, "--json"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["bundles"]
    assert entry["name"] == NAME and entry["status"] == "corrupt" and f"is {what}" in entry["detail"]
