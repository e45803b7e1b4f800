"""examples/trl_capture.py runs as its docstring says (a real subprocess: the example is a program)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_trl_example_captures_and_replays_a_step(tmp_path):
    store = tmp_path / "store"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "trl_capture.py"), str(store)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "loss.policy:" in result.stdout
    assert f"trajectory-replay replay {store} --step 0:1" in result.stdout
    names = sorted(p.name for p in store.iterdir())
    assert {"rollout-0", "step-0-0", "step-0-1"} <= set(names), names
