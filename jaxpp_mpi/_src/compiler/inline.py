"""Inline passes: call-like eqns are flattened into their caller.

A user model wrapped in `jax.jit` (or `jax.checkpoint`) puts its stage marks inside a
`pjit` (or `remat`) eqn; the split pass needs every mark at the top level of the loop
body (`inline_marked_calls`; call eqns without marks stay whole, opaque units of one
task). Around the loop, an optimizer or a whole step wrapped in `jax.jit` would be one
eqn placed on one group; `inline_calls` flattens every call so each leaf's update is
placed with its own operands (and a treduce inside a jitted helper becomes top-level).
"""

from __future__ import annotations

from jax.extend import core as jex_core

from jaxpp_mpi._src.base.compat import split_inputs
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.jaxpr_util import new_jaxpr
from jaxpp_mpi._src.primitives.stage_marks import stage_end_p

# primitive name -> param holding the called jaxpr
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr", "remat": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}
_OPAQUE = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "scan", "while",
           "cond")


class InlineError(CompileError):
    """A stage mark sits where the compiler cannot reach it."""


def _has_mark(jaxpr: jex_core.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_end_p:
            return True
        for sub in jex_core.jaxprs_in_params(eqn.params):
            if _has_mark(sub.jaxpr if isinstance(sub, jex_core.ClosedJaxpr) else sub):
                return True
    return False


def inline_marked_calls(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """Returns `jaxpr` with every call eqn that (transitively) holds a mark inlined.

    Args:
      jaxpr: a loop body.

    Returns:
      An equivalent jaxpr (same invars and outvars) whose marks are all top-level.

    Raises:
      InlineError: a mark inside control flow or a custom_jvp/custom_vjp function.
    """
    if not any(
        _has_mark(s.jaxpr if isinstance(s, jex_core.ClosedJaxpr) else s)
        for e in jaxpr.eqns for s in jex_core.jaxprs_in_params(e.params)
    ):
        return jaxpr
    return _inlined(jaxpr, everything=False, name="inlined body")


def inline_calls(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """Returns `jaxpr` with every call eqn (`jax.jit`, `closed_call`, remat) inlined,
    recursively; control flow and custom-derivative eqns stay whole.

    Args:
      jaxpr: a traced step (the code around the loop).

    Returns:
      An equivalent jaxpr with the same invars, constvars and outvars.
    """
    if not any(e.primitive.name in _CALLS for e in jaxpr.eqns):
        return jaxpr
    return _inlined(jaxpr, everything=True, name="inlined step")


def _inlined(jaxpr: jex_core.Jaxpr, *, everything: bool, name: str) -> jex_core.Jaxpr:
    env: dict = {}
    eqns: list = []
    _inline_into(jaxpr, env, eqns, everything=everything)
    outvars = [_read(env, v) for v in jaxpr.outvars]
    return new_jaxpr(jaxpr.invars, outvars, eqns, name=name, constvars=jaxpr.constvars)


def _read(env: dict, atom):
    if isinstance(atom, jex_core.Literal):
        return atom
    return env.get(atom, atom)


def _inline_into(jaxpr: jex_core.Jaxpr, env: dict, out: list, *, everything: bool) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        subs = list(jex_core.jaxprs_in_params(eqn.params))
        marked = [s for s in subs
                  if _has_mark(s.jaxpr if isinstance(s, jex_core.ClosedJaxpr) else s)]
        if (marked or everything) and name in _CALLS:
            sub = eqn.params[_CALLS[name]]
            closed = sub if isinstance(sub, jex_core.ClosedJaxpr) else None
            inner = closed.jaxpr if closed else sub
            inner_env: dict = {}
            consts = closed.consts if closed else []
            constvars, invars = split_inputs(inner, len(consts))
            for v, a in zip(invars, eqn.invars):
                inner_env[v] = _read(env, a)
            for v, c in zip(constvars, consts):
                inner_env[v] = jex_core.Literal(c, v.aval)
            # Fresh vars for the callee's eqns: the same jaxpr may be inlined twice.
            for inner_eqn in inner.eqns:
                for v in inner_eqn.outvars:
                    if not isinstance(v, jex_core.DropVar):
                        inner_env[v] = jex_core.Var(v.aval)
            _inline_into(_renamed(inner, inner_env), env, out, everything=everything)
            for v, a in zip(eqn.outvars, inner.outvars):
                env[v] = _read(env, _read(inner_env, a))
        elif marked and not everything:
            raise InlineError(
                f"a stage mark (mark_stage_end) is inside a `{name}` "
                f"({'control flow' if name in _OPAQUE else 'primitive'}); marks must be in "
                "straight-line code of the loop body (plain calls and jax.jit are fine)"
            )
        else:
            out.append(eqn.replace(invars=[_read(env, v) for v in eqn.invars]))


def _renamed(jaxpr: jex_core.Jaxpr, env: dict) -> jex_core.Jaxpr:
    """The callee with its vars renamed by `env` (invars/constvars become the caller's
    atoms, so the returned jaxpr is only used for its eqns)."""
    eqns = [
        e.replace(
            invars=[_read(env, v) for v in e.invars],
            outvars=[v if isinstance(v, jex_core.DropVar) else env[v] for v in e.outvars],
        )
        for e in jaxpr.eqns
    ]
    return new_jaxpr([], [], eqns, name="inlined call")
