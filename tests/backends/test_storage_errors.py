"""Storage mistakes are one line, and bounded in time.

Every command that opens a store, pointed at a store it cannot use (no credentials, wrong credentials, an unknown
bucket on the real SeaweedFS server; a closed local port; a local socket that accepts connections and never
answers; a host name that does not resolve), exits 1 with one line that names the URL and what to check, and no
traceback. The silent socket runs with small timeouts set through the documented variables, and the bound they
promise is measured (uploads included). A store that fails in the middle of a command (a proxy in front of the
real server that resets connections) ends the command the same way: it is not reported as a corrupt or invalid
bundle. A server that stops answering in the middle of a command (a proxy that stops forwarding after a number of
requests) ends every command within the documented deadline, counted from the moment it stopped.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.scan_helpers import write_step
from trajectory_replay.backends import open_backend
from trajectory_replay.backends import s3 as s3_backend
from trajectory_replay.backends.s3 import (
    ENV_CONNECT_TIMEOUT,
    ENV_MAX_ATTEMPTS,
    ENV_READ_TIMEOUT,
    ENV_RETRY_DEADLINE,
    NoSuchBucketError,
    RequestPolicy,
    S3Backend,
    StoreAccessError,
    StoreUnreachableError,
)
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.errors import StorageUnavailableError
from trajectory_replay.ops.export import export_bundle

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("replay", "inspect", "validate", "ls", "stats", "cp", "gc", "fsck", "import", "demo")
ONE_ATTEMPT = {ENV_MAX_ATTEMPTS: "1"}
"""For the dead endpoints in the per-command cases: retries are the backend's, the same for every command, and
are checked once, below."""
SMALL = {ENV_CONNECT_TIMEOUT: "0.3", ENV_READ_TIMEOUT: "0.3", **ONE_ATTEMPT}
"""Timeouts for the silent socket: one attempt of 0.3 s."""

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_remembered_outage():
    """An endpoint that failed a moment ago is not asked again for a few seconds, process-wide: each case starts
    from a clean slate."""
    s3_backend._DOWN.clear()
    yield
    s3_backend._DOWN.clear()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """A local bundle (for cp) and an older-format copy of it (for import)."""
    tmp = tmp_path_factory.mktemp("sources")
    bundle = write_canonical(str(tmp / "store"))
    export_bundle(bundle, tmp / "v1")
    return {"bundle": bundle, "v1": str(tmp / "v1")}


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A loopback port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def silent_port():
    """A loopback socket that listens (the kernel accepts connections into its backlog) and never reads or
    answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(512)
    yield s.getsockname()[1]
    s.close()


def _env(server, **changes) -> dict:
    """The variables a user would set for `server`, with `changes` (None removes one); no AWS file or instance
    metadata is consulted."""
    env = {k: None for k in os.environ if k.startswith(("AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_S3_"))}
    env.update(server.env())
    env.update(
        AWS_CONFIG_FILE="/nonexistent/aws-config",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.update(changes)
    return env


def _use_env(monkeypatch, env: dict) -> None:
    """Set the variables of `env` in this process for the test (None removes one)."""
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)


def _mistake(kind: str, server, bucket: str, closed_port: int, silent_port: int) -> tuple[dict, str, list[str]]:
    """(environment, store URL, fragments the message must hold) of one kind of storage mistake."""
    url = f"s3://{bucket}/t-{uuid.uuid4().hex[:8]}"
    if kind == "no credentials":
        return (
            _env(server, AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None),
            url,
            ["no usable S3 credentials", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", server.endpoint],
        )
    if kind == "wrong credentials":
        # a HEAD's 403 carries no error code, so some commands can only say "access denied": both keys are named
        return _env(server, AWS_SECRET_ACCESS_KEY="not-the-secret"), url, ["AWS_SECRET_ACCESS_KEY", server.endpoint]
    if kind == "unknown bucket":
        other = f"nosuch-{uuid.uuid4().hex[:10]}"
        return (
            _env(server),
            f"s3://{other}/run",
            ["the bucket does not exist", f"s3://{other}", "check the bucket name", "AWS_ENDPOINT_URL"],
        )
    if kind == "refused":
        endpoint = f"http://127.0.0.1:{closed_port}"
        return (
            _env(server, AWS_ENDPOINT_URL=endpoint, **ONE_ATTEMPT),
            url,
            ["connection refused", endpoint, "AWS_ENDPOINT_URL"],
        )
    if kind == "never answers":
        endpoint = f"http://127.0.0.1:{silent_port}"
        return (
            _env(server, AWS_ENDPOINT_URL=endpoint, **SMALL),
            url,
            ["no answer within the 0.3s read timeout", endpoint, "AWS_ENDPOINT_URL", ENV_READ_TIMEOUT],
        )
    assert kind == "dns"
    endpoint = "http://nonexistent.invalid:9000"
    return (
        _env(server, AWS_ENDPOINT_URL=endpoint, **ONE_ATTEMPT),
        url,
        ["host name does not resolve", endpoint, "AWS_ENDPOINT_URL"],
    )


def _argv(command: str, url: str, sources: dict[str, str]) -> list[str]:
    return {
        "replay": ["replay", url],
        "inspect": ["inspect", f"{url}/b-00001"],
        "validate": ["validate", f"{url}/b-00001"],
        "ls": ["ls", url],
        "stats": ["stats", url],
        "cp": ["cp", sources["bundle"], url, "--quiet"],
        "gc": ["gc", url, "--dry-run", "--quiet"],
        "fsck": ["fsck", url, "--quiet"],
        "import": ["import", sources["v1"], url],
        "demo": ["demo", url],
    }[command]


MISTAKES = ("no credentials", "wrong credentials", "unknown bucket", "refused", "never answers", "dns")


def _seconds(call, match: str | None = None) -> float:
    """How long `call` takes to raise a StorageUnavailableError whose message holds `match` (any other outcome
    fails the test)."""
    s3_backend._DOWN.clear()
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match=match):
        call()
    return time.monotonic() - started


def _bound(promised: float, baseline: float) -> float:
    """The longest a call that waits out `promised` seconds of timeouts may take on this host now: those seconds
    with as much again for timers that fire late on a loaded host, plus three times `baseline`, the same call
    measured just before against an endpoint that refuses at once (its own work, as slow as the host's load makes
    it). A call that waited a timeout more than promised (botocore's own 60 s, another attempt) is past it."""
    return 2 * promised + 3 * baseline


@pytest.mark.parametrize("kind", MISTAKES)
@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_reports_each_storage_mistake_in_one_line(
    command, kind, s3_server, s3_bucket, sources, closed_port, silent_port
):
    env, url, fragments = _mistake(kind, s3_server, s3_bucket, closed_port, silent_port)
    if kind == "never answers":  # the command's own work, failing at once on this host now
        refused, refused_url, _ = _mistake("refused", s3_server, s3_bucket, closed_port, silent_port)
        started = time.monotonic()
        assert runner.invoke(app, _argv(command, refused_url, sources), env=refused).exit_code == 1
        baseline = time.monotonic() - started
    started = time.monotonic()
    result = runner.invoke(app, _argv(command, url, sources), env=env)
    elapsed = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error: s3://"), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert isinstance(result.exception, SystemExit)  # exited through the CLI's error path, nothing escaped
    assert url.split("/")[2] in lines[0]  # names the bucket of the URL
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    if kind == "never answers":  # one attempt: a connect and a read timeout of 0.3 s each bound the wait
        assert elapsed < _bound(0.3 + 0.3, baseline), (elapsed, baseline, lines[0])


def test_json_says_io_for_a_dead_endpoint(s3_server, s3_bucket, sources, closed_port):
    env, url, _ = _mistake("refused", s3_server, s3_bucket, closed_port, 0)
    for command in ("replay", "inspect", "validate", "ls", "stats", "cp", "gc", "fsck"):
        result = runner.invoke(app, [*_argv(command, url, sources), "--json"], env=env)
        assert result.exit_code == 1, (command, result.stdout, result.stderr)
        assert '"status": "io"' in result.stdout and "connection refused" in result.stdout, (command, result.stdout)


def test_the_real_command_line_prints_one_line_and_no_traceback(s3_server, s3_bucket, closed_port):
    """The installed entry point, in a process of its own, with the user's variables only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_S3_"))}
    env.update(s3_server.env(), AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}", AWS_EC2_METADATA_DISABLED="true")
    url = f"s3://{s3_bucket}/cli"
    out = subprocess.run(
        [sys.executable, "-m", "trajectory_replay", "ls", url],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and out.stdout == "", out
    expected = (
        rf"trajectory-replay: error: {re.escape(url)}: S3 endpoint http://127\.0\.0\.1:{closed_port}: "
        r"connection refused \(3 attempts in \d+\.\ds\): check AWS_ENDPOINT_URL and that the server is running"
    )
    assert re.fullmatch(expected, out.stderr.strip()), out.stderr


def test_credentials_in_the_endpoint_url_are_not_printed(s3_server, s3_bucket, closed_port, monkeypatch):
    _use_env(monkeypatch, _env(s3_server))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://user:hunter2@127.0.0.1:{closed_port}")
    backend = open_backend(f"s3://{s3_bucket}/redacted")
    with pytest.raises(StoreUnreachableError) as caught:
        backend.list()
    assert "hunter2" not in str(caught.value) and f"http://127.0.0.1:{closed_port}" in str(caught.value)


def test_a_silent_endpoint_is_bounded_by_the_timeouts_and_the_deadline(
    s3_server, s3_bucket, silent_port, closed_port, monkeypatch
):
    """The defaults scaled down a hundredfold (connect 0.1 s, read 0.6 s, deadline 1.2 s, 3 attempts): a second
    attempt could end past the deadline, so the request gives up after the first. Then the same endpoint fails at
    once for a while, instead of each request waiting again."""
    _use_env(monkeypatch, _env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_port}"))
    monkeypatch.setenv(ENV_CONNECT_TIMEOUT, "0.1")
    monkeypatch.setenv(ENV_READ_TIMEOUT, "0.6")
    monkeypatch.setenv(ENV_RETRY_DEADLINE, "1.2")
    backend = open_backend(f"s3://{s3_bucket}/silent")
    assert backend.policy == RequestPolicy(connect_timeout=0.1, read_timeout=0.6, max_attempts=3, deadline=1.2)
    refused = _refused_backend(monkeypatch, s3_bucket, closed_port)
    for call in ("read", "write", "exists"):
        args = ("k", b"v") if call == "write" else ("k",)
        baseline = _seconds(lambda call=call, args=args: getattr(refused, call)(*args), "connection refused")
        s3_backend._DOWN.clear()
        started = time.monotonic()
        with pytest.raises(StoreUnreachableError, match=r"read timeout \(1 attempt in"):
            getattr(backend, call)(*args)
        elapsed = time.monotonic() - started
        # one attempt of a connect and a read timeout ("1 attempt" says no other began)
        assert 0.6 <= elapsed < _bound(0.1 + 0.6, baseline), (call, elapsed, baseline)
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="no answer within the 0.6s read timeout"):
        backend.list()  # remembered: not asked again
    assert time.monotonic() - started < 0.6  # asking again would have waited out the read timeout

    # the same with a deadline that leaves room: the attempts are made, and their number is said
    monkeypatch.setenv(ENV_RETRY_DEADLINE, "10")
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "2")
    policy = RequestPolicy.from_env()
    attempts, promised = _worst_case(policy, policy.connect_timeout + policy.read_timeout)
    baseline = _seconds(lambda: refused.read("k"), "connection refused")
    s3_backend._DOWN.clear()
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"\(2 attempts in"):
        open_backend(f"s3://{s3_bucket}/silent").read("k")
    elapsed = time.monotonic() - started
    assert attempts == 2 and 1.2 <= elapsed < _bound(promised, attempts * baseline), (elapsed, promised, baseline)


def _refused_backend(monkeypatch, bucket: str, closed_port: int) -> S3Backend:
    """A backend of the current settings but one attempt, at a port that refuses connections: what a request
    costs here when it waits for nothing."""
    with monkeypatch.context() as changed:
        changed.setenv(ENV_MAX_ATTEMPTS, "1")
        backend = S3Backend(f"s3://{bucket}/refused", client_kwargs={"endpoint_url": f"http://127.0.0.1:{closed_port}"})
    assert backend.policy.max_attempts == 1
    return backend


def test_reads_queued_behind_the_connection_pool_wait_one_attempt_not_one_per_pool_full(
    s3_server, s3_bucket, silent_port, monkeypatch
):
    """botocore's timeouts leave the wait for one of the client's 10 connections unbounded: 40 reads of a silent
    endpoint waited 4 read timeouts, one per pool-full. They fail together once the endpoint has answered none of
    them for one attempt's limit (connect + read)."""
    _use_env(monkeypatch, _env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_port}"))
    monkeypatch.setenv(ENV_CONNECT_TIMEOUT, "0.2")
    monkeypatch.setenv(ENV_READ_TIMEOUT, "1")
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "1")
    backend = open_backend(f"s3://{s3_bucket}/queued")
    limit = backend.policy.attempt_limit()
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="no answer within the 1s read timeout"):
        backend.read_many([f"k{i}" for i in range(40)])
    assert time.monotonic() - started < 2 * limit  # 4 read timeouts before; one attempt's limit now


def test_after_an_outage_no_request_waits_past_its_deadline(s3_server, s3_bucket, silent_port, monkeypatch):
    """An endpoint that failed to answer was asked again once its 5 s of memory were over, each request waiting
    its timeouts again: a command that went on (a listing skipping what it could not read) waited without end.
    During an outage, a request that could not end within the deadline of the moment the endpoint went silent
    fails at once; one that could is made."""
    _use_env(monkeypatch, _env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_port}"))
    monkeypatch.setenv(ENV_CONNECT_TIMEOUT, "0.1")
    monkeypatch.setenv(ENV_READ_TIMEOUT, "0.5")
    monkeypatch.setenv(ENV_RETRY_DEADLINE, "2.5")
    monkeypatch.setattr(s3_backend, "OUTAGE_MEMORY", 0.1)
    backend = open_backend(f"s3://{s3_bucket}/outage")
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"\((\d) attempts? in"):
        backend.read("k")
    made, deadline = 0, backend.policy.deadline
    while time.monotonic() < started + 2 * deadline:
        time.sleep(0.15)
        asked = time.monotonic()
        with pytest.raises(StoreUnreachableError):
            backend.exists("k")
        ended = time.monotonic()
        if ended - asked > 0.3:  # the endpoint was asked: only while a whole attempt fitted within the deadline
            made += 1
            assert ended <= started + deadline * 1.25, (ended - started, deadline)  # slack for a loaded machine
    assert made <= 2, made


def _worst_case(policy: RequestPolicy, attempt_seconds: float) -> tuple[int, float]:
    """(attempts, seconds) of one request whose every attempt fails after `attempt_seconds`, with the longest
    backoffs, following the backend's own retry rule."""
    elapsed, attempt = 0.0, 0
    while True:
        attempt += 1
        elapsed += attempt_seconds
        delay = min(s3_backend.RETRY_MAX, s3_backend.RETRY_FIRST * 2 ** (attempt - 1))
        if not policy.retry_allowed(attempt, elapsed, delay):
            return attempt, elapsed
        elapsed += delay


def test_the_default_policy_fails_a_dead_endpoint_within_two_minutes():
    """Today's defaults kept `ls` waiting 414 s on a silent endpoint. Now: connect 10 s, read 60 s, 3 attempts, and
    no retry that could end past 120 s."""
    policy = RequestPolicy.from_env({})
    assert policy == RequestPolicy(connect_timeout=10.0, read_timeout=60.0, max_attempts=3, deadline=120.0)
    # accepts and never answers: one attempt of 60 s (a second could not end within the deadline)
    assert _worst_case(policy, policy.read_timeout) == (1, 60.0)
    # drops connection attempts (a firewall): three attempts of 10 s
    attempts, seconds = _worst_case(policy, policy.connect_timeout)
    assert attempts == 3 and seconds <= 35
    # answers slowly, just under each timeout: still bounded by the deadline
    attempts, seconds = _worst_case(policy, policy.connect_timeout + policy.read_timeout - 0.1)
    assert attempts == 1 and seconds < 120
    # refused or unresolvable: three fast attempts
    attempts, seconds = _worst_case(policy, 0.01)
    assert attempts == 3 and seconds < 2


@pytest.mark.parametrize(
    "name,value",
    [(ENV_READ_TIMEOUT, "soon"), (ENV_CONNECT_TIMEOUT, "-1"), (ENV_MAX_ATTEMPTS, "0"), (ENV_RETRY_DEADLINE, "nan")],
)
def test_a_bad_setting_is_one_line_naming_the_variable(name, value, s3_server, s3_bucket):
    result = runner.invoke(app, ["ls", f"s3://{s3_bucket}/x"], env=_env(s3_server, **{name: value}))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"trajectory-replay: error: {name}={value!r}: must be "
        + ("a whole number >= 1" if name == ENV_MAX_ATTEMPTS else "a number of seconds > 0")
    ], result.stderr


def test_storage_options_win_over_the_variables(s3_server, s3_bucket, silent_port, closed_port, monkeypatch):
    """A read timeout given as a storage option applies, whatever the variable says."""
    monkeypatch.setenv(ENV_READ_TIMEOUT, "30")
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "1")

    def at(port: int) -> S3Backend:
        return S3Backend(
            f"s3://{s3_bucket}/options",
            key=s3_server.key,
            secret=s3_server.secret,
            client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}"},
            config_kwargs={"read_timeout": 0.4},
        )

    backend = at(silent_port)
    assert backend.fs.config_kwargs["read_timeout"] == 0.4 and backend.policy.read_timeout == 0.4
    baseline = _seconds(lambda: at(closed_port).read("k"), "connection refused")
    started = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="0.4s read timeout.*check the endpoint_url storage option"):
        backend.read("k")
    elapsed = time.monotonic() - started
    assert elapsed < _bound(backend.policy.connect_timeout + 0.4, baseline), (elapsed, baseline)  # not 30 s


def test_an_upload_to_a_silent_endpoint_is_bounded(s3_server, s3_bucket, silent_port, closed_port, monkeypatch):
    """botocore sends uploads with `Expect: 100-continue`, and aiohttp waits for the go-ahead with no timeout; a
    body larger than the socket buffers blocks before the read timeout even starts. Both are bounded."""
    _use_env(monkeypatch, _env(s3_server, AWS_ENDPOINT_URL=f"http://127.0.0.1:{silent_port}"))
    monkeypatch.setenv(ENV_CONNECT_TIMEOUT, "0.5")
    monkeypatch.setenv(ENV_READ_TIMEOUT, "0.5")
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "1")
    monkeypatch.setattr(s3_backend, "SECONDS_PER_UPLOADED_MIB", 0.02)
    backend = open_backend(f"s3://{s3_bucket}/upload")
    refused = _refused_backend(monkeypatch, s3_bucket, closed_port)
    # without these bounds both uploads wait forever
    for body, promised in ((b"small", 1.0), (bytes(48 << 20), 1.0 + 0.02 * 48)):
        for call, key in (("write", "k"), ("create_if_absent", "k2")):
            baseline = _seconds(lambda c=call, k=key, b=body: getattr(refused, c)(k, b), "connection refused")
            elapsed = _seconds(lambda c=call, k=key, b=body: getattr(backend, c)(k, b))
            assert elapsed < _bound(promised, baseline), (call, len(body), elapsed, baseline)


def test_kinds_of_failure_are_told_apart(s3_server, s3_bucket, closed_port, monkeypatch):
    """Capture backs off on each of these and logs each kind once: the classes say which kind it met."""
    monkeypatch.setenv(ENV_MAX_ATTEMPTS, "1")  # the refused endpoint: no backoff between retries to wait out
    options = s3_server.storage_options()
    with pytest.raises(NoSuchBucketError) as no_bucket:
        S3Backend(f"s3://nosuch-{uuid.uuid4().hex[:10]}/x", **options).list()
    wrong = dict(options, secret="not-the-secret")
    with pytest.raises(StoreAccessError) as denied:
        S3Backend(f"s3://{s3_bucket}/x", **wrong).read("k")
    refused = dict(options, client_kwargs={"endpoint_url": f"http://127.0.0.1:{closed_port}"})
    with pytest.raises(StoreUnreachableError) as unreachable:
        S3Backend(f"s3://{s3_bucket}/x", **refused).read("k")
    kinds = [(e.value.kind, e.value.transient) for e in (no_bucket, denied, unreachable)]
    assert kinds == [("bucket", False), ("access", False), ("unreachable", True)]
    assert all(isinstance(e.value, StorageUnavailableError) for e in (no_bucket, denied, unreachable))
    assert "check the secret storage option" in str(denied.value)
    # a missing key of a bucket that exists is still just absent
    backend = S3Backend(f"s3://{s3_bucket}/x", **options)
    assert backend.exists("nothing-here") is False and backend.list("nothing/") == []


class CuttingProxy:
    """A TCP proxy in front of the real S3 server that resets the connection of every request `cut` matches (its
    request line, such as "GET /bucket/key HTTP/1.1"): a network that fails in the middle of a command. It serves
    requests without a body only (reads)."""

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
        self.target = (host, int(port))
        self.cut = lambda line: False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        pending = b""
        try:
            while data := client.recv(1 << 16):
                pending += data
                while b"\r\n\r\n" in pending:
                    head, pending = pending.split(b"\r\n\r\n", 1)
                    if self.cut(head.split(b"\r\n", 1)[0].decode("latin-1")):
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
                        return
                    upstream.sendall(head + b"\r\n\r\n")
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass


@pytest.fixture
def proxied(s3_server, s3_root, monkeypatch):
    """(url, proxy) of a store holding the canonical bundle, reached through a CuttingProxy as a user would (AWS_*
    variables), one attempt per request."""
    url, options = s3_root
    write_canonical(url, storage_options=options)
    proxy = CuttingProxy(s3_server.endpoint)
    _use_env(monkeypatch, _env(s3_server, AWS_ENDPOINT_URL=proxy.endpoint, **ONE_ATTEMPT))
    yield url, proxy
    proxy.close()


def test_a_store_failing_in_the_middle_of_ls_is_not_a_corrupt_bundle(proxied):
    url, proxy = proxied
    assert "b-00001" in runner.invoke(app, ["ls", url]).stdout  # through the proxy, all is well
    marker = f"/{complete_key('b-00001')}"
    proxy.cut = lambda line: line.startswith("GET ") and marker in line  # listings pass, markers fail
    result = runner.invoke(app, ["ls", url])
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert "corrupt" not in (result.stdout + result.stderr).lower()
    expected = (
        rf"trajectory-replay: error: {re.escape(url)}: S3 endpoint {re.escape(proxy.endpoint)}: "
        r"the connection failed \(.+\) \(1 attempt in \d+\.\ds\): check AWS_ENDPOINT_URL"
    )
    assert re.fullmatch(expected, result.stderr.strip()), result.stderr


def test_a_store_failing_in_the_middle_of_validate_gives_no_verdict(proxied):
    from trajectory_replay.bundle import open_sources
    from trajectory_replay.replay.validate import validate_sources

    url, proxy = proxied
    sources = open_sources(f"{url}/b-00001", trust_cache=False)  # documents read; payloads not yet
    proxy.cut = lambda line: True
    with pytest.raises(StoreUnreachableError, match="the connection failed"):
        validate_sources(f"{url}/b-00001", sources)


class StallingProxy:
    """A TCP proxy in front of the real S3 server that forwards every byte until `stall_after` requests have
    gone through; from then on it forwards nothing either way and leaves every connection open, old and new:
    a server that stops answering in the middle of a command (as one stopped with SIGSTOP does)."""

    def __init__(self, endpoint: str, stall_after: int) -> None:
        host, port = endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
        self.target = (host, int(port))
        self.stall_after = stall_after
        self.requests = 0
        self.stalled_at = None
        self._stalled = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()

    def _hold(self) -> None:
        self._closed.wait()

    def _request(self) -> bool:
        with self._lock:
            if self.requests >= self.stall_after and not self._stalled.is_set():
                self.stalled_at = time.monotonic()
                self._stalled.set()
            if self._stalled.is_set():
                return False
            self.requests += 1
            return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self._stalled.is_set():
            return self._hold()
        upstream = socket.create_connection(self.target)
        with self._lock:
            self._sockets.append(upstream)
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        pending, body_left = b"", 0
        try:
            while data := client.recv(1 << 16):
                pending += data
                while pending:
                    if body_left:
                        part, pending = pending[:body_left], pending[body_left:]
                        body_left -= len(part)
                        upstream.sendall(part)
                        continue
                    if b"\r\n\r\n" not in pending:
                        break
                    head, pending = pending.split(b"\r\n\r\n", 1)
                    if not self._request():
                        return self._hold()
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            body_left = int(value)
                    upstream.sendall(head + b"\r\n\r\n")
        except OSError:
            pass

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                if self._stalled.is_set():
                    return self._hold()
                sink.sendall(data)
        except OSError:
            pass


STALL = {ENV_CONNECT_TIMEOUT: "1", ENV_READ_TIMEOUT: "10", ENV_RETRY_DEADLINE: "13"}
"""The defaults scaled down (an attempt's limit of 11 s, a deadline of 13 s): one attempt fits the deadline, a second
does not, and the 5 s during which a failed endpoint is not asked again are short next to a read timeout."""
STALLED_COMMANDS = {"ls": 35, "stats": 36, "inspect": 8, "cp": 30, "fsck": 5, "scan": 80, "gc": 30}
"""Each command, and the number of requests after which the server stops answering (of the 16 to 164 it makes on
the store of `stall_store`): where its reads wait in a batch (gc last: it may leave its lease behind)."""


@pytest.fixture(scope="module")
def stall_store(s3_server, s3_bucket) -> str:
    """Six step bundles on the real server."""
    url = f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:12]}/stall"
    for i in range(6):
        write_step(url, f"s-{i}", i, 0, storage_options=s3_server.storage_options())
    return url


@pytest.mark.parametrize("command", STALLED_COMMANDS)
def test_a_server_that_stops_answering_midway_ends_every_command_within_the_deadline(
    command, s3_server, stall_store, tmp_path
):
    """The server answered 2 minutes' worth of requests at once and then stopped: reads queued behind the client's
    pool of connections waited one read timeout per pool-full (gc 721 s, fsck 180 s, ls 122 s with the defaults),
    and scan reported every bundle `error` and the store `invalid`. Now each command ends with one line, exit 1,
    within the deadline of the moment the server stopped (plus a quarter of it for a loaded machine)."""
    proxy = StallingProxy(s3_server.endpoint, STALLED_COMMANDS[command])
    argv = {
        "ls": ["ls", stall_store],
        "stats": ["stats", stall_store],
        "inspect": ["inspect", f"{stall_store}/s-1"],
        "cp": ["cp", stall_store, str(tmp_path / "copy"), "--all", "--quiet"],
        "fsck": ["fsck", stall_store, "--quiet"],
        "scan": ["scan", stall_store, "--force", "--quiet", "--workers", "2"],
        "gc": ["gc", stall_store, "--grace", "0s", "--quiet"],
    }[command]
    env = {k: v for k, v in _env(s3_server, AWS_ENDPOINT_URL=proxy.endpoint, **STALL).items() if v is not None}
    env = {**{k: v for k, v in os.environ.items() if k not in _env(s3_server)}, **env}
    deadline = float(STALL[ENV_RETRY_DEADLINE])
    try:
        out = subprocess.run(
            [sys.executable, "-m", "trajectory_replay", *argv, "--json"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        ended = time.monotonic()
    finally:
        proxy.close()
    assert proxy.stalled_at is not None, f"{command} ended before the server stopped: {out.stdout[-500:]}"
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    assert lines[0].startswith(f"trajectory-replay: error: {stall_store}") and "no answer" in lines[0], lines
    assert '"status": "io"' in out.stdout, out.stdout[-500:]
    assert ended - proxy.stalled_at <= deadline * 1.25, (ended - proxy.stalled_at, lines[0])
