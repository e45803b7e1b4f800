"""The FINALIZER claim of multi-rank bundles: a producer claims before it reads the cohort, a loser returns at once,
the claimant hands the claim back where a rank is missing, and everyone else (readers, ls, fsck) ignores it, so a
claimant that died leaves a finalizable bundle."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable

import pytest

from tests.ops.conftest import rank_writer, renamed_case, write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.backends.base import CREATED, DIFFERENT, SAME
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.inspect import inspect_bundle
from trajectory_replay.bundle.markers import (
    FINALIZER,
    FINALIZER_FORMAT,
    MARKER_WINDOW,
    MAX_MARKER_BYTES,
    RANK_MARKER,
    RankMarker,
    cohort_state,
    complete_key,
    finalizer_claim,
    finalizer_key,
    rank_key,
    read_marker,
    try_finalize,
)
from trajectory_replay.bundle.status import FINALIZABLE, INCOMPLETE, bundle_status
from trajectory_replay.errors import BundleError, IncompleteBundleError, NotFoundError
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.replay.validate import validate_bundle
from trajectory_replay.store.liveness import read_inflight

DELETED = "deleted"


class Landing:
    """What one producer's finalize did in its bundle's directory: `events`, its creates (key -> status) and
    deletes (key -> DELETED) in order, and `reads`, how often it read each rank marker."""

    def __init__(self) -> None:
        self.final = None
        self.events: list[tuple[str, str]] = []
        self.reads: Counter = Counter()

    @property
    def creates(self) -> dict[str, str]:
        return {key: status for key, status in self.events if status != DELETED}


def _land(
    root: str, name: str, rank: int, expected_ranks: list[int], hook: Callable | None = None, **options
) -> Landing:
    """Land `rank` of bundle `name` with the canonical payloads, watching its writer's backend; `hook(backend)`
    may wrap more of it first."""
    writer = rank_writer(root, name, rank, expected_ranks, **options)
    backend = writer.store.backend
    out, lock = Landing(), threading.Lock()
    create_status, delete, read = backend.create_status, backend.delete, backend.read

    def watched_create(key: str, data: bytes) -> str:
        status = create_status(key, data)
        if key.startswith(f"{name}/"):
            with lock:
                out.events.append((key, status))
        return status

    def watched_delete(key: str) -> None:
        delete(key)
        if key.startswith(f"{name}/"):
            with lock:
                out.events.append((key, DELETED))

    def watched_read(key: str, limit: int | None = None) -> bytes:
        # a marker read is bounded: a refused create's read-back of what is there is not one
        if limit is not None and key.startswith(f"{name}/") and RANK_MARKER.fullmatch(key[len(name) + 1 :]):
            with lock:
                out.reads[int(key.rsplit(".", 1)[1])] += 1
        return read(key, limit)

    backend.create_status, backend.delete, backend.read = watched_create, watched_delete, watched_read
    if hook is not None:
        hook(backend)
    out.final = writer.finalize(payloads=renamed_case(name).payloads)
    return out


def _claimant_died(root: str, name: str, ranks: list[int], **options) -> None:
    """Every rank of `name` landed and the last one claimed finalizing, but COMPLETE was never written."""
    write_ranks(root, name, land=ranks, expected_ranks=ranks, **options)
    backend = open_backend(root, **options)
    backend.delete(complete_key(name))  # as if the claimant died between its claim and COMPLETE
    assert backend.read(finalizer_key(name)) == finalizer_claim(ranks[-1])


def test_the_first_lander_claims_finds_a_rank_missing_and_hands_the_claim_back(tmp_path):
    root = str(tmp_path / "store")
    first = _land(root, "cohort", 0, [0, 1])
    assert first.final is None
    # claimed before reading the cohort; rank 1 missing: the claim deleted, then rank 1 read once more
    assert first.events == [
        (rank_key("cohort", 0), CREATED),
        (finalizer_key("cohort"), CREATED),
        (finalizer_key("cohort"), DELETED),
    ]
    assert first.reads == {0: 1, 1: 2}
    backend = open_backend(root)
    assert backend.list_dir("cohort") == ["COMPLETE.0"]
    last = _land(root, "cohort", 1, [0, 1])
    assert last.final is not None and sorted(last.final.shards) == ["0", "1"]
    assert last.events == [
        (rank_key("cohort", 1), CREATED),
        (finalizer_key("cohort"), CREATED),
        (complete_key("cohort"), CREATED),
    ]
    assert last.reads == {0: 1, 1: 1}
    assert json.loads(backend.read(finalizer_key("cohort"))) == {"format": FINALIZER_FORMAT, "rank": 1}
    assert backend.list_dir("cohort") == ["COMPLETE", "COMPLETE.0", "COMPLETE.1", FINALIZER]
    state = bundle_status(backend, "cohort")
    assert state.status == "complete" and state.finalizer_key == finalizer_key("cohort")
    assert finalizer_key("cohort") not in state.marker_keys


def test_a_loser_returns_at_once_and_a_claim_held_while_ranks_are_missing_is_an_incomplete_bundle(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1, 2])
    backend = open_backend(root)
    assert backend.create_if_absent(finalizer_key("cohort"), finalizer_claim(0))  # rank 0's claimant, mid-read
    loser = _land(root, "cohort", 1, [0, 1, 2])
    assert loser.final is None and loser.reads == {}  # not one marker of the cohort read
    assert loser.events == [(rank_key("cohort", 1), CREATED), (finalizer_key("cohort"), DIFFERENT)]
    assert read_inflight(backend) == []  # a clean commit: nothing left for gc to wait out

    # the claim is no marker: the directory is an incomplete bundle missing rank 2, wherever it is looked at
    state = bundle_status(backend, "cohort")
    assert state.status == INCOMPLETE and state.landed_ranks == [0, 1] and state.missing_ranks == [2]
    assert state.finalizer_key == finalizer_key("cohort") and finalizer_key("cohort") not in state.marker_keys
    listing = list_bundles(root)
    assert [(b.name, b.status, b.ranks, b.missing_ranks) for b in listing.bundles] == [
        ("cohort", "incomplete", [0, 1], [2])
    ]
    assert "incomplete (missing ranks [2])" in listing.render_text() and listing.finalized == []
    seen = inspect_bundle(f"{root}/cohort")
    assert seen.state == "incomplete" and seen.ranks == [0, 1] and seen.expected_ranks == [0, 1, 2]
    assert seen.detail == "incomplete bundle: ranks [0, 1] landed, missing ranks [2] of [0, 1, 2]"
    with pytest.raises(IncompleteBundleError, match=r"missing ranks \[2\]"):
        open_native(f"{root}/cohort")
    assert check_store(root).finalized == [] and not backend.exists(complete_key("cohort"))

    # the claimant died holding the claim: the last rank returns too, and the next reader finalizes
    last = _land(root, "cohort", 2, [0, 1, 2])
    assert last.final is None and last.reads == {}
    assert bundle_status(backend, "cohort").status == FINALIZABLE
    assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1, 2]
    assert backend.exists(complete_key("cohort")) and backend.read(finalizer_key("cohort")) == finalizer_claim(0)


def _land_rank_1_when(moment: str, root: str, others: list[Landing]) -> Callable:
    """A hook for rank 0's claimant of cohort [0, 1]: rank 1 lands (and runs its whole finalize) right after the
    claimant's first read misses rank 1's marker, or right after the claimant deleted its claim."""

    def hook(backend) -> None:
        def land() -> None:
            if not others:
                others.append(_land(root, "cohort", 1, [0, 1]))

        if moment == "after the first miss":
            read = backend.read

            def missed(key: str, limit: int | None = None) -> bytes:
                try:
                    return read(key, limit)
                except NotFoundError:
                    if key == rank_key("cohort", 1):
                        land()
                    raise

            backend.read = missed
        else:
            delete = backend.delete

            def deleted(key: str) -> None:
                delete(key)
                if key == finalizer_key("cohort"):
                    land()

            backend.delete = deleted

    return hook


@pytest.mark.parametrize("moment", ["after the first miss", "after the delete"])
def test_a_rank_landing_while_the_claimant_reads_is_not_lost(tmp_path, moment):
    """Rank 1 lands after the claimant (rank 0) found it missing: before the claimant hands the claim back, rank 1
    finds the claim taken and returns, and the claimant's read after its delete finds rank 1 and finalizes; after
    the hand-back, rank 1 claims and finalizes, and the claimant's second claim finds rank 1's."""
    root = str(tmp_path / "store")
    others: list[Landing] = []
    claimant = _land(root, "cohort", 0, [0, 1], hook=_land_rank_1_when(moment, root, others))
    [rank1] = others
    backend = open_backend(root)
    assert backend.exists(complete_key("cohort"))
    if moment == "after the first miss":
        assert rank1.final is None and rank1.reads == {}
        assert rank1.events == [(rank_key("cohort", 1), CREATED), (finalizer_key("cohort"), DIFFERENT)]
        assert claimant.events == [
            (rank_key("cohort", 0), CREATED),
            (finalizer_key("cohort"), CREATED),
            (finalizer_key("cohort"), DELETED),
            (finalizer_key("cohort"), CREATED),
            (complete_key("cohort"), CREATED),
        ]
        winner, final = 0, claimant.final
    else:
        assert claimant.final is None
        assert claimant.events == [
            (rank_key("cohort", 0), CREATED),
            (finalizer_key("cohort"), CREATED),
            (finalizer_key("cohort"), DELETED),
            (finalizer_key("cohort"), DIFFERENT),
        ]
        assert rank1.events == [
            (rank_key("cohort", 1), CREATED),
            (finalizer_key("cohort"), CREATED),
            (complete_key("cohort"), CREATED),
        ]
        winner, final = 1, rank1.final
    assert claimant.reads == {0: 1, 1: 2}
    assert final is not None and sorted(final.shards) == ["0", "1"]
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(winner)
    assert bundle_status(backend, "cohort").status == "complete"
    assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1]


def test_a_claimant_whose_gaps_filled_before_its_second_read_reads_on_and_finalizes(tmp_path):
    """Two ranks, in different windows, land after the claimant's first read stopped at the first of them: its read
    after the hand-back takes the first gap and every rank after it, so it claims again and finalizes."""
    root = str(tmp_path / "store")
    ranks = list(range(3 * MARKER_WINDOW))
    gaps = [MARKER_WINDOW + 5, 2 * MARKER_WINDOW + 16]
    _land(root, "cohort", 1, ranks)
    backend = open_backend(root)
    template = json.loads(backend.read(rank_key("cohort", 1)))
    for r in ranks[2:]:
        if r not in gaps:
            backend.write(rank_key("cohort", r), compact_json({**template, "rank": r}))
    late: list[Landing] = []

    def hook(watched) -> None:
        read = watched.read

        def missed(key: str, limit: int | None = None) -> bytes:
            try:
                return read(key, limit)
            except NotFoundError:
                if key == rank_key("cohort", gaps[0]) and not late:
                    late.extend(_land(root, "cohort", r, ranks) for r in gaps)  # both find the claim taken
                raise

        watched.read = missed

    claimant = _land(root, "cohort", 0, ranks, hook=hook)
    assert [(x.final, x.reads) for x in late] == [(None, {}), (None, {})]
    assert claimant.final is not None and sorted(claimant.final.shards, key=int) == [str(r) for r in ranks]
    assert [status for _, status in claimant.events] == [CREATED, CREATED, DELETED, CREATED, CREATED]
    # the first read stopped after the window of the first gap; the second took that gap and every rank after it
    assert claimant.reads[gaps[0]] == 2 and claimant.reads[gaps[1]] == 1
    assert sum(claimant.reads.values()) == 2 * MARKER_WINDOW + 1 + len(ranks) - gaps[0] - 1
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(0)
    assert [r.rank for r in open_native(f"{root}/cohort")] == ranks


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
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(2)  # the claim is left as it was
    assert bundle_status(backend, "cohort").status == "complete"


def test_a_retry_of_the_claimant_rank_finds_its_own_claim_and_finalizes(tmp_path):
    root = str(tmp_path / "store")
    _claimant_died(root, "cohort", [0, 1])
    # another rank's retry stops at its landed marker (read once, to log the attempt that landed it) and at the claim
    # it does not hold, reading no other rank's marker
    retry = _land(root, "cohort", 0, [0, 1])
    assert retry.final is None and retry.reads == {0: 1}
    assert retry.creates == {rank_key("cohort", 0): DIFFERENT, finalizer_key("cohort"): DIFFERENT}
    retry = _land(root, "cohort", 1, [0, 1])
    assert retry.events == [
        (rank_key("cohort", 1), DIFFERENT),
        (finalizer_key("cohort"), SAME),
        (complete_key("cohort"), CREATED),
    ]
    assert retry.final is not None and sorted(retry.final.shards) == ["0", "1"]
    assert [r.rank for r in open_native(f"{root}/cohort")] == [0, 1]


def test_a_retry_of_a_claimant_that_died_with_ranks_missing_hands_its_claim_back(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1])
    backend = open_backend(root)
    assert backend.create_if_absent(finalizer_key("cohort"), finalizer_claim(0))  # left by rank 0's first job
    retry = _land(root, "cohort", 0, [0, 1])
    assert retry.final is None
    assert retry.events == [
        (rank_key("cohort", 0), DIFFERENT),
        (finalizer_key("cohort"), SAME),
        (finalizer_key("cohort"), DELETED),
    ]
    last = _land(root, "cohort", 1, [0, 1])
    assert last.final is not None and last.creates[finalizer_key("cohort")] == CREATED
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(1)


def test_the_claimant_still_names_a_bad_rank_marker_keeps_its_claim_and_a_repaired_cohort_is_finalized(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1])
    backend = open_backend(root)
    good = backend.read(rank_key("cohort", 0))
    marker = read_marker(backend, rank_key("cohort", 0), RankMarker)
    backend.write(rank_key("cohort", 0), compact_json({**marker.model_dump(mode="json"), "rank": 1}))
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.0: corrupt rank marker: holds rank 1.*not finalized"):
        _land(root, "cohort", 1, [0, 1])
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(1) and not backend.exists(complete_key("cohort"))
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.0: corrupt rank marker"):  # a retry reports it again
        _land(root, "cohort", 1, [0, 1])
    report = check_store(root)
    assert rank_key("cohort", 0) in report.corrupt and report.finalized == []

    backend.write(rank_key("cohort", 0), good)  # the marker restored: the next fsck finalizes
    assert check_store(root).finalized == ["cohort"]
    assert backend.exists(complete_key("cohort"))


def test_a_claimant_that_cannot_parse_a_marker_names_it_and_keeps_its_claim(tmp_path):
    root = str(tmp_path / "store")
    _land(root, "cohort", 0, [0, 1, 2])
    backend = open_backend(root)
    backend.write(rank_key("cohort", 1), b"{")
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.1"):
        _land(root, "cohort", 2, [0, 1, 2])
    assert backend.read(finalizer_key("cohort")) == finalizer_claim(2) and not backend.exists(complete_key("cohort"))
    assert bundle_status(backend, "cohort").status == "corrupt"


def test_gc_removes_the_claim_of_an_abandoned_cohort_and_a_claim_left_alone(tmp_path):
    root = str(tmp_path / "store")
    _claimant_died(root, "cohort", [0, 1, 2])
    _claimant_died(root, "alone", [0, 1])
    _land(root, "held", 0, [0, 1])
    backend = open_backend(root)
    backend.delete(rank_key("cohort", 2))  # a bad marker removed, its rank never landed again
    for r in (0, 1):
        backend.delete(rank_key("alone", r))
    assert backend.create_if_absent(finalizer_key("held"), finalizer_claim(0))  # its claimant died mid-read
    assert bundle_status(backend, "alone") is None and bundle_status(backend, "cohort").status == "incomplete"
    assert bundle_status(backend, "held").status == "incomplete"

    young = collect_garbage(root)
    assert young.removed == [] and young.abandoned_bundles == []
    report = collect_garbage(root, grace="0s")
    assert report.abandoned_bundles == ["cohort", "held"]
    assert {
        finalizer_key("cohort"),
        finalizer_key("alone"),
        rank_key("cohort", 0),
        rank_key("cohort", 1),
        finalizer_key("held"),
        rank_key("held", 0),
    } <= set(report.removed)
    assert report.markers_removed == 6
    # each abandoned cohort leaves only its ABANDONED note, for a producer still landing into it to read
    assert backend.list("cohort/") == ["cohort/ABANDONED"] and backend.list("held/") == ["held/ABANDONED"]
    assert backend.list("alone/") == []
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
    assert backend.stats.reads == 2 * MARKER_WINDOW - 1  # one read a marker, none past the window of the gap


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
    with pytest.raises(BundleError, match="larger than"):  # what a reader finalizing it would meet
        try_finalize(backend, "cohort", [0, 1])


def test_import_finalizes_a_multi_rank_bundle_whose_claim_another_rank_holds(tmp_path):
    from trajectory_replay.ops.export import export_bundle
    from trajectory_replay.ops.importer import import_v1

    root, out, back = str(tmp_path / "store"), tmp_path / "v1" / "cohort", str(tmp_path / "back")
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    export_bundle(f"{root}/cohort", out)
    backend = open_backend(back)
    backend.write(finalizer_key("cohort"), finalizer_claim(2))  # left alone: its rank markers are gone
    assert import_v1(out, back) == [f"{back}/cohort"]  # both ranks land and find rank 2's claim
    assert backend.exists(complete_key("cohort")) and backend.read(finalizer_key("cohort")) == finalizer_claim(2)
    assert [r.rank for r in open_native(f"{back}/cohort")] == [0, 1]
