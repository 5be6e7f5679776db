"""Tests for ir/counts.py: executables per stage and microbatch, read off task labels."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpp_mpi._src.ir.counts import (
    executables_per_microbatch,
    executables_per_microbatch_by_kind,
    group_executables_per_microbatch,
    instruction_counts,
    num_microbatches,
)
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.schedules.tasks import entry_tasks, task_label
from jaxpp_mpi.schedules import (
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    KimiK2,
    Std1F1B,
    ZeroBubble,
)

F32 = Aval((8,), "float32")


def _group(mpmd_idx: int, *instrs) -> GroupProgram:
    """A group running `instrs`: a str is a Run with that task label, defining a fresh
    buffer; anything else is taken as it is. Buffers below 64 (or the Runs' count)
    have avals."""
    out, k = [], 0
    for instr in instrs:
        if isinstance(instr, str):
            instr = Run(f"e{k}", (), (k,), task=instr)
            k += 1
        out.append(instr)
    return GroupProgram(mpmd_idx, (), out, (), {b: F32 for b in range(max(64, k))})


def test_import_is_pure_python():
    # ir/ imports neither JAX nor MPI (docs/DESIGN.md, section 3)
    code = ("import sys, jaxpp_mpi._src.ir.counts;"
            "bad = [m for m in ('jax', 'mpi4py', 'mpi4jax', 'numpy') if m in sys.modules];"
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_one_f_one_b_by_hand():
    program = Program((
        _group(0, "preg0", "F0s0", "F1s0", "B0s0", "B1s0", "post0g0"),
        _group(1, "F0s1+B0s1", "F1s1+B1s1", "post0g1"),
    ))
    assert num_microbatches(program) == 2
    assert executables_per_microbatch(program) == {0: 2.0, 1: 1.0}
    assert executables_per_microbatch_by_kind(program) == {
        0: {"B": 1.0, "F": 1.0}, 1: {"FB": 1.0}}
    assert group_executables_per_microbatch(program) == {0: 2.0, 1: 1.0}


def test_fused_parts_of_two_stages_count_once_on_each():
    # A DualPipeV-style overlapped entry: stage 0's forward with stage 3's backward.
    program = Program((_group(0, "F0s0", "F1s0+I0s3+W0s3", "F0s3", "F1s3", "I1s3", "W1s3",
                              "W0s0", "W1s0"),))
    assert executables_per_microbatch_by_kind(program) == {
        0: {"F": 1.0, "W": 1.0}, 3: {"F": 1.0, "I": 0.5, "IW": 0.5, "W": 0.5}}
    assert executables_per_microbatch(program) == {0: 2.0, 3: 2.5}
    assert group_executables_per_microbatch(program) == {0: 4.0}  # 8 Runs, 2 microbatches


def test_a_stage_on_two_groups_sums_over_groups():
    program = Program((_group(0, "F0s0", "F1s0", "F2s0"),
                       _group(1, "B0s0", "B1s0", "B2s0", "F0s1")))
    assert executables_per_microbatch(program) == {0: 2.0, 1: 1 / 3}
    assert group_executables_per_microbatch(program) == {0: 1.0, 1: 4 / 3}


def test_only_loop_tasks_count():
    program = Program((
        _group(0, Run("init", (), (40,)), "preg0", "pre1g0", "F0s0",
               Send(0, 1, 0), Free((40,)), "B0s0", "post2g0", "other7"),
        _group(1, Recv(50, 0, 0, F32), "F0s1+B0s1", "post0g1"),
    ))
    assert num_microbatches(program) == 1
    assert executables_per_microbatch(program) == {0: 2.0, 1: 1.0}
    assert group_executables_per_microbatch(program) == {0: 2.0, 1: 1.0}


def test_microbatches_are_the_distinct_indexes():
    # Microbatch 5 alone on stage 1 still makes the count 3 (0, 1 and 5).
    program = Program((_group(0, "F0s0", "F1s0", "F5s0"), _group(1, "F5s1")))
    assert num_microbatches(program) == 3
    assert executables_per_microbatch(program) == {0: 1.0, 1: 1 / 3}


def test_no_loop_tasks():
    program = Program((_group(0, "preg0", Run("x", (), (9,))), _group(1)))
    assert num_microbatches(program) == 0
    assert executables_per_microbatch(program) == {}
    assert executables_per_microbatch_by_kind(program) == {}
    assert group_executables_per_microbatch(program) == {}


def test_counts_survive_the_text_form():
    program = Program((_group(0, "F0s0", "F1s0", "B0s0", "B1s0"),
                       _group(1, "F0s1+B0s1", "F1s1+B1s1")))
    parsed = Program.parse(str(program))
    assert executables_per_microbatch(parsed) == executables_per_microbatch(program)


def test_instruction_counts():
    program = Program((
        _group(0, "F0s0", Send(0, 1, 0), SendRecv(1, 1, 1, 51, 1, 1, F32),
               Free((0,)), "B0s0", AllReduce((1,), "sum")),
        _group(1, Recv(50, 0, 0, F32), "F0s1+B0s1",
               SendRecv(0, 0, 1, 52, 0, 1, F32)),
    ))
    assert instruction_counts(program) == {
        0: {"AllReduce": 1, "Free": 1, "Run": 2, "Send": 1, "SendRecv": 1},
        1: {"Recv": 1, "Run": 1, "SendRecv": 1},
    }


# ----------------------------------------------------------------------------- schedules
# Against the schedule library itself: one Run per schedule entry, labelled like the
# entry. Split apart, every stage runs each of its kinds once per microbatch; as the
# schedule fuses them, each group dispatches its entries.

SCHEDULES = [GPipe(3), Std1F1B(4), Eager1F1B(2), ZeroBubble(3), Interleaved1F1B(4, 2),
             KimiK2(6, 3), DualPipeV(4, 2), DualPipeV(6, 3)]


def _program(schedule, n: int, fused: bool) -> Program:
    groups = []
    for g, entries in enumerate(schedule.tasks(n)):
        labels = ([task_label(e) for e in entries] if fused else
                  [task_label(t) for e in entries for t in entry_tasks(e)])
        groups.append(_group(g, *labels))
    return Program(tuple(groups))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
@pytest.mark.parametrize("n", [6, 12])
def test_schedule_tasks_apart(schedule, n):
    kinds = {"F": 1.0, "I": 1.0, "W": 1.0} if schedule.is_partial_bwd else {"B": 1.0,
                                                                            "F": 1.0}
    program = _program(schedule, n, fused=False)
    assert executables_per_microbatch_by_kind(program) == {
        s: kinds for s in range(schedule.num_stages)}
    assert executables_per_microbatch(program) == dict.fromkeys(
        range(schedule.num_stages), float(len(kinds)))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_schedule_entries_as_fused(schedule):
    n = 6
    program = _program(schedule, n, fused=True)
    entries = schedule.tasks(n)
    assert group_executables_per_microbatch(program) == {
        g: len(e) / n for g, e in enumerate(entries)}
    # every stage still counts each entry that touches it once
    for stage, count in executables_per_microbatch(program).items():
        touching = sum(any(t.stage_id == stage for t in entry_tasks(e))
                       for group_entries in entries for e in group_entries)
        assert count == touching / n
