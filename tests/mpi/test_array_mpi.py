"""A step's MpmdArray results under mpirun: read where held (no message), on every rank
through `jaxpp_mpi.process_allgather`, formatted where held and shown as their repr
elsewhere.

Runs under `launch/jpprun -n 2` and `-n 4`, one group per rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.sharding import MpmdSharding

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
MICROBATCHES = 2 * SIZE
RTOL, ATOL = 1e-5, 1e-6


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), results


def _step(loss_fn):
    """A training step returning a scalar loss, an int index and per-microbatch losses."""

    def step(params, batch):
        grad_fn = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jaxpp_mpi.treduce(
            grad_fn, batch, schedule=models.schedule("1f1b", SIZE))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return jnp.mean(losses), jnp.argmax(losses).astype(jnp.int32), losses, new

    return step


@pytest.fixture(scope="module")
def runs():
    mesh = jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")
    params, batch, loss_fn = models.mlp(SIZE, MICROBATCHES)
    step = _step(loss_fn)
    reference = jax.jit(step)(params, batch)
    got = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)(params, batch)
    return mesh, reference, got


def _read(x: MpmdArray, ref: jax.Array) -> list[str]:
    """`x` read where held (implicitly) and everywhere (explicitly, on every rank at once,
    Note: reading values): the values equal jax.jit's; format gives the value where held
    and the repr elsewhere, with no message."""
    problems = []
    whole = jaxpp_mpi.process_allgather(x)
    if not np.allclose(whole, np.asarray(ref), rtol=RTOL, atol=ATOL):
        problems.append(f"process_allgather {whole} != {np.asarray(ref)}")
    if x.is_partially_addressable:
        if x.ndim == 0:
            if not np.isclose(float(x), float(ref), rtol=RTOL, atol=ATOL):
                problems.append(f"float {float(x)} != {float(ref)}")
            if bool(x) != bool(ref) or int(x) != int(ref):
                problems.append("bool/int differ")
            if f"{x:.3f}" != f"{x.to_mpmd_local_array:.3f}":
                problems.append(f"format {x:.3f}")
        else:
            rows = [float(r) for r in x]
            if not np.allclose(rows, np.asarray(ref), rtol=RTOL, atol=ATOL):
                problems.append(f"rows {rows} != {np.asarray(ref)}")
    elif f"{x:.3f}" != repr(x) or x.to_mpmd_local_array is not None:
        problems.append(f"format on a non-holder gave {x:.3f}")
    return problems


@pytest.mark.mpi(min_size=2)
def test_results_read_on_every_rank(runs):
    mesh, (ref_loss, ref_idx, ref_losses, _), (loss, idx, losses, _) = runs
    problems = []
    for x, ref in ((loss, ref_loss), (idx, ref_idx), (losses, ref_losses)):
        problems += _read(x, ref)
        if len(x.shape) and len(x) != len(ref):  # metadata: known on every rank
            problems.append(f"len {len(x)} != {len(ref)}")
    holders = WORLD.allgather(loss.is_partially_addressable)
    _everywhere(not problems and any(holders) and not all(holders),
                f"rank {RANK}: {problems}, holders {holders}")


@pytest.mark.mpi(min_size=2)
def test_read_on_every_rank_after_reshard(runs):
    """What the error says to do: mpmd_to_spmd_reshard brings the value to every rank."""
    mesh, (ref_loss, *_), (loss, *_) = runs
    [whole] = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, [loss], [P()])
    _everywhere(f"{whole:.3f}" == f"{ref_loss:.3f}"
                and np.isclose(float(whole), float(ref_loss), rtol=RTOL, atol=ATOL),
                f"rank {RANK}: {whole} vs {ref_loss}")


@pytest.mark.mpi(min_size=2)
def test_metadata_only_on_non_holders(runs):
    """Every rank but group 0's may describe a group-0 array without data; group 0's
    rank must hold its replica."""
    mesh = runs[0]
    sharding = MpmdSharding(mesh, 0, P())
    if RANK == 0:
        with pytest.raises(ValueError, match=r"on rank 0 needs 1 local array\(s\)"):
            MpmdArray([], sharding, shape=(3,), dtype=np.float32)
        ok = True
    else:
        a = MpmdArray([], sharding, shape=(3,), dtype=np.float32)
        ok = not a.is_partially_addressable and len(a) == 3 and f"{a}" == repr(a)
    _everywhere(ok, f"rank {RANK}")
