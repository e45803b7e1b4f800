"""Rollout correction against verl 0.9's own `compute_rollout_correction_and_add_to_batch`.

A one-step verl batch (16 prompts x 4 samples, 8-64 response tokens, right-padded responses with junk in the
padding) goes through verl's correction; its importance weights, the mask before and after rejection and its
mismatch metrics are written as a rollout-level bundle (the config through the verl profile, from verl's own
option values), and replay must recompute exactly what verl did: weights, rejection and metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from verl.protocol import DataProto
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.schema import (
    BundleIndex,
    Identity,
    Manifest,
    RecomputeConfig,
    SampleRecord,
    StageContract,
    StageId,
)
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import mismatch, replay

PROMPTS, SAMPLES, WIDTH = 16, 4, 64
STAGES = (StageId.SAMPLE, StageId.ROLLOUT_MISMATCH)


def _batch(seed: int = 0) -> DataProto:
    """verl's batch after the old log-probs: response_mask, old_log_probs and rollout_log_probs, padded to WIDTH
    with junk after each response."""
    gen = torch.Generator().manual_seed(seed)
    n = PROMPTS * SAMPLES
    lengths = torch.randint(8, WIDTH + 1, (n,), generator=gen)
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand((n, WIDTH), generator=gen) * 3.0
    noise = torch.randn((n, WIDTH), generator=gen) * 0.08
    outliers = torch.rand((n, WIDTH), generator=gen) < 0.02
    noise = torch.where(outliers, torch.randn((n, WIDTH), generator=gen) * 1.5, noise)
    rollout = old - noise
    junk = torch.randn((n, WIDTH), generator=gen) * 50.0
    old = torch.where(mask.bool(), old, junk)
    rollout = torch.where(mask.bool(), rollout, -junk)
    return DataProto.from_dict(tensors={"response_mask": mask, "old_log_probs": old, "rollout_log_probs": rollout})


def _flat(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid tokens of a padded (n, WIDTH) tensor, sample after sample."""
    lengths = mask.sum(dim=-1)
    return torch.cat([rows[i, : int(lengths[i])] for i in range(rows.shape[0])])


def _write(root: Path, name: str, verl_options: dict[str, Any], *, config_options: dict[str, Any] | None = None):
    """Run verl's correction on the batch and write what it did as a bundle; the config is the verl profile's
    translation of `config_options` (default: the options verl ran with). Returns (sources, batch, metrics)."""
    batch = _batch()
    before = batch.batch["response_mask"].clone()
    lengths = before.sum(dim=-1)
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(**verl_options))
    after = batch.batch["response_mask"]
    records = [
        SampleRecord(
            sample_id=f"uid-{i // SAMPLES}-{i % SAMPLES}",
            group_index=i // SAMPLES,
            response_length=int(lengths[i]),
            total_length=int(lengths[i]) + 16,
            loss_mask=after[i, : int(lengths[i])].tolist(),
            raw_reward=0.0,
            reward=0.0,
        )
        for i in range(PROMPTS * SAMPLES)
    ]
    config = RecomputeConfig.from_profile("verl", **(config_options or verl_options))
    index = BundleIndex(bundle_id=name, identity=Identity(rollout_id=1), samples=records, config=config)
    manifest = Manifest(bundle_id=name, stage_contracts={s: StageContract(stage=s) for s in STAGES})
    expected = {"rollout.mismatch": {"kl_k1": metrics["rollout_corr/kl"], "kl_k3": metrics["rollout_corr/k3_kl"]}}
    writer = BundleWriter(str(root / name), manifest, index, expected)
    writer.write_payload("old_log_probs", _flat(batch.batch["old_log_probs"], before))
    writer.write_payload("rollout_log_probs", _flat(batch.batch["rollout_log_probs"], before))
    writer.write_payload("pre_rejection_mask", _flat(before, before).to(torch.uint8))
    if "rollout_is_weights" in batch.batch.keys():
        writer.write_payload("rollout_is_weights", _flat(batch.batch["rollout_is_weights"], before))
    writer.finalize(ranks=[0])
    return open_sources(str(root / name)), batch, metrics


CONFIGURATIONS = {
    "token-tis": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "sequence-tis": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "token-icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "token-k1-asymmetric": {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.2"},
    "icepop-and-chained": {
        "rollout_is": "token",
        "rollout_is_threshold": "0.8_1.5",
        "rollout_rs": "token_k1,seq_mean_k3",
        "rollout_rs_threshold": "0.85_1.1,0.03",
    },
    "sequence-is-seq-sum-k1": {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.3_2.5",
    },
    "divergences": {
        "rollout_is": "token",
        "rollout_rs": "token_k2, seq_sum_k3, seq_max_k2, seq_mean_k1, token_k3",
        "rollout_rs_threshold": "0.05,1.0,0.6,0.95_1.04,0.06",
    },
}


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_replay_recomputes_what_verl_computed(tmp_path: Path, options: dict[str, Any]):
    sources, batch, metrics = _write(tmp_path, "rollout-1", options)
    if options.get("rollout_rs"):  # the batch gives every criterion something to reject, and something to keep
        for name in options["rollout_rs"].replace(" ", "").split(","):
            assert 0 < metrics[f"rollout_corr/rollout_rs_{name}_masked_fraction"] < 0.5, name
    report = replay(sources)
    assert report.passed, report.render_text()
    stage = report.stage(StageId.ROLLOUT_MISMATCH.value)
    tokens = sum(r.response_length for r in sources[0].index.samples)
    for compared in ("kl_k1 matches", "kl_k3 matches", f"loss_mask: {tokens} values match"):
        assert compared in stage.message
    weights = f"rollout_is_weights: {tokens} values match"
    assert (weights in stage.message) == bool(options.get("rollout_is"))


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_the_kernel_gives_verl_weights_and_mask_token_for_token(options: dict[str, Any]):
    batch = _batch()
    before = batch.batch["response_mask"].clone()
    old, rollout = batch.batch["old_log_probs"].clone(), batch.batch["rollout_log_probs"].clone()
    batch, _ = compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(**options))
    lengths = before.sum(dim=-1)
    d = torch.where(_flat(before, before).bool(), _flat(old, before) - _flat(rollout, before), 0.0)
    config = RecomputeConfig.from_profile("verl", **options)
    fix = mismatch.correction(d, _flat(before, before), lengths, config)
    assert torch.equal(fix.mask, _flat(batch.batch["response_mask"], before).to(torch.float32))
    if options.get("rollout_is"):
        weights = mismatch.recorded_weights(fix, _flat(before, before))
        torch.testing.assert_close(weights, _flat(batch.batch["rollout_is_weights"], before), rtol=2e-6, atol=0)


def test_a_wrong_threshold_is_found_at_the_first_token_it_changes(tmp_path: Path):
    verl_options = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1"}
    verl_options["rollout_rs_threshold"] = "0.9_1.2"
    recorded = {**verl_options, "rollout_rs_threshold": "0.8_1.2", "rollout_is_threshold": 1.5}
    sources, batch, _ = _write(tmp_path, "rollout-1", verl_options, config_options=recorded)
    report = replay(sources)
    assert report.first_divergent_stage == StageId.ROLLOUT_MISMATCH.value
    stage = report.stage(StageId.ROLLOUT_MISMATCH.value)
    assert "loss_mask: " in stage.message and "rollout_is_weights: " in stage.message
    assert "values differ" in stage.message.split("rollout_is_weights: ")[1], report.render_text()
    # the first divergence is a token verl rejected and the recorded window keeps
    first = next(d for d in stage.divergences if d.field == "loss_mask")
    sample = int(first.sample_id.split("-")[1]) * SAMPLES + int(first.sample_id.split("-")[2])
    ratio = torch.exp(batch.batch["old_log_probs"][sample] - batch.batch["rollout_log_probs"][sample])
    assert first.expected == 0.0 and first.actual == 1.0
    assert 1 / 1.2 <= float(ratio[first.token_offset]) <= 1 / 0.8 and not float(ratio[first.token_offset]) <= 1 / 0.9


def test_the_mask_before_rejection_is_what_the_metrics_are_taken_over(tmp_path: Path):
    """Without the pre-rejection mask, the metrics over the mask after rejection are not verl's."""
    options = {"rollout_is": None, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1"}
    sources, _, _ = _write(tmp_path, "rollout-1", options)
    assert replay(sources).status == "pass"
    root = tmp_path / "without"
    root.mkdir()
    batch = _batch()
    before = batch.batch["response_mask"].clone()
    batch, metrics = compute_rollout_correction_and_add_to_batch(batch, RolloutCorrectionConfig(**options))
    after = batch.batch["response_mask"]
    lengths = before.sum(dim=-1)
    d = _flat(batch.batch["old_log_probs"], before) - _flat(batch.batch["rollout_log_probs"], before)
    got = mismatch.mismatch_metrics(d, _flat(after, before), lengths)
    assert got.kl_k1 != pytest.approx(metrics["rollout_corr/kl"], rel=1e-3)
    got = mismatch.mismatch_metrics(d, _flat(before, before), lengths)
    assert got.kl_k1 == pytest.approx(metrics["rollout_corr/kl"], rel=1e-4)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rollout_is_threshold": "a_b"}, "rollout_is_threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1.1,0.1,0.2"}, "rollout_rs_threshold"),
        ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize"),
        ({"bypass_mode": True}, "bypass_mode"),
    ],
)
def test_what_no_field_expresses_is_refused_in_one_line_naming_the_verl_option(options, named):
    with pytest.raises(ValueError) as raised:
        RecomputeConfig.from_profile("verl", **options)
    message = str(raised.value)
    assert "\n" not in message and f"verl option {named}" in message


def test_an_unknown_criterion_is_unsupported_naming_it(tmp_path: Path):
    options = {"rollout_is": "token", "rollout_rs": "token_k1", "rollout_rs_threshold": "0.9_1.1"}
    sources, _, _ = _write(
        tmp_path, "rollout-1", options, config_options={**options, "rollout_rs": "token_k1,seq_max_k1"}
    )
    with pytest.raises(UnsupportedError, match="^unsupported rollout_rs criterion 'seq_max_k1': one of none, "):
        replay(sources)
