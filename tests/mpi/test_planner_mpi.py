"""`plan_schedules` under mpirun: ranks that time the step at different speeds rank the
plans alike (`agreed_rate` in planner/plan.py), so each applies the same plan and builds
the same program. Each rank's timing is replaced by a rank-dependent rate (rank r: r + 1
times rank 0's), as ranks on a loaded machine measure. Ranks given different task times
stop, every one, naming the ranks that differ."""

from __future__ import annotations

import jax
import pytest
from models import make_step, mlp, schedule
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh
from jaxpp_mpi._src.planner import plan as plan_module

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
RATE = 2e-7  # ms per FLOP


@pytest.mark.mpi(min_size=2)
def test_ranks_timing_differently_rank_the_plans_alike(monkeypatch):
    monkeypatch.setattr(plan_module, "measured_ms_per_flop",
                        lambda *args, **kw: RATE * (RANK + 1))
    priced_at = []
    from_flops = plan_module.from_flops

    def recording(flops, temp, rows, rate, overhead):
        priced_at.append(rate)
        return from_flops(flops, temp, rows, rate, overhead)

    monkeypatch.setattr(plan_module, "from_flops", recording)
    mesh = make_mpmd_mesh((SIZE, jax.local_device_count()), ("stage", "data"), "stage")
    params, batch, loss_fn = mlp(SIZE, 4)
    step, optimizer = make_step(loss_fn, schedule("1f1b", SIZE))
    plans = jaxpp_mpi.plan_schedules(step, optimizer.init(params), params, batch,
                                     mpmd_mesh=mesh, schedules=["1f1b", "gpipe"],
                                     balance_stages=False)
    assert priced_at == [RATE]  # the fastest rank's, on every rank
    table = jaxpp_mpi.format_plans(plans)
    assert WORLD.allgather(table) == [table] * SIZE


@pytest.mark.mpi(min_size=2)
def test_ranks_given_different_task_times_stop_naming_them():
    mesh = make_mpmd_mesh((SIZE, jax.local_device_count()), ("stage", "data"), "stage")
    params, batch, loss_fn = mlp(SIZE, 4)
    step, optimizer = make_step(loss_fn, schedule("1f1b", SIZE))
    own = {"F0_mb0": 1.0, "B0_mb0": 2.0 + RANK}  # each rank's own, not merged
    with pytest.raises(ValueError) as caught:
        jaxpp_mpi.plan_schedules(step, optimizer.init(params), params, batch, mpmd_mesh=mesh,
                                 task_times_ms=own)
    expected = f"task_times_ms on rank(s) {list(range(1, SIZE))} differ from rank 0's"
    assert expected in str(caught.value)
    assert WORLD.allgather(True) == [True] * SIZE  # raised on every rank, none left waiting
