"""Selection closure and its fail-closed paths, over records alone."""

import pytest

from trajectory_replay.bundle.schema import SampleRecord
from trajectory_replay.errors import SelectionError
from trajectory_replay.replay.selection import Selection, resolve_selection

GROUPS = [0, 1, 0, None, 2, 1, 2, 0]
BATCHES = ["mb-0001", "mb-0001", "mb-0002", "mb-0002", "mb-0003", None, "mb-0003", "mb-0003"]
RECORDS = [
    SampleRecord(
        sample_id=f"s-{i}",
        group_index=g,
        response_length=1,
        total_length=2,
        raw_reward=0.0,
        reward=0.0,
        micro_batch_id=b,
    )
    for i, (g, b) in enumerate(zip(GROUPS, BATCHES))
]


def _closure(**kw):
    return resolve_selection(Selection(**{k: tuple(v) for k, v in kw.items()}), RECORDS)


def test_empty_selection_is_everything_and_not_partial():
    closure = _closure()
    assert closure.positions == tuple(range(8)) and not closure.partial


def test_a_sample_pulls_in_its_whole_group_including_non_adjacent_members():
    assert _closure(samples=["s-2"]).positions == (0, 2, 7)
    assert _closure(samples=["s-2"]).partial


def test_a_sample_without_group_index_is_just_itself():
    assert _closure(samples=["s-3"]).positions == (3,)


def test_group_selection():
    assert _closure(groups=["g-1"]).positions == (1, 5)
    assert _closure(groups=["g-1", "g-2"]).positions == (1, 4, 5, 6)


def test_batch_selection_closes_over_the_groups_it_touches():
    # mb-0002 holds s-2 (group 0) and s-3 (no group): group 0 is s-0, s-2, s-7
    assert _closure(batches=["mb-0002"]).positions == (0, 2, 3, 7)


def test_selectors_combine_as_a_union():
    assert _closure(samples=["s-3"], groups=["g-2"]).positions == (3, 4, 6)


def test_a_selection_covering_everything_is_not_partial():
    assert not _closure(groups=["g-0", "g-1", "g-2"], samples=["s-3"]).partial


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"samples": ["s-99"]}, "no sample 's-99'"),
        ({"groups": ["g-9"]}, "no group 'g-9'"),
        ({"groups": ["0"]}, "no group '0'"),
        ({"batches": ["mb-0009"]}, "no batch 'mb-0009'"),
        ({"samples": ["s-0", "s-42"]}, "no sample 's-42'"),
    ],
)
def test_any_miss_fails_closed(kw, message):
    with pytest.raises(SelectionError, match=message):
        _closure(**kw)
