"""The program fuzzer: generated training steps (tests/fuzz/programs.py) compile in local
mode and match `jax.jit` of the same step, under every library schedule.

`JAXPP_MPI_FUZZ_EXAMPLES` programs per schedule (default 2, a bounded budget for `make
test`; `make fuzz` runs 300 per schedule). Without `JAXPP_MPI_FUZZ_SEED` hypothesis draws
a fixed, derandomized sequence; with it, the programs of that seed. No example database:
a failure prints its shrunk `Program(...)`, which goes to
tests/local/test_fuzz_regressions.py as a regression test.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from fuzz.programs import Program, compare, programs
from fuzz.programs import check as check_program
from hypothesis import HealthCheck, given, seed, settings

from jaxpp_mpi._src.base import variables
from jaxpp_mpi.schedules import SCHEDULE_NAMES

# Read as base/variables.py defines them (a malformed value names what it takes).
EXAMPLES = variables.variable("JAXPP_MPI_FUZZ_EXAMPLES").parse(os.environ)
SEED = variables.variable("JAXPP_MPI_FUZZ_SEED").parse(os.environ)


def _fuzzed(test):
    test = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    derandomize=SEED is None, print_blob=False,
                    suppress_health_check=list(HealthCheck))(test)
    return seed(SEED)(test) if SEED is not None else test


@pytest.mark.timeout(max(300, 60 * EXAMPLES))
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_generated_programs_match_jit(schedule):
    @_fuzzed
    @given(prog=programs(schedules=(schedule,)))
    def run(prog):
        print(f"fuzz program: {prog!r}", flush=True)  # shown with -s: what ran, in order
        check_program(prog)

    run()


def _never() -> np.ndarray:
    raise AssertionError("the op-by-op run was asked for")


def test_a_float32_result_is_held_to_its_tolerance_alone():
    ref = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)
    compare(ref + 1e-6, ref, Program(), _never, "leaf")
    with pytest.raises(AssertionError, match="leaf"):
        compare(ref + 1e-3, ref, Program(), _never, "leaf")


def test_a_bfloat16_result_may_be_as_far_as_the_op_by_op_run():
    prog = Program(cast="loss")
    ref = np.linspace(-0.9, 0.9, 16, dtype=np.float32).reshape(4, 4)
    got = ref.copy()
    got[2, 1] += 0.028  # over the 2e-2 tolerance (scale 1)
    compare(ref + 1e-3, ref, prog, _never, "leaf")  # within: never run op by op
    near = ref.copy()
    near[2, 1] += 0.026
    compare(got, ref, prog, lambda: near, "leaf")
    with pytest.raises(AssertionError, match=r"leaf: entry \(2, 1\) is .* op by op"):
        compare(got, ref, prog, lambda: ref, "leaf")
    got[0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"entry \(0, 0\)"):
        compare(got, ref, prog, lambda: near, "leaf")
