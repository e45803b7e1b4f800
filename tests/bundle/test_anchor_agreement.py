"""A COMPLETE whose anchor is not its index's identity is corrupt wherever the bundle is looked at: `ls` would show
one anchor, `inspect` the other, and `--step` would select (and pass) a bundle of another step."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import INDEX_HEAD_BYTES, DocRef, complete_key, index_anchor
from trajectory_replay.cli import app
from trajectory_replay.ops.fsck import check_store
from trajectory_replay.store import ObjectStore

runner = CliRunner()
BOTH = "anchor step 5:5 differs from step 120:0 in the index"


def _move_anchor(root: str, name: str) -> None:
    backend = open_backend(root)
    doc = json.loads(backend.read(complete_key(name)))
    assert doc["anchor"] == {"actor_step_id": {"rollout_id": 120, "step_id": 0}}
    doc["anchor"] = {"actor_step_id": {"rollout_id": 5, "step_id": 5}}
    backend.write(complete_key(name), compact_json(doc))


def _one_error(result) -> str:
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("trajectory-replay: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_complete_whose_anchor_is_not_its_index_s_is_corrupt_everywhere(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    _move_anchor(root, "b-00001")
    listing = json.loads(runner.invoke(app, ["ls", root, "--json"]).stdout)
    (row,) = listing["bundles"]
    assert row["status"] == "corrupt" and BOTH in row["detail"]
    assert BOTH in runner.invoke(app, ["ls", root]).stdout
    assert BOTH in _one_error(runner.invoke(app, ["replay", root, "--step", "5:5"]))
    assert BOTH in _one_error(runner.invoke(app, ["replay", f"{root}/b-00001"]))
    validated = runner.invoke(app, ["validate", f"{root}/b-00001"])
    assert validated.exit_code == 1 and "INVALID" in validated.stdout and BOTH in validated.stdout
    inspected = runner.invoke(app, ["inspect", f"{root}/b-00001"])
    assert inspected.exit_code == 1 and BOTH in inspected.output, inspected.output
    report = check_store(root)
    assert not report.healthy and [b["name"] for b in report.damaged_bundles] == ["b-00001"]
    assert BOTH in report.damaged_bundles[0]["detail"]


def test_a_multi_rank_complete_is_checked_against_every_rank_s_index(tmp_path):
    root = str(tmp_path / "store")
    write_ranks(root, "mr", [0, 1], [0, 1])
    _move_anchor(root, "mr")
    report = check_store(root)
    [damaged] = report.damaged_bundles
    assert (
        "mr/COMPLETE: corrupt marker: anchor step 5:5 differs from step 120:0 in the index of rank 0"
        in damaged["detail"]
    )
    assert BOTH in _one_error(runner.invoke(app, ["replay", f"{root}/mr/rank-1"]))


def test_the_anchor_is_read_from_the_head_of_a_large_index_and_whole_when_it_is_not_there(tmp_path):
    store = ObjectStore(open_backend(str(tmp_path / "store")))
    identity = {"actor_step_id": {"rollout_id": 7, "step_id": 3}, "micro_batch_ids": ["mb-0"]}
    samples = [{"sample_id": f"s-{i}", "pad": "x" * 100} for i in range(2000)]
    for doc in (
        {"bundle_id": "b", "config": {}, "identity": identity, "samples": samples},  # sorted: head only
        {"bundle_id": "b", "samples": samples, "identity": identity},
    ):  # not: the whole
        data = json.dumps(doc, separators=(",", ":")).encode()
        assert len(data) > 8 * INDEX_HEAD_BYTES
        ref = store.put(data)
        anchor = index_anchor(store, DocRef.of(ref), "index")
        assert (anchor.rollout_id, anchor.step_id) == (7, 3)
