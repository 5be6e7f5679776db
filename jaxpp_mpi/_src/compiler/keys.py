"""PRNG keys at the boundary of an executable: key data outside, keys inside.

Note: keys as key data.
  The program holds plain arrays only: a value of a typed PRNG key dtype (`key<fry>[4]`)
  is, everywhere outside an executable, its key data (`jax.random.key_data`: for
  threefry `uint32[4,2]`), and its Aval is that of the key data (`aval_of`). Each
  executable whose jaxpr reads or returns keys is wrapped by `key_boundary`: it takes
  key data, rewraps it (`jax.random.wrap_key_data` with the key's implementation) and
  returns key data. So messages, the layout pass, the local and MPI executors and the
  wire format see uint32 arrays and need nothing of their own; a key crossing a stage
  boundary is a message of its key data, and the rewrapped key is the same key (same
  bits, same implementation), so what it draws is identical. The step's own key
  arguments and results cross the same boundary in `MpmdCompiled` (key data in, keys
  rewrapped out), and key constants are stored as key data (`build_step`). Inside an
  executable, the eqns of a jaxpr with keys are re-made without the trace's mesh
  (`replayable`: JAX's PRNG primitives refuse to mix it with the group's). A program
  without keys, and its executables, are unchanged. (The alternative, a key dtype in
  `Aval`, would make every runtime, the wire format and the layout pass handle keys,
  for no gain: keys are opaque bits between executables.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Spec
from jaxpp_mpi._src.compiler.inline import inline_calls
from jaxpp_mpi._src.ir.program import Aval

__all__ = ["aval_of", "is_key", "key_boundary", "key_impl", "key_struct", "replayable"]


def is_key(dtype) -> bool:
    """Whether `dtype` is a typed PRNG key dtype (`key<fry>`, ...)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def key_impl(dtype) -> str:
    """The name of the PRNG implementation of key dtype `dtype` ('threefry2x32', ...),
    as `jax.random.wrap_key_data` takes it."""
    found: list = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)),
                   jax.ShapeDtypeStruct((), dtype))
    return str(found[0])


@functools.cache
def _key_data_struct(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))


@functools.cache
def key_struct(data_shape: tuple[int, ...], impl: str) -> jax.ShapeDtypeStruct:
    """The shape and key dtype of the keys whose uint32 key data has `data_shape`."""
    wrap = functools.partial(jax.random.wrap_key_data, impl=impl)
    return jax.eval_shape(wrap, jax.ShapeDtypeStruct(data_shape, np.uint32))


def aval_of(aval, spec: Spec = ()) -> Aval:
    """The program Aval of a JAX aval; a key's is that of its key data
    (`Note: keys as key data`).

    Args:
      aval: a JAX aval (anything with `shape` and `dtype`).
      spec: its in-group spec entries, given separately.

    Returns:
      The Aval.

    Raises:
      CompileError: `aval` has an extended dtype that is not a PRNG key.
    """
    shape, dtype, spec = tuple(aval.shape), aval.dtype, tuple(spec)
    try:
        return _aval_cached(shape, dtype, spec)
    except TypeError:  # an unhashable part: made afresh (never in a traced step)
        return _aval(shape, dtype, spec)


def _aval(shape: tuple, dtype, spec: tuple) -> Aval:
    """`aval_of`'s Aval of `shape`, `dtype` and `spec`."""
    if is_key(dtype):
        data = _key_data_struct(shape, dtype)
        shape, dtype = tuple(data.shape), data.dtype
    elif jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise CompileError(f"a value of the step has dtype {dtype}; jaxpp_mpi moves arrays "
                           "of numpy dtypes and typed PRNG keys only")
    return Aval(shape, np.dtype(dtype).name, spec)


# A step has thousands of values of a few dozen avals, and a dtype's name takes
# microseconds to find: each distinct Aval (frozen, so shared) is made once.
_aval_cached = functools.lru_cache(maxsize=4096)(_aval)


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _literal_without_mesh(x):
    if not isinstance(x, jex_core.Literal):
        return x
    aval = jax.core.ShapedArray(x.aval.shape, x.aval.dtype, weak_type=x.aval.weak_type)
    return jex_core.Literal(np.asarray(x.val), aval)


def _touches_key(eqns: Sequence[jex_core.JaxprEqn]) -> bool:
    """Whether one of `eqns` reads or makes a key (each distinct dtype asked once)."""
    return any(map(is_key, {v.aval.dtype for e in eqns for v in (*e.invars, *e.outvars)}))


def replayable(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """`jaxpr`, ready to be re-run inside a group's executable.

    The step is traced under the whole mesh (`Note: sharding constraints`): every eqn
    records that mesh as its context, and literals carry it in their avals, while an
    executable's inputs carry the group's mesh. JAX's standard primitives ignore the mix
    under `Auto` axes (a result may take either mesh), but the PRNG primitives and their
    lowerings check it (`random_fold_in(key, 1)` raises 'Mesh for all inputs should be
    equal'). So in a jaxpr with a top-level eqn that touches a key, every top-level eqn
    is re-made with no mesh in its context (its threefry setting kept) and its literals
    as plain numpy values, calls (`jax.jit`, `closed_call`, remat) inlined first so
    their eqns are re-made too; a jaxpr without keys is left as it is.

    Args:
      jaxpr: a task's or a segment's jaxpr.

    Returns:
      `jaxpr` itself when no top-level eqn touches a key, else the re-made copy.
    """
    if not _touches_key(jaxpr.eqns):
        return jaxpr
    # A call's results take their avals from its jaxpr, traced under the whole mesh (a
    # value made by `jnp.where`'s jit would carry that mesh into a PRNG primitive):
    # inlined, every eqn is bound again here.
    jaxpr = inline_calls(jaxpr)
    eqns = []
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        for e in jaxpr.eqns:
            with jax.threefry_partitionable(e.ctx.threefry_partitionable):
                eqns.append(jex_core.new_jaxpr_eqn(
                    [_literal_without_mesh(x) for x in e.invars], e.outvars, e.primitive,
                    e.params, e.effects, e.source_info))
    return jaxpr.replace(eqns=eqns)


def key_boundary(fn: Callable, in_avals: Sequence, out_avals: Sequence) -> Callable:
    """`fn` taking and returning key data where its avals are keys (`Note: keys as key
    data`).

    Args:
      fn: a function of arrays returning a sequence of arrays.
      in_avals: the JAX avals of its first inputs (later inputs pass through as they
        are); out_avals: those of its results.

    Returns:
      `fn` itself when no aval is a key, else the wrapped function (returning a list).
    """
    impls = [key_impl(a.dtype) if is_key(a.dtype) else None for a in in_avals]
    out_keys = [is_key(a.dtype) for a in out_avals]
    if not any(impls) and not any(out_keys):
        return fn

    def keyed(*args):
        args = [a if impl is None else jax.random.wrap_key_data(a, impl=impl)
                for a, impl in zip(args, impls)] + list(args[len(impls):])
        outs = fn(*args)
        return [jax.random.key_data(o) if k else o for o, k in zip(outs, out_keys)]

    return keyed
