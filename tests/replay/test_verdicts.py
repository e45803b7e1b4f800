"""A replay that compared no value is never `pass`: it is `unsupported` (exit 1) and says why; a divergence is
`diverged`; only compared values that all match are `pass`. Checked through the Python API and the CLI, for native
bundles, older-format bundles, selections, conventions and scan."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.bundle_legacy.v1_cases import tool_case
from tests.replay.conftest import source_of
from trajectory_replay.bundle.schema import StageCapability, StageContract, StageId
from trajectory_replay.cli import app
from trajectory_replay.replay import canonical_case, replay

runner = CliRunner()


def _all_unsupported(case):
    """`case` with every contracted stage declared unsupported, as a capture of an algorithm replay lacks does."""
    manifest = case.manifest
    contracts = {
        stage: StageContract(stage=stage, version=c.version, capability=StageCapability.UNSUPPORTED)
        for stage, c in manifest.stage_contracts.items()
    }
    return manifest.model_copy(update={"stage_contracts": contracts})


def test_a_bundle_whose_every_stage_is_unsupported_is_not_a_pass():
    case = canonical_case(False)
    report = replay([source_of(case._replace(manifest=_all_unsupported(case)))])
    assert report.status == "unsupported" and not report.passed and report.exit_code == 1
    assert report.first_divergent_stage is None and report.compared == 0
    assert "every stage was skipped: capability=unsupported" in report.unsupported_reason
    assert report.to_dict()["reason"] == report.unsupported_reason
    assert (
        report.render_text()
        .splitlines()[0]
        .startswith(f"bundle {case.index.bundle_id} — unsupported: nothing compared (every stage was skipped")
    )


def test_a_clean_replay_counts_what_it_compared():
    report = replay([source_of(canonical_case(False))])
    assert report.status == "pass" and report.passed and report.compared > 0
    assert report.to_dict()["reason"] is None


def test_an_older_format_capture_of_an_unsupported_algorithm_exits_1_with_the_reason(tmp_path):
    """The older tool declares every stage unsupported in a capture of an algorithm it cannot replay (ppo)."""
    case = tool_case(capabilities={s: StageCapability.UNSUPPORTED for s in StageId})
    case.index = case.index.model_copy(
        update={"config": case.index.config.model_copy(update={"advantage_estimator": "ppo"})}
    )
    bundle = case.write(tmp_path / "replay-120-0")
    result = runner.invoke(app, ["replay", str(bundle), "--json"])
    assert result.exit_code == 1, result.stdout
    doc = json.loads(result.stdout)
    assert doc["status"] == "unsupported" and doc["passed"] is False and doc["first_divergent_stage"] is None
    assert "every stage was skipped" in doc["reason"] and doc["error"] == doc["reason"]
    assert all(s["status"] == "skipped" for s in doc["stages"])
    text = runner.invoke(app, ["replay", str(bundle)])
    assert text.exit_code == 1 and "unsupported: nothing compared" in text.stdout
    assert "first divergent stage: none" not in text.stdout
    assert text.stderr.strip().startswith("trajectory-replay: error: every stage was skipped")
    page = tmp_path / "report.html"
    html = runner.invoke(app, ["replay", str(bundle), "--html", str(page)])
    assert html.exit_code == 1 and "unsupported: nothing compared (every stage was skipped" in page.read_text()


def test_a_stage_asked_for_by_name_and_skipped_says_so(tmp_path):
    """loss.policy is cohort-level: a selection of one group skips it, so `--stage loss.policy` checked nothing it
    was asked for, even though the stages it depends on compared values."""
    bundle = write_canonical(str(tmp_path))
    result = runner.invoke(app, ["replay", bundle, "--stage", "loss.policy", "--group", "g-0", "--json"])
    assert result.exit_code == 1, result.stdout
    doc = json.loads(result.stdout)
    assert doc["status"] == "unsupported" and doc["compared"] > 0
    assert doc["reason"].startswith("stage loss.policy was asked for and skipped: cohort-level stage")
    whole = runner.invoke(app, ["replay", bundle, "--stage", "loss.policy", "--json"])
    assert whole.exit_code == 0 and json.loads(whole.stdout)["status"] == "pass"


def test_a_selection_that_skips_only_unnamed_stages_still_passes(tmp_path):
    bundle = write_canonical(str(tmp_path))
    result = runner.invoke(app, ["replay", bundle, "--group", "g-0", "--json"])
    assert result.exit_code == 0, result.stdout
    assert json.loads(result.stdout)["status"] == "pass"


def test_conventions_of_a_bundle_with_nothing_to_compare_is_unsupported(tmp_path):
    case = tool_case(capabilities={s: StageCapability.UNSUPPORTED for s in StageId})
    bundle = case.write(tmp_path / "replay-120-0")
    result = runner.invoke(app, ["conventions", str(bundle), "--json"])
    assert result.exit_code == 1, result.stdout
    doc = json.loads(result.stdout)
    assert doc["status"] == "unsupported" and doc["best"] is None and "every stage was skipped" in doc["reason"]
    text = runner.invoke(app, ["conventions", str(bundle)])
    assert text.exit_code == 1 and "unsupported: nothing compared" in text.stdout


def test_scan_counts_a_bundle_with_nothing_compared_as_unsupported(tmp_path):
    root = tmp_path / "store"
    write_canonical(str(root), name="clean")
    case = canonical_case(False)
    from trajectory_replay.bundle import BundleWriter

    writer = BundleWriter(
        f"{root}/unchecked",
        _all_unsupported(case).model_copy(update={"bundle_id": "unchecked"}),
        case.index.model_copy(update={"bundle_id": "unchecked"}),
        case.expected,
    )
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    result = runner.invoke(app, ["scan", str(root), "--workers", "1", "--json"])
    assert result.exit_code == 1, result.stdout
    doc = json.loads(result.stdout)
    assert doc["status"] == "unsupported"
    assert doc["counts"]["unsupported"] == 1 and doc["counts"]["pass"] == 1
    verdicts = {v["name"]: v for v in doc["verdicts"]}
    assert verdicts["clean"]["status"] == "pass" and verdicts["unchecked"]["status"] == "unsupported"
    assert "every stage was skipped" in verdicts["unchecked"]["detail"]
