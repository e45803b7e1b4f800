"""ls (statuses, sizes, JSON), stats (dedup ratio), export -> import (same verdicts), on local disk and S3."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from tests.ops.conftest import renamed_case, validates, write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.markers import complete_key
from trajectory_replay.cli import app
from trajectory_replay.errors import BundleError
from trajectory_replay.ops.export import export_bundle
from trajectory_replay.ops.importer import import_v1
from trajectory_replay.ops.ls import list_bundles
from trajectory_replay.ops.stats import store_stats
from trajectory_replay.replay import replay

runner = CliRunner()


def _verdicts(report: dict) -> list:
    return [(s["stage"], s["rank"], s["status"], s["mismatch_count"], s["divergences"]) for s in report["stages"]]


def test_ls_statuses_sizes_and_age(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root)
    write_ranks(root, "partial", land=[0, 2], expected_ranks=[0, 1, 2])
    write_ranks(root, "lastdied", land=[0, 1], expected_ranks=[0, 1])
    open_backend(root).delete(complete_key("lastdied"))
    report = list_bundles(root)
    by_name = {b.name: b for b in report.bundles}
    assert [b.name for b in report.bundles] == ["b-00001", "lastdied", "partial"]
    assert by_name["b-00001"].status == "complete" and by_name["b-00001"].anchor == "step 120:0"
    assert by_name["partial"].status == "incomplete" and by_name["partial"].missing_ranks == [1]
    assert by_name["partial"].ranks == [0, 2]
    # every rank of lastdied landed: ls finalizes it, as any reader does
    assert by_name["lastdied"].status == "complete" and by_name["lastdied"].ranks == [0, 1]
    assert report.finalized == ["lastdied"] and open_backend(root).exists(complete_key("lastdied"))
    one = by_name["b-00001"]
    assert one.logical_bytes == sum(s.size for s in open_sources(f"{root}/b-00001")[0].manifest.payloads.values())
    assert one.stored_bytes > 0 and 0 <= one.age_seconds < 60
    assert by_name["lastdied"].logical_bytes == 2 * one.logical_bytes
    text = report.render_text()
    assert "incomplete (missing ranks [1])" in text and "lastdied: finalized" in text
    cli = runner.invoke(app, ["ls", root, "--json"])
    assert cli.exit_code == 0, cli.output
    doc = json.loads(cli.stdout)
    assert doc["status"] == "pass" and {r["name"]: r["status"] for r in doc["bundles"]} == {
        "b-00001": "complete",
        "lastdied": "complete",
        "partial": "incomplete",
    }


def _random_capture(root: str, name: str, **options) -> None:
    """The canonical case with every payload replaced by distinct random values (seeded: identical per call)."""
    case = renamed_case(name)
    writer = BundleWriter(f"{root}/{name}", case.manifest, case.index, case.expected, **options)
    gen = torch.Generator().manual_seed(0)
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, torch.rand(tensor.shape, generator=gen).to(tensor.dtype))
    writer.write_payload("big", torch.rand(50000, generator=gen))
    writer.finalize()


def test_stats_two_identical_captures_dedup_two(tmp_path):
    root = str(tmp_path / "store")
    _random_capture(root, "first")
    _random_capture(root, "second")
    stats = store_stats(root)
    assert stats.bundles == 2 and stats.objects > 0
    assert stats.logical_bytes == 2 * stats.stored_bytes
    assert stats.dedup_ratio == pytest.approx(2.0, abs=0.01)
    assert set(stats.kinds) >= {"advantages", "loss_mask"}
    assert all(k.payloads == 2 and k.dedup_ratio == pytest.approx(2.0, abs=0.01) for k in stats.kinds.values())


def test_export_then_import_keeps_verdicts(tmp_path):
    root = str(tmp_path / "store")
    write_canonical(root, buggy=True)
    write_ranks(root, "cohort", land=[0, 1], expected_ranks=[0, 1])
    for name in ("b-00065", "cohort"):
        out = tmp_path / "v1" / name
        report = export_bundle(f"{root}/{name}", out)
        assert report.payloads > 0 and (out / "COMPLETE").is_file()
        assert validates(str(out))  # the V1 directory itself
        back = str(tmp_path / "back")
        assert import_v1(out, back) == [f"{back}/{name}"]
        original = replay(open_sources(f"{root}/{name}")).to_dict()
        v1 = replay(open_sources(str(out))).to_dict()
        imported = replay(open_sources(f"{back}/{name}")).to_dict()
        assert _verdicts(original) == _verdicts(v1) == _verdicts(imported)
        assert original["first_divergent_stage"] == imported["first_divergent_stage"]
        full = open_sources(f"{root}/{name}")[0].full_index()
        assert [s.loss_mask for s in open_sources(f"{back}/{name}")[0].full_index().samples] == [
            s.loss_mask for s in full.samples
        ]
    assert replay(open_sources(f"{root}/b-00065")).to_dict()["first_divergent_stage"] == "reward.post_process"
    with pytest.raises(BundleError, match="not an empty directory"):
        export_bundle(f"{root}/b-00065", tmp_path / "v1" / "b-00065")


def test_every_command_on_s3_through_the_cli(tmp_path, s3_root, s3_env, monkeypatch):
    url, options = s3_root
    monkeypatch.setenv("TRAJECTORY_REPLAY_CACHE_DIR", str(tmp_path / "cache"))
    _random_capture(url, "first", **options)
    _random_capture(url, "second", **options)
    write_ranks(url, "partial", land=[1], expected_ranks=[0, 1], **options)
    ls = runner.invoke(app, ["ls", url, "--json"])
    assert ls.exit_code == 0, ls.output
    assert {r["name"]: r["status"] for r in json.loads(ls.stdout)["bundles"]} == {
        "first": "complete",
        "second": "complete",
        "partial": "incomplete",
    }
    stats = runner.invoke(app, ["stats", url, "--json"])
    assert stats.exit_code == 0, stats.output
    doc = json.loads(stats.stdout)
    assert doc["dedup_ratio"] == pytest.approx(2.0, abs=0.01) and doc["logical_bytes"] == 2 * doc["stored_bytes"]
    fsck = runner.invoke(app, ["fsck", url, "--json"])
    assert fsck.exit_code == 0, fsck.output
    assert json.loads(fsck.stdout)["incomplete"][0]["name"] == "partial"
    gc = runner.invoke(app, ["gc", url, "--grace", "0s", "--json"])
    assert gc.exit_code == 0, gc.output
    assert json.loads(gc.stdout)["abandoned_bundles"] == ["partial"]
    local = str(tmp_path / "local")
    cp = runner.invoke(app, ["cp", url, local, "--all", "--quiet"])
    assert cp.exit_code == 0, cp.output
    assert "copied 2 bundle(s)" in cp.stdout and cp.stderr == ""
    out = tmp_path / "v1"
    export = runner.invoke(app, ["export", f"{url}/first", str(out)])
    assert export.exit_code == 0, export.output
    imported = runner.invoke(app, ["import", str(out), str(tmp_path / "again")])
    assert imported.exit_code == 0, imported.output
    assert open_sources(f"{local}/first")[0].load_payload("big").numel() == 50000
    assert (
        replay(open_sources(str(tmp_path / "again" / "first"))).to_dict()
        == replay(open_sources(f"{local}/first")).to_dict()
    )
