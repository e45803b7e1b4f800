"""Every estimator, KL variant, policy loss and aggregation mode replayed against an independent float64 reference.

The random bundles come from `reference64.algorithm_case`: ragged responses, partial masks, one sample fully
masked out, prompt groups with interleaved members. Replay recomputes them with its float32 kernels; the
expected values are the reference's plain-Python loops.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.replay.conftest import source_of
from tests.replay.reference64 import (
    FULLY_MASKED,
    Settings,
    aggregate,
    algorithm_case,
    discounted_returns,
    gae,
    masked_whiten,
    post_process,
    token_position,
    token_rewards,
    token_with_mask,
)
from trajectory_replay.bundle.schema import RecomputeConfig, StageCapability, StageContract, StageId
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import estimators, kernels, losses, replay
from trajectory_replay.replay.fixtures import CanonicalCase
from trajectory_replay.replay.registry import resolve_kernels

KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")
ANY = {"group_size_check": "any"}
SINGLETON = {"singleton": True}
UNEVEN_GROUPS = (1, 1, 3, 4, 3, 1, 3, 4, 4, 4, 4, 3)
"""Groups of 3, 4 and 5 members."""
MICRO_BATCHES = {"micro_batches": ("mb-0",) * 5 + ("mb-1",) * 4 + ("mb-2",) * 3}
"""Three micro-batches of different sizes (the fully masked sample in the second)."""
PER_MICRO_BATCH = {"clip_metric_agg": "micro_batch_token_mean"}


def _matrix(*rows: tuple[str, dict[str, Any], dict[str, Any]]) -> list[Any]:
    """pytest params (config, builder options), each row with its own seed."""
    return [
        pytest.param(config, {"seed": 100 + i, **options}, id=name) for i, (name, config, options) in enumerate(rows)
    ]


MATRIX = _matrix(
    # every estimator
    ("grpo", {}, {}),
    ("grpo-std", {"grpo_std_normalization": True}, {}),
    ("grpo-std-biased", {"grpo_std_normalization": True, "std_unbiased": False}, {}),
    ("grpo-std-eps-0.1", {"grpo_std_normalization": True, "std_eps": 0.1}, {}),
    (
        "grpo-mask-advantages",
        {"grpo_std_normalization": True, "mask_advantages": True, "loss_agg_mode": "token_mean"},
        {},
    ),
    ("dr_grpo", {"advantage_estimator": "dr_grpo", "loss_agg_mode": "seq_mean_token_mean"}, {}),
    (
        "dr_grpo-mask-advantages",
        {"advantage_estimator": "dr_grpo", "mask_advantages": True, "loss_agg_mode": "seq_mean_token_sum"},
        {},
    ),
    ("rloo", {"advantage_estimator": "rloo", "loss_agg_mode": "token_mean", "loss_denominator": 80}, {}),
    (
        "rloo-mask-advantages-k2",
        {"advantage_estimator": "rloo", "mask_advantages": True, "kl_coef": 0.05, "kl_loss_type": "k2"},
        {},
    ),
    ("rloo-uneven-groups", {"advantage_estimator": "rloo", **ANY}, {"groups": UNEVEN_GROUPS}),
    ("rf++", {"advantage_estimator": "reinforce_plus_plus"}, {}),
    (
        "rf++-gamma-kl-in-reward",
        {"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9, "kl_coef": 0.1, "kl_in_reward": True},
        {},
    ),
    (
        "rf++-k3-in-reward-clamped",
        {
            "advantage_estimator": "reinforce_plus_plus",
            "kl_coef": 0.2,
            "kl_in_reward": True,
            "kl_loss_type": "k3",
            "kl_log_ratio_clamp": 0.3,
        },
        {},
    ),
    (
        "rf++-kl-not-in-reward",
        {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "kl_loss_type": "abs"},
        {},
    ),
    ("rf++-baseline", {"advantage_estimator": "reinforce_plus_plus_baseline"}, {}),
    (
        "rf++-baseline-gspo",
        {
            "advantage_estimator": "reinforce_plus_plus_baseline",
            "policy_loss": "gspo",
            "loss_agg_mode": "seq_mean_token_mean",
        },
        {},
    ),
    ("gae", {"advantage_estimator": "gae"}, {}),
    ("gae-gamma-lam", {"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, {}),
    (
        "gae-kl-in-reward",
        {
            "advantage_estimator": "gae",
            "gamma": 0.95,
            "lam": 0.9,
            "kl_coef": 0.1,
            "kl_in_reward": True,
            "kl_loss_type": "low_var_kl",
            "loss_agg_mode": "token_mean",
            "loss_denominator": 64,
            "loss_scale": 2.0,
            "cliprange_value": 0.1,
        },
        {},
    ),
    (
        "gae-sum-norm",
        {
            "advantage_estimator": "gae",
            "lam": 0.95,
            "loss_agg_mode": "seq_mean_token_sum_norm",
            "loss_scale_factor": 12.0,
        },
        {},
    ),
    (
        "gae-cispo-seq-mean",
        {
            "advantage_estimator": "gae",
            "gamma": 0.99,
            "policy_loss": "cispo",
            "loss_agg_mode": "seq_mean_token_mean",
            "loss_denominator": 16,
        },
        {},
    ),
    # every policy loss
    ("gspo-token-mean", {"policy_loss": "gspo", "loss_agg_mode": "token_mean"}, {}),
    (
        "gspo-tight-clip",
        {"policy_loss": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "loss_agg_mode": "seq_mean_token_mean"},
        {},
    ),
    ("gspo-ignores-ppo-clamps", {"policy_loss": "gspo", "ratio_log_clamp": 0.2, "eps_clip_c": 1.5}, {}),
    ("cispo", {"policy_loss": "cispo"}, {}),
    (
        "cispo-ratio-log-clamp",
        {"policy_loss": "cispo", "ratio_log_clamp": 0.2, "eps_clip_high": 5.0, "loss_agg_mode": "token_mean"},
        {},
    ),
    ("ppo-ratio-log-clamp", {"ratio_log_clamp": 0.2}, {}),
    ("ppo-dual-clip", {"grpo_std_normalization": True, "eps_clip_c": 1.5, "eps_clip_high": 0.28}, {}),
    # every aggregation mode, with and without the recorded denominator
    ("token-mean", {"loss_agg_mode": "token_mean"}, {}),
    ("seq-mean-token-mean-denominator", {"loss_agg_mode": "seq_mean_token_mean", "loss_denominator": 16}, {}),
    ("seq-mean-token-sum", {"loss_agg_mode": "seq_mean_token_sum"}, {}),
    ("seq-mean-token-sum-denominator", {"loss_agg_mode": "seq_mean_token_sum", "loss_denominator": 16}, {}),
    ("seq-mean-token-sum-norm", {"loss_agg_mode": "seq_mean_token_sum_norm", "loss_scale_factor": 6.0}, {}),
    ("seq-mean-token-sum-scaled", {"loss_agg_mode": "seq_mean_token_sum_scaled", "loss_scale_factor": 6.0}, {}),
    (
        "seq-mean-token-sum-scaled-denominator",
        {"loss_agg_mode": "seq_mean_token_sum_scaled", "loss_scale_factor": 6.0, "loss_denominator": 16},
        {},
    ),
    ("token-sum", {"loss_agg_mode": "token_sum", "loss_scale": 2.0}, {}),
    # the clip metrics as a token mean per micro-batch, whatever the mode
    ("clip-metrics-one-micro-batch", {**PER_MICRO_BATCH, "loss_agg_mode": "seq_mean_token_mean"}, {}),
    ("clip-metrics-per-micro-batch", {**PER_MICRO_BATCH, "loss_agg_mode": "token_mean"}, MICRO_BATCHES),
    (
        "clip-metrics-per-micro-batch-gae",
        {**PER_MICRO_BATCH, "advantage_estimator": "gae", "loss_agg_mode": "seq_mean_token_sum"},
        MICRO_BATCHES,
    ),
    ("clip-metrics-of-the-mode-with-micro-batches", {"loss_agg_mode": "seq_mean_token_mean"}, MICRO_BATCHES),
    # no entropy without an entropy term
    ("no-entropy", {"loss_agg_mode": "token_mean", "kl_loss_coef": 0.1}, {"entropy": False}),
    ("loss-scale", {"loss_scale": 0.25, "entropy_coef": 0.01, "kl_loss_coef": 0.05}, {}),
    # the KL loss with each estimator, and the two KL clamps
    *[
        (
            f"kl-loss-{k}",
            {"kl_loss_coef": 0.1, "kl_loss_estimator": k, "entropy_coef": 0.001, "loss_agg_mode": "token_mean"},
            {},
        )
        for k in KL_TYPES
    ],
    (
        "kl-clamps",
        {
            "kl_coef": 0.1,
            "kl_loss_type": "low_var_kl",
            "kl_log_ratio_clamp": 0.2,
            "kl_output_clamp": 0.01,
            "kl_loss_coef": 0.1,
            "kl_loss_estimator": "k2",
        },
        {},
    ),
    ("kl-output-clamp", {"kl_coef": 0.1, "kl_output_clamp": 0.1}, {}),
    # a prompt group of one
    ("grpo-singleton-unit", {"grpo_std_normalization": True, "singleton_group": "unit", **ANY}, SINGLETON),
    ("grpo-singleton-nan", {**ANY}, SINGLETON),
    ("grpo-singleton-nan-biased-std", {"grpo_std_normalization": True, "std_unbiased": False, **ANY}, SINGLETON),
    ("dr_grpo-singleton-nan", {"advantage_estimator": "dr_grpo", **ANY}, SINGLETON),
    ("rloo-singleton-unit", {"advantage_estimator": "rloo", "singleton_group": "unit", **ANY}, SINGLETON),
    (
        "rf++-baseline-singleton-unit",
        {"advantage_estimator": "reinforce_plus_plus_baseline", "singleton_group": "unit", **ANY},
        SINGLETON,
    ),
    # a response with no tokens at all
    ("gae-empty-response", {"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, {"empty_sample": True}),
    ("rf++-empty-response", {"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9}, {"empty_sample": True}),
    ("gspo-empty-response", {"policy_loss": "gspo", "loss_agg_mode": "seq_mean_token_mean"}, {"empty_sample": True}),
    # the running return carried over masked-out tokens, the KL in every outcome estimator's score, clamps per KL
    (
        "rf++-carry-gamma-kl-in-reward",
        {
            "advantage_estimator": "reinforce_plus_plus",
            "masked_return": "carry",
            "gamma": 0.9,
            "kl_coef": 0.1,
            "kl_in_reward": True,
        },
        {},
    ),
    (
        "rf++-carry-empty-response",
        {"advantage_estimator": "reinforce_plus_plus", "masked_return": "carry"},
        {"empty_sample": True},
    ),
    *[
        (
            f"{estimator}-kl-in-score",
            {
                "advantage_estimator": estimator,
                "grpo_std_normalization": True,
                "kl_coef": 0.2,
                "kl_in_reward": True,
                "kl_in_score": True,
                "kl_loss_type": "k3",
            },
            {},
        )
        for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
    ],
    (
        "kl-clamps-k3-only",
        {
            "kl_coef": 0.1,
            "kl_loss_type": "k1",
            "kl_log_ratio_clamp": 0.2,
            "kl_output_clamp": 0.01,
            "kl_clamped": ["k3", "low_var_kl"],
            "kl_loss_coef": 0.1,
            "kl_loss_estimator": "k3",
        },
        {},
    ),
)


def _statuses(report) -> dict[str, str]:
    """Each stage's status by stage name."""
    return {s.stage: s.status for s in report.stages}


@pytest.mark.parametrize("config, options", MATRIX)
def test_every_supported_combination_replays_clean(config, options):
    case = algorithm_case(config, **options)
    report = replay([source_of(case)])
    assert report.passed, report.render_text()
    contracted = [s.value for s in StageId if s in case.manifest.stage_contracts]
    assert _statuses(report) == dict.fromkeys(contracted, "pass")
    assert ("loss.value" in contracted) == (config.get("advantage_estimator") == "gae")


# --------------------------------------------------------------------------- every varied field matters


def _named_by_change(at: int, *rows: tuple) -> list[Any]:
    """pytest params named after the config fields their item `at` (a dict) changes."""
    return [pytest.param(*row, id="+".join(row[at])) for row in rows]


@pytest.mark.parametrize(
    "config, options, override, stage",
    _named_by_change(
        2,
        ({"grpo_std_normalization": True, "std_unbiased": False}, {}, {"std_unbiased": True}, "reward.post_process"),
        ({"grpo_std_normalization": True, "std_eps": 0.1}, {}, {"std_eps": 1e-6}, "reward.post_process"),
        (
            {"grpo_std_normalization": True, "singleton_group": "unit", **ANY},
            SINGLETON,
            {"singleton_group": "nan"},
            "reward.post_process",
        ),
        ({"advantage_estimator": "rloo"}, {}, {"advantage_estimator": "dr_grpo"}, "reward.post_process"),
        (
            {"kl_coef": 0.1, "kl_loss_type": "low_var_kl", "kl_log_ratio_clamp": 0.2},
            {},
            {"kl_log_ratio_clamp": None},
            "advantage.kl",
        ),
        ({"kl_coef": 0.1, "kl_output_clamp": 0.1}, {}, {"kl_output_clamp": None}, "advantage.kl"),
        (
            {"kl_coef": 0.1, "kl_output_clamp": 0.1, "kl_clamped": ["k3"]},
            {},
            {"kl_clamped": None},
            "advantage.kl",
        ),
        (
            {"kl_coef": 0.2, "kl_in_reward": True, "kl_in_score": True, "grpo_std_normalization": True},
            {},
            {"kl_in_score": False},
            "reward.post_process",
        ),
        (
            {"advantage_estimator": "rloo", "kl_coef": 0.2, "kl_in_reward": True, "kl_in_score": True},
            {},
            {"kl_coef": 0.1},
            "reward.post_process",
        ),
        (
            {"advantage_estimator": "reinforce_plus_plus", "masked_return": "carry"},
            {},
            {"masked_return": "restart"},
            "advantage.estimate",
        ),
        ({"mask_advantages": True}, {}, {"mask_advantages": False}, "advantage.estimate"),
        ({"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9}, {}, {"gamma": 1.0}, "advantage.estimate"),
        (
            {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "kl_in_reward": True},
            {},
            {"kl_in_reward": False},
            "advantage.estimate",
        ),
        ({"advantage_estimator": "gae", "lam": 0.8}, {}, {"lam": 1.0}, "advantage.estimate"),
        (
            {"advantage_estimator": "gae", "kl_coef": 0.1, "kl_in_reward": True},
            {},
            {"kl_coef": 0.2},
            "advantage.estimate",
        ),
        ({"ratio_log_clamp": 0.2}, {}, {"ratio_log_clamp": None}, "loss.policy"),
        ({"grpo_std_normalization": True, "eps_clip_c": 1.5}, {}, {"eps_clip_c": None}, "loss.policy"),
        ({"eps_clip_high": 0.28}, {}, {"eps_clip_high": 0.2}, "loss.policy"),
        ({"policy_loss": "gspo"}, {}, {"policy_loss": "ppo_clip"}, "loss.policy"),
        ({"policy_loss": "cispo"}, {}, {"policy_loss": "ppo_clip"}, "loss.policy"),
        ({"loss_agg_mode": "token_mean"}, {}, {"loss_agg_mode": "seq_mean_token_mean"}, "loss.policy"),
        ({"loss_agg_mode": "seq_mean_token_sum"}, {}, {"loss_denominator": 16}, "loss.policy"),
        ({"loss_scale": 0.25}, {}, {"loss_scale": 1.0}, "loss.policy"),
        (
            {"kl_loss_coef": 0.1, "kl_loss_estimator": "k3"},
            {},
            {"kl_loss_estimator": "low_var_kl", "kl_output_clamp": 0.01},
            "loss.policy",
        ),
        ({"advantage_estimator": "gae", "cliprange_value": 0.1}, {}, {"cliprange_value": 0.2}, "loss.value"),
    ),
)
def test_each_varied_field_changes_the_verdict(config, options, override, stage):
    """The matrix above would not notice a kernel that ignores a field unless its cases exercise that field."""
    source = source_of(algorithm_case(config, seed=7, **options))
    assert replay([source]).passed
    report = replay([source], overrides=override)
    assert report.first_divergent_stage == stage, report.render_text()


# --------------------------------------------------------------------------- worked by hand


def _rewards(raw, groups, **config):
    """(reference, replay) post-processed rewards."""
    cfg = RecomputeConfig(**config)
    ids, keys = kernels.dense_group_ids(groups)
    kernel = resolve_kernels(cfg).estimator
    ours = kernel.post_process(estimators.RewardInputs(torch.tensor(raw), ids, len(keys), cfg)).tolist()
    return post_process(raw, groups, Settings.of(config)), ours


def test_rloo_leaves_each_sample_out_of_its_baseline():
    # group [1, 2, 3, 6], sum 12: 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 3 - 9/3 = 0, 6 - 6/3 = 4
    for out in _rewards([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0], advantage_estimator="rloo"):
        assert out == pytest.approx([-8 / 3, -4 / 3, 0.0, 4.0], rel=1e-6, abs=1e-7)


def test_grpo_std_biased_and_unbiased():
    # [1, 3, 5]: centered [-2, 0, 2], squares sum to 8; unbiased std sqrt(8/2) = 2, biased sqrt(8/3) = 1.632993
    unbiased = 2 / (2 + 1e-6)
    biased = 2 / (math.sqrt(8 / 3) + 1e-6)
    assert biased == pytest.approx(1.224744, rel=1e-6)
    for out in _rewards([1.0, 3.0, 5.0], [4, 4, 4], grpo_std_normalization=True):
        assert out == pytest.approx([-unbiased, 0.0, unbiased], rel=1e-6)
    for out in _rewards([1.0, 3.0, 5.0], [4, 4, 4], grpo_std_normalization=True, std_unbiased=False):
        assert out == pytest.approx([-biased, 0.0, biased], rel=1e-6)


def test_singleton_group_nan_and_unit():
    # a group of one under nan: unbiased std 0/0 -> NaN; under unit: mean 0, std 1 -> 4 / (1 + 1e-6)
    for out in _rewards([4.0, 1.0, 3.0], [0, 1, 1], grpo_std_normalization=True):
        assert math.isnan(out[0])
    for out in _rewards([4.0, 1.0, 3.0], [0, 1, 1], grpo_std_normalization=True, singleton_group="unit"):
        assert out[0] == pytest.approx(4.0 / (1 + 1e-6), rel=1e-7)
    for out in _rewards([4.0, 1.0, 3.0], [0, 1, 1], advantage_estimator="rloo", singleton_group="unit"):
        assert out == pytest.approx([4.0, -2.0, 2.0])


GAE_VALUES, GAE_MASK = [0.5, 0.2, 0.4], [1, 0, 1]


def test_gae_three_tokens_with_a_masked_middle_token():
    # gamma .9, lam .8 (gamma * lam = .72), reward 1 at the last token, values [.5, .2, .4], mask [1, 0, 1]
    # t=2: delta = 1 - .4 = .6, A = .6; next value .4
    # t=1 (masked): its TD step is discarded; A and next value carry over: A = .6 (return .6 + .2 = .8)
    # t=0: delta = .9 * .4 - .5 = -.14, A = -.14 + .72 * .6 = .292 (return .792)
    raw_advantages, returns = [0.292, 0.6, 0.6], [0.792, 0.8, 1.0]
    # whitened over the masked tokens {.292, .6}: mean .446, unbiased var 2 * .154^2, so -+1/sqrt(2)
    d = 0.154
    scale = 1 / math.sqrt(2 * d * d + 1e-8)
    whitened = [-d * scale, d * scale, d * scale]
    assert whitened[0] == pytest.approx(-1 / math.sqrt(2), rel=1e-6)
    ref_raw, ref_returns = gae([[0.0, 0.0, 1.0]], [GAE_VALUES], [GAE_MASK], 0.9, 0.8)
    assert ref_raw[0] == pytest.approx(raw_advantages) and ref_returns[0] == pytest.approx(returns)
    assert masked_whiten(ref_raw, [GAE_MASK])[0] == pytest.approx(whitened)
    out = estimators.gae_advantages(
        estimators.AdvantageInputs(
            torch.tensor([1.0]),
            torch.tensor([3]),
            torch.tensor(GAE_MASK),
            RecomputeConfig(gamma=0.9, lam=0.8),
            values=torch.tensor(GAE_VALUES),
        )
    )
    assert out.advantages.tolist() == pytest.approx(whitened, rel=1e-5)
    assert out.returns.tolist() == pytest.approx(returns, rel=1e-6)


def test_reinforce_plus_plus_return_restarts_behind_a_masked_token():
    # gamma .5, reward 1 at the last token, mask [1, 0, 1]:
    # G2 = 1, G1 = 0 + .5 * m2 * G2 = .5, G0 = 0 + .5 * m1 * G1 = 0 (the masked G1 does not reach G0)
    # whitened over {G0, G2} = {0, 1}: mean .5, unbiased var .5 -> [-1/sqrt 2, (masked) 0, 1/sqrt 2]
    s = Settings.of({"advantage_estimator": "reinforce_plus_plus", "gamma": 0.5})
    rho = token_rewards([1.0], [GAE_MASK], [[0.0, 0.0, 0.0]], s)
    assert discounted_returns(rho, [GAE_MASK], 0.5) == [[0.0, 0.5, 1.0]]
    h = 1 / math.sqrt(2)
    out = estimators.reinforce_plus_plus_advantages(
        estimators.AdvantageInputs(
            torch.tensor([1.0]), torch.tensor([3]), torch.tensor(GAE_MASK), RecomputeConfig(gamma=0.5)
        )
    )
    assert out.advantages.tolist() == pytest.approx([-h, 0.0, h], rel=1e-6)


# two samples with tokens [1, 2, 3, (100)] and [10], and one fully masked out: sums 6 and 10 over T = 3 and 1
AGG_VALUES = [[1.0, 2.0, 3.0, 100.0], [10.0], [50.0, 50.0]]
AGG_MASKS = [[1, 1, 1, 0], [1], [0, 0]]


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"loss_agg_mode": "sum_of_sample_means"}, 2 + 10 + 0),  # the fully masked sample adds 0 / 1
        ({"loss_agg_mode": "token_mean"}, 16 / 4),  # all tokens alike: the long sample weighs more
        ({"loss_agg_mode": "token_mean", "loss_denominator": 8}, 16 / 8),
        ({"loss_agg_mode": "seq_mean_token_mean"}, (2 + 10) / 2),  # every sequence alike; T = 0 not counted
        ({"loss_agg_mode": "seq_mean_token_mean", "loss_denominator": 4}, (2 + 10) / 4),
        ({"loss_agg_mode": "seq_mean_token_sum"}, (6 + 10) / 2),
        ({"loss_agg_mode": "seq_mean_token_sum", "loss_denominator": 4}, (6 + 10) / 4),
        ({"loss_agg_mode": "seq_mean_token_sum_norm", "loss_scale_factor": 8}, 16 / 8),
    ],
)
def test_aggregation_modes_on_two_samples(config, expected):
    assert aggregate(AGG_VALUES, AGG_MASKS, Settings.of(config)) == pytest.approx(expected, rel=1e-8)
    # replay's aggregation of the entropy (pg is 0: ratio 1, advantages 0)
    cfg = RecomputeConfig(**config)
    flat = torch.tensor([v for row in AGG_VALUES for v in row])
    n = flat.numel()
    data = losses.PolicyLossData(
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n),
        flat,
        torch.tensor([m for row in AGG_MASKS for m in row]),
        torch.tensor([4, 1, 2]),
    )
    out = losses.policy_loss_outputs(data, cfg, resolve_kernels(cfg))
    assert out["entropy_loss"] == pytest.approx(expected, rel=1e-8)
    assert out["pg_loss"] == 0.0


# --------------------------------------------------------------------------- a fault is found where it is

SEED = 11


def _with_payload(case: CanonicalCase, name: str, sample: int, offset: int, delta: float) -> CanonicalCase:
    """`case` with one token of payload `name` moved by `delta`."""
    faulty = case.payloads[name].clone()
    faulty[token_position(case.index, sample, offset)] += delta
    return case._replace(payloads={**case.payloads, name: faulty})


def _only_failure(report, stage: str):
    """The result of `stage`, after checking it is the only stage that failed."""
    assert report.first_divergent_stage == stage, report.render_text()
    assert [s.stage for s in report.stages if s.failed] == [stage], report.render_text()
    return report.stage(stage)


@pytest.mark.parametrize(
    "config, sample",
    [
        ({"grpo_std_normalization": True}, 8),
        ({"advantage_estimator": "rloo"}, 3),
    ],
)
def test_a_wrong_expected_reward_is_located_at_reward_post_process(config, sample):
    case = algorithm_case(config, seed=SEED)
    case.expected["reward.post_process"]["rewards"][sample] += 0.5
    result = _only_failure(replay([source_of(case)]), "reward.post_process")
    assert [(d.field, d.sample_id, d.token_offset) for d in result.divergences] == [("reward", f"a-{sample}", None)]


@pytest.mark.parametrize(
    "config, payload, sample, stage",
    [
        ({"kl_coef": 0.1, "kl_loss_type": "k3"}, "kl", 4, "advantage.kl"),
        ({"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "kl_in_reward": True}, "kl", 9, "advantage.kl"),
        ({"advantage_estimator": "gae", "kl_coef": 0.1, "kl_in_reward": True}, "kl", 4, "advantage.kl"),
        ({"grpo_std_normalization": True}, "advantages", 10, "advantage.estimate"),
        ({"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9}, "advantages", 3, "advantage.estimate"),
        ({"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, "advantages", 8, "advantage.estimate"),
        ({"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, "returns", 5, "advantage.estimate"),
    ],
)
def test_a_single_token_fault_is_located_at_its_stage_sample_and_token(config, payload, sample, stage):
    case = algorithm_case(config, seed=SEED)
    offset = case.index.samples[sample].response_length - 1
    assert offset > 0  # the offset inside the response is checked, not only the sample
    result = _only_failure(replay([source_of(_with_payload(case, payload, sample, offset, 0.5))]), stage)
    assert result.mismatch_count == 1
    assert [(d.field, d.sample_id, d.token_offset) for d in result.divergences] == [(payload, f"a-{sample}", offset)]


def test_a_kl_fault_at_a_masked_out_token_is_no_divergence():
    """The reward-side KL of a masked-out token reaches no reward: advantage.kl compares only masked-in tokens."""
    case = algorithm_case({"advantage_estimator": "gae", "kl_coef": 0.1, "kl_in_reward": True}, seed=SEED)
    offset = token_with_mask(case.index, 4, masked_in=False)
    assert replay([source_of(_with_payload(case, "kl", 4, offset, 0.5))]).passed
    assert replay([source_of(_with_payload(case, "kl", FULLY_MASKED, 0, 0.5))]).passed


KL_IN_SCORE = {"advantage_estimator": "rloo", "kl_coef": 0.1, "kl_in_reward": True, "kl_in_score": True}


def test_with_the_kl_in_the_score_a_wrong_coefficient_shows_first_at_reward_post_process():
    """Production's coefficient differs from the recorded kl_coef (an adaptive one left unrecorded): the KL itself
    matches, each sample's reward does not."""
    case = algorithm_case({**KL_IN_SCORE, "kl_coef": 0.12}, seed=SEED)
    case.index.config.kl_coef = 0.1
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "reward.post_process", report.render_text()
    assert {d.field for d in report.stage("reward.post_process").divergences} == {"reward"}
    assert report.stage("advantage.kl").status == "pass"


def test_with_the_kl_in_the_score_a_recorded_kl_token_is_checked_at_advantage_kl():
    """Post-processing takes production's recorded KL; advantage.kl names the token where it departs from the
    log-probs, and the sample whose reward it moved diverges at post-processing."""
    case = algorithm_case(KL_IN_SCORE, seed=SEED)
    offset = token_with_mask(case.index, 9)
    report = replay([source_of(_with_payload(case, "kl", 9, offset, 0.5))])
    assert [s.stage for s in report.stages if s.failed][:2] == ["reward.post_process", "advantage.kl"]
    kl = report.stage("advantage.kl")
    assert [(d.field, d.sample_id, d.token_offset) for d in kl.divergences] == [("kl", "a-9", offset)]
    assert ("reward", "a-9") in {(d.field, d.sample_id) for d in report.stage("reward.post_process").divergences}


LOSS_ONLY = (StageId.SAMPLE, StageId.LOSS_POLICY)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo", "cispo"])
def test_a_current_log_prob_fault_shows_at_loss_policy_only_on_a_masked_token(policy_loss):
    case = algorithm_case({"policy_loss": policy_loss, "kl_loss_coef": 0.1}, seed=SEED, stages=LOSS_ONLY)
    assert replay([source_of(case)]).passed
    masked_in = _with_payload(case, "log_probs", 4, token_with_mask(case.index, 4), 0.5)
    result = _only_failure(replay([source_of(masked_in)]), "loss.policy")
    fields = {d.field for d in result.divergences}
    assert {"loss", "ppo_kl", "kl_loss"} <= fields
    assert {(d.sample_id, d.token_offset) for d in result.divergences} == {(None, None)}  # cohort-level scalars
    masked_out = _with_payload(case, "log_probs", 4, token_with_mask(case.index, 4, masked_in=False), 0.5)
    assert replay([source_of(masked_out)]).passed


def test_a_value_prediction_fault_shows_at_loss_value_only_on_a_masked_token():
    case = algorithm_case({"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, seed=SEED)
    masked_in = _with_payload(case, "vpreds", 4, token_with_mask(case.index, 4), 5.0)
    result = _only_failure(replay([source_of(masked_in)]), "loss.value")
    assert "vf_loss" in {d.field for d in result.divergences}
    assert {(d.sample_id, d.token_offset) for d in result.divergences} == {(None, None)}
    masked_out = _with_payload(case, "vpreds", 4, token_with_mask(case.index, 4, masked_in=False), 5.0)
    assert replay([source_of(masked_out)]).passed


def test_without_advantage_kl_the_token_rewards_take_the_recorded_kl():
    config = {"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9, "kl_coef": 0.1, "kl_in_reward": True}
    case = algorithm_case(
        config,
        seed=SEED,
        stages=tuple(
            s for s in StageId if s not in (StageId.ADVANTAGE_KL, StageId.ROLLOUT_MISMATCH, StageId.LOSS_VALUE)
        ),
    )
    assert replay([source_of(case)]).passed
    faulty = _with_payload(case, "kl", 4, token_with_mask(case.index, 4), 0.5)
    report = replay([source_of(faulty)])
    # the recorded kl is an input here, not a value checked: the advantages it feeds diverge (cohort-wide, since
    # the returns are whitened together), and the loss computed from them
    assert report.first_divergent_stage == "advantage.estimate"
    # a masked-out token's reward never reaches a masked-in token's return
    assert replay([source_of(_with_payload(case, "kl", 4, token_with_mask(case.index, 4, False), 0.5))]).passed


def test_a_loss_only_gae_bundle_reads_the_recorded_returns():
    case = algorithm_case(
        {"advantage_estimator": "gae", "lam": 0.9},
        seed=SEED,
        stages=(StageId.SAMPLE, StageId.LOSS_POLICY, StageId.LOSS_VALUE),
    )
    assert _statuses(replay([source_of(case)])) == {"sample": "pass", "loss.policy": "pass", "loss.value": "pass"}
    faulty = _with_payload(case, "returns", 4, token_with_mask(case.index, 4), 3.0)
    _only_failure(replay([source_of(faulty)]), "loss.value")
    with pytest.raises(UnsupportedError, match="needs payload 'returns'"):
        replay([source_of(_without(case, "returns"))])


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_singleton_under_the_literal_convention_is_reported_not_hidden(estimator):
    config = {"advantage_estimator": estimator, "grpo_std_normalization": True, **ANY}
    case = algorithm_case(config, seed=SEED, singleton=True)
    singleton = f"a-{len(case.index.samples) - 1}"
    assert math.isnan(case.expected["reward.post_process"]["rewards"][-1])
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "reward.post_process"
    message = report.stage("reward.post_process").message
    assert "nan" in message and singleton in message


def test_group_sizes_are_checked_for_grouped_estimators_only():
    uneven = {"n_samples_per_prompt": 4, "advantage_estimator": "grpo"}
    report = replay([source_of(algorithm_case(uneven, seed=SEED, groups=UNEVEN_GROUPS))])
    assert report.first_divergent_stage == "reward.post_process"
    message = report.stage("reward.post_process").message
    assert "reward group g-1 has 3 samples, expected 4" in message and "g-4 has 5 samples" in message
    for estimator in ("reinforce_plus_plus", "gae"):
        for groups in (UNEVEN_GROUPS, (None,) * 12):
            case = algorithm_case({**uneven, "advantage_estimator": estimator}, seed=SEED, groups=groups)
            assert replay([source_of(case)]).passed, estimator
    ungrouped = algorithm_case({"advantage_estimator": "rloo"}, seed=SEED, groups=(None,) * 12)
    assert "sample a-0 has no group_index" in replay([source_of(ungrouped)]).stage("reward.post_process").message


# --------------------------------------------------------------------------- what replay refuses


def _refused(config: dict[str, Any], **change: Any) -> str:
    """The UnsupportedError message of replaying a valid `config` case whose recorded config is then changed;
    nothing may be loaded before the refusal."""
    case = algorithm_case(config, seed=SEED)
    for field, value in change.items():
        setattr(case.index.config, field, value)
    source = source_of(case)
    with pytest.raises(UnsupportedError) as refused:
        replay([source])
    assert source.loads == []
    return str(refused.value)


@pytest.mark.parametrize(
    "config, change, says",
    _named_by_change(
        1,
        ({}, {"advantage_estimator": "ppo"}, "unsupported advantage_estimator 'ppo'"),
        ({}, {"policy_loss": "dapo"}, "unsupported policy_loss 'dapo'"),
        ({}, {"loss_agg_mode": "token_max"}, "unsupported loss_agg_mode 'token_max'"),
        ({"kl_coef": 0.1}, {"kl_loss_type": "k4"}, "unsupported kl_loss_type 'k4'"),
        ({"kl_loss_coef": 0.1}, {"kl_loss_estimator": "mse"}, "unsupported kl_loss_estimator 'mse'"),
        ({}, {"singleton_group": "zero"}, "unsupported singleton_group 'zero'"),
        ({}, {"group_size_check": "at_least"}, "unsupported group_size_check 'at_least'"),
        ({}, {"loss_agg_mode": "seq_mean_token_sum_norm"}, "'seq_mean_token_sum_norm' needs loss_scale_factor"),
        ({}, {"loss_agg_mode": "seq_mean_token_sum_scaled"}, "'seq_mean_token_sum_scaled' needs loss_scale_factor"),
        ({}, {"clip_metric_agg": "token_mean"}, "unsupported clip_metric_agg 'token_mean'"),
        ({}, {"loss_agg_mode": "token_mean", "loss_denominator": 0}, "unsupported loss_denominator 0"),
        ({}, {"eps_clip_c": 1.0}, "unsupported eps_clip_c 1.0"),
    ),
)
def test_an_unsupported_config_value_is_refused_naming_the_field(config, change, says):
    assert says in _refused(config, **change)


def test_a_name_no_running_stage_uses_is_not_refused():
    case = algorithm_case({}, seed=SEED, stages=(StageId.SAMPLE, StageId.REWARD_RAW, StageId.REWARD_POST_PROCESS))
    case.index.config.policy_loss = "dapo"
    case.index.config.loss_agg_mode = "token_sum"
    assert replay([source_of(case)]).passed


def _without(case: CanonicalCase, *names: str) -> CanonicalCase:
    """`case` without the named payloads."""
    return case._replace(payloads={k: v for k, v in case.payloads.items() if k not in names})


def test_gae_without_values_is_refused_naming_the_payload():
    case = _without(algorithm_case({"advantage_estimator": "gae"}, seed=SEED), "values")
    with pytest.raises(UnsupportedError, match="advantage_estimator=gae needs payload 'values'"):
        replay([source_of(case)])


def test_loss_value_without_vpreds_is_refused_naming_the_payload():
    case = _without(algorithm_case({"advantage_estimator": "gae"}, seed=SEED), "vpreds")
    with pytest.raises(UnsupportedError, match="loss.value needs payload 'vpreds'"):
        replay([source_of(case)])


def test_context_parallelism_is_refused():
    case = algorithm_case({"advantage_estimator": "gae"}, seed=SEED)
    case.index.identity.rank.cp = 2
    with pytest.raises(UnsupportedError, match="unsupported replay topology: cp=2"):
        replay([source_of(case)])


def _declared(case: CanonicalCase, stage: StageId, capability: StageCapability) -> CanonicalCase:
    """`case` with the contract of `stage` declaring `capability`."""
    contracts = {**case.manifest.stage_contracts, stage: StageContract(stage=stage, capability=capability)}
    return case._replace(manifest=case.manifest.model_copy(update={"stage_contracts": contracts}))


@pytest.mark.parametrize(
    "capability", [StageCapability.UNSUPPORTED, StageCapability.INSPECT_ONLY, StageCapability.RECORDED_ONLY]
)
def test_a_loss_stage_the_bundle_declares_not_replayable_is_skipped_never_failed(capability):
    gae_case = algorithm_case({"advantage_estimator": "gae"}, seed=SEED)
    # loss.value without its payloads and with a wrong expected value: it would be refused or fail if it ran
    gae_case.expected["loss.value"]["vf_loss"] += 1.0
    report = replay([source_of(_without(_declared(gae_case, StageId.LOSS_VALUE, capability), "vpreds"))])
    assert report.passed and report.stage("loss.value").status == "skipped"
    assert f"capability={capability.value}" in report.stage("loss.value").message
    grpo_case = algorithm_case({"loss_agg_mode": "token_mean"}, seed=SEED)
    grpo_case.expected["loss.policy"]["pg_loss"] += 1.0
    report = replay([source_of(_declared(grpo_case, StageId.LOSS_POLICY, capability))])
    assert report.passed and report.stage("loss.policy").status == "skipped"


def test_a_recorded_only_estimate_hands_its_recorded_returns_to_loss_value():
    case = algorithm_case({"advantage_estimator": "gae", "gamma": 0.9, "lam": 0.8}, seed=SEED)
    recorded = _declared(case, StageId.ADVANTAGE_ESTIMATE, StageCapability.RECORDED_ONLY)
    report = replay([source_of(recorded)])
    assert report.passed and report.stage("advantage.estimate").status == "skipped"
    assert report.stage("loss.value").status == "pass" and report.stage("loss.policy").status == "pass"
    # now loss.value reads the payload: a fault in it shows there, and nowhere earlier
    faulty = _with_payload(recorded, "returns", 4, token_with_mask(case.index, 4), 3.0)
    assert _only_failure(replay([source_of(faulty)]), "loss.value").status == "fail"


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_whitened_advantages_are_skipped_under_a_partial_selection_and_checked_on_the_whole(estimator):
    """Whitening spans the whole cohort: recomputing it on the selected samples alone would report a divergence
    where there is none, so the stage says why it did not run instead."""
    source = source_of(algorithm_case({"advantage_estimator": estimator, "kl_coef": 0.1}))
    report = replay([source], samples=[source.index.samples[0].sample_id])
    estimate = report.stage("advantage.estimate")
    assert estimate.status == "skipped" and "whitened over the whole cohort" in estimate.message
    assert report.passed and report.stage("reward.post_process").status == "pass"
    assert replay([source]).stage("advantage.estimate").status == "pass"
