"""The tiny async GRPO example runs end to end as a real multi-process program, deterministically."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.py"
SCALARS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss")


def run_example(tmp_path: Path, name: str, *extra: str, world_size: int = 2, steps: int = 2,
                timeout: float = 120) -> tuple[dict[str, Any], str, float]:
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--world-size", str(world_size),
           "--seed", "3", "--out-json", str(out), *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          check=False)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(out.read_text(encoding="utf-8")), proc.stdout, elapsed


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[dict[str, Any], str, float]:
    return run_example(tmp_path_factory.mktemp("tiny_grpo"), "baseline")


def test_two_ranks_two_steps_complete_quickly(baseline) -> None:
    result, stdout, elapsed = baseline
    assert elapsed < 60, f"took {elapsed:.1f}s"
    steps_per_rollout = 6 * 4 // 6   # default rollout size / consumer batch
    assert len(result["steps"]) == 2 * steps_per_rollout
    assert [(r["rollout_id"], r["step_id"]) for r in result["steps"]] == \
        [(k, s) for k in range(2) for s in range(steps_per_rollout)]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("rollout=")]
    assert len(lines) == len(result["steps"])
    for line in lines:
        for field in ("reward=", "loss=", "pg_loss=", "clipfrac="):
            assert field in line
    for rec in result["steps"]:
        values = {k: float.fromhex(rec[k]) for k in SCALARS}
        assert all(math.isfinite(v) for v in values.values())
        # The reported loss is defined from the reported parts (sum over ranks of rank scalars).
        assert values["loss"] == pytest.approx(values["pg_loss"] - 0.01 * values["entropy_loss"], abs=1e-6)
        assert values["entropy_loss"] > 0 and values["pg_clipfrac"] >= 0


def test_identical_runs_are_bit_identical(baseline, tmp_path) -> None:
    again, _, _ = run_example(tmp_path, "again")
    assert again["steps"] == baseline[0]["steps"]
    assert again["param_checksum"] == baseline[0]["param_checksum"]


def test_pr65_fault_changes_the_losses(baseline, tmp_path) -> None:
    faulty, _, _ = run_example(tmp_path, "pr65", "--fault", "pr65")
    assert faulty["fault"] == "pr65"
    base = [[r[k] for k in SCALARS] for r in baseline[0]["steps"]]
    bad = [[r[k] for k in SCALARS] for r in faulty["steps"]]
    assert base != bad
    # Raw rewards come from the same seeded samples in the first rollout (weights only diverge after it).
    assert [r["mean_raw_reward"] for r in faulty["steps"] if r["rollout_id"] == 0] == \
        [r["mean_raw_reward"] for r in baseline[0]["steps"] if r["rollout_id"] == 0]
    assert faulty["steps"][0]["pg_loss"] != baseline[0]["steps"][0]["pg_loss"]


def test_prompt_groups_are_split_across_batches_and_ranks(baseline) -> None:
    result, stdout, _ = baseline
    assert result["split_groups"] > 0
    assert result["split_across_batches"] > 0 and result["split_across_ranks"] > 0
    match = re.search(r"split_groups=(\d+)", stdout)
    assert match and int(match.group(1)) == result["split_groups"]


def test_single_process_runs_without_spawning(tmp_path) -> None:
    result, _, _ = run_example(tmp_path, "w1", world_size=1, steps=1)
    assert len(result["steps"]) == 4 and result["world_size"] == 1
    assert result["split_across_ranks"] == 0 and result["split_across_batches"] > 0


def test_capture_dir_is_not_wired_yet(tmp_path) -> None:
    """Until the capture hooks are wired, asking for capture must fail loudly rather than silently skip."""
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "1", "--world-size", "1",
                           "--capture-dir", str(tmp_path / "cap")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode == 0:
        pytest.skip("capture is wired now; covered by the capture tests")
    assert "capture not wired yet" in proc.stderr
