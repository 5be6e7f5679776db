"""Schedules: construction, value semantics, task orders, and the checker over a grid."""

import dataclasses
import subprocess
import sys
from collections import Counter

import pytest

from jaxpp_mpi.schedules import (
    BaseSchedule,
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    KimiK2,
    ScheduleError,
    Std1F1B,
    Task,
    TaskType,
    ZeroBubble,
    check_schedule,
)

F, B, I, W = TaskType.FWD, TaskType.BWD, TaskType.BWD_I, TaskType.BWD_W  # noqa: E741
MICROBATCHES = (1, 2, 3, 4, 5, 8, 16)
STAGES = (1, 2, 3, 4, 8)


def flat(row):
    return [t for e in row for t in (e if isinstance(e, tuple) else (e,))]


def cells(row):
    return [f"{t.type.value}{t.microbatch}" for t in flat(row)]


def grid():
    """(schedule, n) for every schedule over the grid of stages, mpmd_dim, microbatches."""
    for p in STAGES:
        for cls in (GPipe, Std1F1B, Eager1F1B, ZeroBubble):
            yield from ((cls(p), n) for n in MICROBATCHES)
    for d in STAGES:
        for chunks in (1, 2, 3, 4):
            for cls in (Interleaved1F1B, KimiK2):
                for fuse in (False, True):
                    yield from ((cls(d * chunks, d, fuse), n) for n in MICROBATCHES)
        yield from ((DualPipeV(2 * d, d), n) for n in MICROBATCHES)


def _accepts(schedule, n):
    try:
        schedule.tasks(n)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule,n", list(grid()), ids=lambda x: repr(x))
def test_grid_accepted_schedules_pass_the_checker(schedule, n):
    if not _accepts(schedule, n):
        with pytest.raises(ValueError, match=type(schedule).__name__):
            schedule.tasks(n)
        return
    check_schedule(schedule, n)
    check_schedule(schedule, n, comm_latency=0.5)
    tasks = schedule.tasks(n)
    assert len(tasks) == schedule.mpmd_dim
    kinds = (F, I, W) if schedule.is_partial_bwd else (F, B)
    seen = Counter(t for row in tasks for t in flat(row))
    assert set(seen.values()) == {1}
    assert len(seen) == schedule.num_stages * n * len(kinds)
    # Per (stage, kind), microbatches run in increasing order.
    for row in tasks:
        last = {}
        for t in flat(row):
            assert last.get((t.stage_id, t.type), -1) < t.microbatch
            last[t.stage_id, t.type] = t.microbatch


def test_which_grid_points_are_rejected():
    rejected = {(repr(s), n) for s, n in grid() if not _accepts(s, n)}
    for s, n in grid():
        name = type(s).__name__
        if name in ("GPipe", "Std1F1B", "Eager1F1B"):
            assert (repr(s), n) not in rejected
        elif name in ("ZeroBubble", "DualPipeV"):
            assert ((repr(s), n) in rejected) == (n < s.num_stages)
        else:
            chunks = s.num_stages // s.mpmd_dim
            bad = chunks > 1 and n % max(1, n // s.mpmd_dim) != 0
            assert ((repr(s), n) in rejected) == bad


def test_one_stage_one_microbatch():
    for s in (GPipe(1), Std1F1B(1), Eager1F1B(1), Interleaved1F1B(1, 1), KimiK2(1, 1)):
        assert s.tasks(1) == [[Task(0, 0, F), Task(0, 0, B)]]
    assert ZeroBubble(1).tasks(1) == [[Task(0, 0, F), Task(0, 0, I), Task(0, 0, W)]]
    check_schedule(DualPipeV(2, 1), 2)


def test_value_semantics_and_repr():
    assert repr(Std1F1B(4)) == "Std1F1B(num_stages=4)"
    assert repr(Interleaved1F1B(8, 4)) == (
        "Interleaved1F1B(num_stages=8, mpmd_dim=4, fuse_steady_state=False)"
    )
    assert repr(KimiK2(8, 4, True)) == "KimiK2(num_stages=8, mpmd_dim=4, fuse_steady_state=True)"
    assert repr(DualPipeV(4, 2)) == "DualPipeV(num_stages=4, mpmd_dim=2)"
    assert Std1F1B(4) == Std1F1B(4) and hash(Std1F1B(4)) == hash(Std1F1B(4))
    assert Std1F1B(4) != Eager1F1B(4) and GPipe(4) != Std1F1B(4)
    assert Interleaved1F1B(8, 4) != KimiK2(8, 4)
    assert len({Std1F1B(4), Std1F1B(4), Std1F1B(2)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        Std1F1B(4).num_stages = 3
    assert isinstance(ZeroBubble(2), BaseSchedule)
    with pytest.raises(TypeError):
        BaseSchedule(2)


def test_properties_and_group_maps():
    assert (Std1F1B(4).mpmd_dim, Std1F1B(4).is_partial_bwd) == (4, False)
    assert ZeroBubble(4).is_partial_bwd and DualPipeV(4, 2).is_partial_bwd
    assert not Interleaved1F1B(8, 4).is_partial_bwd
    assert [GPipe(3).get_mpmd_idx(s) for s in range(3)] == [0, 1, 2]
    assert [Interleaved1F1B(6, 3).get_mpmd_idx(s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [DualPipeV(8, 4).get_mpmd_idx(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="stage_id 4 is out of range"):
        GPipe(4).get_mpmd_idx(4)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: Std1F1B(0), r"Std1F1B: num_stages must be a positive integer, got 0"),
        (lambda: GPipe(-1), r"GPipe: num_stages .* got -1"),
        (lambda: ZeroBubble(2.0), r"ZeroBubble: num_stages .* got 2.0"),
        (lambda: Interleaved1F1B(4, 0), r"Interleaved1F1B: mpmd_dim .* got 0"),
        (lambda: Interleaved1F1B(6, 4), r"num_stages=6 is not divisible by mpmd_dim=4"),
        (lambda: KimiK2(3, 2), r"KimiK2: num_stages=3 is not divisible by mpmd_dim=2"),
        (lambda: DualPipeV(6, 2), r"DualPipeV needs exactly 2 \* mpmd_dim stages.*num_stages=6"),
        (lambda: DualPipeV(2, 2), r"use DualPipeV\(num_stages=4, mpmd_dim=2\)"),
    ],
)
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "schedule,n,match",
    [
        (Std1F1B(4), 0, r"Std1F1B\(num_stages=4\): the number of microbatches .* got 0"),
        (GPipe(2), -3, r"got -3"),
        (ZeroBubble(4), 3, r"ZeroBubble\(num_stages=4\) needs at least num_stages=4 .* got 3"),
        (DualPipeV(8, 4), 7, r"DualPipeV\(num_stages=8, mpmd_dim=4\) needs at least .* got 7"),
        (Interleaved1F1B(8, 4), 9, r"cannot run 9 microbatches.*multiple of 4 such as 8 or 12"),
        (KimiK2(4, 2), 5, r"KimiK2.*cannot run 5 microbatches"),
    ],
)
def test_tasks_errors(schedule, n, match):
    with pytest.raises(ValueError, match=match):
        schedule.tasks(n)


def test_gpipe_order():
    assert [cells(r) for r in GPipe(2).tasks(3)] == [["F0", "F1", "F2", "B0", "B1", "B2"]] * 2


def test_std_1f1b_order():
    rows = Std1F1B(4).tasks(8)
    assert cells(rows[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7".split()
    assert cells(rows[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7".split()
    # Fewer microbatches than stages: warm-up capped at n.
    assert cells(Std1F1B(4).tasks(2)[0]) == ["F0", "F1", "B0", "B1"]


def test_eager_1f1b_has_twice_the_warmup():
    rows = Eager1F1B(4).tasks(8)
    assert cells(rows[0])[:8] == "F0 F1 F2 F3 F4 F5 F6 B0".split()
    assert cells(rows[2])[:4] == "F0 F1 F2 B0".split()
    assert cells(rows[3])[:2] == "F0 B0".split()


def test_interleaved_with_one_chunk_is_eager_1f1b():
    for p in (1, 2, 4):
        for n in (1, 3, 8):
            assert Interleaved1F1B(p, p).tasks(n) == Eager1F1B(p).tasks(n)


def test_interleaved_order_and_fusion():
    rows = Interleaved1F1B(4, 2).tasks(4)
    # Group 0 holds stages 0 and 2: a round of 2 microbatches on stage 0, then on stage 2.
    first = [str(t) for t in flat(rows[0])[:6]]
    assert first == ["F0s0", "F1s0", "F0s2", "F1s2", "F2s0", "B0s2"]  # 4 warm-up forwards
    fused = Interleaved1F1B(4, 2, fuse_steady_state=True).tasks(4)
    assert [flat(r) for r in fused] == [flat(r) for r in rows]
    for row in fused:
        for e in row:
            if isinstance(e, tuple):
                assert [t.type for t in e] == [F, B]


def test_kimi_k2_warms_up_one_more_forward():
    def warmup(row):
        return next(i for i, t in enumerate(flat(row)) if t.type is B)

    for r, (a, b) in enumerate(
        zip(Interleaved1F1B(8, 4).tasks(8), KimiK2(8, 4).tasks(8), strict=True)
    ):
        assert warmup(b) == warmup(a) + 1 == (2 - 1) * 4 + 2 * (4 - 1 - r) + 2


def test_zero_bubble_defers_weight_gradients():
    rows = ZeroBubble(4).tasks(8)
    assert cells(rows[0])[:7] == "F0 F1 F2 F3 I0 W0 F4".split()
    assert cells(rows[3])[:9] == "F0 I0 F1 I1 F2 I2 F3 I3 W0".split()
    assert all(t.type is not B for row in rows for t in flat(row))


def test_dualpipev_shape():
    rows = DualPipeV(4, 2).tasks(4)
    assert {t.stage_id for t in flat(rows[0])} == {0, 3}
    assert {t.stage_id for t in flat(rows[1])} == {1, 2}
    assert any(isinstance(e, tuple) and e[0].type is F and len(e) == 3 for e in rows[0])


def test_checker_rejects_a_broken_schedule():
    @dataclasses.dataclass(frozen=True)
    class Backwards(GPipe):
        def tasks(self, num_microbatches):
            return [row[::-1] for row in super().tasks(num_microbatches)]

    with pytest.raises(ScheduleError, match=r"Backwards\(num_stages=2\): group 0, position 0"):
        check_schedule(Backwards(2), 2)


def test_import_is_pure_python():
    code = (
        "import sys, jaxpp_mpi.schedules, jaxpp_mpi.schedules.__main__;"
        "bad = [m for m in ('jax', 'mpi4py', 'mpi4jax', 'numpy') if m in sys.modules];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_schedule_by_name_covers_every_short_name():
    from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name

    made = {name: schedule_by_name(name, 4) for name in SCHEDULE_NAMES}
    assert all(s.mpmd_dim == 4 for s in made.values())
    assert made["1f1b"] == Std1F1B(4)
    assert made["dualpipev"] == DualPipeV(8, 4)
    assert made["interleaved"] == Interleaved1F1B(8, 4)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe, 1f1b"):
        schedule_by_name("pipedream", 4)
