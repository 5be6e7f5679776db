"""`mpmd_jit_by_yield` across ranks (one group per rank): an MLP forward with two stages
per rank and a `cross_mpmd_all_reduce` of per-stage partials, against single-process
`jax.jit` on every rank. Runs under `launch/jpprun -n 2` and `-n 4`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import held_values, mlp
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.frontend.by_yield import mpmd_jit_by_yield
from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_all_reduce

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


def forward(params, mb):
    """The MLP's forward; each stage's squared activations summed across stages."""
    x, y = mb
    partials = []
    for w, b in params:
        x = jnp.tanh(x @ w + b)
        partials.append(jnp.sum(x * x))
        x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean((x - y) ** 2), x, cross_mpmd_all_reduce(*partials)


@pytest.mark.mpi(min_size=2)
def test_by_yield_mlp_forward_matches_jit_mpi():
    """Stage s on rank s % SIZE; the results, on the last stage's rank, equal jax.jit's
    (rtol 1e-6); the other ranks hold none of them."""
    mesh = jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")
    params, batch, _ = mlp(2 * SIZE, 1)
    mb = jax.tree.map(lambda a: a[0], batch)
    out = mpmd_jit_by_yield(forward, mesh, target_num_stages=2 * SIZE)(params, mb)
    ref = jax.jit(forward)(params, mb)
    assert all(x.mpmd_idxs == {SIZE - 1} for x in out)
    checked = 0
    for r, o in zip(held_values(ref), held_values(out)):
        if o is not None:
            np.testing.assert_allclose(o, r, rtol=1e-6, atol=0)
            checked += 1
    assert checked == (len(out) if RANK == SIZE - 1 else 0)
