"""How many executables a microbatch passes through on each stage, per schedule.

On a GPU every executable call costs a fixed host time, so this count is part of what
a schedule costs. Each case builds the plan of `tests/models.py`'s MLP training step
(one layer per stage) with `build_step` (no devices) and compares
`executables_per_microbatch` of its program with the table below. A change in which
tasks run as one executable (`Note: back-to-back tasks` in compiler/loop_order.py, the
split of a backward) therefore fails here, and the table shows what changed.

How the table follows from the schedules:
- A stage runs F and B per microbatch; under a split backward (ZeroBubble, DualPipeV)
  F, I and W, except the first stage: its input is the batch, it has no input gradient,
  so its backward is W alone.
- The last stage's forward ends in the loss, which nothing but its own backward reads;
  it runs with that backward (B, or I under a split backward) as one executable when
  the schedule runs the backward of every microbatch right after its forward
  (`test_table_follows_the_schedules` checks that against each schedule's task lists).
  Every other stage's forward feeds the next stage, so it stays apart.
"""

from __future__ import annotations

import functools

import pytest
from models import make_step, mlp, schedule

from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.ir.counts import (
    executables_per_microbatch,
    executables_per_microbatch_by_kind,
    group_executables_per_microbatch,
)
from jaxpp_mpi._src.schedules.tasks import Task, TaskType, entry_tasks
from jaxpp_mpi.schedules import SCHEDULE_NAMES

# (groups, microbatches) -> schedule -> per stage, the executables one microbatch passes
# through there, by kind: "F B" is two executables, a fused "FB" one.
EXPECTED = {
    (2, 4): {
        "gpipe": ["F B", "F B"],  # F and B back to back at the turn only: apart
        "1f1b": ["F B", "FB"],
        "eager1f1b": ["F B", "FB"],
        "interleaved": ["F B", "F B", "F B", "FB"],
        "zerobubble": ["F W", "FI W"],
        "dualpipev": ["F W", "F I W", "F I W", "F I W"],  # stage 3 runs F1s3, then F3s0
        "kimik2": ["F B", "F B", "F B", "F B"],  # its extra warm-up F splits stage 3
    },
    (4, 8): {
        "gpipe": ["F B"] * 4,
        "1f1b": ["F B"] * 3 + ["FB"],
        "eager1f1b": ["F B"] * 3 + ["FB"],
        "interleaved": ["F B"] * 7 + ["FB"],
        "zerobubble": ["F W"] + ["F I W"] * 2 + ["FI W"],
        "dualpipev": ["F W"] + ["F I W"] * 7,
        "kimik2": ["F B"] * 8,
    },
}

CASES = [(groups, n, name) for (groups, n), table in EXPECTED.items() for name in table]


def _id(case) -> str:
    groups, n, name = case
    return f"{name}-g{groups}-m{n}"


@functools.cache
def _program(groups: int, n: int, name: str):
    """The program of the MLP training step under schedule `name` (built once per run)."""
    sched = schedule(name, groups)
    params, batch, loss_fn = mlp(sched.num_stages, n, width=4, rows=2)
    step, optimizer = make_step(loss_fn, sched)
    return build_step(step, (optimizer.init(params), params, batch), groups).program


def test_every_schedule_has_a_row():
    for table in EXPECTED.values():
        assert sorted(table) == sorted(SCHEDULE_NAMES)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_executables_per_microbatch(case):
    groups, n, name = case
    want = {s: float(len(kinds.split())) for s, kinds in enumerate(EXPECTED[groups, n][name])}
    assert executables_per_microbatch(_program(groups, n, name)) == want


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_executables_by_kind(case):
    groups, n, name = case
    want = {s: dict.fromkeys(sorted(kinds.split()), 1.0)
            for s, kinds in enumerate(EXPECTED[groups, n][name])}
    assert executables_per_microbatch_by_kind(_program(groups, n, name)) == want


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_executables_per_group(case):
    """A group dispatches the executables of the stages it holds."""
    groups, n, name = case
    sched = schedule(name, groups)
    want = dict.fromkeys(range(groups), 0.0)
    for s, kinds in enumerate(EXPECTED[groups, n][name]):
        want[sched.get_mpmd_idx(s)] += len(kinds.split())
    assert group_executables_per_microbatch(_program(groups, n, name)) == want


def _derived(groups: int, n: int, name: str) -> list[str]:
    """Per stage, its kinds as the module docstring derives them from `sched.tasks(n)`."""
    sched = schedule(name, groups)
    last = sched.num_stages - 1
    split = sched.is_partial_bwd
    kinds = [(["F", "W"] if s == 0 else ["F", "I", "W"]) if split else ["F", "B"]
             for s in range(sched.num_stages)]
    bwd = TaskType.BWD_I if split else TaskType.BWD
    # the last stage's group in schedule order, fused entries as their parts back to
    # back, without the tasks the step does not have (the first stage's I)
    order = [t for e in sched.tasks(n)[sched.get_mpmd_idx(last)] for t in entry_tasks(e)
             if not (t.stage_id == 0 and t.type is TaskType.BWD_I)]
    fused = all(
        k + 1 < len(order) and order[k + 1] == Task(last, t.microbatch, bwd)
        for k, t in enumerate(order)
        if t.stage_id == last and t.type is TaskType.FWD
    )
    if fused:
        kinds[last] = ["F" + bwd.value] + [k for k in kinds[last] if k not in ("F", bwd.value)]
    return [" ".join(k) for k in kinds]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_table_follows_the_schedules(case):
    groups, n, name = case
    assert _derived(groups, n, name) == EXPECTED[groups, n][name]
