"""The training framework release that produced a step: recorded in the manifest's producer by the writer from a
config built with `RecomputeConfig.from_profile(..., framework_version=)`, and shown by `inspect`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from trajectory_replay.bundle import BundleReader, BundleWriter
from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.cli import app
from trajectory_replay.replay import canonical_case

runner = CliRunner()


def write(root: str, config: RecomputeConfig | None) -> str:
    case = canonical_case(buggy=False)
    index = case.index if config is None else case.index.model_copy(update={"config": config})
    url = f"{root}/{case.manifest.bundle_id}"
    writer = BundleWriter(url, case.manifest, index, case.expected)
    for name, tensor in case.payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    return url


def test_the_writer_records_the_framework_release_and_inspect_shows_it(tmp_path):
    config = RecomputeConfig.from_profile("verl", framework_version="0.9.1", kl_coef=0.001)
    assert config.framework_version == "0.9.1" and config.profile == "verl"
    url = write(str(tmp_path), config)
    manifest = BundleReader.open(url).manifest
    assert (manifest.producer.framework, manifest.producer.framework_version) == ("verl", "0.9.1")
    assert (manifest.conventions.profile, manifest.conventions.framework_version) == ("verl", "0.9.1")
    info = json.loads(runner.invoke(app, ["inspect", url, "--json"]).stdout)
    assert info["producer"]["framework"] == "verl" and info["producer"]["framework_version"] == "0.9.1"
    text = runner.invoke(app, ["inspect", url]).stdout
    producer = next(line for line in text.splitlines() if line.startswith("  producer "))
    assert "framework=verl, framework_version=0.9.1" in producer


def test_a_pinned_profile_records_its_own_modelled_version_beside_the_producing_release(tmp_path):
    config = RecomputeConfig.from_profile("verl-0.8", framework_version="0.8.3")
    manifest = BundleReader.open(write(str(tmp_path), config)).manifest
    assert manifest.conventions.framework_version == "0.8.0.dev (b178a3cd)"
    assert manifest.producer.framework_version == "0.8.3"


def test_a_bundle_without_a_framework_release_keeps_the_producer_it_always_had(tmp_path):
    for config in (None, RecomputeConfig.from_profile("verl")):  # no release given: nothing recorded
        url = write(str(tmp_path / str(config is None)), config)
        info = json.loads(runner.invoke(app, ["inspect", url, "--json"]).stdout)
        assert "framework" not in info["producer"] and "framework_version" not in info["producer"]
        assert set(info["producer"]) == {"commit", "dirty_patch_digest", "torch_version"}
