"""Restaging a step: another schedule, and some of its stage marks, with no edit to it.

Note: restaging.
  A planned step runs the user's own step function with two things changed, both on
  its traced jaxpr rather than in its code: the `schedule` parameter of its one
  `treduce_p` eqn (`Note: treduce_p params`) is replaced, and of the loop body's M
  forward stage marks (`Note: stage marks`) only the kept ones stay, with their
  backward partners (the k-th backward mark from the end belongs to stage k, so the
  mark pair of candidate boundary k is the k-th forward mark and the (M-1-k)-th
  backward one in body order). A dropped mark becomes the identity: its outputs are
  its operands. The S kept marks, in order, end the S stages of the new schedule, so
  a model marked after every layer can be split into any number of stages up to M, at
  any boundaries. `restage(step, schedule, stage_marks)` returns a function that traces
  `step`, rewrites the jaxpr and evaluates it in the caller's trace: passed to
  `mpmd_jit_with_loop` (or `jax.jit`) it is the planned step.

  The microbatch count is the leading dimension of the batch `treduce` slices, so a
  plan with another count takes the batch reshaped (`microbatched`): the same rows,
  `num_microbatches` microbatches of `rows / num_microbatches`. The step must compute
  what it means for any count (a loss averaged over microbatches, not summed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.inline import inline_marked_calls
from jaxpp_mpi._src.compiler.jaxpr_util import new_jaxpr
from jaxpp_mpi._src.primitives.stage_marks import is_stage_end
from jaxpp_mpi._src.primitives.treduce import find_treduce_eqns

__all__ = ["count_marks", "keep_marks", "loop_eqn", "microbatched", "restage",
           "restage_jaxpr"]


def loop_eqn(jaxpr: jex_core.Jaxpr) -> tuple[int, jex_core.JaxprEqn]:
    """The index and eqn of the one top-level `treduce_p` eqn of a traced step.

    Raises:
      CompileError: the step has no top-level treduce, or more than one.
    """
    loops = find_treduce_eqns(jaxpr)
    if len(loops) != 1:
        raise CompileError(f"a planned step calls treduce once at its top level; this one "
                           f"has {len(loops)} top-level treduce calls")
    return loops[0]


def count_marks(body: jex_core.ClosedJaxpr) -> int:
    """The number of forward stage marks of a loop body (its calls inlined)."""
    return sum(is_stage_end(e, "fwd") for e in inline_marked_calls(body.jaxpr).eqns)


def keep_marks(body: jex_core.ClosedJaxpr, keep: Sequence[int]) -> jex_core.ClosedJaxpr:
    """The loop body with only the forward marks `keep` and their backward partners
    (`Note: restaging`).

    Args:
      body: a `treduce_p` body.
      keep: the indexes, in forward order, of the marks that stay.

    Returns:
      An equivalent body whose forward marks are the kept ones.

    Raises:
      ValueError: `keep` names a mark the body does not have.
    """
    jaxpr = inline_marked_calls(body.jaxpr)
    fwd = [k for k, e in enumerate(jaxpr.eqns) if is_stage_end(e, "fwd")]
    bwd = [k for k, e in enumerate(jaxpr.eqns) if is_stage_end(e, "bwd")]
    kept = set(keep)
    if not kept <= set(range(len(fwd))):
        raise ValueError(f"stage marks {sorted(kept - set(range(len(fwd))))} do not exist: "
                         f"the loop body has {len(fwd)} marks (0..{len(fwd) - 1})")
    last = len(fwd) - 1
    dropped = {k for s, k in enumerate(fwd) if s not in kept}
    dropped |= {k for j, k in enumerate(bwd) if last - j not in kept}
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom if isinstance(atom, jex_core.Literal) else env.get(atom, atom)

    eqns = []
    for k, eqn in enumerate(jaxpr.eqns):
        invars = [read(v) for v in eqn.invars]
        if k in dropped:  # the identity: its results are its operands
            for out, x in zip(eqn.outvars, invars):
                if not isinstance(out, jex_core.DropVar):
                    env[out] = x
        else:
            eqns.append(eqn.replace(invars=invars))
    out = new_jaxpr(jaxpr.invars, [read(v) for v in jaxpr.outvars], eqns,
                    name="restaged body", constvars=jaxpr.constvars)
    return jex_core.ClosedJaxpr(out, body.consts)


def restage_jaxpr(closed: jex_core.ClosedJaxpr, schedule: Any = None,
                  stage_marks: Sequence[int] | None = None) -> jex_core.ClosedJaxpr:
    """A traced step with its loop's schedule and stage marks replaced (`Note: restaging`).

    Args:
      closed: the traced step.
      schedule: the loop's new schedule (None: unchanged).
      stage_marks: the marks that stay (None: all of them).

    Returns:
      The rewritten step.
    """
    index, loop = loop_eqn(closed.jaxpr)
    params = dict(loop.params)
    if schedule is not None:
        params["schedule"] = schedule
    if stage_marks is not None:
        params["body"] = keep_marks(params["body"], stage_marks)
    eqns = list(closed.jaxpr.eqns)
    eqns[index] = loop.replace(params=params)
    return jex_core.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)


def restage(step: Callable, schedule: Any = None,
            stage_marks: Sequence[int] | None = None) -> Callable:
    """`step` with its loop's schedule and stage marks replaced (`Note: restaging`).

    Args:
      step: a training step calling `treduce` once (its arguments arrays only: bind
        static ones first, e.g. with `functools.partial`).
      schedule: the schedule to run (None: the step's own).
      stage_marks: the indexes of the step's `mark_stage_end` calls (in forward order)
        that end a stage; the others are dropped (None: all of them).

    Returns:
      A function with `step`'s signature, for `mpmd_jit_with_loop` or `jax.jit`.
    """
    keep = None if stage_marks is None else tuple(stage_marks)

    @functools.wraps(step)
    def restaged(*args: Any, **kwargs: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(lambda a, k: step(*a, **k), return_shape=True)(
            args, kwargs)
        closed = restage_jaxpr(closed, schedule, keep)
        outs = jex_core.jaxpr_as_fun(closed)(*jax.tree.leaves((args, kwargs)))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return restaged


def microbatched(batch: Any, num_microbatches: int) -> Any:
    """`batch` (leaves of shape (microbatches, rows, ...)) as `num_microbatches`
    microbatches of the same rows (`Note: restaging`); `jax.ShapeDtypeStruct` leaves
    give `jax.ShapeDtypeStruct`s.

    Raises:
      ValueError: a leaf has fewer than two dimensions, or `num_microbatches` does not
        divide its rows.
    """

    def split(path: Any, x: Any) -> Any:
        shape = tuple(np.shape(x))
        if len(shape) < 2:
            raise ValueError(f"batch leaf {jax.tree_util.keystr(path)} of shape {shape} has "
                             "no row dimension to share out over other microbatch counts")
        rows = shape[0] * shape[1]
        if rows % num_microbatches:
            raise ValueError(f"{num_microbatches} microbatches do not divide the {rows} rows "
                             f"of batch leaf {jax.tree_util.keystr(path)}")
        new = (num_microbatches, rows // num_microbatches, *shape[2:])
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(new, x.dtype, weak_type=x.weak_type)
        return x.reshape(new)

    return jax.tree_util.tree_map_with_path(split, batch)
