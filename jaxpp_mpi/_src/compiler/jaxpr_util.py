"""Small helpers for building jaxprs in compiler passes (public jax.extend API only)."""

from __future__ import annotations

from collections.abc import Sequence

from jax.extend import core as jex_core


def new_jaxpr(
    invars: Sequence, outvars: Sequence, eqns: Sequence, *, name: str,
    constvars: Sequence = (),
) -> jex_core.Jaxpr:
    """A Jaxpr over the given vars and eqns, with its effects and a DebugInfo.

    JAX deprecates jaxprs without a DebugInfo.

    Args:
      invars: the jaxpr's inputs.
      outvars: its outputs (variables or literals).
      eqns: its equations, in order.
      name: a name that shows in JAX's error messages about it.
      constvars: its constant inputs.

    Returns:
      The Jaxpr; its effects are the union of the eqns'.
    """
    effects = set()
    for e in eqns:
        effects |= set(e.effects)
    debug = jex_core.DebugInfo(
        traced_for=f"jaxpp_mpi {name}",
        func_src_info=None,
        arg_names=("",) * len(invars),
        result_paths=("",) * len(outvars),
    )
    return jex_core.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns),
                          effects, debug_info=debug)
