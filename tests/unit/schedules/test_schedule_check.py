"""Checker failure cases and schedule analysis against closed forms."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpp_mpi._src.schedules.check import check_tasks
from jaxpp_mpi.schedules import (
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
    analyze_schedule,
)

F, B, I, W = TaskType.FWD, TaskType.BWD, TaskType.BWD_I, TaskType.BWD_W  # noqa: E741


def check(rows, num_stages=2, n=1, stage_to_group=(0, 1), partial=False, **kw):
    return check_tasks(
        rows,
        num_stages=num_stages,
        num_microbatches=n,
        stage_to_group=stage_to_group,
        partial_bwd=partial,
        name="S",
        **kw,
    )


def T(s, m, k):
    return Task(s, m, k)


OK = [[T(0, 0, F), T(0, 0, B)], [T(1, 0, F), T(1, 0, B)]]


def test_valid_tasks_give_a_timeline():
    timeline = check(OK)
    assert [(e.start, e.end) for e in timeline[0]] == [(0, 1), (4, 6)]
    assert [(e.start, e.end) for e in timeline[1]] == [(1, 2), (2, 4)]
    late = check(OK, comm_latency=0.5)
    assert [(e.start, e.end) for e in late[0]] == [(0, 1), (5, 7)]
    assert [(e.start, e.end) for e in late[1]] == [(1.5, 2.5), (2.5, 4.5)]


@pytest.mark.parametrize(
    "rows,kw,match",
    [
        (
            [[T(0, 0, F)], [T(1, 0, F), T(1, 0, B)]],
            {},
            r"S: BWD\(stage=0, microbatch=0\) is missing",
        ),
        (
            [[T(0, 0, F), T(0, 0, B), T(0, 0, B)], [T(1, 0, F), T(1, 0, B)]],
            {},
            r"S: group 0, position 2: BWD\(stage=0, microbatch=0\): appears twice; it already "
            r"ran at group 0, position 1",
        ),
        (
            [[T(0, 0, F), T(0, 0, B), T(1, 0, F)], [T(1, 0, B)]],
            {},
            r"group 0, position 2: FWD\(stage=1, microbatch=0\): stage 1 belongs to group 1",
        ),
        (
            [[T(0, 0, B), T(0, 0, F)], [T(1, 0, F), T(1, 0, B)]],
            {},
            r"group 0, position 0: BWD\(stage=0, microbatch=0\) runs before FWD\(stage=0, "
            r"microbatch=0\), which it needs and which group 0 only runs later, at group 0, "
            r"position 1",
        ),
        (
            [[T(0, 0, F), T(0, 0, I), T(0, 0, W)], [T(1, 0, F), T(1, 0, B)]],
            {"partial": False},
            r"BWD_I has no place",
        ),
        (
            [[T(0, 0, F), T(0, 0, B)], [T(1, 0, F), T(1, 1, B)]],
            {},
            r"FWD\+BWD|microbatch is outside 0\.\.0",
        ),
        (
            [[T(0, 0, F), T(0, 0, B)], [T(1, 0, F), T(7, 0, B)]],
            {},
            r"stage is outside 0\.\.1",
        ),
        ([[T(0, 0, F), "B0"], [T(1, 0, F), T(1, 0, B)]], {}, r"'B0' is not a Task"),
        ([[T(0, 0, F), ()], [T(1, 0, F), T(1, 0, B)]], {}, r"\(\) is not a Task"),
    ],
)
def test_checker_errors(rows, kw, match):
    with pytest.raises(ScheduleError, match=match):
        check(rows, **kw)


def test_partial_bwd_rules():
    rows = [[T(0, 0, F), T(0, 0, W), T(0, 0, I)]]
    with pytest.raises(ScheduleError, match=r"BWD_W\(stage=0, microbatch=0\) runs before BWD_I"):
        check(rows, num_stages=1, stage_to_group=(0,), partial=True)
    rows = [[T(0, 0, F), (T(0, 0, I), T(0, 0, W))]]
    check(rows, num_stages=1, stage_to_group=(0,), partial=True)
    rows = [[T(0, 0, F), (T(0, 0, W), T(0, 0, I))]]
    with pytest.raises(ScheduleError, match="later in the same fused task"):
        check(rows, num_stages=1, stage_to_group=(0,), partial=True)


def test_cyclic_wait_between_groups_is_reported():
    rows = [
        [T(0, 0, F), T(0, 0, B), T(0, 1, F), T(0, 1, B)],
        [T(1, 1, F), T(1, 1, B), T(1, 0, F), T(1, 0, B)],
    ]
    with pytest.raises(
        ScheduleError,
        match=r"wait for each other forever \(cyclic wait\): "
        r"group 0, position 1 \(BWD\(stage=0, microbatch=0\)\) waits for "
        r"BWD\(stage=1, microbatch=0\) at group 1, position 3; group 1",
    ):
        check(rows, n=2)


def test_fused_task_waits_for_all_external_inputs():
    # Group 0 fuses F1 with B0: B0 needs group 1's B0, which needs F0 only -> fine.
    rows = [
        [T(0, 0, F), (T(0, 1, F), T(0, 0, B)), T(0, 1, B)],
        [T(1, 0, F), T(1, 0, B), T(1, 1, F), T(1, 1, B)],
    ]
    check(rows, n=2)
    # Group 1 needs F(0, 1) before B(1, 0), but F(0, 1) is fused with B(0, 0): cyclic.
    rows[1] = [T(1, 0, F), T(1, 1, F), T(1, 0, B), T(1, 1, B)]
    with pytest.raises(ScheduleError, match="forever"):
        check(rows, n=2)


def test_custom_latencies_and_fused_sum():
    a = analyze_schedule(Interleaved1F1B(1, 1, fuse_steady_state=True), 3, {F: 2, B: 3})
    assert a.makespan == 15 and a.busy == (15,) and a.bubble_fraction == (0.0,)
    assert any(isinstance(e.entry, tuple) and e.end - e.start == 5 for e in a.timeline[0])
    with pytest.raises(ValueError, match="latency of FWD must be >= 0"):
        analyze_schedule(GPipe(2), 2, {F: -1})
    with pytest.raises(ValueError, match="comm_latency"):
        analyze_schedule(GPipe(2), 2, comm_latency=-1)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_gpipe_and_1f1b_closed_forms(p, m):
    gpipe, one_f_one_b = analyze_schedule(GPipe(p), m), analyze_schedule(Std1F1B(p), m)
    for a in (gpipe, one_f_one_b):
        assert a.makespan == 3 * (m + p - 1)
        assert a.bubble_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)
        assert a.busy == (3 * m,) * p
    assert gpipe.peak_activations[0] == m
    assert one_f_one_b.peak_activations[0] == min(p, m) <= p
    assert one_f_one_b.peak_activations == tuple(min(p - s, m) for s in range(p))
    assert analyze_schedule(Eager1F1B(p), m).peak_activations[0] == min(2 * p - 1, m)


def test_zero_bubble_beats_1f1b():
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        zb, std = analyze_schedule(ZeroBubble(p), m), analyze_schedule(Std1F1B(p), m)
        assert zb.makespan < std.makespan
        assert max(zb.peak_activations) <= p


def test_interleaving_shrinks_the_bubble():
    std = analyze_schedule(Std1F1B(4), 8)
    inter = analyze_schedule(Interleaved1F1B(8, 4), 8, {F: 0.5, B: 1})
    assert inter.makespan < std.makespan
    dualpipev = analyze_schedule(DualPipeV(8, 4), 16)  # twice the stages: compare bubbles
    assert max(dualpipev.bubble_fraction) < min(analyze_schedule(Std1F1B(4), 16).bubble_fraction)


SCHEDULES = st.one_of(
    st.builds(GPipe, st.integers(1, 6)),
    st.builds(Std1F1B, st.integers(1, 6)),
    st.builds(Eager1F1B, st.integers(1, 6)),
    st.builds(ZeroBubble, st.integers(1, 6)),
    st.builds(
        lambda d, c, f: Interleaved1F1B(d * c, d, f),
        st.integers(1, 5),
        st.integers(1, 3),
        st.booleans(),
    ),
    st.builds(
        lambda d, c, f: KimiK2(d * c, d, f), st.integers(1, 5), st.integers(1, 3), st.booleans()
    ),
    st.builds(lambda d: DualPipeV(2 * d, d), st.integers(1, 5)),
)


@settings(max_examples=150, deadline=None)
@given(
    SCHEDULES,
    st.integers(1, 24),
    st.sampled_from([0.0, 0.25, 1.0]),
    st.sampled_from([0.5, 1.0, 2.0]),
)
def test_analysis_invariants(schedule, n, comm, bwd):
    try:
        schedule.tasks(n)
    except ValueError:
        return
    a = analyze_schedule(schedule, n, {B: bwd, I: bwd / 2, W: bwd / 2}, comm_latency=comm)
    per_group = schedule.num_stages // schedule.mpmd_dim
    assert a.busy == pytest.approx([n * per_group * (1 + bwd)] * schedule.mpmd_dim)
    for row, busy, bubble, peak in zip(
        a.timeline, a.busy, a.bubble_fraction, a.peak_activations, strict=True
    ):
        assert 0 <= bubble < 1 and bubble == pytest.approx(1 - busy / a.makespan)
        assert 1 <= peak <= n * per_group
        assert all(x.end <= y.start for x, y in zip(row, row[1:], strict=False))
        assert row[-1].end <= a.makespan
    assert max(row[-1].end for row in a.timeline) == a.makespan
    # Analysis is a pure function of its inputs.
    assert analyze_schedule(schedule, n, {B: bwd, I: bwd / 2, W: bwd / 2}, comm_latency=comm) == a


def test_kimi_k2_holds_one_more_activation():
    inter, kimi = analyze_schedule(Interleaved1F1B(8, 4), 8), analyze_schedule(KimiK2(8, 4), 8)
    assert kimi.peak_activations == tuple(p + 1 for p in inter.peak_activations)
