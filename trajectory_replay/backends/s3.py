"""S3 backend over s3fs (AWS S3, MinIO, SeaweedFS, ...).

Endpoint and credentials come from the usual places: storage options, AWS_* variables
(AWS_ENDPOINT_URL included), AWS config files, and fsspec's FSSPEC_S3_* configuration,
which `fsspec.filesystem("s3", ...)` applies. create_if_absent is a PUT with
`If-None-Match: *`, issued directly as one put_object (s3fs switches large bodies to a
multipart upload that drops the condition). A refusal surfaces from s3fs as an OSError
whose cause is a botocore ClientError with code PreconditionFailed (412); a 409
ConditionalRequestConflict means a concurrent conditional write is in flight and is retried.
Ranged reads use `cat_file(start=, end=)` / `cat_ranges`, never `open()`, whose read-ahead
block would fetch far more than asked.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional, Sequence

import aiohttp
import fsspec
from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError
from s3fs.core import _error_wrapper as _s3_retrying
from fsspec.asyn import _run_coros_in_chunks, sync

from trajectory_replay.backends.base import Backend, ByteRange, Capabilities, validate_key
from trajectory_replay.errors import BackendError, NotFoundError

_REFUSED = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409", "OperationAborted"}
_UNAVAILABLE = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}
"""Answers that mean "not now" (and are worth retrying), unlike 501 NotImplemented, which means "never"."""


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception raised by s3fs, looking through its cause chain."""
    seen = 0
    while exc is not None and seen < 5:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return str(status)
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class S3Backend(Backend):
    """Keys are objects under `s3://bucket/prefix/`."""

    capabilities = Capabilities(atomic_create=True, ranged_reads=True, listing=True, deletes=True, remote=True)
    max_workers = 16

    def __init__(self, path: str, fs: Any = None, **storage_options: Any) -> None:
        super().__init__()
        path = path.split("://", 1)[-1].strip("/")
        if not path or len(path.split("/", 1)[0]) < 3:
            raise BackendError(f"s3://{path}: a bucket name (3+ characters) is required")
        self.path = path
        self.url = f"s3://{path}"
        self.storage_options = storage_options
        if fs is None:
            # fresh instance: listings are never cached, so exists/list see other writers at once
            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **storage_options)
        self.fs = fs

    def probe_scope(self) -> tuple:
        """Conditional writes are the server's and the bucket's property, not a prefix's."""
        endpoint = getattr(getattr(self.fs, "s3", None), "_endpoint", None)
        host = getattr(endpoint, "host", None) or str(self.fs.client_kwargs.get("endpoint_url", ""))
        return (type(self.fs).__name__, host, self.path.split("/", 1)[0])

    def transient_error(self, exc: BaseException) -> bool:
        """The server did not answer (refused connection, DNS, timeout, a connection cut off) or answered
        that it cannot serve now (5xx other than 501, throttling). Any other answer is the server's word."""
        code = _error_code(exc)
        if code is not None:
            return code in _UNAVAILABLE
        seen = 0
        while exc is not None and seen < 8:
            if isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError, BotoConnectionError, HTTPClientError,
                                aiohttp.ClientError)):
                return True
            exc = exc.__cause__ or exc.__context__
            seen += 1
        return False

    def child(self, prefix: str) -> "S3Backend":
        return S3Backend(f"{self.path}/{prefix}", fs=self.fs, **self.storage_options)

    def _path(self, key: str) -> str:
        return f"{self.path}/{key}"

    def _not_found(self, key: str) -> NotFoundError:
        return NotFoundError(f"{self.url}: no such key {key!r}")

    async def _get(self, path: str) -> bytes:
        """One GET of a whole object. (s3fs's cat_file asks for the size first: a HEAD, plus a LIST when the
        key is absent, before the GET; the store's reads are small or already split into chunks.)"""
        bucket, obj_key, _ = self.fs.split_path(path)

        async def call_and_read() -> bytes:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=obj_key)
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        # s3fs's own retry policy, as its cat_file applies it: a body cut off mid-read is fetched again
        return await _s3_retrying(call_and_read, retries=self.fs.retries)

    def _read(self, key: str) -> bytes:
        try:
            return sync(self.fs.loop, self._get, self._path(key))
        except FileNotFoundError:
            raise self._not_found(key) from None

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError:
            raise self._not_found(key) from None

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Concurrent GETs in s3fs's event loop."""
        paths = [self._path(validate_key(k)) for k in keys]
        if not paths:
            return []
        results = sync(self.fs.loop, _run_coros_in_chunks, [self._get(p) for p in paths],
                       batch_size=self.max_workers * 4, return_exceptions=True)
        values = []
        for key, value in zip(keys, results):
            if isinstance(value, FileNotFoundError):
                raise self._not_found(key)
            if isinstance(value, BaseException):
                raise value
            self.stats.count_read(len(value))
            values.append(value)
        return values

    def read_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Concurrent ranged GETs in s3fs's event loop."""
        if not ranges:
            return []
        paths = [self._path(validate_key(r.key)) for r in ranges]
        try:
            values = self.fs.cat_ranges(paths, [r.start for r in ranges], [r.end for r in ranges],
                                        on_error="return")
        except FileNotFoundError:
            raise self._not_found(ranges[0].key) from None
        for r, value in zip(ranges, values):
            if isinstance(value, FileNotFoundError):
                raise self._not_found(r.key)
            if isinstance(value, BaseException):
                raise value
            self.stats.count_read(len(value))
        return values

    def _write(self, key: str, data, durable: bool = True) -> None:
        # one PUT (or a multipart upload completed in one call) replaces the object atomically
        self.fs.pipe_file(self._path(key), bytes(data))

    def _create(self, key: str, data) -> bool:
        bucket, obj_key, _ = self.fs.split_path(self._path(key))
        body = bytes(data)
        for attempt in range(8):
            try:
                sync(self.fs.loop, self.fs._call_s3, "put_object", Bucket=bucket, Key=obj_key, Body=body,
                     IfNoneMatch="*")
                return True
            except FileExistsError:
                return False
            except Exception as exc:  # s3fs wraps ClientError in OSError; inspect the code
                code = _error_code(exc)
                if code in _REFUSED:
                    return False
                if code in _CONFLICT:  # another conditional write of this key is in flight: it settles fast
                    time.sleep(0.01 * (attempt + 1))
                    continue
                raise
        raise BackendError(f"{self.url}: conditional write of {key!r} kept conflicting")

    def _head(self, key: str) -> Optional[dict]:
        """One HEAD request (s3fs's `info` adds a LIST for a missing key, to look for a directory)."""
        bucket, obj_key, _ = self.fs.split_path(self._path(key))
        try:
            return sync(self.fs.loop, self.fs._call_s3, "head_object", Bucket=bucket, Key=obj_key)
        except FileNotFoundError:
            return None
        except Exception as exc:  # s3fs wraps ClientError; a 404 is "absent"
            if _error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def _exists(self, key: str) -> bool:
        return self._head(key) is not None

    def _info(self, key: str) -> dict:
        head = self._head(key)
        if head is None:
            raise self._not_found(key)
        return head

    def _size(self, key: str) -> int:
        return int(self._info(key)["ContentLength"])

    def _mtime(self, key: str) -> float:
        return self._info(key)["LastModified"].timestamp()

    def _list(self, prefix: str) -> list[str]:
        """One LIST request per 1,000 keys (s3fs's `find` adds a HEAD and a second LIST when nothing is found)."""
        bucket, root, _ = self.fs.split_path(self.path)
        base = f"{root}/" if root else ""

        async def pages() -> list[str]:
            keys, token = [], None
            while True:
                kwargs = dict(Bucket=bucket, Prefix=base + prefix)
                if token:
                    kwargs["ContinuationToken"] = token
                page = await self.fs._call_s3("list_objects_v2", **kwargs)
                keys += [item["Key"] for item in page.get("Contents", [])]
                token = page.get("NextContinuationToken")
                if not (page.get("IsTruncated") and token):
                    return keys

        try:
            found = sync(self.fs.loop, pages)
        except FileNotFoundError:   # no such bucket
            return []
        # a key ending in "/" is a directory placeholder some tools create, not a value
        return [k[len(base):] for k in found if not k.endswith("/")]

    def _delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def _list_dir(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.path
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False, refresh=True)
                    if p.rstrip("/") != base]
        except FileNotFoundError:
            return []
