"""Backend contract, run against local disk, memory and the real S3 server."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading

import pytest

from trajectory_replay.backends import ByteRange, open_backend
from trajectory_replay.backends.probe import PROBE_DIR
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.errors import InvalidKeyError, NotFoundError


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request, tmp_path):
    if request.param == "local":
        return open_backend(str(tmp_path / "root"))
    if request.param == "memory":
        return open_backend(request.getfixturevalue("memory_root"))
    url, options = request.getfixturevalue("s3_root")
    return open_backend(url, **options)


def test_read_write_roundtrip(backend):
    backend.write("a/b/c.bin", b"hello world")
    assert backend.read("a/b/c.bin") == b"hello world"
    assert backend.exists("a/b/c.bin")
    assert not backend.exists("a/b")
    assert backend.size("a/b/c.bin") == 11
    assert backend.mtime("a/b/c.bin") > 0
    backend.write("a/b/c.bin", b"replaced")
    assert backend.read("a/b/c.bin") == b"replaced"


def test_stat_gives_the_size_and_mtime_together(backend):
    backend.write("s/v", b"12345")
    found = backend.stat("s/v")
    assert found == (5, backend.mtime("s/v")) and found.size == backend.size("s/v") == 5 and found.mtime > 0
    with pytest.raises(NotFoundError, match="s/gone"):
        backend.stat("s/gone")
    with pytest.raises(InvalidKeyError):
        backend.stat("../s/v")


def test_ranged_reads(backend):
    backend.write("r", bytes(range(100)))
    assert backend.read_range("r", 10, 20) == bytes(range(10, 20))
    assert backend.read_range("r", 5, 5) == b""
    assert backend.read_ranges([ByteRange("r", 0, 2), ByteRange("r", 98, 100)]) == [b"\x00\x01", b"\x62\x63"]
    with pytest.raises(InvalidKeyError):
        backend.read_range("r", 20, 10)


def test_read_many_and_missing(backend):
    backend.write("x/1", b"one")
    backend.write("x/2", b"two")
    assert backend.read_many(["x/2", "x/1"]) == [b"two", b"one"]
    with pytest.raises(NotFoundError, match="x/3"):
        backend.read("x/3")
    with pytest.raises(NotFoundError):
        backend.read_many(["x/1", "x/3"])


def test_list_and_delete(backend):
    for key in ["p/a", "p/b/c", "q/d", "pz"]:
        backend.write(key, b"v")
    assert backend.list("p/") == ["p/a", "p/b/c"]
    assert backend.list() == ["p/a", "p/b/c", "pz", "q/d"]
    backend.delete("p/a")
    backend.delete("p/a")  # idempotent
    assert not backend.exists("p/a")
    assert backend.list("p/") == ["p/b/c"]
    assert backend.list("nothing/") == []
    assert backend.list_dir() == ["p", "pz", "q"]
    assert backend.list_dir("p") == ["b"]
    assert backend.list_dir("nothing") == []


def test_create_if_absent_semantics(backend):
    assert backend.create_if_absent(complete_key("m"), b"first") is True
    assert backend.create_if_absent(complete_key("m"), b"first") is True  # retry of the same bytes
    assert backend.create_if_absent(complete_key("m"), b"second") is False
    assert backend.read(complete_key("m")) == b"first"


@pytest.mark.parametrize("same", [False, True])
def test_create_if_absent_threads(backend, same):
    payloads = [b"same" if same else f"writer-{i}".encode() for i in range(8)]
    barrier = threading.Barrier(8)
    results = [None] * 8

    def run(i):
        barrier.wait()
        results[i] = backend.create_if_absent("race/key", payloads[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = backend.read("race/key")
    if same:
        assert all(results)
    else:
        winners = [p for p, r in zip(payloads, results) if r]
        assert len(winners) == 1
        assert winners[0] == stored


def _create_in_process(url, options, key, payload, barrier, out):
    from trajectory_replay.backends import open_backend as _open

    b = _open(url, **options)
    barrier.wait()
    out.put((payload, b.create_if_absent(key, payload)))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_create_if_absent_processes(kind, tmp_path, request):
    if kind == "local":
        url, options = str(tmp_path / "root"), {}
    else:
        url, options = request.getfixturevalue("s3_root")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_create_in_process, args=(url, options, "proc/key", f"p{i}".encode(), barrier, out))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    winners = [payload for payload, won in results if won]
    assert len(winners) == 1
    assert open_backend(url, **options).read("proc/key") == winners[0]


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "", "a/", "a\\b", "a/../b"])
def test_invalid_keys_rejected(backend, key):
    with pytest.raises(InvalidKeyError, match="invalid key"):
        backend.write(key, b"x")
    with pytest.raises(InvalidKeyError):
        backend.read(key)


def test_probe_passes_on_real_targets(backend):
    result = backend.probe()
    assert result.ok, result
    assert result.checks == {"sequential": True, "concurrent": True}
    backend.require_atomic_create()
    assert backend.list(f"{PROBE_DIR}/") == []  # the probe cleans up


def test_open_backend_rejects_unknown_protocol():
    from trajectory_replay.errors import BackendError

    with pytest.raises(BackendError, match="unsupported storage protocol 'ftp'"):
        open_backend("ftp://host/x")


@pytest.mark.parametrize(
    "url, shown",
    [
        ("s3://user:pw@bucket/x", "s3://bucket/x"),
        ("s3://AKIA:ab/c+d@bucket/run", "s3://bucket/run"),  # a secret key holding '/' and '+'
        ("s3://AKIA:ab%2Fc%2Bd@bucket/run", "s3://bucket/run"),  # the same, percent-encoded
        ("s3://AKIA:a/b/c@bucket", "s3://bucket"),
        ("s3://AKIAONLY@bucket/run", "s3://bucket/run"),
        ("s3://bucket/run/b-1", "s3://bucket/run/b-1"),
        ("s3://bucket/dir@2/b-1", "s3://bucket/dir@2/b-1"),  # an '@' in the prefix is no credential
        ("/plain/path", "/plain/path"),
    ],
)
def test_redact_url(url, shown):
    from trajectory_replay.backends import redact_url

    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url", ["s3://AKIAFAKE:secretKEY@bars/x", "s3://AKIA:ab/c+d@bucket/run", "s3://AKIA:ab%2Fcd@bucket/run"]
)
@pytest.mark.parametrize("command", ["ls", "inspect", "validate", "replay", "gc", "fsck", "stats"])
def test_credentials_in_an_s3_url_are_refused_and_never_shown(url, command, monkeypatch):
    """The client would echo them inside its bucket-name error: the URL is refused before any request, in one
    line that names it without them (no server is needed to see it: nothing is sent)."""
    from typer.testing import CliRunner

    from trajectory_replay.cli import app

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    result = CliRunner().invoke(app, [command, url, "--json"])
    assert result.exit_code == 2, result.output  # a location refused as typed: a command-line mistake
    for secret in ("AKIA", "secretKEY", "ab/c+d", "ab%2Fcd", "c+d"):
        assert secret not in result.output, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "usage" and "credentials in an S3 URL are not used" in doc["error"], doc
    bucket = url.split("@", 1)[1].split("/", 1)[0]
    assert doc["error"].startswith(f"s3://{bucket}"), doc  # the store (bundle commands open its root) named


def test_read_into_fills_the_target_and_reports_the_size(backend):
    """read_into writes the whole value at the front of the target and returns its size; a larger value returns its
    size (the caller's check fails); an absent key, or a prefix that holds keys, is NotFoundError."""
    backend.write("r/a", b"hello")
    target = bytearray(b"." * 8)
    assert backend.read_into("r/a", memoryview(target)) == 5 and bytes(target) == b"hello..."
    assert backend.read_into("r/a", memoryview(bytearray(3))) == 5
    backend.write("r/empty", b"")
    assert backend.read_into("r/empty", memoryview(bytearray(4))) == 0
    for absent in ("r/b", "r", "r/a/deeper"):
        with pytest.raises(NotFoundError):
            backend.read_into(absent, memoryview(bytearray(4096)))
