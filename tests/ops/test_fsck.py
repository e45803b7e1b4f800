"""fsck: a flipped byte, a deleted chunk, an orphan object and a finalizable bundle are found;
the finalizable bundle is finalized; --repair-from restores the damaged objects from a copy."""

from __future__ import annotations

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import reachable, validates, write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.bundle.status import scan_bundles
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.digest import blob_ref_key, object_key


def _payload_chunk(root: str, name: str, options: dict | None = None) -> str:
    """An object key holding bytes of a payload (not shared with the other bundle)."""
    from trajectory_replay.bundle.status import bundle_status
    from trajectory_replay.ops.walk import Walker

    backend = open_backend(root, **(options or {}))
    tree = Walker(backend).trees([bundle_status(backend, name)])[name]
    node = next(n for _, spec, n in tree.payloads if spec.name == "advantages")
    return object_key(node.chunks[0][0])


def test_fsck_finds_damage_finalizes_and_repairs_from_a_copy(tmp_path, s3_root):
    url, options = s3_root
    root = str(tmp_path / "store")
    write_canonical(root)
    write_canonical(root, buggy=True)
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    copy_bundles(root, url, all_bundles=True, dest_options=options)  # the copy to repair from, on S3
    assert check_store(url, **options).healthy

    backend = open_backend(root)
    flipped = _payload_chunk(root, "b-00001")
    data = bytearray(backend.read(flipped))
    data[len(data) // 2] ^= 0x01
    backend.write(flipped, bytes(data))
    deleted = _payload_chunk(root, "b-00065")
    assert deleted != flipped
    backend.delete(deleted)
    orphan_digest = ObjectStore(backend).put_object(b"nobody references me")
    orphan = object_key(orphan_digest)
    backend.delete(complete_key("cohort"))
    assert [b.status for b in scan_bundles(backend)] == ["complete", "complete", "finalizable"]

    report = check_store(root)
    assert not report.healthy and report.exit_code == 1
    assert report.corrupt == [flipped] and report.missing == [deleted]
    assert orphan in report.orphaned and len(report.orphaned) == 1
    assert report.finalizable == ["cohort"] and report.finalized == ["cohort"]
    assert backend.exists(complete_key("cohort"))  # it shares the flipped chunk: validated after the repair
    as_dict = report.to_dict()
    assert as_dict["healthy"] is False and as_dict["corrupt"] == [flipped]

    repaired = check_store(root, repair_from=url, repair_options=options)
    assert sorted(repaired.repaired) == sorted([flipped, deleted])
    assert repaired.healthy and repaired.exit_code == 0
    assert validates(f"{root}/b-00001") and validates(f"{root}/b-00065") and validates(f"{root}/cohort")
    s3 = open_backend(url, **options)
    for name in ("b-00001", "b-00065", "cohort"):
        for key in reachable(root, name) - {complete_key("cohort")}:
            assert backend.read(key) == s3.read(key)
    assert check_store(root).healthy


def test_missing_record_repairs_in_rounds_and_missing_ref_is_relinked(tmp_path):
    root, copy = str(tmp_path / "store"), str(tmp_path / "copy")
    write_canonical(root)
    copy_bundles(f"{root}/b-00001", copy)
    from trajectory_replay.bundle.status import bundle_status
    from trajectory_replay.ops.walk import Walker

    backend = open_backend(root)
    tree = Walker(backend).trees([bundle_status(backend, "b-00001")])["b-00001"]
    node = next(n for _, spec, n in tree.payloads if spec.name == "log_probs")
    record_key = object_key(node.record)
    chunk_keys = [object_key(c) for c, _ in node.chunks]
    for key in [record_key, *chunk_keys]:
        backend.delete(key)
    damaged = check_store(root)
    assert record_key in damaged.missing and not damaged.healthy
    assert damaged.damaged_bundles and damaged.damaged_bundles[0]["name"] == "b-00001"
    fixed = check_store(root, repair_from=copy)
    assert set(fixed.repaired) == {record_key, *chunk_keys} and fixed.healthy
    other = next(n for _, spec, n in tree.payloads if spec.name == "entropy")
    backend.delete(blob_ref_key(other.digest))
    relinked = check_store(root)
    assert relinked.relinked == [blob_ref_key(other.digest)] and relinked.healthy
    assert validates(f"{root}/b-00001")
