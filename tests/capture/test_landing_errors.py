"""A multi-producer capture whose landing cannot count is a counted error, never a silent success: a rank landing
into a cohort gc abandoned meanwhile, and a rank already landed by another run with other content (a capture
restarted into the same directory)."""

from __future__ import annotations

from tests.capture.helpers import rollout_kwargs
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import complete_key, rank_key
from trajectory_replay.ops.gc import collect_garbage

BUNDLE = "rollout-120"


def _capture(make_manager, root, rank: int, run_id=None, **changes) -> dict:
    manager = make_manager(root, rank=rank, expected_ranks=[0, 1], **({"run_id": run_id} if run_id else {}))
    assert manager.capture_rollout(120, **{**rollout_kwargs(), **changes})
    assert manager.flush(60)
    stats = manager.stats()
    manager.close(timeout=10)
    return stats


def test_a_rank_landing_after_gc_abandoned_its_cohort_is_a_counted_error(tmp_path, make_manager, caplog):
    root = str(tmp_path / "capture")
    assert _capture(make_manager, root, 0)["errors"] == 0
    assert collect_garbage(root, grace="0s").abandoned_bundles == [BUNDLE]
    stats = _capture(make_manager, root, 1)
    assert stats["errors"] == 1 and stats["written"] == 0
    assert "gc removed the landed rank marker(s) [0] of this bundle" in caplog.text
    assert not open_backend(root).exists(complete_key(BUNDLE))


def test_a_restarted_capture_landing_a_rank_with_other_content_is_a_counted_error(tmp_path, make_manager, caplog):
    root = str(tmp_path / "capture")
    assert _capture(make_manager, root, 0)["errors"] == 0  # run A: rank 0 landed, rank 1 never did
    landed_by_a = open_backend(root).read(rank_key(BUNDLE, 0))
    lineage = {"rollout_weight": 6, "actor_weight": 8}  # run B: other content, same directory
    stats = _capture(make_manager, root, 0, weight_lineage=lineage)
    assert stats["errors"] == 1 and stats["written"] == 0
    assert "rank 0 already landed with different content" in caplog.text
    backend = open_backend(root)
    assert backend.read(rank_key(BUNDLE, 0)) == landed_by_a  # A's landing kept as it was, B's refused
    assert not backend.exists(complete_key(BUNDLE))


def test_ranks_of_two_launches_never_complete_one_bundle(tmp_path, make_manager, caplog):
    """Run A lands rank 0 and dies before rank 1 lands; run B (a restart with another seed) captures the same
    bundle into the same directory. B's rank 1 would complete the cohort with A's rank 0, a mix of two runs that
    replays as a divergence neither has: the launches' run identities differ, so the cohort is refused, loudly."""
    root = str(tmp_path / "capture")
    assert _capture(make_manager, root, 0, run_id="launch-a")["errors"] == 0
    lineage = {"rollout_weight": 6, "actor_weight": 8}
    stats_b1 = _capture(make_manager, root, 1, run_id="launch-b", weight_lineage=lineage)
    stats_b0 = _capture(make_manager, root, 0, run_id="launch-b", weight_lineage=lineage)
    assert stats_b1["errors"] + stats_b0["errors"] >= 1
    assert "rank markers disagree on run" in caplog.text or "already landed with different content" in caplog.text
    backend = open_backend(root)
    assert not backend.exists(complete_key(BUNDLE))
    assert "launch-a" in backend.read(rank_key(BUNDLE, 0)).decode()


def test_a_retry_of_the_same_launch_lands_and_completes(tmp_path, make_manager):
    """The same launch writing a rank again (a retry after a lost response) is the same landing: accepted."""
    root = str(tmp_path / "capture")
    assert _capture(make_manager, root, 0, run_id="launch-a")["errors"] == 0
    assert _capture(make_manager, root, 0, run_id="launch-a")["errors"] == 0
    assert _capture(make_manager, root, 1, run_id="launch-a")["errors"] == 0
    assert open_backend(root).exists(complete_key(BUNDLE))


def test_the_run_identity_comes_from_the_launcher():
    from trajectory_replay.capture.config import CaptureConfigError, run_identity

    assert run_identity({}) is None
    assert run_identity({"TRAJECTORY_REPLAY_RUN_ID": "job-7", "TORCHELASTIC_RUN_ID": "x"}) == "job-7"
    assert run_identity({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert run_identity({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}) == "torchelastic:abc:2"
    assert run_identity({"SLURM_JOB_ID": "991"}) == "slurm:991:0"
    try:
        run_identity({"TRAJECTORY_REPLAY_RUN_ID": "two words"})
    except CaptureConfigError as exc:
        assert str(exc).startswith("TRAJECTORY_REPLAY_RUN_ID='two words': expected")
    else:
        raise AssertionError("a run id with a space was accepted")
