"""A multi-producer capture whose landing cannot count is a counted error, never a silent success: a rank landing
into a cohort gc abandoned meanwhile, and a rank already landed by another run with other content (a capture
restarted into the same directory)."""

from __future__ import annotations

from tests.capture.helpers import rollout_kwargs
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import complete_key, rank_key
from trajectory_replay.ops.gc import collect_garbage

BUNDLE = "rollout-120"


def _capture(make_manager, root, rank: int, **changes) -> dict:
    manager = make_manager(root, rank=rank, expected_ranks=[0, 1])
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
    assert _capture(make_manager, root, 0)["errors"] == 0            # run A: rank 0 landed, rank 1 never did
    landed_by_a = open_backend(root).read(rank_key(BUNDLE, 0))
    lineage = {"rollout_weight": 6, "actor_weight": 8}                 # run B: other content, same directory
    stats = _capture(make_manager, root, 0, weight_lineage=lineage)
    assert stats["errors"] == 1 and stats["written"] == 0
    assert "rank 0 already landed with different content" in caplog.text
    backend = open_backend(root)
    assert backend.read(rank_key(BUNDLE, 0)) == landed_by_a   # A's landing kept as it was, B's refused
    assert not backend.exists(complete_key(BUNDLE))
