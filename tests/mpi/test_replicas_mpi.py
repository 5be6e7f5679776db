"""Pipeline replicas: R copies of a P-group pipeline on R x P ranks match jax.jit on the
global batch (Note: replicas in compiler/replicas.py).

Runs under `launch/jpprun -n 4` (2 replicas x 2 groups, and 1 replica x 4 groups with the
same script); with 2 devices per rank each group mesh has a 'data' axis as well.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from models import (
    SCHEDULES,
    assert_close_to_reference,
    make_step,
    megatron_specs,
    mlp,
    run_steps,
    schedule,
)
from mpi4py import MPI
from rank0_reference import on_rank_0

import jaxpp_mpi
from jaxpp_mpi._src.ir.program import AllReduce

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


def _mesh(replicas: int):
    return jaxpp_mpi.make_mpmd_mesh((replicas, SIZE // replicas, K),
                                    ("replica", "stage", "data"), "stage",
                                    replica_axis_name="replica")


@pytest.fixture(scope="module")
def meshes():
    # Building a mesh is collective: every rank builds them, in the same order.
    return {1: _mesh(1), 2: _mesh(2), "model": jaxpp_mpi.make_mpmd_mesh(
        (2, SIZE // 2, 1, K), ("replica", "stage", "data", "model"), "stage",
        replica_axis_name="replica", axis_types=(AxisType.Auto,) * 4)}


def _problem(mesh, sched_name: str, num_microbatches: int, **mlp_args):
    """The MLP training step of `tests/models.py` for `mesh`: (step, optimizer, params,
    batch)."""
    sched = schedule(sched_name, mesh.mpmd_dim)
    params, batch, loss_fn = mlp(sched.num_stages, num_microbatches, **mlp_args)
    step, opt = make_step(loss_fn, sched)
    return step, opt, params, batch


def _share(batch, replica: int, size: int):
    """A replica's consecutive block of `size` microbatches of every batch leaf."""
    return jax.tree.map(lambda x: x[replica * size:(replica + 1) * size], batch)


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sched_name", SCHEDULES)
def test_two_replicas_match_jit_every_schedule(meshes, sched_name):
    mesh = meshes[2]
    step, opt, params, batch = _problem(mesh, sched_name, 8)
    opt_state = opt.init(params)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt_state, params, batch))
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    pipelined = run_steps(fn, opt_state, params, batch)
    compared = assert_close_to_reference(reference, pipelined)
    program = fn.compile(opt_state, params, batch).program(mesh.my_mpmd_axis_index)
    reductions = [i for i in program.instrs if isinstance(i, AllReduce)]
    _everywhere(compared > 0 and bool(reductions),
                f"rank {RANK}: {compared} outputs, {len(reductions)} all-reduces")


@pytest.mark.mpi(min_size=4)
def test_one_replica_same_script(meshes):
    mesh = meshes[1]
    step, opt, params, batch = _problem(mesh, "1f1b", mesh.mpmd_dim)
    opt_state = opt.init(params)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt_state, params, batch))
    pipelined = run_steps(jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh),
                          opt_state, params, batch)
    _everywhere(assert_close_to_reference(reference, pipelined) > 0)


@pytest.mark.mpi(min_size=4)
def test_replica_mesh_layout(meshes):
    mesh = meshes[2]
    p = SIZE // 2
    assert (mesh.replica_idx, mesh.my_mpmd_axis_index) == divmod(RANK, p)
    assert mesh.comm.Get_size() == p and mesh.replica_comm.Get_size() == 2
    assert mesh.job_comm.Get_size() == SIZE
    assert meshes[1].replica_comm is None and meshes[1].job_comm is meshes[1].comm


@pytest.mark.mpi(min_size=4)
def test_microbatches_not_divisible_by_replicas_rejected_on_every_rank(meshes):
    mesh = meshes[2]
    step, opt, params, batch = _problem(mesh, "1f1b", 3)
    with pytest.raises(jaxpp_mpi.CompileError, match="multiple of 2 microbatches"):
        jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)(opt.init(params), params, batch)
    np.testing.assert_equal(WORLD.allgather(1), [1] * SIZE)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sched_name", ["1f1b", "zerobubble"])
def test_sharded_replicas_match_jit(meshes, sched_name):
    """Weights split Megatron-style over the group's "model" axis (K devices per rank):
    the replicas' AllReduce moves each value shard by shard."""
    mesh = meshes["model"]
    step, opt, params, batch = _problem(mesh, sched_name, 4, width=8 * K, rows=2 * K)
    params = jax.tree.map(lambda x: jax.numpy.asarray(np.asarray(x)), params)
    pspecs, bspecs = megatron_specs("mlp", params, batch)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt.init(params), params, batch))
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, in_shardings=(None, pspecs, bspecs),
                                      donate_argnums=(0, 1))
    got = run_steps(fn, opt.init(params), params, batch)
    compared = assert_close_to_reference(reference, got)
    _everywhere(compared > 0 and len(fn._cache) == 1, f"rank {RANK}: {compared} compared")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("replicas", [2, 1])
def test_each_rank_passes_its_share_of_the_batch(meshes, replicas):
    """in_shardings P("replica") on the batch: each rank passes only its replica's
    microbatches (Note: replica shares) and the step still equals jax.jit on the global
    batch; the same script runs with 1 replica (the share is the whole batch)."""
    from jax.sharding import PartitionSpec as P

    mesh = meshes[replicas]
    n = 4
    step, opt, params, batch = _problem(mesh, "1f1b", n)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt.init(params), params, batch))
    mine = _share(batch, mesh.replica_idx, n // replicas)
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh,
                                      in_shardings=(None, None, P("replica")))
    got = run_steps(fn, opt.init(params), params, mine)
    _everywhere(assert_close_to_reference(reference, got) > 0)


@pytest.mark.mpi(min_size=4)
def test_share_read_outside_the_loop_is_refused_on_every_rank(meshes):
    from jax.sharding import PartitionSpec as P

    mesh = meshes[2]
    step, opt, params, batch = _problem(mesh, "1f1b", 4)

    def with_batch_mean(opt_state, params, batch):
        out = step(opt_state, params, batch)
        return (*out, jax.numpy.mean(batch[0]))

    fn = jaxpp_mpi.mpmd_jit_with_loop(with_batch_mean, mpmd_mesh=mesh,
                                      in_shardings=(None, None, P("replica")))
    mine = _share(batch, mesh.replica_idx, 2)
    with pytest.raises(jaxpp_mpi.CompileError, match="split over the pipeline replicas"):
        fn(opt.init(params), params, mine)
    np.testing.assert_equal(WORLD.allgather(1), [1] * SIZE)


@pytest.mark.mpi(min_size=4)
def test_share_split_on_another_dimension_is_refused_on_every_rank(meshes):
    """The batch's rows split over the replicas (dimension 1) while treduce takes the
    microbatches along dimension 0: every rank raises, naming the argument's path, the
    replica axis, the shapes and the spec to give instead, before any message."""
    from jax.sharding import PartitionSpec as P

    mesh = meshes[2]
    step, opt, params, batch = _problem(mesh, "1f1b", 4)
    rows = batch[0].shape[1] // 2
    r = mesh.replica_idx
    mine = jax.tree.map(lambda x: x[:, r * rows:(r + 1) * rows], batch)
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh,
                                      in_shardings=(None, None, P(None, "replica")))
    with pytest.raises(jaxpp_mpi.CompileError) as info:
        fn(opt.init(params), params, mine)
    text = str(info.value)
    wanted = ["argument args[2][", "dimension 1", "'replica'", "P('replica')",
              str(tuple(batch[0].shape)), str((4, rows, batch[0].shape[2]))]
    missing = [w for w in wanted if w not in text]
    _everywhere(not missing, f"rank {RANK}: {missing} not in {text}")


@pytest.mark.mpi(min_size=4)
def test_a_signal_to_one_replica_stops_every_replica(meshes):
    """Preemption decides over the whole job: a SIGUSR1 caught by the last rank alone
    (a rank of replica 1) makes should_stop() true on every rank of both replicas."""
    import os
    import signal

    with jaxpp_mpi.PreemptionGuard(meshes[2]) as guard:
        first = guard.should_stop()
        if RANK == SIZE - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        WORLD.Barrier()
        second = guard.should_stop()
    assert WORLD.allgather((first, second)) == [(False, True)] * SIZE


@pytest.mark.mpi(min_size=4)
def test_closed_jaxpr_of_a_share_is_the_global_step(meshes):
    from jax.sharding import PartitionSpec as P

    mesh = meshes[2]
    step, opt, params, batch = _problem(mesh, "1f1b", 4)
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh,
                                      in_shardings=(None, None, P("replica")))
    compiled = fn.compile(opt.init(params), params, _share(batch, mesh.replica_idx, 2))
    want = jax.make_jaxpr(step)(opt.init(params), params, batch).in_avals
    assert [a.shape for a in compiled.closed_jaxpr.in_avals] == [a.shape for a in want]
