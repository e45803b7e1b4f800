"""Storage backends: one small interface over local disk, S3 (s3fs) and memory, opened from a path or URL.

The package also names the location helpers of `backends.urls` (split_url, location_problem, redact_url,
S3_BUCKET_RULE), which its users import from here.
"""

from __future__ import annotations

import os
from typing import Any

from trajectory_replay.backends.base import (
    Backend,
    ByteRange,
    Capabilities,
    IOStats,
    KeyStat,
    validate_key,
    validate_prefix,
)
from trajectory_replay.backends.probe import ProbeResult
from trajectory_replay.backends.urls import (
    S3_BUCKET_RULE,
    location_problem,
    redact_url,
    s3_bucket_problem,
    split_url,
    unsupported_protocol,
)
from trajectory_replay.errors import BackendError


def open_backend(path_or_url: str | os.PathLike[str], **storage_options: Any) -> Backend:
    """Open the backend for a local path, `file://`, `s3://bucket/prefix` or `memory://name` URL."""
    protocol, path = split_url(os.fspath(path_or_url))
    if protocol == "file":
        from trajectory_replay.backends.local import LocalBackend

        return LocalBackend(path, **storage_options)
    if protocol == "memory":
        from trajectory_replay.backends.memory import MemoryBackend

        return MemoryBackend(path)
    if protocol == "s3":
        from trajectory_replay.backends.s3 import S3Backend

        problem = s3_bucket_problem(os.fspath(path_or_url), path)
        if problem:  # before botocore sees it: its own message would echo credentials, or two regular expressions
            raise BackendError(problem)

        return S3Backend(path, **storage_options)
    raise BackendError(unsupported_protocol(os.fspath(path_or_url), protocol))


__all__ = [
    "Backend",
    "BackendError",
    "ByteRange",
    "Capabilities",
    "IOStats",
    "KeyStat",
    "ProbeResult",
    "S3_BUCKET_RULE",
    "location_problem",
    "open_backend",
    "redact_url",
    "split_url",
    "validate_key",
    "validate_prefix",
]
