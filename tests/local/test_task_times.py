"""`mpmd_jit_with_loop(..., task_times_ms=...)`: a step lowered for measured task times
computes what `jax.jit` computes, and its program is the one fastest under those times."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from models import assert_close_to_reference, make_step, mlp, run_steps, schedule

import jaxpp_mpi
from jaxpp_mpi._src.ir.simulate import simulate


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")


def _problem(sched_name: str):
    sched = schedule(sched_name, 2)
    params, batch, loss_fn = mlp(sched.num_stages, 8)
    step, opt = make_step(loss_fn, sched)
    return step, opt.init(params), params, batch


def _times(program, first_w: float = 5.0) -> dict[str, float]:
    """Uneven task times: forwards 1, input gradients 2, weight gradients 3, stage 0's
    weight task (which also does its input gradient's work) `first_w`."""
    out = {}
    for g in program.groups:
        for run in g.instrs:
            label = getattr(run, "task", "")
            if label[:1] and label[0] in "FIWB" and "+" not in label:
                kind, stage = label[0], int(label.rsplit("s", 1)[1])
                out[label] = {"F": 1.0, "I": 2.0, "B": 5.0}.get(
                    kind, first_w if stage == 0 else 3.0)
    return out


def test_step_lowered_for_task_times_matches_jax_jit_and_is_faster_under_them(mesh):
    step, opt_state, params, batch = _problem("dualpipev")
    default = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    times = _times(default.compile(opt_state, params, batch).program())
    tuned = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, task_times_ms=times)
    reference = run_steps(jax.jit(step), opt_state, params, batch)
    assert assert_close_to_reference(reference, run_steps(tuned, opt_state, params, batch)) > 0

    def makespan(program):
        return simulate(program, lambda run: times.get(run.task, 0.0)).makespan

    p_default = default.compile(opt_state, params, batch).program()
    p_tuned = tuned.compile(opt_state, params, batch).program()
    assert makespan(p_tuned) < makespan(p_default)  # 99 against 103 under these times


@pytest.mark.parametrize(
    "bad", [[1.0], {"F0s0": -1.0}, {"F0s0": float("nan")}, {3: 1.0}, {"F0s0": "1"}]
)
def test_bad_task_times_are_refused_by_name(mesh, bad):
    step, *_ = _problem("1f1b")
    with pytest.raises(TypeError, match="task_times_ms must map task labels"):
        jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, task_times_ms=bad)


def test_numpy_times_from_collected_medians_are_accepted(mesh):
    step, opt_state, params, batch = _problem("1f1b")
    f = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    with jaxpp_mpi.collect_task_times_ms() as stats:
        f(opt_state, params, batch)
    medians = {label: np.median(ts) for label, ts in stats.items()}
    assert medians
    tuned = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, task_times_ms=medians)
    reference = run_steps(jax.jit(step), opt_state, params, batch, steps=1)
    pipelined = run_steps(tuned, opt_state, params, batch, steps=1)
    assert assert_close_to_reference(reference, pipelined) > 0


def test_task_times_naming_none_of_the_steps_tasks_are_refused(mesh):
    step, opt_state, params, batch = _problem("1f1b")
    f = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, task_times_ms={"F0s7": 1.0})
    with pytest.raises(jaxpp_mpi.CompileError, match="task_times_ms names none of its tasks"):
        f.compile(opt_state, params, batch)
