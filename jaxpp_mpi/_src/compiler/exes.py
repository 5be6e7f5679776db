"""A group's executables (`Exe`), and how a loop task's `_first` variant is built from its
plain one (`first_from_plain`).

Note: first variants
  A task's `_first` variant computes what its plain variant computes from states that
  hold the identity of each reduction: `Add` -0.0 (IEEE's additive identity: -0.0 + x is
  x for every x, -0.0 and NaN included; 0 for integers), `Max` -inf (the type's minimum
  for integers), `Concat` zeros (every write replaces). So where both variants run on a
  group, the compiler may build the `_first` executable from the plain one and a small
  fill of those identities (`Exe.first_fills`; `group_compiler.py` does it where the layout
  pass has not already compiled both): one fewer task compile per family, the same
  results bit for bit, the program unchanged. An op without a known identity (a user's
  `Op` subclass, `Max` of a type without -inf) keeps its own `_first` executable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.primitives.treduce import Add, Concat, Max, Op

__all__ = ["Exe", "first_fills", "first_from_plain", "first_state", "identity"]


@dataclasses.dataclass(frozen=True)
class Exe:
    """One executable of a group: `fn(*arrays) -> tuple of arrays`.

    Attributes:
      fn: a traceable function of the flat inputs.
      donate_argnums: inputs whose buffers the executable may reuse.
      family: the name shared by the variants of one loop task (`Note: loop tasks`
        in loop_tasks.py); empty outside the loop.
      state_ins / state_outs: per `Add` state of the task whose reduction may be
        deferred (`Note: deferred reduction` in compiler/deferred.py), in the same order
        in every variant of the family: its input / output position, None where this
        variant has none (the first microbatch's takes no state in, the last one's
        returns the loop output).
      first_fills: for a `_first` variant, per state it makes (in output order), the
        identity of its reduction (`Note: first variants`): the family's plain variant
        given states full of these values computes the same. None elsewhere, and where
        some state's op has no known identity.
    """

    fn: Callable[..., tuple]
    donate_argnums: tuple[int, ...] = ()
    family: str = ""
    state_ins: tuple[int | None, ...] = ()
    state_outs: tuple[int | None, ...] = ()
    first_fills: tuple[Any, ...] | None = None


def first_state(op: Op, n: int, v, i):
    """The state a `_first` variant makes of `v`, microbatch `i`'s value (of `n`)."""
    if isinstance(op, Concat):
        aval = op.result_aval(n, jax.core.ShapedArray(jnp.shape(v), jnp.result_type(v)))
        return op.update(jnp.zeros(aval.shape, aval.dtype), v, i)
    return op.state(n, v)


def identity(op: Op, dtype: Any) -> Any | None:
    """The identity of `op`'s reduction for values of `dtype`, as a numpy scalar of
    that dtype (`Note: first variants`), or None where it has none known."""
    dtype = np.dtype(dtype)
    if isinstance(op, Concat):
        return np.zeros((), dtype)[()]
    if isinstance(op, Add):
        if dtype == np.bool_:
            return np.bool_(False)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            return np.array(complex(-0.0, -0.0), dtype)[()]
        return np.array(-0.0 if jnp.issubdtype(dtype, jnp.floating) else 0).astype(dtype)[()]
    if isinstance(op, Max):
        if dtype == np.bool_:
            return np.bool_(False)
        if jnp.issubdtype(dtype, jnp.integer):
            return np.array(jnp.iinfo(dtype).min, dtype)[()]
        if jnp.issubdtype(dtype, jnp.floating):
            low = np.array(-np.inf).astype(dtype)[()]
            return low if np.isneginf(np.float64(low)) else None  # float8_e4m3fn: no inf
    return None


def first_fills(ops: Sequence[Op], avals: Sequence[Aval]) -> tuple[Any, ...] | None:
    """Per state, its op's identity (`identity`); None if some op has none."""
    fills = tuple(identity(op, a.dtype) for op, a in zip(ops, avals))
    return None if any(f is None for f in fills) else fills


def first_from_plain(exes: Mapping[str, Exe],
                     exe_avals: Mapping[str, tuple[tuple[Aval, ...], tuple[Aval, ...]]],
                     name: str) -> tuple[str, Exe] | None:
    """How a group may build executable `name` from another (`Note: first variants`).

    Args:
      exes: the group's executables by name.
      exe_avals: per executable, its (input avals, output avals).
      name: one of them.

    Returns:
      For a `_first` variant whose family's plain variant takes the same inputs plus
      one state per state it makes (donated, of the avals it returns them with) and
      returns the same outputs: the plain variant's name and an `Exe` of no inputs
      returning those states, each full of its reduction's identity. None otherwise.
    """
    exe = exes[name]
    plain = exes.get(exe.family)
    if exe.first_fills is None or plain is None or exe.family == name:
        return None
    (ins, outs), (plain_ins, plain_outs) = exe_avals[name], exe_avals[exe.family]
    fills = exe.first_fills
    states = outs[len(outs) - len(fills):]
    if (plain_outs != outs or plain_ins != (*ins, *states)
            or plain.donate_argnums != tuple(range(len(ins), len(plain_ins)))):
        return None

    def fill() -> tuple:
        return tuple(jnp.full(a.shape, f, np.dtype(a.dtype)) for f, a in zip(fills, states))

    return exe.family, Exe(fill)
