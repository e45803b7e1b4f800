"""The command line as a user runs it: verdicts, exit codes, resolution, older-format bundles, S3 URLs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.conftest import SHARED
from trajectory_replay.bundle.legacy import write_v1_bundle
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.replay import canonical_case
from trajectory_replay.store.digest import hash_bytes, object_key

runner = CliRunner()


def run(*args: str, env: dict | None = None):
    return runner.invoke(app, list(args), env=env)


def test_hand_built_example_runs_unchanged(tmp_path):
    script = SHARED / "examples" / "hand_built_bundle.py"
    if not script.exists():
        pytest.skip("the conformance scripts of ../shared are not present in this checkout")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    good = run("replay", str(tmp_path / "b-00001"))
    assert good.exit_code == 0, good.output
    assert good.stdout.startswith("bundle b-00001 — first divergent stage: none")
    bad = run("replay", str(tmp_path / "b-00065"), "--json")
    assert bad.exit_code == 1 and isinstance(bad.exception, SystemExit), bad.output
    report = json.loads(bad.stdout)
    assert report["first_divergent_stage"] == "reward.post_process"
    post = next(s for s in report["stages"] if s["stage"] == "reward.post_process")
    assert post["divergences"][0] == {
        "field": "reward",
        "sample_id": "s-0",
        "token_offset": None,
        "expected": -5.5,
        "actual": -1.0,
        "abs_error": 4.5,
    }


def test_demo(tmp_path):
    result = run("demo", str(tmp_path / "demo"))
    assert result.exit_code == 0, result.output
    assert "bundle b-00001 — first divergent stage: none" in result.stdout
    assert "bundle b-00065 — first divergent stage: reward.post_process" in result.stdout
    assert "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5" in result.stdout


def test_demo_default_directory_is_new(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("demo").exit_code == 0
    assert run("demo").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trajectory-replay-demo", "trajectory-replay-demo-2"]


def test_replay_json_shape_and_human_report(tmp_path):
    path = write_canonical(str(tmp_path / "store"), buggy=True, current_logprob=0.5)
    result = run("replay", path, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert set(report) == {
        "status",
        "bundle_id",
        "passed",
        "first_divergent_stage",
        "first_divergence",
        "reason",
        "compared",
        "config_overrides",
        "stages",
    }
    assert report["status"] == "diverged"
    assert report["passed"] is False and report["first_divergent_stage"] == "reward.post_process"
    for stage in report["stages"]:
        assert set(stage) == {
            "bundle",
            "stage",
            "rank",
            "status",
            "message",
            "compared",
            "max_abs_error",
            "mismatch_count",
            "divergences",
        }
    loss = next(s for s in report["stages"] if s["stage"] == "loss.policy")
    assert loss["status"] == "fail"
    pg = next(d for d in loss["divergences"] if d["field"] == "pg_loss")
    assert pg["expected"] == pytest.approx(4.038490, abs=1e-5) and pg["actual"] == pytest.approx(0.897442, abs=1e-5)
    text = run("replay", path).stdout.splitlines()
    assert text[0] == "bundle b-00065 — first divergent stage: reward.post_process"
    assert text[1].startswith("[   pass] sample")
    assert any(line.startswith("[   fail] reward.post_process") for line in text)


def test_selection_and_stage_flags(tmp_path):
    path = write_canonical(str(tmp_path / "store"), buggy=True)
    partial = json.loads(run("replay", path, "--sample", "s-2", "--json").stdout)
    loss = next(s for s in partial["stages"] if s["stage"] == "loss.policy")
    assert loss["status"] == "skipped" and "partial selection" in loss["message"]
    post = next(s for s in partial["stages"] if s["stage"] == "reward.post_process")
    assert [d["sample_id"] for d in post["divergences"]] == ["s-2", "s-3"]  # the whole group g-1
    assert run("replay", path, "--sample", "s-9").exit_code == 1
    assert run("replay", path, "--group", "g-7").exit_code == 1
    assert run("replay", path, "--batch", "mb-9999").exit_code == 1
    staged = json.loads(run("replay", path, "--stage", "advantage.estimate", "--json").stdout)
    assert [s["stage"] for s in staged["stages"]] == [
        "sample",
        "reward.raw",
        "reward.post_process",
        "advantage.estimate",
    ]
    assert staged["first_divergent_stage"] == "reward.post_process"  # the upstream bug is still named first
    loose = run("replay", path, "--stage", "reward.post_process", "--atol", "10")
    assert loose.exit_code == 0


def test_usage_errors_exit_2(tmp_path):
    path = write_canonical(str(tmp_path / "store"))
    assert run("replay", path, "--step", "1:0", "--rollout", "1").exit_code == 2
    assert run("replay", path, "--step", "nonsense").exit_code == 2
    assert run("replay", path, "--rollout", "x").exit_code == 2
    assert run("replay", path, "--no-such-flag").exit_code == 2
    assert run("replay", path, "--stage", "no.such.stage").exit_code == 2


def test_capture_directory_resolution(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)  # step 120:0
    case = canonical_case(False)
    from trajectory_replay.bundle import BundleWriter
    from trajectory_replay.bundle.schema import ActorStepId, Identity

    for name, identity in (
        ("step-121", Identity(actor_step_id=ActorStepId(rollout_id=121, step_id=3))),
        ("rollout-121", Identity(rollout_id=121)),
    ):
        index = case.index.model_copy(update={"bundle_id": name, "identity": identity})
        w = BundleWriter(f"{root}/{name}", case.manifest.model_copy(update={"bundle_id": name}), index, case.expected)
        for p, t in case.payloads.items():
            w.write_payload(p, t)
        w.finalize()
    several = run("replay", root)
    assert several.exit_code == 1
    assert "b-00001 (step 120:0)" in several.stderr and "choose one with --step" in several.stderr
    assert json.loads(run("replay", root, "--step", "121:3", "--json").stdout)["bundle_id"] == "step-121"
    assert json.loads(run("replay", root, "--rollout", "121", "--json").stdout)["bundle_id"] == "rollout-121"
    assert json.loads(run("replay", root, "--step", "120:0", "--json").stdout)["bundle_id"] == "b-00001"
    nothing = run("replay", root, "--step", "7:7")
    assert nothing.exit_code == 1 and "no bundle matches --step 7:7" in nothing.stderr
    assert run("replay", f"{root}/b-00001", "--rollout", "120").exit_code == 1  # a step-level bundle
    assert run("replay", str(tmp_path / "absent")).exit_code == 1


def _write_v1(path: Path, buggy: bool) -> Path:
    case = canonical_case(buggy=buggy)
    return write_v1_bundle(path, case.manifest, case.index, case.expected, case.payloads)


def test_v1_bundles_directly_and_imported_give_the_same_verdicts(tmp_path):
    v1_dir = tmp_path / "v1"
    _write_v1(v1_dir / "b-00065", buggy=True)
    _write_v1(v1_dir / "b-00001", buggy=False)
    assert run("inspect", str(v1_dir / "b-00065")).exit_code == 0
    assert run("validate", str(v1_dir / "b-00065")).exit_code == 0
    direct = json.loads(run("replay", str(v1_dir / "b-00065"), "--json").stdout)
    assert direct["first_divergent_stage"] == "reward.post_process"
    store = str(tmp_path / "store")
    imported = run("import", str(v1_dir), store)
    assert imported.exit_code == 0, imported.output
    assert "imported" in imported.stdout
    native = json.loads(run("replay", f"{store}/b-00065", "--json").stdout)

    def verdicts(report):
        return [(s["stage"], s["rank"], s["status"], s["mismatch_count"], s["divergences"]) for s in report["stages"]]

    assert native["first_divergent_stage"] == direct["first_divergent_stage"]
    assert verdicts(native) == verdicts(direct)
    assert run("replay", f"{store}/b-00001").exit_code == 0
    assert run("validate", f"{store}/b-00001").exit_code == 0
    # the same import again is a no-op; onto a different existing bundle it is refused
    assert run("import", str(v1_dir / "b-00065"), store).exit_code == 0
    clash = run("import", str(v1_dir / "b-00065"), store, "--as", "b-00001")
    assert clash.exit_code == 1 and "different content" in clash.stderr


def test_schema_command():
    result = run("schema")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert set(doc) == {"manifest", "index", "expected"}
    assert "stage_contracts" in doc["manifest"]["properties"]
    assert "reward.post_process" in doc["expected"]["properties"]


def test_inspect_incomplete_bundle(tmp_path):
    root = str(tmp_path / "store")
    case = canonical_case(False)
    from trajectory_replay.bundle import BundleWriter

    w = BundleWriter(
        f"{root}/mr",
        case.manifest.model_copy(update={"bundle_id": "mr"}),
        case.index.model_copy(update={"bundle_id": "mr"}),
        case.expected,
        rank=1,
        expected_ranks=[0, 1],
    )
    for p, t in case.payloads.items():
        w.write_payload(p, t)
    w.finalize()
    result = run("inspect", f"{root}/mr", "--json")
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    assert info["status"] == "incomplete" and "missing ranks [0]" in info["detail"]
    assert run("replay", f"{root}/mr").exit_code == 1
    assert run("validate", f"{root}/mr").exit_code == 1


def test_replay_by_s3_url(s3_server, s3_root, tmp_path, monkeypatch):
    """Endpoint and credentials from the AWS_* variables alone, as a user sets them: once through a real
    `python -m trajectory_replay` process, then in-process for the other commands."""
    url, options = s3_root
    write_canonical(url, buggy=True, storage_options=options)
    write_canonical(url, buggy=False, storage_options=options)
    env = {**s3_server.env(), "TRAJECTORY_REPLAY_CACHE_DIR": str(tmp_path / "cache")}
    bad = subprocess.run(
        [sys.executable, "-m", "trajectory_replay", "replay", f"{url}/b-00065", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert bad.returncode == 1, bad.stderr
    assert json.loads(bad.stdout)["first_divergent_stage"] == "reward.post_process"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    good = run("replay", url, "--step", "120:0")
    assert good.exit_code == 1 and "2 bundles match --step 120:0" in good.output  # both are step 120:0
    assert run("replay", f"{url}/b-00001").exit_code == 0
    for cmd in ("inspect", "validate"):
        out = run(cmd, f"{url}/b-00001")
        assert out.exit_code == 0, out.output


def test_errors_are_one_line_without_traceback(tmp_path):
    bad_dir = tmp_path / "v1bad"
    _write_v1(bad_dir, buggy=False)
    (bad_dir / "index.json").write_text("{not json")
    for cmd in ("replay", "inspect"):  # in this process: a real process's output is tests/ops/test_cli_ops.py's
        out = run(cmd, str(bad_dir))
        assert out.exception is None or isinstance(out.exception, SystemExit), repr(out.exception)
        assert "Traceback" not in out.stdout + out.stderr
        if cmd == "replay":
            assert out.exit_code == 1
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("trajectory-replay: error:") and "index.json" in lines[0]


def test_replay_one_rank_of_a_data_parallel_bundle(tmp_path):
    """`<bundle>/rank-<r>` of a bundle whose prompt groups straddle ranks: the rank's groups are completed from
    the other ranks, so a correct bundle passes, and its loss.policy is replayed for that rank."""
    from tests.replay.cases import split_ranks, twelve_case
    from trajectory_replay.bundle import BundleWriter

    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    name = shards[0].manifest.bundle_id
    for r, shard in enumerate(shards):
        BundleWriter(
            str(tmp_path / name), shard.manifest, shard.index, shard.expected, rank=r, expected_ranks=[0, 1]
        ).finalize(payloads=shard.payloads)
    result = run("replay", str(tmp_path / name / "rank-1"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["first_divergent_stage"] is None
    assert [(s["stage"], s["rank"]) for s in report["stages"]][-1] == ("loss.policy", 1)
    assert run("replay", str(tmp_path / name)).exit_code == 0
    result = run("replay", str(tmp_path / name / "rank-1"), "--sample", "q-0")
    assert result.exit_code == 1 and "no sample 'q-0'" in result.output


def test_the_demos_default_directories_are_git_ignored():
    repo = Path(__file__).resolve().parents[2]
    paths = [
        f"trajectory-replay-demo/{complete_key('b-00001')}",
        f"trajectory-replay-demo-2/{object_key(hash_bytes(b'x'))}",
    ]
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == paths, (out.returncode, out.stdout, out.stderr)
    kept = subprocess.run(
        ["git", "check-ignore", "--no-index", "trajectory_replay/demo.py"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert kept.returncode == 1  # the module of the same name is not
