"""The tiny async GRPO example runs end to end as a real multi-process program, deterministically."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from tests.examples.helpers import EXAMPLE, SCALARS, SMALL, STEPS_PER_ROLLOUT, run_example


def test_two_ranks_two_steps_complete(baseline) -> None:
    # how long the run took is no promise of the example's: on a loaded host it is the host's (a hang is caught by
    # the run's timeout)
    result, stdout = baseline.result, baseline.stdout
    assert len(result["steps"]) == 2 * STEPS_PER_ROLLOUT
    assert [(r["rollout_id"], r["step_id"]) for r in result["steps"]] == [
        (k, s) for k in range(2) for s in range(STEPS_PER_ROLLOUT)
    ]
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
    # Per-step timing of rank 0's training thread is recorded beside (not inside) the compared scalars.
    assert [(t["rollout_id"], t["step_id"]) for t in result["timing"]] == [
        (r["rollout_id"], r["step_id"]) for r in result["steps"]
    ]
    assert all(0 <= t["capture_seconds"] <= t["step_seconds"] for t in result["timing"])


def test_identical_runs_are_bit_identical(baseline, tmp_path) -> None:
    again = run_example(tmp_path, "again", *SMALL).result
    assert again["steps"] == baseline.result["steps"]
    assert again["param_checksum"] == baseline.result["param_checksum"]


def test_prompt_groups_are_split_across_batches_and_ranks(baseline) -> None:
    result, stdout = baseline.result, baseline.stdout
    assert result["split_groups"] > 0
    assert result["split_across_batches"] > 0 and result["split_across_ranks"] > 0
    match = re.search(r"split_groups=(\d+)", stdout)
    assert match and int(match.group(1)) == result["split_groups"]


def test_capture_off_starts_nothing_and_writes_nothing(baseline) -> None:
    """No TRAJECTORY_REPLAY_CAPTURE* variables: no manager, no writer thread on any rank, no file but --out-json."""
    cap = baseline.result["capture"]
    assert cap["threads"] == 0
    assert [c["rank"] for c in cap["ranks"]] == [0, 1]
    for c in cap["ranks"]:
        waits = {k: c.pop(k) for k in ("start_seconds", "shutdown_seconds")}
        assert c == {"rank": c["rank"], "enabled": False, "capture_threads": 0, "flushed": True, "stats": None}
        # with nothing started, the end has nothing to wait for (the start's figure is its imports)
        assert isinstance(waits["start_seconds"], float) and waits["start_seconds"] >= 0, waits
        assert 0 <= waits["shutdown_seconds"] < 0.5, waits
    assert "capture_threads=0" in baseline.stdout
    assert sorted(p.name for p in baseline.workdir.iterdir()) == [baseline.out_json.name]


def test_single_process_runs_without_spawning(tmp_path: Path) -> None:
    # TRAJECTORY_REPLAY_CAPTURE=0 switches capture off even with a directory configured: nothing is created there.
    cap_dir = tmp_path / "not-written"
    run = run_example(
        tmp_path,
        "w1",
        *SMALL,
        world_size=1,
        steps=1,
        env={"TRAJECTORY_REPLAY_CAPTURE": "0", "TRAJECTORY_REPLAY_CAPTURE_DIR": str(cap_dir)},
    )
    result = run.result
    assert len(result["steps"]) == STEPS_PER_ROLLOUT and result["world_size"] == 1
    assert result["split_across_ranks"] == 0 and result["split_across_batches"] > 0
    assert result["capture"]["threads"] == 0 and not result["capture"]["ranks"][0]["enabled"]
    assert not cap_dir.exists()
    assert sorted(p.name for p in run.workdir.iterdir()) == [run.out_json.name]


def test_long_responses_share_rollout_chunks(tmp_path) -> None:
    """--digits/--min-response give 129-token responses; the step-level bundles then store each micro-batch's
    rows once, in the chunks of the rollout-level payload they consumed."""
    from trajectory_replay.bundle import open_native
    from trajectory_replay.replay import replay
    from trajectory_replay.store import ObjectStore

    run = run_example(
        tmp_path,
        "long",
        *SMALL,
        "--digits",
        "128",
        "--min-response",
        "128",
        "--capture-dir",
        str(tmp_path / "cap"),
        world_size=1,
        steps=1,
        env={"TRAJECTORY_REPLAY_CAPTURE_WRITER": "thread"},
    )
    assert len(run.result["steps"]) == STEPS_PER_ROLLOUT
    [rollout] = open_native(str(tmp_path / "cap" / "rollout-0"))
    assert {s.response_length for s in rollout.index.samples} == {129}
    store = ObjectStore.open(str(tmp_path / "cap"))

    def chunks(source, name):
        return {c.digest for c in store.record(source.payload_ref(name)).chunks}

    for s in range(STEPS_PER_ROLLOUT):
        [step] = open_native(str(tmp_path / "cap" / f"step-0-{s}"))
        assert replay([step]).passed
        for name in ("old_log_probs", "advantages"):
            mine = chunks(step, name)
            assert len(mine - chunks(rollout, name)) == 1, (s, name)  # its own header only
    assert replay([rollout]).passed


def test_capture_dir_replaces_the_switch_and_directory_however_the_environment_spells_them(monkeypatch) -> None:
    from trajectory_replay.capture import load_config
    from trajectory_replay.capture.config import OLDER_NAMES

    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import tiny_grpo
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    monkeypatch.setenv(OLDER_NAMES["TRAJECTORY_REPLAY_CAPTURE"], "0")
    monkeypatch.setenv(OLDER_NAMES["TRAJECTORY_REPLAY_CAPTURE_DIR"], "/elsewhere")
    monkeypatch.setenv(OLDER_NAMES["TRAJECTORY_REPLAY_CAPTURE_STEPS"], "1:0")
    config = load_config(tiny_grpo.capture_environ("/here"))
    assert (config.enabled, config.capture_dir, config.steps) == (True, "/here", {(1, 0)})
