"""`replay --html` and `diff --html`: one self-contained file, rendered in headless Chromium (a real browser
process): it draws its plots, logs nothing to the console, and its screenshot is not blank."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trajectory_replay.bundle import BundleWriter
from trajectory_replay.cli import app
from trajectory_replay.replay.fixtures import canonical_case

runner = CliRunner()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=8000"]


def _write(root: Path, buggy: bool) -> str:
    manifest, index, expected, payloads = canonical_case(buggy=buggy)
    path = root / ("buggy" if buggy else "clean")
    writer = BundleWriter(str(path), manifest, index, expected)
    for name, tensor in payloads.items():
        if name != "loss_mask":
            writer.write_payload(name, tensor)
    writer.finalize()
    return str(path)


def _render(page: Path, tmp: Path) -> tuple[str, str, Path]:
    """(the DOM after scripts ran, Chromium's log, a screenshot) of `page` opened from disk. The two browsers
    run side by side, each with a profile of its own."""
    assert CHROMIUM, "Debian's chromium is needed for this test (scripts/bootstrap.sh installs it with apt-get)"
    shot = tmp / f"{page.stem}.png"

    def browser(profile: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / profile}", *args, page.as_uri()],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

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


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("html")
    return _write(root, buggy=False), _write(root, buggy=True)


def test_replay_html_of_a_divergent_bundle_renders_its_plots(bundles, tmp_path):
    page = tmp_path / "replay.html"
    result = runner.invoke(app, ["replay", bundles[1], "--html", str(page), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["first_divergent_stage"] == "reward.post_process"
    text = page.read_text(encoding="utf-8")
    assert "<script src=" not in text and "first divergent stage: reward.post_process" in text
    assert "largest error per sample" in text and "the first divergent sample" in text
    dom, log, shot = _render(page, tmp_path)
    assert "CONSOLE" not in log, log
    # every figure drew: plotly leaves one js-plotly-plot element with an svg per figure
    assert dom.count('class="plot-container plotly"') == text.count('class="plotly-graph-div"') >= 3
    assert dom.count('class="main-svg"') >= 3
    assert shot.stat().st_size > 30_000   # a blank page is a few kilobytes


def test_diff_html_renders_its_chart(bundles, tmp_path):
    page = tmp_path / "diff.html"
    result = runner.invoke(app, ["diff", *bundles, "--html", str(page)])
    assert result.exit_code == 1 and "first difference at reward.post_process" in result.stdout
    dom, log, _ = _render(page, tmp_path)
    assert "CONSOLE" not in log, log
    assert "share of values that differ, per field" in page.read_text(encoding="utf-8")
    assert dom.count('class="plot-container plotly"') == 1


def test_a_clean_bundle_has_a_report_without_error_plots(bundles, tmp_path):
    page = tmp_path / "clean.html"
    assert runner.invoke(app, ["replay", bundles[0], "--html", str(page)]).exit_code == 0
    text = page.read_text(encoding="utf-8")
    assert "first divergent stage: none" in text and "largest error per sample" not in text
