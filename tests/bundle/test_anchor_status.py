"""The one Anchor, the one bundle_status and the one place --step/--critic/--rollout are matched.

Anchors are parsed from the command line and from markers, printed, and compared exactly (a step filter never
matches a rollout-level bundle of the same rollout, nor the critic's bundle of the same step). Each bundle state is
produced from real markers on disk. Last, one store root holding the actor's step-level, the critic's step-level and
the rollout-level bundle of the same rollout: replay, inspect, validate and cp pick the same bundle for the same
filter, and ls and scan show the same anchors.
"""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.anchor import CRITIC, Anchor
from trajectory_replay.bundle.documents import compact_json
from trajectory_replay.bundle.markers import CompleteMarker, RankMarker, complete_key, rank_key, read_marker
from trajectory_replay.bundle.resolve import Candidate, Selection
from trajectory_replay.bundle.schema import Identity
from trajectory_replay.bundle.status import (
    COMPLETE_STATUS,
    CORRUPT,
    FINALIZABLE,
    INCOMPLETE,
    bundle_status,
    describe_missing,
    finalize,
    scan_bundles,
)
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError, NoSuchTargetError, SelectionError, UsageError
from trajectory_replay.ops.scan import scan_store
from trajectory_replay.replay import canonical_case

runner = CliRunner()


# ---- Anchor --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, anchor", [("120:0", Anchor(120, 0)), (" 7 : 3 ", Anchor(7, 3)), ("-1:2", Anchor(-1, 2))]
)
def test_step_flag_parses_to_a_step_anchor(text, anchor):
    assert Anchor.parse_step(text) == anchor == Anchor.requested(step=text)
    assert anchor.level == "step" and str(anchor) == f"step {anchor.rollout_id}:{anchor.step_id}"
    assert anchor.flag == f"--step {anchor.rollout_id}:{anchor.step_id}"


@pytest.mark.parametrize("text", ["", "120", "120:", "a:b", "1:2:3", "1.5:0"])
def test_malformed_step_flag_is_a_usage_error(text):
    with pytest.raises(UsageError, match="expected ROLLOUT:STEP"):
        Anchor.parse_step(text)


def test_rollout_flag_and_no_flag():
    assert Anchor.requested(rollout=120) == Anchor(120) and str(Anchor(120)) == "rollout 120"
    assert Anchor(120).level == "rollout" and Anchor(120).flag == "--rollout 120"
    assert Anchor.requested() is None
    with pytest.raises(UsageError, match="mutually exclusive"):
        Anchor.requested(step="1:0", rollout=1)


def test_critic_flag_parses_to_a_critic_step_anchor():
    anchor = Anchor.requested(critic=" 7 : 3 ")
    assert anchor == Anchor.parse_step("7:3", CRITIC) == Anchor(7, 3, CRITIC) != Anchor(7, 3)
    assert anchor.level == "step" and str(anchor) == "critic 7:3" and anchor.flag == "--critic 7:3"
    with pytest.raises(UsageError, match=r"--critic '7': expected ROLLOUT:STEP"):
        Anchor.requested(critic="7")
    for flags, says in (
        ({"step": "1:0", "critic": "1:0"}, "--step and --critic are mutually exclusive"),
        ({"critic": "1:0", "rollout": 1}, "--critic and --rollout are mutually exclusive"),
        ({"step": "1:0", "rollout": 1}, "--step and --rollout are mutually exclusive"),
    ):
        with pytest.raises(UsageError, match=says):
            Anchor.requested(**flags)
    with pytest.raises(ValueError, match="needs a step_id"):
        Anchor(7, None, CRITIC)


def test_marker_form_round_trips_and_names_what_is_wrong():
    for anchor in (Anchor(120, 0), Anchor(5), Anchor(120, 0, CRITIC)):
        assert Anchor.from_marker(anchor.to_marker()) == anchor
    assert Anchor(120, 0).to_marker() == {"actor_step_id": {"rollout_id": 120, "step_id": 0}}
    assert Anchor(5).to_marker() == {"rollout_id": 5}
    assert Anchor(120, 0, CRITIC).to_marker() == {"critic_step_id": {"rollout_id": 120, "step_id": 0}}
    for bad, says in (
        (5, "expected an object"),
        ({}, "exactly one"),
        ({"rollout_id": 1, "actor_step_id": {"rollout_id": 1, "step_id": 0}}, "exactly one"),
        ({"actor_step_id": "x"}, "actor_step_id must be an object"),
        ({"rollout_id": True}, "rollout_id must be a 64-bit integer"),
        ({"actor_step_id": {"rollout_id": 1, "step_id": 1 << 63}}, "actor_step_id.step_id"),
        ({"actor_step_id": {"rollout_id": 1, "step_id": 0}, "critic_step_id": {"rollout_id": 1, "step_id": 0}}, "one"),
        ({"critic_step_id": {"rollout_id": 1}}, "critic_step_id.step_id must be a 64-bit integer, got None"),
    ):
        with pytest.raises(ValueError, match=says):
            Anchor.from_marker(bad)


def test_identity_and_markers_carry_the_same_anchor(tmp_path):
    url = write_canonical(str(tmp_path / "store"))
    marker = read_marker(open_backend(str(tmp_path / "store")), complete_key("b-00001"), CompleteMarker)
    assert marker.anchor == Anchor.of(canonical_case(False).index.identity) == Anchor(120, 0)
    assert json.loads(open_backend(url.rsplit("/", 1)[0]).read(complete_key("b-00001")))["anchor"] == {
        "actor_step_id": {"rollout_id": 120, "step_id": 0}
    }  # the stored form is unchanged
    assert Identity(rollout_id=9).anchor() == "rollout 9"


def test_a_critic_identity_is_stored_with_its_own_field_and_an_actor_identity_as_before():
    actor = Identity(actor_step_id={"rollout_id": 3, "step_id": 1})
    critic = Identity(critic_step_id={"rollout_id": 3, "step_id": 1})
    assert "critic_step_id" not in actor.model_dump(mode="json")  # an actor's index is stored as it was
    assert critic.model_dump(mode="json")["critic_step_id"] == {"rollout_id": 3, "step_id": 1}
    assert Identity.model_validate(critic.model_dump(mode="json")) == critic
    assert (critic.level, critic.anchor(), Anchor.of(critic)) == ("step", "critic 3:1", Anchor(3, 1, CRITIC))
    with pytest.raises(ValueError, match="exactly one of actor_step_id, critic_step_id or rollout_id"):
        Identity(actor_step_id={"rollout_id": 3, "step_id": 1}, critic_step_id={"rollout_id": 3, "step_id": 1})


# ---- matching ------------------------------------------------------------------------------------


def _candidates() -> list[Candidate]:
    return [
        Candidate("s", "root/s", Anchor(120, 0)),
        Candidate("r", "root/r", Anchor(120)),
        Candidate("t", "root/t", Anchor(121, 0)),
    ]


def test_a_filter_matches_exactly_its_anchor():
    found = _candidates()
    assert [c.name for c in Selection("root", Anchor(120), found).chosen] == ["r"]
    assert [c.name for c in Selection("root", Anchor(120, 0), found).chosen] == ["s"]
    assert Selection("root", Anchor(120, 1), found).chosen == []
    assert [c.name for c in Selection("root", None, found).chosen] == ["s", "r", "t"]
    assert Selection("root", Anchor(121), found).chosen == []  # rollout 121 has only a step-level bundle


def test_one_bundle_or_a_selection_error():
    found = _candidates()
    assert Selection("root", Anchor(120), found).one().name == "r"
    with pytest.raises(SelectionError, match=r"root: no bundle matches --step 9:9 \(found: s \(step 120:0\), "):
        Selection("root", Anchor(9, 9), found).one()
    with pytest.raises(SelectionError, match="3 bundles match: .*choose one with --step"):
        Selection("root", None, found).one()
    with pytest.raises(SelectionError, match="bundle is step 120:0, which does not match --rollout 120"):
        Selection("root/s", Anchor(120), found[:1], direct=True).one()
    twins = [Candidate("a", "root/a", Anchor(1, 0)), Candidate("b", "root/b", Anchor(1, 0))]
    with pytest.raises(SelectionError, match="share an anchor.*e.g. root/a"):
        Selection("root", Anchor(1, 0), twins).one()


def test_several_covers_unreadable_bundles_as_asked():
    found = _candidates()
    unknown = Candidate("u", "root/u", None, detail="marker is not JSON")
    rollout = Candidate("v", "root/v", Anchor(120), detail="a rank marker disagrees")
    selection = Selection("root", Anchor(120), found, [unknown, rollout])
    chosen, skipped = selection.several(all_bundles=False)
    assert [c.name for c in chosen] == ["r"] and [c.name for c in skipped] == ["v"]
    chosen, skipped = Selection("root", None, found, [unknown]).several(all_bundles=True)
    assert [c.name for c in chosen] == ["s", "r", "t"] and [c.name for c in skipped] == ["u"]
    with pytest.raises(SelectionError, match="4 bundles .*; corrupt: u \\(marker is not JSON\\); choose with"):
        Selection("root", None, found, [unknown]).several(all_bundles=False)


# ---- bundle_status -------------------------------------------------------------------------------


def test_status_of_each_kind_of_bundle(tmp_path):
    root = str(tmp_path / "store")
    backend = open_backend(root)
    write_canonical(root)
    write_ranks(root, "partial", land=[1], expected_ranks=[0, 1])
    write_ranks(root, "landed", land=[0, 1], expected_ranks=[0, 1])
    backend.delete(complete_key("landed"))  # the last rank died after landing
    write_ranks(root, "disagrees", land=[0, 1], expected_ranks=[0, 1])
    backend.delete(complete_key("disagrees"))
    marker = json.loads(backend.read(rank_key("disagrees", 1)))
    backend.write(rank_key("disagrees", 1), compact_json({**marker, "anchor": {"rollout_id": 120}}))
    write_canonical(root, name="garbled")
    backend.write(complete_key("garbled"), b'{"bundle_id": ')

    states = {s.name: s for s in scan_bundles(backend)}
    assert {n: s.status for n, s in states.items()} == {
        "b-00001": COMPLETE_STATUS,
        "partial": INCOMPLETE,
        "landed": FINALIZABLE,
        "disagrees": CORRUPT,
        "garbled": CORRUPT,
    }
    assert states["b-00001"].anchor == Anchor(120, 0) and states["partial"].anchor == Anchor(120, 0)
    assert states["partial"].missing_ranks == [0] and states["partial"].expected_ranks == [0, 1]
    assert (
        describe_missing(backend, "partial", states["partial"])
        == "incomplete bundle: ranks [1] landed, missing ranks [0] of [0, 1]"
    )
    assert (
        "disagrees/COMPLETE.1: corrupt rank marker: anchor rollout 120 differs from step 120:0"
        in states["disagrees"].detail
    )
    assert not states["disagrees"].markers_unreadable and states["garbled"].markers_unreadable
    assert complete_key("garbled") in states["garbled"].detail and states["garbled"].anchor is None
    with pytest.raises(BundleError, match=complete_key("garbled")):
        describe_missing(backend, "garbled", states["garbled"])

    assert finalize(backend, states["partial"]) is states["partial"]  # nothing to do for other states
    done = finalize(backend, states["landed"])
    assert done.status == COMPLETE_STATUS and done.complete.multi_rank and backend.exists(complete_key("landed"))
    assert finalize(backend, states["disagrees"]).status == CORRUPT and not backend.exists(complete_key("disagrees"))


def test_no_marker_is_no_status_and_says_why(tmp_path):
    root = tmp_path / "store"
    write_canonical(str(root))
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("hello")
    backend = open_backend(str(root))
    assert bundle_status(backend, "notes") is None and bundle_status(backend, "absent") is None
    with pytest.raises(NoSuchTargetError, match="notes: not a bundle"):
        describe_missing(backend, "notes", None)
    with pytest.raises(NoSuchTargetError, match="absent: no such bundle"):
        describe_missing(backend, "absent", None)
    assert [s.name for s in scan_bundles(backend)] == ["b-00001"]  # neither is listed, nor objects/ or blobs/


def test_inspect_shows_unfinalizable_markers_as_damage(tmp_path):
    root = str(tmp_path / "store")
    write_ranks(root, "disagrees", land=[0, 1], expected_ranks=[0, 1])
    backend = open_backend(root)
    backend.delete(complete_key("disagrees"))
    marker = read_marker(backend, rank_key("disagrees", 1), RankMarker)
    backend.write(rank_key("disagrees", 1), compact_json({**marker.model_dump(mode="json"), "bundle_id": "other"}))
    result = runner.invoke(app, ["inspect", f"{root}/disagrees", "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["state"] == "finalizable" and "cannot be finalized" in doc["detail"]
    assert len(doc["problems"]) == 1 and "disagrees/COMPLETE.1: corrupt rank marker" in doc["problems"][0]
    assert doc["ranks"] == [0, 1] and doc["samples"] == 2 * len(canonical_case(False).index.samples)
    assert not backend.exists(complete_key("disagrees"))


# ---- every command picks the same bundle ----------------------------------------------------------


def _rollout_level(root: str, name: str) -> None:
    _anchored(root, name, rollout_id=120)


def _anchored(root: str, name: str, **anchor) -> None:
    """The canonical case as bundle `name` anchored by `anchor` (the identity's anchor fields) instead."""
    case = canonical_case(False)
    identity = Identity.model_validate({**case.index.identity.model_dump(exclude={"actor_step_id"}), **anchor})
    index = case.index.model_copy(update={"bundle_id": name, "identity": identity})
    BundleWriter(f"{root}/{name}", case.manifest.model_copy(update={"bundle_id": name}), index, case.expected).finalize(
        payloads=case.payloads
    )


def _picked(command: str, root: str, flags: list[str], tmp_path) -> str:
    if command == "cp":
        dest = str(tmp_path / f"copy-{len(os.listdir(tmp_path))}")
        result = runner.invoke(app, ["cp", root, dest, *flags, "--quiet", "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["bundles"][0]
    result = runner.invoke(app, [command, root, *flags, "--json"])
    assert result.exit_code in (0, 1) and "error" not in json.loads(result.stdout), result.output
    return json.loads(result.stdout)["bundle_id"]


def test_replay_inspect_validate_and_cp_pick_alike(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)  # b-00001: step 120:0
    _rollout_level(root, "r-120")  # rollout 120: same rollout, the other level
    for flags, expected in ((["--step", "120:0"], "b-00001"), (["--rollout", "120"], "r-120")):
        picked = {
            command: _picked(command, root, flags, tmp_path) for command in ("replay", "inspect", "validate", "cp")
        }
        assert set(picked.values()) == {expected}, picked
    for command in ("replay", "inspect", "validate", "cp"):
        args = [command, root, *(["dest"] if command == "cp" else []), "--step", "120:1"]
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and "matches --step 120:1" in result.stderr, result.output
    rows = json.loads(runner.invoke(app, ["ls", root, "--json"]).stdout)["bundles"]
    assert {r["name"]: (r["anchor"], r["rollout_id"], r["step_id"]) for r in rows} == {
        "b-00001": ("step 120:0", 120, 0),
        "r-120": ("rollout 120", 120, None),
    }


def test_the_actor_and_the_critic_of_one_step_are_picked_apart(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)  # b-00001: the actor's step 120:0
    _anchored(root, "c-120", critic_step_id={"rollout_id": 120, "step_id": 0})  # the critic's step 120:0
    _rollout_level(root, "r-120")
    marker = json.loads(open_backend(root).read(complete_key("c-120")))
    assert marker["anchor"] == {"critic_step_id": {"rollout_id": 120, "step_id": 0}}
    for flags, expected in (
        (["--step", "120:0"], "b-00001"),
        (["--critic", "120:0"], "c-120"),
        (["--rollout", "120"], "r-120"),
    ):
        picked = {
            command: _picked(command, root, flags, tmp_path) for command in ("replay", "inspect", "validate", "cp")
        }
        assert set(picked.values()) == {expected}, picked
    copied = runner.invoke(app, ["ls", str(tmp_path / "copy-2"), "--json"])  # the copy made with --critic
    assert [(r["name"], r["anchor"]) for r in json.loads(copied.stdout)["bundles"]] == [("c-120", "critic 120:0")]
    inspected = json.loads(runner.invoke(app, ["inspect", root, "--critic", "120:0", "--json"]).stdout)
    assert inspected["anchor"] == "critic 120:0"
    assert inspected["identity"]["critic_step_id"] == {"rollout_id": 120, "step_id": 0}
    rows = json.loads(runner.invoke(app, ["ls", root, "--json"]).stdout)["bundles"]
    assert {r["name"]: r["anchor"] for r in rows} == {
        "b-00001": "step 120:0",
        "c-120": "critic 120:0",
        "r-120": "rollout 120",
    }
    listed = runner.invoke(app, ["ls", root]).stdout
    assert any(line.split()[:2] == ["c-120", "critic"] for line in listed.splitlines()), listed
    scanned = scan_store(root, workers=1)
    assert {v.name: v.anchor for v in scanned.verdicts} == {
        "b-00001": "step 120:0",
        "c-120": "critic 120:0",
        "r-120": "rollout 120",
    }


@pytest.mark.parametrize("command", ["replay", "inspect", "validate", "cp", "diff", "conventions"])
def test_critic_selection_errors_name_what_is_there(tmp_path, command):
    root = str(tmp_path / "store")
    write_canonical(root)
    _anchored(root, "c-120", critic_step_id={"rollout_id": 120, "step_id": 0})
    extra = {"cp": [str(tmp_path / "dest")], "diff": [root]}.get(command, [])
    result = runner.invoke(app, [command, root, *extra, "--critic", "120:1"])
    assert result.exit_code == 1, result.output
    assert "no complete bundle matches --critic 120:1" in result.stderr or (
        "no bundle matches --critic 120:1 (found: b-00001 (step 120:0), c-120 (critic 120:0))" in result.stderr
    ), result.stderr
    both = runner.invoke(app, [command, root, *extra, "--step", "120:0", "--critic", "120:0"])
    assert both.exit_code == 2 and "mutually exclusive" in both.stderr, both.output
    assert "--critic" in both.stderr and "--step" in both.stderr
    if command in ("replay", "inspect", "validate"):  # a bundle named by its path is checked against the filter
        direct = runner.invoke(app, [command, f"{root}/c-120", "--step", "120:0"])
        assert direct.exit_code == 1, direct.output
        assert "bundle is critic 120:0, which does not match --step 120:0" in direct.stderr


def test_without_a_filter_the_critic_flag_is_offered(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    _anchored(root, "c-120", critic_step_id={"rollout_id": 120, "step_id": 0})
    result = runner.invoke(app, ["replay", root])
    assert result.exit_code == 1
    assert "choose one with --step ROLLOUT:STEP, --critic ROLLOUT:STEP or --rollout ROLLOUT" in result.stderr


def test_the_older_format_cannot_hold_a_critic_bundle(tmp_path):
    root = str(tmp_path / "store")
    _anchored(root, "c-120", critic_step_id={"rollout_id": 120, "step_id": 0})
    result = runner.invoke(app, ["export", f"{root}/c-120", str(tmp_path / "v1"), "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "the older format has no anchor for a critic's step (critic 120:0)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "v1").exists() or not any((tmp_path / "v1").iterdir())  # refused before writing
