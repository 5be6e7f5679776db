"""Layouts through the pipeline across ranks (`Note: layouts`): one group per rank, its K
devices (XLA_FLAGS=--xla_force_host_platform_device_count=K before launch) on a "data" or
a "model" axis; the batch rows split over "data", weights Megatron-split over "model".

References, on every rank: the step under plain `jax.jit` on one device (values), and
under `jax.jit` on this rank's K devices with the same layouts (per-device FLOPs from
XLA's cost analysis, one microbatch so that the reference has no loop).
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    all_reduced,
    assert_close_to_reference,
    make_step,
    megatron_specs,
    mlp,
    run_steps,
)
from models import schedule as named_schedule
from mpi4py import MPI
from rank0_reference import on_rank_0

import jaxpp_mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
AXES = {"data": (K, 1), "model": (1, K)}


@functools.cache
def mpmd_mesh(axis: str) -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.make_mpmd_mesh((SIZE, *AXES[axis]), ("stage", "data", "model"),
                                    "stage", axis_types=(AxisType.Auto,) * 3)


def problem(sched_name: str, num_microbatches: int):
    sched = named_schedule(sched_name, SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, num_microbatches, width=8 * K, rows=2 * K)
    params = jax.tree.map(lambda x: jax.numpy.asarray(np.asarray(x)), params)
    step, optimizer = make_step(loss_fn, sched)
    return step, optimizer, params, batch, megatron_specs("mlp", params, batch)


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("axis", sorted(AXES))
@pytest.mark.parametrize("sched_name", ["1f1b", "zerobubble"])
def test_sharded_groups_match_jax_jit(sched_name, axis):
    step, optimizer, params, batch, (pspecs, bspecs) = problem(sched_name, 2 * SIZE)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), optimizer.init(params), params, batch))
    f = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(axis),
                                     in_shardings=(None, pspecs, bspecs),
                                     donate_argnums=(0, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_steps(f, optimizer.init(params), params, batch)
    compared = assert_close_to_reference(reference, got)
    donation = [str(w.message) for w in caught if "donat" in str(w.message)]
    _everywhere(compared > 0 and not donation and len(f._cache) == 1,
                f"rank {RANK}: {compared} compared, {donation}, {len(f._cache)} compiles")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("axis", sorted(AXES))
def test_sharded_groups_per_device_flops_match_jax_jit(axis):
    step, optimizer, params, batch, (pspecs, bspecs) = problem("gpipe", 1)
    state = optimizer.init(params)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(
        step, mpmd_mesh=mpmd_mesh(axis), in_shardings=(None, pspecs, bspecs)
    ).compile(state, params, batch)
    mine = compiled.cost_analysis()[RANK]["flops"]
    total = sum(WORLD.allgather(mine))
    data, model = AXES[axis]
    group = Mesh(np.array(jax.local_devices()).reshape(data, model), ("data", "model"),
                 axis_types=(AxisType.Auto,) * 2)
    named = lambda t: jax.tree.map(lambda s: NamedSharding(group, s), t,
                                   is_leaf=lambda x: isinstance(x, P))
    reference = jax.jit(step, in_shardings=(named(jax.tree.map(lambda _: P(), state)),
                                            named(pspecs), named(bspecs)))
    cost = reference.lower(state, params, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    _everywhere(abs(total / cost["flops"] - 1) <= 0.10,
                f"rank {RANK}: pipelined {total}, jax.jit {cost['flops']}")
    # Every rank reached the same program, layouts included.
    _everywhere(len(set(WORLD.allgather(compiled.program().hash()))) == 1)


@pytest.mark.mpi(min_size=2)
def test_sharded_groups_reduce_data_parallel_gradients_once_per_step():
    """`Note: deferred reduction` under MPI: on each rank's data=K group, of the
    backward executables only the last microbatch's all-reduces the gradients (their
    sums are carried unreduced until then). The last rank runs its F and B as one
    (`Note: back-to-back tasks`), whose every variant also all-reduces the loss."""
    step, optimizer, params, batch, (pspecs, bspecs) = problem("1f1b", 2 * SIZE)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(
        step, mpmd_mesh=mpmd_mesh("data"), in_shardings=(None, pspecs, bspecs)
    ).compile(optimizer.init(params), params, batch)
    family = f"FB{RANK}" if RANK == SIZE - 1 else f"B{RANK}"
    count = {v: all_reduced(compiled.as_text(RANK, family + v)) for v in ("", "_first", "_last")}
    forward = 0 if family[0] == "B" else count[""]
    _everywhere(count[""] == count["_first"] == forward < count["_last"],
                f"rank {RANK}: {family} all-reduces {count} elements")
