"""The runner end to end over in-memory sources: verdicts and exact locations."""

import json
import math

import pytest
import torch

from tests.replay.cases import split_ranks, token_position, twelve_case
from tests.replay.conftest import MemorySource, source_of
from trajectory_replay.bundle.schema import StageCapability, StageContract, StageId
from trajectory_replay.errors import BundleError, SelectionError, UnsupportedError, UsageError
from trajectory_replay.replay import PARTIAL_SELECTION, canonical_case, replay


def _statuses(report):
    return {(s.stage, s.rank): s.status for s in report.stages}


def _divs(result):
    return [(d.field, d.sample_id, d.token_offset, d.expected, d.actual, d.abs_error) for d in result.divergences]


# --- the canonical case -----------------------------------------------------------------------------


def test_canonical_correct_bundle_passes(canonical_source):
    report = replay([canonical_source(buggy=False, current_logprob=0.5)])
    assert report.passed and report.first_divergent_stage is None and report.exit_code == 0
    assert [s.stage for s in report.stages] == [
        "sample",
        "reward.raw",
        "reward.post_process",
        "advantage.kl",
        "advantage.estimate",
        "loss.policy",
    ]
    assert all(s.rank is None for s in report.stages)


def test_canonical_bug_with_ratio_one_names_reward_post_process(canonical_source):
    report = replay([canonical_source(buggy=True)])
    assert report.first_divergent_stage == "reward.post_process" and report.exit_code == 1
    assert _statuses(report) == {
        ("sample", None): "pass",
        ("reward.raw", None): "pass",
        ("reward.post_process", None): "fail",
        ("advantage.kl", None): "pass",
        ("advantage.estimate", None): "fail",
        ("loss.policy", None): "pass",
    }
    post = report.stage("reward.post_process")
    assert post.mismatch_count == 4 and len(post.divergences) == 4 and post.max_abs_error == 4.5
    assert _divs(post)[0] == ("reward", "s-0", None, -5.5, -1.0, 4.5)
    assert post.divergences[0].render() == "reward s-0: expected=-5.5 actual=-1.0 abs_err=4.5"
    estimate = report.stage("advantage.estimate")
    assert estimate.mismatch_count == 8 and estimate.max_abs_error == 4.5
    assert _divs(estimate)[1] == ("advantages", "s-0", 1, -5.5, -1.0, 4.5)
    assert report.render_text().splitlines()[0] == "bundle b-00065 — first divergent stage: reward.post_process"


def test_canonical_bug_with_ratio_e_half_fails_loss_policy_too(canonical_source):
    report = replay([canonical_source(buggy=True, current_logprob=0.5)])
    assert report.first_divergent_stage == "reward.post_process"
    loss = report.stage("loss.policy")
    assert loss.status == "fail" and loss.mismatch_count == 2
    found = {d.field: d for d in loss.divergences}
    assert set(found) == {"loss", "pg_loss"}
    assert found["pg_loss"].expected == pytest.approx(4.038490, abs=2e-6)
    assert found["pg_loss"].actual == pytest.approx(0.897442, abs=2e-6)
    assert found["loss"].expected == pytest.approx(4.018490, abs=2e-6)
    assert found["loss"].actual == pytest.approx(0.877442, abs=2e-6)
    assert found["pg_loss"].sample_id is None and found["pg_loss"].token_offset is None


def test_json_report_of_the_canonical_bug(canonical_source):
    data = json.loads(replay([canonical_source(buggy=True)]).to_json())
    assert data["passed"] is False and data["first_divergent_stage"] == "reward.post_process"
    assert data["stages"][2]["divergences"][0] == {
        "field": "reward",
        "sample_id": "s-0",
        "token_offset": None,
        "expected": -5.5,
        "actual": -1.0,
        "abs_error": 4.5,
    }


# --- the 12-sample case ---------------------------------------------------------------------------


def test_twelve_sample_case_passes():
    report = replay([source_of(twelve_case())])
    assert report.passed, report.render_text()
    assert len(report.stages) == 6


@pytest.mark.parametrize(
    "payload, sample, offset, stage, field",
    [
        ("kl", 4, 2, "advantage.kl", "kl"),
        ("advantages", 9, 2, "advantage.estimate", "advantages"),
        ("old_log_probs", 2, 1, "advantage.kl", "kl"),
        ("ref_log_probs", 11, 2, "advantage.kl", "kl"),
    ],
)
def test_a_single_token_fault_is_located(payload, sample, offset, stage, field):
    manifest, index, expected, payloads = twelve_case()
    faulty = payloads[payload].clone()
    faulty[token_position(sample, offset)] += 0.5
    report = replay([source_of((manifest, index, expected, {**payloads, payload: faulty}))])
    assert report.first_divergent_stage == stage
    result = report.stage(stage)
    assert result.mismatch_count == 1
    assert [(d.field, d.sample_id, d.token_offset) for d in result.divergences] == [(field, f"q-{sample}", offset)]


@pytest.mark.parametrize("payload, field", [("log_probs", "pg_loss"), ("entropy", "entropy_loss")])
def test_a_loss_input_fault_shows_at_loss_policy(payload, field):
    manifest, index, expected, payloads = twelve_case()
    faulty = payloads[payload].clone()
    faulty[token_position(3, 1)] += 1.0
    report = replay([source_of((manifest, index, expected, {**payloads, payload: faulty}))])
    assert report.first_divergent_stage == "loss.policy"
    assert field in {d.field for d in report.stage("loss.policy").divergences}


def test_a_loss_mask_fault_shows_at_the_sample_stage():
    manifest, index, expected, payloads = twelve_case()
    mask = torch.tensor([v for r in index.samples for v in r.loss_mask], dtype=torch.uint8)
    mask[token_position(4, 1)] = 1
    report = replay([source_of((manifest, index, expected, {**payloads, "loss_mask": mask}))])
    assert report.first_divergent_stage == "sample"
    # expected: the payload replay computes with; actual: the copy the record carries
    assert _divs(report.stage("sample")) == [("loss_mask", "q-4", 1, 1.0, 0.0, 1.0)]


@pytest.mark.parametrize(
    "stage, key, position, field",
    [
        ("reward.raw", "raw_rewards", 5, "raw_reward"),
        ("reward.post_process", "rewards", 7, "reward"),
    ],
)
def test_a_per_sample_expected_fault_is_located(stage, key, position, field):
    manifest, index, expected, payloads = twelve_case()
    expected[stage][key][position] += 0.25
    report = replay([source_of((manifest, index, expected, payloads))])
    assert report.first_divergent_stage == stage
    assert [(d.field, d.sample_id, d.token_offset) for d in report.stage(stage).divergences] == [
        (field, f"q-{position}", None)
    ]


@pytest.mark.parametrize("field", ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"])
def test_each_expected_loss_scalar_fault_is_named(field):
    manifest, index, expected, payloads = twelve_case()
    expected["loss.policy"][field] += 0.01
    report = replay([source_of((manifest, index, expected, payloads))])
    assert report.first_divergent_stage == "loss.policy"
    assert [d.field for d in report.stage("loss.policy").divergences] == [field]


def test_a_recorded_raw_reward_fault_shows_at_reward_raw_first():
    manifest, index, expected, payloads = twelve_case()
    index.samples[3].raw_reward += 1.0
    report = replay([source_of((manifest, index, expected, payloads))])
    assert report.first_divergent_stage == "reward.raw"
    assert [d.sample_id for d in report.stage("reward.raw").divergences] == ["q-3"]


def test_nan_in_an_expected_payload_fails():
    manifest, index, expected, payloads = twelve_case()
    kl = payloads["kl"].clone()
    kl[token_position(7, 0)] = math.nan
    report = replay([source_of((manifest, index, expected, {**payloads, "kl": kl}))])
    result = report.stage("advantage.kl")
    assert report.first_divergent_stage == "advantage.kl" and result.mismatch_count == 1
    assert "kl: expected value is nan at q-7 token 0" in result.message
    assert json.loads(report.to_json())["stages"][3]["divergences"][0]["expected"] == "nan"


def test_nan_in_an_expected_list_fails():
    case = canonical_case(buggy=False)
    case.expected["reward.post_process"]["rewards"][2] = math.nan
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "reward.post_process"
    assert "expected value is nan at s-2" in report.stage("reward.post_process").message


def test_a_group_of_one_with_std_normalization_reports_nan():
    case = canonical_case(buggy=False)
    case.index.config.n_samples_per_prompt = 1
    case.index.config.grpo_std_normalization = True
    for i, record in enumerate(case.index.samples):
        record.group_index = i
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "reward.post_process"
    assert "reward: actual value is nan at s-0 (4 non-finite)" in report.stage("reward.post_process").message


@pytest.mark.parametrize("stage, key", [("reward.raw", "raw_rewards"), ("reward.post_process", "rewards")])
def test_a_truncated_expected_list_fails_with_both_lengths(stage, key):
    case = canonical_case(buggy=False)
    del case.expected[stage][key][-1]
    report = replay([source_of(case)])
    assert report.first_divergent_stage == stage
    assert f"expected {stage}.{key} has 3 values, the bundle has 4 samples" in report.stage(stage).message
    # also under a partial selection that would only need the surviving prefix
    assert replay([source_of(case)], groups=["g-0"]).first_divergent_stage == stage


def test_missing_expected_list_fails():
    case = canonical_case(buggy=False)
    del case.expected["reward.raw"]
    assert "expected has no reward.raw.raw_rewards" in replay([source_of(case)]).stage("reward.raw").message


# --- structural failures ----------------------------------------------------------------------------


def test_null_group_index_fails_post_process_and_estimate_says_why():
    case = canonical_case(buggy=False)
    case.index.samples[2].group_index = None
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "reward.post_process"
    assert report.stage("reward.post_process").message == "sample s-2 has no group_index"
    assert (
        "needs rewards from upstream stage reward.post_process, which produced none"
        in report.stage("advantage.estimate").message
    )


def test_wrong_group_size_fails():
    case = canonical_case(buggy=False)
    case.index.samples[2].group_index = 0
    report = replay([source_of(case)])
    assert report.stage("reward.post_process").message == (
        "reward group g-0 has 3 samples, expected 2; reward group g-1 has 1 samples, expected 2"
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: setattr(r, "response_length", -1), "sample s-1: response_length -1, total_length 3"),
        (lambda r: setattr(r, "total_length", 1), "sample s-1: response_length 2, total_length 1"),
        (lambda r: setattr(r, "loss_mask", [1, 1, 1]), "sample s-1: loss_mask has 3 values, response_length 2"),
        (lambda r: setattr(r, "sample_id", "s-0"), "duplicate sample ids: s-0"),
    ],
)
def test_sample_stage_record_checks(mutate, message):
    case = canonical_case(buggy=False)
    payloads = dict(case.payloads, loss_mask=torch.ones(8, dtype=torch.uint8))
    mutate(case.index.samples[1])
    report = replay([MemorySource(case.manifest, case.index, case.expected, payloads)], stages=["sample"])
    assert report.first_divergent_stage == "sample"
    assert message in report.stage("sample").message


def test_a_per_token_payload_of_the_wrong_size_fails_the_sample_stage():
    case = canonical_case(buggy=False)
    report = replay([source_of(case, entropy=torch.full((7,), 0.5))])
    assert report.first_divergent_stage == "sample"
    assert "payload 'entropy' has 7 elements, the responses have 8 tokens" in report.stage("sample").message


def test_a_loss_mask_payload_of_the_wrong_size_fails_the_sample_stage():
    case = canonical_case(buggy=False)
    report = replay([source_of(case, loss_mask=torch.ones(9, dtype=torch.uint8))])
    assert "loss_mask payload has 9 values, the responses have 8 tokens" in report.stage("sample").message


def test_missing_expected_loss_map_or_field_fails_naming_it():
    case = canonical_case(buggy=False)
    del case.expected["loss.policy"]["ppo_kl"]
    assert replay([source_of(case)]).stage("loss.policy").message == "expected loss.policy has no field 'ppo_kl'"
    del case.expected["loss.policy"]
    assert replay([source_of(case)]).stage("loss.policy").message == "expected has no loss.policy map"


def test_a_missing_input_payload_fails_the_stage_naming_it():
    case = canonical_case(buggy=False)
    del case.payloads["entropy"]
    report = replay([source_of(case)])
    assert report.first_divergent_stage == "loss.policy"
    assert report.stage("loss.policy").message == "bundle has no payload 'entropy'"


def test_a_loss_only_bundle_uses_the_advantages_payload():
    case = canonical_case(buggy=True, current_logprob=0.5)
    contracts = {s: c for s, c in case.manifest.stage_contracts.items() if s in (StageId.SAMPLE, StageId.LOSS_POLICY)}
    manifest = case.manifest.model_copy(update={"stage_contracts": contracts})
    report = replay([source_of((manifest, case.index, case.expected, case.payloads))])
    assert report.passed and [s.stage for s in report.stages] == ["sample", "loss.policy"]


# --- capability matrix --------------------------------------------------------------------------


def test_unsupported_estimator_fails_loudly():
    case = canonical_case(buggy=False)
    case.index.config.advantage_estimator = "ppo"
    with pytest.raises(UnsupportedError, match="unsupported advantage_estimator 'ppo'"):
        replay([source_of(case)])


def test_context_parallelism_fails_loudly():
    case = canonical_case(buggy=False)
    case.index.identity.rank.cp = 2
    with pytest.raises(UnsupportedError, match="unsupported replay topology: .*cp=2"):
        replay([source_of(case)])


def test_unknown_kl_type_fails_before_loading_anything():
    case = canonical_case(buggy=False)
    case.index.config.kl_loss_type = "k9"
    source = source_of(case)
    with pytest.raises(UnsupportedError, match="kl_loss_type 'k9'"):
        replay([source])
    assert source.loads == []


def _with_contract(case, stage, capability=StageCapability.RECOMPUTE, version="v1"):
    contracts = dict(case.manifest.stage_contracts)
    contracts[stage] = StageContract(stage=stage, capability=capability, version=version)
    return source_of((case.manifest.model_copy(update={"stage_contracts": contracts}), *case[1:]))


def test_a_loss_value_contract_without_its_payloads_is_unsupported_and_names_the_payload():
    source = _with_contract(canonical_case(buggy=False), StageId.LOSS_VALUE)
    with pytest.raises(UnsupportedError, match="loss.value needs payload 'values', which bundle b-00001 does not"):
        replay([source])
    assert replay([source], stages=["advantage.estimate"]).passed


@pytest.mark.parametrize(
    "capability", [StageCapability.UNSUPPORTED, StageCapability.INSPECT_ONLY, StageCapability.RECORDED_ONLY]
)
def test_a_stage_the_bundle_declares_not_replayable_is_skipped_with_its_capability(capability):
    """The older tool's capture declares loss.value unsupported in every bundle: that must not fail a clean one."""
    case = canonical_case(buggy=False)
    kl = case.payloads["kl"].clone()
    kl[0] = 9.0  # would fail advantage.kl if it ran
    source = _with_contract(case._replace(payloads={**case.payloads, "kl": kl}), StageId.ADVANTAGE_KL, capability)
    report = replay([source])
    assert report.passed, report.render_text()
    result = report.stage("advantage.kl")
    assert result.status == "skipped" and f"capability={capability.value}" in result.message
    assert f"[skipped] advantage.kl  capability={capability.value}" in report.render_text()


def test_a_loss_value_contract_declared_unsupported_is_skipped():
    source = _with_contract(canonical_case(buggy=False), StageId.LOSS_VALUE, StageCapability.UNSUPPORTED)
    report = replay([source])
    assert report.passed and report.stage("loss.value").status == "skipped"
    assert report.stage("loss.policy").status == "pass"
    buggy = _with_contract(canonical_case(buggy=True), StageId.LOSS_VALUE, StageCapability.UNSUPPORTED)
    assert replay([buggy]).first_divergent_stage == "reward.post_process"


def test_asking_for_a_stage_declared_unsupported_fails_loudly():
    source = _with_contract(canonical_case(buggy=False), StageId.ADVANTAGE_KL, StageCapability.UNSUPPORTED)
    with pytest.raises(UnsupportedError, match="stage advantage.kl is declared unsupported by bundle b-00001"):
        replay([source], stages=["advantage.kl"])
    assert replay([source], stages=["advantage.estimate"]).passed  # not named, not run


def test_an_unknown_contract_version_fails_loudly():
    source = _with_contract(canonical_case(buggy=False), StageId.REWARD_RAW, version="v2")
    with pytest.raises(UnsupportedError, match="contract version 'v2'"):
        replay([source])


def test_recorded_only_post_process_is_skipped_and_hands_on_recorded_rewards():
    source = _with_contract(canonical_case(buggy=True), StageId.REWARD_POST_PROCESS, StageCapability.RECORDED_ONLY)
    report = replay([source])
    assert report.stage("reward.post_process").status == "skipped"
    # the recorded (buggy) rewards agree with the recorded advantages: the bug is invisible by contract
    assert report.passed


def test_recorded_only_reward_raw_is_skipped_and_post_process_uses_the_recorded_raw_rewards():
    case = canonical_case(buggy=False)
    case.expected["reward.raw"]["raw_rewards"][0] = 2.0  # not compared: the stage is not replayed
    report = replay([_with_contract(case, StageId.REWARD_RAW, StageCapability.RECORDED_ONLY)])
    assert report.stage("reward.raw").status == "skipped" and report.passed
    buggy = canonical_case(buggy=True)
    report = replay([_with_contract(buggy, StageId.REWARD_RAW, StageCapability.RECORDED_ONLY)])
    assert report.first_divergent_stage == "reward.post_process"


@pytest.mark.parametrize("capability", [StageCapability.INSPECT_ONLY, StageCapability.UNSUPPORTED])
def test_a_skipped_upstream_hands_its_recorded_values_to_the_stage_after_it(capability):
    source = _with_contract(canonical_case(buggy=False), StageId.REWARD_POST_PROCESS, capability)
    report = replay([source])
    assert report.stage("reward.post_process").status == "skipped" and report.passed
    assert report.stage("advantage.estimate").status == "pass"
    case = canonical_case(buggy=False)
    advantages = case.payloads["advantages"].clone()
    advantages[5] = 3.0  # s-2 token 1: the stage after the skipped one still finds it
    report = replay(
        [
            _with_contract(
                case._replace(payloads={**case.payloads, "advantages": advantages}),
                StageId.REWARD_POST_PROCESS,
                capability,
            )
        ]
    )
    assert report.first_divergent_stage == "advantage.estimate"
    assert _divs(report.stage("advantage.estimate"))[0][:3] == ("advantages", "s-2", 1)


# --- --stage closure ----------------------------------------------------------------------------


def test_stage_selection_runs_its_contracted_dependencies_and_names_the_upstream_bug():
    report = replay([canonical_source_of(buggy=True)], stages=["advantage.estimate"])
    assert [s.stage for s in report.stages] == ["sample", "reward.raw", "reward.post_process", "advantage.estimate"]
    assert report.first_divergent_stage == "reward.post_process"


def test_stage_selection_of_loss_policy_skips_unrelated_kl():
    report = replay([canonical_source_of(buggy=True, current_logprob=0.5)], stages=["loss.policy"])
    assert "advantage.kl" not in [s.stage for s in report.stages]
    assert report.first_divergent_stage == "reward.post_process"


def test_a_single_stage_name_is_one_stage():
    report = replay([canonical_source_of(buggy=True)], stages="reward.raw")
    assert [s.stage for s in report.stages] == ["sample", "reward.raw"] and report.passed


def test_stage_selection_fails_closed():
    with pytest.raises(UsageError, match="unknown stage 'reward'"):
        replay([canonical_source_of()], stages=["reward"])
    with pytest.raises(SelectionError, match="stage loss.value is not contracted"):
        replay([canonical_source_of()], stages=["loss.value"])


def canonical_source_of(buggy=False, current_logprob=0.0):
    return source_of(canonical_case(buggy, current_logprob))


# --- selection through the runner ------------------------------------------------------------------


def test_partial_selection_runs_the_subset_and_skips_loss_policy():
    report = replay([canonical_source_of(buggy=True)], samples=["s-2"])
    post = report.stage("reward.post_process")
    assert post.mismatch_count == 2 and [d.sample_id for d in post.divergences] == ["s-2", "s-3"]
    assert report.stage("advantage.estimate").mismatch_count == 4
    loss = report.stage("loss.policy")
    assert loss.status == "skipped" and loss.message == PARTIAL_SELECTION


def test_selection_covering_every_group_is_not_partial():
    report = replay([canonical_source_of()], groups=["g-0", "g-1"])
    assert report.stage("loss.policy").status == "pass"


def test_batch_selection_through_the_runner():
    report = replay([source_of(twelve_case())], batches=["mb-0001"])
    # mb-0001 holds q-4..q-7, touching groups 2, 1, 0: every sample
    assert report.stage("loss.policy").status == "pass"
    with pytest.raises(SelectionError, match="no batch 'mb-0042'"):
        replay([source_of(twelve_case())], batches=["mb-0042"])


def test_unknown_sample_fails_closed():
    with pytest.raises(SelectionError, match="no sample 's-9'"):
        replay([canonical_source_of()], samples=["s-9"])


def test_tolerance_overrides_reach_the_comparison():
    report = replay([canonical_source_of(buggy=True)], atol=5.0)
    assert report.passed


# --- lazy loading -------------------------------------------------------------------------------


def test_partial_selection_loads_only_closure_rows():
    source = source_of(twelve_case())
    replay([source], groups=["g-1"])
    assert source.loads and all(rows == (2, 5, 6, 10) for _, rows in source.loads)
    assert source.loaded_names() == {"loss_mask", "kl", "old_log_probs", "ref_log_probs", "advantages"}


def test_each_payload_is_loaded_once():
    source = source_of(twelve_case())
    replay([source])
    names = [name for name, _ in source.loads]
    assert sorted(names) == sorted(set(names))
    assert all(rows is None for _, rows in source.loads)


def test_kl_coef_zero_does_not_load_reference_log_probs():
    case = canonical_case(buggy=False)
    case.index.config.kl_coef = 0.0
    source = source_of(case, kl=torch.zeros(8))
    assert replay([source], stages=["advantage.kl"]).passed
    assert source.loaded_names() == {"loss_mask", "kl"}


def test_stage_post_process_loads_only_the_loss_mask():
    source = canonical_source_of(buggy=True)
    replay([source], stages=["reward.post_process"])
    assert source.loaded_names() == {"loss_mask"}


# --- multi-rank ---------------------------------------------------------------------------------


def _replicas(case, n=2):
    return [source_of(case, rank=r) for r in range(n)]


def test_replica_ranks_are_each_replayed_and_agree():
    report = replay(_replicas(canonical_case(buggy=True)))
    assert report.first_divergent_stage == "reward.post_process"
    post = report.stage("reward.post_process")
    assert post.rank is None and post.mismatch_count == 4
    assert [(s.stage, s.rank) for s in report.stages][-2:] == [("loss.policy", 0), ("loss.policy", 1)]


def test_ranks_with_the_same_ids_and_other_data_are_each_replayed_on_their_own():
    """Rank-local sample ids (every rank from s-0): a rank whose payload differs is its own shard, and a fault in
    it is reported for that rank alone."""
    case = canonical_case(buggy=False)
    kl = case.payloads["kl"].clone()
    kl[3] = 1.0
    sources = [source_of(case, rank=0), source_of(case, rank=1, kl=kl)]
    report = replay(sources)
    assert report.first_divergent_stage == "advantage.kl"
    assert report.stage("advantage.kl", rank=0).status == "pass"
    result = report.stage("advantage.kl", rank=1)
    assert result.status == "fail" and _divs(result)[0][:3] == ("kl", "s-1", 1)
    assert {s.rank for s in report.stages} == {0, 1}
    assert [s.stage for s in report.stages][:2] == ["sample", "sample"]  # stage by stage, each rank


def test_rank_local_ids_with_other_groups_are_normalized_within_their_rank():
    case = canonical_case(buggy=False)
    other = canonical_case(buggy=False)
    other.index.samples[1].group_index, other.index.samples[2].group_index = 1, 0
    report = replay([source_of(case, rank=0), source_of(other, rank=1)])
    assert report.stage("reward.post_process", rank=0).status == "pass"
    result = report.stage("reward.post_process", rank=1)
    assert result.status == "fail" and report.first_divergent_stage == "reward.post_process"
    assert report.stage("sample", rank=1).status == "pass"  # group membership is the rank's own


def test_rank_local_ids_in_another_order_are_replayed_as_recorded():
    case = canonical_case(buggy=False)
    other = canonical_case(buggy=False)
    other.index.samples.reverse()  # the rank's records no longer line up with its expected lists
    report = replay([source_of(case, rank=0), source_of(other, rank=1)])
    assert report.stage("reward.raw", rank=0).status == "pass"
    assert report.stage("reward.raw", rank=1).status == "fail"


def test_a_fault_in_the_third_of_three_rank_local_shards_fails_the_replay():
    cases = [canonical_case(buggy=False) for _ in range(3)]
    for r, case in enumerate(cases):  # each rank its own data under the same ids
        for record in case.index.samples:
            record.micro_batch_id = f"mb-{r}"
    advantages = cases[2].payloads["advantages"].clone()
    advantages[6] = 5.0  # s-3 token 0
    sources = [source_of(c, rank=r) for r, c in enumerate(cases[:2])] + [
        source_of(cases[2], rank=2, advantages=advantages)
    ]
    report = replay(sources)
    assert not report.passed and report.first_divergent_stage == "advantage.estimate"
    assert [(r.stage, r.rank) for r in report.stages if r.failed] == [("advantage.estimate", 2)]
    assert _divs(report.stage("advantage.estimate", rank=2))[0][:3] == ("advantages", "s-3", 0)
    assert [(r.rank, r.status) for r in report.stages if r.stage == "loss.policy"] == [
        (0, "pass"),
        (1, "pass"),
        (2, "pass"),
    ]
    fresh = [source_of(c, rank=r) for r, c in enumerate(cases[:2])] + [
        source_of(cases[2], rank=2, advantages=advantages)
    ]
    alone = replay(fresh, rank=2)  # the rank by itself: its own data, nothing of the others
    assert alone.first_divergent_stage == "advantage.estimate" and fresh[0].loads == fresh[1].loads == []


def test_replicas_among_rank_local_shards_are_reported_for_every_rank():
    same = canonical_case(buggy=False)
    other = canonical_case(buggy=False)
    other.expected["reward.post_process"]["rewards"] = [-5.5, -3.5, 3.5, 5.5]
    report = replay([source_of(same, rank=0), source_of(canonical_case(buggy=False), rank=1), source_of(other, rank=2)])
    post = [(s.rank, s.status) for s in report.stages if s.stage == "reward.post_process"]
    assert post == [(0, "pass"), (1, "pass"), (2, "fail")]
    assert report.stage("reward.post_process", rank=1).message.endswith("(data identical to rank 0)")
    assert {s.rank for s in report.stages if s.stage == "loss.policy"} == {0, 1, 2}


def test_selection_over_rank_local_ids_selects_in_each_rank():
    cases = [canonical_case(buggy=False), canonical_case(buggy=False)]
    cases[1].expected["reward.post_process"]["rewards"] = [-5.5, -3.5, 3.5, 5.5]  # rank 1's data: the bug
    cases[1].index.samples[0].micro_batch_id = "mb-0042"
    sources = [source_of(c, rank=r) for r, c in enumerate(cases)]
    report = replay(sources, samples=["s-0"])
    assert report.stage("reward.post_process", rank=0).status == "pass"
    assert report.stage("reward.post_process", rank=1).status == "fail"
    assert {(s.stage, s.rank) for s in report.stages if s.stage == "loss.policy"} == {
        ("loss.policy", 0),
        ("loss.policy", 1),
    }
    assert all(s.status == "skipped" for s in report.stages if s.stage == "loss.policy")
    only_rank_1 = replay(sources, batches=["mb-0042"])
    assert {s.rank for s in only_rank_1.stages} == {1}
    with pytest.raises(SelectionError, match="no sample 's-9'"):
        replay(sources, samples=["s-9"])


def test_data_parallel_ranks_form_one_cohort_and_loss_runs_per_rank():
    shards = split_ranks(twelve_case(), [range(0, 5), range(5, 12)])
    report = replay([source_of(shard, rank=r) for r, shard in enumerate(shards)])
    assert report.passed, report.render_text()
    assert [(s.stage, s.rank) for s in report.stages] == [
        ("sample", None),
        ("reward.raw", None),
        ("reward.post_process", None),
        ("advantage.kl", None),
        ("advantage.estimate", None),
        ("loss.policy", 0),
        ("loss.policy", 1),
    ]


def test_data_parallel_divergence_is_located_in_its_rank():
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    shards[1].expected["reward.post_process"]["rewards"][2] += 1.0  # q-8
    advantages = shards[1].payloads["advantages"].clone()
    advantages[1] += 1.0  # q-6 has one token, so this is q-7 token 0
    sources = [source_of(shards[0], rank=0), source_of(shards[1], rank=1, advantages=advantages)]
    report = replay(sources)
    assert report.first_divergent_stage == "reward.post_process"
    assert [d.sample_id for d in report.stage("reward.post_process").divergences] == ["q-8"]
    assert _divs(report.stage("advantage.estimate"))[0][:3] == ("advantages", "q-7", 0)


def test_data_parallel_partial_selection_closes_over_a_group_split_across_ranks():
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    sources = [source_of(shard, rank=r) for r, shard in enumerate(shards)]
    report = replay(sources, samples=["q-0"])  # group 2: q-0, q-4 on rank 0; q-8, q-11 on rank 1
    assert report.stage("reward.post_process").status == "pass"
    assert report.stage("loss.policy").status == "skipped"
    assert {rows for _, rows in sources[0].loads} == {(0, 4)}
    assert {rows for _, rows in sources[1].loads} == {(2, 5)}


def test_one_rank_of_a_data_parallel_bundle_closes_its_groups_over_the_other_ranks():
    """Replaying rank r alone: its groups' members on other ranks join the group-level stages (a group split
    across ranks is normalized over all of its members), and loss.policy runs for rank r only."""
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])  # every group has members on both ranks
    sources = [source_of(shard, rank=r) for r, shard in enumerate(shards)]
    alone = replay([sources[1]])  # the rank's rows by themselves: groups are incomplete
    assert alone.first_divergent_stage == "reward.post_process"
    report = replay(sources, rank=1)
    assert report.passed, report.render_text()
    assert [(s.stage, s.rank) for s in report.stages][-1:] == [("loss.policy", 1)]
    assert report.stage("loss.policy", rank=1).status == "pass"


def test_one_rank_finds_a_divergence_in_its_group_on_another_rank():
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    shards[0].expected["reward.post_process"]["rewards"][0] += 1.0  # q-0, in group 2 with q-8 and q-11 (rank 1)
    sources = [source_of(shard, rank=r) for r, shard in enumerate(shards)]
    report = replay(sources, rank=1)
    assert report.first_divergent_stage == "reward.post_process"
    assert [d.sample_id for d in report.stage("reward.post_process").divergences] == ["q-0"]


def test_one_rank_selection_picks_among_its_own_samples():
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    sources = [source_of(shard, rank=r) for r, shard in enumerate(shards)]
    with pytest.raises(SelectionError, match="no sample 'q-0'"):
        replay(sources, rank=1, samples=["q-0"])  # q-0 is rank 0's
    report = replay(sources, rank=1, samples=["q-8"])  # group 2: q-8, q-11 here, q-0, q-4 on rank 0
    assert report.stage("reward.post_process").status == "pass"
    assert report.stage("loss.policy").status == "skipped"  # not all of rank 1's samples
    with pytest.raises(BundleError, match="has no rank 7"):
        replay(sources, rank=7)


def test_one_rank_of_replicas_is_replayed_alone():
    case = canonical_case(buggy=False)
    sources = [source_of(case, rank=0), source_of(canonical_case(buggy=False), rank=1)]
    report = replay(sources, rank=1)
    assert report.passed and sources[0].loads == []


def test_partly_overlapping_ranks_are_replayed_each_on_their_own():
    shards = split_ranks(twelve_case(), [range(0, 7), range(6, 12)])
    report = replay([source_of(shard, rank=r) for r, shard in enumerate(shards)])
    assert {s.rank for s in report.stages} == {0, 1}
    # neither rank holds every member of its prompt groups, so each alone diverges at reward.post_process
    assert report.first_divergent_stage == "reward.post_process"


def test_ranks_of_different_bundles_are_an_error():
    with pytest.raises(BundleError, match="different bundles"):
        replay([canonical_source_of(buggy=False), source_of(canonical_case(buggy=True), rank=1)])


@pytest.mark.parametrize(
    "config, kept",
    [
        ({"kl_coef": 0.1}, {"old_log_probs", "log_probs", "entropy", "advantages", "loss_mask"}),
        (
            {"kl_coef": 0.1, "kl_loss_coef": 0.01},
            {"old_log_probs", "log_probs", "entropy", "advantages", "loss_mask", "ref_log_probs"},
        ),
        (
            {"kl_coef": 0.1, "kl_in_reward": True, "advantage_estimator": "reinforce_plus_plus"},
            {"old_log_probs", "log_probs", "entropy", "advantages", "loss_mask", "kl"},
        ),
    ],
)
def test_after_advantage_kl_the_payloads_no_later_stage_reads_under_the_config_are_let_go(config, kept):
    """The reference log-probs and the recorded KL stay loaded only while a later stage can read them under the
    config (a KL loss term; the KL in the token rewards), not whenever some config could."""
    from trajectory_replay.bundle.schema import RecomputeConfig
    from trajectory_replay.replay.cohort import PayloadCache
    from trajectory_replay.replay.flags import setting
    from trajectory_replay.replay.runner import _release
    from trajectory_replay.replay.stages import STAGES

    cache = PayloadCache()
    loaded = ("old_log_probs", "ref_log_probs", "kl", "log_probs", "entropy", "advantages", "loss_mask", "values")
    cache._loaded = {(0, name, None): torch.zeros(1) for name in loaded}
    later = [STAGES[StageId.ADVANTAGE_ESTIMATE], STAGES[StageId.LOSS_POLICY]]
    _release({}, cache, later, setting(RecomputeConfig(**config)))
    assert {name for _, name, _ in cache._loaded} == kept
