"""Trace export across ranks: rank 0 writes one Chrome trace holding every rank's step.

Runs under `launch/jpprun -n 2` and `-n 4` (any size >= 2).
"""

from __future__ import annotations

import jax
import pytest
from models import make_step, mlp, schedule
from mpi4py import MPI
from trace_schema import check_chrome_trace, program_tasks, task_counts

import jaxpp_mpi
import jaxpp_mpi.trace
from jaxpp_mpi._src.mpi import collectives

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((SIZE, jax.local_device_count()), ("stage", "data"),
                                    "stage")


@pytest.mark.mpi(min_size=2)
def test_trace_export_has_every_task_of_every_rank_once(mesh, tmp_path):
    sched = schedule("1f1b", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    args = (opt.init(params), params, batch)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*args)
    jax.block_until_ready(compiled(*args))  # warm-up
    with jaxpp_mpi.trace.record() as events:
        jax.block_until_ready(compiled(*args))
    assert events and {e.group for e in events} == {RANK}
    path = WORLD.bcast(str(tmp_path / "trace.json"), root=0)  # rank 0's directory
    trace = jaxpp_mpi.trace.export(path, events, mesh, other_data={"test": "mpi"})
    if RANK != 0:
        assert trace is None
    else:
        assert jaxpp_mpi.trace.load(path) == trace
        tracks = check_chrome_trace(trace)
        assert tracks == {(r, r): f"group {r}" for r in range(SIZE)}  # one per rank
        want = program_tasks(compiled.program(), range(SIZE), lambda g: g)
        assert task_counts(trace) == want and max(want.values()) == 1
        for r in range(SIZE):
            sends = [e for e in trace["traceEvents"] if e.get("cat") == "message"
                     and e["pid"] == r and e["name"] in ("send", "sendrecv")]
            assert sends and all(e["dur"] > 0 for e in sends), r
        assert trace["otherData"]["clock_offsets_ns"] == [0] * SIZE  # one host, one clock
        assert trace["otherData"]["test"] == "mpi"
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_trace_write_failure_raises_on_every_rank(mesh):
    bad = "/proc/jaxpp_mpi_no_such_dir/trace.json"
    with pytest.raises(OSError, match="rank 0 could not write the trace"):
        jaxpp_mpi.trace.export(bad, [], mesh)


@pytest.mark.mpi(min_size=2)
def test_clock_offsets_by_ping_pong():
    """Forced ping-pong on one host measures an offset near the true 0."""
    offsets = collectives.clock_offsets_ns(WORLD, root=0, always=True)
    if RANK == 0:
        assert len(offsets) == SIZE and offsets[0] == 0
        assert all(abs(o) < 100_000_000 for o in offsets), offsets  # < 0.1 s, loaded CI
    else:
        assert offsets is None
    data = collectives.gather_bytes(b"x" * RANK, WORLD, root=SIZE - 1)
    assert data == ([b"x" * r for r in range(SIZE)] if RANK == SIZE - 1 else None)
    assert collectives.bcast_bytes(b"hello" if RANK == 1 else None, WORLD, root=1) == b"hello"
