"""`replay --set` and `trajectory-replay conventions` as a user runs them, on bundles written to disk."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.replay.reference64 import algorithm_case
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import BundleIndex, RecomputeConfig
from trajectory_replay.cli import app

runner = CliRunner()
BASE = {"advantage_estimator": "grpo", "grpo_std_normalization": True, "kl_coef": 0.05, "entropy_coef": 0.01}


def run(*args: str):
    return runner.invoke(app, list(args))


def write(root: Path, case, config: dict | RecomputeConfig | None = None) -> str:
    """Write `case` as a native bundle, its index recording `config` (default: the case's own)."""
    manifest, index, expected, payloads = case
    if isinstance(config, dict):
        config = RecomputeConfig.model_validate({"n_samples_per_prompt": index.config.n_samples_per_prompt, **config})
    if config is not None:
        index = BundleIndex.model_validate({**index.model_dump(), "config": config.model_dump()})
        index.config = config
    index = index.model_copy(
        update={"samples": [s.model_copy(update={"loss_mask": list(s.loss_mask)}) for s in index.samples]}
    )
    writer = BundleWriter(str(root / manifest.bundle_id), manifest, index, expected)
    for name, tensor in payloads.items():
        writer.write_payload(name, tensor)
    writer.finalize()
    return str(root / manifest.bundle_id)


def test_replay_set_overrides_a_field_and_says_so(tmp_path):
    bundle = write(tmp_path, algorithm_case({**BASE, "std_eps": 1e-4}, seed=2), BASE)
    assert run("replay", bundle).exit_code == 1
    fixed = run("replay", bundle, "--set", "std_eps=1e-4", "--json")
    assert fixed.exit_code == 0, fixed.output
    report = json.loads(fixed.stdout)
    assert report["config_overrides"] == {"std_eps": 0.0001} and report["passed"]
    text = run("replay", bundle, "--set", "std_eps=1e-4")
    assert "config overridden (not as recorded): std_eps=0.0001" in text.stdout


def test_replay_set_mistakes_are_one_line_usage_errors(tmp_path):
    bundle = write(tmp_path, algorithm_case(BASE, seed=2))
    for flag, message in (
        ("std_eps", "expected FIELD=VALUE"),
        ("nope=1", "unknown config field 'nope'"),
        ("std_eps=abc", "config field std_eps"),
    ):
        result = run("replay", bundle, "--set", flag)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
    unsupported = run("replay", bundle, "--set", "loss_agg_mode=median", "--json")
    assert unsupported.exit_code == 1
    assert json.loads(unsupported.stdout)["status"] == "unsupported"


def test_conventions_names_the_profile_and_the_manifest_records_it(tmp_path):
    verl = RecomputeConfig.from_profile("verl", kl_coef=0.05, entropy_coef=0.01, n_samples_per_prompt=4)
    recorded = write(tmp_path / "a", algorithm_case(verl.model_dump(), seed=7), verl)
    manifest = json.loads(run("inspect", recorded, "--json").stdout)
    assert "verl" in json.dumps(manifest)
    assert run("replay", recorded).exit_code == 0
    unrecorded = write(
        tmp_path / "b",
        algorithm_case(verl.model_dump(), seed=7, singleton=True),
        {**BASE, "n_samples_per_prompt": 4, "group_size_check": "any"},
    )
    result = run("conventions", unrecorded)
    assert result.exit_code == 0, result.output
    assert "every stage reproduced by: profile verl" in result.stdout
    as_json = json.loads(run("conventions", unrecorded, "--json").stdout)
    assert as_json["status"] == "pass" and as_json["best"] == "profile verl"


def test_conventions_exits_1_when_no_convention_explains_the_divergence(tmp_path):
    case = algorithm_case(BASE, seed=4)
    case.expected["reward.post_process"]["rewards"][0] += 1.0
    result = run("conventions", write(tmp_path, case), "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["status"] == "diverged" and report["best"] is None
    assert report["reproduced_by"]["reward.post_process"] == []


def test_conventions_of_a_bundle_replay_refuses_is_that_refusal(tmp_path):
    bundle = write(tmp_path, algorithm_case(BASE, seed=4), {**BASE, "policy_loss": "dpo"})
    result = run("conventions", bundle, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["status"] == "unsupported" and "unsupported policy_loss 'dpo'" in report["error"]


def test_replay_set_and_conventions_speak_trls_option_names_on_a_trl_bundle(tmp_path):
    production = RecomputeConfig.from_profile("trl", loss_type="grpo", beta=0.04, num_generations=4)
    recorded = RecomputeConfig.from_profile("trl", beta=0.04, num_generations=4)  # dapo, TRL's default
    bundle = write(tmp_path, algorithm_case(production.model_dump(), seed=4), recorded)
    assert run("replay", bundle).exit_code == 1
    fixed = run("replay", bundle, "--set", "loss_type=grpo", "--json")
    assert fixed.exit_code == 0, fixed.output
    assert json.loads(fixed.stdout)["config_overrides"]["loss_agg_mode"] == "seq_mean_token_mean"
    refused = run("replay", bundle, "--set", "loss_type=sapo")
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "TRL option loss_type='sapo' (profile trl)" in refused.output
    found = run("conventions", bundle, "--json")
    assert found.exit_code == 0, found.output
    report = json.loads(found.stdout)
    assert report["profile"] == "trl" and report["best"] == "loss_type=grpo"
