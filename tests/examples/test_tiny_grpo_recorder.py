"""The flight recorder on the example: 50 rollouts with `--capture-policy recorder:8` and a fault from rollout 30
keep exactly the 8 steps up to the trigger (and the rollout-level bundles they name) in the store, complete, and
`scan` names the first divergent bundle and the trigger that kept it; the spool ends within its bound.

nan-loss fires the recorder's own nan_loss trigger at the first faulty step. pr65 fires none of the built-in
triggers (its rewards, losses and KL stay in their usual range); the example's own check of its group rewards
calls `capture.trigger` at the end of the first faulty rollout, so its trigger is at the next step, step-31-0."""

from __future__ import annotations

import pytest

from tests.examples.helpers import SMALL, STEPS_PER_ROLLOUT, run_cli_many, run_example
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.status import COMPLETE_STATUS, scan_bundles

K = 8


def _steps_up_to(rollout: int, step: int) -> list[str]:
    ordered = [(r, s) for r in range(50) for s in range(STEPS_PER_ROLLOUT)]
    end = ordered.index((rollout, step)) + 1
    return [f"step-{r}-{s}" for r, s in ordered[end - K : end]]


@pytest.mark.parametrize(
    "fault, trigger, at, divergent, stage",
    [
        ("nan-loss", "nan_loss", (30, 0), "step-30-0", "loss.policy"),
        ("pr65", "user", (31, 0), "rollout-30", "reward.post_process"),
    ],
)
def test_recorder_keeps_the_steps_before_the_fault(tmp_path, fault, trigger, at, divergent, stage):
    store, spool = tmp_path / fault / "store", tmp_path / fault / "spool"
    run = run_example(
        tmp_path,
        fault,
        *SMALL,
        "--capture-dir",
        str(store),
        "--capture-policy",
        f"recorder:{K}",
        "--capture-queue",
        "1000",  # the example's steps are faster than a loaded host's writer: queued, none dropped
        "--fault",
        fault,
        "--fault-from-step",
        "30",
        world_size=1,
        steps=50,
        env={"TRAJECTORY_REPLAY_CAPTURE_SPOOL": str(spool)},
        timeout=900,
    )
    assert "capture_flushed=True" in run.stdout
    steps = _steps_up_to(*at)
    rollouts = sorted({f"rollout-{name.split('-')[1]}" for name in steps})
    states = scan_bundles(open_backend(str(store)))
    assert sorted(s.name for s in states) == sorted(steps + rollouts)
    assert all(s.status == COMPLETE_STATUS for s in states)

    scan, text_scan = run_cli_many(
        [["scan", str(store), "--json"], ["scan", str(store)]],
        env={"TRAJECTORY_REPLAY_CACHE_DIR": str(tmp_path / fault / "cli-cache")},
        processes=1,
    )
    report = scan.json()
    first = report["earliest_divergence"]
    assert first["name"] == divergent and first["first_divergent_stage"] == stage
    assert first["trigger"]["name"] == trigger and first["trigger"]["step"] == "step-{}-{}".format(*at)
    assert [t["name"] for t in report["triggers"]] == [trigger]
    text = text_scan.stdout
    assert f"earliest divergence: {divergent}" in text and f"kept by trigger {trigger} at step-{at[0]}-{at[1]}" in text

    kept = [s.name for s in scan_bundles(open_backend(str(spool / "rank-0"))) if s.name.startswith("step-")]
    assert 0 < len(kept) <= K
