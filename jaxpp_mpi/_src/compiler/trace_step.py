"""Trace pass: the user's step becomes one flat jaxpr holding exactly one treduce loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.compat import split_inputs
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.inline import inline_calls
from jaxpp_mpi._src.compiler.jaxpr_util import new_jaxpr
from jaxpp_mpi._src.compiler.retarget import retarget_jaxpr, trace_mesh
from jaxpp_mpi._src.primitives.treduce import find_treduce_eqns, nested_treduce_errors

if TYPE_CHECKING:
    from jaxpp_mpi._src.arrays.mesh import MpmdMesh

__all__ = ["TracedStep", "trace_step"]


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """The step as one jaxpr (the result of `trace_step`).

    Attributes:
      jaxpr: the step with every call inlined and its constants turned into leading
        invars: invars = (*constants, *flat arguments).
      consts: the constant values, one per leading invar.
      loop_index: the index of the one `treduce_p` eqn in `jaxpr.eqns`.
      out_tree: the pytree structure of the step's result.
    """

    jaxpr: jex_core.Jaxpr
    consts: tuple[Any, ...]
    loop_index: int
    out_tree: jax.tree_util.PyTreeDef

    @property
    def loop(self) -> jex_core.JaxprEqn:
        return self.jaxpr.eqns[self.loop_index]


def _traced(fun: Callable, args: Sequence[Any], mesh: MpmdMesh | None,
            what: str) -> tuple[jex_core.ClosedJaxpr, Any]:
    """`jax.make_jaxpr(fun, return_shape=True)(*args)`, under `mesh` when given, with its
    shardings retargeted to a group's mesh (see Note: sharding constraints)."""
    if mesh is None:
        return jax.make_jaxpr(fun, return_shape=True)(*args)
    try:
        with jax.sharding.use_abstract_mesh(trace_mesh(mesh.jax_mesh)):
            closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    except ValueError as e:
        if "only refer to Auto axes" not in str(e):
            raise
        raise CompileError(
            f"{what} calls with_sharding_constraint with a NamedSharding naming an "
            "Explicit mesh axis, which JAX rejects; jaxpp_mpi traces the step under the "
            "mesh with every axis Auto, so pass a bare PartitionSpec instead "
            "(with_sharding_constraint(x, P('data'))), or build the mesh with "
            f"axis_types=(AxisType.Auto, ...) (JAX said: {e})"
        ) from e
    jaxpr = retarget_jaxpr(closed.jaxpr, mesh.jax_mesh, mesh.mpmd_axis_name)
    if jaxpr is not closed.jaxpr:
        closed = jex_core.ClosedJaxpr(jaxpr, closed.consts)
    return closed, out_shape


def trace_step(fun: Callable, args: Sequence[Any], *, what: str = "the step",
               mesh: MpmdMesh | None = None) -> TracedStep:
    """Traces `fun(*args)` and checks it holds one top-level treduce.

    Args:
      fun: the user's step.
      args: the arguments; leaves may be `jax.ShapeDtypeStruct`s.
      what: the function's name for messages.
      mesh: the mesh the step is pipelined over: when given, the step is traced under
        it and its sharding constraints are retargeted to a group's mesh (Note:
        sharding constraints in retarget.py); without it, traced with no mesh.

    Returns:
      The TracedStep.

    Raises:
      CompileError: no treduce, several, or one that cannot be reached (inside lax
        control flow); a sharding constraint no group can apply (see `retarget_jaxpr`).
      TypeError: a result that is not an array (from `jax.make_jaxpr`).
    """
    closed, out_shape = _traced(fun, args, mesh, what)
    jaxpr = inline_calls(closed.jaxpr)
    nested = nested_treduce_errors(jaxpr)
    if nested:
        raise CompileError(f"{what}: " + "; ".join(nested))
    loops = find_treduce_eqns(jaxpr)
    if not loops:
        raise CompileError(
            f"{what} calls no treduce: mpmd_jit_with_loop pipelines the microbatch loop "
            "of a training step, so the function must call jaxpp_mpi.treduce (or "
            "treduce_i) exactly once, e.g. treduce(partial(jax.value_and_grad(loss), "
            "params), batch, schedule=Std1F1B(mesh.mpmd_dim))"
        )
    if len(loops) > 1:
        raise CompileError(
            f"{what} calls treduce {len(loops)} times; mpmd_jit_with_loop pipelines one "
            "microbatch loop per step: merge the loops into one treduce (return every "
            "value from one body), or compile each loop as its own step"
        )
    index, loop = loops[0]
    # Literal loop operands (scalars JAX inlined) become constants like any other, so
    # that every loop operand is a variable the homes pass can put on groups.
    consts, loop_invars = list(closed.consts), []
    constvars, invars = split_inputs(jaxpr, len(consts))
    for x in loop.invars:
        if isinstance(x, jex_core.Literal):
            v = jex_core.Var(x.aval)
            consts.append(x.val)
            constvars.append(v)
            x = v
        loop_invars.append(x)
    eqns = list(jaxpr.eqns)
    eqns[index] = loop.replace(invars=loop_invars)
    flat = new_jaxpr([*constvars, *invars], jaxpr.outvars, eqns, name="step")
    _, out_tree = jax.tree.flatten(out_shape)
    return TracedStep(flat, tuple(consts), index, out_tree)
