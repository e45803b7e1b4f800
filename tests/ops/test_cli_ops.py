"""The store commands at the command line: one-line errors with the right exit codes, progress only on a terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from trajectory_replay.cli import app
from trajectory_replay.ops import progress as progress_mod
from trajectory_replay.ops.progress import Progress, RichProgress, terminal_progress
from trajectory_replay.store.layout import OBJECTS_DIR

runner = CliRunner()


@pytest.mark.parametrize(
    "args, code",
    [
        (["gc", "{root}", "--grace", "5x"], 2),
        (["gc", "{root}", "--grace", ""], 2),
        (["gc", "{missing}"], 1),
        (["ls", "{missing}"], 1),
        (["stats", "{missing}"], 1),
        (["fsck", "{missing}"], 1),
        (["cp", "{missing}", "{dest}", "--all"], 1),
        (["cp", "{root}", "{dest}", "--all", "--rollout", "3"], 2),
        (["cp", "{root}", "{dest}", "--step", "nope"], 2),
        (["cp", "{root}/b-00001/rank-0", "{dest}"], 2),
        (["export", "{missing}/b-00001", "{dest}"], 1),
        (["ls", "s3://x"], 2),  # a bucket name needs 3+ characters: refused as typed
        (["gc", "{root}", "--bogus"], 2),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, args, code):
    root = str(tmp_path / "store")
    write_canonical(root)
    values = {"root": root, "missing": str(tmp_path / "absent"), "dest": str(tmp_path / "dest")}
    argv = [a.format(**values) for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == code, (argv, result.output)
    assert "Traceback" not in result.output
    if code == 1 or argv[1:3] == [root, "--grace"]:
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error: "), result.stderr


def test_subprocess_errors_have_no_traceback(tmp_path):
    for argv in (["gc", str(tmp_path), "--grace", "1y"], ["fsck", str(tmp_path / "absent")]):
        out = subprocess.run(
            [sys.executable, "-m", "trajectory_replay", *argv], capture_output=True, text=True, timeout=60
        )
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_fsck_exit_codes_and_gc_json(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    healthy = runner.invoke(app, ["fsck", root])
    assert healthy.exit_code == 0 and "healthy" in healthy.stdout
    gc = runner.invoke(app, ["gc", root, "--dry-run", "--json", "--grace", "0s"])
    doc = json.loads(gc.stdout)
    assert gc.exit_code == 0 and doc["dry_run"] is True and {"bytes_freed", "removed"} <= set(doc)
    chunk = next(p for p in (tmp_path / "store" / OBJECTS_DIR).rglob("*") if p.is_file() and p.stat().st_size > 100)
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
    broken = runner.invoke(app, ["fsck", root, "--json"])
    assert broken.exit_code == 1 and json.loads(broken.stdout)["healthy"] is False


def test_progress_only_on_a_terminal(monkeypatch):
    with terminal_progress(quiet=False) as p:  # pytest captures: not a terminal
        assert type(p) is Progress
    monkeypatch.setattr(progress_mod, "progress_wanted", lambda quiet: not quiet)
    with terminal_progress(quiet=True) as p:
        assert type(p) is Progress
    with terminal_progress(quiet=False) as p:
        assert isinstance(p, RichProgress)
        p.phase("copying chunks", objects=3, nbytes=300)
        p.advance(2, 200)
        p.phase("copying refs", objects=None)
        p.advance(1, 0)


def test_rich_progress_renders_objects_and_bytes():
    from rich.console import Console

    buffer = io.StringIO()
    bar = RichProgress(Console(file=buffer, force_terminal=True, width=120))
    with bar:
        bar.phase("copying chunks", objects=4, nbytes=4096)
        bar.advance(4, 4096)
    text = buffer.getvalue()
    assert "copying chunks" in text and "4/4 objects" in text and "4.0 KiB" in text and "kB" not in text
