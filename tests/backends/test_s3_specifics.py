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
    env = {"PATH": "/usr/bin:/bin", "FSSPEC_S3_KEY": s3_server.key, "FSSPEC_S3_SECRET": s3_server.secret,
           "FSSPEC_S3_ENDPOINT_URL": s3_server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
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
    keys = [f"objects/{i % 7:02x}/{i:06d}" for i in range(1003)]
    backend._map(lambda k: backend.write(k, b"v", durable=False), keys)
    bucket, root, _ = backend.fs.split_path(backend.path)
    backend.fs.pipe_file(f"{bucket}/{root}/objects/placeholder/", b"")
    calls: list[str] = []
    real = backend.fs._call_s3

    async def counting(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)

    backend.fs._call_s3 = counting
    assert backend.list("objects/") == sorted(keys)
    assert calls == ["list_objects_v2", "list_objects_v2"]
    assert backend.list("objects/01") == sorted(k for k in keys if k.startswith("objects/01/"))
    calls.clear()
    assert backend.list(".gc/lease-") == [] and calls == ["list_objects_v2"]
