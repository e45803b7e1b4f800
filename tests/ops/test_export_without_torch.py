"""`export` runs where torch cannot be imported (a real process boundary), and what it writes replays, loads
and imports back exactly as the native bundle does (checked here, with torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.cli.test_torch_free import CHILD
from tests.ops.conftest import renamed_case, write_ranks
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.legacy import LegacyBundle
from trajectory_replay.cli import app
from trajectory_replay.demo import run_demo

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()

EXTRA = {
    "scores_bf16": torch.linspace(-3, 3, 6).reshape(2, 3).to(torch.bfloat16),
    "flags": torch.tensor([True, False, True, True, False, False, True, False]),
    "ids": torch.arange(8, dtype=torch.int64).reshape(2, 4) * 1_000_000_007,
    "nothing": torch.empty(0, 3, dtype=torch.float16),
}
"""Payloads no stage reads, of other dtypes and shapes, carried through export as they are (not replayed: the
older format takes every payload for a flat per-token one)."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[str, Path, dict]]:
    """{bundle name: (native bundle, its export, the child's result)}: the demo's two bundles, one with extra
    payloads, and a two-rank bundle, exported without torch."""
    tmp = tmp_path_factory.mktemp("export")
    root = tmp / "store"
    run_demo(root)
    case = renamed_case("mixed")
    writer = BundleWriter(f"{root}/mixed", case.manifest, case.index, case.expected)
    for name, tensor in {**case.payloads, **EXTRA}.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    write_ranks(str(root), "cohort", land=[0, 1], expected_ranks=[0, 1])
    names = ["b-00001", "b-00065", "mixed", "cohort"]
    pairs = [(str(root / name), str(tmp / "v1" / name)) for name in names]
    commands = [["export", bundle, out, "--quiet"] for bundle, out in pairs]
    # one process where any import of torch fails runs every export
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(commands)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    *results, tail = [json.loads(line) for line in done.stdout.splitlines()]
    assert tail == {"torch_loaded": False}
    return {
        name: (bundle, Path(out), result) for name, (bundle, out), result in zip(names, pairs, results, strict=True)
    }


def _replay(path: str) -> tuple[int, str, list]:
    result = runner.invoke(app, ["replay", path, "--json"])
    report = json.loads(result.stdout)
    return (
        result.exit_code,
        report["first_divergent_stage"],
        [(s["stage"], s["rank"], s["status"], s["mismatch_count"], s["divergences"]) for s in report["stages"]],
    )


@pytest.mark.parametrize("name", ["b-00001", "b-00065", "cohort"])
def test_export_without_torch_replays_to_the_same_verdict(exported, name, tmp_path):
    bundle, out, result = exported[name]
    assert result["code"] == 0, result
    assert f"exported {name}" in result["output"] and (out / "COMPLETE").is_file()
    native = _replay(bundle)
    assert _replay(str(out)) == native
    assert native[1] == ("reward.post_process" if name == "b-00065" else None)
    imported = runner.invoke(app, ["import", str(out), str(tmp_path / "back")])
    assert imported.exit_code == 0, imported.output
    assert _replay(str(tmp_path / "back" / name)) == native


@pytest.mark.parametrize("name", ["mixed", "cohort"])
def test_exported_payloads_are_the_native_tensors(exported, name):
    bundle, out, result = exported[name]
    assert result["code"] == 0, result
    natives, olds = open_sources(bundle), open_sources(str(out))
    assert all(isinstance(s, LegacyBundle) for s in olds) and len(olds) == len(natives)
    for native, old in zip(natives, olds):
        assert old.rank == native.rank
        names = [n for n in native.manifest.payloads if n != "loss_mask"]
        assert sorted(old.manifest.payloads) == sorted(names)
        for payload in names:
            spec = native.spec(payload)
            file = old.path / "payloads" / f"{payload}.pt"
            loaded = torch.load(file, weights_only=True)  # as the older tool loads it
            want = native.load_payload(payload).reshape(spec.shape)
            assert loaded.dtype == want.dtype and loaded.shape == want.shape and loaded.is_contiguous()
            assert torch.equal(loaded, want), payload
            assert old.load_payload(payload).reshape(spec.shape).equal(want)  # through the V1 reader's checks
        assert [s.loss_mask for s in old.index.samples] == [s.loss_mask for s in native.full_index().samples]
        assert old.load_payload("loss_mask").equal(native.load_payload("loss_mask"))
    if name == "mixed":
        for payload, tensor in EXTRA.items():
            assert torch.equal(torch.load(out / "payloads" / f"{payload}.pt", weights_only=True), tensor)
