"""Randomness inside pipelined steps: typed PRNG keys against `jax.jit` (`Note: keys as
key data` in compiler/keys.py).

A tanh MLP with dropout after every layer trains for a few `optax.adam` steps. Its state
holds a typed key (`jax.random.key`) that each step splits, returning the new key; the
dropout keys are folded from the step's subkey, the microbatch index and the stage
index inside the loss. The reference is the same step under `jax.jit` with a plain
Python loop over the microbatches and no stage marks; keys being identical, so are the
masks, and losses, parameters, optimizer state and keys must agree (keys bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi._src.ir.program import Aval, Recv, Send, SendRecv

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
RATE = 0.25  # dropout rate
WIDTH, ROWS = 8, 4
OPTIMIZER = optax.adam(1e-2)
SCHEDULES: dict[str, Callable[[int], jaxpp_mpi.BaseSchedule]] = {
    "1f1b": lambda s: jaxpp_mpi.Std1F1B(s),
    "zerobubble": lambda s: jaxpp_mpi.ZeroBubble(s),
    "interleaved": lambda s: jaxpp_mpi.Interleaved1F1B(2 * s, s),
}


def dropout(key: jax.Array, x: jax.Array, rate: float = RATE) -> jax.Array:
    """Inverted dropout, by hand: what flax's `Dropout` does with its rng."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def mlp_loss(params, microbatch, key, mark, rate: float = RATE):
    """One tanh layer per stage, dropout after each (key folded with the stage index)."""
    x, y = microbatch
    for stage, (w, b) in enumerate(params):
        x = dropout(jax.random.fold_in(key, stage), jnp.tanh(x @ w + b), rate)
        x = mark(x)
    return jnp.mean((x - y) ** 2)


def crossing_loss(params, microbatch, key, mark):
    """Stage 0 derives the key for the stage after it from its own activations and hands
    it over with them through the stage mark: the key crosses a message."""
    x, y = microbatch
    for w, b in params:
        x = jnp.tanh(x @ w + b)
        key = jax.random.fold_in(key, jnp.sum(x > 0))  # depends on this stage's values
        x = dropout(key, x)
        x, key = mark((x, key))
    return jnp.mean((x - y) ** 2)


BASE_KEY = jax.random.key(42)  # closed over by the step: a key constant


def inner_key_loss(params, microbatch, key, mark):
    """Keys made inside the stages: from an integer seed, and from a key constant."""
    del key
    x, y = microbatch
    for stage, (w, b) in enumerate(params):
        own = jax.random.key(1000 + stage)
        x = dropout(jax.random.fold_in(own, jnp.sum(x > 0)), jnp.tanh(x @ w + b))
        x = dropout(jax.random.fold_in(BASE_KEY, stage), x)
        x = mark(x)
    return jnp.mean((x - y) ** 2)


def remat_loss(params, microbatch, key, mark):
    """Every stage under jax.checkpoint, its dropout key made inside it."""
    x, y = microbatch

    @jax.checkpoint
    def layer(x, w, b, key):
        x = jnp.tanh(x @ w + b)
        return dropout(jax.random.fold_in(key, jnp.sum(x > 0)), x)

    for stage, (w, b) in enumerate(params):
        x = mark(layer(x, w, b, jax.random.fold_in(key, stage)))
    return jnp.mean((x - y) ** 2)


def sequential_reduce(fun: Callable, n: int) -> tuple[jax.Array, Any]:
    """treduce_i's default semantics by hand: stack the losses, sum the gradients."""
    outs = [fun(jnp.int32(i)) for i in range(n)]
    losses = jnp.stack([o[0] for o in outs])
    return losses, jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *[o[1] for o in outs])


def make_step(loss: Callable, reduce: Callable, mark: Callable) -> Callable:
    """A training step on a state {params, opt, key}; returns (new state, losses)."""

    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        params = state["params"]
        grad_fn = jax.value_and_grad(loss)

        def microbatch(i):
            mb = jax.tree.map(lambda a: a[i], batch)
            return grad_fn(params, mb, jax.random.fold_in(sub, i), mark)

        losses, grads = reduce(microbatch, batch[0].shape[0])
        updates, opt = OPTIMIZER.update(grads, state["opt"], params)
        return {"params": optax.apply_updates(params, updates), "opt": opt, "key": key}, losses

    return step


def problem(num_stages: int, num_microbatches: int, seed: int = 0):
    """(state, batch): params, adam state and a typed key; (x, y) per microbatch."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    params = [(normal(WIDTH, WIDTH) * 0.5, normal(WIDTH) * 0.1) for _ in range(num_stages)]
    state = {"params": params, "opt": OPTIMIZER.init(params), "key": jax.random.key(seed)}
    batch = (normal(num_microbatches, ROWS, WIDTH), normal(num_microbatches, ROWS, WIDTH))
    return state, batch


def pipelined(loss: Callable, sched, mesh: jaxpp_mpi.MpmdMesh, **kw):
    reduce = lambda fun, n: jaxpp_mpi.treduce_i(fun, n, schedule=sched)
    return jaxpp_mpi.mpmd_jit_with_loop(make_step(loss, reduce, jaxpp_mpi.mark_stage_end),
                                        mpmd_mesh=mesh, **kw)


def reference(loss: Callable):
    return jax.jit(make_step(loss, sequential_reduce, lambda x: x))


def is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(x) -> np.ndarray:
    """The bits of a key result (an MpmdArray of keys or a jax.Array of keys)."""
    if isinstance(x, jaxpp_mpi.MpmdArray):
        x = x.first_mpmd_replica
    return np.asarray(jax.random.key_data(x))


def held(x) -> tuple[bool, np.ndarray | None]:
    """(is a key, value) of a result leaf: numpy, a key as its key data, None for an
    MpmdArray this process does not hold (MPI mode)."""
    if isinstance(x, jaxpp_mpi.MpmdArray):
        if not x.is_partially_addressable:
            return is_key(x), None
        x = next(iter(x.local_arrays.values()))  # a replica held here: no message
    if is_key(x):
        return True, key_data(x)
    return False, np.asarray(x)


def run(step: Callable, state, batch) -> list[list[tuple[bool, np.ndarray | None]]]:
    """NUM_STEPS steps, each fed the previous state; per step, `held` of every leaf of
    (state, losses)."""
    history = []
    for _ in range(NUM_STEPS):
        state, losses = step(state, batch)
        history.append([held(x) for x in jax.tree.leaves((state, losses))])
    return history


def assert_parity(want: list, got: list) -> int:
    """Every held leaf of every step matches (keys bit for bit); returns how many keys
    were compared."""
    keys = 0
    for k, (w, g) in enumerate(zip(want, got, strict=True)):
        for j, ((w_key, a), (g_key, b)) in enumerate(zip(w, g, strict=True)):
            assert w_key == g_key, f"leaf {j}, step {k}: key {w_key} vs {g_key}"
            if b is None:
                continue
            if g_key:
                np.testing.assert_array_equal(b, a, err_msg=f"key leaf {j}, step {k}")
                keys += 1
            else:
                np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL,
                                           err_msg=f"leaf {j}, step {k}")
    return keys


@functools.cache
def local_mesh(groups: int, data: int = 1) -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.MpmdMesh(jax.make_mesh((groups, data), ("stage", "data")), "stage")


@pytest.mark.parametrize("sched_name", SCHEDULES)
def test_random_dropout_parity(sched_name):
    """Dropout in every stage, a key argument carried in the state and split every step:
    3 steps match jax.jit, keys bit for bit (so every mask is jax.jit's)."""
    sched = SCHEDULES[sched_name](2)
    state, batch = problem(sched.num_stages, 4)
    want = run(reference(mlp_loss), state, batch)
    got = run(pipelined(mlp_loss, sched, local_mesh(2)), state, batch)
    assert assert_parity(want, got) == NUM_STEPS  # the state's key, every step
    # Dropout is live: without it the step's losses differ.
    plain = run(reference(lambda p, mb, k, mark: mlp_loss(p, mb, k, mark, rate=0.0)), state,
                batch)
    assert not np.allclose(plain[0][-1][1], want[0][-1][1])  # the losses


def test_random_key_crosses_a_message():
    """A key made in stage 0 from its activations is used in stage 1: the program sends its
    key data (uint32[2]) from group 0 to group 1, and the masks still match jax.jit."""
    sched = jaxpp_mpi.Std1F1B(2)
    state, batch = problem(2, 4)
    step = pipelined(crossing_loss, sched, local_mesh(2))
    program = step.compile(state, batch).program()
    key_aval = Aval((2,), "uint32")
    sent = [i for i in program.group(0).instrs if isinstance(i, (Send, SendRecv))
            and program.group(0).aval(i.buf if isinstance(i, Send) else i.send_buf) == key_aval]
    received = [i for i in program.group(1).instrs
                if isinstance(i, (Recv, SendRecv)) and i.aval == key_aval]
    assert len(sent) == len(received) == 4, program  # one key per microbatch
    assert_parity(run(reference(crossing_loss), state, batch), run(step, state, batch))


def test_random_keys_made_inside_stages():
    """Keys from an integer seed and from a closed-over key constant, inside the stages;
    and a key made by the step itself returned as a result."""
    sched = jaxpp_mpi.Std1F1B(2)
    state, batch = problem(2, 4, seed=1)

    def with_fresh_key(step):
        def wrapped(state, batch):
            state, losses = step(state, batch)
            return state, losses, jax.random.fold_in(jax.random.key(7), losses.shape[0])
        return wrapped

    ref = jax.jit(with_fresh_key(make_step(inner_key_loss, sequential_reduce, lambda x: x)))
    reduce = lambda fun, n: jaxpp_mpi.treduce_i(fun, n, schedule=sched)
    pp = jaxpp_mpi.mpmd_jit_with_loop(
        with_fresh_key(make_step(inner_key_loss, reduce, jaxpp_mpi.mark_stage_end)),
        mpmd_mesh=local_mesh(2))
    want, got = ref(state, batch), pp(state, batch)
    np.testing.assert_array_equal(key_data(got[2]), key_data(want[2]))
    assert got[2].dtype == want[2].dtype
    assert_parity(run(lambda s, b: ref(s, b)[:2], state, batch),
                  run(lambda s, b: pp(s, b)[:2], state, batch))


def test_random_dropout_under_checkpoint():
    """Dropout inside jax.checkpoint'ed stages (recomputed in the backward): jax.jit's."""
    sched = jaxpp_mpi.ZeroBubble(2)
    state, batch = problem(2, 4, seed=3)
    step = pipelined(remat_loss, sched, local_mesh(2))
    assert_parity(run(reference(remat_loss), state, batch), run(step, state, batch))


def test_random_group_sharded_batch():
    """Two devices per group, each microbatch's rows split over them: the dropout masks,
    drawn shard by shard, are still jax.jit's."""
    sched = jaxpp_mpi.Std1F1B(2)
    state, batch = problem(2, 4, seed=2)
    step = pipelined(mlp_loss, sched, local_mesh(2, 2),
                     in_shardings=(None, (P(None, "data"), P(None, "data"))))
    assert_parity(run(reference(mlp_loss), state, batch), run(step, state, batch))


def test_random_key_argument_signature():
    """A key argument is part of the signature by its key dtype: a step fed its own key
    results compiles once; a key of another implementation (rbg) compiles anew and draws
    that implementation's masks, as jax.jit does."""
    sched = jaxpp_mpi.Std1F1B(2)
    state, batch = problem(2, 2)
    step = pipelined(mlp_loss, sched, local_mesh(2))
    fed = state
    for _ in range(3):
        fed, _ = step(fed, batch)
    assert fed["key"].dtype == jax.random.key(0).dtype
    assert len(step._cache) == 1  # one compile across the training loop
    rbg = dict(state, key=jax.random.key(0, impl="rbg"))
    want, got = reference(mlp_loss)(rbg, batch), step(rbg, batch)
    assert len(step._cache) == 2
    assert got[0]["key"].dtype == want[0]["key"].dtype
    np.testing.assert_array_equal(key_data(got[0]["key"]), key_data(want[0]["key"]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=RTOL, atol=ATOL)
