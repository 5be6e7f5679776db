"""compiler/replicas.py: microbatch shares, reduction ops, replica-share reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler import replicas
from jaxpp_mpi._src.primitives.treduce import Add, Concat, Max


def test_local_microbatches():
    assert replicas.local_microbatches(8, 2) == 4
    assert replicas.local_microbatches(3, 1) == 3
    with pytest.raises(CompileError, match="multiple of 4 microbatches"):
        replicas.local_microbatches(6, 4)


@pytest.mark.parametrize(("op", "dtype", "want"), [
    (Add(), "float32", "sum"), (Add(), "bfloat16", "sum"), (Max(), "int32", "max"),
    (Concat(), "float32", "bor"), (Add(), "bool", "bor"), (Max(), "bool", "bor")])
def test_reduce_op(op, dtype, want):
    assert replicas.reduce_op(op, dtype) == want


def test_concat_states_combine_exactly_by_bitwise_or():
    """Two replicas' Concat states (zeros except their own microbatches) OR'ed bit by
    bit equal the stack of every microbatch, -0.0 and NaN payloads included."""
    values = np.array([[-0.0, 1.5], [np.nan, -2.0], [3.0, 0.0], [-7.25, 1e-30]], np.float32)
    op = Concat()
    states = []
    for r in range(2):
        state = jnp.zeros((4, 2), jnp.float32)
        for m in range(2 * r, 2 * r + 2):
            state = op.update(state, values[m], m)
        states.append(np.asarray(state).view(np.uint32))
    combined = (states[0] | states[1]).view(np.float32)
    np.testing.assert_array_equal(combined.view(np.uint32), values.view(np.uint32))


def test_split_dim():
    assert replicas.split_dim(("replica", None), "replica") == 0
    assert replicas.split_dim((None, ("replica", "data")), "replica") == 1
    assert replicas.split_dim(("data",), "replica") is None
    assert replicas.split_dim(("replica",), None) is None
    with pytest.raises(ValueError, match="put it first"):
        replicas.split_dim((("data", "replica"),), "replica")
    with pytest.raises(ValueError, match="split one dimension"):
        replicas.split_dim(("replica", "replica"), "replica")


def _take(xs, i):
    return lax.squeeze(lax.dynamic_slice(xs, (i, 0), (1, xs.shape[1])), (0,)) * 2.0


def test_localize_reads_the_share_at_the_global_index():
    xs = np.arange(24, dtype=np.float32).reshape(8, 3)
    closed = jax.make_jaxpr(_take)(xs, 0)
    local = replicas.localize(closed, {0: (0, 4)}, "argument xs")
    assert local.in_avals[0].shape == (4, 3)
    fn = jex_core.jaxpr_as_fun(local)
    for replica in range(2):
        share = xs[4 * replica:4 * replica + 4]
        for i in range(4 * replica, 4 * replica + 4):
            np.testing.assert_array_equal(fn(share, np.int32(i))[0], xs[i] * 2.0)


def test_localize_refuses_a_whole_read():
    closed = jax.make_jaxpr(lambda xs, i: jnp.sum(xs) + i)(np.zeros((8, 3), np.float32), 0)
    with pytest.raises(CompileError, match="one microbatch at a time"):
        replicas.localize(closed, {0: (0, 4)}, "argument xs")


def test_localize_names_a_share_split_on_another_dimension_than_the_loop_reads():
    """The rows split over the replicas on dimension 1 while the loop takes microbatches
    along dimension 0: every slice spans the whole of dimension 1, which no replica
    holds. The error names the argument, the replica axis, both shapes and the spec."""
    xs = np.arange(32, dtype=np.float32).reshape(8, 4)
    closed = jax.make_jaxpr(_take)(xs, 0)
    with pytest.raises(CompileError) as info:
        replicas.localize(closed, {0: (1, 2)}, "task F0", names={0: "args[2][0]"},
                          replica_axis="dp")
    text = str(info.value)
    for part in ("argument args[2][0] (read by task F0)", "dimension 1", "'dp'",
                 "(8, 4)", "(8, 2)", "slices of shape (1, 4)", "P('dp')"):
        assert part in text, (part, text)


def test_localize_refuses_slices_straddling_two_shares():
    xs = np.arange(24, dtype=np.float32).reshape(8, 3)
    take3 = lambda xs, i: lax.dynamic_slice(xs, (i, 0), (3, 3)) * 2.0
    closed = jax.make_jaxpr(take3)(xs, 0)
    with pytest.raises(CompileError, match=r"xs .*do not tile a share of 4"):
        replicas.localize(closed, {0: (0, 4)}, "argument xs")
