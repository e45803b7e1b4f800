"""The kernels one function at a time against hand-computed values, including the canonical case's numbers."""

import math

import pytest
import torch

from trajectory_replay.bundle.schema import RecomputeConfig
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import estimators, kernels, losses
from trajectory_replay.replay.registry import resolve_kernels


def _post(rewards, groups, **config):
    """Post-processed rewards of the config's estimator (grpo unless named)."""
    cfg = RecomputeConfig(**config)
    ids, keys = kernels.dense_group_ids(groups)
    kernel = resolve_kernels(cfg).estimator
    return kernel.post_process(estimators.RewardInputs(torch.tensor(rewards), ids, len(keys), cfg))


def test_dense_group_ids_number_groups_in_order_of_first_appearance():
    ids, keys = kernels.dense_group_ids([7, 3, 7, 5, 3])
    assert ids.tolist() == [0, 1, 0, 2, 1]
    assert keys == [7, 3, 5]


def test_group_normalization_canonical_correct_and_buggy():
    assert _post([1, 3, 10, 12], [0, 0, 1, 1]).tolist() == [-1.0, 1.0, -1.0, 1.0]
    # the PR #65 bug: the whole physical batch as one group, mean 6.5
    assert _post([1, 3, 10, 12], [0, 0, 0, 0]).tolist() == [-5.5, -3.5, 3.5, 5.5]


def test_group_normalization_follows_group_index_not_position():
    assert _post([1, 10, 3, 12], [0, 1, 0, 1]).tolist() == [-1.0, -1.0, 1.0, 1.0]


def test_std_normalization_is_unbiased_with_eps_in_float32():
    out = _post([1.0, 3.0, 5.0], [0, 0, 0], grpo_std_normalization=True)
    # centered [-2, 0, 2], unbiased std 2
    assert out.tolist() == pytest.approx([-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6)], rel=1e-6)
    assert out.dtype == torch.float32


def test_std_normalization_of_a_group_of_one_is_nan_by_default_and_unit_under_verl_convention():
    literal = _post([4.0, 1.0, 3.0], [0, 1, 1], grpo_std_normalization=True)
    assert math.isnan(literal[0])
    assert literal[1:].tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)], rel=1e-6)
    unit = _post([4.0, 1.0, 3.0], [0, 1, 1], grpo_std_normalization=True, singleton_group="unit")
    assert unit[0].item() == pytest.approx(4.0 / (1 + 1e-6), rel=1e-6)  # mean 0, std 1
    assert unit[1:].tolist() == literal[1:].tolist()


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("dr_grpo", [0.0, -1.0, 1.0]),
        ("reinforce_plus_plus_baseline", [0.0, -1.0, 1.0]),
        ("rloo", [math.nan, -2.0, 2.0]),
        ("reinforce_plus_plus", [4.0, 1.0, 3.0]),
        ("gae", [4.0, 1.0, 3.0]),
    ],
)
def test_baselines_with_a_group_of_one_under_the_literal_convention(estimator, expected):
    out = _post([4.0, 1.0, 3.0], [0, 1, 1], advantage_estimator=estimator, group_size_check="any")
    assert out.tolist() == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize(
    "kl_type, expected",
    [
        ("k1", [-0.25, 0.5]),
        ("k2", [0.03125, 0.125]),
        ("k3", [math.exp(0.25) - 1 - 0.25, math.exp(-0.5) - 1 + 0.5]),
        ("low_var_kl", [math.exp(0.25) - 1 - 0.25, math.exp(-0.5) - 1 + 0.5]),
        ("abs", [0.25, 0.5]),
    ],
)
def test_kl_estimators(kl_type, expected):
    old, ref = torch.tensor([0.0, 0.5]), torch.tensor([0.25, 0.0])
    assert kernels.kl_estimate(old, ref, kl_type).tolist() == pytest.approx(expected, rel=1e-6)


def test_canonical_kl_is_minus_quarter_per_token():
    assert kernels.kl_estimate(torch.zeros(8), torch.full((8,), 0.25), "k1").tolist() == [-0.25] * 8


def test_low_var_kl_is_clamped_but_k3_is_not():
    old, ref = torch.tensor([-20.0]), torch.tensor([0.0])
    assert kernels.kl_estimate(old, ref, "low_var_kl").item() == 10.0
    assert kernels.kl_estimate(old, ref, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_kl_clamps_apply_to_the_log_ratio_first_and_to_the_estimate_last():
    old, ref = torch.tensor([2.0, -0.1]), torch.tensor([0.0, 0.0])
    # d = [2, -0.1] clamped to [1, -0.1]: k2 [0.5, 0.005]; then the estimate clamped to 0.2
    assert kernels.kl_estimate(old, ref, "k2", log_ratio_clamp=1.0).tolist() == pytest.approx([0.5, 0.005])
    assert kernels.kl_estimate(old, ref, "k2", 1.0, 0.2).tolist() == pytest.approx([0.2, 0.005])
    assert kernels.kl_estimate(old, ref, "k1", output_clamp=0.05).tolist() == pytest.approx([0.05, -0.05])


def test_unknown_kl_type_is_unsupported_naming_the_field():
    with pytest.raises(UnsupportedError, match="kl_loss_type 'k4'"):
        kernels.kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(UnsupportedError, match="kl_loss_estimator 'mse'"):
        kernels.check_kl_type("mse", "kl_loss_estimator")


def _advantage_inputs(rewards, lengths, mask, **config):
    """AdvantageInputs from plain lists."""
    return estimators.AdvantageInputs(
        torch.tensor(rewards), torch.tensor(lengths), torch.tensor(mask, dtype=torch.uint8), RecomputeConfig(**config)
    )


def test_outcome_advantages_broadcast_each_reward_to_its_tokens():
    inputs = _advantage_inputs([1.0, -2.0, 3.0], [2, 0, 3], [1, 0, 1, 1, 0])
    assert estimators.outcome_advantages(inputs).advantages.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    masked = _advantage_inputs([1.0, -2.0, 3.0], [2, 0, 3], [1, 0, 1, 1, 0], mask_advantages=True)
    assert estimators.outcome_advantages(masked).advantages.tolist() == [1.0, 0.0, 3.0, 3.0, 0.0]


def test_token_rewards_put_the_reward_on_the_last_token_and_skip_empty_responses():
    inputs = _advantage_inputs([1.0, 5.0, 2.0], [2, 0, 3], [1, 1, 1, 0, 0], kl_coef=0.5)
    assert estimators.token_rewards(inputs).tolist() == [0.0, 1.0, 0.0, 0.0, 2.0]
    with_kl = estimators.AdvantageInputs(
        inputs.rewards, inputs.lengths, inputs.mask, inputs.config, kl=torch.tensor([0.2, 0.4, 0.2, 0.4, 0.6])
    )
    # -0.5 * kl on the masked tokens only
    assert estimators.token_rewards(with_kl).tolist() == pytest.approx([-0.1, 0.8, -0.1, 0.0, 2.0])


def test_masked_whiten_uses_the_unbiased_variance_of_the_masked_tokens_and_whitens_every_token():
    values, mask = torch.tensor([1.0, 3.0, 100.0, 5.0]), torch.tensor([1, 1, 0, 1])
    out = kernels.masked_whiten(values, mask)
    # masked values [1, 3, 5]: mean 3, unbiased var 4
    assert out.tolist() == pytest.approx([-1.0, 0.0, 97 / 2, 1.0], rel=1e-6)


def test_sum_of_sample_means_is_a_sum_of_masked_per_sample_means():
    # sample 0: tokens [1, 2, 3] mask [1, 0, 1] -> 2; sample 1: fully masked out -> 0; sample 2: [4] -> 4
    values = torch.tensor([1.0, 2.0, 3.0, 9.0, 9.0, 4.0])
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.uint8)
    lengths = torch.tensor([3, 2, 1])
    sums = kernels.masked_sample_sums(values, mask, lengths)
    weights = losses.sum_of_sample_means_weights(kernels.token_counts(mask, lengths), RecomputeConfig())
    assert float((sums * weights).sum()) == 6.0


def _loss(current, advantages, **config):
    """The canonical loss.policy scalars: two fully masked-in tokens per advantage, old log-prob 0, entropy .5."""
    n = len(advantages)
    cfg = RecomputeConfig(**{"eps_clip": 0.2, "eps_clip_high": 0.2, "entropy_coef": 0.01, **config})
    data = losses.PolicyLossData(
        torch.full((2 * n,), current),
        torch.zeros(2 * n),
        torch.tensor([a for a in advantages for _ in "xx"]),
        torch.full((2 * n,), 0.5),
        torch.ones(2 * n, dtype=torch.uint8),
        torch.full((n,), 2),
    )
    return losses.policy_loss_outputs(data, cfg, resolve_kernels(cfg))


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
        assert "kl_loss" not in out


def test_canonical_policy_loss_with_ratio_one_hides_the_bug():
    assert _loss(0.0, [-5.5, -3.5, 3.5, 5.5])["pg_loss"] == 0.0
    assert _loss(0.0, [-1.0, 1.0, -1.0, 1.0])["pg_loss"] == 0.0


def test_loss_scale_multiplies_the_loss_terms_not_the_metrics():
    plain, scaled = _loss(0.5, [-1.0, 1.0, -1.0, 1.0]), _loss(0.5, [-1.0, 1.0, -1.0, 1.0], loss_scale=4.0)
    for term in ("pg_loss", "entropy_loss", "loss"):
        assert scaled[term] == pytest.approx(4 * plain[term], rel=1e-6)
    assert (scaled["pg_clipfrac"], scaled["ppo_kl"]) == (plain["pg_clipfrac"], plain["ppo_kl"])


def test_the_loss_does_not_depend_on_how_samples_are_blocked(monkeypatch):
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 1, 4, 2, 5])
    n = int(lengths.sum())
    cfg = RecomputeConfig(loss_agg_mode="seq_mean_token_mean", kl_loss_coef=0.1)
    data = losses.PolicyLossData(
        torch.randn(n, generator=g) * 0.3 - 1,
        torch.randn(n, generator=g) * 0.3 - 1,
        torch.randn(n, generator=g),
        torch.rand(n, generator=g),
        (torch.rand(n, generator=g) < 0.7).to(torch.uint8),
        lengths,
        torch.randn(n, generator=g) * 0.3 - 1,
    )
    whole = losses.policy_loss_outputs(data, cfg, resolve_kernels(cfg))
    monkeypatch.setattr(losses, "BLOCK_TOKENS", 4)
    blocked = losses.policy_loss_outputs(data, cfg, resolve_kernels(cfg))
    assert blocked.keys() == whole.keys() and set(whole) >= {"kl_loss", "loss"}
    assert blocked == pytest.approx(whole, rel=1e-12)


def _policy_inputs(log_probs, advantages, old=None, lengths=None, mask=None, **config):
    """PolicyInputs from plain lists: old log-probs 0, one fully masked-in sample unless given."""
    n = len(log_probs)
    return losses.PolicyInputs(
        torch.tensor(log_probs),
        torch.tensor(old if old is not None else [0.0] * n),
        torch.tensor(advantages),
        torch.tensor(mask if mask is not None else [1] * n),
        torch.tensor(lengths if lengths is not None else [n]),
        RecomputeConfig(**config),
    )


def test_asymmetric_clip_uses_the_high_bound_for_ratios_above_one():
    terms = losses.ppo_clip_tokens(_policy_inputs([0.5, -0.5], [1.0, -1.0], eps_clip_high=0.28))
    # A > 0, ratio e^0.5 > 1.28: clipped at 1.28; A < 0, ratio e^-0.5 < 0.8: max keeps the larger -r*A
    assert terms.pg.tolist() == pytest.approx([-1.28, max(math.exp(-0.5), 0.8)], rel=1e-6)
    assert terms.clipfrac.tolist() == [True, True]
    assert terms.ppo_kl.tolist() == [-0.5, 0.5]


def test_dual_clip_caps_negative_advantage_losses():
    plain = losses.ppo_clip_tokens(_policy_inputs([2.0, 2.0], [-1.0, 1.0]))
    dual = losses.ppo_clip_tokens(_policy_inputs([2.0, 2.0], [-1.0, 1.0], eps_clip_c=3.0))
    assert plain.pg[0].item() == pytest.approx(math.exp(2.0), rel=1e-6)
    assert dual.pg.tolist() == pytest.approx([3.0, -1.2], rel=1e-6)


def test_ratio_log_clamp_bounds_the_ratio_and_the_reported_ppo_kl():
    terms = losses.ppo_clip_tokens(_policy_inputs([3.0, 0.1], [-1.0, -1.0], ratio_log_clamp=1.0))
    assert terms.pg.tolist() == pytest.approx([math.e, math.exp(0.1)], rel=1e-6)
    assert terms.ppo_kl.tolist() == pytest.approx([-1.0, -0.1])


def test_gspo_uses_one_ratio_per_sequence_from_its_masked_mean_log_ratio():
    # sample 0: masked log ratios [0.2, 0.4] (the 3.0 is masked out) -> s = e^0.3; sample 1: fully masked -> s = 1
    inputs = _policy_inputs(
        [0.2, 3.0, 0.4, 5.0], [1.0, 1.0, -1.0, 2.0], lengths=[3, 1], mask=[1, 0, 1, 0], eps_clip_high=0.5
    )
    terms = losses.gspo_tokens(inputs)
    s = math.exp(0.3)
    assert terms.pg.tolist() == pytest.approx([-s, -s, s, -2.0], rel=1e-6)
    assert terms.clipfrac.tolist() == [False, False, False, False]
    assert terms.ppo_kl.tolist() == pytest.approx([-0.2, -3.0, -0.4, -5.0])  # per token, unclamped


def test_gspo_caps_the_sequence_log_ratio_at_ten():
    terms = losses.gspo_tokens(_policy_inputs([12.0, 14.0], [-1.0, -1.0]))
    assert terms.pg.tolist() == pytest.approx([math.exp(10.0)] * 2, rel=1e-6)


def test_gspo_ignores_the_ppo_ratio_clamp_and_dual_clip():
    terms = losses.gspo_tokens(_policy_inputs([3.0], [-1.0], ratio_log_clamp=1.0, eps_clip_c=2.0))
    assert terms.pg.item() == pytest.approx(math.exp(3.0), rel=1e-6)
    assert terms.ppo_kl.item() == -3.0


def test_cispo_weights_the_log_prob_by_the_clipped_ratio():
    terms = losses.cispo_tokens(_policy_inputs([-0.5, -1.0], [2.0, 2.0], old=[-1.0, -1.0]))
    # ratio e^0.5 clipped to 1.2: -1.2 * 2 * -0.5 = 1.2; ratio 1 kept: -1 * 2 * -1 = 2
    assert terms.pg.tolist() == pytest.approx([1.2, 2.0], rel=1e-6)
    assert terms.clipfrac.tolist() == [True, False]
    assert terms.ppo_kl.tolist() == pytest.approx([-0.5, 0.0])


def test_value_loss_clips_the_prediction_around_the_old_value():
    cfg = RecomputeConfig(cliprange_value=0.2)
    data = losses.ValueLossData(
        values=torch.tensor([0.0, 0.0]),
        vpreds=torch.tensor([1.0, 0.1]),
        returns=torch.tensor([0.0, 0.5]),
        mask=torch.tensor([1, 1]),
        lengths=torch.tensor([2]),
    )
    out = losses.value_loss_outputs(data, cfg, resolve_kernels(cfg))
    # token 0: clipped to 0.2, (0.2 - 0)^2 = .04 < (1 - 0)^2 = 1; token 1: 0.1 is inside the clip range
    assert out == pytest.approx({"vf_loss": 0.5 * (1.0 + 0.16) / 2, "vf_clipfrac": 0.0})
    worse = losses.ValueLossData(
        values=torch.tensor([0.0]),
        vpreds=torch.tensor([-1.0]),
        returns=torch.tensor([0.5]),
        mask=torch.tensor([1]),
        lengths=torch.tensor([1]),
    )
    # clipped to -0.2: (-0.2 - .5)^2 = .49 < (-1 - .5)^2 = 2.25, so the max is the plain term: not clipped
    assert losses.value_loss_outputs(worse, cfg, resolve_kernels(cfg)) == pytest.approx(
        {"vf_loss": 0.5 * 2.25, "vf_clipfrac": 0.0}
    )
    pulled = losses.ValueLossData(
        values=torch.tensor([0.0]),
        vpreds=torch.tensor([1.0]),
        returns=torch.tensor([2.0]),
        mask=torch.tensor([1]),
        lengths=torch.tensor([1]),
    )
    # (1 - 2)^2 = 1 < (0.2 - 2)^2 = 3.24: the clipped term wins
    assert losses.value_loss_outputs(pulled, cfg, resolve_kernels(cfg)) == pytest.approx(
        {"vf_loss": 0.5 * 3.24, "vf_clipfrac": 1.0}
    )


def test_segment_sums_match_a_float64_loop_with_empty_segments_anywhere():
    from trajectory_replay.replay.kernels import segment_sums

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([0, 5, 0, 0, 3, 1, 0])
    values = torch.randn(2, int(lengths.sum()), generator=g, dtype=torch.float64)
    got = segment_sums(values, lengths)
    ends = torch.cumsum(lengths, 0).tolist()
    want = torch.stack([torch.stack([row[e - n : e].sum() for e, n in zip(ends, lengths.tolist())]) for row in values])
    assert got.shape == (2, 7) and torch.allclose(got, want, rtol=0, atol=1e-12)
    assert segment_sums(values[:, :0], torch.zeros(3, dtype=torch.int64)).eq(0).all()


def test_stacked_sample_sums_keep_float64_rows_in_float64():
    from trajectory_replay.replay.kernels import Workspace, stacked_sample_sums

    fine = torch.tensor([1.0 + 2.0**-40, 3.0], dtype=torch.float64)
    coarse = torch.tensor([0.5, 0.25])
    for workspace in (None, Workspace()):
        sums = stacked_sample_sums([coarse, fine], torch.tensor([1, 1]), torch.tensor([2]), workspace)
        assert sums.dtype == torch.float64 and sums[1].item() == 4.0 + 2.0**-40 and sums[0].item() == 0.75


@pytest.mark.parametrize("mask_kind", ["uint8", "bool", "weighted", "float"])
def test_count_rows_summed_in_float32_give_the_float64_sums_bit_for_bit(mask_kind):
    """Rows named as counts (0/1 clip indicators) and the mask are summed in float32 where that is exact: the same
    float64 numbers as widening every row, whatever the rows' dtypes, empty samples, a uint8 mask with values above 1
    or a float mask (summed in float64 then)."""
    from trajectory_replay.replay.kernels import Workspace, stacked_sample_sums

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 3000, (200,), generator=g)
    lengths[::9] = 0
    total = int(lengths.sum())
    mask = {
        "uint8": (torch.rand(total, generator=g) < 0.8).to(torch.uint8),
        "bool": torch.rand(total, generator=g) < 0.8,
        "weighted": torch.randint(0, 4, (total,), generator=g, dtype=torch.uint8),
        "float": (torch.rand(total, generator=g) < 0.8).to(torch.float32),
    }[mask_kind]
    rows = [
        torch.randn(total, generator=g),
        (torch.rand(total, generator=g) < 0.3).float(),
        torch.randn(total, generator=g, dtype=torch.float64),
        torch.rand(total, generator=g) < 0.5,
        torch.randn(total, generator=g).to(torch.bfloat16),
    ]
    plain = stacked_sample_sums(rows, mask, lengths)
    for workspace in (None, Workspace()):
        counted = stacked_sample_sums(rows, mask, lengths, workspace, counts=(1, 3))
        assert torch.equal(counted, plain)
        table = torch.full((len(rows) + 1, 300), 7.0, dtype=torch.float64)
        stacked_sample_sums(rows, mask, lengths, workspace, out=table[:, 50:250], counts=(1, 3))
        assert torch.equal(table[:, 50:250], plain) and table[:, :50].eq(7).all() and table[:, 250:].eq(7).all()
    ends = torch.cumsum(lengths, 0).tolist()
    want = [float(mask[e - n : e].double().sum()) for e, n in zip(ends, lengths.tolist())]
    assert plain[-1].tolist() == want


def test_counts_are_widened_where_float32_could_not_hold_their_sums():
    """A sample so long that its count could pass 2^24 is summed in float64 like any row."""
    from trajectory_replay.replay.kernels import _counts_exact_in_float32

    assert _counts_exact_in_float32(torch.ones(10, dtype=torch.bool), torch.tensor([(1 << 24) - 1]))
    assert not _counts_exact_in_float32(torch.ones(10, dtype=torch.bool), torch.tensor([1 << 24]))
    assert not _counts_exact_in_float32(torch.full((10,), 2, dtype=torch.uint8), torch.tensor([1 << 23]))
    assert not _counts_exact_in_float32(torch.ones(10), torch.tensor([10]))  # a float mask may hold any value


def _greedy_blocks(lengths: list[int], block_tokens: int) -> list[tuple[int, int, int, int]]:
    """The definition: samples are added to a block until it holds at least `block_tokens` tokens; the last block
    takes what is left."""
    out, first, start, end = [], 0, 0, 0
    for i, n in enumerate(lengths):
        end += n
        if end - start >= block_tokens or i == len(lengths) - 1:
            out.append((first, i + 1, start, end))
            first, start = i + 1, end
    return out


@pytest.mark.parametrize("block_tokens", [1, 2, 5, 16, 64, 1000])
def test_sample_blocks_are_the_greedy_blocks_of_whole_samples(block_tokens):
    g = torch.Generator().manual_seed(block_tokens)
    choices = torch.tensor([0, 0, 1, 3, 7, 50])
    for n in range(40):
        lengths = choices[torch.randint(len(choices), (n,), generator=g)]
        blocks = list(kernels.sample_blocks(lengths, block_tokens))
        assert blocks == _greedy_blocks(lengths.tolist(), block_tokens)
        # whole samples, in order, every token once
        assert [b[0] for b in blocks[1:]] == [b[1] for b in blocks[:-1]]
        assert sum(b[3] - b[2] for b in blocks) == int(lengths.sum())
