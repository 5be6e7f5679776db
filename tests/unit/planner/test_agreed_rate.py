"""The planner's time per FLOP, agreed by the ranks (`agreed_rate` in planner/plan.py):
ranks that time the step at different speeds price every plan alike; a rank that cannot
time it stops every rank's planning; ranks given different measurements are told which
(`same_inputs`). Ranks are threads over a stand-in communicator (the
MPI run is tests/mpi/test_planner_mpi.py)."""

from __future__ import annotations

import pytest
from thread_comm import on_thread_ranks

from jaxpp_mpi._src.planner.plan import agreed_rate, same_inputs
from jaxpp_mpi._src.planner.runtime_cost import RuntimeCost


def test_every_rank_takes_the_fastest_ranks_rate():
    measured = [3e-9, 1e-9, 2e-9]
    out = on_thread_ranks(3, lambda r, comm: agreed_rate(lambda: measured[r], comm))
    assert [err for _, err in out] == [None] * 3
    assert [rate for rate, _ in out] == [1e-9] * 3


def test_alone_the_rate_is_this_process_own():
    assert agreed_rate(lambda: 4e-9, None) == 4e-9
    with pytest.raises(ZeroDivisionError):
        agreed_rate(lambda: 1 / 0, None)


def test_one_rank_failing_to_time_stops_every_rank():
    def rank(r, comm):
        def measure():
            if r == 1:
                raise ValueError("typed keys")
            return 1e-9
        return agreed_rate(measure, comm)

    out = on_thread_ranks(2, rank)
    for _, err in out:
        assert isinstance(err, RuntimeError)
        assert "rank(s) [1] could not time" in str(err) and "typed keys" in str(err)


def test_ranks_given_different_measurements_are_told_which():
    def rank(r, comm):
        times = {"F0_mb0": 1.0, "B0_mb0": 2.0 + (r == 2)}
        same_inputs({"task_times_ms": times, "runtime_cost": RuntimeCost(),
                     "message_cost": (0.1, 1e6) if r else (0.2, 1e6)}, comm)

    out = on_thread_ranks(3, rank)
    for _, err in out:
        assert isinstance(err, ValueError)
        text = str(err)
        assert "task_times_ms on rank(s) [2]" in text and "message_cost on rank(s) [1, 2]" in text
        assert "runtime_cost" not in text and "merge every rank's" in text


def test_the_same_measurements_pass_in_any_order():
    def rank(r, comm):
        items = [("F0_mb0", 1.0), ("B0_mb0", 2.0)]
        same_inputs({"task_times_ms": dict(items if r else items[::-1]),
                     "runtime_cost": RuntimeCost(), "message_cost": None}, comm)

    assert [err for _, err in on_thread_ranks(2, rank)] == [None, None]


def test_a_rank_alone_passing_a_non_number_is_named_on_every_rank():
    def rank(r, comm):
        same_inputs({"task_times_ms": {"F0_mb0": "fast" if r == 1 else 1.0},
                     "runtime_cost": RuntimeCost(), "message_cost": None}, comm)

    out = on_thread_ranks(3, rank)
    for _, err in out:
        assert isinstance(err, ValueError)
        assert "task_times_ms on rank(s) [1]" in str(err)
    # a number agrees with itself whatever its type
    same = on_thread_ranks(2, lambda r, comm: same_inputs(
        {"task_times_ms": {"F0_mb0": 1 if r else 1.0}}, comm))
    assert [err for _, err in same] == [None, None]
