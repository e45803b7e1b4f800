"""The commands that do no math run where torch cannot be imported (a real process boundary: the child
refuses `import torch` before anything of the package is loaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.demo import run_demo

REPO = Path(__file__).resolve().parents[2]

# Runs each command line given as a JSON list, in one process with torch unimportable, and prints one
# JSON line per command: its exit code and the first line of its output. Any import of torch fails.
CHILD = """
import contextlib, io, json, sys
sys.modules["torch"] = None
from trajectory_replay.cli import main
sys.argv[0] = "trajectory-replay"
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv[1:] = args
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
    print(json.dumps({"args": args, "code": code, "output": out.getvalue()}))
print(json.dumps({"torch_loaded": "torch" in sys.modules and sys.modules["torch"] is not None}))
"""


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchfree") / "demo"
    run_demo(root)
    return root


def test_inspect_validate_ls_stats_without_torch(demo_root):
    bundles = sorted(p.name for p in demo_root.iterdir() if (demo_root / complete_key(p.name)).exists())
    assert len(bundles) == 2
    clean = str(demo_root / bundles[0])
    commands = [
        ["inspect", clean],
        ["inspect", clean, "--json"],
        ["validate", clean],
        ["validate", clean, "--json"],
        ["ls", str(demo_root)],
        ["stats", str(demo_root)],
        ["fsck", str(demo_root)],
        ["gc", str(demo_root), "--dry-run"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(commands)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    *results, tail = [json.loads(line) for line in done.stdout.splitlines()]
    assert tail == {"torch_loaded": False}
    by_command = {" ".join(r["args"][:1] + r["args"][2:]): r for r in results}
    for result in results:
        assert result["code"] == 0, result
    assert "complete" in by_command["inspect"]["output"]
    assert json.loads(by_command["inspect --json"]["output"])["status"] == "pass"
    assert json.loads(by_command["validate --json"]["output"])["status"] == "pass"
    assert "2 complete bundle(s)" in by_command["ls"]["output"]
    assert "healthy" in by_command["fsck"]["output"]


def test_a_command_that_needs_torch_says_so_in_one_line(demo_root):
    bundle = str(sorted(p for p in demo_root.iterdir() if (demo_root / complete_key(p.name)).exists())[0])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([["replay", bundle]])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[0])
    assert result["code"] == 1
    assert "Traceback" not in result["output"]
    lines = result["output"].strip().splitlines()
    assert len(lines) == 1 and "torch" in lines[0], lines
