"""One corrupt bundle in a store root never stops a whole-root `ls`, `cp` or the shared walk.

Each case damages bundle `bad` of a real store root on disk (a marker that is not JSON, nests too
deeply, has a traversal shard key, an anchor of the wrong type, an unparsable digest, too many ranks;
or a manifest / record that is hostile JSON stored under its real digest) next to an intact bundle
`good`. `ls` lists both (the bad one as corrupt, with the object and field named), `cp --all` copies
the good one and names the bad one (exit 1: not everything asked was copied), and `scan_bundles`, the
walk ls, cp, gc and fsck share, reports the bad one as corrupt instead of raising.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import validates
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import MAX_RANKS, complete_key, rank_key
from trajectory_replay.bundle.status import COMPLETE_STATUS, CORRUPT, scan_bundles
from trajectory_replay.cli import app
from trajectory_replay.store import ObjectStore
from trajectory_replay.store.digest import hash_bytes, object_key

runner = CliRunner()


def cli(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    return result


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _marker(backend, name: str = "bad") -> dict:
    return json.loads(backend.read(complete_key(name)))


def _set_marker(backend, marker: dict | bytes, key: str = complete_key("bad")) -> None:
    backend.write(key, marker if isinstance(marker, bytes) else compact_json(marker))


def _edit(backend, change) -> None:
    marker = _marker(backend)
    change(marker)
    _set_marker(backend, marker)


def _store_under_digest(backend, data: bytes) -> str:
    digest = hash_bytes(data)
    backend.write(object_key(digest), data)
    return digest


def _multi_rank_with_key(marker: dict, key: str) -> None:
    docs = marker["shards"]["0"]
    marker.update(multi_rank=True, expected_ranks=[0, 1], shards={"0": docs, key: docs})


def _hostile_manifest(backend) -> None:
    """The manifest blob is stored honestly (chunks, record, ref) but its content nests too deeply."""
    ref = ObjectStore(backend).put(b'{"bundle_id":"bad","producer":' + nested(5000) + b"}")
    _edit(backend, lambda m: m["shards"]["0"]["manifest"].update(digest=ref.digest, record=ref.record, size=ref.size))


def _hostile_record(backend) -> None:
    digest = _store_under_digest(backend, nested(100_000))
    _edit(backend, lambda m: m["shards"]["0"]["manifest"].update(record=digest))


def _rank_marker_only(backend, data: bytes) -> None:
    backend.delete(complete_key("bad"))
    _set_marker(backend, data, rank_key("bad", 0))


CORRUPTIONS = {
    "complete-not-json": (lambda b: _set_marker(b, b'{"bundle_id": "bad", '), [complete_key("bad"), "not valid JSON"]),
    "complete-not-utf8": (lambda b: _set_marker(b, b"\xff\xfe\x00"), [complete_key("bad"), "not UTF-8"]),
    "complete-nested": (lambda b: _set_marker(b, nested(100_000)), [complete_key("bad"), "nested more than"]),
    "shard-key-traversal": (
        lambda b: _edit(b, lambda m: _multi_rank_with_key(m, "../../x")),
        [complete_key("bad"), "field 'shards'", "'../../x'"],
    ),
    "anchor-int": (lambda b: _edit(b, lambda m: m.update(anchor=5)), [complete_key("bad"), "field 'anchor'"]),
    "anchor-step-string": (
        lambda b: _edit(b, lambda m: m.update(anchor={"actor_step_id": "x"})),
        [complete_key("bad"), "field 'anchor'", "actor_step_id"],
    ),
    "anchor-rollout-list": (
        lambda b: _edit(b, lambda m: m.update(anchor={"rollout_id": [1]})),
        [complete_key("bad"), "field 'anchor'", "rollout_id"],
    ),
    "digest-unparsable": (
        lambda b: _edit(b, lambda m: m["shards"]["0"]["manifest"].update(digest="blake3:no")),
        [complete_key("bad"), "shards.0.manifest.digest"],
    ),
    "too-many-ranks": (
        lambda b: _edit(b, lambda m: m.update(expected_ranks=list(range(MAX_RANKS + 1)))),
        [complete_key("bad"), "expected_ranks", str(MAX_RANKS)],
    ),
    "rank-marker-garbage": (lambda b: _rank_marker_only(b, b"\x00garbage"), [rank_key("bad", 0), "not"]),
    "manifest-nested": (_hostile_manifest, ["manifest", "nested more than"]),
    "record-nested": (_hostile_record, ["malformed blob record", "nested more than"]),
}


@pytest.fixture
def root(tmp_path) -> str:
    root = str(tmp_path / "src")
    write_canonical(root, name="bad")
    write_canonical(root, name="good")
    return root


def _damage(root: str, case: str) -> list[str]:
    change, needles = CORRUPTIONS[case]
    change(open_backend(root))
    return needles


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_ls_lists_the_good_bundle_and_names_the_corrupt_one(root, case):
    needles = _damage(root, case)
    listing = cli("ls", root, "--json")
    assert listing.exit_code == 0, listing.output
    rows = {row["name"]: row for row in json.loads(listing.stdout)["bundles"]}
    assert rows["good"]["status"] == "complete" and rows["good"]["logical_bytes"] > 0
    assert rows["bad"]["status"] == "corrupt", rows["bad"]
    for needle in needles:
        assert needle in rows["bad"]["detail"], (needle, rows["bad"]["detail"])
    assert "\n" not in rows["bad"]["detail"] and len(rows["bad"]["detail"]) < 2000
    text = cli("ls", root)
    assert text.exit_code == 0
    assert any(line.startswith("good ") and "complete" in line for line in text.stdout.splitlines())
    assert any(line.startswith("bad: ") and needles[-1] in line for line in text.stdout.splitlines()), text.stdout


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_cp_all_copies_the_good_bundle_and_names_the_corrupt_one(root, tmp_path, case):
    needles = _damage(root, case)
    dest = str(tmp_path / "dest")
    result = cli("cp", root, dest, "--all", "--quiet", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["bundles"] == ["good"]
    assert [s["name"] for s in report["skipped"]] == ["bad"]
    for needle in needles:
        assert needle in report["skipped"][0]["detail"], (needle, report["skipped"][0]["detail"])
    assert validates(f"{dest}/good")
    assert not open_backend(dest).list("bad/")
    again = cli("cp", root, str(tmp_path / "dest2"), "--all", "--quiet")
    assert again.exit_code == 1
    assert again.stdout.splitlines()[0].startswith("copied 1 bundle(s) good")
    assert again.stdout.splitlines()[1].startswith("not copied: bad: corrupt")


@pytest.mark.parametrize("case", ["complete-not-json", "anchor-step-string", "shard-key-traversal", "record-nested"])
def test_shared_walk_reports_the_corrupt_bundle_instead_of_raising(root, case):
    _damage(root, case)
    states = {s.name: s for s in scan_bundles(open_backend(root))}
    assert states["good"].status == COMPLETE_STATUS
    if case == "record-nested":  # markers are fine; the tree is what is damaged
        assert states["bad"].status == COMPLETE_STATUS
    else:
        assert states["bad"].status == CORRUPT and complete_key("bad") in states["bad"].detail


def test_cp_without_a_selector_counts_the_corrupt_bundle(root, tmp_path):
    """It may be the bundle the user meant: nothing is picked for them, and it is named."""
    _damage(root, "anchor-int")
    result = cli("cp", root, str(tmp_path / "dest"), "--quiet")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert "2 bundles" in line and "corrupt: bad" in line and "field 'anchor'" in line and "--all" in line


def test_cp_step_copies_the_match_past_a_corrupt_bundle_of_unknown_anchor(root, tmp_path):
    _damage(root, "complete-not-json")
    dest = str(tmp_path / "dest")
    result = cli("cp", root, dest, "--step", "120:0", "--quiet", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["bundles"] == ["good"] and validates(f"{dest}/good")


def test_cp_step_skips_a_matching_bundle_with_a_damaged_tree(root, tmp_path):
    _damage(root, "manifest-nested")
    result = cli("cp", root, str(tmp_path / "dest"), "--step", "120:0", "--quiet", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["bundles"] == ["good"] and [s["name"] for s in report["skipped"]] == ["bad"]


def test_cp_refuses_when_every_bundle_is_corrupt(tmp_path):
    root = str(tmp_path / "src")
    write_canonical(root, name="bad")
    _damage(root, "digest-unparsable")
    result = cli("cp", root, str(tmp_path / "dest"), "--all", "--quiet")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("trajectory-replay: error:") and "corrupt: bad" in line
    assert "shards.0.manifest.digest" in line


def test_cp_of_the_corrupt_bundle_itself_is_one_line(root, tmp_path):
    _damage(root, "shard-key-traversal")
    result = cli("cp", f"{root}/bad", str(tmp_path / "dest"), "--quiet")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("trajectory-replay: error:") and "corrupt bundle" in line and "'../../x'" in line


def test_replay_of_a_root_resolves_past_a_corrupt_bundle(root):
    _damage(root, "anchor-step-string")
    chosen = cli("replay", root, "--step", "120:0")
    assert chosen.exit_code == 0, chosen.output
    assert "skipped unreadable bundle bad" in chosen.stderr and "field 'anchor'" in chosen.stderr
    ambiguous = cli("replay", root)
    assert ambiguous.exit_code == 1
    (line,) = ambiguous.stderr.strip().splitlines()
    assert "good" in line and "unreadable: bad" in line and "field 'anchor'" in line
