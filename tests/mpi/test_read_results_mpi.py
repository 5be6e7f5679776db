"""A step's results read on every rank with `jaxpp_mpi.process_allgather` (Note: reading
values), against `jax.jit` of the same step in this process; implicit reads stay local
(Note: implicit reads are local).

Runs under `launch/jpprun -n 2`, `-n 3` (one group per rank) and `-n 4`, where the mesh
has 2 pipeline replicas of 2 groups (each replica reads on its own pipeline's ranks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from mpi4py import MPI

import jaxpp_mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
REPLICAS = 2 if SIZE % 2 == 0 and SIZE >= 4 else 1
GROUPS = SIZE // REPLICAS
MICROBATCHES = 2 * SIZE
RTOL, ATOL = 1e-5, 1e-6


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), [r for r in results if not r[0]]


def _step(loss_fn):
    """A training step: params, then a mean loss, an int32 index and per-microbatch
    losses (results on different groups)."""

    def step(params, batch):
        grad_fn = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jaxpp_mpi.treduce(
            grad_fn, batch, schedule=models.schedule("1f1b", GROUPS))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, (jnp.mean(losses), jnp.argmax(losses).astype(jnp.int32), losses)

    return step


@pytest.fixture(scope="module")
def runs():
    names = ("replica", "stage", "data") if REPLICAS > 1 else ("stage", "data")
    shape = (REPLICAS, GROUPS, K) if REPLICAS > 1 else (GROUPS, K)
    mesh = jaxpp_mpi.make_mpmd_mesh(shape, names, "stage",
                                    replica_axis_name="replica" if REPLICAS > 1 else None)
    params, batch, loss_fn = models.mlp(GROUPS, MICROBATCHES)
    step = _step(loss_fn)
    reference = jax.jit(step)(params, batch)
    got = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)(params, batch)
    return mesh, reference, got


@pytest.mark.mpi(min_size=2)
def test_read_results_process_allgather_matches_jit_on_every_rank(runs):
    mesh, reference, got = runs
    values = jaxpp_mpi.process_allgather(got)
    problems = []
    if jax.tree.structure(values) != jax.tree.structure(reference):
        problems.append("tree structure")
    for k, (v, r) in enumerate(zip(jax.tree.leaves(values), jax.tree.leaves(reference))):
        r = np.asarray(r)
        if not (isinstance(v, np.ndarray) and v.shape == r.shape and v.dtype == r.dtype
                and np.allclose(v, r, rtol=RTOL, atol=ATOL)):
            problems.append(f"leaf {k}: {v!r} != {r!r}")
    loss = got[1][0]
    holders = WORLD.allgather(loss.is_partially_addressable)
    if REPLICAS > 1 and mesh.num_replicas != REPLICAS:
        problems.append("replicas")
    _everywhere(not problems and any(holders) and not all(holders),
                f"rank {RANK}: {problems}, holders {holders}")


@pytest.mark.mpi(min_size=2)
def test_read_results_implicit_reads_are_local(runs):
    """Where held: the value, as jax.jit's; elsewhere: an error at once, naming the
    holders and both ways to read it; `format` gives the repr there. The logging loop
    of JAX's multi-process code (read where held, skip elsewhere) sends nothing."""
    _, (_, (ref_loss, ref_idx, ref_losses)), (_, (loss, idx, losses)) = runs
    problems = []
    for x, ref in ((loss, ref_loss), (idx, ref_idx), (losses, ref_losses)):
        if x.is_partially_addressable:
            if not np.allclose(np.asarray(x), np.asarray(ref), rtol=RTOL, atol=ATOL):
                problems.append(f"{np.asarray(x)} != {np.asarray(ref)}")
            if x.ndim == 0 and (f"{x:.3f}" != f"{ref:.3f}" or int(x) != int(ref)):
                problems.append(f"format {x:.3f} or int {int(x)}")
            continue
        for read in (np.asarray, float) if x.ndim == 0 else (np.asarray, list):
            try:
                read(x)
                problems.append(f"{read} read {x!r} on a non-holder")
            except RuntimeError as e:
                text = str(e)
                groups = str(tuple(x.mpmd_sharding.mesh_ids))
                if not (f"held by groups {groups}" in text and "to_mpmd_local_array" in text
                        and "jaxpp_mpi.process_allgather(x)" in text):
                    problems.append(text)
        if f"{x:.3f}" != repr(x) or str(x) != repr(x):
            problems.append(f"format {x:.3f}")
    logged = [float(loss) if loss.is_partially_addressable else None for _ in range(3)]
    if loss.is_partially_addressable and logged != [float(np.asarray(ref_loss))] * 3:
        if not np.allclose(logged, float(np.asarray(ref_loss)), rtol=RTOL, atol=ATOL):
            problems.append(f"logged {logged}")
    _everywhere(not problems, f"rank {RANK}: {problems}")


@pytest.mark.mpi(min_size=2)
def test_read_results_in_rounds_past_the_count_limit(runs, monkeypatch):
    """Past MPI's count limit the bytes go in rounds (here a limit of 16 bytes per rank
    and round): the same values as jax.jit's."""
    from jaxpp_mpi._src.mpi import collectives

    monkeypatch.setattr(collectives, "_MAX_ROUND_BYTES", 16 * GROUPS)
    _, reference, got = runs
    values = jaxpp_mpi.process_allgather(got)
    problems = [k for k, (v, r) in enumerate(zip(jax.tree.leaves(values),
                                                 jax.tree.leaves(reference)))
                if not np.allclose(v, np.asarray(r), rtol=RTOL, atol=ATOL)]
    _everywhere(not problems, f"rank {RANK}: leaves {problems}")
