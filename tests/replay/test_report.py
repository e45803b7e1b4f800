"""The report's JSON object (DESIGN.md shape, valid JSON with NaN) and its text rendering."""

import json
import math

from trajectory_replay.replay.report import Divergence, ReplayReport, StageResult, format_number, skipped


def _report() -> ReplayReport:
    nan_div = Divergence("kl", "s-1", 1, math.nan, -0.25, math.nan)
    return ReplayReport(
        "b-1",
        (
            StageResult("sample", "pass", "4 samples", max_abs_error=None),
            skipped("reward.raw", "inspect-only stage: not replayed"),
            StageResult(
                "advantage.kl",
                "fail",
                "kl: expected value is nan",
                max_abs_error=0.0,
                mismatch_count=1,
                divergences=(nan_div,),
            ),
            StageResult("loss.policy", "fail", "pg_loss differs", rank=1, max_abs_error=math.inf, mismatch_count=1),
        ),
    )


def test_json_has_the_design_shape_and_stays_valid_with_non_finite_values():
    data = json.loads(_report().to_json())
    assert data["bundle_id"] == "b-1" and data["passed"] is False
    assert data["first_divergent_stage"] == "advantage.kl"
    assert [s["stage"] for s in data["stages"]] == ["sample", "reward.raw", "advantage.kl", "loss.policy"]
    assert set(data["stages"][0]) == {
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
    assert data["stages"][1]["status"] == "skipped"
    assert data["stages"][2]["divergences"] == [
        {"field": "kl", "sample_id": "s-1", "token_offset": 1, "expected": "nan", "actual": -0.25, "abs_error": "nan"}
    ]
    assert data["stages"][3]["rank"] == 1 and data["stages"][3]["max_abs_error"] == "inf"


def test_skipped_stages_never_count_and_an_all_pass_report_passes():
    report = ReplayReport("b", (skipped("loss.policy", "partial"), StageResult("sample", "pass", "ok", compared=4)))
    assert report.passed and report.first_divergent_stage is None and report.exit_code == 0
    assert json.loads(report.to_json())["first_divergent_stage"] is None
    assert _report().exit_code == 1


def test_a_report_that_compared_no_value_is_unsupported_not_pass():
    nothing = ReplayReport("b", (skipped("loss.policy", "partial"), StageResult("sample", "pass", "ok")))
    assert nothing.status == "unsupported" and not nothing.passed and nothing.exit_code == 1
    assert "had no value to compare" in nothing.unsupported_reason
    assert ReplayReport("b", ()).unsupported_reason == "the bundle contracts no stage"
    asked = ReplayReport(
        "b",
        (skipped("loss.policy", "partial"), StageResult("sample", "pass", "ok", compared=4)),
        requested=("loss.policy",),
    )
    assert (
        asked.status == "unsupported"
        and asked.unsupported_reason == "stage loss.policy was asked for and skipped: partial"
    )
    assert _report().status == "diverged" and _report().unsupported_reason is None


def test_text_rendering():
    lines = _report().render_text().splitlines()
    assert lines[0] == "bundle b-1 — first divergent stage: advantage.kl"
    assert lines[1] == "[   pass] sample  4 samples, max_abs_error=n/a, mismatches=0"
    assert lines[2] == "[skipped] reward.raw  inspect-only stage: not replayed"
    assert lines[3] == "[   fail] advantage.kl  kl: expected value is nan, max_abs_error=0.0, mismatches=1"
    assert lines[4].strip() == "kl s-1 token 1: expected=nan actual=-0.25 abs_err=nan"
    assert lines[5] == "[   fail] loss.policy (rank 1)  pg_loss differs, max_abs_error=inf, mismatches=1"


def test_numbers_have_up_to_six_significant_digits():
    assert [format_number(v) for v in (-1.0, 4.5, 4.0384914, 1e-7, -5.5)] == ["-1.0", "4.5", "4.03849", "1e-07", "-5.5"]
