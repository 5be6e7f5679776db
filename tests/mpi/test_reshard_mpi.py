"""Resharding and mpmd_init across ranks (one group per rank), checked against numpy.

Runs under `launch/jpprun -n 2` and `-n 4`, and with 2 devices per rank. Hypothesis draws
with `derandomize=True`, so every rank draws the same examples in the same order; each
example's verdict is agreed over MPI before asserting, so all ranks fail together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import assert_close_to_reference, bits, make_step, mlp, random_array, schedule
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi import MpmdSharding
from jaxpp_mpi._src.reshard import reshard

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
DTYPES = ["float32", "bfloat16", "int32"]


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), [r for r in results if not r[0]]


def spec_on(ndim: int, dim, axis) -> P:
    return P(*[axis if i == dim else None for i in range(ndim)])


def block_of(value: np.ndarray, dim) -> np.ndarray:
    """This rank's block along `dim` (the whole value when `dim` is None)."""
    if dim is None:
        return value
    b = value.shape[dim] // SIZE
    return np.take(value, range(RANK * b, (RANK + 1) * b), axis=dim)


def spmd_input(mesh, value: np.ndarray, dim, with_data: bool):
    """The SPMD input of this rank: its block (spec naming the MPMD axis, read with
    `process_local=True`) or the whole."""
    axis = ("stage", "data") if with_data else "stage"
    sharding = NamedSharding(mesh.mpmd_submesh((RANK,)).jax_mesh, spec_on(value.ndim, dim, axis))
    return jax.device_put(block_of(value, dim), sharding)


@st.composite
def leaf_case(draw) -> dict:
    ndim = draw(st.integers(0, 3))
    dim = st.sampled_from([None, *range(ndim)])
    src, dst, inner = draw(dim), draw(dim), draw(dim)
    src_data = K > 1 and src is not None and draw(st.booleans())
    shape = []
    for i in range(ndim):
        factor = SIZE if i in (src, dst) else 1
        if K > 1 and (i == inner or (i == src and src_data)):
            factor *= K
        shape.append(draw(st.integers(1, 2)) * factor)
    owners = draw(st.lists(st.integers(0, SIZE - 1), min_size=1, max_size=min(3, SIZE),
                           unique=True))
    return {"dtype": draw(st.sampled_from(DTYPES)), "shape": tuple(shape), "src": src,
            "src_data": src_data, "dst": dst, "owners": tuple(owners),
            "inner": spec_on(ndim, inner, "data")}


@pytest.mark.mpi(min_size=2)
@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
@given(st.lists(leaf_case(), min_size=1, max_size=3), st.integers(0, 2 ** 31))
def test_round_trip_returns_the_same_bytes_on_every_rank(mesh, leaves, seed):
    values = [random_array(seed + i, c["shape"], c["dtype"]) for i, c in enumerate(leaves)]
    inputs = [spmd_input(mesh, v, c["src"], c["src_data"]) for v, c in zip(values, leaves)]
    targets = [MpmdSharding(mesh, c["owners"], c["inner"]) for c in leaves]
    problems = []
    mpmd = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, inputs, targets, process_local=True)
    for i, (x, arr, v, t) in enumerate(zip(inputs, mpmd, values, targets)):
        if not x.is_deleted() or arr.shape != v.shape or arr.dtype != v.dtype:
            problems.append(f"leaf {i}: input kept or {arr} is not {v.dtype}{v.shape}")
        if arr.is_partially_addressable != (RANK in t.mesh_ids):
            problems.append(f"leaf {i}: held here is {arr.is_partially_addressable}")
        elif RANK in t.mesh_ids:
            replica = arr.to_mpmd_local_array
            if not (replica.sharding.is_equivalent_to(t.sharding_for(RANK), v.ndim)
                    and np.array_equal(bits(replica), bits(v))):
                problems.append(f"leaf {i}: replica differs from the value")
    dst = [spec_on(len(c["shape"]), c["dst"], "stage") for c in leaves]
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, mpmd, dst, process_local=True)
    for i, (out, arr, v, c, spec) in enumerate(zip(back, mpmd, values, leaves, dst)):
        want = block_of(v, c["dst"])
        layout = NamedSharding(mesh.mpmd_submesh((RANK,)).jax_mesh, spec)
        if not (arr.is_deleted() and out.sharding.is_equivalent_to(layout, v.ndim)
                and out.dtype == v.dtype and np.array_equal(bits(out), bits(want))):
            problems.append(f"leaf {i}: spmd result differs ({c})")
    _everywhere(not problems, f"rank {RANK}: {problems}")


@pytest.mark.mpi(min_size=2)
def test_messages_take_the_cheapest_collective(mesh):
    """Whole inputs move nothing; a block owned by every group is allgathered, one owned
    by one group gathered; going back, a value held by one group is broadcast (whole
    target) or scattered (blocked target), one held everywhere moves nothing."""
    v = random_array(1, (2 * SIZE * K, 3), "float32")
    whole = jax.device_put(v, NamedSharding(mesh.mpmd_submesh((RANK,)).jax_mesh, P()))
    everyone, one = MpmdSharding(mesh, range(SIZE), P()), MpmdSharding(mesh, SIZE - 1, P())
    got = jaxpp_mpi.spmd_to_mpmd_reshard(
        mesh, [whole, spmd_input(mesh, v, 0, False), spmd_input(mesh, v, 0, False)],
        [one, everyone, one], process_local=True)
    first = list(reshard.last_stats.collectives)
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, got, [P(), P(), P("stage")],
                                          process_local=True)
    second = list(reshard.last_stats.collectives)
    ok = (first == ["allgather", "gather"] and second == ["bcast", "scatter"]
          and np.array_equal(bits(back[0]), bits(v)) and np.array_equal(bits(back[1]), bits(v))
          and np.array_equal(bits(back[2]), bits(block_of(v, 0))))
    _everywhere(ok, f"rank {RANK}: {first} {second}")


@pytest.mark.mpi(min_size=2)
def test_batches_bound_the_bytes_in_flight(mesh):
    """8 blocked arrays of 1 KiB, every one owned by group 0, with a 2.5 KiB threshold:
    4 batches, at most threshold + the largest array's bytes held at once per rank."""
    values = [random_array(10 + i, (16 * SIZE, 16 // SIZE), "float32") for i in range(8)]
    inputs = [spmd_input(mesh, v, 0, False) for v in values]
    targets = [MpmdSharding(mesh, 0, P()) for _ in values]
    threshold = 2560
    # On group 0 a whole value takes 1 KiB on each of its K devices; staging it through
    # the first device (K > 1) adds at most 2 more copies.
    largest = 1024 * (K + (2 if K > 1 else 0))
    out = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, inputs, targets, threshold=threshold,
                                         process_local=True)
    stats = reshard.last_stats
    ok = (stats.threshold == threshold and len(stats.batches) == (4 if K == 1 else 8)
          and stats.peak_in_flight_bytes <= threshold + largest
          and all(x.is_deleted() for x in inputs))
    if RANK == 0:
        ok = ok and stats.peak_in_flight_bytes > 0 and all(
            np.array_equal(bits(a.to_mpmd_local_array), bits(v)) for a, v in zip(out, values))
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, out, [P("stage")] * 8, threshold=threshold,
                                          process_local=True)
    ok = ok and reshard.last_stats.peak_in_flight_bytes <= threshold + largest and all(
        np.array_equal(bits(b), bits(block_of(v, 0))) for b, v in zip(back, values))
    _everywhere(ok, f"rank {RANK}: {reshard.last_stats}")


@pytest.mark.mpi(min_size=2)
def test_bad_input_on_one_rank_raises_on_every_rank(mesh):
    """A rank-local problem (one rank's block has another shape, or one rank passes a
    non-array) raises the same ValueError everywhere, before any data moves."""
    target = [MpmdSharding(mesh, 0, P())]
    cases = [
        ([spmd_input(mesh, np.zeros((SIZE * (2 + (RANK == 1)),), np.float32), 0, False)],
         "ranks passed different arrays"),
        ([jnp.zeros(2) if RANK != 1 else [1.0, 2.0]], "bad input on rank"),
    ]
    for arrays, match in cases:
        try:
            jaxpp_mpi.spmd_to_mpmd_reshard(mesh, arrays, target, process_local=True)
        except ValueError as e:
            ok, msg = match in str(e), str(e)
        else:
            ok, msg = False, "no error"
        messages = WORLD.allgather(msg)
        _everywhere(ok and len(set(messages)) == 1, f"rank {RANK}: {msg}")


@pytest.mark.mpi(min_size=2)
def test_compiled_in_shardings_feed_the_reshard(mesh):
    """The JaxPP flow across ranks: SPMD init, reshard to compile(...).in_shardings, one
    step, new params back to SPMD on every rank; equal to single-process jax.jit."""
    sched = schedule("1f1b", SIZE)
    params, batch, loss_fn = mlp(sched.num_stages, 2 * SIZE)
    step, opt = make_step(loss_fn, sched)
    opt_state = opt.init(params)
    reference = jax.jit(step)(opt_state, params, batch)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(opt_state, params,
                                                                          batch)
    (state_sh, params_sh, _), _ = compiled.in_shardings
    mpmd_state, mpmd_params = jaxpp_mpi.spmd_to_mpmd_reshard(
        mesh, jax.tree.map(jnp.copy, (opt_state, params)), (state_sh, params_sh))
    out = compiled(mpmd_state, mpmd_params, batch)
    assert_close_to_reference(reference, out)
    new_params = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, out[1], jax.tree.map(lambda _: P(), out[1]))
    compared = assert_close_to_reference(reference[1], new_params)
    _everywhere(compared == len(jax.tree.leaves(params)))


@pytest.mark.mpi(min_size=2)
def test_mpmd_init_on_owning_ranks_only(mesh):
    """Each rank computes only the leaves its group owns; values equal jax.jit's."""
    def init(key):
        ks = jax.random.split(key, SIZE + 1)
        return {"layers": [jax.random.uniform(ks[i], (4 * K, 3)) for i in range(SIZE)],
                "bits": jax.random.bits(ks[-1], (5,))}

    shardings = {"layers": [MpmdSharding(mesh, i, P("data")) for i in range(SIZE)],
                 "bits": MpmdSharding(mesh, range(SIZE), P())}
    key = jax.random.PRNGKey(3)
    out = jaxpp_mpi.mpmd_init(init, shardings, key)
    layout = {"layers": [NamedSharding(mesh.group_mesh(RANK), P("data"))] * SIZE,
              "bits": NamedSharding(mesh.group_mesh(RANK), P())}
    want = jax.jit(init, out_shardings=layout)(key)
    ok = all(a.is_partially_addressable == (i == RANK) for i, a in enumerate(out["layers"]))
    ok = ok and np.array_equal(bits(out["layers"][RANK]), bits(want["layers"][RANK]))
    ok = ok and np.array_equal(np.asarray(out["bits"]), np.asarray(want["bits"]))
    _everywhere(ok, f"rank {RANK}")
