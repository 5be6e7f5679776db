"""Compiling each distinct module once across ranks (`Note: shared compiles` in
shared_compiles.py): who compiles what, and the exchange played by ranks that are
threads over a stand-in communicator (the MPI runs are in tests/mpi)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from thread_comm import on_thread_ranks

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.driver import shared_compiles
from jaxpp_mpi._src.driver.shared_compiles import assign_owners, compile_lowered


def test_a_module_one_rank_needs_stays_there_and_shared_ones_even_the_load():
    wants = [{"a": 10, "s1": 5}, {"s1": 5, "s2": 3, "s3": 3}, {"s2": 3, "s3": 3}]
    owner = assign_owners(wants)
    assert owner == {"a": 0, "s1": 1, "s2": 2, "s3": 2}
    assert assign_owners(wants) == owner  # the same on every rank
    for d, r in owner.items():
        assert d in wants[r]  # only a rank that needs a module compiles it


def test_helpers_take_modules_only_where_they_end_sooner():
    wants = [{"big": 10, "mid": 6, "small": 1}, {}, {"other": 3}]
    assert assign_owners(wants) == {"big": 0, "mid": 0, "small": 0, "other": 2}
    # Largest first. Rank 1 needs nothing: it takes "mid" (it is done at 6, before rank
    # 0, busy with "big" until 10, would start it); "other" stays with rank 2 (idle);
    # rank 2 then ends "small" at 4, before rank 0 would start it.
    assert assign_owners(wants, helpers=True) == {"big": 0, "mid": 1, "small": 2,
                                                   "other": 2}


def test_helpers_are_ranks_with_the_same_devices():
    wants = [{"big": 10, "mid": 6}, {}, {}]
    where = ["gpu0", "gpu1", "gpu0"]  # rank 1 would lower the module for other devices
    assert assign_owners(wants, helpers=True, where=where) == {"big": 0, "mid": 2}


def test_identical_ranks_split_their_modules():
    wants = [{"f": 9, "b": 7, "post": 3, "fill": 1}] * 2
    owner = assign_owners(wants)
    loads = [sum(wants[0][d] for d, r in owner.items() if r == k) for k in (0, 1)]
    assert sorted(loads) == [10, 10]


def _lowered(scale: float):
    f = jax.jit(lambda x: (jnp.tanh(x * scale), x.sum()))
    return f.lower(jax.ShapeDtypeStruct((4, 8), np.float32))


def _tanh_jit(x, scale: float):
    """The reference: jax.jit of tanh(x * scale) alone, compiled as the modules are (a
    fused tanh may differ from eager op-by-op in the last bit)."""
    return jax.jit(lambda v: jnp.tanh(v * scale))(x)


def _run_ranks(per_rank, compile_one=None):
    """Runs `compile_lowered` on len(per_rank) thread ranks; per rank (result, error)."""
    return on_thread_ranks(len(per_rank), lambda r, comm: compile_lowered(
        per_rank[r], None, comm, devices=jax.devices()[:1],
        compile_one=compile_one and compile_one(r)))


def test_two_ranks_compile_their_common_modules_once_and_get_the_same_results(
        no_persistent_cache):
    x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 7
    per_rank = [{"F": _lowered(2.0), "post": _lowered(3.0)},
                {"F": _lowered(2.0), "post": _lowered(3.0), "mine": _lowered(5.0)}]
    (r0, e0), (r1, e1) = _run_ranks(per_rank)
    assert e0 is None and e1 is None, (e0, e1)
    (exes0, rep0), (exes1, rep1) = r0, r1
    assert rep0["distinct"] == rep1["distinct"] == 3
    assert rep0["compiled"] + rep1["compiled"] == 3  # each distinct module once
    assert rep0["received"] + rep1["received"] == 2  # F and post reached the other rank
    for name, exe in [*exes0.items(), *exes1.items()]:
        expected = jax.jit(lambda v, s={"F": 2.0, "post": 3.0, "mine": 5.0}[name]:
                           (jnp.tanh(v * s), v.sum()))(x)
        for got, want in zip(exe(x), expected):
            np.testing.assert_array_equal(got, want)


def test_a_rank_with_nothing_of_its_own_compiles_for_another(no_persistent_cache):
    x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 7
    scales = {"A": 2.0, "B": 3.0}
    per_rank = [{name: _lowered(sc) for name, sc in scales.items()}, {}]
    lowered_by = []

    def lower_for(rank, name):
        lowered_by.append((rank, name))
        return _lowered(scales[name])

    results = on_thread_ranks(2, lambda r, comm: compile_lowered(
        per_rank[r], None, comm, devices=jax.devices()[:1], lower_for=lower_for))
    (exes, rep0), e0 = results[0]
    (_, rep1), e1 = results[1]
    assert e0 is None and e1 is None, (e0, e1)
    assert rep1["compiled"] == rep1["helped"] == 1 and rep0["received"] == 1, (rep0, rep1)
    assert rep0["compiled"] == 1 and lowered_by == [(0, lowered_by[0][1])]
    for name, exe in exes.items():
        np.testing.assert_array_equal(exe(x)[0], _tanh_jit(x, scales[name]))


def test_a_module_too_large_to_pass_on_is_compiled_by_each_rank(no_persistent_cache,
                                                                 monkeypatch):
    monkeypatch.setattr(shared_compiles, "MAX_SHARED_BYTES", 10)
    x = jnp.ones((4, 8), jnp.float32)
    results = _run_ranks([{"F": _lowered(2.0)}, {"F": _lowered(2.0)}])
    assert [report["compiled"] for (_, report), _ in results] == [1, 1]
    for (exes, _), error in results:
        assert error is None
        np.testing.assert_array_equal(exes["F"](x)[0], _tanh_jit(x, 2.0))


@pytest.mark.parametrize("cache", ["off", "on"])
def test_a_failed_compile_raises_on_every_rank_naming_its_owner(request, cache):
    if cache == "off":
        request.getfixturevalue("no_persistent_cache")
    per_rank = [{"F": _lowered(2.0), "post": _lowered(3.0)},
                {"F": _lowered(2.0), "post": _lowered(3.0)}]

    def compile_one(rank):
        def compile_(low):
            if rank == 1:
                raise RuntimeError("injected compile failure")
            return low.compile()
        return compile_

    results = _run_ranks(per_rank, compile_one)
    for _, error in results:
        assert isinstance(error, CompileError), results
        assert "rank(s) [1] failed to compile" in str(error)
        assert "injected compile failure" in str(error)


def test_with_the_persistent_cache_every_rank_compiles_its_own():
    """An executable loaded from JAX's persistent cache serializes without its code, so
    with the cache on (as in this test session) the ranks do not share, and each
    module still computes what it should."""
    x = jnp.ones((4, 8), jnp.float32)
    per_rank = [{"F": _lowered(2.0)}, {"F": _lowered(2.0)}]
    results = _run_ranks(per_rank)
    for (exes, report), error in results:
        assert error is None
        assert report == {"compiled": 1, "helped": 0, "received": 0, "needed": 1, "distinct": 1}
        np.testing.assert_array_equal(exes["F"](x)[0], _tanh_jit(x, 2.0))


def test_without_a_communicator_every_module_is_compiled_here():
    exes, report = compile_lowered({"F": _lowered(2.0)}, None, None,
                                   devices=jax.devices()[:1])
    assert report == {"compiled": 1, "helped": 0, "received": 0, "needed": 1, "distinct": 1}
    with pytest.raises(ValueError, match="lowering failed"):
        compile_lowered(None, ValueError("lowering failed"), None, devices=jax.devices()[:1])
    assert set(exes) == {"F"}


def test_digests_differ_with_the_devices_and_the_options():
    low = _lowered(2.0)
    base = shared_compiles.digest(low, jax.devices()[:1], None)
    assert base == shared_compiles.digest(_lowered(2.0), jax.devices()[:1], None)
    assert base != shared_compiles.digest(_lowered(3.0), jax.devices()[:1], None)
    fast = {"xla_cpu_enable_fast_math": True}
    assert base != shared_compiles.digest(low, jax.devices()[:1], fast)
    assert base != shared_compiles.digest(low, jax.devices()[1:2], None)


def test_module_cost_counts_kernels_not_text():
    x = jax.ShapeDtypeStruct((8, 8), np.float32)
    dot = jax.jit(lambda a, b: (a @ b, a.sum())).lower(x, x).as_text()
    # the module, a dot, a reduction, two results
    assert shared_compiles.module_cost(dot) == 2 + 2 + 2
    elementwise = jax.jit(lambda a: jnp.tanh(a * 3 + 1) * 2 - a).lower(x).as_text()
    assert shared_compiles.module_cost(elementwise) == 2 + 0 + 1
