"""The kernels against hand-computed values, including the canonical case's numbers."""

import math

import pytest
import torch

from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import kernels


def _normalize(rewards, groups, std=False):
    ids, keys = kernels.dense_group_ids(groups)
    return kernels.normalize_group_rewards(torch.tensor(rewards), ids, len(keys), std).tolist()


def test_dense_group_ids_number_groups_in_order_of_first_appearance():
    ids, keys = kernels.dense_group_ids([7, 3, 7, 5, 3])
    assert ids.tolist() == [0, 1, 0, 2, 1]
    assert keys == [7, 3, 5]


def test_group_normalization_canonical_correct_and_buggy():
    assert _normalize([1, 3, 10, 12], [0, 0, 1, 1]) == [-1.0, 1.0, -1.0, 1.0]
    # the PR #65 bug: the whole physical batch as one group, mean 6.5
    assert _normalize([1, 3, 10, 12], [0, 0, 0, 0]) == [-5.5, -3.5, 3.5, 5.5]


def test_group_normalization_follows_group_index_not_position():
    assert _normalize([1, 10, 3, 12], [0, 1, 0, 1]) == [-1.0, -1.0, 1.0, 1.0]


def test_std_normalization_is_unbiased_with_eps():
    out = _normalize([1.0, 3.0, 5.0], [0, 0, 0], std=True)
    # centered [-2, 0, 2], unbiased std 2
    assert out == pytest.approx([-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6)], rel=1e-6)
    assert torch.tensor(out).dtype == torch.float32


def test_std_normalization_of_a_group_of_one_is_nan():
    out = _normalize([4.0, 1.0, 3.0], [0, 1, 1], std=True)
    assert math.isnan(out[0])
    assert out[1:] == pytest.approx([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)], rel=1e-6)


@pytest.mark.parametrize("kl_type, expected", [
    ("k1", [-0.25, 0.5]),
    ("k2", [0.03125, 0.125]),
    ("k3", [math.exp(0.25) - 1 - 0.25, math.exp(-0.5) - 1 + 0.5]),
    ("low_var_kl", [math.exp(0.25) - 1 - 0.25, math.exp(-0.5) - 1 + 0.5]),
])
def test_kl_estimators(kl_type, expected):
    old, ref = torch.tensor([0.0, 0.5]), torch.tensor([0.25, 0.0])
    assert kernels.kl_estimate(old, ref, kl_type).tolist() == pytest.approx(expected, rel=1e-6)


def test_canonical_kl_is_minus_quarter_per_token():
    assert kernels.kl_estimate(torch.zeros(8), torch.full((8,), 0.25), "k1").tolist() == [-0.25] * 8


def test_low_var_kl_is_clamped_but_k3_is_not():
    old, ref = torch.tensor([-20.0]), torch.tensor([0.0])
    assert kernels.kl_estimate(old, ref, "low_var_kl").item() == 10.0
    assert kernels.kl_estimate(old, ref, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_unknown_kl_type_is_unsupported():
    with pytest.raises(UnsupportedError, match="kl_loss_type 'k4'"):
        kernels.kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_grpo_advantages_broadcast_each_reward_to_its_tokens():
    out = kernels.grpo_advantages(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([2, 0, 3]))
    assert out.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]


def test_reduction_is_a_sum_of_masked_per_sample_means():
    # sample 0: tokens [1, 2, 3] mask [1, 0, 1] -> 2; sample 1: fully masked out -> 0; sample 2: [4] -> 4
    values = torch.tensor([1.0, 2.0, 3.0, 9.0, 9.0, 4.0])
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.uint8)
    lengths = torch.tensor([3, 2, 1])
    assert kernels.sum_of_masked_means(values, mask, lengths) == 6.0


def _loss(current, advantages, **kw):
    n = len(advantages)
    params = dict(eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None, entropy_coef=0.01) | kw
    return kernels.policy_loss_outputs(
        torch.full((2 * n,), current), torch.zeros(2 * n), torch.tensor([a for a in advantages for _ in "xx"]),
        torch.full((2 * n,), 0.5), torch.ones(2 * n, dtype=torch.uint8), torch.full((n,), 2), **params)


def test_canonical_policy_loss_with_ratio_e_half():
    buggy, correct = _loss(0.5, [-5.5, -3.5, 3.5, 5.5]), _loss(0.5, [-1.0, 1.0, -1.0, 1.0])
    assert buggy["pg_loss"] == pytest.approx(4.038490, abs=2e-6)
    assert buggy["loss"] == pytest.approx(4.018490, abs=2e-6)
    assert correct["pg_loss"] == pytest.approx(0.897442, abs=2e-6)
    assert correct["loss"] == pytest.approx(0.877442, abs=2e-6)
    for out in (buggy, correct):
        assert out["pg_clipfrac"] == 2.0
        assert out["ppo_kl"] == pytest.approx(-2.0)
        assert out["entropy_loss"] == 2.0


def test_canonical_policy_loss_with_ratio_one_hides_the_bug():
    assert _loss(0.0, [-5.5, -3.5, 3.5, 5.5])["pg_loss"] == 0.0
    assert _loss(0.0, [-1.0, 1.0, -1.0, 1.0])["pg_loss"] == 0.0


def test_asymmetric_clip_uses_the_high_bound_for_ratios_above_one():
    ratio = math.exp(0.5)
    terms = kernels.ppo_policy_loss_tokens(torch.tensor([0.5, -0.5]), torch.zeros(2), torch.tensor([1.0, -1.0]),
                                           eps_clip=0.2, eps_clip_high=0.28)
    # A > 0, ratio e^0.5: clipped at 1.28; A < 0, ratio e^-0.5: clipped at 0.8, max keeps the larger -r*A
    assert terms.pg.tolist() == pytest.approx([-1.28, max(math.exp(-0.5), 0.8)], rel=1e-6)
    assert terms.clipfrac.tolist() == [1.0, 1.0]
    assert terms.ppo_kl.tolist() == [-0.5, 0.5]
    assert ratio > 1.28


def test_dual_clip_caps_negative_advantage_losses():
    log_probs, old, adv = torch.tensor([2.0, 2.0]), torch.zeros(2), torch.tensor([-1.0, 1.0])
    plain = kernels.ppo_policy_loss_tokens(log_probs, old, adv, 0.2, 0.2)
    dual = kernels.ppo_policy_loss_tokens(log_probs, old, adv, 0.2, 0.2, eps_clip_c=3.0)
    assert plain.pg[0].item() == pytest.approx(math.exp(2.0), rel=1e-6)
    assert dual.pg.tolist() == pytest.approx([3.0, -1.2], rel=1e-6)


def test_dual_clip_must_exceed_one():
    with pytest.raises(UnsupportedError, match="eps_clip_c"):
        kernels.ppo_policy_loss_tokens(torch.zeros(1), torch.zeros(1), torch.ones(1), 0.2, 0.2, eps_clip_c=1.0)
