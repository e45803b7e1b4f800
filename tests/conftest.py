"""Shared fixtures: a real S3 server for the session, fresh buckets, local and memory roots."""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path

import pytest

from tests.s3server import S3Server, start_server

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    """SeaweedFS for the whole session. A server that cannot start fails the tests that need it."""
    try:
        server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    except Exception as exc:  # the S3 tests must run: this is a failure, never a skip
        pytest.fail(f"cannot start the S3 test server: {exc}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    """The session's bucket; tests keep apart by prefix. (A bucket per test would make SeaweedFS grow a
    volume collection per bucket until it has no free volumes left.)"""
    import s3fs

    name = f"tr-{uuid.uuid4().hex[:16]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    fs.mkdir(name)
    return name


@pytest.fixture
def s3_root(s3_server, s3_bucket) -> tuple[str, dict]:
    """(url, storage_options) of a new, empty prefix in the session's bucket."""
    return f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:12]}/root", s3_server.storage_options()


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> dict:
    """Point the standard AWS_* variables at the test server (as a user would) and return them."""
    env = s3_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def memory_root() -> str:
    return f"memory://t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def local_root(tmp_path) -> str:
    return str(tmp_path / "store")
