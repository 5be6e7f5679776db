"""The one place that touches `jax._src` internals, each use with its reason.

Everything else in jaxpp_mpi uses public JAX (`jax`, `jax.extend`,
`jax.interpreters.*`). When a JAX upgrade breaks something, this module is the
first place to look.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

# Why: `api_util.debug_info` builds the DebugInfo that `lu.wrap_init` needs; the
# public `jax.extend.linear_util.wrap_init` fills in a placeholder and is marked
# deprecated for that use. There is no public constructor for a real one.
from jax._src import api_util as _api_util
from jax.extend import core as jex_core
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

__all__ = ["eqn_source_line", "jax_backends_initialized", "mesh_spec", "persistent_cache_used",
           "register_dce_rule", "split_inputs", "trace_closure_converted"]


def trace_closure_converted(
    flat_fun: Callable[..., Sequence[Any]],
    in_avals: Sequence[jax.core.ShapedArray],
    *,
    name: str,
) -> tuple[jex_core.ClosedJaxpr, list[Any]]:
    """Traces `flat_fun` to a closed jaxpr whose closed-over values are inputs.

    Every value the function closes over (concrete arrays and tracers of an
    enclosing `jax.jit` / `jax.make_jaxpr` / `jax.grad` trace alike) becomes an
    explicit input placed *after* the traced arguments, so the result can be
    bound as a primitive's operand list without leaking tracers.

    Args:
      flat_fun: function of `len(in_avals)` arrays returning a flat sequence of
        arrays.
      in_avals: abstract values of the traced arguments.
      name: name for the debug info (shows in error messages).

    Returns:
      `(closed_jaxpr, consts)`: `closed_jaxpr.jaxpr.invars` is
      `(*args, *closed_over)`, `closed_jaxpr.consts` is empty, and `consts`
      are the closed-over values, in the order of their invars.
    """
    dbg = _api_util.debug_info(name, flat_fun, tuple(in_avals), {})
    wrapped = lu.wrap_init(lambda *args: list(flat_fun(*args)), debug_info=dbg)
    # Why `trace_to_jaxpr_dynamic` (exported by `jax.interpreters.partial_eval`)
    # rather than `jax.closure_convert`: the latter only hoists values that may
    # carry a tangent (float tracers) and leaves integer tracers (token ids,
    # labels) and concrete arrays closed over; we need *every* captured value as
    # an operand so the compiler sees all loop invariants.
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    constvars, argvars = split_inputs(jaxpr, len(consts))
    arg_names = jaxpr.debug_info.arg_names
    if arg_names is not None:  # JAX 0.11 names the leading constvars "" already
        arg_names = (*arg_names[len(arg_names) - len(argvars):], *("",) * len(constvars))
    lifted = jaxpr.replace(
        constvars=[],
        invars=[*argvars, *constvars],
        debug_info=jaxpr.debug_info._replace(arg_names=arg_names),
    )
    return jex_core.ClosedJaxpr(lifted, ()), list(consts)


def split_inputs(jaxpr: jex_core.Jaxpr, num_consts: int) -> tuple[list[Any], list[Any]]:
    """`(constvars, invars)` of `jaxpr` whose first `num_consts` inputs are constants.

    Why: JAX 0.11 merged `ClosedJaxpr` into `Jaxpr`. There a jaxpr's `constvars` are only
    the inputs with values attached: a jaxpr traced or built with constvars but no values
    lists them at the front of `invars` and has no `constvars`, where JAX 0.10 keeps the
    two lists apart. Taking both lists together, constants first, and splitting at the
    number of constant values reads the same on both.
    """
    every = [*jaxpr.constvars, *jaxpr.invars]
    return every[:num_consts], every[num_consts:]


def register_dce_rule(prim: jex_core.Primitive,
                      rule: Callable[[list[bool], jex_core.JaxprEqn], Any]) -> None:
    """Registers `rule(used_outputs, eqn) -> (used_inputs, eqn or None)` as `prim`'s rule
    for JAX's dead-code elimination.

    Why: JAX 0.12 calls DCE rules as `rule(used_outputs, live_inputs, eqn)` (live inputs:
    for Ref-typed operands); 0.10 and 0.11 as `rule(used_outputs, eqn)`.
    """
    pe.dce_rules[prim] = lambda used_outputs, *rest: rule(used_outputs, rest[-1])


def jax_backends_initialized() -> bool:
    """Whether JAX has created its backends (after which device settings are fixed).

    Why `jax._src.xla_bridge`: `backends_are_initialized` is the only way to ask without
    creating the backends; every public device query (`jax.devices()`,
    `jax.extend.backend.get_backend()`) initialises them as a side effect, which would
    defeat `jaxpp_mpi.launch.bind_local_devices`, the caller that needs the answer.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def persistent_cache_used(device: Any) -> bool:
    """Whether compiles for `device`'s backend go through JAX's persistent compilation
    cache (`JAX_COMPILATION_CACHE_DIR`).

    Why `jax._src.compilation_cache`: JAX decides this once per process from several
    settings (directory, enable flag, backend support) and keeps the answer;
    `is_cache_used` is that decision, and the public config alone can disagree with it
    after a setting changes. Falls back to the config where the internals moved.
    """
    try:
        from jax._src import compilation_cache

        return bool(compilation_cache.is_cache_used(device.client))
    except (ImportError, AttributeError):
        return bool(jax.config.jax_enable_compilation_cache
                    and jax.config.jax_compilation_cache_dir)


def mesh_spec(sharding: jax.sharding.Sharding, mesh: jax.sharding.Mesh
              ) -> jax.sharding.PartitionSpec | None:
    """The PartitionSpec over `mesh` that lays a value out as `sharding` does, or None.

    Why `jax._src.sharding_impls`: a compiled executable reports the layouts XLA chose
    for unconstrained results as `GSPMDSharding`s (a device tile assignment) when its
    propagation did not start from a mesh axis name; `parse_flatten_op_sharding` is
    JAX's own reading of such a tile assignment as mesh axes, with no public equivalent.
    """
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.spec
    from jax._src import sharding_impls

    hlo = getattr(sharding, "_hlo_sharding", None)
    if hlo is None:
        return None
    try:
        return sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
    except (NotImplementedError, AssertionError, ValueError):
        return None


def eqn_source_line(eqn: jex_core.JaxprEqn, skip: Sequence[str] = ()) -> str | None:
    """`file:line (function)` of the code that made `eqn`: its innermost frame outside
    JAX, Python's library and the directories in `skip` (e.g. jaxpp_mpi's own); None
    when the eqn recorded no such frame.

    Why `jax._src.source_info_util`: an eqn's `source_info` is a traceback JAX keeps for
    its own error messages; `user_frames` is JAX's filter of its frames (JAX's and the
    standard library's left out), with no public equivalent.
    """
    from jax._src import source_info_util

    try:
        frames = source_info_util.user_frames(eqn.source_info.traceback)
        for frame in frames:
            if not any(frame.file_name.startswith(d) for d in skip):
                return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    except (AttributeError, TypeError, ValueError):
        return None
    return None
