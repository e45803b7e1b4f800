"""Bundles written exactly as the older tool writes them (its markers, capture directories, rank-local sample ids,
declared capabilities), generated here, through the command line: replay, inspect, validate, ls, cp and import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.bundle_legacy.v1_cases import (
    edit_json,
    sha256,
    tool_case,
    update_rank_markers,
    write_capture,
    write_capture_multirank,
)
from trajectory_replay.bundle.legacy import capture_dir_name, open_v1, open_v1_bundle, v1_status
from trajectory_replay.bundle.schema import StageCapability, StageId
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError, UnsupportedError

runner = CliRunner()
DOCUMENTS = ("manifest.json", "index.json", "expected.json")


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def report_of(*args: str) -> tuple[int, dict]:
    result = run(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("trajectory-replay: error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def verdicts(report: dict) -> list[tuple[str, object, str]]:
    return [(s["stage"], s["rank"], s["status"]) for s in report["stages"]]


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """A capture directory of the older tool: a three-rank step bundle with rank-local sample ids, a
    single-producer step bundle and a rollout-level bundle."""
    root = tmp_path / "capture"
    write_capture_multirank(
        root,
        [
            tool_case(raw_rewards=[1, 3, 10, 12]),
            tool_case(raw_rewards=[5, 1, 2, 2], log_prob=0.1),
            tool_case(raw_rewards=[0, 4, 8, 0, 1, 1]),
        ],
    )
    write_capture(root, tool_case("b-00002", step=1))
    write_capture(root, tool_case("b-00003", level="rollout"))
    return root


# --------------------------------------------------------------------------- what the writers write


def test_single_producer_markers_are_shaped_as_the_older_tools(tmp_path: Path) -> None:
    bundle = write_capture(tmp_path, tool_case())
    assert bundle.name == "replay-120-0"
    metadata = {f: sha256((bundle / f).read_bytes()) for f in DOCUMENTS}
    complete = json.loads((bundle / "COMPLETE").read_text())
    assert complete == {"ranks": [0], "expected_ranks": [0], "metadata": metadata}  # no bundle id
    marker = json.loads((bundle / "COMPLETE.0").read_text())
    assert marker == {
        "actor_step_id": {"rollout_id": 120, "step_id": 0},
        "rollout_id": None,
        "expected_ranks": [0],
        "metadata": metadata,
        "payloads": {p.stem: sha256(p.read_bytes()) for p in (bundle / "payloads").iterdir()},
    }
    rollout = write_capture(tmp_path, tool_case(level="rollout"))
    assert rollout.name == "replay-rollout-120"
    marker = json.loads((rollout / "COMPLETE.0").read_text())
    assert marker["actor_step_id"] is None and marker["rollout_id"] == 120
    assert sorted(marker["payloads"]) == ["advantages", "kl", "old_log_probs", "ref_log_probs"]


def test_multi_rank_markers_are_shaped_as_the_older_tools(capture: Path) -> None:
    root = capture / "replay-120-0"
    assert sorted(p.name for p in root.iterdir()) == [
        "COMPLETE",
        "COMPLETE.0",
        "COMPLETE.1",
        "COMPLETE.2",
        "rank-0",
        "rank-1",
        "rank-2",
    ]
    parent = json.loads((root / "COMPLETE").read_text())
    assert set(parent) == {"ranks", "shards"} and parent["ranks"] == [0, 1, 2]
    for rank in range(3):
        shard = parent["shards"][str(rank)]
        assert set(shard) == {"actor_step_id", "rollout_id", "payloads", "metadata", "expected_ranks", "relpath"}
        assert shard == json.loads((root / f"COMPLETE.{rank}").read_text())
        assert shard["relpath"] == f"rank-{rank}" and shard["expected_ranks"] == [0, 1, 2]
        own = root / f"rank-{rank}"
        assert json.loads((own / "COMPLETE").read_text())["ranks"] == [rank]
        assert json.loads((own / f"COMPLETE.{rank}").read_text()) == {k: v for k, v in shard.items() if k != "relpath"}
    ids = [[r.sample_id for r in s.index.samples] for s in open_v1(root)]
    assert ids == [["s-0", "s-1", "s-2", "s-3"]] * 2 + [[f"s-{i}" for i in range(6)]]  # rank-local


def test_a_rank_marker_that_disagrees_with_its_bundle_is_refused(tmp_path: Path) -> None:
    bundle = write_capture(tmp_path, tool_case())
    update_rank_markers(bundle, lambda m: m.update(actor_step_id={"rollout_id": 120, "step_id": 7}))
    with pytest.raises(BundleError, match=r"replay-120-0/COMPLETE.0: anchor differs from replay-120-0/index.json"):
        open_v1_bundle(bundle)
    older = write_capture(tmp_path / "older", tool_case(), rank_marker=False)  # before markers were written
    assert not (older / "COMPLETE.0").exists() and open_v1_bundle(older).bundle_id == "b-00001"


def test_the_older_tools_format_2_is_refused_in_one_line(tmp_path: Path) -> None:
    bundle = write_capture(tmp_path, tool_case())
    edit_json(bundle, "manifest.json", lambda m: m.update(format_version="2.0.0"))
    with pytest.raises(UnsupportedError, match=r"format_version '2.0.0' is the older tool's format 2"):
        open_v1_bundle(bundle)
    result = run("replay", bundle)
    assert result.exit_code == 1 and "format_version '2.0.0'" in one_line_error(result)
    assert v1_status(bundle).status == "unsupported"
    listed = run("ls", tmp_path)
    assert "unsupported" in listed.stdout and "format_version '2.0.0'" in listed.stdout


# --------------------------------------------------------------------------- declared capabilities


def test_loss_value_declared_unsupported_is_skipped_and_the_bundle_passes(tmp_path: Path) -> None:
    bundle = write_capture(tmp_path, tool_case())
    result = run("validate", bundle)
    assert result.exit_code == 0 and "stage loss.value is declared unsupported by the bundle" in result.stdout
    result = run("replay", bundle)
    assert result.exit_code == 0, result.output
    assert "[skipped] loss.value  capability=unsupported" in result.stdout
    code, report = report_of("replay", bundle, "--sample", "s-0")
    assert code == 0 and report["status"] == "pass"
    asked = run("replay", bundle, "--stage", "loss.value")
    assert asked.exit_code == 1 and "stage loss.value is declared unsupported" in one_line_error(asked)


@pytest.mark.parametrize(
    "capability", [StageCapability.INSPECT_ONLY, StageCapability.RECORDED_ONLY, StageCapability.UNSUPPORTED]
)
def test_every_declared_capability_is_skipped_and_reported(tmp_path: Path, capability: StageCapability) -> None:
    case = tool_case(capabilities={StageId.REWARD_POST_PROCESS: capability, StageId.ADVANTAGE_KL: capability})
    case.payloads["kl"] = torch.full((8,), 3.0)  # not what the stage recomputes: it must not run
    code, report = report_of("replay", write_capture(tmp_path, case))
    assert code == 0 and report["status"] == "pass"
    stages = {s["stage"]: s for s in report["stages"]}
    for stage in ("reward.post_process", "advantage.kl"):
        assert stages[stage]["status"] == "skipped"
        assert stages[stage]["message"].startswith(f"capability={capability.value}")
    assert stages["advantage.estimate"]["status"] == "pass"  # checked against the recorded rewards


def test_an_unsupported_topology_still_fails_loudly(tmp_path: Path) -> None:
    case = tool_case()
    case.index.config.advantage_estimator = "ppo"
    result = run("replay", write_capture(tmp_path / "a", case))
    assert result.exit_code == 1 and "unsupported advantage_estimator 'ppo'" in one_line_error(result)
    case = tool_case()
    case.index.identity.rank.cp = 2
    result = run("replay", write_capture(tmp_path / "b", case))
    assert result.exit_code == 1 and "cp=2" in one_line_error(result)


# --------------------------------------------------------------------------- capture directories


def test_capture_directories_resolve_by_step_and_rollout(capture: Path) -> None:
    for flags, bundle_id in (
        (("--step", "120:0"), "replay-120-0"),
        (("--step", "120:1"), "b-00002"),
        (("--rollout", "120"), "b-00003"),
    ):
        code, report = report_of("replay", capture, *flags)
        assert code == 0 and report["bundle_id"] == bundle_id, report
        code, shown = report_of("inspect", capture, *flags)
        assert code == 0 and shown["bundle_id"] == bundle_id and shown["format"] == "v1"
        code, checked = report_of("validate", capture, *flags)
        assert code == 0 and checked["bundle_id"] == bundle_id and checked["valid"]
    nothing = run("replay", capture, "--step", "9:9")
    assert nothing.exit_code == 1 and "no bundle matches --step 9:9" in one_line_error(nothing)
    several = run("replay", capture)
    assert several.exit_code == 1 and "3 bundles match" in one_line_error(several)
    code, report = report_of("replay", capture / "replay-120-0" / "rank-1")
    assert code == 0 and {s["rank"] for s in report["stages"]} == {None}


def test_ls_lists_a_directory_of_older_bundles(capture: Path, tmp_path: Path) -> None:
    unfinished = tmp_path / "unfinished"
    write_capture_multirank(unfinished, [tool_case(), tool_case(raw_rewards=[2, 2, 4, 8])], land=[0])
    (capture / unfinished.name).symlink_to(unfinished / "replay-120-0", target_is_directory=True)
    code, listing = report_of("ls", capture)
    assert code == 0
    rows = {b["name"]: b for b in listing["bundles"]}
    assert {n: (b["anchor"], b["status"], b["ranks"], b["format"]) for n, b in rows.items()} == {
        "replay-120-0": ("step 120:0", "complete", [0, 1, 2], "v1"),
        "replay-120-1": ("step 120:1", "complete", [0], "v1"),
        "replay-rollout-120": ("rollout 120", "complete", [0], "v1"),
        "unfinished": ("step 120:0", "incomplete", [0], "v1"),
    }
    assert rows["unfinished"]["missing_ranks"] == [1]
    assert rows["replay-120-1"]["logical_bytes"] == sum(
        p.stat().st_size for p in (capture / "replay-120-1" / "payloads").iterdir()
    )
    text = run("ls", capture).stdout
    assert "corrupt" not in text and "replay-120-0 [v1]" in text
    write_capture_multirank(unfinished, [tool_case(), tool_case(raw_rewards=[2, 2, 4, 8])], land=[1])
    assert v1_status(capture / "unfinished").status == "complete"
    (unfinished / "replay-120-0" / "COMPLETE").unlink()
    assert v1_status(capture / "unfinished").status == "finalizable"
    code, one = report_of("ls", capture / "replay-120-1")
    assert [b["name"] for b in one["bundles"]] == ["replay-120-1"]


def test_cp_and_import_resolve_and_convert_like_replay(capture: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    copied = run("cp", capture, store, "--step", "120:0")
    assert copied.exit_code == 0 and "converted 1 older-format bundle(s) replay-120-0" in copied.stdout
    imported = run("import", capture, store, "--rollout", "120")
    assert imported.exit_code == 0 and imported.stdout.strip() == f"imported {store}/b-00003"
    assert run("cp", capture, store, "--step", "120:1").exit_code == 0
    code, listing = report_of("ls", store)
    assert {b["name"]: (b["anchor"], b["status"], b["format"]) for b in listing["bundles"]} == {
        "replay-120-0": ("step 120:0", "complete", "native"),
        "b-00002": ("step 120:1", "complete", "native"),
        "b-00003": ("rollout 120", "complete", "native"),
    }
    for flags in (("--step", "120:0"), ("--step", "120:1"), ("--rollout", "120")):
        direct, imported_report = report_of("replay", capture, *flags), report_of("replay", store, *flags)
        assert direct[0] == imported_report[0] == 0
        assert verdicts(direct[1]) == verdicts(imported_report[1])
    again = run("cp", capture, tmp_path / "all", "--all")
    assert again.exit_code == 0 and "converted 3 older-format bundle(s)" in again.stdout
    with_none = run("cp", capture, tmp_path / "none", "--rollout", "7")
    assert with_none.exit_code == 1 and "no bundle matches --rollout 7" in one_line_error(with_none)


# --------------------------------------------------------------------------- rank-local sample ids


def test_every_rank_of_a_rank_local_capture_is_replayed_and_reported(capture: Path) -> None:
    code, report = report_of("replay", capture, "--step", "120:0")
    assert code == 0, report
    assert {(s["stage"], s["rank"]) for s in report["stages"]} == {
        (stage, rank)
        for stage in (
            "sample",
            "reward.raw",
            "reward.post_process",
            "advantage.kl",
            "advantage.estimate",
            "loss.policy",
            "loss.value",
        )
        for rank in (0, 1, 2)
    }


@pytest.mark.parametrize("level", ["step", "loss"])
def test_a_fault_in_rank_2_fails_the_replay_directly_and_after_import(tmp_path: Path, level: str) -> None:
    cases = [
        tool_case(raw_rewards=[1, 3, 10, 12], level=level),
        tool_case(raw_rewards=[5, 1, 2, 2], log_prob=0.1, level=level),
        tool_case(raw_rewards=[0, 4, 8, 0], log_prob=-0.2, level=level),
    ]
    cases[2].expected["loss.policy"]["pg_loss"] += 0.5  # what rank 2 reported is not what its data gives
    capture = tmp_path / "capture"
    write_capture_multirank(capture, cases)
    code, report = report_of("replay", capture, "--step", "120:0")
    assert code == 1 and report["status"] == "diverged" and report["first_divergent_stage"] == "loss.policy"
    failed = [(s["stage"], s["rank"]) for s in report["stages"] if s["status"] == "fail"]
    assert failed == [("loss.policy", 2)]
    if level == "loss":  # the older tool's loss-only capture: every sample of every rank in group 0
        assert {r.group_index for s in open_v1(capture / "replay-120-0") for r in s.index.samples} == {0}
    store = tmp_path / "store"
    assert run("import", capture, store).exit_code == 0
    code, imported = report_of("replay", store / "replay-120-0")
    assert code == 1 and verdicts(imported) == verdicts(report)
    alone = run("replay", capture / "replay-120-0" / "rank-2")
    assert alone.exit_code == 1 and "loss.policy" in alone.stdout


def test_ranks_with_identical_content_are_replicas_reported_per_rank(tmp_path: Path) -> None:
    root = write_capture_multirank(tmp_path, [tool_case(), tool_case()])
    code, report = report_of("replay", root)
    assert code == 0
    assert [(s["stage"], s["rank"]) for s in report["stages"]] == [
        ("sample", None),
        ("reward.raw", None),
        ("reward.post_process", None),
        ("advantage.kl", None),
        ("advantage.estimate", None),
        ("loss.policy", 0),
        ("loss.policy", 1),
        ("loss.value", None),
    ]
    assert report["stages"][6]["message"].endswith("(data identical to rank 0)")


def test_capture_dir_name_follows_the_identity() -> None:
    assert capture_dir_name(tool_case(step=3, rollout_id=7).index) == "replay-7-3"
    assert capture_dir_name(tool_case(level="rollout", rollout_id=7).index) == "replay-rollout-7"


def test_a_capture_directory_converts_into_s3_and_replays_there(capture: Path, s3_env, s3_root) -> None:
    url, _ = s3_root
    assert run("cp", capture, url, "--step", "120:0").exit_code == 0
    assert run("import", capture, url, "--rollout", "120").exit_code == 0
    code, listing = report_of("ls", url)
    assert code == 0 and sorted(b["name"] for b in listing["bundles"]) == ["b-00003", "replay-120-0"]
    direct, remote = report_of("replay", capture, "--step", "120:0"), report_of("replay", url, "--step", "120:0")
    assert direct[0] == remote[0] == 0 and verdicts(direct[1]) == verdicts(remote[1])
    assert {s["rank"] for s in remote[1]["stages"]} == {0, 1, 2}
