"""fsck on damage an outside probe found it silent or wrong about: a rank marker that disagrees with the
COMPLETE beside it, the keys a corrupt blob record leaves unreferenced (gc keeps them), a store to repair
from that does not exist."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import complete_key, rank_key
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.cli import app
from trajectory_replay.ops.cp import copy_bundles
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.ops.walk import Walker
from trajectory_replay.store.digest import blob_ref_key, object_key

runner = CliRunner()


def test_a_rank_marker_that_disagrees_with_complete_is_corrupt(tmp_path):
    root = str(tmp_path / "store")
    write_ranks(root, "mr", [0, 1], [0, 1])
    backend = open_backend(root)
    assert check_store(root).healthy
    doc = json.loads(backend.read(rank_key("mr", 1)))
    doc["documents"]["index"]["digest"] = "blake3:" + "0" * 64  # latent while COMPLETE exists
    backend.write(rank_key("mr", 1), compact_json(doc))

    report = check_store(root)
    assert not report.healthy and report.exit_code == 1
    assert report.corrupt == [rank_key("mr", 1)]
    [damaged] = report.damaged_bundles
    assert damaged["name"] == "mr"
    assert "mr/COMPLETE.1: corrupt rank marker: documents.index differs from COMPLETE's rank 1" in damaged["detail"]
    assert rank_key("mr", 0) not in damaged["detail"]
    # the same damage once COMPLETE is lost: the marker is what blocks finalizing, by the same key
    backend.delete(complete_key("mr"))
    again = check_store(root)
    assert rank_key("mr", 1) in again.corrupt and again.finalized == []


def test_keys_under_a_corrupt_record_are_kept_by_gc_and_fsck_says_so(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    backend = open_backend(root)
    state = bundle_status(backend, "b-00001")
    tree = Walker(backend).trees([state])["b-00001"]
    spec, node = next((spec, node) for _, spec, node in tree.payloads if spec.name == "advantages")
    record = object_key(node.record)
    chunks = [object_key(c) for c, _ in node.chunks]
    backend.write(record, backend.read(record)[:-7] + b"garbage")

    report = check_store(root)
    assert record in report.corrupt
    assert set(chunks) <= set(report.orphaned)
    assert report.orphans_kept_by == ["b-00001"]
    text = report.render_text()
    assert "gc removes them" not in text
    assert "gc keeps them, and every other object, while b-00001 cannot be read whole" in text
    gc = collect_garbage(root, grace="0s")
    assert gc.kept_everything and gc.objects_removed == 0
    assert all(backend.exists(k) for k in chunks)  # what fsck said: kept


def test_repair_from_a_store_that_does_not_exist_is_a_one_line_error(tmp_path):
    root, missing = str(tmp_path / "store"), str(tmp_path / "absent")
    write_canonical(root)
    result = runner.invoke(app, ["fsck", root, "--repair-from", missing])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines == [f"trajectory-replay: error: --repair-from {missing}: no such store root (nothing stored there)"]
    as_json = runner.invoke(app, ["fsck", root, "--repair-from", missing, "--json"])
    doc = json.loads(as_json.stdout)
    assert as_json.exit_code == 1 and doc["status"] == "selection" and "--repair-from" in doc["error"]


def test_a_ref_naming_a_record_that_does_not_exist_is_the_culprit_and_is_repaired_from_a_copy(tmp_path):
    root, copy = str(tmp_path / "store"), str(tmp_path / "copy")
    write_canonical(root)
    copy_bundles(root, copy, all_bundles=True)
    backend = open_backend(root)
    tree = Walker(backend).trees([bundle_status(backend, "b-00001")])["b-00001"]
    node = next(node for _, spec, node in tree.payloads if spec.name == "advantages")
    ref = blob_ref_key(node.digest)
    nowhere = "blake3:" + "ab" * 32
    backend.write(ref, nowhere.encode())

    report = check_store(root)
    assert report.corrupt == [ref] and report.missing == []
    assert object_key(nowhere) not in report.render_text()

    repaired = check_store(root, repair_from=copy)
    assert repaired.repaired == [ref] and repaired.unrepaired == [] and repaired.healthy
    assert backend.read(ref) == open_backend(copy).read(ref)
    assert check_store(root).healthy
