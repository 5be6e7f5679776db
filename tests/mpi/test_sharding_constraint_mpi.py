"""`with_sharding_constraint` inside a pipelined step across ranks, Auto and Explicit axes.

Runs under `launch/jpprun -n 2` and `-n 4`; with K devices per rank
(XLA_FLAGS=--xla_force_host_platform_device_count=K before launch) each group mesh has
K devices on a "data" axis, and the constraint splits every stage's activation over
them. The reference, on every rank, is the same step under plain `jax.jit` on this
rank's devices, the constraint on them.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from models import (
    assert_close_to_reference,
    constrained_mlp_loss,
    data_constraint,
    make_step,
    mlp,
    run_steps,
    schedule,
)
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.base.errors import CompileError

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
ROWS, WIDTH = 2 * K, 16  # per microbatch: "data" splits the rows K ways


@pytest.fixture(scope="module")
def meshes():
    """The MPMD mesh with Auto axes and with Explicit axes (jax.make_mesh's default)."""
    axes = ("stage", "data")
    return {kind: jaxpp_mpi.make_mpmd_mesh((SIZE, K), axes, "stage", axis_types=(t, t))
            for kind, t in (("auto", AxisType.Auto), ("explicit", AxisType.Explicit))}


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


def _dot_rows(hlo: str) -> set[int]:
    """The leading dimension of every f32[rows, WIDTH] dot in an optimized HLO text."""
    return {int(m) for m in re.findall(rf"= f32\[(\d+),{WIDTH}\]\S* dot\(", hlo)}


@pytest.mark.mpi(min_size=2)
# "user_mesh": compiled and called under `jax.set_mesh(mesh)`, as a bare PartitionSpec
# under plain jax.jit needs; without it, the step is traced under the MPMD mesh anyway.
@pytest.mark.parametrize(("axis_types", "kind", "context"), [
    ("auto", "named", None), ("auto", "bare", None), ("explicit", "bare", None),
    ("auto", "named", "user_mesh"), ("explicit", "bare", "user_mesh"),
])
def test_sharding_constraint_is_honoured(meshes, axis_types, kind, context):
    mpmd_mesh = meshes[axis_types]
    mesh = mpmd_mesh.jax_mesh  # this rank's group mesh, with the MPMD axis of size 1
    sched = schedule("1f1b", SIZE)
    params, batch, _ = mlp(sched.num_stages, 2 * SIZE, width=WIDTH, rows=ROWS)
    step, optimizer = make_step(constrained_mlp_loss(data_constraint(kind, mesh)), sched)
    opt_state = optimizer.init(params)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh)
    if context == "user_mesh":
        with jax.set_mesh(mesh):
            compiled = pipelined.compile(opt_state, params, batch)
            outs = run_steps(compiled, opt_state, params, batch)
    else:
        compiled = pipelined.compile(opt_state, params, batch)
        outs = run_steps(compiled, opt_state, params, batch)
    devices = Mesh(np.array(jax.local_devices()), ("data",), axis_types=(AxisType.Auto,))
    ref_step, _ = make_step(constrained_mlp_loss(data_constraint("named", devices)), sched)
    reference = run_steps(jax.jit(ref_step), opt_state, params, batch)
    compared = assert_close_to_reference(reference, outs)
    # This rank's forward stage computes its matmul on ROWS / K rows per device. The
    # last rank runs its F and B as one executable (`Note: back-to-back tasks`), which
    # also holds the weight gradient's f32[WIDTH, WIDTH] dot.
    last = RANK == SIZE - 1
    rows = _dot_rows(compiled.as_text(RANK, f"FB{RANK}" if last else f"F{RANK}"))
    rows -= {WIDTH} if last else set()
    _everywhere(compared > 0 and rows == {ROWS // K},
                f"rank {RANK}: compared {compared} leaves, dot rows {rows}")


@pytest.mark.mpi(min_size=2)
def test_explicit_named_sharding_raises_on_every_rank(meshes):
    mpmd_mesh = meshes["explicit"]
    sched = schedule("1f1b", SIZE)
    params, batch, _ = mlp(sched.num_stages, 2 * SIZE, width=WIDTH, rows=ROWS)
    step, optimizer = make_step(
        constrained_mlp_loss(data_constraint("named", mpmd_mesh.jax_mesh)), sched)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh)
    with pytest.raises(CompileError, match=r"Explicit mesh axis.*bare PartitionSpec"):
        pipelined.compile(optimizer.init(params), params, batch)
    _everywhere(True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec", ["data", "stage", "both"])
def test_uneven_and_mpmd_axis_constraints_match_jit(meshes, spec):
    """Constraints jax.jit accepts although they cannot split evenly (3 rows over the
    MPMD axis of SIZE ranks; over "data" with K = 2 devices per rank) or name the MPMD
    axis: every rank's results equal jax.jit's (`Note: sharding constraints`). The
    reference runs on this rank's devices, under a mesh with both axis names."""
    from jax.sharding import PartitionSpec as P

    entry = {"data": "data", "stage": "stage", "both": ("stage", "data")}[spec]
    sched = schedule("1f1b", SIZE)
    params, batch, _ = mlp(sched.num_stages, 2 * SIZE, width=5, rows=3)
    constrain = lambda x: jax.lax.with_sharding_constraint(x, P(entry))
    step, optimizer = make_step(constrained_mlp_loss(constrain), sched)
    opt_state = optimizer.init(params)
    local = jax.make_mesh((1, K), ("stage", "data"), axis_types=(AxisType.Auto,) * 2,
                          devices=jax.local_devices())
    with jax.set_mesh(local):
        reference = run_steps(jax.jit(step), opt_state, params, batch)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=meshes["auto"])
    compared = assert_close_to_reference(reference, run_steps(pipelined, opt_state, params,
                                                              batch))
    _everywhere(compared > 0, f"rank {RANK}: compared {compared} leaves")
