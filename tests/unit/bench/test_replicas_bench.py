"""bench/replicas.py's analysis (no JAX, no MPI) against hand-computed programs and times."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import replicas as bench  # noqa: E402

from jaxpp_mpi._src.ir.program import AllReduce, Free, Program, Recv, Run, Send  # noqa: E402
from jaxpp_mpi._src.ir.reductions import add_replica_reductions  # noqa: E402
from jaxpp_mpi._src.ir.simulate import MessageCost  # noqa: E402
from jaxpp_mpi.trace import TraceEvent  # noqa: E402

# Group 1 finishes its stage's gradient (%2, 80 bytes), sends the input gradient (%1, 4
# bytes) that group 0's backward needs, frees, then all-reduces %2: the order
# `reductions.add_replica_reductions` gives now (past the sends and frees that follow the
# definition; on group 0 past the free).
PROGRAM = """\
group 0
  inputs %0=0
  recv %1 <- 1 tag=0 float32[1]
  run b0 (%0, %1) -> (%2)  task=B0s0
  free %0 %1
  allreduce (%2) op=sum
  outputs %2=0
  aval %0 float32[1]
  aval %1 float32[1]
  aval %2 float32[20]
group 1
  inputs %0=1
  run b1 (%0) -> (%1, %2)  task=B0s1
  send %1 -> 0 tag=0
  free %0 %1
  allreduce (%2) op=sum
  outputs %2=1
  aval %0 float32[1]
  aval %1 float32[1]
  aval %2 float32[20]
"""

# One group, two 80-byte gradients of one task, not yet reduced (the bucket sweep).
TWO_GRADIENTS = """\
group 0
  inputs %0=0
  run b0 (%0) -> (%1, %2)  task=B0s0
  free %0
  outputs %1=0 %2=1
  aval %0 float32[1]
  aval %1 float32[20]
  aval %2 float32[20]
"""

# 16 bytes per time unit, no latency: a 4-byte message takes 0.25; an AllReduce of 80
# bytes over 2 replicas (ring: 2(R-1)/R * bytes / bandwidth) takes 5. Each Run takes 1.
COST = MessageCost(latency=0.0, bandwidth=16.0)


def latency(run: Run) -> float:
    return 1.0


@pytest.fixture(scope="module")
def program() -> Program:
    return Program.parse(PROGRAM)


def test_covered_is_the_union_of_the_clipped_intervals():
    # [2,4) and [3,6) overlap ([2,6) = 4), [8,20) is clipped to [8,10) (2), [-5,1) to [0,1).
    assert bench.covered(0, 10, [(2, 4), (3, 6), (8, 20), (-5, 1), (12, 14)]) == 7
    assert bench.covered(0, 10, []) == 0


def test_is_backward():
    assert [bench.is_backward(x) for x in ("B3s1", "I0s0", "W2s1", "F1s0+B0s1", "F1s0",
                                           "post0g0")] == [True, True, True, True, False, False]


def test_program_positions(program):
    assert bench.program_positions(program.group(1)) == [{
        "index": 3, "bufs": 1, "last_backward_before": 0, "last_backward_task": "B0s1",
        "instructions_since": 3, "backward_runs_after": 0, "length": 4}]


def test_program_is_what_the_pass_builds(program):
    # The premise of the "now" column: the compiler's pass puts the AllReduce past the send.
    bare = Program(tuple(dataclasses.replace(g, instrs=tuple(
        x for x in g.instrs if not isinstance(x, AllReduce))) for g in program.groups))
    assert add_replica_reductions(bare, {0: [(2, "sum")], 1: [(2, "sum")]}, 16 << 20) == program


def test_at_definition_moves_the_reduction_before_the_send(program):
    before = bench.at_definition(program)
    assert [type(x) for x in before.group(1).instrs] == [Run, AllReduce, Send, Free]
    assert [type(x) for x in before.group(0).instrs] == [Recv, Run, AllReduce, Free]
    assert bench.at_definition(before) == before


def test_at_definition_refuses_a_bucket_of_two_definitions():
    p = Program.parse(TWO_GRADIENTS.replace(
        "run b0 (%0) -> (%1, %2)  task=B0s0",
        "run b0 (%0) -> (%1)  task=B0s0\n  run c0 (%0) -> (%2)  task=W0s0",
    ).replace("  free %0\n", "  allreduce (%1, %2) op=sum\n  free %0\n"))
    with pytest.raises(ValueError, match="not defined once by one instruction"):
        bench.at_definition(p)


def test_sim_summary_hand_computed(program):
    # Now: group 1 runs B [0,1], the send [1,1.25], its AllReduce [1.25,6.25]; group 0
    # its B [1.25,2.25] (a fifth of group 1's AllReduce) and AllReduce [2.25,7.25].
    # Without reductions: 2.25.
    s = bench.sim_summary(program, latency, COST, replicas=2)
    assert s["makespan_ms"] == pytest.approx(7.25)
    assert s["makespan_no_reductions_ms"] == pytest.approx(2.25)
    assert s["exposed_ms"] == pytest.approx(5.0)
    assert s["allreduce_ms_per_group"] == pytest.approx([5.0, 5.0])
    assert s["allreduce_bytes_per_group"] == [80, 80]
    assert [a["overlap_backward_elsewhere"] for a in s["allreduces"]] == pytest.approx([0.0, 0.2])
    # Before: group 1's AllReduce [1,6], the send [6,6.25]; group 0's B [6.25,7.25] and
    # AllReduce [7.25,12.25]: the reductions in series.
    b = bench.sim_summary(bench.at_definition(program), latency, COST, replicas=2)
    assert b["makespan_ms"] == pytest.approx(12.25)
    assert b["exposed_ms"] == pytest.approx(10.0)
    assert [a["overlap_backward_elsewhere"] for a in b["allreduces"]] == [0.0, 0.0]


@pytest.mark.parametrize("bucket_bytes, count, largest, exposed", [
    # Ring over 2 replicas with a 0.1 latency: 80 B / 16 + 2 x 0.1 = 5.2 per 80-byte
    # bucket; one 160-byte bucket: 10 + 0.2.
    (80, 2, 80, 10.4),
    (100, 2, 80, 10.4),
    (160, 1, 160, 10.2),
    (0, 1, 160, 10.2),
])
def test_bucket_row_hand_computed(bucket_bytes, count, largest, exposed):
    p = add_replica_reductions(Program.parse(TWO_GRADIENTS), {0: [(1, "sum"), (2, "sum")]},
                               bucket_bytes)
    row = bench.bucket_row(p, latency, MessageCost(latency=0.1, bandwidth=16.0), replicas=2)
    assert row["allreduces_per_group"] == [count]
    assert row["largest_allreduce_bytes_per_group"] == [largest]
    assert row["allreduce_bytes_per_group"] == [160]
    assert row["makespan_no_reductions_ms"] == pytest.approx(1.0)
    assert row["exposed_ms"] == pytest.approx(exposed)


def _task(name, group, start, end):
    return TraceEvent(name, "task", group, start, end)


def _allreduce(group, start, end, nbytes):
    return TraceEvent("allreduce", "message", group, start, end, {"bytes": nbytes})


def test_allreduce_overlap_counts_only_the_same_replica():
    # 2 replicas x 2 groups: rank = replica * 2 + group.
    events = [
        [_task("F0s0", 0, 0, 12), _task("B0s0", 0, 15, 30)],  # replica 0, group 0
        [_task("B0s1", 1, 2, 8), _allreduce(1, 10, 20, 80)],  # replica 0, group 1
        [_task("B0s0", 0, 0, 5)],  # replica 1, group 0
        [_task("B0s1", 1, 1, 9), _allreduce(1, 10, 20, 80)],  # replica 1, group 1
    ]
    rows = bench.allreduce_overlap(events, 2)
    assert [(r["rank"], r["replica"], r["group"], r["bytes"]) for r in rows] == [
        (1, 0, 1, 80), (3, 1, 1, 80)]
    assert [r["overlap_backward_elsewhere"] for r in rows] == [0.5, 0.0]
    assert [r["gap_after_own_last_backward_ms"] for r in rows] == pytest.approx([2e-6, 1e-6])


def test_rank_rows_sums_bytes_per_step():
    one = [{"rank": 1, "bytes": 80, "ms": 2.0, "overlap_backward_elsewhere": 0.5,
            "gap_after_own_last_backward_ms": 0.1},
           {"rank": 1, "bytes": 4, "ms": 1.0, "overlap_backward_elsewhere": 0.0,
            "gap_after_own_last_backward_ms": None}]
    rows = bench.rank_rows([one, one], [[0, 2], [0, 2]], 2, [100, 80], [0, 4])
    assert rows[0]["allreduced_bytes_per_step"] == [0] and rows[0]["expected_bytes"] == 100
    assert rows[1]["allreduced_bytes_per_step"] == [84] and rows[1]["expected_bytes"] == 84
    assert rows[1]["allreduces_per_step"] == [2] and rows[1]["allreduce_ms_per_step"] == 3.0
    assert [a["bytes"] for a in rows[1]["allreduces"]] == [80, 4]
