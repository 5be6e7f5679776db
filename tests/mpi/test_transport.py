"""Transport smoke test: every op, float32 and bfloat16, inside jax.jit, bit-exact."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

from jaxpp_mpi._src.mpi import chains, collectives, wire

COMM = collectives.world_dup()
RANK, SIZE = COMM.rank, COMM.size
DTYPES = [jnp.float32, jnp.bfloat16]
SHAPE = (3, 257)  # odd sizes; ~1.5-3 KiB per message


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def data_of(rank: int, dtype, shape=SHAPE) -> jax.Array:
    """Random bit patterns (NaN payloads, infs, -0.0, subnormals) unique to `rank`."""
    width = np.dtype(dtype).itemsize
    bits = np.random.default_rng(1000 + rank).integers(0, 2 ** (8 * width), shape)
    return jnp.asarray(bits.astype(f"u{width}").view(np.dtype(dtype)))


def assert_bits_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_send_recv_pairs(dtype):
    # Pairs (0,1), (2,3), ...: the even rank sends first, then the odd one answers.
    peer = RANK ^ 1
    if peer >= SIZE:  # odd rank count: the last rank has no partner
        return
    x = data_of(RANK, dtype)

    @jax.jit
    def exchange(x):
        if RANK % 2 == 0:
            collectives.send(x, peer, tag=7, comm=COMM)
            return collectives.recv(x.shape, x.dtype, peer, tag=8, comm=COMM)
        got = collectives.recv(x.shape, x.dtype, peer, tag=7, comm=COMM)
        collectives.send(x, peer, tag=8, comm=COMM)
        return got

    assert_bits_equal(exchange(x), data_of(peer, dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sendrecv_ring(dtype):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    x = data_of(RANK, dtype)
    ring = jax.jit(
        lambda x: collectives.sendrecv(x, right, 3, x.shape, x.dtype, left, 3, COMM)
    )
    assert_bits_equal(ring(x), data_of(left, dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("root", [0, -1])
def test_bcast(dtype, root):
    root = root % SIZE
    x = data_of(RANK, dtype)
    got = jax.jit(functools.partial(collectives.bcast, root=root, comm=COMM))(x)
    assert_bits_equal(got, data_of(root, dtype))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(dtype):
    got = jax.jit(functools.partial(collectives.allgather, comm=COMM))(data_of(RANK, dtype))
    # numpy, not jnp.stack: XLA's stack would canonicalise the NaN payloads.
    want = np.stack([np.asarray(data_of(r, dtype)) for r in range(SIZE)])
    assert_bits_equal(got, want)


@pytest.mark.mpi(min_size=2)
def test_large_message_rendezvous():
    # 8 MiB: beyond every eager limit, so this exercises the rendezvous protocol.
    x = data_of(RANK, jnp.float32, (2048, 1024))
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    got = jax.jit(lambda x: collectives.sendrecv(x, right, 1, x.shape, x.dtype, left, 1, COMM))(x)
    assert_bits_equal(got, data_of(left, jnp.float32, (2048, 1024)))


def test_runtime_communicator_is_not_comm_world():
    assert COMM != MPI.COMM_WORLD
    assert MPI.Comm.Compare(COMM, MPI.COMM_WORLD) == MPI.CONGRUENT


def test_wire_dtypes():
    assert wire.wire_dtype(jnp.bfloat16) == np.uint16
    assert wire.wire_dtype(jnp.float32) == np.float32
    assert wire.wire_dtype(jnp.float8_e4m3fn) == np.uint8


# ------------------------------------------------------------------ message chains


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_chain_runs_several_calls_in_one_computation(dtype):
    """One jitted chain: send, recv and sendrecv in that order, bit-exact (bfloat16 via
    its wire dtype), between pairs (0,1), (2,3), ..."""
    peer = RANK ^ 1
    if peer >= SIZE:
        return
    even = RANK % 2 == 0
    x = data_of(RANK, dtype)
    if even:
        ops = (("send", peer, 1), ("recv", peer, 2, SHAPE, jnp.dtype(dtype).name),
               ("sendrecv", peer, 3, 3, SHAPE, jnp.dtype(dtype).name))
        fn = jax.jit(chains.chain_fn(ops, COMM))
        order, got, swapped = fn(chains.Chain(jax.devices()[0]).order, x, x + x)
    else:
        ops = (("recv", peer, 1, SHAPE, jnp.dtype(dtype).name), ("send", peer, 2),
               ("sendrecv", peer, 3, 3, SHAPE, jnp.dtype(dtype).name))
        fn = jax.jit(chains.chain_fn(ops, COMM))
        order, got, swapped = fn(chains.Chain(jax.devices()[0]).order, x, x + x)
    want = data_of(peer, dtype)
    assert_bits_equal(got, want)
    assert_bits_equal(swapped, want + want)
    assert int(order) == 1


@pytest.mark.mpi(min_size=2)
def test_chains_dispatched_without_blocking_keep_program_order():
    """Forty chains dispatched back to back, nothing blocking in between, all on one tag
    and alternating direction: MPI matches same-tag messages in order, so any reordering
    of this rank's calls would deliver the wrong values (or deadlock)."""
    peer = RANK ^ 1
    if peer >= SIZE:
        return
    dev = jax.devices()[0]
    chain = chains.Chain(dev)
    send = jax.jit(chains.chain_fn((("send", peer, 5),), COMM))
    recv = jax.jit(chains.chain_fn((("recv", peer, 5, (1024,), "float32"),), COMM))
    got = []
    for k in range(40):
        sending = (k % 2 == 0) == (RANK % 2 == 0)
        if sending:
            (chain.order,) = send(chain.order, jnp.full((1024,), 1000.0 * RANK + k))
        else:
            chain.order, y = recv(chain.order)
            got.append((k, y))
    chain.wait()
    for k, y in got:
        np.testing.assert_array_equal(np.asarray(y), np.full((1024,), 1000.0 * peer + k))
