"""fsck blames the key that is actually wrong and repairs only that; rank markers that disagree with their own
documents are corrupt and never finalized, by any reader; after `--repair-from`, a second fsck is healthy or the
first one said exactly what it could not repair."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import validates, write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import complete_key, rank_key, try_finalize
from trajectory_replay.bundle.reader import open_native
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.ops.walk import Walker
from trajectory_replay.store.digest import blob_ref_key, object_key
from trajectory_replay.store.inventory import BlobNode


def _payload(backend, bundle: str, payload: str) -> BlobNode:
    tree = Walker(backend).trees([bundle_status(backend, bundle)])[bundle]
    return next(n for _, spec, n in tree.payloads if spec.name == payload)


def _document(backend, bundle: str, rank: int, which: str) -> BlobNode:
    state = bundle_status(backend, bundle)
    digest = getattr(state.rank_markers[rank].documents, which).digest
    tree = Walker(backend).trees([state])[bundle]
    return next(n for n in tree.documents if n.digest == digest)


def _point_ref_at_other_record(backend) -> tuple[str, str]:
    """Make blob `advantages`'s ref name the (healthy) record of blob `kl`; returns (ref key, that record's key)."""
    victim, other = _payload(backend, "b-00001", "advantages"), _payload(backend, "b-00001", "kl")
    backend.write(blob_ref_key(victim.digest), other.record.encode())
    return blob_ref_key(victim.digest), object_key(other.record)


def _edit_marker(backend, key: str, **changes) -> None:
    doc = json.loads(backend.read(key))
    doc.update(changes)
    backend.write(key, compact_json(doc))


def _culprit_case(tmp_path, url: str, options: dict) -> None:
    copy = str(tmp_path / "copy")
    write_canonical(url, storage_options=options)
    copy_bundles(url, copy, all_bundles=True, source_options=options)
    backend = open_backend(url, **options)
    ref, healthy_record = _point_ref_at_other_record(backend)
    before = backend.read(healthy_record)

    found = check_store(url, **options)
    assert found.corrupt == [ref] and not found.missing and found.exit_code == 1
    assert healthy_record not in found.corrupt

    fixed = check_store(url, repair_from=copy, **options)
    assert fixed.repaired == [ref] and not fixed.unrepaired and fixed.healthy
    assert backend.read(healthy_record) == before
    again = check_store(url, **options)
    assert again.healthy and again.exit_code == 0 and not again.corrupt
    assert validates(f"{url}/b-00001", **options)


def test_a_ref_naming_another_blobs_record_is_the_culprit_local(tmp_path):
    _culprit_case(tmp_path, str(tmp_path / "store"), {})


def test_a_ref_naming_another_blobs_record_is_the_culprit_s3(tmp_path, s3_root):
    url, options = s3_root
    _culprit_case(tmp_path, url, options)


# ---- rank markers checked against their documents -------------------------------------------------


def _rank_shifted(backend, root, options):
    _edit_marker(backend, rank_key("cohort", 1), rank=0)
    return [rank_key("cohort", 1)], "holds rank 0"


def _anchor_moved(backend, root, options):
    for key in (rank_key("cohort", 0), rank_key("cohort", 1)):
        _edit_marker(backend, key, anchor={"actor_step_id": {"rollout_id": 7, "step_id": 3}})
    return [rank_key("cohort", 0), rank_key("cohort", 1)], "anchor"


def _documents_of_another_bundle(backend, root, options):
    write_ranks(root, "other", land=[1], expected_ranks=[0, 1], **options)
    other = json.loads(backend.read(rank_key("other", 1)))
    _edit_marker(backend, rank_key("cohort", 1), documents=other["documents"])
    return [rank_key("cohort", 1)], "bundle_id 'cohort' differs from 'other' in its manifest"


def _marker_case(tmp_path, root: str, options: dict, damage) -> None:
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1], **options)
    backend = open_backend(root, **options)
    backend.delete(complete_key("cohort"))
    bad_keys, why = damage(backend, root, options)

    listing = {b.name: b for b in list_bundles(root, **options).bundles}["cohort"]
    assert listing.status == "corrupt" and bad_keys[0] in listing.detail and why in listing.detail

    with pytest.raises(BundleError, match=f"{bad_keys[0]}: corrupt rank marker") as exc:
        open_native(f"{root}/cohort/rank-0", **options)
    assert why in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(BundleError, match="corrupt rank marker"):
        try_finalize(backend, "cohort")
    with pytest.raises(BundleError, match="corrupt"):
        copy_bundles(f"{root}/cohort", str(tmp_path / "dest"), source_options=options)

    report = check_store(root, **options)
    assert not report.healthy and report.exit_code == 1
    assert all(k in report.corrupt for k in bad_keys) and report.finalized == []
    damaged = {b["name"]: b["detail"] for b in report.damaged_bundles}
    assert bad_keys[0] in damaged["cohort"] and why in damaged["cohort"]
    assert f"corrupt: {bad_keys[0]}" in report.render_text()
    assert not backend.exists(complete_key("cohort"))  # nobody finalized from it
    assert not open_backend(str(tmp_path / "dest")).exists(complete_key("cohort"))


@pytest.mark.parametrize("damage", [_rank_shifted, _anchor_moved, _documents_of_another_bundle])
def test_a_rank_marker_disagreeing_with_its_documents_is_corrupt_and_never_finalized(tmp_path, damage):
    _marker_case(tmp_path, str(tmp_path / "store"), {}, damage)


def test_a_rank_marker_disagreeing_with_its_documents_is_corrupt_and_never_finalized_s3(tmp_path, s3_root):
    url, options = s3_root
    _marker_case(tmp_path, url, options, _documents_of_another_bundle)


def test_an_incomplete_bundles_corrupt_rank_marker_is_reported(tmp_path):
    root = str(tmp_path / "store")
    write_ranks(root, "cohort", land=[0], expected_ranks=[0, 1])
    backend = open_backend(root)
    _edit_marker(backend, rank_key("cohort", 0), bundle_id="someone-else")
    report = check_store(root)
    assert report.corrupt == [rank_key("cohort", 0)] and not report.healthy
    assert report.damaged_bundles == [
        {
            "name": "cohort",
            "detail": "cohort/COMPLETE.0: corrupt rank marker: bundle_id "
            "'someone-else' differs from 'cohort' in its manifest",
        }
    ]
    assert report.incomplete == []  # a capture in progress is no damage; this marker is


def test_unreadable_rank_documents_block_finalizing_until_repaired(tmp_path):
    """The missing object is the culprit (not the marker): repaired, the bundle is finalized by the same fsck."""
    root, copy = str(tmp_path / "store"), str(tmp_path / "copy")
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    copy_bundles(f"{root}/cohort", copy)
    backend = open_backend(root)
    backend.delete(complete_key("cohort"))
    index = _document(backend, "cohort", 1, "index")
    chunk = object_key(index.chunks[0][0])
    backend.delete(chunk)

    assert {b.name: b.status for b in list_bundles(root).bundles} == {"cohort": "corrupt"}
    with pytest.raises(BundleError, match=r"cohort/COMPLETE\.0: rank marker cannot be checked") as exc:
        open_native(f"{root}/cohort/rank-0")  # both ranks hold the same documents: both markers are named
    assert f"missing chunk {chunk}" in str(exc.value) and "(and 1 more)" in str(exc.value)
    found = check_store(root)
    assert found.missing == [chunk] and found.corrupt == [] and found.finalized == []
    assert not backend.exists(complete_key("cohort"))

    fixed = check_store(root, repair_from=copy)
    assert fixed.repaired == [chunk] and fixed.finalized == ["cohort"] and fixed.healthy
    assert check_store(root).healthy and validates(f"{root}/cohort")


# ---- after --repair-from: healthy, or the first fsck said what it could not repair ---------------


def test_repairable_damage_leaves_a_healthy_store(tmp_path):
    root, copy = str(tmp_path / "store"), str(tmp_path / "copy")
    write_canonical(root)
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    copy_bundles(root, copy, all_bundles=True)
    backend = open_backend(root)
    backend.delete(complete_key("cohort"))
    ref, _ = _point_ref_at_other_record(backend)
    entropy = _payload(backend, "b-00001", "entropy")
    record = object_key(entropy.record)
    backend.delete(record)

    repaired = check_store(root, repair_from=copy)
    assert sorted(repaired.repaired) == sorted([ref, record]) and repaired.healthy
    second = CliRunner().invoke(app, ["fsck", root])
    assert second.exit_code == 0 and "healthy" in second.stdout, second.output
    assert validates(f"{root}/b-00001") and validates(f"{root}/cohort")


def test_unrepairable_damage_is_named_by_the_first_fsck(tmp_path):
    root, copy = str(tmp_path / "store"), str(tmp_path / "copy")
    write_canonical(root)
    copy_bundles(root, copy, all_bundles=True)
    backend, source = open_backend(root), open_backend(copy)
    ref, _ = _point_ref_at_other_record(backend)
    _point_ref_at_other_record(source)  # the copy's ref is just as wrong: not a repair
    chunk = object_key(_payload(backend, "b-00001", "entropy").chunks[0][0])
    backend.delete(chunk)
    source.delete(chunk)

    first = CliRunner().invoke(app, ["fsck", root, "--repair-from", copy])
    assert first.exit_code == 1, first.output
    lines = first.stdout.splitlines()
    assert any(line.startswith(f"  not repaired: {ref} (") for line in lines), first.stdout
    assert any(line.startswith(f"  not repaired: {chunk} (") for line in lines), first.stdout
    report = check_store(root, repair_from=copy)
    assert sorted(report.unrepaired) == sorted([ref, chunk]) and report.repaired == []
    assert report.missing == [chunk] and report.corrupt == [ref]
    second = check_store(root)
    assert second.exit_code == 1 and second.missing == [chunk] and second.corrupt == [ref]
