"""The planner's configurations and stage splits, against hand counts (no JAX)."""

import itertools

import pytest

from jaxpp_mpi._src.planner.candidates import candidates, microbatch_counts
from jaxpp_mpi._src.planner.split import (
    balanced_marks,
    even_marks,
    splits_to_try,
    stage_segments,
)
from jaxpp_mpi.schedules import SCHEDULE_NAMES, DualPipeV, Interleaved1F1B, Std1F1B


def test_microbatch_counts_divide_the_rows_from_the_group_count_up():
    assert microbatch_counts(32, 2) == (2, 4, 8, 16, 32)
    assert microbatch_counts(24, 4) == (4, 6, 8, 12, 24)
    assert microbatch_counts(256, 2) == (2, 4, 8, 16, 32, 64)  # up to 64


@pytest.mark.parametrize("marks", [2, 4, 8])
def test_every_schedule_the_marks_allow_at_every_count(marks):
    found, skipped = candidates(2, marks, (2, 4, 8))
    names = {c.name for c in found} | {s.name for s in skipped}
    assert names == set(SCHEDULE_NAMES)
    for c in found:
        assert c.schedule.mpmd_dim == 2 and c.num_stages <= marks
        c.schedule.tasks(c.num_microbatches)  # the schedule runs it
    one_per_group = {c.name for c in found if c.num_stages == 2}
    assert one_per_group == {"gpipe", "1f1b", "eager1f1b", "zerobubble"}
    interleaved = sorted({c.num_stages for c in found if c.name == "interleaved"})
    assert interleaved == [s for s in (4, 6, 8) if s <= marks]
    assert [s.reason for s in skipped if s.name == "dualpipev" and s.num_microbatches == 2] \
        == ([] if marks < 4 else [str(_dualpipev_error())])


def _dualpipev_error() -> ValueError:
    try:
        DualPipeV(4, 2).tasks(2)
    except ValueError as e:
        return e
    raise AssertionError


def test_schedules_can_be_chosen_and_unknown_names_refused():
    found, _ = candidates(2, 2, (4,), names=("1f1b",))
    assert [c.schedule for c in found] == [Std1F1B(2)]
    with pytest.raises(ValueError, match="unknown schedule"):
        candidates(2, 2, (4,), names=("2f2b",))


def test_a_step_with_too_few_marks_skips_the_interleaved_schedules():
    found, skipped = candidates(2, 2, (4,))
    assert not any(isinstance(c.schedule, Interleaved1F1B) for c in found)
    assert {s.name for s in skipped} >= {"interleaved", "kimik2", "dualpipev"}


def test_even_marks():
    assert even_marks(8, 4) == (1, 3, 5, 7)
    assert even_marks(4, 4) == (0, 1, 2, 3)
    assert even_marks(6, 4) is None


def test_stage_segments():
    assert stage_segments((1, 3)) == [(0, 1), (2, 3)]
    assert stage_segments((0, 3)) == [(0,), (1, 2, 3)]


def _bottleneck(cost, marks):
    return max(sum(cost[j] for j in seg) for seg in stage_segments(marks))


@pytest.mark.parametrize("cost,stages", [
    ([1, 1, 1, 1], 2), ([1, 1, 1, 5], 2), ([5, 1, 1, 1, 1, 1], 3), ([3, 1, 4, 1, 5, 9, 2, 6], 4),
    ([2, 2, 2], 3), ([7], 1),
])
def test_balanced_marks_against_every_split(cost, stages):
    """The dynamic programme's bottleneck equals the best over all C(M-1, S-1) splits."""
    marks = balanced_marks(cost, stages)
    assert len(marks) == stages and marks[-1] == len(cost) - 1
    assert list(marks) == sorted(set(marks))
    best = min(_bottleneck(cost, (*inner, len(cost) - 1))
               for inner in itertools.combinations(range(len(cost) - 1), stages - 1))
    assert _bottleneck(cost, marks) == best


def test_balanced_marks_give_a_heavy_last_segment_a_stage_of_its_own():
    assert balanced_marks([1, 1, 1, 1, 1, 1, 1, 7], 2) == (6, 7)
    assert balanced_marks([1, 1, 1, 1, 1, 1, 1, 4], 2) == (4, 7)  # ties: the earlier cut
    with pytest.raises(ValueError):
        balanced_marks([1, 1], 3)


def test_stages_per_group_can_be_chosen():
    found, _ = candidates(2, 8, (8,), stages_per_group=(1, 2))
    assert {c.num_stages for c in found} == {2, 4}
    found, skipped = candidates(2, 8, (8,), stages_per_group=(4,))
    assert {c.name for c in found} == {"interleaved", "kimik2"}
    assert {c.num_stages for c in found} == {8}
    assert {s.name for s in skipped} == {"gpipe", "1f1b", "eager1f1b", "zerobubble",
                                         "dualpipev"}


@pytest.mark.parametrize("cost,groups", [
    ([1, 1, 1, 1, 1, 1, 1, 3], [0, 1, 1, 0]),  # DualPipeV: group 0 holds stages 0 and 3
    ([3, 1, 4, 1, 5, 9, 2, 6], [0, 1, 0, 1]),  # Interleaved1F1B
    ([2, 1, 1, 1, 1, 1, 1, 1, 1, 4], [0, 1, 2, 0, 1, 2]),
])
def test_group_balanced_marks_against_every_split(cost, groups):
    from jaxpp_mpi._src.planner.split import _group_key, group_balanced_marks

    marks = group_balanced_marks(cost, groups)
    assert len(marks) == len(groups) and marks[-1] == len(cost) - 1
    every = [(*inner, len(cost) - 1)
             for inner in itertools.combinations(range(len(cost) - 1), len(groups) - 1)]
    assert _group_key(cost, marks, groups) == min(_group_key(cost, m, groups) for m in every)


def test_group_balanced_marks_search_when_splits_are_many(monkeypatch):
    from jaxpp_mpi._src.planner import split

    cost = [1.0] * 15 + [6.0]
    groups = [0, 1, 1, 0]
    exact = split.group_balanced_marks(cost, groups)
    monkeypatch.setattr(split, "EXHAUSTIVE", 0)
    searched = split.group_balanced_marks(cost, groups)
    start = split.balanced_marks(cost, 4)
    assert split._group_key(cost, searched, groups) <= split._group_key(cost, start, groups)
    assert split._group_key(cost, searched, groups) == split._group_key(cost, exact, groups)


def test_splits_to_try():
    cost = [1, 1, 1, 1, 1, 1, 1, 7]
    assert splits_to_try(cost, [0, 1]) == [(3, 7), (6, 7)]
    assert splits_to_try(cost, [0, 1], balance=False) == [(3, 7)]
    assert splits_to_try([1, 1, 1], [0, 1], balance=False) == []  # no even split
    dualpipev = splits_to_try(cost, [0, 1, 1, 0])
    assert dualpipev[0] == (1, 3, 5, 7) and len(dualpipev) == len(set(dualpipev))
