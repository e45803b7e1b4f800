"""The rollout.mismatch stage, the rollout corrections in loss.policy, staleness and the on-policy check.

The hand-computed case is three ragged samples whose log ratios d = old - rollout are exact binary fractions:
sample 0 [0.125, -0.25], sample 1 [0.5, 3.0 (masked out), -0.125], sample 2 [1.0].
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from tests.replay.conftest import MemorySource, source_of
from tests.replay.reference64 import algorithm_case, token_position
from tests.replay.reference64 import mismatch_metrics as reference_metrics
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
from trajectory_replay.replay import losses, mismatch, replay
from trajectory_replay.replay.registry import resolve_kernels

OLD = [-1.0, -0.5, -2.0, -0.25, -1.25, -0.75]
D = [0.125, -0.25, 0.5, 3.0, -0.125, 1.0]
ROLLOUT = [o - d for o, d in zip(OLD, D)]
LENGTHS = [2, 3, 1]
MASKS = [[1, 1], [1, 0, 1], [1]]
FLAT_MASK = [m for row in MASKS for m in row]
INSIDE = [d for d, m in zip(D, FLAT_MASK) if m]
E = math.exp


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _lengths() -> torch.Tensor:
    return torch.tensor(LENGTHS)


def _config(**fields: Any) -> RecomputeConfig:
    return RecomputeConfig(**{"loss_agg_mode": "token_mean", **fields})


def test_metrics_of_the_ragged_case_by_hand():
    got = mismatch.mismatch_metrics(mismatch.log_ratio(_t(OLD), _t(ROLLOUT)), _t(FLAT_MASK), _lengths())
    assert got.kl_k1 == pytest.approx(-(0.125 - 0.25 + 0.5 - 0.125 + 1.0) / 5)
    assert got.kl_k3 == pytest.approx(sum(E(d) - 1 - d for d in INSIDE) / 5)
    assert got.log_ratio_max_abs == 1.0  # the masked-out 3.0 does not count
    assert got.seq_log_ratio_max_abs == 1.0  # sums -0.125, 0.375, 1.0


def test_token_and_sequence_importance_weights_by_hand():
    d, m = mismatch.log_ratio(_t(OLD), _t(ROLLOUT)), _t(FLAT_MASK)
    token = mismatch.correction(d, m, _lengths(), _config(rollout_is="token"))
    assert token.weights.tolist() == pytest.approx([E(0.125), E(-0.25), E(0.5), 2.0, E(-0.125), 2.0])
    assert mismatch.recorded_weights(token, m).tolist() == pytest.approx(
        [E(0.125), E(-0.25), E(0.5), 0.0, E(-0.125), 2.0]
    )
    assert token.mask.tolist() == FLAT_MASK  # no rejection asked for
    seq = mismatch.correction(d, m, _lengths(), _config(rollout_is="sequence", rollout_is_threshold=1.5))
    assert seq.weights.tolist() == pytest.approx([E(-0.125)] * 2 + [E(0.375)] * 3 + [1.5])


def test_token_and_sequence_rejection_by_hand():
    d, m = mismatch.log_ratio(_t(OLD), _t(ROLLOUT)), _t(FLAT_MASK)
    token = mismatch.correction(d, m, _lengths(), _config(rollout_rs="token"))  # bounds [1/2, 2]
    assert token.weights is None and token.mask.tolist() == [1, 1, 1, 0, 1, 0]  # e^1 > 2 rejected
    seq = mismatch.correction(
        d, m, _lengths(), _config(rollout_rs="sequence", rollout_rs_lower=0.9, rollout_rs_upper=2.0)
    )
    assert seq.mask.tolist() == [0, 0, 1, 0, 1, 0]  # e^-0.125 < 0.9 and e^1 > 2: samples 0 and 2 rejected
    both = mismatch.correction(d, m, _lengths(), _config(rollout_is="token", rollout_rs="token"))
    assert both.weights is not None and both.mask.tolist() == [1, 1, 1, 0, 1, 0]


def test_the_loss_takes_the_weights_and_the_rejection_mask_by_hand():
    """Advantages 1 and log_probs == old: every token's pg is -w, so token_mean is minus the mean weight."""
    lp, m = _t(OLD), _t(FLAT_MASK)
    data = losses.PolicyLossData(lp, lp, torch.ones(6), torch.zeros(6), m, _lengths(), rollout_log_probs=_t(ROLLOUT))
    weighted = _config(rollout_is="token")
    out = losses.policy_loss_outputs(data, weighted, resolve_kernels(weighted))
    assert out["pg_loss"] == pytest.approx(-(E(0.125) + E(-0.25) + E(0.5) + E(-0.125) + 2.0) / 5)
    rejected = _config(rollout_rs="token", loss_agg_mode="sum_of_sample_means")
    out = losses.policy_loss_outputs(data, rejected, resolve_kernels(rejected))
    assert out["pg_loss"] == pytest.approx(-2.0)  # samples 0 and 1 keep their tokens, sample 2 has none left
    both = _config(rollout_is="sequence", rollout_rs="token")
    out = losses.policy_loss_outputs(data, both, resolve_kernels(both))
    assert out["pg_loss"] == pytest.approx(-(2 * E(-0.125) + 2 * E(0.375)) / 4)


# --------------------------------------------------------------------------- replay of a bundle


def _bundle(
    config: dict[str, Any] | None = None,
    *,
    versions: list[int | None] | None = None,
    expected_metrics: dict[str, float] | None = None,
    log_probs: list[float] | None = None,
    with_rollout: bool = True,
    extra: dict[str, torch.Tensor] | None = None,
) -> MemorySource:
    """The hand case as a bundle contracting sample, rollout.mismatch and loss.policy."""
    cfg = RecomputeConfig(**{"loss_agg_mode": "token_mean", **(config or {})})
    versions = versions or [None] * 3
    records = [
        SampleRecord(
            sample_id=f"s-{i}",
            group_index=i,
            response_length=n,
            total_length=n + 2,
            loss_mask=MASKS[i],
            raw_reward=0.0,
            reward=0.0,
            policy_version=versions[i],
        )
        for i, n in enumerate(LENGTHS)
    ]
    lp = _t(log_probs or OLD)
    payloads = {
        "old_log_probs": _t(OLD),
        "log_probs": lp,
        "entropy": torch.full((6,), 0.5),
        "advantages": _t([1.0, -1.0, 0.5, 0.5, 0.5, -2.0]),
    }
    if with_rollout:
        payloads["rollout_log_probs"] = _t(ROLLOUT)
    payloads.update(extra or {})
    mask = torch.tensor(FLAT_MASK, dtype=torch.uint8)
    expected: dict[str, Any] = {
        "loss.policy": losses.policy_loss_outputs(
            losses.PolicyLossData(
                _t(OLD),
                _t(OLD),
                payloads["advantages"],
                payloads["entropy"],
                mask,
                _lengths(),
                rollout_log_probs=_t(ROLLOUT),
            ),
            cfg,
            resolve_kernels(cfg),
        )
    }
    if expected_metrics is not None:
        expected["rollout.mismatch"] = expected_metrics
    stages = (StageId.SAMPLE, StageId.ROLLOUT_MISMATCH, StageId.LOSS_POLICY)
    manifest = Manifest(bundle_id="b-mismatch", stage_contracts={s: StageContract(stage=s) for s in stages})
    index = BundleIndex(bundle_id="b-mismatch", identity=Identity(rollout_id=1), samples=records, config=cfg)
    return MemorySource(manifest, index, expected, payloads)


def test_a_clean_bundle_passes_and_the_report_shows_the_metrics_and_worst_tokens():
    report = replay(
        [
            _bundle(
                expected_metrics=reference_metrics(
                    [OLD[:2], OLD[2:5], OLD[5:]], [ROLLOUT[:2], ROLLOUT[2:5], ROLLOUT[5:]], MASKS
                )
            )
        ]
    )
    assert report.passed, report.render_text()
    entry = report.stage("rollout.mismatch")
    assert entry.metrics["kl_k1"] == pytest.approx(-0.25) and entry.metrics["staleness_max"] is None
    worst = entry.metrics["worst_tokens"]
    assert [(w["sample_id"], w["token_offset"]) for w in worst] == [
        ("s-2", 0),
        ("s-1", 0),
        ("s-0", 1),
        ("s-0", 0),
        ("s-1", 2),
    ]  # masked-in tokens by |d|
    assert worst[0] == {
        "sample_id": "s-2",
        "token_offset": 0,
        "rollout_log_prob": -1.75,
        "trainer_log_prob": -0.75,
        "log_ratio": 1.0,
    }
    text = report.render_text()
    assert (
        "metrics: kl_k1=-0.25" in text
        and "worst tokens:" in text
        and "sample_id=s-2 token_offset=0 rollout_log_prob=-1.75 trainer_log_prob=-0.75 log_ratio=1.0" in text
    )
    as_json = json.loads(report.to_json())
    assert as_json["stages"][1]["stage"] == "rollout.mismatch" and as_json["stages"][1]["metrics"]["kl_k1"] == -0.25


def test_an_expected_metric_that_differs_fails_the_stage():
    report = replay([_bundle(expected_metrics={"kl_k1": -0.2})])
    assert report.first_divergent_stage == "rollout.mismatch"
    assert "kl_k1: expected -0.2, actual -0.25" in report.stage("rollout.mismatch").message


def test_the_token_log_ratio_ceiling_trips_at_the_worst_token():
    report = replay([_bundle({"mismatch_max_token_log_ratio": 0.75})])
    entry = report.stage("rollout.mismatch")
    assert report.first_divergent_stage == "rollout.mismatch"
    assert "1 tokens have |log ratio| above mismatch_max_token_log_ratio 0.75" in entry.message
    first = entry.divergences[0]
    assert (first.field, first.sample_id, first.token_offset, first.expected, first.actual) == (
        "log_ratio",
        "s-2",
        0,
        -1.75,
        -0.75,
    )
    assert replay([_bundle({"mismatch_max_token_log_ratio": 1.0})]).passed  # |d| <= the ceiling passes


def test_the_kl_k3_ceiling_trips():
    k3 = sum(E(d) - 1 - d for d in INSIDE) / 5
    assert replay([_bundle({"mismatch_max_kl_k3": k3 * 1.01})]).passed
    report = replay([_bundle({"mismatch_max_kl_k3": k3 * 0.99})])
    assert report.first_divergent_stage == "rollout.mismatch"
    assert "exceeds mismatch_max_kl_k3" in report.stage("rollout.mismatch").message


def test_staleness_both_ways():
    ok = replay([_bundle({"actor_version": 5, "max_staleness": 2}, versions=[5, 4, 3])])
    assert ok.passed and ok.stage("rollout.mismatch").metrics["staleness_max"] == 2.0
    future = replay([_bundle({"actor_version": 5}, versions=[5, 6, 5])])
    entry = future.stage("rollout.mismatch")
    assert future.first_divergent_stage == "rollout.mismatch"
    assert "sample s-1 has policy_version 6, newer than actor_version 5" in entry.message
    assert (entry.divergences[0].field, entry.divergences[0].sample_id) == ("policy_version", "s-1")
    stale = replay([_bundle({"actor_version": 5, "max_staleness": 1}, versions=[5, 4, 3])])
    assert (
        "sample s-2 has policy_version 3, 2 versions behind actor_version 5 (max_staleness 1)"
        in stale.stage("rollout.mismatch").message
    )


def test_staleness_alone_is_checked_without_rollout_log_probs():
    source = _bundle({"actor_version": 2}, versions=[2, 3, 2], with_rollout=False)
    report = replay([source])
    assert (
        report.first_divergent_stage == "rollout.mismatch"
        and "newer than actor_version" in report.stage("rollout.mismatch").message
    )
    assert "rollout_log_probs" not in source.loaded_names()


def test_the_on_policy_check_names_the_first_token_whose_log_prob_moved():
    assert replay([_bundle({"expect_on_policy": True})]).passed
    moved = list(OLD)
    moved[4] += 0.5  # sample 1, token 2
    report = replay([_bundle({"expect_on_policy": True}, log_probs=moved)])
    assert report.first_divergent_stage == "loss.policy"
    first = report.stage("loss.policy").divergences[0]
    assert (first.field, first.sample_id, first.token_offset) == ("log_probs", "s-1", 2)
    assert (first.expected, first.actual) == pytest.approx((OLD[4], OLD[4] + 0.5))  # old, then current
    masked_only = list(OLD)
    masked_only[3] += 0.5  # a masked-out token does not count
    assert replay([_bundle({"expect_on_policy": True}, log_probs=masked_only)]).passed


def test_recorded_importance_weights_are_compared():
    cfg = {"rollout_is": "token"}
    good = mismatch.recorded_weights(
        mismatch.correction(mismatch.log_ratio(_t(OLD), _t(ROLLOUT)), _t(FLAT_MASK), _lengths(), _config(**cfg)),
        _t(FLAT_MASK),
    )
    assert replay([_bundle(cfg, extra={"rollout_is_weights": good})]).passed
    bad = good.clone()
    bad[2] = 1.0
    report = replay([_bundle(cfg, extra={"rollout_is_weights": bad})])
    first = report.stage("rollout.mismatch").divergences[0]
    assert report.first_divergent_stage == "rollout.mismatch"
    assert (first.field, first.sample_id, first.token_offset) == ("rollout_is_weights", "s-1", 0)


# --------------------------------------------------------------------------- against the float64 reference

CORRECTIONS = [
    {"rollout_is": "token"},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0},
    {"rollout_rs": "token", "rollout_rs_lower": 0.7, "rollout_rs_upper": 1.4},
    {"rollout_rs": "sequence", "rollout_rs_lower": 0.3},
    {"rollout_is": "token", "rollout_rs": "sequence", "rollout_rs_upper": 2.5},
]
MODES = ["sum_of_sample_means", "token_mean", "seq_mean_token_mean"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("correction", CORRECTIONS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_corrected_losses_match_the_float64_reference(correction, mode):
    config = {
        "grpo_std_normalization": True,
        "loss_agg_mode": mode,
        "kl_loss_coef": 0.1,
        "entropy_coef": 0.01,
        **correction,
    }
    case = algorithm_case(config, seed=31)
    report = replay([source_of(case)])
    assert report.passed, report.render_text()
    plain = algorithm_case({k: v for k, v in config.items() if k not in correction}, seed=31)
    assert plain.expected["loss.policy"]["pg_loss"] != case.expected["loss.policy"]["pg_loss"]  # it matters
    assert case.expected["rollout.mismatch"]["kl_k3"] > 0


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_corrections_combine_with_the_other_policy_losses(policy_loss):
    case = algorithm_case(
        {"policy_loss": policy_loss, "rollout_is": "token", "rollout_rs": "token", "loss_agg_mode": "token_mean"},
        seed=32,
    )
    assert replay([source_of(case)]).passed


def test_a_wrong_rollout_log_prob_is_found_at_the_loss_with_the_correction():
    case = algorithm_case(
        {"rollout_is": "token", "loss_agg_mode": "token_mean"}, seed=33, stages=(StageId.SAMPLE, StageId.LOSS_POLICY)
    )
    rollout = case.payloads["rollout_log_probs"].clone()
    rollout[token_position(case.index, 2, 0)] -= 1.0
    report = replay([source_of(case, rollout_log_probs=rollout)])
    assert report.first_divergent_stage == "loss.policy"


def test_unsupported_corrections_fail_naming_the_field():
    case = algorithm_case({"loss_agg_mode": "token_mean"}, seed=34)
    with pytest.raises(UnsupportedError, match="unsupported rollout_is 'tokens'"):
        replay([source_of(case)], overrides={"rollout_is": "tokens"})
    with pytest.raises(UnsupportedError, match="rollout_rs_lower=3.0"):
        replay([source_of(case)], overrides={"rollout_rs": "token", "rollout_rs_lower": 3.0})
    without = {k: v for k, v in case.payloads.items() if k != "rollout_log_probs"}
    with pytest.raises(UnsupportedError, match="needs payload 'rollout_log_probs'"):
        replay([MemorySource(case.manifest, case.index, case.expected, without)], overrides={"rollout_is": "token"})
    with pytest.raises(UnsupportedError, match="max_staleness 2 needs actor_version"):
        replay([_bundle({"max_staleness": 2})])


def test_a_non_finite_log_prob_fails_the_stage_and_leads_the_worst_tokens():
    broken = list(ROLLOUT)
    broken[4] = float("nan")  # sample 1, token 2 (masked in)
    source = _bundle()
    source.payloads["rollout_log_probs"] = _t(broken)
    report = replay([source])
    entry = report.stage("rollout.mismatch")
    assert report.first_divergent_stage == "rollout.mismatch"
    assert "log ratio is nan at s-1 token 2 (1 tokens not finite)" in entry.message
    worst = entry.metrics["worst_tokens"][0]
    assert (worst["sample_id"], worst["token_offset"]) == ("s-1", 2) and math.isnan(entry.metrics["log_ratio_max_abs"])
    assert json.loads(report.to_json())["stages"][1]["metrics"]["kl_k1"] == "nan"


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), float("inf")])
def test_a_non_finite_log_prob_on_a_masked_out_token_changes_nothing(value):
    """Padding often holds garbage: a NaN or infinite rollout log-prob where the loss mask is 0 counts as d = 0,
    so the stage passes with the metrics and worst tokens of the clean bundle, in one block or streamed."""
    clean = replay([_bundle()])
    garbage = list(ROLLOUT)
    garbage[3] = value  # sample 1, token 1: masked out
    source = _bundle()
    source.payloads["rollout_log_probs"] = _t(garbage)
    for report in (replay([source]), replay([source], block_tokens=2)):
        entry = report.stage("rollout.mismatch")
        assert report.passed and entry.status == "pass", entry.message
        assert entry.metrics == clean.stage("rollout.mismatch").metrics


def test_the_stage_takes_its_sums_in_one_pass_or_by_selection_alike():
    """The fast pass (the mask multiplied in) and the selection it falls back to give the same per-sample sums."""
    old, rollout = _t(OLD), _t(ROLLOUT)
    mask = torch.tensor(FLAT_MASK, dtype=torch.uint8)
    found = mismatch.mismatch_pass(old, rollout, mask, _lengths(), ceiling=0.4)
    reference = mismatch.mismatch_sums(mismatch.log_ratio(old, rollout), mask, _lengths())
    assert torch.equal(found.sums.seq, reference.seq) and torch.equal(found.sums.k3, reference.k3)
    assert (found.sums.tokens, found.sums.max_score) == (reference.tokens, reference.max_score) == (5, 1.0)
    assert found.worst.tolist() == [5, 2, 1, 0, 4] and found.over == 2 and found.nonfinite is None


def _brute_force(d: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, ceiling: float) -> dict:
    """What `mismatch_pass` finds, token by token in float64 Python (sums aside): the worst tokens by |d| (NaN
    first, ties in flat order, |d| = 0 left out), the tokens over the ceiling, the first non-finite token."""
    inside = [bool(m) for m in mask.tolist()]
    values = d.tolist()
    scored = [(i, abs(v)) for i, (v, m) in enumerate(zip(values, inside)) if m and (math.isnan(v) or v != 0)]
    scored.sort(key=lambda p: (not math.isnan(p[1]), -p[1] if not math.isnan(p[1]) else 0.0, p[0]))
    bad = [i for i, (v, m) in enumerate(zip(values, inside)) if m and not math.isfinite(v)]
    return {
        "worst": [i for i, _ in scored[: mismatch.WORST_TOKENS]],
        "over": sum(1 for v, m in zip(values, inside) if m and (math.isnan(v) or abs(v) > ceiling)),
        "nonfinite": (bad[0], len(bad)) if bad else None,
    }


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000, 1 << 16])
@pytest.mark.parametrize("kind", ["clean", "garbage outside the mask", "non-finite inside", "ties"])
def test_the_pass_gives_the_same_results_whatever_its_chunks(kind, chunk_tokens):
    """Chunks of whole samples and windows of WINDOW tokens change nothing: the sums are bit for bit those of
    one selection over the whole cohort, and the worst tokens, the count over the ceiling and the first
    non-finite token are those of a token-by-token search."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 700, (40,), generator=g)
    lengths[5] = 3000  # one sample longer than several windows
    total = int(lengths.sum())
    old = -torch.rand(total, generator=g)
    rollout = old - 0.05 * torch.randn(total, generator=g)
    mask = (torch.rand(total, generator=g) < 0.8).to(torch.uint8)
    if kind == "garbage outside the mask":
        outside = (mask == 0).nonzero().flatten()
        rollout[outside[::3]] = math.nan
        rollout[outside[1::3]] = -math.inf
    if kind == "non-finite inside":
        inside = mask.nonzero().flatten()
        rollout[inside[[100, 2000, 9000]]] = torch.tensor([math.nan, math.inf, -math.inf])
    if kind == "ties":  # equal |d| in windows far apart, the largest of them all
        inside = mask.nonzero().flatten()
        for at, sign in zip(inside[[9000, 50, 4500, 12000]].tolist(), (1, -1, 1, -1)):
            rollout[at] = old[at] - sign * 0.75
    d = mismatch.log_ratio(old, rollout)
    found = mismatch.mismatch_pass(old, rollout, mask, lengths, ceiling=0.1, chunk_tokens=chunk_tokens)
    reference = mismatch.mismatch_sums(d, mask, lengths)
    for got, want in ((found.sums.seq, reference.seq), (found.sums.k3, reference.k3)):  # exactly, NaN for NaN
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert found.sums.tokens == reference.tokens
    assert (
        found.sums.max_score == reference.max_score
        or math.isnan(found.sums.max_score)
        and math.isnan(reference.max_score)
    )
    expected = _brute_force(d, mask, lengths, 0.1)
    assert {"worst": found.worst.tolist(), "over": found.over, "nonfinite": found.nonfinite} == expected
    if kind == "ties":
        assert expected["worst"][:4] == sorted(inside[[9000, 50, 4500, 12000]].tolist())


def test_worst_tokens_over_many_windows_match_a_full_sort():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(50_000, generator=g)
    d = torch.randn(50_000, generator=g)
    d[[7, 31_000, 49_999]] = torch.tensor([9.0, -9.0, 8.5])  # a tie across windows, and the last token
    mask = torch.rand(50_000, generator=g) < 0.8
    mask[[7, 31_000, 49_999]] = True
    lengths = torch.tensor([10_000] * 5)
    got = mismatch.mismatch_pass(old, old - d, mask, lengths).worst.tolist()
    ratio = mismatch.log_ratio(old, old - d)
    score = torch.where(mask, ratio.abs(), -1.0)
    expected = sorted(range(50_000), key=lambda i: (-float(score[i]), i))[:10]
    assert got == expected and got[:3] == [7, 31_000, 49_999]


def test_verl_option_names_map_to_the_correction_fields():
    config = RecomputeConfig.from_profile(
        "verl-0.8",
        rollout_is=None,
        rollout_rs="sequence",
        rollout_rs_threshold=1.5,
        rollout_rs_threshold_lower=0.8,
        rollout_is_threshold=3.0,
    )
    assert (
        config.rollout_is,
        config.rollout_rs,
        config.rollout_rs_upper,
        config.rollout_rs_lower,
        config.rollout_is_threshold,
    ) == ("none", "sequence", 1.5, 0.8, 3.0)


@pytest.mark.parametrize(
    "estimator",
    [
        {"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8},
        {"advantage_estimator": "reinforce_plus_plus", "gamma": 0.95},
        {"advantage_estimator": "rloo", "group_size_check": "any"},
        {"advantage_estimator": "dr_grpo"},
    ],
    ids=lambda e: e["advantage_estimator"],
)
def test_corrections_combine_with_every_estimator(estimator):
    case = algorithm_case(
        {
            **estimator,
            "rollout_is": "sequence",
            "rollout_rs": "token",
            "rollout_rs_upper": 3.0,
            "loss_agg_mode": "seq_mean_token_mean",
            "actor_version": 4,
            "mismatch_max_token_log_ratio": 5.0,
        },
        seed=35,
    )
    report = replay([source_of(case)])
    assert report.passed, report.render_text()
    assert {s.stage for s in report.stages} >= {"rollout.mismatch", "advantage.estimate", "loss.policy"}


def test_recorded_weights_without_a_configured_correction_are_a_problem_not_ignored():
    report = replay([_bundle(extra={"rollout_is_weights": torch.ones(6)})])
    assert report.first_divergent_stage == "rollout.mismatch"
    assert "config's rollout_is is 'none'" in report.stage("rollout.mismatch").message


def test_without_any_mismatch_no_token_is_listed_and_no_negative_zero_is_shown():
    source = _bundle()
    source.payloads["rollout_log_probs"] = _t(OLD)
    report = replay([source])
    entry = report.stage("rollout.mismatch")
    assert report.passed and entry.metrics["worst_tokens"] == []
    assert "metrics: kl_k1=0.0 kl_k3=0.0 log_ratio_max_abs=0.0" in report.render_text()
    assert "worst tokens" not in report.render_text()


def test_the_loss_takes_weights_and_rejection_over_the_pre_rejection_mask():
    """A bundle that records the mask after rejection as its loss mask and the one before as pre_rejection_mask
    gives the loss of the mask before; without the payload, the sequence weights over the mask after differ."""
    cfg = _config(
        rollout_is="sequence",
        rollout_is_threshold=10.0,
        rollout_rs="token_k1",
        rollout_rs_bounds={"token_k1": {"lower": 0.9, "upper": 2.0}},
    )
    before = _t(FLAT_MASK)
    after = mismatch.correction(mismatch.log_ratio(_t(OLD), _t(ROLLOUT)), before, _lengths(), cfg).mask
    # e^-0.25, e^-0.125 < 0.9 and e^1 > 2 rejected: sample 0 keeps one of its two tokens
    assert after.tolist() == [1, 0, 1, 0, 0, 0]

    def loss(mask: torch.Tensor, payloads: dict[str, torch.Tensor]) -> dict[str, float]:
        data = losses.PolicyLossData(
            _t([o + 0.1 for o in OLD]),
            _t(OLD),
            _t([1.0, -1.0, 0.5, 0.5, 0.5, -2.0]),
            torch.full((6,), 0.5),
            mask,
            _lengths(),
            rollout_log_probs=_t(ROLLOUT),
            payloads=payloads,
        )
        return losses.policy_loss_outputs(data, cfg, resolve_kernels(cfg))

    assert loss(after, {"pre_rejection_mask": before}) == loss(before, {})
    # sample 0's weight over the mask after is e^0.125, over the mask before e^-0.125
    assert loss(after, {})["pg_loss"] != pytest.approx(loss(before, {})["pg_loss"])
