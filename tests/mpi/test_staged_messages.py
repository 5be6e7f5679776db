"""Staged messages (`Note: staged messages` in mpi/staged.py), forced on CPU as
JAXPP_MPI_STAGED_MESSAGES=1 does: pipelined steps match single-process jax.jit, many
messages per channel pair in order, a donated buffer in flight arrives intact, and the
threads' work shows in traces.

Runs under `launch/jpprun -n 2` and `-n 4` (any size >= 2).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import assert_close_to_reference, make_step, mlp, run_steps, schedule
from models import transformer as transformer_model
from mpi4py import MPI
from rank0_reference import on_rank_0

import jaxpp_mpi
import jaxpp_mpi.trace
from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.ir.program import (
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.simulate import verify
from jaxpp_mpi._src.mpi import chains, staged
from jaxpp_mpi._src.runtime.mpi import MpiExecutor
from jaxpp_mpi._src.timeline.chrome import chrome_trace
from jaxpp_mpi._src.timeline.timing import message_overlap

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
STAGED = dataclasses.replace(config.options(), staged_messages="1")


@pytest.fixture(scope="module", autouse=True)
def staged_everywhere():
    """JAXPP_MPI_STAGED_MESSAGES=1 for every step this module compiles."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "options", lambda: STAGED)
        yield


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


def _pair_comm():
    """Ranks 0 and 1 in a communicator of their own (None on the others)."""
    comm = WORLD.Split(0 if RANK < 2 else 1, RANK)
    return comm if RANK < 2 else None


# The MLP under each kind of schedule; the transformer (more values per message, a
# loss on the last stage) where messages are densest: 1F1B, and Interleaved's two
# stages per rank.
PARITY = [("mlp", s) for s in ("gpipe", "1f1b", "zerobubble", "interleaved")] + [
    ("transformer", s) for s in ("1f1b", "interleaved")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("model, sched_name", PARITY)
def test_staged_pipeline_parity(mesh, model, sched_name):
    """Three training steps with staged messages match jax.jit of the same step (float32
    products in full precision: on a GPU JAX's default, TF32, rounds each fusion apart)."""
    with jax.default_matmul_precision("highest"):
        _staged_parity(mesh, model, sched_name)


def _staged_parity(mesh, model: str, sched_name: str) -> None:
    build = mlp if model == "mlp" else transformer_model
    sched = schedule(sched_name, SIZE)
    params, batch, loss_fn = build(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    opt_state = opt.init(params)
    reference = on_rank_0(lambda: run_steps(jax.jit(step), opt_state, params, batch))
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
        opt_state, params, batch)
    assert compiled._executor._sends is not None  # the staged path, not chains
    pipelined = run_steps(compiled, opt_state, params, batch)
    compared = assert_close_to_reference(reference, pipelined)
    _everywhere(compared > 0, f"rank {RANK} held no output")


def _sharding(mesh, rank):
    gm = mesh.group_mesh(rank)
    return lambda aval: NamedSharding(gm, P(*aval.spec))


def _many_messages_program(n: int, aval: Aval) -> Program:
    """Group 0 sends its n inputs to group 1, which returns each (Send), then the two
    exchange them again (SendRecv): n messages per channel and kind, back to back."""
    g0 = [Send(k, 1, k) for k in range(n)]
    g1 = [Recv(k, 0, k, aval) for k in range(n)]
    for k in range(n):
        g0 += [Recv(n + k, 1, k, aval), SendRecv(k, 1, n + k, 2 * n + k, 1, n + k, aval)]
        g1 += [Send(k, 0, k), SendRecv(k, 0, n + k, 2 * n + k, 0, n + k, aval)]
    g0.append(Free(tuple(range(n))))
    avals0 = {b: aval for b in range(3 * n)}
    avals1 = {b: aval for b in [*range(n), *range(2 * n, 3 * n)]}
    return Program((
        GroupProgram(0, [(k, k) for k in range(n)], g0,
                     [(b, b) for b in range(n, 3 * n)], avals0),
        GroupProgram(1, [], g1, [(k, k) for k in range(n)]
                     + [(2 * n + k, 3 * n + k) for k in range(n)], avals1)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec", [(), ("data",)])
def test_many_messages_per_channel_pair_in_order(mesh, spec):
    """24 different values per channel and kind of message, back to back: more than
    the receiver's window, so its receives are posted ahead in batches; any reordering
    would deliver the wrong values. Two steps: the threads serve each step anew."""
    comm = _pair_comm()
    if comm is None:
        _everywhere(True)
        return
    n, shape = 24, (4 * K, 3)
    aval = Aval(shape, "float32", spec)
    program = _many_messages_program(n, aval)
    verify(program)
    sharding = _sharding(mesh, RANK)
    executor = MpiExecutor(program, RANK, {}, sharding, comm, options=STAGED)
    values = [np.full(shape, k + 1.0, np.float32) for k in range(n)]
    inputs = [jax.device_put(v, sharding(aval)) for v in values] if RANK == 0 else [None] * n
    inputs += [None] * (4 * n - len(inputs))
    for _ in range(2):
        out = executor.run_replicas(inputs[:n])
    got = {k: np.asarray(d[RANK]) for k, d in enumerate(out) if RANK in d}
    want_keys = range(n, 3 * n) if RANK == 0 else [*range(n), *range(3 * n, 4 * n)]
    want = {k: values[k % n] for k in want_keys}
    ok = got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    _everywhere(ok, f"rank {RANK}: {[(k, float(got[k].flat[0])) for k in sorted(got)][:8]}")


def _slow_host_copies(monkeypatch) -> None:
    """The sender thread takes each host copy 0.3 s late: what the dispatching thread
    does meanwhile runs while the message is in flight."""
    host = staged._host

    def slow_host(shard):
        time.sleep(0.3)
        return host(shard)

    monkeypatch.setattr(staged, "_host", slow_host)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donated_buffer_in_flight_arrives_intact(mesh, dtype, monkeypatch):
    """Group 0 sends a value, and the next Run donates (and overwrites) that buffer
    before the sender thread has taken its host copy: the Run waits for the copy, and
    the message carries the value as it was sent."""
    comm = _pair_comm()
    if comm is None:
        _everywhere(True)
        return
    aval = Aval((256, 64), dtype)
    g0 = GroupProgram(0, [(0, 0)], [Run("double", (0,), (1,), donate=(0,)), Send(1, 1, 0),
                                    Run("negate", (1,), (2,), donate=(1,))],
                      [(2, 0)], {0: aval, 1: aval, 2: aval})
    g1 = GroupProgram(1, [], [Recv(0, 0, 0, aval)], [(0, 1)], {0: aval})
    program = Program((g0, g1))
    verify(program)
    _slow_host_copies(monkeypatch)
    exes = {"double": jax.jit(lambda x: (x + x,), donate_argnums=0),
            "negate": jax.jit(lambda x: (-x,), donate_argnums=0)}
    sharding = _sharding(mesh, RANK)
    executor = MpiExecutor(program, RANK, exes, sharding, comm, options=STAGED)
    value = (np.arange(256 * 64).reshape(256, 64) % 251 + 1).astype(jnp.dtype(dtype))
    out = executor.run_replicas([jax.device_put(value, sharding(aval))])
    got = np.asarray(out[RANK][RANK]).astype(np.float32)
    want = (-2 if RANK == 0 else 2) * value.astype(np.float32)
    _everywhere(np.array_equal(got, want), f"rank {RANK}: {got[0, :4]}")


@pytest.mark.mpi(min_size=2)
def test_a_sent_step_output_is_copied_before_the_step_returns(mesh, monkeypatch):
    """Group 0 sends a value it also returns, and the caller donates (overwrites) the
    returned array at once: the step returned only once the message's host copy was
    taken, so the message carries the value as it was sent."""
    comm = _pair_comm()
    if comm is None:
        _everywhere(True)
        return
    aval = Aval((256, 64), "float32")
    g0 = GroupProgram(0, [(0, 0)], [Run("double", (0,), (1,), donate=(0,)), Send(1, 1, 0)],
                      [(1, 0)], {0: aval, 1: aval})
    g1 = GroupProgram(1, [], [Recv(0, 0, 0, aval)], [(0, 1)], {0: aval})
    program = Program((g0, g1))
    verify(program)
    _slow_host_copies(monkeypatch)
    exes = {"double": jax.jit(lambda x: (x + x,), donate_argnums=0)}
    sharding = _sharding(mesh, RANK)
    executor = MpiExecutor(program, RANK, exes, sharding, comm, options=STAGED)
    value = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    out = executor.run_replicas([jax.device_put(value, sharding(aval))])
    got = out[RANK][RANK]
    if RANK == 0:
        got = jax.jit(lambda x: -x, donate_argnums=0)(got)  # the caller's own donation
        chains.quiesce()
    got = np.asarray(got)
    want = (-2 if RANK == 0 else 2) * value
    _everywhere(np.array_equal(got, want), f"rank {RANK}: {got[0, :4]}")


@pytest.mark.mpi(min_size=2)
def test_staged_trace_shows_each_message_stage(mesh):
    """A recorded 1F1B step has, per message of this rank, its copy to host and MPI
    send on the sender thread's track and its MPI receive and copy to device on the
    receiver's; the trace's summary gives the message time and its hidden share."""
    sched = schedule("1f1b", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    args = (opt.init(params), params, batch)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*args)
    jax.block_until_ready(compiled(*args))  # warm-up
    with jaxpp_mpi.trace.record() as events:
        jax.block_until_ready(compiled(*args))
    instrs = compiled.program().group(RANK).instrs
    sends = sum(isinstance(i, (Send, SendRecv)) for i in instrs)
    recvs = sum(isinstance(i, (Recv, SendRecv)) for i in instrs)
    by = {}
    for e in events:
        by.setdefault((e.track, e.name), []).append(e)
    counts = {key: len(v) for key, v in by.items() if key[0]}
    want = {("sender", "copy to host"): sends, ("sender", "MPI send"): sends,
            ("receiver", "MPI recv"): recvs, ("receiver", "copy to device"): recvs}
    want = {k: v for k, v in want.items() if v}
    ok = counts == want and all(e.end_ns >= e.start_ns and e.group == RANK for e in events)
    summary = message_overlap(events)[RANK]
    ok = ok and summary["message_ms"] > 0 and 0 <= summary["hidden_share"] <= 1
    trace = chrome_trace([events])
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
              if e["name"] == "thread_name"}
    ok = ok and {f"group {RANK} sender thread", f"group {RANK} receiver thread"} >= (
        set(tracks.values()) - {f"group {RANK}"})
    ok = ok and trace["otherData"]["message_overlap"][0]["group"] == RANK
    _everywhere(ok, f"rank {RANK}: {counts} vs {want}; {summary}; {tracks}")


def test_threads_need_mpi_thread_multiple(monkeypatch):
    """With less than MPI_THREAD_MULTIPLE the option is refused, with one warning."""
    device = jax.devices()[0]
    assert staged.stages_messages(device, STAGED)
    assert not staged.stages_messages(device, dataclasses.replace(STAGED,
                                                                  staged_messages="0"))
    monkeypatch.setattr(staged.MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    monkeypatch.setattr(staged, "_warned", False)
    with pytest.warns(RuntimeWarning, match="MPI_THREAD_MULTIPLE.*MPI_THREAD_SERIALIZED"):
        assert not staged.stages_messages(device, STAGED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not staged.stages_messages(device, STAGED)  # warned once only
