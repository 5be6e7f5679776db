"""A step's call surface without compiling: static and donated arguments, keyword
arguments, the cache key, specs naming the MPMD axis, the JaxPP-compatible names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi._src.arrays.sharding import MpmdSharding, without_axis
from jaxpp_mpi._src.driver.arguments import (
    paths,
    resolve_argnums,
    signature,
    spec_entries,
    split_call,
    static_lines,
)


def step(params, scale, *, batch, lr=0.1):  # the signature only: nothing traces it
    return params, scale, batch, lr


def split(args, kwargs, **options):
    return split_call(resolve_argnums(step, **options), args, kwargs, "step")


# ------------------------------------------------------------------ static and donated


def test_argnums_and_argnames_complete_each_other():
    """As jax.jit: a position names its parameter and a name gives its position."""
    nums = resolve_argnums(step, static_argnums=1, donate_argnames="params")
    assert nums.static_argnums == (1,) and nums.static_argnames == ("scale",)
    assert nums.donate_argnums == (0,) and nums.donate_argnames == ("params",)
    nums = resolve_argnums(step, static_argnames=("lr", "scale"), donate_argnums=-2)
    assert nums.static_argnums == (1,) and nums.static_argnames == ("lr", "scale")
    assert nums.donate_argnums == (0,)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"static_argnums": 2}, ValueError, r"static_argnums=\(2,\), but step takes 2 positional"),
        (
            {"donate_argnames": "batchh"},
            ValueError,
            r"donate_argnames has \['batchh'\], which "
            r"step has no keyword parameter for",
        ),
        (
            {"static_argnums": 1, "donate_argnames": "scale"},
            ValueError,
            r"\[1, 'scale'\] of step are both static and donated",
        ),
        ({"static_argnums": "1"}, TypeError, "static_argnums must be an int"),
        ({"donate_argnums": True}, TypeError, "donate_argnums must be an int"),
        ({"static_argnames": 3}, TypeError, "static_argnames must be a str"),
    ],
)
def test_bad_argnums(options, error, message):
    with pytest.raises(error, match=message):
        resolve_argnums(step, **options)


def test_split_call_takes_static_values_out_and_sorts_kwargs():
    params, batch = [jnp.ones(2)], {"x": jnp.zeros(3)}
    call = split(
        (params, 2),
        {"lr": 0.5, "batch": batch},
        static_argnums=1,
        static_argnames="lr",
        donate_argnums=0,
    )
    assert call.args == (params,) and list(call.kwargs) == ["batch"]
    assert call.static == ((1, 2), ("lr", 0.5))
    assert call.donated == (True, False)
    assert paths(call.dynamic) == ["args[0][0]", "kwargs['batch']['x']"]
    seen = call.bind(step)((params,), {"batch": batch})
    assert seen == (params, 2, batch, 0.5)  # static values back where the call had them


def test_kwargs_in_any_order_give_one_key():
    a = split((1.0, 2), {"batch": jnp.ones(2), "lr": jnp.ones(())})
    b = split((1.0, 2), {"lr": jnp.ones(()), "batch": jnp.ones(2)})
    assert signature(a) == signature(b)
    assert jax.tree.leaves(a.dynamic)[2].shape == (2,)  # sorted by name: batch before lr


def test_static_values_are_part_of_the_key():
    key = lambda lr: signature(
        split((1.0, 2), {"batch": jnp.ones(2), "lr": lr}, static_argnames="lr")
    )
    assert key(0.1) == key(0.1) and key(0.1) != key(0.2)
    assert len(jax.tree.leaves(key(0.1)[0].unflatten([0, 0, 0]))) == 3  # lr not a leaf


def test_unhashable_static_value_is_refused():
    with pytest.raises(
        TypeError,
        match=r"static argument kwargs\['lr'\] of step is a list, "
        r"which is not hashable.*a tuple, not a list",
    ):
        split((1.0, 2), {"batch": 1.0, "lr": [0.1]}, static_argnames="lr")


def test_static_lines_hide_memory_addresses():
    class Opaque:
        __hash__ = object.__hash__

    call = split((1.0, Opaque()), {"batch": 1.0, "lr": 0.5}, static_argnums=1, static_argnames="lr")
    lines = static_lines(call)
    assert lines[0].startswith("static args[1] = <") and " at 0x" not in lines[0]
    assert lines[1] == "static kwargs['lr'] = 0.5"


def test_donate_argnum_past_the_call():
    nums = resolve_argnums(lambda *a: a, donate_argnums=3)
    with pytest.raises(ValueError, match=r"donate_argnums has \[3\], but step got 2"):
        split_call(nums, (1.0, 2.0), {}, "step")


# ------------------------------------------------------------------ the MPMD axis in specs


@pytest.mark.parametrize(
    "spec, dropped",
    [
        (P("stage", "data"), P(None, "data")),
        (P(("model", "stage")), P("model")),
        (P(None, ("data", "stage", "model")), P(None, ("data", "model"))),
        (P(("stage",)), P(None)),
        (P("data"), P("data")),
    ],
)
def test_mpmd_axis_is_dropped_with_its_meaning(spec, dropped):
    """JaxPP lays values out on a group mesh whose MPMD axis has size 1: naming it
    splits nothing, so dropping it keeps the layout."""
    assert without_axis(spec, "stage") == dropped
    assert spec_entries(spec, "in_shardings", "stage") == tuple(dropped)


def test_mpmd_sharding_drops_the_mpmd_axis():
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((2, 2), ("stage", "data")), "stage")
    assert MpmdSharding(mesh, 0, P("stage", "data")) == MpmdSharding(mesh, 0, P(None, "data"))
    assert MpmdSharding(mesh, 1, P(("data", "stage"))).spec == P("data")


def test_array_over_the_mpmd_axis_is_the_whole_array():
    """An array laid out over the MPMD axis (size 1 on this rank's mesh, as a rank's own
    `jax.jit` makes it) is the whole array, as in JaxPP: its shape keys the step, its
    layout does not."""
    group = jax.make_mesh((1, 2), ("stage", "data"))
    whole = jax.device_put(np.ones((4, 2), np.float32),
                           NamedSharding(group, P(("stage", "data"))))
    plain = np.ones((4, 2), np.float32)
    sig = signature(split((whole, 2), {"batch": 1.0}))
    assert sig[1][0] == ((4, 2), "float32", False, ())
    assert sig == signature(split((plain, 2), {"batch": 1.0}))


# ------------------------------------------------------------------ JaxPP names


def test_mpmd_jit_with_loop_option_errors():
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    jit = jaxpp_mpi.mpmd_jit_with_loop
    with pytest.raises(ValueError, match="both in_shardings and in_specs"):
        jit(step, mesh, in_shardings=P(), in_specs=P())
    with pytest.raises(ValueError, match="both out_shardings and out_specs"):
        jit(step, mesh, out_shardings=P(), out_specs=P())
    with pytest.raises(TypeError, match="needs mpmd_mesh"):
        jit(step)
    with pytest.raises(TypeError, match="compiler_options must be a dict"):
        jit(step, mesh, compiler_options=[("xla_opt", 1)])
    assert jit(step, mesh, in_specs=(P("data"),))._in_shardings == (P("data"),)
    assert isinstance(jit(mpmd_mesh=mesh, static_argnums=1)(step), jaxpp_mpi.MpmdFunction)


def test_interleaved_base_schedule():
    schedules = jaxpp_mpi.schedules
    for cls in (schedules.Interleaved1F1B, schedules.DualPipeV, schedules.KimiK2):
        assert issubclass(cls, schedules.InterleavedBaseSchedule)
    assert not issubclass(schedules.Std1F1B, schedules.InterleavedBaseSchedule)
    with pytest.raises(ValueError, match="not divisible by mpmd_dim=2"):
        schedules.Interleaved1F1B(num_stages=3, mpmd_dim=2)

    class Loop(schedules.InterleavedBaseSchedule):  # a user's schedule, as in JaxPP
        def tasks(self, num_microbatches):
            return schedules.Interleaved1F1B(self.num_stages, self.mpmd_dim).tasks(num_microbatches)

    s = Loop(num_stages=4, mpmd_dim=2)
    assert [s.get_mpmd_idx(i) for i in range(4)] == [0, 1, 0, 1]
    schedules.check_schedule(s, 4)
