"""Storage backends: one small interface over local disk, S3 (s3fs) and memory, opened from a path or URL."""

from __future__ import annotations

import os
from typing import Any

from trajectory_replay.backends.base import (
    Backend, ByteRange, Capabilities, IOStats, ProbeResult, validate_key, validate_prefix,
)
from trajectory_replay.errors import BackendError


def split_url(path_or_url: str) -> tuple[str, str]:
    """(protocol, path) of a path or URL; plain paths and file:// are `file`, s3a:// is `s3`."""
    text = os.fspath(path_or_url)
    if "://" not in text:
        return "file", text
    protocol, rest = text.split("://", 1)
    protocol = protocol.lower()
    if protocol in ("s3a", "s3n"):
        protocol = "s3"
    if protocol in ("file", "local"):
        return "file", rest
    return protocol, rest


def open_backend(path_or_url: str | os.PathLike, **storage_options: Any) -> Backend:
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

        if _userinfo_end(path):   # never handed on: the client would echo them inside its bucket-name error
            raise BackendError(f"{redact_url(os.fspath(path_or_url))}: credentials in an S3 URL are not used; give "
                               "them through AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, an AWS profile, or the "
                               "key and secret storage options")

        return S3Backend(path, **storage_options)
    raise BackendError(f"{path_or_url}: unsupported storage protocol {protocol!r} (use a path, file://, s3:// or memory://)")


def _userinfo_end(rest: str) -> int:
    """Where the `user:password@` part of a URL's text after `://` ends (0 when there is none). A secret key may
    hold '/' and '+' unencoded (AWS secret keys do), so an '@' after a '/' still ends it when the text before that
    '@' has the ':' between user and password; a redaction errs on the side of hiding."""
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        return authority.rindex("@") + 1
    head, at, _ = rest.partition("@")
    return len(head) + 1 if at and ":" in head else 0


def redact_url(url: str) -> str:
    """`url` without user:password@ credentials (whatever they hold: '/', '+', '%2F'), for anything that is
    written or printed."""
    if "://" not in url:
        return url
    protocol, rest = url.split("://", 1)
    return f"{protocol}://{rest[_userinfo_end(rest):]}"


__all__ = [
    "Backend", "BackendError", "ByteRange", "Capabilities", "IOStats", "ProbeResult", "open_backend",
    "redact_url", "split_url", "validate_key", "validate_prefix",
]
