"""The example with the physical-batch bug switched on mid-run (`--fault pr65 --fault-from-step 1`), captured and
scanned: the rollouts before the switch pass, the first one after it is the earliest divergence."""

from __future__ import annotations

from tests.examples.helpers import SMALL, STEPS_PER_ROLLOUT, run_example
from tests.ops.scan_helpers import cli_json


def test_scan_finds_the_rollout_where_the_fault_starts(tmp_path):
    capture = tmp_path / "capture"
    run_example(
        tmp_path,
        "pr65-from-1",
        *SMALL,
        "--fault",
        "pr65",
        "--fault-from-step",
        "1",
        "--capture-dir",
        str(capture),
        world_size=1,
        steps=2,
        env={"TRAJECTORY_REPLAY_CAPTURE_WRITER": "thread"},
    )
    code, summary = cli_json("scan", str(capture), "--workers", "2")
    assert code == 1 and summary["status"] == "diverged"
    statuses = {v["name"]: v["status"] for v in summary["verdicts"]}
    steps = [f"step-{k}-{s}" for k in range(2) for s in range(STEPS_PER_ROLLOUT)]
    assert statuses == {"rollout-0": "pass", "rollout-1": "diverged", **{name: "pass" for name in steps}}
    first = summary["earliest_divergence"]
    assert (first["name"], first["anchor"], first["first_divergent_stage"]) == (
        "rollout-1",
        "rollout 1",
        "reward.post_process",
    )
    assert [v["name"] for v in summary["verdicts"]] == [
        "rollout-0",
        "step-0-0",
        "step-0-1",
        "rollout-1",
        "step-1-0",
        "step-1-1",
    ]
