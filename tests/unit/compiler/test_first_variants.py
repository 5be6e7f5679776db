"""`Note: first variants`: a task's `_first` executable is its plain one on identity states.

The identities are checked against IEEE arithmetic as numpy does it (every value kept bit
for bit, -0.0, infinities and NaN included); the pairing of variants on a step built for
two groups (traced and split only: no XLA compile here).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from models import make_step, mlp, schedule

from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.compiler.exes import first_from_plain, identity
from jaxpp_mpi._src.primitives.treduce import Add, Concat, Max, Op

FLOATS = ["float16", "bfloat16", "float32", "float64"]
INTS = ["int8", "uint8", "int32", "uint32"]


def _samples(dtype) -> np.ndarray:
    """Values that an identity must keep exactly: signed zeros, extremes, inf, NaN."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.array([info.min, info.min + 1, 0, 1, info.max], dtype)
    info = ml_dtypes.finfo(dtype)
    values = [
        -0.0,
        0.0,
        1.5,
        -2.25,
        float(info.max),
        float(info.min),
        float(info.smallest_subnormal),
        np.inf,
        -np.inf,
        np.nan,
    ]
    return np.array(values, dtype)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_add_identity_keeps_every_value_bit_for_bit(dtype):
    x = _samples(dtype)
    assert _same_bits(np.add(np.full_like(x, identity(Add(), x.dtype)), x), x)


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_add_identity_of_complex_keeps_both_signed_zeros(dtype):
    parts = np.array([-0.0, 0.0, 1.5, np.inf, np.nan])
    x = np.empty(len(parts) ** 2, dtype)
    x.real, x.imag = np.repeat(parts, len(parts)), np.tile(parts, len(parts))
    # numpy's complex add is per component, as XLA's.
    assert _same_bits(np.add(np.full_like(x, identity(Add(), x.dtype)), x), x)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_max_identity_keeps_every_value_bit_for_bit(dtype):
    x = _samples(dtype)
    with np.errstate(invalid="ignore"):  # NaN is one of the values
        out = np.maximum(np.full_like(x, identity(Max(), x.dtype)), x)
    assert _same_bits(out, x)


@pytest.mark.parametrize("dtype", FLOATS + INTS + ["bool"])
def test_concat_identity_is_zeros(dtype):
    assert identity(Concat(), dtype) == np.zeros((), dtype)


def test_bool_identities():
    x = np.array([False, True])
    assert _same_bits(np.logical_or(identity(Add(), np.bool_), x), x)
    assert _same_bits(np.maximum(identity(Max(), np.bool_), x), x)


def test_no_identity_where_none_is_known():
    @dataclasses.dataclass(frozen=True)
    class Product(Op):
        def state(self, length, a):
            return a

        def update(self, state, v, i):
            return state * v

    assert identity(Product(), np.float32) is None
    assert identity(Max(), ml_dtypes.float8_e4m3fn) is None  # no -inf in this type
    assert identity(Max(), np.complex64) is None


def _plan(sched_name: str, num_microbatches: int):
    sched = schedule(sched_name, 2)
    params, batch, loss_fn = mlp(sched.num_stages, num_microbatches, width=4, rows=2)
    step, optimizer = make_step(loss_fn, sched)
    return build_step(step, (optimizer.init(params), params, batch), 2)


@pytest.mark.parametrize("sched_name", ["1f1b", "zerobubble"])
def test_every_first_variant_pairs_with_its_plain_variant(sched_name):
    plan = _plan(sched_name, 4)
    paired = 0
    for exes, avals in zip(plan.exes, plan.exe_avals):
        for name in exes:
            via = first_from_plain(exes, avals, name)
            if not name.endswith("_first"):
                assert via is None, name
                continue
            assert via is not None, name  # Add, Max and Concat states only in this step
            plain, fill = via
            assert plain == name.removesuffix("_first") and plain in exes
            (ins, outs), (plain_ins, _) = avals[name], avals[plain]
            states = jax.eval_shape(fill.fn)
            assert [(s.shape, s.dtype.name) for s in states] == [
                (a.shape, a.dtype) for a in plain_ins[len(ins) :]
            ]
            assert [(a.shape, a.dtype) for a in outs[len(outs) - len(states) :]] == [
                (s.shape, s.dtype.name) for s in states
            ]
            paired += 1
    assert paired >= 2  # at least one backward family per group


def test_one_microbatch_has_no_plain_variant_to_share():
    plan = _plan("gpipe", 1)
    for exes, avals in zip(plan.exes, plan.exe_avals):
        assert all(first_from_plain(exes, avals, name) is None for name in exes)


def test_fill_holds_the_identities():
    plan = _plan("1f1b", 2)
    exes, avals = plan.exes[0], plan.exe_avals[0]
    name = next(n for n in exes if n.startswith("B") and n.endswith("_first"))
    _, fill = first_from_plain(exes, avals, name)
    for state, value in zip(fill.fn(), exes[name].first_fills):
        state = np.asarray(state)
        assert _same_bits(state, np.full(state.shape, value, state.dtype))
    # Weight gradients are sums: each starts from -0.0.
    assert all(
        np.signbit(v) and v == 0
        for v in exes[name].first_fills
        if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)
    )
