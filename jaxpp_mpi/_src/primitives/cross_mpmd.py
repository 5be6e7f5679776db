"""`cross_mpmd_all_reduce`, `cross_mpmd_stack`, `place_with`: JaxPP's cross-group
operations, as the plain JAX operations they compute.

Note: cross-group sums.
  `cross_mpmd_all_reduce(a, b, ...)` is `a + b + ...`, added in argument order, after
  JaxPP's check that every operand has the same dtype (and, since the result takes the
  first operand's aval as JaxPP's does, the same shape). No primitive is needed: the
  compiler already places each add and moves its operands between groups.
  - Inside a loop body or an `mpmd_jit_by_yield` function, each add runs in the stage
    task the split pass gives it (`Note: stage assignment`): for forward values, the
    latest stage among its operands; so per-stage partial losses are summed on the last
    stage's group.
  - After the loop, each add runs on the group holding its largest operand, the lowest
    such group on ties (`Note: outer homes`): per-group partial gradient norms are
    summed on the lowest contributing group.
  Every group that reads the sum receives it by a message. Unlike JaxPP, which leaves
  the sum on every contributing group, a sum that is a step result is held by the one
  group that computed it (`MpmdArray.mpmd_idxs`); read it there, or return what each
  group needs from the step.
  Under plain `jax.jit` or eagerly, the same adds run in the same order, so a
  pipelined step's sum equals `jax.jit`'s bit for bit.
  `cross_mpmd_stack(arrays, axis)` is `jnp.stack` on the same terms: a concatenate the
  compiler places like any equation (after the loop: with its largest operand, Note:
  outer homes), its operands moved to it by messages. `place_with(val, with_val)` is
  `val`: JaxPP's primitive is an identity its compiler does not read either; values
  live where the dataflow puts them (Note: stage assignment, Note: outer homes).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cross_mpmd_all_reduce", "cross_mpmd_stack", "place_with"]


def cross_mpmd_all_reduce(*args: Any) -> jax.Array:
    """Sums values that live on different MPMD groups (JaxPP's `cross_mpmd_all_reduce`).

    Call it inside the step (or an `mpmd_jit_by_yield` function), e.g. on each stage's
    partial loss or squared gradient norm; see `Note: cross-group sums` for where the
    sum is computed and held.

    Args:
      *args: one or more arrays (or scalars) of one dtype and one shape.

    Returns:
      `args[0] + args[1] + ...`, added in argument order.

    Raises:
      TypeError: no argument, or arguments of different dtypes.
      ValueError: arguments of different shapes.
    """
    if not args:
        raise TypeError("cross_mpmd_all_reduce needs at least one value to sum")
    arrays = [jnp.asarray(a) for a in args]
    dtypes = [a.dtype for a in arrays]
    if any(d != dtypes[0] for d in dtypes):
        raise TypeError(
            f"cross_mpmd_all_reduce: all arguments must have the same dtype, got "
            f"{[str(d) for d in dtypes]}; cast them first (e.g. x.astype(jnp.float32))"
        )
    shapes = [a.shape for a in arrays]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            f"cross_mpmd_all_reduce: all arguments must have the same shape, got {shapes}; "
            "the sum has the shape of each operand (reduce or broadcast them first)"
        )
    return functools.reduce(operator.add, arrays)


def cross_mpmd_stack(arrays: Any, axis: int = 0) -> jax.Array:
    """Stacks values that live on different MPMD groups (JaxPP's `cross_mpmd_stack`).

    Call it inside the step, e.g. on each stage's partial loss; see `Note: cross-group
    sums` for where the result is computed and held.

    Args:
      arrays: a non-empty sequence of arrays (or scalars) of one dtype and one shape.
      axis: where the new axis goes in the result, as for `jnp.stack`.

    Returns:
      `jnp.stack(arrays, axis)`.

    Raises:
      TypeError: no array, or arrays of different dtypes.
      ValueError: arrays of different shapes, or `axis` out of range.
    """
    arrays = [jnp.asarray(a) for a in arrays]
    if not arrays:
        raise TypeError("cross_mpmd_stack needs at least one value to stack")
    dtypes = [a.dtype for a in arrays]
    if any(d != dtypes[0] for d in dtypes):
        raise TypeError(
            f"cross_mpmd_stack: all arrays must have the same dtype, got "
            f"{[str(d) for d in dtypes]}; cast them first (e.g. x.astype(jnp.float32))")
    shapes = [a.shape for a in arrays]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"cross_mpmd_stack: all arrays must have the same shape, got "
                         f"{shapes}")
    ndim = arrays[0].ndim + 1
    if not -ndim <= axis < ndim:
        raise ValueError(f"cross_mpmd_stack: axis {axis} is out of range for the "
                         f"{ndim}-dimensional result")
    return jnp.stack(arrays, axis=axis)


def place_with(val: Any, with_val: Any) -> Any:
    """JaxPP's placement hint `place_with(val, with_val)`: returns `val` (see `Note:
    cross-group sums`; the compiler places values by their dataflow).

    Args:
      val: the value.
      with_val: the value JaxPP's hint names; not read.

    Returns:
      `val`.
    """
    del with_val
    return val
