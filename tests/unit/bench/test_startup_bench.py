"""bench/startup.py's summaries (no JAX) against hand-computed figures: the fit, the
growth of the cost per instruction turn by turn, and the plain reference pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import startup as bench  # noqa: E402


def _run(n: int, lower_s: float, ref: float, dense: float) -> dict:
    return {"instructions": n, "lower_s": lower_s, "reference_us_per_item": ref,
            "reference_dense_us_per_item": dense}


def test_growth_pairs_the_largest_program_with_the_one_nearest_3k_turn_by_turn():
    rows = [
        {"new": [_run(238, 0.01, 0.2, 0.1), _run(238, 0.01, 0.2, 0.1)]},
        {"new": [_run(3358, 0.05, 0.4, 0.3), _run(3358, 0.06, 0.5, 0.3)]},  # nearest 3k
        {"new": [_run(13342, 0.2, 0.4, 0.3), _run(13342, 0.2, 0.4, 0.3)]},
        {"new": [_run(257178, 5.0, 0.8, 0.33), _run(257178, 6.0, 1.0, 0.36)]},  # largest
    ]
    g = bench.growth(rows)
    assert (g["large"], g["small"]) == (257178, 3358)
    small = [1e6 * 0.05 / 3358, 1e6 * 0.06 / 3358]
    large = [1e6 * 5.0 / 257178, 1e6 * 6.0 / 257178]
    assert g["per_turn"]["lower"] == pytest.approx([b / s for b, s in zip(large, small)])
    assert g["per_turn"]["reference"] == pytest.approx([2.0, 2.0])
    assert g["per_turn"]["reference_dense"] == pytest.approx([1.1, 1.2])
    assert g["median"]["reference_dense"] == pytest.approx(1.15)
    assert bench.growth(rows[:1]) == {}


def test_fit_recovers_a_line():
    points = [(n, 0.25 + 20e-6 * n) for n in (1000, 5000, 30000, 250000)]
    fit = bench.fit(points)
    assert fit["a_s"] == pytest.approx(0.25)
    assert fit["b_us_per_instruction"] == pytest.approx(20.0)


@pytest.mark.parametrize("dense", [False, True])
def test_reference_pass_times_per_item(dense):
    assert bench.reference_pass(2000, dense=dense) > 0.0
