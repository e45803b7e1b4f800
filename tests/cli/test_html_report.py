"""`replay --html`, `diff --html` and `scan --html`: one self-contained file, rendered in headless Chromium (a
real browser process): it draws its plots, logs nothing to the console, and its screenshot is not blank. What the
page says first (the bundle, the first divergent stage's values), its index axes, and its size for a large bundle."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import (
    ActorStepId,
    BundleIndex,
    ComparisonPolicy,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageCapability,
    StageContract,
    StageId,
)
from trajectory_replay.cli import app
from trajectory_replay.html_report import PAGE_LIMIT, write_diff_html, write_replay_html, write_scan_html
from trajectory_replay.replay.fixtures import canonical_case
from trajectory_replay.replay.report import Divergence, ReplayReport, StageResult

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=8000",
]
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"


def _write(root: Path, buggy: bool) -> str:
    manifest, index, expected, payloads = canonical_case(buggy=buggy)
    path = root / ("buggy" if buggy else "clean")
    writer = BundleWriter(str(path), manifest, index, expected)
    for name, tensor in payloads.items():
        if name != "loss_mask":
            writer.write_payload(name, tensor)
    writer.finalize()
    return str(path)


def _write_large(path: Path, groups: int, tokens: int) -> str:
    """A bundle of `groups` prompt groups of 2 samples of `tokens` tokens each, whose rewards production
    normalized over the whole batch (the canonical bug, at scale): every sample and token diverges."""
    raw = [float(i % 7) for i in range(2 * groups)]
    mean = sum(raw) / len(raw)
    buggy = [r - mean for r in raw]
    samples = [
        SampleRecord(
            sample_id=f"sample-{i:05d}",
            group_index=i // 2,
            response_length=tokens,
            total_length=tokens + 1,
            loss_mask=[1] * tokens,
            raw_reward=raw[i],
            reward=buggy[i],
        )
        for i in range(2 * groups)
    ]
    stages = (StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE)
    index = BundleIndex(
        bundle_id="b-large",
        identity=Identity(actor_step_id=ActorStepId(rollout_id=7, step_id=3)),
        samples=samples,
        config=RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=2),
    )
    manifest = Manifest(
        bundle_id="b-large",
        stage_contracts={s: StageContract(stage=s, capability=StageCapability.RECOMPUTE) for s in stages},
        comparison_policy=ComparisonPolicy(exact_fields=["sample_id", "loss_mask", "group_index"]),
    )
    writer = BundleWriter(
        str(path), manifest, index, {"reward.raw": {"raw_rewards": raw}, "reward.post_process": {"rewards": buggy}}
    )
    writer.write_payload("advantages", torch.tensor(buggy).repeat_interleave(tokens))
    writer.finalize()
    return str(path)


def _render(page: Path, tmp: Path) -> tuple[str, str, Path]:
    """(the DOM after the page loaded, Chromium's log, a screenshot) of `page` opened from disk. The two
    browsers run side by side, each with a profile of its own."""
    assert CHROMIUM, "Debian's chromium is needed for this test (scripts/bootstrap.sh installs it with apt-get)"
    shot = tmp / f"{page.stem}.png"

    def browser(profile: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / profile}", *args, page.as_uri()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    dumper = browser("profile-dom", "--dump-dom")
    shooter = browser("profile-shot", "--window-size=1300,2200", f"--screenshot={shot}")
    try:
        dom, log = dumper.communicate(timeout=120)
        _, shot_log = shooter.communicate(timeout=120)
    finally:
        for proc in (dumper, shooter):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert shooter.returncode == 0, shot_log
    return dom, log, shot


def _self_contained(text: str) -> None:
    """No script and nothing fetched: no src or href attribute at all, no URL but the SVG namespace."""
    assert "<script" not in text and not re.search(r"\s(src|href)=", text)
    assert set(re.findall(r"https?://[^'\"\s<]+", text)) <= {"http://www.w3.org/2000/svg"}


def _index_ticks(text: str) -> list[str]:
    """The tick labels of every index axis on the page (token offsets, heatmap columns, bundle positions)."""
    return re.findall(r"<text class=['\"]index['\"][^>]*>([^<]*)</text>", text)


def _headings(text: str) -> list[str]:
    return re.findall(r"<h[123]>([^<]*)</h[123]>", text)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("html")
    return _write(root, buggy=False), _write(root, buggy=True)


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory) -> tuple[Path, str]:
    """The page of the buggy bundle `trajectory-replay demo` writes (b-00065), and the demo's directory."""
    root = tmp_path_factory.mktemp("demo")
    assert runner.invoke(app, ["demo", str(root / "demo")]).exit_code == 0
    page = root / "b-00065.html"
    result = runner.invoke(app, ["replay", str(root / "demo" / "b-00065"), "--html", str(page)])
    assert result.exit_code == 1 and f"wrote {page}" in result.stderr
    return page, str(root / "demo")


def test_the_demo_buggy_bundle_report_is_small_and_renders_with_integer_sample_ticks(demo_page, tmp_path):
    page, _ = demo_page
    text = page.read_text(encoding="utf-8")
    assert page.stat().st_size <= PAGE_LIMIT
    _self_contained(text)
    dom, log, shot = _render(page, tmp_path)
    assert "CONSOLE" not in log, log
    # every plot is drawn in the browser: the first divergent stage's values, its heatmap, and the later
    # advantage.estimate's heatmap and first divergent sample per token
    assert dom.count('<svg class="plot"') == text.count("<svg class='plot'") == 4
    assert "advantage.estimate: advantages of s-0, its first divergent sample, per token" in text
    ticks = _index_ticks(dom)
    assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks
    assert shot.stat().st_size > 30_000  # a blank page is a few kilobytes


def test_the_page_says_first_which_bundle_and_the_first_divergent_stage_values(demo_page):
    page, demo = demo_page
    text = page.read_text(encoding="utf-8")
    # identity: bundle, anchor, where it is stored, the recompute config
    assert "<code>b-00065</code>" in text and "step 120:0" in text and f"<code>{demo}/b-00065</code>" in text
    assert "<code>advantage_estimator</code></td><td><code>&quot;grpo&quot;</code>" in text
    headings = _headings(text)
    first = headings.index("first divergent stage: reward.post_process")
    assert first < headings.index("stages") < headings.index("failed: advantage.estimate")
    section = text[text.index("first divergent stage: reward.post_process</h2>") : text.index("<h2>stages</h2>")]
    # expected against actual per sample, with the sample ids: the table and the plot
    for sid, expected, actual in (
        ("s-0", "-5.5", "-1.0"),
        ("s-1", "-3.5", "1.0"),
        ("s-2", "3.5", "-1.0"),
        ("s-3", "5.5", "1.0"),
    ):
        assert (
            f"<td>reward</td><td>{sid}</td><td class='num'></td><td class='num'>{expected}</td>"
            f"<td class='num'>{actual}</td>"
        ) in section
        assert f"<title>{sid}: expected {float(expected):g}</title>" in section
        assert "<text class='label'" in section and f">{sid}</text>" in section
    assert "reward.post_process: reward, expected and actual per sample" in section
    assert "advantage.estimate" not in section  # no later stage's values stand in for the first one's


def test_a_config_field_replayed_with_another_value_is_marked(demo_page, tmp_path):
    page = tmp_path / "override.html"
    result = runner.invoke(
        app, ["replay", str(Path(demo_page[1]) / "b-00065"), "--set", "kl_coef=0.2", "--html", str(page)]
    )
    assert result.exit_code == 1, result.output
    text = page.read_text(encoding="utf-8")
    assert "<td class='changed'><code>kl_coef</code></td><td class='changed'><code>0.1 → 0.2</code></td>" in text
    assert "replayed with 1 field(s) changed" in text


def test_heatmaps_name_their_samples_with_a_readable_colour_bar(demo_page):
    text = demo_page[0].read_text(encoding="utf-8")
    heatmap = text[text.index("reward.post_process: reward, largest error per sample") :]
    heatmap = heatmap[: heatmap.index("</svg>")]
    height = int(re.search(r"<svg class='plot'[^>]* height='(\d+)'", heatmap).group(1))
    assert 80 <= height <= 200  # one row of 4 samples: neither a sliver nor a screenful
    for sid in ("s-0", "s-1", "s-2", "s-3"):
        assert f"<title>{sid}: 4.5</title>" in heatmap and f">{sid}</text>" in heatmap
    # the colour bar: the largest error at the top, whole decades below it, labels at least 16 px apart
    labels = re.findall(
        r"<line class='tick'[^>]*/><text x='[\d.]+' y='([\d.]+)'>([^<]+)</text>", heatmap[heatmap.index("|error|") :]
    )
    assert [text for _, text in labels] == ["4.5", "1e0"]
    ys = sorted(float(y) for y, _ in labels)
    assert all(b - a >= 16 for a, b in zip(ys, ys[1:]))


def test_a_large_bundle_page_stays_under_the_limit_and_says_what_it_left_out(tmp_path):
    bundle = _write_large(tmp_path / "large", groups=4096, tokens=512)
    page = tmp_path / "large.html"
    result = runner.invoke(app, ["replay", bundle, "--html", str(page), "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["first_divergent_stage"] == "reward.post_process"
    text = page.read_text(encoding="utf-8")
    assert page.stat().st_size <= PAGE_LIMIT
    _self_contained(text)
    # 8,192 samples on at most 2,048 cells: 4 per cell, said on the page
    assert "8192 samples in cohort order" in text and "each cell holds 4 consecutive samples" in text
    assert "<title>sample-00000 … sample-00003: " in text
    # the first divergent stage lists its first mismatches, with sample ids, and says how many there are
    assert "the first 10 of 8192 mismatches" in text and "<td>sample-00009</td>" in text
    ticks = _index_ticks(text)
    assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks


def test_per_rank_mismatch_sections_name_their_rank(tmp_path):
    metrics = {"tokens": 16, "kl_k3": 0.01, "worst_tokens": [{"sample_id": "s-1", "token": 3, "log_ratio": 0.4}]}
    report = ReplayReport(
        "b-ranks",
        stages=tuple(StageResult("rollout.mismatch", "pass", "measured", rank=r, metrics=metrics) for r in (0, 1)),
    )
    page = tmp_path / "ranks.html"
    write_replay_html(report, page)
    headings = _headings(page.read_text(encoding="utf-8"))
    assert "training–inference mismatch: rollout.mismatch (rank 0)" in headings
    assert "training–inference mismatch: rollout.mismatch (rank 1)" in headings


def test_a_page_of_very_many_failed_ranks_stays_under_the_limit_and_says_where_it_is_cut(tmp_path):
    ids = [f"s-{i}" for i in range(64)]
    evidence = {
        "advantages": {
            "sample_errors": dict.fromkeys(ids, 1.0),
            "first_sample": {
                "sample_id": "s-0",
                "expected": [1.0] * 64,
                "actual": [2.0] * 64,
                "divergent": list(range(64)),
            },
        }
    }
    divergences = tuple(Divergence("advantages", sid, 0, 1.0, 2.0, 1.0) for sid in ids[:10])
    report = ReplayReport(
        "b-many-ranks",
        stages=tuple(
            StageResult(
                stage,
                "fail",
                "advantages: 64 of 64 values differ",
                rank=r,
                max_abs_error=1.0,
                mismatch_count=64,
                divergences=divergences,
                evidence=evidence,
            )
            for r in range(512)
            for stage in ("advantage.estimate", "loss.policy")
        ),
    )
    page = tmp_path / "ranks.html"
    assert write_replay_html(report, page) == page.stat().st_size <= PAGE_LIMIT
    text = page.read_text(encoding="utf-8")
    assert text.endswith("</body></html>")
    assert "first divergent stage: advantage.estimate (rank 0)" in _headings(text)
    assert "1024 of 1024 stage entries not listed here" not in text and "624 of 1024 stage entries" in text
    assert "the rest of this report is left out: it would take this page past 1.5 MB" in text


def test_non_finite_values_are_drawn_as_such(tmp_path):
    nan, inf = float("nan"), float("inf")
    evidence = {
        "advantages": {
            "sample_errors": {"s-0": nan, "s-1": 0.5, "s-2": 0.0, "s-3": inf},
            "first_sample": {
                "sample_id": "s-0",
                "expected": [1.0, 1.0, 1.0],
                "actual": [1.0, nan, 2.0],
                "divergent": [1, 2],
            },
        }
    }
    report = ReplayReport(
        "b-nan",
        stages=(
            StageResult(
                "advantage.estimate",
                "fail",
                "advantages: 2 of 12 values differ",
                max_abs_error=nan,
                mismatch_count=2,
                divergences=(Divergence("advantages", "s-0", 1, 1.0, nan, nan),),
                evidence=evidence,
            ),
        ),
    )
    page = tmp_path / "nan.html"
    write_replay_html(report, page)
    text = page.read_text(encoding="utf-8")
    assert "<title>s-0: not finite</title>" in text and "<title>s-3: not finite</title>" in text
    assert "<title>s-2: 0</title>" in text and ">not finite</text>" in text  # the legend of the grey cells
    assert "<title>s-0 token 1: expected 1, actual not finite</title>" in text
    # no coordinate of a plot is NaN or infinite (the browser would drop the element)
    svgs = re.findall(r"<svg.*?</svg>", text)
    assert len(svgs) == 3 and not re.search(r"='[^']*(nan|inf)[^']*'", "".join(svgs))


def test_the_diff_page_lists_fields_in_stage_order_without_credentials(bundles, tmp_path):
    from trajectory_replay.bundle import open_bundle
    from trajectory_replay.bundle.schema import STAGE_ORDER
    from trajectory_replay.replay.diff import diff_bundles

    a, b = (open_bundle(p).readers() for p in bundles)
    report = diff_bundles(a, b, a_label=f"s3://AKIDEXAMPLE:{SECRET}@bucket/clean", b_label=bundles[1])
    page = tmp_path / "diff.html"
    write_diff_html(report, page)
    text = page.read_text(encoding="utf-8")
    assert SECRET not in text and "s3://bucket/clean" in text
    order = ["config"] + [s.value for s in STAGE_ORDER]
    stages = re.findall(r"<tr class='[a-z]*'><td>([^<]+)</td>", text)
    assert len(stages) == len(report.fields) and len(set(stages)) > 2
    assert stages == sorted(stages, key=order.index), stages


def test_diff_html_renders_its_chart(bundles, tmp_path):
    page = tmp_path / "diff.html"
    result = runner.invoke(app, ["diff", *bundles, "--html", str(page)])
    assert result.exit_code == 1 and "first difference at reward.post_process" in result.stdout
    text = page.read_text(encoding="utf-8")
    _self_contained(text)
    dom, log, _ = _render(page, tmp_path)
    assert "CONSOLE" not in log, log
    assert "share of values that differ, per field" in text
    assert dom.count('<svg class="plot"') == 1


def test_a_clean_bundle_has_a_report_without_error_plots(bundles, tmp_path):
    page = tmp_path / "clean.html"
    assert runner.invoke(app, ["replay", bundles[0], "--html", str(page)]).exit_code == 0
    text = page.read_text(encoding="utf-8")
    assert "first divergent stage: none" in text and "largest error per sample" not in text
    assert "<svg" not in text and "<code>b-00001</code>" in text


def test_a_scan_page_of_many_bundles_stays_under_the_limit_without_credentials(tmp_path):
    from trajectory_replay.ops.scan import ScanReport, Verdict

    verdicts = [
        Verdict(
            f"step-{i}",
            "diverged" if i % 97 == 5 else "pass",
            rollout_id=i,
            step_id=0,
            first_divergent_stage="reward.post_process" if i % 97 == 5 else None,
            detail="x" * 120,
        )
        for i in range(20_000)
    ]
    report = ScanReport(f"s3://AKIDEXAMPLE:{SECRET}@bucket/run-7", "local", 2, "1", {}, verdicts=verdicts)
    page = tmp_path / "scan.html"
    assert write_scan_html(report, page) == page.stat().st_size <= PAGE_LIMIT
    text = page.read_text(encoding="utf-8")
    assert SECRET not in text and "s3://bucket/run-7" in text
    assert "each column holds 20 consecutive bundles" in text
    # the table keeps every diverged bundle and says how many passing ones it left out
    assert all(f"<td>step-{i}</td>" in text for i in range(20_000) if i % 97 == 5)
    assert "of 20000 bundles not listed here" in text
    ticks = _index_ticks(text)
    assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks
