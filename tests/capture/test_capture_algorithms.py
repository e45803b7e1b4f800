"""Capture beyond GRPO: gae's values and returns in rollout-level bundles, the KL loss and the value loss in
step-level bundles; contracts follow the config, and the bundles replay with a pass."""

from __future__ import annotations

import math

import pytest
import torch

from tests.capture.helpers import (
    CONFIG,
    CURRENT,
    RAW,
    REF,
    TOKENS,
    loss_scalars,
    microbatch_kwargs,
    rollout_kwargs,
)
from trajectory_replay import capture
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.schema import StageId
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import replay

ALL = range(4)
GAE = CONFIG.model_copy(update={"advantage_estimator": "gae"})
KL_LOSS_COEF = 0.5
WITH_KL_LOSS = CONFIG.model_copy(update={"kl_loss_coef": KL_LOSS_COEF})
VALUES, VPREDS, RETURNS = 0.0, 0.5, 1.0
N_TOKENS = 4 * TOKENS
WRITER = "thread"
"""A writer thread: no process to start per test (the writer process is tested in test_capture.py)."""


def _passed(url: str):
    """The sources of a bundle, after checking that it replays with a pass; and the report."""
    sources = open_native(url)
    report = replay(sources)
    assert report.passed, [(str(s.stage), s.status, s.message) for s in report.stages]
    return sources[0], report


def _gae_rollout_kwargs() -> dict:
    """Canonical samples under gae with zero values, gamma = lam = 1: each token's raw advantage is the sample's
    raw reward (one reward at the last token), so returns = r and the advantages are r whitened over all tokens."""
    raw = torch.tensor([r for r in RAW for _ in range(TOKENS)])
    count = raw.numel()
    var = (raw - raw.mean()).square().sum() / (count - 1)
    whitened = (raw - raw.mean()) / torch.sqrt(var + 1e-8)
    return {
        **rollout_kwargs(),
        "rewards": list(RAW),
        "config": GAE,
        "values": torch.full((N_TOKENS,), VALUES),
        "returns": raw.clone(),
        "advantages": whitened,
    }


def test_gae_rollout_bundle_carries_values_and_returns(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_rollout(3, **_gae_rollout_kwargs())
    assert manager.flush(30)
    source, report = _passed(str(tmp_path / "rollout-3"))
    assert {"values", "returns"} <= set(source.manifest.payloads)
    contract = source.manifest.stage_contracts[StageId.ADVANTAGE_ESTIMATE]
    assert "values" in contract.inputs and contract.expected_outputs == ["advantages", "returns"]
    estimate = next(s for s in report.stages if s.stage == StageId.ADVANTAGE_ESTIMATE)
    assert "returns" in estimate.message and estimate.status == "pass"
    assert source.load_payload("returns").tolist() == [r for r in RAW for _ in range(TOKENS)]


def test_gae_rollout_with_wrong_returns_fails_at_advantage_estimate(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    kwargs = _gae_rollout_kwargs()
    kwargs["returns"] = kwargs["returns"] + 1.0
    assert manager.capture_rollout(4, **kwargs)
    assert manager.flush(30)
    report = replay(open_native(str(tmp_path / "rollout-4")))
    assert not report.passed and report.first_divergent_stage == "advantage.estimate"


def _value_kwargs() -> dict:
    return {
        name: torch.full((N_TOKENS,), v) for name, v in (("values", VALUES), ("vpreds", VPREDS), ("returns", RETURNS))
    }


def _value_scalars() -> dict[str, float]:
    """Every token: unclipped (0.5 - 1)^2 = 0.25, clipped (0.2 - 1)^2 = 0.64 (the larger, so clipped); the V1
    reduction sums four per-sample means."""
    return {"vf_loss": 0.5 * 4 * 0.64, "vf_clipfrac": 4.0}


def test_value_loss_is_contracted_and_replays(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    for j, pos in enumerate(([0, 1], [2, 3])):
        batch = {name: t[: len(pos) * TOKENS] for name, t in _value_kwargs().items()}
        assert manager.capture_microbatch(7, 0, f"mb-{j:04d}", **microbatch_kwargs(pos), **batch)
    assert manager.capture_step_end(7, 0, config=GAE, **loss_scalars(ALL), **_value_scalars())
    assert manager.flush(30)
    source, report = _passed(str(tmp_path / "step-7-0"))
    assert [str(s.stage) for s in report.stages] == ["sample", "loss.policy", "loss.value"]
    assert {"values", "vpreds", "returns"} <= set(source.manifest.payloads)
    assert source.expected["loss.value"] == pytest.approx(_value_scalars())
    assert source.manifest.stage_contracts[StageId.LOSS_VALUE].expected_outputs == ["vf_loss", "vf_clipfrac"]
    # the value inputs are concatenated micro-batch after micro-batch like every step payload
    assert source.load_payload("vpreds").tolist() == [VPREDS] * N_TOKENS


def test_value_scalars_without_their_inputs_fail_loudly(tmp_path, make_manager):
    """Given any part of a value loss, loss.value is contracted: what is missing is reported, never unchecked."""
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_microbatch(7, 1, "mb-0000", **microbatch_kwargs(ALL))
    assert manager.capture_step_end(7, 1, config=GAE, **loss_scalars(ALL), **_value_scalars())
    assert manager.flush(30)
    sources = open_native(str(tmp_path / "step-7-1"))
    assert StageId.LOSS_VALUE in sources[0].manifest.stage_contracts
    with pytest.raises(UnsupportedError, match="loss.value needs payload 'values'"):
        replay(sources)


def test_kl_loss_brings_reference_log_probs_and_its_scalar(tmp_path, make_manager):
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_microbatch(
        8, 0, "mb-0000", **microbatch_kwargs(ALL), ref_log_probs=torch.full((N_TOKENS,), REF)
    )
    d = CURRENT - REF
    kl_loss = 4 * (math.exp(-d) - 1 + d)  # k3 of current vs reference, a sum of four per-sample means
    scalars = loss_scalars(ALL)
    scalars["loss"] += KL_LOSS_COEF * kl_loss
    assert manager.capture_step_end(8, 0, config=WITH_KL_LOSS, kl_loss=kl_loss, **scalars)
    assert manager.flush(30)
    source, report = _passed(str(tmp_path / "step-8-0"))
    assert "ref_log_probs" in source.manifest.payloads
    assert source.expected["loss.policy"]["kl_loss"] == pytest.approx(kl_loss)
    assert "ref_log_probs" in source.manifest.stage_contracts[StageId.LOSS_POLICY].inputs
    policy = next(s for s in report.stages if s.stage == StageId.LOSS_POLICY)
    assert "kl_loss matches" in policy.message


def test_kl_loss_scalar_is_expected_only_under_a_kl_loss_config(tmp_path, make_manager):
    """Without kl_loss_coef the reported kl_loss is not a loss.policy output: the expected map leaves it out."""
    manager = make_manager(tmp_path, writer=WRITER)
    assert manager.capture_microbatch(8, 1, "mb-0000", **microbatch_kwargs(ALL))
    assert manager.capture_step_end(8, 1, config=CONFIG, kl_loss=0.25, **loss_scalars(ALL))
    assert manager.flush(30)
    source, _ = _passed(str(tmp_path / "step-8-1"))
    assert source.expected == {"loss.policy": loss_scalars(ALL)}
    assert set(source.manifest.stage_contracts) == {StageId.SAMPLE, StageId.LOSS_POLICY}


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_a_step_without_entropy_replays_only_without_an_entropy_term(tmp_path, make_manager, entropy_coef):
    """A trainer without an entropy term computes none: the step needs no entropy and no entropy_loss then."""
    config = CONFIG.model_copy(update={"entropy_coef": entropy_coef})
    capture.set_manager(make_manager(tmp_path, writer=WRITER))
    try:
        kwargs = microbatch_kwargs(ALL)
        del kwargs["entropy"]
        assert capture.capture_microbatch(9, 0, "mb-0000", **kwargs)
        scalars = loss_scalars(ALL)
        del scalars["entropy_loss"]
        scalars["loss"] = scalars["pg_loss"]
        assert capture.capture_step_end(9, 0, config=config, **scalars)
        assert capture.get_manager().flush(30)
    finally:
        capture.set_manager(None)
    sources = open_native(str(tmp_path / "step-9-0"))
    assert "entropy" not in sources[0].manifest.payloads
    if entropy_coef == 0:
        _, report = _passed(str(tmp_path / "step-9-0"))
        assert "entropy_loss" not in next(s for s in report.stages if s.stage == StageId.LOSS_POLICY).message
    else:
        assert replay(sources).stage("loss.policy").message == "bundle has no payload 'entropy'"


def test_hooks_and_slime_adapter_pass_the_new_inputs(tmp_path):
    manager = capture.set_manager(None)
    assert manager is None
    # capture off: the new keywords are accepted and cost nothing
    assert capture.capture_microbatch(0, 0, "mb-0000", **microbatch_kwargs(ALL), **_value_kwargs()) is None
    assert capture.capture_step_end(0, 0, config=GAE, **loss_scalars(ALL), kl_loss=0.0, **_value_scalars()) is None
    data = {
        "response_lengths": [TOKENS] * 4,
        "total_lengths": [TOKENS + 1] * 4,
        "loss_masks": [[1] * TOKENS] * 4,
        "raw_reward": RAW,
        "rewards": RAW,
        "log_probs": torch.zeros(N_TOKENS),
        "kl": torch.zeros(N_TOKENS),
        "advantages": torch.zeros(N_TOKENS),
        "group_index": [0, 0, 1, 1],
        "values": torch.ones(N_TOKENS),
        "returns": torch.full((N_TOKENS,), 2.0),
    }
    kwargs = capture.slime_rollout_arguments(5, data)
    assert kwargs["values"] is data["values"] and kwargs["returns"] is data["returns"]
    assert capture.slime_rollout_arguments(5, {k: v for k, v in data.items() if k != "values"})["values"] is None
