"""Programs the fuzzer (tests/local/test_fuzz_programs.py) found failing, shrunk, each kept
as a regression test: it compiles in local mode and matches `jax.jit`.

Each entry says what was wrong. Add the shrunk `Program(...)` the fuzzer prints.
"""

from __future__ import annotations

import pytest
from fuzz.programs import Program, check

FOUND = {
    # A backward task recomputed the loss's subtraction but not the labels' slice it
    # reads (a free value): "input 'v9@0' is never produced" (compiler/split.py copies
    # free eqns into every task that runs a recomputed eqn reading them).
    "recomputed_loss_reads_labels": Program(layers=("dense",), marks=(0, 1), cast="loss"),
    # A key folded with a count of `jnp.where`'s result: the call's result kept the
    # traced mesh into `random_fold_in`, "Mesh for all inputs should be equal"
    # (compiler/keys.py inlines calls before re-making a task's eqns).
    "key_from_a_call_result": Program(layers=("dense", "dense", "dense"),
                                      extras=(("key", 1, 2),), dropout=(1,)),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found_program_matches_jit(name):
    check(FOUND[name])
