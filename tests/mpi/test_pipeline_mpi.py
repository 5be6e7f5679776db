"""Pipelined training across ranks (one group per rank) matches single-process jax.jit.

Runs under `launch/jpprun -n 2` and `-n 4`; with K devices per rank
(XLA_FLAGS=--xla_force_host_platform_device_count=K before launch) each group mesh has
K devices on a 'data' axis.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from models import SCHEDULES, assert_close_to_reference, make_step, mlp, run_steps, schedule
from models import transformer as transformer_model
from mpi4py import MPI
from rank0_reference import on_rank_0

import jaxpp_mpi
from jaxpp_mpi._src.ir.program import Aval, GroupProgram, Program, Recv, Run, Send
from jaxpp_mpi._src.runtime.mpi import MpiExecutor

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


def _parity(mesh, build, sched_name: str, microbatches: int) -> None:
    sched = schedule(sched_name, SIZE)
    params, batch, loss_fn = build(sched.num_stages, microbatches)
    step, opt = make_step(loss_fn, sched)
    opt_state = opt.init(params)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt_state, params, batch))
    pipelined = run_steps(jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh),
                          opt_state, params, batch)
    compared = assert_close_to_reference(reference, pipelined)
    _everywhere(compared > 0, f"rank {RANK} held no output")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sched_name", SCHEDULES)
def test_mlp_parity_every_schedule(mesh, sched_name):
    _parity(mesh, mlp, sched_name, 2 * SIZE)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sched_name", SCHEDULES)
def test_transformer_parity_every_schedule(mesh, sched_name):
    _parity(mesh, transformer_model, sched_name, 2 * SIZE)


@pytest.mark.mpi(min_size=2)
def test_tied_transformer_parity(mesh):
    _parity(mesh, lambda s, n: transformer_model(s, n, tied=True), "1f1b", 2 * SIZE)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sched_name", ["1f1b", "zerobubble"])
def test_rendezvous_sized_messages_finish(mesh, sched_name):
    """Activations of 8 MiB per message (past every eager limit, so MPI uses its
    rendezvous protocol) in 1F1B and ZeroBubble: the step finishes and matches."""
    sched = schedule(sched_name, SIZE)
    rows, width = 1024, 2048  # 1024 x 2048 float32 = 8 MiB
    ks = jax.random.split(jax.random.PRNGKey(3), sched.num_stages + 1)
    params = [jax.random.uniform(k, (width,), minval=0.5, maxval=1.5) for k in ks[:-1]]
    n = 2 * SIZE
    batch = jax.random.normal(ks[-1], (n, rows, width))

    def loss_fn(params, x):
        for w in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x * w))
        return jnp.mean(x ** 2), jnp.max(x)

    step, opt = make_step(loss_fn, sched)
    opt_state = opt.init(params)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt_state, params, batch, steps=1))
    pipelined = run_steps(jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh),
                          opt_state, params, batch, steps=1)
    assert_close_to_reference(reference, pipelined)


@pytest.mark.mpi(min_size=2)
def test_mismatched_programs_raise_on_every_rank(mesh):
    """Rank 1 uses another schedule (same arguments, another program): every rank raises
    the same clear error. (Arguments that differ between ranks are rejected before
    tracing: tests/mpi/test_bad_input_mpi.py.)"""
    sched = schedule("1f1b" if RANK != 1 else "gpipe", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    _refused_as_different_programs(jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh),
                                   opt.init(params), params, batch)


def _refused_as_different_programs(pipelined, *args) -> None:
    """Compiling `pipelined` raises on every rank, naming rank 1's different program."""
    try:
        pipelined.compile(*args)
    except ValueError as e:
        msg = str(e)
        ok = "ranks compiled different programs" in msg and "rank 1" in msg
    else:
        ok, msg = False, "no error"
    _everywhere(ok, msg)


@pytest.mark.mpi(min_size=2)
def test_mismatched_programs_from_task_times_raise_on_every_rank(mesh):
    """Only rank 1 passes task times that reorder DualPipeV's messages: its program
    differs, and every rank raises the same error before any message is sent."""
    sched = schedule("dualpipev", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 8)
    step, opt = make_step(loss_fn, sched)
    # forwards and input gradients 1, weight gradients 4: a program other than the one
    # the default lowering keeps across its task-time models.
    times = {f"{kind}{m}s{s}": 4.0 if kind == "W" else 1.0
             for kind in "FIW" for m in range(8) for s in range(sched.num_stages)}
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh,
                                             task_times_ms=times if RANK == 1 else None)
    _refused_as_different_programs(pipelined, opt.init(params), params, batch)


def _sharded_exchange_program(shape, spec) -> Program:
    """Group 0 sends its input to group 1, which returns it: one value, one message."""
    aval = Aval(shape, "float32", spec)
    g0 = GroupProgram(0, [(0, 0)], [Send(0, 1, 0)], [], {0: aval})
    g1 = GroupProgram(1, [], [Recv(0, 0, 0, aval)], [(0, 0)], {0: aval})
    return Program((g0, g1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec", [(), ("data",), (None, "data")])
def test_values_move_shard_by_shard(mesh, spec):
    """A value laid out over the group's devices arrives with the same layout and
    bytes; with K devices and a sharded spec it travels as K shard messages."""
    comm = WORLD.Split(0 if RANK < 2 else 1, RANK)
    if RANK > 1:
        _everywhere(True)
        return
    shape = (4 * K, 2 * K)
    program = _sharded_exchange_program(shape, spec)
    gm = mesh.group_mesh(RANK)
    sharding = lambda aval: jax.sharding.NamedSharding(gm, P(*aval.spec))
    executor = MpiExecutor(program, RANK, {}, sharding, comm)
    value = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    out = executor.run_replicas([jax.device_put(value, sharding(Aval(shape, "float32", spec)))])
    if RANK == 1:
        got = out[0][1]
        np.testing.assert_array_equal(np.asarray(got), value)
        assert got.sharding.is_equivalent_to(sharding(Aval(shape, "float32", spec)), 2)
    _everywhere(True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sent_buffer_donated_later_arrives_intact(mesh, dtype):
    """Group 0 sends its input, then a task that may overwrite that buffer (donated)
    runs while the receiver is still busy: the message carries the value as it was
    sent (`Note: posted sends`: JAX does not donate a buffer a message is read from)."""
    comm = WORLD.Split(0 if RANK < 2 else 1, RANK)
    if RANK > 1:
        _everywhere(True)
        return
    aval = Aval((256, 64), dtype)
    g0 = GroupProgram(0, [(0, 0)], [Send(0, 1, 0), Run("negate", (0,), (1,), donate=(0,))],
                      [(1, 0)], {0: aval, 1: aval})
    g1 = GroupProgram(1, [], [Recv(0, 0, 0, aval)], [(0, 1)], {0: aval})
    gm = mesh.group_mesh(RANK)
    sharding = lambda a: jax.sharding.NamedSharding(gm, P(*a.spec))  # noqa: E731
    negate = jax.jit(lambda x: (-x,), donate_argnums=0)
    executor = MpiExecutor(Program((g0, g1)), RANK, {"negate": negate}, sharding, comm)
    value = (np.arange(256 * 64).reshape(256, 64) % 251 + 1).astype(jnp.dtype(dtype))
    if RANK == 1:
        time.sleep(0.3)  # the sender's task runs before this receive is posted
    out = executor.run_replicas([jax.device_put(value, sharding(aval))])
    got = np.asarray(out[RANK][RANK])
    _everywhere(np.array_equal(got, -value if RANK == 0 else value), f"rank {RANK}: {got[0, :4]}")


@pytest.mark.mpi(min_size=2)
def test_task_times_are_collected_per_rank(mesh):
    """collect_task_times_ms on each rank times exactly this rank's stage tasks."""
    sched = schedule("1f1b", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    opt_state = opt.init(params)
    pipelined(opt_state, params, batch)  # compile and warm up outside the block
    with jaxpp_mpi.collect_task_times_ms() as times:
        pipelined(opt_state, params, batch)
    stage_tasks = {label for label in times if label[0] in "FB"}
    want = {f"{k}{m}s{RANK}" for k in "FB" for m in range(2 * SIZE)}
    if RANK == SIZE - 1:  # the last stage runs F and B as one (`Note: back-to-back tasks`)
        want = {f"F{m}s{RANK}+B{m}s{RANK}" for m in range(2 * SIZE)}
    ok = stage_tasks == want and all(t > 0 for ts in times.values() for t in ts)
    _everywhere(ok, f"rank {RANK}: {sorted(times)}")
