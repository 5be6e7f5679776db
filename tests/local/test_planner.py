"""The schedule planner on whole steps (`Note: planning a step`).

- Memory: each plan's peak bytes per group equal `memory_analysis()` of the same
  schedule compiled (the same program, XLA's scratch of the same executables); with
  the loop tasks' scratch estimated, within 10% on the transformer.
- Ranking: every schedule listed, microbatch counts dividing the batch, the fit flag
  agreeing with the limit, the fastest fitting plan first.
- Measured times: W cheap or expensive flips Std1F1B against ZeroBubble as the
  schedules' own dataflow simulator (`analyze_schedule`) says.
- A plan runs: its restaged step on its microbatches equals `jax.jit` of the step.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from models import make_step, mlp, schedule, transformer

import jaxpp_mpi as jp
from jaxpp_mpi._src.planner.plan import plan
from jaxpp_mpi._src.planner.runtime_cost import RuntimeCost, runtime_counts
from jaxpp_mpi.schedules import SCHEDULE_NAMES, TaskType, analyze_schedule

MODELS = {"mlp": mlp, "transformer": transformer}


def _mesh(groups: int = 2) -> jp.MpmdMesh:
    return jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")


def _step(model: str, sched_name: str, num_stages: int, n: int, **kw):
    params, batch, loss_fn = MODELS[model](num_stages, n, **kw)
    step, optimizer = make_step(loss_fn, schedule(sched_name, 2))
    return step, (optimizer.init(params), params, batch)


@pytest.mark.parametrize("model", ["transformer", "mlp"])
@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "zerobubble", "interleaved", "dualpipev"])
def test_predicted_peak_bytes_equal_memory_analysis(model, sched):
    num_stages = schedule(sched, 2).num_stages
    step, args = _step(model, sched, num_stages, 4)
    mesh = _mesh()
    found = plan(step, *args, mpmd_mesh=mesh, schedules=[sched], exact_memory=True,
                 balance_stages=False, donate_argnums=(0, 1))
    (p,) = [p for p in found.plans if p.schedule == schedule(sched, 2)]
    assert p.stage_marks == tuple(range(num_stages))
    compiled = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh, donate_argnums=(0, 1)).compile(*args)
    measured = [m["peak_bytes"] for m in compiled.memory_analysis()]
    assert list(p.peak_bytes) == measured
    if model == "transformer":  # loop tasks' scratch estimated from the segments' compiles
        found = plan(step, *args, mpmd_mesh=mesh, schedules=[sched], balance_stages=False,
                     donate_argnums=(0, 1))
        (p,) = [p for p in found.plans if p.schedule == schedule(sched, 2)]
        for estimate, exact in zip(p.peak_bytes, measured):
            assert abs(estimate - exact) <= 0.1 * exact


def test_ranking_lists_every_schedule_and_flags_fit():
    step, args = _step("mlp", "1f1b", 4, 4, rows=4)
    everything = plan(step, *args, mpmd_mesh=_mesh(), batch_argnums=2)
    peaks = sorted(p.peak for p in everything.plans)
    limit = peaks[len(peaks) // 2]
    plans = plan(step, *args, mpmd_mesh=_mesh(), batch_argnums=2,
                 memory_limit=limit).plans
    assert {p.schedule for p in plans} == {p.schedule for p in everything.plans}
    names = {type(schedule(name, 2)).__name__ for name in SCHEDULE_NAMES}
    assert {type(p.schedule).__name__ for p in plans} == names
    rows = 4 * 4
    assert {p.num_microbatches for p in plans} == {2, 4, 8, 16}
    for p in plans:
        assert rows % p.num_microbatches == 0
        assert p.fits == (max(p.peak_bytes) <= limit)
        assert len(p.peak_bytes) == 2 and p.step_ms > 0 and 0 <= p.bubble < 1
        assert p.stage_marks[-1] == 3 and len(p.stage_marks) == p.schedule.num_stages
    keys = [(not p.fits, p.step_ms) for p in plans]
    assert keys == sorted(keys)
    assert plans[0].fits and plans[0].reason and not any(
        p.fits and p.step_ms < plans[0].step_ms for p in plans)


@pytest.mark.parametrize("w", [0.05, 8.0])
def test_measured_weight_gradients_flip_the_ranking_as_simulated(w):
    """Times of one ZeroBubble step: F = I = 1, W = w (+ a dispatch overhead each)."""
    o, n = 0.5, 8
    step, args = _step("mlp", "zerobubble", 2, n)
    times = {}
    for m in range(n):
        times |= {f"F{m}s0": 1 + o, f"F{m}s1": 1 + o, f"I{m}s1": 1 + o, f"W{m}s1": w + o,
                  f"W{m}s0": 1 + w + o}  # the first stage's W computes its I too
    plans = plan(step, *args, mpmd_mesh=_mesh(), task_times_ms=times,
                 runtime_cost=RuntimeCost(run_ms=o, message_ms=0.0, free_ms=0.0),
                 schedules=("1f1b", "zerobubble")).plans
    latencies = {TaskType.FWD: 1 + o, TaskType.BWD: 1 + w + o, TaskType.BWD_I: 1 + o,
                 TaskType.BWD_W: w + o}
    simulated = sorted(("1f1b", "zerobubble"), key=lambda name: analyze_schedule(
        schedule(name, 2), n, latencies).makespan)
    assert [p.schedule for p in plans] == [schedule(name, 2) for name in simulated]
    assert simulated[0] == ("1f1b" if w < 1 else "zerobubble")


def test_a_run_cost_adds_its_runs_to_every_plan():
    """`Note: runtime costs`: a cost per Run adds exactly that cost times each group's
    Runs to the group's time, so a schedule with more Runs per microbatch (DualPipeV,
    two stages a group) gains more than one with fewer (ZeroBubble) on the same work."""
    step, args = _step("mlp", "zerobubble", 4, 4)
    mesh, run_ms = _mesh(), 0.5
    kw = dict(mpmd_mesh=mesh, schedules=("zerobubble", "dualpipev"), balance_stages=False)
    free = {p.schedule: p for p in plan(step, *args, runtime_cost=RuntimeCost(
        run_ms=0.0, message_ms=0.0, free_ms=0.0), **kw).plans}
    priced = {p.schedule: p for p in plan(step, *args, runtime_cost=RuntimeCost(
        run_ms=run_ms, message_ms=0.0, free_ms=0.0), **kw).plans}
    runs = {}
    for sched, p in priced.items():
        program = jp.MpmdFunction(p.apply(step), mesh, None, None).step_plan(*args).program
        runs[sched] = [c["run"] for c in runtime_counts(program)]
        added = [b - a for a, b in zip(free[sched].busy_ms, p.busy_ms)]
        assert added == pytest.approx([run_ms * r for r in runs[sched]])
    zb, dpv = schedule("zerobubble", 2), schedule("dualpipev", 2)
    assert all(a > b for a, b in zip(runs[dpv], runs[zb]))


def test_a_plan_runs_as_jax_jit_of_the_step():
    step, (state, params, batch) = _step("transformer", "1f1b", 4, 2, rows=4)
    plans = plan(step, state, params, batch, mpmd_mesh=_mesh(), batch_argnums=2,
                 num_microbatches=(4,), schedules=("interleaved",)).plans
    p = plans[0]
    assert p.num_microbatches == 4 and p.schedule.num_stages == 4
    mb = p.batch(batch)
    got = jp.mpmd_jit_with_loop(p.apply(step), mpmd_mesh=_mesh())(state, params, mb)
    want = jax.jit(step)(state, params, mb)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


MODEL_FILE = '''
from functools import partial
import jax, jax.numpy as jnp
import jaxpp_mpi

def loss(params, mb):
    x, y = mb
    for w in params:
        x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w))
    return jnp.mean((x - y) ** 2)

def inputs(mesh):
    def step(params, batch):
        losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), params), batch,
                                          schedule=jaxpp_mpi.Std1F1B(mesh.mpmd_dim))
        return grads, losses
    params = [jax.ShapeDtypeStruct((8, 8), jnp.float32)] * 4
    batch = (jax.ShapeDtypeStruct((4, 2, 8), jnp.float32),) * 2
    return {"step": step, "args": (params, batch), "batch_argnums": 1}
'''


def test_command_line_prints_and_writes_the_ranked_plans(tmp_path, capsys):
    import json

    from jaxpp_mpi._src.schedules.cli import main

    model = tmp_path / "model.py"
    model.write_text(MODEL_FILE)
    out = tmp_path / "plans.json"
    assert main(["plan", f"{model}:inputs", "--groups", "2", "--microbatches", "2,4",
                 "--memory-limit", "1MiB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:3] == ["#", "schedule", "stages"]
    assert "why first: " in text and "stage segments" in text
    rows = json.loads(out.read_text())
    assert {r["num_microbatches"] for r in rows} == {2, 4}
    assert all(r["fits"] == (max(r["peak_bytes"]) <= 2**20) for r in rows)
    assert main(["plan", f"{model}:nothing"]) == 2
    assert "has no function 'nothing'" in capsys.readouterr().err
