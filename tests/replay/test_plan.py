"""The replay plan: decided before any stage runs, a frozen value that says what will run on which rows."""

import dataclasses

import pytest

from tests.replay.cases import split_ranks, twelve_case
from tests.replay.conftest import source_of
from trajectory_replay.bundle.schema import StageCapability, StageContract, StageId
from trajectory_replay.bundle.stage_io import STAGE_IO
from trajectory_replay.errors import SelectionError, UnsupportedError
from trajectory_replay.replay import PARTIAL_SELECTION, STAGES, Selection, canonical_case, replay
from trajectory_replay.replay.plan import plan_replay
from trajectory_replay.replay.runner import execute


def _data_parallel():
    shards = split_ranks(twelve_case(), [range(0, 5), range(5, 12)])
    return [source_of(shard, rank=r) for r, shard in enumerate(shards)]


def test_two_disjoint_ranks_plan_one_cohort_of_shards_and_loss_per_rank():
    sources = _data_parallel()
    plan = plan_replay(sources)
    assert plan.layout == "data-parallel" and plan.ranks == (0, 1)
    assert [s.ranks for s in plan.shards] == [(0,), (1,)]
    (one,) = plan.passes
    assert [(p.source.rank, len(p.positions)) for p in one.parts] == [(0, 5), (1, 7)]
    assert one.label is None and one.copies == () and one.cohort_ranks == ((0,), (1,)) and one.cohort_skip == ""
    assert [(p.stage.id, p.action) for p in plan.stages] == [
        (s, "run") for s in STAGES if s not in (StageId.LOSS_VALUE, StageId.ROLLOUT_MISMATCH)
    ]
    assert plan.describe().splitlines()[0] == "bundle b-twelve ranks 0, 1: data-parallel"
    assert "pass 1: samples rank 0: 5/5, rank 1: 7/7; verdicts once; cohort-level stages for ranks 0, 1" in str(plan)
    assert all(s.loads == [] for s in sources)  # telling shards apart read no payload
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layout = "single"


def test_a_partial_selection_plans_loss_policy_skipped_with_the_reason():
    plan = plan_replay([source_of(canonical_case(buggy=True))], Selection(samples=("s-2",)))
    (one,) = plan.passes
    assert plan.layout == "single" and one.cohort_skip == PARTIAL_SELECTION
    assert [p.positions for p in one.parts] == [(2, 3)]  # s-2 and its group partner s-3
    assert f"cohort-level stages skipped ({PARTIAL_SELECTION})" in plan.describe()
    report = execute(plan)
    assert report.stage("loss.policy").status == "skipped" and report.stage("loss.policy").message == PARTIAL_SELECTION
    assert report.to_dict() == replay([source_of(canonical_case(buggy=True))], samples=["s-2"]).to_dict()


def test_a_split_group_is_closed_over_both_ranks_in_the_plan():
    shards = split_ranks(twelve_case(), [range(0, 6), range(6, 12)])
    plan = plan_replay([source_of(shard, rank=r) for r, shard in enumerate(shards)], Selection(samples=("q-0",)))
    (one,) = plan.passes
    assert [(p.source.rank, p.positions) for p in one.parts] == [(0, (0, 4)), (1, (2, 5))]
    assert one.cohort_skip == PARTIAL_SELECTION


def test_identical_ranks_plan_replicas_replayed_once_and_reported_for_each():
    case = canonical_case(buggy=False)
    plan = plan_replay([source_of(case, rank=0), source_of(case, rank=1)])
    assert plan.layout == "replicas" and [s.ranks for s in plan.shards] == [(0, 1)]
    (one,) = plan.passes
    assert len(one.parts) == 1 and one.cohort_ranks == ((0, 1),)


def test_rank_local_ids_plan_a_pass_per_rank_and_a_selection_skips_ranks_without_the_ids():
    cases = [canonical_case(buggy=False), canonical_case(buggy=False)]
    cases[1].expected["reward.post_process"]["rewards"] = [-5.5, -3.5, 3.5, 5.5]  # same ids, other data
    cases[1].index.samples[0].micro_batch_id = "mb-0042"
    sources = [source_of(c, rank=r) for r, c in enumerate(cases)]
    plan = plan_replay(sources)
    assert plan.layout == "rank-local"
    assert [(p.label, p.cohort_ranks, p.cohort_skip) for p in plan.passes] == [(0, ((0,),), ""), (1, ((1,),), "")]
    only = plan_replay(sources, Selection(batches=("mb-0042",)))
    assert [(p.label, p.cohort_skip) for p in only.passes] == [(1, PARTIAL_SELECTION)]
    assert [p.positions for p in only.passes[0].parts] == [(0, 1)]


def test_one_rank_of_a_data_parallel_bundle_reports_the_cohort_stage_for_that_rank_only():
    plan = plan_replay(_data_parallel(), rank=1)
    (one,) = plan.passes
    assert plan.layout == "data-parallel" and one.cohort_ranks == ((), (1,)) and one.cohort_skip == ""


def test_stages_declared_recorded_only_are_planned_with_why():
    case = canonical_case(buggy=False)
    case.manifest.stage_contracts[StageId.REWARD_POST_PROCESS] = StageContract(
        stage=StageId.REWARD_POST_PROCESS, capability=StageCapability.RECORDED_ONLY
    )
    planned = {p.stage.id: p for p in plan_replay([source_of(case)]).stages}
    assert planned[StageId.REWARD_POST_PROCESS].action == "recorded"
    assert planned[StageId.REWARD_POST_PROCESS].reason.startswith("capability=recorded-only")


def test_refusals_are_raised_by_the_plan_before_anything_is_loaded():
    sources = _data_parallel()
    with pytest.raises(SelectionError, match="no sample 's-9'"):
        plan_replay(sources, Selection(samples=("s-9",)))
    with pytest.raises(SelectionError, match="no sample 'q-0'"):
        plan_replay(sources, Selection(samples=("q-0",)), rank=1)  # q-0 is rank 0's
    sources[1].index.identity.rank.cp = 2
    with pytest.raises(UnsupportedError, match="cp=2"):
        plan_replay(sources)
    assert all(s.loads == [] for s in sources)


def test_each_stage_loads_only_payloads_its_table_row_names():
    """The stage table is what replay keeps loaded between stages: a stage loading a payload its row does not
    name would be read twice."""
    for stage in STAGES:
        if stage in (StageId.LOSS_VALUE, StageId.ROLLOUT_MISMATCH):  # not contracted by this case
            continue
        source = source_of(twelve_case())
        plan = plan_replay([source], stages=[stage])
        execute(plan)
        named = {name for p in plan.stages for name in STAGE_IO[p.stage.id].payloads_read}
        assert source.loaded_names() <= named, stage
