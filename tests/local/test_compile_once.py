"""Each distinct executable of a group is compiled once (`Note: first variants`).

A task's `_first` variant (its first microbatch: it makes the reduction states) runs as
the plain variant on states holding each reduction's identity, so it costs no compile
of its own. The step (the tanh MLP, whose loop reduces with Add, Max and Concat) still
matches plain `jax.jit` of the same step.
"""

from __future__ import annotations

import jax
from models import assert_close_to_reference, make_step, mlp, run_steps, schedule

import jaxpp_mpi as jp
from jaxpp_mpi._src.driver import group_compiler as compiler_module


def test_first_variants_get_no_compile_of_their_own(monkeypatch):
    sched = schedule("1f1b", 2)
    params, batch, loss_fn = mlp(2, 4)
    step, optimizer = make_step(loss_fn, sched)
    built = []
    compile_exe = compiler_module.compile_exe

    def recording(exe, *args, **kwargs):
        built.append(exe)
        return compile_exe(exe, *args, **kwargs)

    monkeypatch.setattr(compiler_module, "compile_exe", recording)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    pipelined = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
        optimizer.init(params), params, batch
    )

    times = lambda exe: sum(e is exe for e in built)
    firsts = 0
    for exes in pipelined.plan.exes:
        for name, exe in exes.items():
            assert times(exe) == (0 if name.endswith("_first") else 1), name
            firsts += name.endswith("_first")
    # Group 0's B family and group 1's fused F+B family (`Note: back-to-back tasks`)
    # start with a `_first` variant here; each got a fill of identity states instead (a
    # compile of its own, with no task in it).
    assert firsts == 2
    plan_exes = [e for exes in pipelined.plan.exes for e in exes.values()]
    assert len([e for e in built if not any(e is x for x in plan_exes)]) == firsts

    reference = run_steps(jax.jit(step), optimizer.init(params), params, batch)
    result = run_steps(pipelined, optimizer.init(params), params, batch)
    assert assert_close_to_reference(reference, result) == len(jax.tree.leaves(reference))
