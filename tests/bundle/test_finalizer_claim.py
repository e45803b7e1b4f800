"""The FINALIZER claim of multi-rank bundles: only the producer that wins it checks the rank markers and writes
COMPLETE; everyone else (readers, ls, fsck) ignores it, so a claimant that died leaves a finalizable bundle."""

from __future__ import annotations

import json

import pytest

from trajectory_replay.backends import open_backend
from trajectory_replay.backends.base import CREATED, DIFFERENT, SAME
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import (
    FINALIZER, FINALIZER_FORMAT, MARKER_WINDOW, MAX_MARKER_BYTES, RankMarker, cohort_state, complete_key,
    finalizer_claim, finalizer_key, rank_key, read_marker, try_finalize,
)
from trajectory_replay.bundle.status import FINALIZABLE, bundle_status
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.replay.validate import validate_bundle
from trajectory_replay.store.liveness import read_inflight
from tests.ops.conftest import rank_writer, renamed_case, write_ranks


def _land(root: str, name: str, rank: int, expected_ranks: list[int], **options):
    """Land `rank` of bundle `name` with the canonical payloads; what its writer's finalize returned, and the
    outcome of each create it made in the bundle's directory (key -> status)."""
    writer = rank_writer(root, name, rank, expected_ranks, **options)
    backend = writer.store.backend
    creates: dict[str, str] = {}
    create_status = backend.create_status

    def watched(key: str, data: bytes) -> str:
        status = create_status(key, data)
        if key.startswith(f"{name}/"):
            creates[key] = status
        return status

    backend.create_status = watched
    final = writer.finalize(payloads=renamed_case(name).payloads)
    return final, creates


def _claimant_died(root: str, name: str, ranks: list[int], **options) -> None:
    """Every rank of `name` landed and the last one claimed finalizing, but COMPLETE was never written."""
    write_ranks(root, name, land=ranks, expected_ranks=ranks, **options)
    backend = open_backend(root, **options)
    backend.delete(complete_key(name))   # as if the claimant died between its claim and COMPLETE
    assert backend.read(finalizer_key(name)) == finalizer_claim(ranks[-1])


def test_the_last_rank_claims_and_finalizes(tmp_path):
    root = str(tmp_path / "store")
    final, creates = _land(root, "cohort", 0, [0, 1])
    assert final is None and creates == {rank_key("cohort", 0): CREATED}   # rank 1 missing: no claim tried
    final, creates = _land(root, "cohort", 1, [0, 1])
    assert final is not None and sorted(final.shards) == ["0", "1"]
    assert creates == {rank_key("cohort", 1): CREATED, finalizer_key("cohort"): CREATED,
                       complete_key("cohort"): CREATED}
    backend = open_backend(root)
    assert json.loads(backend.read(finalizer_key("cohort"))) == {"format": FINALIZER_FORMAT, "rank": 1}
    assert backend.list_dir("cohort") == ["COMPLETE", "COMPLETE.0", "COMPLETE.1", FINALIZER]
    state = bundle_status(backend, "cohort")
    assert state.status == "complete" and state.finalizer_key == finalizer_key("cohort")
    assert finalizer_key("cohort") not in state.marker_keys


def test_a_losing_claimant_lands_its_rank_and_leaves_finalizing_to_the_winner(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1])
    backend = open_backend(root)
    assert backend.create_if_absent(finalizer_key("cohort"), finalizer_claim(0))   # rank 0 won the race
    final, creates = _land(root, "cohort", 1, [0, 1])
    assert final is None
    assert creates == {rank_key("cohort", 1): CREATED, finalizer_key("cohort"): DIFFERENT}
    assert not backend.exists(complete_key("cohort")) and backend.exists(rank_key("cohort", 1))
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(0)
    assert read_inflight(backend) == []   # a clean commit: nothing left for gc to wait out
    # the bundle is in the state a dead claimant leaves: the next reader finalizes it
    assert bundle_status(backend, "cohort").status == FINALIZABLE
    assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1]
    assert backend.exists(complete_key("cohort"))


@pytest.mark.parametrize("finalizer", ["open_native", "validate", "ls", "fsck"])
def test_a_dead_claimant_leaves_a_bundle_that_readers_ls_and_fsck_finalize(tmp_path, finalizer):
    root = str(tmp_path / "store")
    _claimant_died(root, "cohort", [0, 1, 2])
    backend = open_backend(root)
    assert bundle_status(backend, "cohort").status == FINALIZABLE
    if finalizer == "open_native":
        assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1, 2]
    elif finalizer == "validate":
        report = validate_bundle(f"{root}/cohort")
        assert report.valid and sorted(report.ranks) == [0, 1, 2]
    elif finalizer == "ls":
        assert list_bundles(root).finalized == ["cohort"]
    else:
        assert check_store(root).finalized == ["cohort"]
    assert backend.exists(complete_key("cohort"))
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(2)   # the claim is left as it was
    assert bundle_status(backend, "cohort").status == "complete"


def test_a_retry_of_the_claimant_rank_finds_its_own_claim_and_finalizes(tmp_path):
    root = str(tmp_path / "store")
    _claimant_died(root, "cohort", [0, 1])
    # another rank's retry stops at its landed marker and at the claim it does not hold
    final, creates = _land(root, "cohort", 0, [0, 1])
    assert final is None and creates == {rank_key("cohort", 0): DIFFERENT, finalizer_key("cohort"): DIFFERENT}
    final, creates = _land(root, "cohort", 1, [0, 1])
    assert creates == {rank_key("cohort", 1): DIFFERENT, finalizer_key("cohort"): SAME,
                       complete_key("cohort"): CREATED}
    assert final is not None and sorted(final.shards) == ["0", "1"]
    assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1]


def test_the_claimant_still_names_a_bad_rank_marker_and_a_repaired_cohort_is_finalized(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1])
    backend = open_backend(root)
    good = backend.read(rank_key("cohort", 0))
    marker = read_marker(backend, rank_key("cohort", 0), RankMarker)
    backend.write(rank_key("cohort", 0), compact_json({**marker.model_dump(mode="json"), "rank": 1}))
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.0: corrupt rank marker: holds rank 1.*not finalized"):
        _land(root, "cohort", 1, [0, 1])
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(1) and not backend.exists(complete_key("cohort"))
    report = check_store(root)
    assert rank_key("cohort", 0) in report.corrupt and report.finalized == []

    backend.write(rank_key("cohort", 0), good)   # the marker restored: the next fsck finalizes
    assert check_store(root).finalized == ["cohort"]
    assert backend.exists(complete_key("cohort"))


def test_gc_removes_the_claim_of_an_abandoned_cohort_and_a_claim_left_alone(tmp_path):
    root = str(tmp_path / "store")
    _claimant_died(root, "cohort", [0, 1, 2])
    _claimant_died(root, "alone", [0, 1])
    backend = open_backend(root)
    backend.delete(rank_key("cohort", 2))   # a bad marker removed, its rank never landed again
    for r in (0, 1):
        backend.delete(rank_key("alone", r))
    assert bundle_status(backend, "alone") is None and bundle_status(backend, "cohort").status == "incomplete"

    young = collect_garbage(root)
    assert young.removed == [] and young.abandoned_bundles == []
    report = collect_garbage(root, grace="0s")
    assert report.abandoned_bundles == ["cohort"]
    assert {finalizer_key("cohort"), finalizer_key("alone"), rank_key("cohort", 0), rank_key("cohort", 1)} \
        <= set(report.removed)
    assert report.markers_removed == 4
    assert backend.list("cohort/") == [] and backend.list("alone/") == []
    assert check_store(root).orphaned == []


def test_cp_copies_markers_not_the_claim(tmp_path):
    root, dest = str(tmp_path / "store"), str(tmp_path / "dest")
    _claimant_died(root, "cohort", [0, 1])
    copy_bundles(f"{root}/cohort", dest)
    assert open_backend(dest).list_dir("cohort") == ["COMPLETE", "COMPLETE.0", "COMPLETE.1"]
    assert [r.rank for r in open_native(f"{dest}/cohort")] == [0, 1]


def test_cohort_state_reads_one_window_past_a_missing_rank_at_most(tmp_path):
    root = str(tmp_path / "store")
    ranks = list(range(3 * MARKER_WINDOW))
    _land(root, "cohort", 0, ranks)
    backend = open_backend(root)
    template = json.loads(backend.read(rank_key("cohort", 0)))
    missing = MARKER_WINDOW + 3
    for r in ranks[1:]:
        if r != missing:
            backend.write(rank_key("cohort", r), compact_json({**template, "rank": r}))
    backend.stats.reset()
    landed, gap = cohort_state(backend, "cohort", ranks)
    assert gap == [missing] and [m.rank for m in landed] == list(range(missing))
    assert backend.stats.reads == 2 * MARKER_WINDOW - 1   # one read a marker, none past the window of the gap


@pytest.mark.s3
def test_cohort_state_on_s3_refuses_empty_and_oversized_markers_by_key(s3_root):
    url, options = s3_root
    write_ranks(url, "cohort", land=[0, 1], expected_ranks=[0, 1], **options)
    backend = open_backend(url, **options)
    landed, gap = cohort_state(backend, "cohort", [0, 1])
    assert gap == [] and [m.rank for m in landed] == [0, 1]
    backend.stats.reset()
    cohort_state(backend, "cohort", [0, 1])
    assert backend.stats.reads == 2
    backend.write(rank_key("cohort", 1), b"")
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.1"):
        cohort_state(backend, "cohort", [0, 1])
    backend.write(rank_key("cohort", 1), b" " * (MAX_MARKER_BYTES + 10))
    with pytest.raises(BundleError, match=rf"cohort/COMPLETE\.1: marker larger than {MAX_MARKER_BYTES} bytes"):
        cohort_state(backend, "cohort", [0, 1])
    backend.delete(complete_key("cohort"))
    with pytest.raises(BundleError, match="larger than"):   # what a reader finalizing it would meet
        try_finalize(backend, "cohort", [0, 1])


def test_import_finalizes_a_multi_rank_bundle_whose_claim_another_rank_holds(tmp_path):
    from trajectory_replay.ops.export import export_bundle
    from trajectory_replay.ops.importer import import_v1

    root, out, back = str(tmp_path / "store"), tmp_path / "v1" / "cohort", str(tmp_path / "back")
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    export_bundle(f"{root}/cohort", out)
    backend = open_backend(back)
    backend.write(finalizer_key("cohort"), finalizer_claim(0))   # left alone: its rank markers are gone
    assert import_v1(out, back) == [f"{back}/cohort"]   # rank 1 lands last and finds rank 0's claim
    assert backend.exists(complete_key("cohort")) and backend.read(finalizer_key("cohort")) == finalizer_claim(0)
    assert [r.rank for r in open_native(f"{back}/cohort")] == [0, 1]
