"""gc and the landing of multi-rank bundles: a rank marker gc removed as an abandoned cohort is no landing lost
without a word (the later lander fails loudly, the rank landed again completes the bundle), and a rank marker
already there is accepted only when it is the same landing."""

from __future__ import annotations

import json

import pytest

from tests.ops.conftest import rank_writer, renamed_case, validates
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import ABANDONED_FORMAT, abandoned_key, complete_key, rank_key
from trajectory_replay.bundle.status import COMPLETE_STATUS, bundle_status
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.store.liveness import read_inflight


def _land(root: str, name: str, rank: int, expected: list[int], *, buggy: bool = False, **options):
    case = renamed_case(name, buggy=buggy)
    writer = rank_writer(root, name, rank, expected, **options)
    return writer.finalize(payloads=case.payloads)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> tuple[str, dict]:
    if request.param == "local":
        return str(tmp_path / "store"), {}
    return request.getfixturevalue("s3_root")


def test_a_rank_landing_after_gc_abandoned_its_cohort_fails_and_relanding_completes(root):
    url, options = root
    assert _land(url, "cohort", 0, [0, 1], **options) is None
    report = collect_garbage(url, grace="0s", **options)  # between the two ranks' landings
    assert report.abandoned_bundles == ["cohort"]
    backend = open_backend(url, **options)
    assert not backend.exists(rank_key("cohort", 0))
    note = json.loads(backend.read(abandoned_key("cohort")))
    assert note["format"] == ABANDONED_FORMAT and note["ranks"] == [0]

    with pytest.raises(BundleError, match=r"gc removed the landed rank marker\(s\) \[0\] of this bundle"):
        _land(url, "cohort", 1, [0, 1], **options)
    assert read_inflight(backend) == []  # a writer that failed leaves nothing for gc to wait out
    assert not backend.exists(complete_key("cohort"))

    # the step captured again: rank 0 lands anew, the note is consumed, the bundle completes
    final = _land(url, "cohort", 0, [0, 1], **options)
    assert final is not None and sorted(final.shards) == ["0", "1"]
    assert not backend.exists(abandoned_key("cohort"))
    assert bundle_status(backend, "cohort").status == COMPLETE_STATUS
    assert validates(f"{url}/cohort", **options)


def test_a_note_alone_in_its_directory_goes_only_once_no_writer_can_be_at_work(tmp_path):
    url = str(tmp_path / "store")
    _land(url, "cohort", 0, [0, 1])
    collect_garbage(url, grace="0s")
    backend = open_backend(url)
    assert backend.list_dir("cohort") == ["ABANDONED"]
    collect_garbage(url, grace="0s")  # younger than an in-flight record's TTL: a writer may still read it
    assert backend.list_dir("cohort") == ["ABANDONED"]
    collect_garbage(url, grace="30d")
    assert backend.list_dir("cohort") == ["ABANDONED"]
    report = collect_garbage(url, grace="0s", dry_run=True)
    assert abandoned_key("cohort") not in report.removed


def test_a_rank_already_landed_with_other_content_is_refused_and_the_same_landing_accepted(root):
    url, options = root
    # run A landed rank 0 and crashed; run B (other data) captures the same step into the same directory
    assert _land(url, "cohort", 0, [0, 1], **options) is None
    with pytest.raises(BundleError, match=r"COMPLETE\.0: rank 0 already landed with different content"):
        _land(url, "cohort", 0, [0, 1], buggy=True, **options)
    backend = open_backend(url, **options)
    assert not backend.exists(complete_key("cohort"))
    # a retry of A's own rank-0 job is the same landing: accepted, and the bundle completes with A's rank 1
    assert _land(url, "cohort", 0, [0, 1], **options) is None
    final = _land(url, "cohort", 1, [0, 1], **options)
    assert final is not None and sorted(final.shards) == ["0", "1"]
    assert validates(f"{url}/cohort", **options)


def test_a_name_holding_only_an_abandoned_note_takes_an_import(tmp_path):
    """gc's note of an abandoned cohort is no bundle: importing under that name is not refused as a clash."""
    from tests.bundle_legacy.v1_cases import tool_case
    from trajectory_replay.ops.importer import import_v1

    root = str(tmp_path / "store")
    assert _land(root, "cohort", 0, [0, 1]) is None
    assert collect_garbage(root, grace="0s").abandoned_bundles == ["cohort"]
    assert open_backend(root).exists(abandoned_key("cohort"))
    v1 = tool_case().write(tmp_path / "replay-120-0")
    (url,) = import_v1(str(v1), root, name="cohort")
    assert url.endswith("/cohort") and validates(url)
