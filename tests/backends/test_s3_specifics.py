"""S3 behaviour that only a real server shows: conditions honoured, configuration from the environment,
and refusal of a server that ignores conditional writes."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import s3fs

from trajectory_replay.backends.s3 import S3Backend
from trajectory_replay.errors import BackendError
from trajectory_replay.store.layout import OBJECTS_DIR
from trajectory_replay.store.liveness import LEASE_PREFIX


class ConditionIgnoringS3(s3fs.S3FileSystem):
    """A client whose server drops `If-None-Match`: every conditional PUT silently overwrites."""

    async def _call_s3(self, method, *args, **kwargs):
        kwargs.pop("IfNoneMatch", None)
        return await super()._call_s3(method, *args, **kwargs)


def test_probe_detects_server_ignoring_conditions(s3_root, caplog):
    url, options = s3_root
    fs = ConditionIgnoringS3(skip_instance_cache=True, use_listings_cache=False, **options)
    backend = S3Backend(url, fs=fs)
    result = backend.probe()
    assert not result.ok
    assert result.checks["sequential"] is False
    with pytest.raises(BackendError, match="create-if-absent is not atomic"):
        backend.require_atomic_create()
    with caplog.at_level(logging.WARNING):
        backend.require_atomic_create(unsafe=True)
    assert "unsafe override" in caplog.text


def test_configuration_from_aws_environment(s3_server, s3_bucket):
    """No flags or options: AWS_ENDPOINT_URL and the AWS_* credentials are enough."""
    code = (
        "from trajectory_replay.backends import open_backend\n"
        f"b = open_backend('s3://{s3_bucket}/envtest')\n"
        "b.write('k', b'v'); print(b.read('k').decode())\n"
    )
    env = {"PATH": "/usr/bin:/bin", **s3_server.env()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "v"


def test_configuration_from_fsspec_environment(s3_server, s3_bucket):
    """fsspec's FSSPEC_S3_* variables configure the filesystem too."""
    code = (
        "from trajectory_replay.backends import open_backend\n"
        f"b = open_backend('s3://{s3_bucket}/fsspecenv')\n"
        "b.write('k', b'w'); print(b.read('k').decode())\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "FSSPEC_S3_KEY": s3_server.key,
        "FSSPEC_S3_SECRET": s3_server.secret,
        "FSSPEC_S3_ENDPOINT_URL": s3_server.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "w"


def test_bucket_name_required():
    with pytest.raises(BackendError, match="bucket name"):
        S3Backend("s3://ab")


def test_listing_pages_and_prefixes(s3_root):
    """A listing is one LIST request per 1,000 keys: pages are followed, partial names match, directory
    placeholders (keys ending in '/', which some tools create) are not values, and an empty prefix costs one request."""
    url, options = s3_root
    backend = S3Backend(url, **options)
    keys = [f"{OBJECTS_DIR}/{i % 7:02x}/{i:06d}" for i in range(1003)]
    backend._map(lambda k: backend.write(k, b"v", durable=False), keys)
    bucket, root, _ = backend.fs.split_path(backend.path)
    backend.fs.pipe_file(f"{bucket}/{root}/{OBJECTS_DIR}/placeholder/", b"")
    calls: list[str] = []
    real = backend.fs._call_s3

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    backend.fs._call_s3 = counting
    assert backend.list(f"{OBJECTS_DIR}/") == sorted(keys)
    assert calls == ["list_objects_v2", "list_objects_v2"]
    assert backend.list(f"{OBJECTS_DIR}/01") == sorted(k for k in keys if k.startswith(f"{OBJECTS_DIR}/01/"))
    calls.clear()
    assert backend.list(LEASE_PREFIX) == [] and calls == ["list_objects_v2"]


@pytest.mark.parametrize("document", ["manifest", "index"])
def test_inspect_with_a_warm_read_cache_sees_a_document_damaged_on_the_server(
    document, s3_root, s3_env, tmp_path, monkeypatch
):
    """inspect read a bundle's documents through the read cache: once a first inspect had warmed it, a document
    damaged on the server (other bytes of its size in its chunk) passed, where validate, fsck and scan found it.
    inspect reads the server's copy of what it checks (markers, documents, records) every time."""
    from typer.testing import CliRunner

    from tests.bundle.helpers import write_canonical
    from trajectory_replay.backends import open_backend
    from trajectory_replay.bundle.status import bundle_status
    from trajectory_replay.cli import app
    from trajectory_replay.ops.walk import Walker
    from trajectory_replay.store.digest import object_key

    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    url, options = s3_root
    write_canonical(url, storage_options=options)
    runner = CliRunner()
    assert runner.invoke(app, ["inspect", f"{url}/b-00001", "--json"]).exit_code == 0  # warms the cache
    backend = open_backend(url, **options)
    tree = Walker(backend).trees([bundle_status(backend, "b-00001")])["b-00001"]
    node = tree.documents[["manifest", "index", "expected"].index(document)]
    for digest, size in node.chunks:
        backend.write(object_key(digest), b"\x5a" * size)
    result = runner.invoke(app, ["inspect", f"{url}/b-00001", "--json"])
    assert result.exit_code == 1, result.stdout[-1500:]
    assert document in result.stdout and '"status": "invalid"' in result.stdout, result.stdout[-1500:]
    assert runner.invoke(app, ["validate", f"{url}/b-00001"]).exit_code == 1
