"""How many ranks a marker may list, and how long rank lists are shown: a bound every marker is held to
(writers refuse more before writing anything), and text output that abbreviates what `--json` lists whole."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import rank_writer, renamed_case
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import MAX_RANKS, complete_key, ranks_brief
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError

runner = CliRunner()


def _set_expected_ranks(root: str, ranks: list[int]) -> None:
    backend = open_backend(root)
    doc = json.loads(backend.read(complete_key("b-00001")))
    doc["expected_ranks"] = ranks
    backend.write(complete_key("b-00001"), compact_json(doc))


def _ls(root: str) -> tuple[list[str], dict]:
    text = runner.invoke(app, ["ls", root])
    as_json = runner.invoke(app, ["ls", root, "--json"])
    return text.stdout.splitlines(), json.loads(as_json.stdout)


def test_the_bound_is_what_a_marker_can_hold():
    assert MAX_RANKS == 4096
    assert ranks_brief([0, 1, 2]) == "[0, 1, 2]"
    assert ranks_brief(range(4096)) == "[0-4095] (4096 ranks)"
    assert ranks_brief([r for r in range(4096) if r != 64]) == "[0-63, 65-4095] (4095 ranks)"
    assert ranks_brief(range(0, 4096, 2)) == f"[{', '.join(map(str, range(0, 32, 2)))}, ...] (2048 ranks)"


def test_a_marker_listing_more_ranks_than_the_bound_is_corrupt_in_one_short_line(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    _set_expected_ranks(root, list(range(65_536)))  # one shard, 65,536 expected ranks
    lines, doc = _ls(root)
    assert max(map(len, lines)) < 300, max(map(len, lines))
    (row,) = doc["bundles"]
    assert row["status"] == "corrupt" and f"bound of {MAX_RANKS}" in row["detail"]


def test_long_rank_lists_are_abbreviated_in_text_and_whole_in_json(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    _set_expected_ranks(root, list(range(MAX_RANKS)))
    lines, doc = _ls(root)
    assert max(map(len, lines)) < 300
    assert any("[0-4095] (4096 ranks)" in line for line in lines)
    assert doc["bundles"][0]["ranks"] == list(range(MAX_RANKS))

    # an incomplete cohort of as many ranks: its missing ranks too
    case = renamed_case("cohort")
    rank_writer(root, "cohort", 7, range(MAX_RANKS)).finalize(payloads=case.payloads)
    lines, doc = _ls(root)
    assert max(map(len, lines)) < 300
    assert any("incomplete (missing ranks [0-6, 8-4095] (4095 ranks))" in line for line in lines)
    row = next(b for b in doc["bundles"] if b["name"] == "cohort")
    assert len(row["missing_ranks"]) == MAX_RANKS - 1
    inspected = runner.invoke(app, ["inspect", f"{root}/cohort"])
    assert max(map(len, inspected.stdout.splitlines())) < 300
    assert "missing ranks [0-6, 8-4095] (4095 ranks) of [0-4095] (4096 ranks)" in inspected.stdout


def test_a_writer_refuses_more_ranks_than_the_bound_before_writing(tmp_path):
    root = str(tmp_path / "store")
    with pytest.raises(BundleError, match=f"bound of {MAX_RANKS}"):
        rank_writer(root, "cohort", 0, range(MAX_RANKS + 1))
    assert not (tmp_path / "store").exists() or not open_backend(root).list_dir()
