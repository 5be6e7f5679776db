"""bench/schedules.py's analysis (no JAX, no MPI) against hand-computed events and bubbles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import schedules as bench  # noqa: E402

from jaxpp_mpi._src.ir.simulate import MessageCost  # noqa: E402
from jaxpp_mpi.schedules import schedule_by_name  # noqa: E402
from jaxpp_mpi.trace import TraceEvent  # noqa: E402

MS = 1_000_000  # ns


def _event(name: str, cat: str, start_ms: float, end_ms: float, **args) -> TraceEvent:
    return TraceEvent(name, cat, 0, int(start_ms * MS), int(end_ms * MS), args)


def test_breakdown_splits_a_traced_step_by_hand():
    # A rank: F (10 ms), a 4 ms send of 1000 bytes, B (20 ms); its part done at 40 ms,
    # the closing barrier passed at 55 ms (the other rank's cooldown).
    events = [
        _event("F0s0", "task", 1, 11),
        _event("send", "message", 11, 15, bytes=1000),
        _event("B0s0", "task", 15, 35),
    ]
    cost = MessageCost(latency=1.0, bandwidth=1000.0)  # ms, bytes/ms: 1 ms + 1 ms here
    b = bench.breakdown(events, wall_ms=55.0, done_ms=40.0, cost=cost)
    assert b["compute"] == pytest.approx(30.0)
    assert b["message_transfer"] == pytest.approx(2.0)
    assert b["message_wait"] == pytest.approx(2.0)
    assert b["other"] == pytest.approx(40.0 - 30.0 - 4.0)
    assert b["idle_end"] == pytest.approx(15.0)
    assert (b["tasks"], b["messages"]) == (2, 1)


def test_breakdown_never_counts_more_transfer_than_the_message_took():
    events = [_event("recv", "message", 0, 1, bytes=10**6)]
    cost = MessageCost(latency=0.0, bandwidth=1e3)  # 1 s for the bytes: > the 1 ms measured
    b = bench.breakdown(events, wall_ms=1.0, done_ms=1.0, cost=cost)
    assert b["message_transfer"] == pytest.approx(1.0)
    assert b["message_wait"] == 0.0


@pytest.mark.parametrize(
    ("name", "stages", "factor"),
    [
        # GPipe / 1F1B, 2 stages, 8 microbatches, F=1, B=2: busy 2 x 8 x 3 = 48, makespan
        # (8 + 2 - 1) x 3 = 27.
        ("gpipe", 2, 27 / 48),
        ("1f1b", 2, 27 / 48),
    ],
)
def test_ideal_factor_is_the_schedules_bubble(name, stages, factor):
    assert bench.ideal_factor(schedule_by_name(name, stages), 8) == pytest.approx(factor)


def test_flop_task_ms_times_each_run_by_its_executables_flops():
    from jaxpp_mpi._src.ir.program import Program

    program = Program.parse(
        """\
group 0
  inputs %0=0
  run f0 (%0) -> (%1)  task=F0s0
  send %1 -> 1 tag=0
  free %0 %1
  aval %0 float32[1]
  aval %1 float32[1]
group 1
  recv %0 <- 0 tag=0 float32[1]
  run f1_first (%0) -> (%1)  task=F0s1
  free %0
  outputs %1=0
  aval %0 float32[1]
  aval %1 float32[1]
"""
    )
    per_exe = {0: {"f0": 2e9}, 1: {"f1_first": 3e9, "f1": 3e9}}
    assert bench.flop_task_ms(program, per_exe, ms_per_flop=1e-8) == {
        "F0s0": pytest.approx(20.0),
        "F0s1": pytest.approx(30.0),
    }


def test_round_times_merge_each_round_over_the_ranks():
    rank0 = [{"F0s0": 1.0, "B0s0": 2.0}, {"F0s0": 1.5, "B0s0": 2.5}]
    rank1 = [{"F0s1": 3.0}, {"F0s1": 3.5}]
    assert bench.round_times([rank0, rank1]) == [
        {"F0s0": 1.0, "B0s0": 2.0, "F0s1": 3.0},
        {"F0s0": 1.5, "B0s0": 2.5, "F0s1": 3.5},
    ]
