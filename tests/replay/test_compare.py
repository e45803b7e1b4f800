"""Comparison: tolerances, non-finite values on either side, length mismatches, locations."""

import math

import pytest
import torch

from trajectory_replay.bundle.schema import ComparisonPolicy, Manifest, Tolerance
from trajectory_replay.replay.compare import (
    SampleLayout,
    Tolerances,
    compare_scalar,
    compare_tensors,
    resolve_tolerance,
)

LAYOUT = SampleLayout.per_token(["a", "b", "c", "d"], torch.tensor([2, 0, 3, 1]))


def test_resolve_tolerance_override_beats_policy_beats_default():
    manifest = Manifest(
        bundle_id="b",
        comparison_policy=ComparisonPolicy(
            tolerances={"advantage.kl": Tolerance(atol=1e-3), "reward.raw": Tolerance(atol=0.5, rtol=0.0)}
        ),
    )
    assert resolve_tolerance(manifest, "sample") == Tolerances(1e-6, 1e-5)
    assert resolve_tolerance(manifest, "advantage.kl") == Tolerances(1e-3, 1e-5)
    assert resolve_tolerance(manifest, "reward.raw") == Tolerances(0.5, 0.0)
    assert resolve_tolerance(manifest, "reward.raw", atol=0.0) == Tolerances(0.0, 0.0)
    assert resolve_tolerance(manifest, "reward.raw", rtol=0.1) == Tolerances(0.5, 0.1)


def test_mismatch_rule_is_atol_plus_rtol_times_expected():
    tol = Tolerances(atol=0.1, rtol=0.1)
    # bound for expected 10 is 1.1: 1.05 passes, 1.2 fails
    assert not compare_scalar("x", 10.0, 11.05, tol).failed
    assert compare_scalar("x", 10.0, 11.2, tol).failed
    assert compare_scalar("x", 10.0, 11.2, tol).divergences[0].abs_error == pytest.approx(1.2, abs=1e-6)


def test_divergences_are_located_by_sample_and_token_offset():
    expected = torch.zeros(6)
    actual = torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0, 3.0])
    result = compare_tensors("kl", expected, actual, LAYOUT, Tolerances())
    assert result.mismatch_count == 3 and result.max_abs_error == 3.0
    assert [(d.sample_id, d.token_offset, d.actual) for d in result.divergences] == [
        ("a", 1, 1.0),
        ("c", 2, 2.0),
        ("d", 0, 3.0),
    ]


def test_per_sample_divergences_have_no_token_offset():
    result = compare_tensors(
        "reward",
        torch.tensor([1.0, 2.0]),
        torch.tensor([1.0, 5.0]),
        SampleLayout.per_sample(["s-0", "s-1"]),
        Tolerances(),
    )
    d = result.divergences[0]
    assert (d.field, d.sample_id, d.token_offset, d.expected, d.actual, d.abs_error) == (
        "reward",
        "s-1",
        None,
        2.0,
        5.0,
        3.0,
    )


def test_nan_in_expected_fails_and_says_where():
    expected = torch.zeros(6)
    expected[3] = math.nan
    result = compare_tensors("kl", expected, torch.zeros(6), LAYOUT, Tolerances())
    assert result.failed and result.mismatch_count == 1
    assert result.problems == ("kl: expected value is nan at c token 1 (1 non-finite)",)
    assert result.max_abs_error == 0.0
    assert math.isnan(result.divergences[0].expected)


def test_inf_in_actual_fails_and_says_which_side():
    actual = torch.zeros(6)
    actual[0] = math.inf
    result = compare_tensors("kl", torch.zeros(6), actual, LAYOUT, Tolerances())
    assert result.problems == ("kl: actual value is inf at a token 0 (1 non-finite)",)


def test_nan_on_both_sides_still_fails():
    both = torch.tensor([math.nan])
    assert compare_tensors("x", both, both.clone(), SampleLayout.per_sample(["s"]), Tolerances()).failed


def test_length_mismatch_fails_with_both_lengths_and_compares_no_prefix():
    result = compare_tensors("reward", torch.zeros(3), torch.zeros(4), SampleLayout.per_sample("abcd"), Tolerances())
    assert result.failed and result.compared == 0
    assert result.problems == ("reward: expected has 3 values, actual has 4",)


def test_at_most_ten_divergences_are_listed_but_all_are_counted():
    result = compare_tensors(
        "x", torch.zeros(25), torch.ones(25), SampleLayout.per_sample(list("abcdefghijklmnopqrstuvwxy")), Tolerances()
    )
    assert result.mismatch_count == 25 and len(result.divergences) == 10


def _long_pair(seed: int, jitter: float):
    """A long per-token pair over samples of uneven lengths (some empty), `actual` off by at most `jitter`."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3000, (200,), generator=g)
    lengths[[0, 7, 199]] = 0
    n = int(lengths.sum())
    expected = torch.randn(n, generator=g)
    actual = expected + (torch.rand(n, generator=g) * 2 - 1) * jitter
    layout = SampleLayout.per_token([f"s{i}" for i in range(200)], lengths)
    return expected, actual, layout


def _full(expected, actual, layout, tol):
    """The comparison with the chunked check turned off: the reference it must agree with."""
    import trajectory_replay.replay.compare as compare

    saved, compare.CHUNK_TOKENS = compare.CHUNK_TOKENS, 1 << 40
    try:
        return compare_tensors("x", expected, actual, layout, tol, sample_errors=True)
    finally:
        compare.CHUNK_TOKENS = saved


@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_check_of_a_passing_field_equals_the_full_comparison(seed):
    expected, actual, layout = _long_pair(seed, 1e-7)
    assert expected.numel() > 4 * (1 << 16)  # long enough to be checked chunk by chunk
    tol = Tolerances(atol=1e-6, rtol=0.0)
    fast = compare_tensors("x", expected, actual, layout, tol, sample_errors=True)
    full = _full(expected, actual, layout, tol)
    assert not fast.failed and fast.max_abs_error == full.max_abs_error > 0
    assert fast.compared == full.compared and fast.per_token and full.per_token
    assert torch.equal(fast.sample_errors, full.sample_errors)
    assert fast.sample_errors[0] == 0 and fast.sample_errors[199] == 0  # empty responses


def test_chunked_check_hands_a_failing_or_non_finite_field_to_the_full_comparison():
    expected, actual, layout = _long_pair(2, 1e-7)
    actual[-5] += 1.0
    tol = Tolerances(atol=1e-6, rtol=0.0)
    result = compare_tensors("x", expected, actual, layout, tol, sample_errors=True)
    assert result.mismatch_count == 1 and result.divergences[0].abs_error == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(result.sample_errors, _full(expected, actual, layout, tol).sample_errors)
    actual[-5] -= 1.0
    actual[3000] = float("nan")
    result = compare_tensors("x", expected, actual, layout, tol)
    assert result.failed and result.mismatch_count == 1 and "actual value is nan" in result.problems[0]
