"""Comparison: tolerances, non-finite values on either side, length mismatches, locations."""

import math

import pytest
import torch

from trajectory_replay.bundle.schema import ComparisonPolicy, Manifest, Tolerance
from trajectory_replay.replay.compare import (
    SampleLayout, Tolerances, compare_scalar, compare_tensors, resolve_tolerance,
)

LAYOUT = SampleLayout.per_token(["a", "b", "c", "d"], torch.tensor([2, 0, 3, 1]))


def test_resolve_tolerance_override_beats_policy_beats_default():
    manifest = Manifest(bundle_id="b", comparison_policy=ComparisonPolicy(
        tolerances={"advantage.kl": Tolerance(atol=1e-3), "reward.raw": Tolerance(atol=0.5, rtol=0.0)}))
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
        ("a", 1, 1.0), ("c", 2, 2.0), ("d", 0, 3.0)]


def test_per_sample_divergences_have_no_token_offset():
    result = compare_tensors("reward", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 5.0]),
                             SampleLayout.per_sample(["s-0", "s-1"]), Tolerances())
    d = result.divergences[0]
    assert (d.field, d.sample_id, d.token_offset, d.expected, d.actual, d.abs_error) == ("reward", "s-1", None, 2.0,
                                                                                          5.0, 3.0)


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
    result = compare_tensors("reward", torch.zeros(3), torch.zeros(4), SampleLayout.per_sample("abcd"),
                             Tolerances())
    assert result.failed and result.compared == 0
    assert result.problems == ("reward: expected has 3 values, actual has 4",)


def test_at_most_ten_divergences_are_listed_but_all_are_counted():
    result = compare_tensors("x", torch.zeros(25), torch.ones(25), SampleLayout.per_sample(list("abcdefghijklmnopqrstuvwxy")),
                             Tolerances())
    assert result.mismatch_count == 25 and len(result.divergences) == 10
