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

Every request is bounded in time (`RequestPolicy`): a connect timeout, a read timeout, and a
few attempts, none started that could end past a deadline. The stacked defaults of s3fs and
botocore (five s3fs attempts of five botocore attempts each, 15 s read timeout) kept a command
waiting about 7 minutes on a server that accepted connections and never answered. Retries
happen here, once, and a failure that means "the store cannot be used" (no answer,
credentials, access, unknown bucket) becomes a `StorageUnavailableError` whose one-line
message names the URL, the endpoint and what to check.

The bound holds for a whole command, not only for one request, when the endpoint stops answering
in the middle of it (`_Silence`): requests queued behind the client's pool of connections
(botocore's connect and read timeouts leave that wait unbounded, so a batch of N reads waited
N / 10 read timeouts) fail together once the endpoint has answered none of the waiting requests
for one attempt's limit, and once it failed to answer, no request starts that could end more
than `deadline` seconds after it went silent: the requests that follow fail at once. An answer
to any request ends the outage; a process that outlives one and wants to ask again sooner
(capture) calls `forget_outage`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import fsspec
from botocore.exceptions import (
    BotoCoreError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ReadTimeoutError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from botocore.handlers import add_expect_header
from fsspec.asyn import _run_coros_in_chunks, sync
from s3fs.core import _error_wrapper as _s3_retrying

from trajectory_replay.backends.base import Backend, ByteRange, Capabilities, KeyStat, validate_key
from trajectory_replay.backends.urls import redact_url
from trajectory_replay.errors import BackendError, NotFoundError, StorageUnavailableError

log = logging.getLogger(__name__)

_REFUSED = {"PreconditionFailed", "412"}
_CONFLICT = {"ConditionalRequestConflict", "409", "OperationAborted"}
_UNAVAILABLE = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}
"""Answers that mean "not now" (and are worth retrying), unlike 501 NotImplemented, which means "never"."""

ENV_CONNECT_TIMEOUT = "TRAJECTORY_REPLAY_S3_CONNECT_TIMEOUT"
ENV_READ_TIMEOUT = "TRAJECTORY_REPLAY_S3_READ_TIMEOUT"
ENV_MAX_ATTEMPTS = "TRAJECTORY_REPLAY_S3_MAX_ATTEMPTS"
ENV_RETRY_DEADLINE = "TRAJECTORY_REPLAY_S3_RETRY_DEADLINE"

SECONDS_PER_UPLOADED_MIB = 4.0
"""An upload attempt may take this long per MiB of body on top of its connect and read timeouts. aiohttp starts the
read timeout only once the body is sent, so a server that accepts a connection and never reads would otherwise
hold a large PUT forever."""
MAX_SINGLE_PUT = 100 << 20
"""Bodies up to this size go up as one PUT, bounded in time by RequestPolicy.attempt_limit; larger ones as
s3fs's multipart upload."""
OUTAGE_MEMORY = 5.0
"""Seconds during which an endpoint that gave no answer (after its retries) fails every request at once (after
them, only requests that could end within the deadline of the outage are made)."""
RETRY_FIRST, RETRY_MAX = 0.5, 8.0
"""Backoff (seconds) between attempts of one request: doubling from the first to the max, with jitter."""


@dataclass(frozen=True)
class RequestPolicy:
    """How long one S3 request may take when the endpoint does not answer.

    Each attempt waits at most `connect_timeout` for a connection and `read_timeout` for each read of the
    answer. A request makes at most `max_attempts` attempts when the endpoint gives no answer or answers
    "not now" (5xx, throttling), and starts no attempt that could end more than `deadline` seconds after the
    first began: with the defaults a dead endpoint fails a request within 2 minutes."""

    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_attempts: int = 3
    deadline: float = 120.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RequestPolicy:
        """The defaults, overridden by the variables ENV_CONNECT_TIMEOUT, ENV_READ_TIMEOUT, ENV_MAX_ATTEMPTS and
        ENV_RETRY_DEADLINE name."""
        values: dict[str, Any] = {}
        for name, field, kind in (
            (ENV_CONNECT_TIMEOUT, "connect_timeout", float),
            (ENV_READ_TIMEOUT, "read_timeout", float),
            (ENV_MAX_ATTEMPTS, "max_attempts", int),
            (ENV_RETRY_DEADLINE, "deadline", float),
        ):
            text = environ.get(name, "").strip()
            if not text:
                continue
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not value > 0 or value != value or value == float("inf"):
                unit = "a whole number >= 1" if kind is int else "a number of seconds > 0"
                raise BackendError(f"{name}={text!r}: must be {unit}")
            values[field] = value
        return cls(**values)

    def attempt_limit(self, upload_bytes: int = 0) -> float:
        """The longest one attempt can take without an answer (an upload: plus its allowance per MiB)."""
        return self.connect_timeout + self.read_timeout + SECONDS_PER_UPLOADED_MIB * upload_bytes / (1 << 20)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(RETRY_MAX, RETRY_FIRST * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def retry_allowed(self, attempt: int, elapsed: float, delay: float) -> bool:
        """Whether attempt `attempt` (1-based), failed `elapsed` seconds after the first began, may be followed by
        another after `delay` seconds: attempts are left, and the next one cannot end past the deadline."""
        return attempt < self.max_attempts and elapsed + delay + self.attempt_limit() <= self.deadline


class StoreUnreachableError(StorageUnavailableError):
    """The endpoint gave no answer (refused, unknown host, timeouts, a connection cut off) or answered "not now"."""

    kind = "unreachable"
    transient = True


class StoreAccessError(StorageUnavailableError):
    """No credentials, credentials the endpoint rejects, or access denied."""

    kind = "access"
    transient = False


class NoSuchBucketError(StorageUnavailableError):
    """The URL's bucket does not exist at the endpoint."""

    kind = "bucket"
    transient = False


class StoreConfigError(StorageUnavailableError):
    """The endpoint URL or region cannot be used at all."""

    kind = "config"
    transient = False


# ---- configuration ------------------------------------------------------------------------------------
def _client_options(storage_options: Mapping[str, Any], policy: RequestPolicy) -> tuple[dict[str, Any], RequestPolicy]:
    """Storage options with the policy's timeouts and retries filled in where the user set none, and the policy as
    it then applies. Options win over fsspec's FSSPEC_S3_* configuration, which wins over the policy: when the user
    configured botocore's retries, those are the only ones (one attempt here)."""
    options = dict(storage_options)
    configured = dict(fsspec.config.conf.get("s3", {}).get("config_kwargs") or {})
    configured.update(options.get("config_kwargs") or {})
    config = dict(configured)
    config.setdefault("connect_timeout", policy.connect_timeout)
    config.setdefault("read_timeout", policy.read_timeout)
    config.setdefault("retries", {"total_max_attempts": 1})  # attempts are made (and counted) here
    options["config_kwargs"] = config
    effective = replace(
        policy, connect_timeout=float(config["connect_timeout"]), read_timeout=float(config["read_timeout"])
    )
    if "retries" in configured:
        effective = replace(effective, max_attempts=1)
    return options, effective


def _policy_of(fs: Any, policy: RequestPolicy) -> RequestPolicy:
    """The timeouts an s3fs filesystem made elsewhere really uses (its own retries come on top)."""
    config = getattr(fs, "config_kwargs", None) or {}
    return replace(
        policy,
        connect_timeout=float(config.get("connect_timeout", getattr(fs, "connect_timeout", 5))),
        read_timeout=float(config.get("read_timeout", getattr(fs, "read_timeout", 15))),
        max_attempts=1,
    )


def _error_code(exc: BaseException | None) -> str | None:
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


def _chain(exc: BaseException | None, limit: int = 8) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and len(out) < limit:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


_DNS_ERRORS = (socket.gaierror, getattr(aiohttp, "ClientConnectorDNSError", socket.gaierror))
_CONNECT_TIMEOUTS = (ConnectTimeoutError, getattr(aiohttp, "ConnectionTimeoutError", ConnectTimeoutError))
_READ_TIMEOUTS = (ReadTimeoutError, TimeoutError, asyncio.TimeoutError, socket.timeout)
_NO_ANSWER = (BotoConnectionError, HTTPClientError, aiohttp.ClientError, ConnectionError)
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId": "the endpoint does not know this access key",
    "SignatureDoesNotMatch": "the secret key does not match the access key",
    "InvalidToken": "the session token is not valid",
    "ExpiredToken": "the session token has expired",
    "TokenRefreshRequired": "the session token has expired",
    "InvalidClientTokenId": "the endpoint does not know this access key",
}
_DENIED_CODES = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem"}


# ---- failures -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Failure:
    """What went wrong with a request, before it is worded for one backend's URL."""

    error: type[StoreUnreachableError | StoreAccessError | NoSuchBucketError | StoreConfigError]
    what: str  # the problem, in words
    check: str  # what the user should check (names of variables or options)


class _Sources:
    """Where this backend's endpoint and credentials were configured: the names the messages tell the user to check."""

    def __init__(self, fs: Any, storage_options: Mapping[str, Any]) -> None:
        conf = fsspec.config.conf.get("s3", {})
        client_kwargs = getattr(fs, "client_kwargs", None) or {}
        if "endpoint_url" in storage_options or "endpoint_url" in (storage_options.get("client_kwargs") or {}):
            self.endpoint = "the endpoint_url storage option"
        elif "endpoint_url" in conf or "endpoint_url" in (conf.get("client_kwargs") or {}):
            self.endpoint = "FSSPEC_S3_ENDPOINT_URL"
        elif os.environ.get("AWS_ENDPOINT_URL_S3"):
            self.endpoint = "AWS_ENDPOINT_URL_S3"
        elif client_kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None):
            self.endpoint = "the endpoint_url storage option"
        else:
            self.endpoint = "AWS_ENDPOINT_URL"
        if any(k in storage_options for k in ("key", "secret", "username", "password", "token")):
            self.key, self.secret = "the key storage option", "the secret storage option"
        elif "key" in conf or "secret" in conf:
            self.key, self.secret = "FSSPEC_S3_KEY", "FSSPEC_S3_SECRET"
        else:
            self.key, self.secret = "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"
        self.token = "AWS_SESSION_TOKEN" if self.key == "AWS_ACCESS_KEY_ID" else "the token storage option"


def _timeout_text(seconds: float) -> str:
    return f"{seconds:g}s"


def _classify(exc: BaseException, sources: _Sources, policy: RequestPolicy) -> _Failure | None:
    """The storage failure `exc` stands for, or None when it is not one (a missing key, a refused condition, a bug)."""
    chain = _chain(exc)
    if any(isinstance(e, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)) for e in chain):
        return _Failure(
            StoreAccessError,
            "no usable S3 credentials were found",
            f"set {sources.key} and {sources.secret} (or AWS_PROFILE)",
        )
    if any(isinstance(e, NoRegionError) for e in chain):
        return _Failure(StoreConfigError, "no S3 region is configured", "set AWS_DEFAULT_REGION")
    code = _error_code(exc)
    if code in _CREDENTIAL_CODES:
        check = {
            "InvalidAccessKeyId": sources.key,
            "InvalidClientTokenId": sources.key,
            "SignatureDoesNotMatch": f"{sources.secret} (and {sources.key})",
        }.get(code, sources.token)
        return _Failure(StoreAccessError, f"{_CREDENTIAL_CODES[code]} ({code})", f"check {check}")
    if code in _DENIED_CODES:
        return _Failure(
            StoreAccessError,
            f"access denied ({'403 Forbidden' if code == '403' else code})",
            f"check {sources.key} and {sources.secret}, and that they may use this bucket",
        )
    if code == "NoSuchBucket":
        return _Failure(
            NoSuchBucketError, "the bucket does not exist", f"check the bucket name in the URL (and {sources.endpoint})"
        )
    if code in _UNAVAILABLE:
        return _Failure(StoreUnreachableError, f"the endpoint cannot serve requests now ({code})", "try again later")
    if code is not None:
        return None  # any other answer is the server's word on this request
    endpoint = f"check {sources.endpoint}"
    for e in chain:
        if isinstance(e, _DNS_ERRORS):
            return _Failure(StoreUnreachableError, "its host name does not resolve", endpoint)
    for e in chain:
        if isinstance(e, _CONNECT_TIMEOUTS):
            return _Failure(
                StoreUnreachableError,
                f"no connection within the {_timeout_text(policy.connect_timeout)} connect timeout",
                f"{endpoint} and the network (the wait is {ENV_CONNECT_TIMEOUT})",
            )
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return _Failure(StoreUnreachableError, "connection refused", f"{endpoint} and that the server is running")
    for e in chain:
        if isinstance(e, _READ_TIMEOUTS):
            return _Failure(
                StoreUnreachableError,
                f"connected, but no answer within the {_timeout_text(policy.read_timeout)} read timeout",
                f"{endpoint} names an S3 server that is up (the wait is {ENV_READ_TIMEOUT})",
            )
    for e in chain:
        if isinstance(e, ValueError) and "endpoint" in str(e).lower():
            return _Failure(StoreConfigError, f"the endpoint URL is not valid ({e})", endpoint)
    for e in chain:
        if isinstance(e, _NO_ANSWER):
            # botocore's messages end with the request's URL, which the message names already (as the store's)
            detail = str(e).split(': "', 1)[0] if isinstance(e, BotoCoreError) else f"{type(e).__name__}: {e}"
            return _Failure(StoreUnreachableError, f"the connection failed ({detail})", endpoint)
    return None


class _SilenceError(TimeoutError):
    """The endpoint answered none of the waiting requests for one attempt's limit (a read timeout, for the
    requests still queued for a connection)."""


@dataclass(frozen=True)
class _Outage:
    """An endpoint that gave no answer: when it went silent, when its last request failed, how, and the note."""

    began: float
    failed: float
    failure: _Failure
    note: str


class _Silence:
    """What one endpoint answered lately, seen by every request to it: how many requests wait for it, since
    when none of them got an answer, and its last answer."""

    def __init__(self) -> None:
        self.waiting = 0
        self.quiet_since = 0.0
        self.last_answer = 0.0

    def silent_since(self, started: float) -> float:
        """When the endpoint went silent for a request started at `started` that got no answer: the start of the
        wait of the requests still waiting (or this request's start, if earlier), but never before its last
        answer."""
        return max(self.last_answer, min(started, self.quiet_since) if self.waiting else started)


_DOWN: dict[str, _Outage] = {}
"""Endpoint -> its outage, until it answers again (or `forget_outage`)."""
_SILENCE: dict[str, _Silence] = {}
_DOWN_LOCK = threading.Lock()


def _silence(endpoint: str) -> _Silence:
    with _DOWN_LOCK:
        return _SILENCE.setdefault(endpoint, _Silence())


def _answered(endpoint: str, **_event: Any) -> None:
    """The endpoint answered a request (botocore's after-call, whatever the answer): it is not silent."""
    now = time.monotonic()
    with _DOWN_LOCK:
        state = _SILENCE.setdefault(endpoint, _Silence())
        state.quiet_since = state.last_answer = now
        _DOWN.pop(endpoint, None)


_PREPARED_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def _storage_call(method):
    """Run a primitive with the backend's retries, turning a storage failure into a StorageUnavailableError."""

    @functools.wraps(method)
    def call(self: S3Backend, *args: Any, **kwargs: Any) -> Any:
        return self._attempts(method, args, kwargs)

    return call


class S3Backend(Backend):
    """Keys are objects under `s3://bucket/prefix/`."""

    capabilities = Capabilities(atomic_create=True, ranged_reads=True, listing=True, deletes=True, remote=True)
    max_workers = 16

    def __init__(
        self, path: str, fs: Any = None, *, request_policy: RequestPolicy | None = None, **storage_options: Any
    ) -> None:
        super().__init__()
        path = path.split("://", 1)[-1].strip("/")
        if not path or len(path.split("/", 1)[0]) < 3:
            raise BackendError(f"s3://{path}: a bucket name (3+ characters) is required")
        self.path = path
        self.url = f"s3://{path}"
        self.bucket = path.split("/", 1)[0]
        self.storage_options = storage_options
        policy = request_policy or RequestPolicy.from_env()
        if fs is None:
            options, policy = _client_options(storage_options, policy)
            # fresh instance: listings are never cached, so exists/list see other writers at once
            fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
            fs.retries = 1  # s3fs's own retry loop would multiply the attempts made here
        elif request_policy is None:
            policy = _policy_of(fs, policy)
        self.fs = fs
        self.policy = policy
        self._sources = _Sources(fs, storage_options)

    def probe_scope(self) -> tuple:
        """Conditional writes are the server's and the bucket's property, not a prefix's."""
        endpoint = getattr(getattr(self.fs, "s3", None), "_endpoint", None)
        host = getattr(endpoint, "host", None) or str(self.fs.client_kwargs.get("endpoint_url", ""))
        return (type(self.fs).__name__, host, self.bucket)

    def transient_error(self, exc: BaseException) -> bool:
        """The server did not answer (refused connection, DNS, timeout, a connection cut off) or answered
        that it cannot serve now (5xx other than 501, throttling). Any other answer is the server's word.

        Every StorageUnavailableError counts: credentials or a bucket that are wrong now say nothing about
        create-once either, and may be fixed while a writer runs."""
        if isinstance(exc, StorageUnavailableError):
            return True
        code = _error_code(exc)
        if code is not None:
            return code in _UNAVAILABLE
        seen = 0
        link: BaseException | None = exc
        while link is not None and seen < 8:
            if isinstance(
                link,
                (
                    OSError,
                    TimeoutError,
                    asyncio.TimeoutError,
                    BotoConnectionError,
                    HTTPClientError,
                    aiohttp.ClientError,
                ),
            ):
                return True
            link = link.__cause__ or link.__context__
            seen += 1
        return False

    def child(self, prefix: str) -> S3Backend:
        return S3Backend(f"{self.path}/{prefix}", fs=self.fs, request_policy=self.policy, **self.storage_options)

    # ---- failures --------------------------------------------------------------------------------
    def endpoint(self) -> str:
        """The endpoint URL requests go to (as configured until the client exists), without credentials."""
        client = getattr(self.fs, "_s3", None)
        host = getattr(getattr(client, "_endpoint", None), "host", None)
        if not host:
            host = (
                (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url")
                or getattr(self.fs, "endpoint_url", None)
                or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL")
            )
        return redact_url(str(host).rstrip("/")) if host else "AWS S3"

    def forget_outage(self) -> None:
        """Ask this endpoint again at the next request even if it just failed to answer (a caller that spaces its
        attempts out itself, such as capture's backoff, starts each one afresh)."""
        with _DOWN_LOCK:
            _DOWN.pop(self.endpoint(), None)

    async def _watched(self, endpoint: str, coro, silence_limit: float | None) -> Any:
        """Await `coro`; with `silence_limit`, counted among the requests waiting for `endpoint`, and failed
        (`_SilenceError`) once the endpoint has answered none of them for that many seconds, wherever they wait (a
        connection of the pool, a read)."""
        if silence_limit is None:
            return await coro
        state = _silence(endpoint)
        with _DOWN_LOCK:
            if state.waiting == 0:
                state.quiet_since = time.monotonic()
            state.waiting += 1
        task = asyncio.ensure_future(coro)
        try:
            while True:
                with _DOWN_LOCK:
                    left = state.quiet_since + silence_limit - time.monotonic()
                if left <= 0:
                    raise _SilenceError(f"no answer for {silence_limit:g}s")
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
        finally:
            with _DOWN_LOCK:
                state.waiting -= 1
            if not task.done():
                task.cancel()

    def _sync(self, coro, *, upload: bool = False) -> Any:
        """Run a request's coroutine in s3fs's event loop, watched (an upload is not: it gets no answer until its
        body is sent, which may take long, and is bounded by its own limit)."""
        return sync(self.fs.loop, self._watched, self.endpoint(), coro, None if upload else self.policy.attempt_limit())

    def _refuse_during_outage(self) -> None:
        """Fail at once while the endpoint is in an outage and asking it could not end within the outage's
        deadline (or it failed moments ago)."""
        with _DOWN_LOCK:
            outage = _DOWN.get(self.endpoint())
        if outage is None:
            return
        now = time.monotonic()
        past_deadline = now + self.policy.attempt_limit() > outage.began + self.policy.deadline
        if now < outage.failed + OUTAGE_MEMORY or past_deadline:
            raise self._error(outage.failure, outage.note)

    def _error(self, failure: _Failure, note: str = "") -> StorageUnavailableError:
        return failure.error(f"{self.url}: S3 endpoint {self.endpoint()}: {failure.what}{note}: {failure.check}")

    def _prepare_client(self) -> None:
        """Create the client, without `Expect: 100-continue` on uploads: aiohttp waits for the server's go-ahead with
        no timeout at all, so a server that accepts connections and never answers would hold every PUT forever."""
        client = self.fs._s3
        if client is None or client not in _PREPARED_CLIENTS:
            client = self.fs.s3
            client.meta.events.unregister("before-call.s3", add_expect_header)
            client.meta.events.register("after-call.s3", functools.partial(_answered, self.endpoint()))
            _PREPARED_CLIENTS.add(client)

    def _attempts(self, method, args: tuple, kwargs: dict) -> Any:
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                self._prepare_client()
                self._refuse_during_outage()
                return method(self, *args, **kwargs)
            except StorageUnavailableError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below; anything else is raised unchanged
                failure = _classify(exc, self._sources, self.policy)
                if failure is None:
                    raise
                silent_since = _silence(self.endpoint()).silent_since(started)
                if failure.error.transient:
                    delay = self.policy.backoff(attempt)
                    now = time.monotonic()
                    if (
                        self.policy.retry_allowed(attempt, now - started, delay)
                        and now + delay + self.policy.attempt_limit() <= silent_since + self.policy.deadline
                    ):
                        log.debug(
                            "%s: attempt %d failed (%s); retrying in %.1fs", self.url, attempt, failure.what, delay
                        )
                        time.sleep(delay)
                        continue
                note = ""
                if failure.error.transient:
                    elapsed = time.monotonic() - started
                    note = f" ({attempt} attempt{'s' if attempt > 1 else ''} in {elapsed:.1f}s)"
                    with _DOWN_LOCK:
                        known = _DOWN.get(self.endpoint())
                        began = silent_since if known is None else min(known.began, silent_since)
                        _DOWN[self.endpoint()] = _Outage(began, time.monotonic(), failure, note)
                raise self._error(failure, note) from exc

    def _missing(self, exc: BaseException) -> None:
        """A "no such key" that is really "no such bucket" is a storage failure, not an absent value."""
        failure = _classify(exc, self._sources, self.policy) if _error_code(exc) == "NoSuchBucket" else None
        if failure is not None:  # the code is always classified: a NoSuchBucketError
            raise self._error(failure) from exc

    # ---- primitives ------------------------------------------------------------------------------
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
                body = await resp["Body"].read()
            finally:
                resp["Body"].close()
            _answered(self.endpoint())  # the body came too: a long one is no silence
            return body

        return await _s3_retrying(call_and_read, retries=self.fs.retries)

    async def _put(self, path: str, body: bytes, **conditions: Any) -> None:
        bucket, obj_key, _ = self.fs.split_path(path)
        await asyncio.wait_for(
            self.fs._call_s3("put_object", Bucket=bucket, Key=obj_key, Body=body, **conditions),
            self.policy.attempt_limit(len(body)),
        )

    @_storage_call
    def _read(self, key: str) -> bytes:
        try:
            return self._sync(self._get(self._path(key)))
        except FileNotFoundError as exc:
            self._missing(exc)
            raise self._not_found(key) from None

    @_storage_call
    def _read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            return self._sync(self.fs._cat_file(self._path(key), start=start, end=end))
        except FileNotFoundError as exc:
            self._missing(exc)
            raise self._not_found(key) from None

    @_storage_call
    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Concurrent GETs in s3fs's event loop."""
        paths = [self._path(validate_key(k)) for k in keys]
        if not paths:
            return []
        results = self._sync(
            _run_coros_in_chunks([self._get(p) for p in paths], batch_size=self.max_workers * 4, return_exceptions=True)
        )
        for value in results:  # a storage failure of any request is the whole call's
            if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                raise value
        values = []
        for key, value in zip(keys, results):
            if isinstance(value, FileNotFoundError):
                self._missing(value)
                raise self._not_found(key)
            self.stats.count_read(len(value))
            values.append(value)
        return values

    @_storage_call
    def read_ranges(self, ranges: Sequence[ByteRange]) -> list[bytes]:
        """Concurrent ranged GETs in s3fs's event loop."""
        if not ranges:
            return []
        paths = [self._path(validate_key(r.key)) for r in ranges]
        try:
            values = self._sync(
                self.fs._cat_ranges(paths, [r.start for r in ranges], [r.end for r in ranges], on_error="return")
            )
        except FileNotFoundError as exc:
            self._missing(exc)
            raise self._not_found(ranges[0].key) from None
        for value in values:
            if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                raise value
        for r, value in zip(ranges, values):
            if isinstance(value, FileNotFoundError):
                self._missing(value)
                raise self._not_found(r.key)
            self.stats.count_read(len(value))
        return values

    @_storage_call
    def _write(self, key: str, data, durable: bool = True) -> None:
        # one PUT (or a multipart upload completed in one call) replaces the object atomically
        body = bytes(data)
        if len(body) <= MAX_SINGLE_PUT:
            self._sync(self._put(self._path(key), body), upload=True)
        else:
            self._sync(self.fs._pipe_file(self._path(key), body), upload=True)

    @_storage_call
    def _create(self, key: str, data) -> bool:
        body = bytes(data)
        for attempt in range(8):
            try:
                self._sync(self._put(self._path(key), body, IfNoneMatch="*"), upload=True)
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

    @_storage_call
    def _head(self, key: str) -> dict | None:
        """One HEAD request (s3fs's `info` adds a LIST for a missing key, to look for a directory)."""
        bucket, obj_key, _ = self.fs.split_path(self._path(key))

        try:
            return self._sync(self.fs._call_s3("head_object", Bucket=bucket, Key=obj_key))
        except FileNotFoundError:
            return None
        except Exception as exc:  # s3fs wraps ClientError; a 404 is "absent" (a HEAD has no body to say "no bucket")
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

    def _size_and_mtime(self, key: str) -> KeyStat:
        head = self._info(key)
        return KeyStat(int(head["ContentLength"]), head["LastModified"].timestamp())

    @_storage_call
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
            found = self._sync(pages())
        except FileNotFoundError as exc:
            self._missing(exc)
            return []
        # a key ending in "/" is a directory placeholder some tools create, not a value
        return [k[len(base) :] for k in found if not k.endswith("/")]

    @_storage_call
    def _delete(self, key: str) -> None:
        try:
            self._sync(self.fs._rm_file(self._path(key)))
        except FileNotFoundError:
            pass

    @_storage_call
    def _list_dir(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.path
        try:
            return [
                p.rstrip("/").rsplit("/", 1)[-1]
                for p in self._sync(self.fs._ls(base, detail=False, refresh=True))
                if p.rstrip("/") != base
            ]
        except FileNotFoundError as exc:
            self._missing(exc)
            return []
