"""One outcome model: every command's `--json` status and its exit code agree with `trajectory_replay.outcome`'s one
mapping, in every situation a command can end in; statuses, the mapping and the one-line message in one place."""

from __future__ import annotations

import io
import json
import tokenize
from pathlib import Path

import pytest
from typer.testing import CliRunner

import trajectory_replay
from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.inspect import Inspection
from trajectory_replay.bundle.schema import RankTopology
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.cli import app
from trajectory_replay.ops.walk import Walker
from trajectory_replay.outcome import EXIT_CODES, INTERRUPTED_EXIT, Outcome, Status, exit_code, one_line
from trajectory_replay.replay import canonical_case
from trajectory_replay.store.digest import object_key

runner = CliRunner()


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, str]:
    """One store root per situation: a clean bundle, the buggy one, an incomplete one, one with a corrupt chunk, and
    one of a topology replay does not do."""
    base = tmp_path_factory.mktemp("outcome")
    out = {name: str(base / name) for name in ("ok", "bug", "partial", "bad", "cp2")}
    write_canonical(out["ok"])
    write_canonical(out["bug"], buggy=True)
    write_ranks(out["partial"], "partial", land=[1], expected_ranks=[0, 1])
    write_canonical(out["bad"])
    backend = open_backend(out["bad"])
    state = bundle_status(backend, "b-00001")
    assert state is not None
    tree = Walker(backend).trees([state])["b-00001"]
    digest, size = next(n for _, spec, n in tree.payloads if spec.name == "advantages").chunks[0]
    backend.write(object_key(digest), b"\x5a" * size)
    case = canonical_case(False)
    index = case.index.model_copy(
        update={"identity": case.index.identity.model_copy(update={"rank": RankTopology(cp=2)})}
    )
    BundleWriter(f"{out['cp2']}/b-00001", case.manifest, index, case.expected).finalize(payloads=case.payloads)
    out["absent"] = str(base / "absent")
    out["dest"] = str(base / "dest")
    return out


def bundle(roots: dict[str, str], name: str) -> str:
    return f"{roots[name]}/" + {"partial": "partial", "bug": "b-00065"}.get(name, "b-00001")


def command_lines(roots: dict[str, str]) -> list[list[str]]:
    """A command line of every `--json` command in each situation it can meet."""
    b = lambda name: bundle(roots, name)  # noqa: E731
    lines: list[list[str]] = []
    for name in ("ok", "bug", "partial", "bad", "cp2", "absent"):
        lines += [["replay", b(name)], ["inspect", b(name)], ["validate", b(name)]]
    lines += [["replay", roots["ok"], "--step", "120:0"], ["replay", b("ok"), "--group", "g-7"]]
    for name in ("ok", "bug", "partial", "absent"):
        lines.append(["conventions", b(name)])
    lines += [["diff", b("ok"), b("ok")], ["diff", b("ok"), b("bug")], ["diff", b("ok"), b("absent")]]
    for name in ("ok", "bad", "partial", "absent"):
        root = roots[name]
        lines += [["ls", root], ["stats", root], ["gc", root, "--dry-run", "--quiet"], ["fsck", root, "--quiet"]]
    lines += [
        ["cp", b("ok"), roots["dest"], "--quiet"],
        ["cp", roots["bad"], roots["dest"], "--all", "--quiet"],
        ["cp", b("absent"), roots["dest"], "--quiet"],
    ]
    lines += [["scan", roots[name], "--workers", "1", "--quiet"] for name in ("ok", "bug", "absent")]
    lines += [
        [command, roots["ok"], "--no-such-flag"]
        for command in ("replay", "conventions", "inspect", "validate", "ls", "scan", "stats", "cp", "gc", "fsck")
    ]
    lines.append(["diff", b("ok"), b("ok"), "--atol", "nan"])
    return lines


def test_every_json_status_and_exit_code_agree_with_the_one_mapping(roots):
    seen: dict[Status, list[str]] = {}
    for args in command_lines(roots):
        result = runner.invoke(app, [*args, "--json"])
        doc = json.loads(result.stdout)
        assert next(iter(doc)) == "status", doc  # status first
        status = Status(doc["status"])
        explains = Inspection.explains_incomplete if args[0] == "inspect" else False
        assert result.exit_code == exit_code(status, explains_incomplete=explains), (
            args,
            status,
            result.exit_code,
            result.stderr,
        )
        if result.exit_code:
            assert status is Status.DIVERGED or doc.get("error"), (args, doc)
        seen.setdefault(status, []).append(args[0])
    # every status a local store can give (io needs a storage that refuses us: tests/cli/test_json_status.py)
    assert set(seen) == set(Status) - {Status.IO}, seen
    assert "inspect" in seen[Status.INCOMPLETE] and "replay" in seen[Status.INCOMPLETE]


def test_the_mapping():
    assert [EXIT_CODES[s] for s in Status] == [0, 1, 1, 1, 1, 1, 2, 1]
    assert [s.value for s in Status] == [
        "pass",
        "diverged",
        "invalid",
        "incomplete",
        "unsupported",
        "selection",
        "usage",
        "io",
    ]
    assert exit_code(Status.INCOMPLETE) == 1 and exit_code(Status.INCOMPLETE, explains_incomplete=True) == 0
    assert exit_code(Status.INVALID, explains_incomplete=True) == 1
    assert exit_code(Status.INCOMPLETE, interrupted=True) == INTERRUPTED_EXIT == 130
    assert json.dumps({"status": Status.DIVERGED}) == '{"status": "diverged"}' and f"{Status.IO}" == "io"


def _outcomes(cls: type) -> set[type]:
    subs: set[type] = set(cls.__subclasses__())
    return subs.union(*(_outcomes(s) for s in subs))


def test_every_report_class_derives_its_exit_code_from_its_status():
    import trajectory_replay.demo  # noqa: F401  (import every module with a report class)
    import trajectory_replay.ops.cp  # noqa: E401, F401
    import trajectory_replay.ops.export
    import trajectory_replay.ops.fsck
    import trajectory_replay.ops.gc  # noqa: E401, F401
    import trajectory_replay.ops.ls
    import trajectory_replay.ops.scan  # noqa: F401
    import trajectory_replay.ops.stats
    import trajectory_replay.replay.chain  # noqa: E401, F401
    import trajectory_replay.replay.convention_search
    import trajectory_replay.replay.diff  # noqa: E401, F401

    names = {cls.__name__ for cls in _outcomes(Outcome)}
    assert {
        "ReplayReport",
        "ChainReport",
        "DiffReport",
        "ConventionsReport",
        "Inspection",
        "ValidationReport",
        "ListReport",
        "StoreStats",
        "GcReport",
        "CopyReport",
        "FsckReport",
        "ExportReport",
        "DemoResult",
        "ScanReport",
    } <= names
    for cls in _outcomes(Outcome):
        assert cls.exit_code is Outcome.exit_code, f"{cls.__name__} decides its own exit code"


def test_one_line():
    assert one_line("a\n\n  b  \nc") == "a; b; c"
    assert one_line(ValueError("x\ny")) == "x; y"
    assert one_line("x" * 10, 5) == "xxxx…" and one_line("x" * 5, 5) == "xxxxx"


def test_the_statuses_are_spelled_once():
    """The word of an outcome as a string literal only in the module that owns it (scan's verdicts included: they
    are Status members, but for the scan's own `error`)."""
    package = Path(trajectory_replay.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative == "outcome.py":
            continue
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.STRING and token.string.strip("'\"") in ("diverged", "usage"):
                found.append(f"{relative}:{token.start[0]}: {token.string}")
    assert not found, found
