"""Programs the fuzzer (tests/local/test_fuzz_programs.py) found failing, shrunk, each kept
as a regression test: it compiles in local mode and matches `jax.jit`.

Each entry says what was wrong (in the pipeline, or in the fuzzer's own judgement). Add
the shrunk `Program(...)` the fuzzer prints.
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
    # Gradients summed in bfloat16 under DualPipeV, momentum and dropout: one entry of a
    # weight gradient 0.047 from jax.jit's (0.109 against 0.156), over the elementwise
    # 3e-2, where jax.jit run op by op differs by 0.031 too: rounding of the large
    # terms that cancel there, now judged against the result's scale (`Program.scale`).
    "bf16_gradient_cancels": Program(
        schedule="dualpipev", microbatches=4, layers=("dense", "gelu", "norm", "norm", "gelu"),
        marks=(0, 0, 2, 2), cast="step", shared=((3, 2),), constant=True, dropout=(0, 3),
        optimizer="momentum", loss="xent"),
    # An embedding's gradient made in bfloat16 (the parameters cast at the top of the
    # loss) under DualPipeV, dropout and a skip: one entry of the momentum -0.039
    # against jax.jit's -0.008, one bfloat16 step of the rows scattered together there
    # (the largest entry is 3.8), where jax.jit run op by op differs by 0.031 too:
    # every bfloat16 step is now judged against the result's scale.
    "bf16_embedding_gradient_cancels": Program(
        schedule="dualpipev", microbatches=4, layers=("dense", "norm", "norm", "norm"),
        marks=(0, 0, 0, 3), cast="loss", embed="embed", shared=((3, 2),),
        skips=((1, (2, 3)),), constant=True, dropout=(2,), optimizer="momentum"),
    # A bfloat16 value carried across a stage boundary, the parameters cast at the top of
    # the loss, momentum, under every 2-stage schedule: one entry of the momentum 0.028
    # from jax.jit's, over the 2e-2 (the result's largest entry is 0.96: scale 1), where
    # jax.jit run op by op differs by 0.026 and the pipeline is 0.008 from that run: a
    # bfloat16 result is now also judged against jax.jit's distance from the op-by-op
    # run (`check`).
    "bf16_carried_value_rounds": Program(
        schedule="gpipe", microbatches=2, layers=("gelu", "dense", "norm", "dense", "norm"),
        marks=(2, 2), cast="loss", shared=((1, 0),), skips=((1, (2,)),),
        extras=(("bf16", 2, 4),), constant=True, optimizer="momentum", loss="mse"),
    # Adam's step count, donated by the first group's pre segment and read by the second
    # group's update, under DualPipeV: a lazy timed walk ran the donating task while the
    # idle peer had not taken the count, then sent the donated buffer ("KeyError: 'in10'"
    # in compiler/walks.py; a donated value owed to an idle peer now goes first).
    "donated_input_owed_to_an_idle_peer": Program(
        schedule="dualpipev", microbatches=4, layers=("dense",) * 5, marks=(0, 0, 5, 5),
        cast="step", recompute=False, optimizer="adam", donate=True),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_found_program_matches_jit(name):
    check(FOUND[name])
