"""Bundles written by the older tool itself, beside the repository in shared/fixtures/relax-v1: each gets the verdict
that tool printed for it (REPORTS.txt, exit codes included), read directly and after `import`.

The folder is not part of the repository; without it these tests skip (the project's own generated bundles in
test_older_tool_layout.py cover every format detail they exercise).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import SHARED
from trajectory_replay.cli import app

FIXTURES = SHARED / "fixtures" / "relax-v1"
pytestmark = pytest.mark.skipif(
    not (FIXTURES / "REPORTS.txt").is_file(), reason="shared/fixtures/relax-v1 is not beside the repository"
)
runner = CliRunner()
_STAGE_LINE = re.compile(r"\[\s*(pass|fail|skipped)\]\s+(\S+)(?:\s+—\s+(.*))?")
_RC_LINE = re.compile(r"(?:\w+_)?rc=(\d+)|exit=(\d+)")


@dataclass
class Reported:
    """One command of REPORTS.txt and what the older tool printed for it."""

    command: str
    args: list[str]
    exit_code: int = -1
    stages: dict[str, tuple[str, str]] = field(default_factory=dict)
    """stage -> (status, reason)"""


def reported() -> list[Reported]:
    """Every `$ trajectory_replay ...` of REPORTS.txt with its exit code and stage verdicts."""
    out: list[Reported] = []
    for line in (FIXTURES / "REPORTS.txt").read_text().splitlines():
        if line.startswith("$ trajectory_replay "):
            command, *args = line.removeprefix("$ trajectory_replay ").split()
            out.append(Reported(command, args))
            continue
        if not out:
            continue
        stage = _STAGE_LINE.match(line.strip())
        if stage:
            out[-1].stages[stage.group(2)] = (stage.group(1), stage.group(3) or "")
        rc = _RC_LINE.fullmatch(line.strip().split("(")[0])
        if rc and (line.startswith(("rc=", "replay_rc=", "validate_rc=")) or out[-1].exit_code < 0):
            out[-1].exit_code = int(rc.group(1) or rc.group(2))
    return out


REPORTED = reported() if (FIXTURES / "REPORTS.txt").is_file() else []


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def check(entry: Reported, args: list[str]) -> None:
    """Our command gives the exit code the older tool gave, and each stage it reported the same verdict."""
    plain = run(entry.command, *args)
    assert plain.exit_code == entry.exit_code, plain.output
    assert "Traceback" not in plain.output
    if entry.command != "replay":
        return
    result = run(entry.command, *args, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == entry.exit_code
    ours: dict[str, set[str]] = {}
    for stage in report["stages"]:
        ours.setdefault(stage["stage"], set()).add(stage["status"])
    for stage, (status, reason) in entry.stages.items():
        if reason == "no stage contract":
            assert stage not in ours, f"{stage}: the bundle has no contract for it"
        else:
            assert ours.get(stage) == {status}, f"{stage}: theirs {status} ({reason}), ours {ours.get(stage)}"
            if reason.startswith("capability="):
                message = next(s["message"] for s in report["stages"] if s["stage"] == stage)
                assert message.startswith(reason), message


def test_reports_cover_every_bundle() -> None:
    named = {e.args[0] for e in REPORTED}
    assert named == {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    assert all(e.exit_code in (0, 1) for e in REPORTED)


@pytest.mark.parametrize("entry", REPORTED, ids=lambda e: " ".join([e.command, *e.args]))
def test_verdict_read_directly(entry: Reported) -> None:
    check(entry, [str(FIXTURES / entry.args[0]), *entry.args[1:]])


@pytest.mark.parametrize("entry", REPORTED, ids=lambda e: " ".join([e.command, *e.args]))
def test_verdict_after_import(entry: Reported, tmp_path: Path) -> None:
    store = tmp_path / "store"
    imported = run("import", FIXTURES / entry.args[0], store)
    assert imported.exit_code == 0, imported.output
    urls = [line.removeprefix("imported ") for line in imported.stdout.splitlines()]
    assert len(urls) == 1
    flags = entry.args[1:]
    # a flag picks the bundle of the store root, as it picked it in the capture directory
    target = str(store) if any(f in ("--step", "--rollout") for f in flags) else urls[0]
    check(entry, [target, *flags])


def test_multirank_capture_is_listed_and_copied(tmp_path: Path) -> None:
    listing = run("ls", FIXTURES / "multirank", "--json")
    assert listing.exit_code == 0
    rows = json.loads(listing.stdout)["bundles"]
    assert [(r["name"], r["anchor"], r["status"], r["ranks"]) for r in rows] == [
        ("replay-120-0", "step 120:0", "complete", [0, 1])
    ]
    assert run("cp", FIXTURES / "multirank", tmp_path / "store", "--step", "120:0").exit_code == 0
    assert run("replay", tmp_path / "store", "--step", "120:0").exit_code == 0
