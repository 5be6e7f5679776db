"""Ranking plans: fit first, then time; the reason names the comparison (no JAX)."""

import pytest

from jaxpp_mpi._src.planner.ranking import Plan, format_bytes, format_plans, parse_bytes, rank
from jaxpp_mpi.schedules import GPipe, Interleaved1F1B, Std1F1B, ZeroBubble


def _plan(sched, ms, peak, n=8, bubble=0.1):
    return Plan(sched, n, tuple(range(sched.num_stages)), ms, bubble, (peak, peak // 2))


@pytest.mark.parametrize("text,n", [("80GiB", 80 * 2**30), ("512 MiB", 512 * 2**20),
                                    ("1.5GB", 1_500_000_000), ("4e9", 4_000_000_000),
                                    (1024, 1024), ("12kib", 12 * 1024)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_parse_bytes_refuses_other_text():
    for text in ("lots", "80 GiBs", ""):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(text)


def test_format_bytes():
    assert format_bytes(80 * 2**30) == "80 GiB" and format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"


def test_fitting_plans_first_then_by_time_and_memory():
    plans = [_plan(Std1F1B(2), 10.0, 100), _plan(ZeroBubble(2), 9.0, 100),
             _plan(GPipe(2), 8.0, 500), _plan(Interleaved1F1B(4, 2), 9.0, 90)]
    ranked = rank(plans, memory_limit=200)
    assert [type(p.schedule).__name__ for p in ranked] == [
        "Interleaved1F1B", "ZeroBubble", "Std1F1B", "GPipe"]
    assert [p.fits for p in ranked] == [True, True, True, False]
    assert all(p.fits == (p.peak <= 200) for p in ranked)
    assert "1 faster plans do not fit" in ranked[0].reason
    assert ranked[-1].reason.startswith("does not fit: group 0 needs")


def test_the_reason_compares_with_the_best_other_schedule():
    ranked = rank([_plan(Std1F1B(2), 10.0, 100, bubble=0.2), _plan(ZeroBubble(2), 9.0, 100),
                   _plan(ZeroBubble(2), 9.5, 100, n=16)])
    assert ranked[0].fits is None
    why = ranked[0].reason
    assert why.startswith("ZeroBubble(2 stages), 8 microbatches: predicted 10% faster than")
    assert "Std1F1B(2 stages)" in why and "same peak memory" in why
    assert "bubble 10% against 20%" in why
    assert ranked[1].reason == "5.6% slower than the first"


def test_nothing_fits():
    ranked = rank([_plan(Std1F1B(2), 10.0, 100)], memory_limit=10)
    assert ranked[0].fits is False and ranked[0].reason.startswith("no plan fits")


def test_table_lists_every_plan_and_the_reason():
    ranked = rank([_plan(Std1F1B(2), 10.0, 100), _plan(ZeroBubble(2), 9.0, 2**20)], 2**19)
    text = format_plans(ranked, 2**19)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["#", "schedule", "stages"]
    assert lines[1].split()[1] == "Std1F1B" and lines[1].split()[-2:] == ["yes", "0,1"]
    assert lines[2].split()[1] == "ZeroBubble" and lines[2].split()[-2:] == ["NO", "0,1"]
    assert lines[-1] == f"why first: {ranked[0].reason}"
