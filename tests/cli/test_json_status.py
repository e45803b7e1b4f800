"""`--json` means JSON, always: for replay, inspect, validate, ls, stats, cp, gc and fsck, stdout is exactly one
JSON object whatever happens (usage errors included), with a top-level `status` and, on an error, `error` (the
one-line message that also goes to stderr). Exit codes stay 0 / 1, and 2 only for a malformed command line."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import RankTopology
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.cli import app
from trajectory_replay.errors import (
    BackendError,
    BundleError,
    IncompleteBundleError,
    IntegrityError,
    NoSuchTargetError,
    NotFoundError,
    SelectionError,
    StorageUnavailableError,
    TrajectoryReplayError,
    UnsupportedError,
    UsageError,
)
from trajectory_replay.ops.walk import Walker
from trajectory_replay.outcome import Status, error_status
from trajectory_replay.replay import canonical_case
from trajectory_replay.store.digest import object_key

runner = CliRunner()
JSON_COMMANDS = ("replay", "inspect", "validate", "ls", "stats", "cp", "gc", "fsck")


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


def one_object(result, status: str, code: int, *, verdict: bool = False) -> dict:
    """stdout is one JSON object with `status`; a failure carries `error`, one line. A command that failed
    says the same line on stderr; a `verdict` (a report that found problems) only prints its report."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout.count("\n") == 1, result.stdout  # one line: one object, nothing else
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict) and doc["status"] == status, doc
    if code and status != "diverged":
        assert isinstance(doc["error"], str) and "\n" not in doc["error"] and doc["error"]
        if not verdict:
            assert result.stderr.strip().splitlines() == [f"trajectory-replay: error: {doc['error']}"]
    assert "Traceback" not in result.stdout + result.stderr
    return doc


def _args(command: str, root: str, bundle: str, dest: str) -> list[str]:
    """A well-formed command line of `command` on a store root / bundle."""
    return {
        "replay": ["replay", bundle],
        "inspect": ["inspect", bundle],
        "validate": ["validate", bundle],
        "ls": ["ls", root],
        "stats": ["stats", root],
        "cp": ["cp", bundle, dest, "--quiet"],
        "gc": ["gc", root, "--dry-run", "--quiet"],
        "fsck": ["fsck", root, "--quiet"],
    }[command]


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "store")
    return root, write_canonical(root), str(tmp_path / "dest")


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_success_has_status_pass(store, command):
    root, bundle, dest = store
    doc = one_object(run(*_args(command, root, bundle, dest), "--json"), "pass", 0)
    assert len(doc) > 1  # the report itself follows the status


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_usage_errors_are_json_with_exit_2(store, command):
    root, bundle, dest = store
    doc = one_object(run(*_args(command, root, bundle, dest), "--no-such-flag", "--json"), "usage", 2)
    assert "--no-such-flag" in doc["error"] and f"trajectory-replay {command} --help" in doc["error"]
    missing = one_object(run(command, "--json"), "usage", 2)  # the required argument left out
    assert "Missing argument" in missing["error"]


def test_usage_errors_without_json_are_one_line(store):
    root, bundle, _ = store
    for args in (["replay", bundle, "--rollout", "x"], ["ls"], ["gc", root, "--grace", "soon"]):
        result = run(*args)
        assert result.exit_code == 2 and result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error: "), result.stderr
    bad_type = run("replay", bundle, "--rollout", "x", "--json")
    assert "'--rollout'" in one_object(bad_type, "usage", 2)["error"]
    both = one_object(run("replay", bundle, "--step", "1:0", "--rollout", "1", "--json"), "usage", 2)
    assert "mutually exclusive" in both["error"]
    assert one_object(run("replay", bundle, "--stage", "no.such.stage", "--json"), "usage", 2)


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_a_path_that_is_not_there_is_a_selection_error(tmp_path, command):
    absent = str(tmp_path / "absent")
    doc = one_object(run(*_args(command, absent, f"{absent}/b-00001", str(tmp_path / "d")), "--json"), "selection", 1)
    assert "absent" in doc["error"]


def test_replay_statuses(tmp_path):
    root = str(tmp_path / "store")
    buggy = write_canonical(root, buggy=True)
    clean = write_canonical(root, name="clean")
    assert one_object(run("replay", clean, "--json"), "pass", 0)["passed"] is True
    diverged = one_object(run("replay", buggy, "--json"), "diverged", 1)
    assert diverged["first_divergent_stage"] == "reward.post_process"
    # both are step 120:0: resolution matches several
    several = one_object(run("replay", root, "--json"), "selection", 1)
    assert "2 bundles match" in several["error"]
    assert "no group 'g-7'" in one_object(run("replay", buggy, "--group", "g-7", "--json"), "selection", 1)["error"]


def test_unsupported_topology(tmp_path):
    case = canonical_case(False)
    identity = case.index.identity.model_copy(update={"rank": RankTopology(cp=2)})
    index = case.index.model_copy(update={"identity": identity})
    BundleWriter(str(tmp_path / "cp2"), case.manifest, index, case.expected).finalize(payloads=case.payloads)
    doc = one_object(run("replay", str(tmp_path / "cp2"), "--json"), "unsupported", 1)
    assert "cp=2" in doc["error"]


def test_incomplete_and_invalid_bundles(tmp_path):
    root = str(tmp_path / "store")
    write_ranks(root, "partial", land=[1], expected_ranks=[0, 1])
    assert "missing ranks [0]" in one_object(run("replay", f"{root}/partial", "--json"), "incomplete", 1)["error"]
    validated = one_object(run("validate", f"{root}/partial", "--json"), "incomplete", 1, verdict=True)
    assert "missing ranks [0]" in validated["error"] and validated["problems"] == [validated["error"]]
    info = one_object(run("inspect", f"{root}/partial", "--json"), "incomplete", 0)  # inspect explains it
    assert info["state"] == "incomplete"

    bundle = write_canonical(root)
    backend = open_backend(root)
    tree = Walker(backend).trees([bundle_status(backend, "b-00001")])["b-00001"]
    chunk = next(n for _, spec, n in tree.payloads if spec.name == "advantages").chunks[0][0]
    key = object_key(chunk)
    data = bytearray(backend.read(key))
    data[-1] ^= 0xFF
    backend.write(key, bytes(data))
    validated = one_object(run("validate", bundle, "--json"), "invalid", 1, verdict=True)
    assert validated["valid"] is False and "advantages" in validated["error"]
    assert chunk[7:] in one_object(run("replay", bundle, "--json"), "invalid", 1)["error"]
    fsck = one_object(run("fsck", root, "--quiet", "--json"), "invalid", 1, verdict=True)
    assert fsck["corrupt"] == [key] and fsck["error"] == f"corrupt {key}"


def test_storage_refusing_us_is_io(s3_server, s3_root, tmp_path):
    url, options = s3_root
    write_canonical(url, storage_options=options)
    wrong = {
        **os.environ,
        **s3_server.env(),
        "AWS_SECRET_ACCESS_KEY": "not-the-secret",
        "TRAJECTORY_REPLAY_CACHE_DIR": str(tmp_path / "cache"),
    }
    for args in (
        ["ls", url],
        ["replay", f"{url}/b-00001"],
        ["inspect", f"{url}/b-00001"],
        ["validate", f"{url}/b-00001"],
        ["stats", url],
    ):
        doc = one_object(run(*args, "--json", env=wrong), "io", 1)
        assert doc["error"]


def test_error_status_is_one_mapping():
    cases = [
        (UsageError("x"), ("usage", 2)),
        (SelectionError("x"), ("selection", 1)),
        (NoSuchTargetError("x"), ("selection", 1)),
        (UnsupportedError("x"), ("unsupported", 1)),
        (IncompleteBundleError("x"), ("incomplete", 1)),
        (StorageUnavailableError("x"), ("io", 1)),
        (BackendError("x"), ("io", 1)),
        (PermissionError(13, "denied"), ("io", 1)),
        (BundleError("x"), ("invalid", 1)),
        (IntegrityError("x"), ("invalid", 1)),
        (NotFoundError("x"), ("invalid", 1)),
        (TrajectoryReplayError("x"), ("invalid", 1)),
        (KeyboardInterrupt(), ("incomplete", 130)),
    ]
    for exc, expected in cases:
        assert error_status(exc) == expected, exc
        assert expected[0] in set(Status)
    assert issubclass(StorageUnavailableError, TrajectoryReplayError)
