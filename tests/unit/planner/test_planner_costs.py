"""The planner's cost table and Run times (`Note: planner task costs`), by hand (no JAX)."""

import pytest

from jaxpp_mpi._src.planner.costs import from_flops, from_measured, run_ms, run_temp_bytes

# Two segments; segment 0 has no I task (its W does the whole backward).
FLOPS = {"F": [100.0, 200.0], "B": [200.0, 400.0], "I": [0.0, 100.0], "W": [200.0, 300.0]}
TEMP = {"F": [10, 20], "B": [30, 40], "I": [0, 5], "W": [30, 35]}


def test_from_flops_prices_work_at_the_rate():
    costs = from_flops(FLOPS, TEMP, rows=4, ms_per_flop=0.01, overhead_ms=0.5)
    assert costs.work_ms["B"] == (2.0, 4.0) and costs.work_ms["I"] == (0.0, 1.0)
    assert costs.stage_work("F", (0, 1)) == 3.0 and costs.stage_temp("B", (0, 1)) == 40


def test_run_times_add_overhead_parts_and_scale_with_rows():
    costs = from_flops(FLOPS, TEMP, rows=4, ms_per_flop=0.01, overhead_ms=0.5)
    stages = [(0,), (1,)]
    labels = {"F0s0", "F0s1+B0s1", "B0s0", "post0g0"}
    times = run_ms(labels, costs, stages, rows=8, segment_ms={"post0g0": 7.0})
    assert times["F0s0"] == pytest.approx(0.5 + 2 * 1.0)
    assert times["F0s1+B0s1"] == pytest.approx(0.5 + 2 * (2.0 + 4.0))
    assert times["post0g0"] == 7.0
    # one stage of both segments
    merged = run_ms({"F1s0"}, costs, [(0, 1)], rows=4, segment_ms={})
    assert merged["F1s0"] == pytest.approx(0.5 + 3.0)


def test_a_w_without_its_i_does_both():
    costs = from_flops(FLOPS, TEMP, rows=4, ms_per_flop=0.01, overhead_ms=0.0)
    # the first stage (segments 0 and 1) has no I task: its W also computes I
    times = run_ms({"W0s0", "F0s0"}, costs, [(0, 1)], rows=4, segment_ms={})
    assert times["W0s0"] == pytest.approx(2.0 + 3.0 + 0.0 + 1.0)
    times = run_ms({"I0s1", "W0s1"}, costs, [(0,), (1,)], rows=4, segment_ms={})
    assert times["W0s1"] == pytest.approx(3.0)


def test_measured_times_fill_the_kinds_they_lack():
    # measured 1F1B-like: F and B per stage, the last stage fused, with 1 ms overhead
    measured = {"F0s0": 3.0, "F1s0": 3.0, "B0s0": 5.0, "F0s1+B0s1": 10.0, "post0g0": 99.0}
    costs, rate = from_measured(measured, FLOPS, TEMP, rows=4, overhead_ms=1.0)
    assert costs.work_ms["F"][0] == pytest.approx(2.0) and costs.work_ms["B"][0] == 4.0
    # the fused 9 ms of work shared by FLOPs: F 200, B 400
    assert costs.work_ms["F"][1] == pytest.approx(3.0)
    assert costs.work_ms["B"][1] == pytest.approx(6.0)
    # I and W share each B by their FLOPs; the first segment's W is all of its B
    assert costs.work_ms["I"][1] == pytest.approx(6.0 * 100 / 400)
    assert costs.work_ms["W"][1] == pytest.approx(6.0 * 300 / 400)
    assert costs.work_ms["W"][0] == pytest.approx(4.0) and costs.work_ms["I"][0] == 0.0
    assert rate == pytest.approx((2 + 4 + 3 + 6) / (100 + 200 + 200 + 400))


def test_measured_split_backward_gives_b():
    measured = {"F0s0": 1.0, "W0s0": 2.0, "F0s1": 1.0, "I0s1": 1.5, "W0s1": 0.5}
    costs, _ = from_measured(measured, FLOPS, TEMP, rows=4, overhead_ms=0.0)
    assert costs.work_ms["B"] == (2.0, 2.0)


def test_measured_times_must_name_a_stage_task():
    with pytest.raises(ValueError, match="names no task"):
        from_measured({"post0g0": 1.0, "F0s7": 1.0}, FLOPS, TEMP, rows=4)


def test_loop_task_scratch_is_the_largest_segment_scaled():
    costs = from_flops(FLOPS, TEMP, rows=4, ms_per_flop=1.0)
    assert run_temp_bytes("F0s0", costs, [(0, 1)], rows=4) == 20
    assert run_temp_bytes("F0s1+B0s1", costs, [(0,), (1,)], rows=2) == (20 + 40) // 2


def test_times_measured_on_merged_stages_are_shared_by_flops():
    """Measured on one stage of both segments (a plan's split): shared by FLOPs."""
    measured = {"F0s0": 3.0, "B0s0": 6.0}
    costs, _ = from_measured(measured, FLOPS, TEMP, rows=4, overhead_ms=0.0, stages=[(0, 1)])
    assert costs.work_ms["F"] == pytest.approx((1.0, 2.0))
    assert costs.work_ms["B"] == pytest.approx((2.0, 4.0))
    # a W measured on a stage with no I task measured did the I work too
    costs, _ = from_measured({"W0s0": 6.0}, FLOPS, TEMP, rows=4, overhead_ms=0.0,
                             stages=[(0, 1)])
    assert costs.work_ms["W"] == pytest.approx((2.0, 3.0))
    assert costs.work_ms["I"] == pytest.approx((0.0, 1.0))
