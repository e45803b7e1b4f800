"""`trajectory-replay diff`: two captures of one step compared sample by sample, in stage order; lazily through
the store, where blocks with equal digests are equal without being read."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from tests.replay.conftest import MemorySource
from tests.replay.reference64 import algorithm_case, token_position
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.cli import app
from trajectory_replay.replay.diff import diff_bundles
from trajectory_replay.replay.fixtures import CanonicalCase

runner = CliRunner()
CONFIG = {"grpo_std_normalization": True, "kl_coef": 0.05, "rollout_is": "token", "loss_agg_mode": "token_mean"}


@pytest.fixture(scope="module")
def case():
    return algorithm_case(CONFIG, seed=41)


def _ranks(case, groups: Sequence[Sequence[int]]) -> list[MemorySource]:
    """`case` sharded into ranks holding the given sample positions, in the given order (cohort scalars go with
    a single rank only)."""
    manifest, index, expected, payloads = case
    starts, offset = [], 0
    for r in index.samples:
        starts.append(offset)
        offset += r.response_length
    out = []
    for rank, positions in enumerate(groups):
        rows = torch.cat([torch.arange(starts[i], starts[i] + index.samples[i].response_length) for i in positions])
        sub = {k: v[rows] for k, v in payloads.items()}
        sub["loss_mask"] = torch.tensor([m for i in positions for m in index.samples[i].loss_mask], dtype=torch.uint8)
        docs = {
            k: {key: [vals[i] for i in positions]}
            for k, v in expected.items()
            for key, vals in v.items()
            if isinstance(vals, list)
        }
        if len(groups) == 1:
            docs.update({k: v for k, v in expected.items() if not any(isinstance(x, list) for x in v.values())})
        records = [index.samples[i] for i in positions]
        out.append(
            MemorySource(
                manifest,
                index.model_copy(update={"samples": records}),
                docs,
                sub,
                rank=None if len(groups) == 1 else rank,
            )
        )
    return out


def _whole(case) -> list[MemorySource]:
    return _ranks(case, [list(range(len(case.index.samples)))])


def test_identical_bundles(case):
    report = diff_bundles(_whole(case), _whole(case))
    assert report.identical and report.exit_code == 0 and report.first is None
    kinds = {f.kind for f in report.fields}
    assert kinds == {"config", "record", "payload", "expected"}
    assert all(f.compared > 0 for f in report.fields if f.kind == "payload")


def test_reordered_and_resharded_is_no_difference(case):
    n = len(case.index.samples)
    shuffled = [[7, 2, 11, 0, 5], [9, 1, 3, 10, 4, 6, 8]]
    assert sorted(shuffled[0] + shuffled[1]) == list(range(n))
    report = diff_bundles(_whole(case), _ranks(case, shuffled))
    assert report.identical, report.render_text()
    scalars = [f for f in report.fields if f.name == "expected.loss.policy"]
    assert scalars and "ranks hold different samples" in scalars[0].note


@pytest.mark.parametrize(
    "payload, stage",
    [
        ("loss_mask", "sample"),
        ("rollout_log_probs", "rollout.mismatch"),
        ("old_log_probs", "rollout.mismatch"),
        ("kl", "advantage.kl"),
        ("advantages", "advantage.estimate"),
        ("log_probs", "loss.policy"),
        ("entropy", "loss.policy"),
        ("ref_log_probs", "advantage.kl"),
    ],
)
def test_one_token_changed_in_each_payload_kind(case, payload, stage):
    sample, offset = 5, 1
    changed = {k: v.clone() for k, v in case.payloads.items()}
    changed.setdefault(
        "loss_mask", torch.tensor([m for r in case.index.samples for m in r.loss_mask], dtype=torch.uint8)
    )
    at = token_position(case.index, sample, offset)
    changed[payload][at] = 1 - changed[payload][at] if payload == "loss_mask" else changed[payload][at] + 0.25
    b = [MemorySource(case.manifest, case.index, case.expected, changed)]
    report = diff_bundles(_whole(case), b)
    first = report.first
    assert report.exit_code == 1 and first is not None
    assert (first.stage, first.name, first.first["sample"], first.first["token"]) == (
        stage,
        f"payload.{payload}",
        "a-5",
        offset,
    )
    assert first.differing == 1
    assert [f.name for f in report.differences] == [f"payload.{payload}"]


def test_a_record_field_changed_is_placed_at_the_stage_that_reads_it(case):
    records = [
        r.model_copy(update={"raw_reward": r.raw_reward + 1.0}) if r.sample_id == "a-3" else r
        for r in case.index.samples
    ]
    b = _whole(
        CanonicalCase(case.manifest, case.index.model_copy(update={"samples": records}), case.expected, case.payloads)
    )
    report = diff_bundles(_whole(case), b)
    assert (report.first.stage, report.first.name, report.first.first["sample"]) == (
        "reward.raw",
        "record.raw_reward",
        "a-3",
    )
    assert report.first.max_abs_diff == pytest.approx(1.0)


def test_a_config_difference_comes_first(case):
    other = case.index.model_copy(update={"config": case.index.config.model_copy(update={"std_eps": 1e-4})})
    report = diff_bundles(_whole(case), _whole(CanonicalCase(case.manifest, other, case.expected, case.payloads)))
    assert (report.first.stage, report.first.note) == ("config", "std_eps")


def test_samples_in_one_bundle_only(case):
    report = diff_bundles(_whole(case), _ranks(case, [list(range(11))]))
    assert report.first.name == "sample_id" and report.first.first["sample"] == "a-11"


def _write(root, case, name: str, payloads: dict[str, torch.Tensor] | None = None, **options: Any) -> str:
    manifest, index, expected, base = case[:4]
    url = f"{root}/{name}"
    writer = BundleWriter(url, manifest, index, expected, **options)
    for key, tensor in (payloads or base).items():
        if key != "loss_mask":
            writer.write_payload(key, tensor)
    writer.finalize()
    return url


def test_the_cli_on_native_bundles_reads_only_what_differs(tmp_path, case):
    a = _write(tmp_path, case, "a")
    same = _write(tmp_path, case, "b")
    result = runner.invoke(app, ["diff", a, same, "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["status"] == "pass" and report["identical"] is True
    advantages = next(f for f in report["fields"] if f["name"] == "payload.advantages")
    assert advantages["note"] == "12 of 12 samples equal by digest, not read"
    changed = {k: v.clone() for k, v in case.payloads.items()}
    changed["advantages"][token_position(case.index, 4, 0)] += 1.0
    other = _write(tmp_path, case, "c", changed)
    result = runner.invoke(app, ["diff", a, other])
    assert result.exit_code == 1
    assert "first difference at advantage.estimate: payload.advantages sample=a-4 token=0" in result.stdout
    assert "* advantage.estimate" in result.stdout


def test_an_older_format_bundle_against_its_native_copy(tmp_path, case):
    native = _write(tmp_path, case, "native")
    exported = runner.invoke(app, ["export", native, str(tmp_path / "v1")])
    assert exported.exit_code == 0, exported.stdout
    result = runner.invoke(app, ["diff", native, str(tmp_path / "v1"), "--json"])
    assert result.exit_code == 0, result.stdout
    assert json.loads(result.stdout)["identical"] is True


def test_a_lazy_diff_on_s3_fetches_about_the_differing_group(s3_root, tmp_path):
    from benchmarks.data import GROUP_SIZE, big_case

    root, options = s3_root
    big = big_case(512, 1024, bundle_id="s3diff")
    a = _write(root, big, "a", cache_dir=str(tmp_path / "wa"), **options)
    changed = {k: v.clone() for k, v in big.payloads.items()}
    group = [i for i, r in enumerate(big.index.samples) if r.group_index == 3]
    assert len(group) == GROUP_SIZE
    for i in group:
        changed["advantages"][i * 1024 : (i + 1) * 1024] += 0.5
    b = _write(root, big, "b", changed, cache_dir=str(tmp_path / "wb"), **options)
    left = open_sources(a, cache_dir=str(tmp_path / "ca"), **options)
    right = open_sources(b, cache_dir=str(tmp_path / "cb"), **options)
    report = diff_bundles(left, right)
    payload_bytes = sum(t.numel() * t.element_size() for t in big.payloads.values()) * 2
    assert [f.name for f in report.differences] == ["payload.advantages"]
    assert report.differences[0].differing == GROUP_SIZE * 1024
    assert report.bytes_fetched is not None and report.bytes_fetched < 0.10 * payload_bytes, report.bytes_fetched
