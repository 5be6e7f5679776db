"""`mpmd_jit_by_yield`: a function with stage marks and no loop, run once through its stages.

Note: by_yield as a one-microbatch loop.
  `mpmd_jit_by_yield(fun, mesh)` is `mpmd_jit_with_loop` of a step that runs `fun` as
  the body of a one-microbatch `treduce_i`, so the loop compiler is the only compiler:
  - the step traces `fun` once (`jax.make_jaxpr` of its traced arguments, inside the
    step's own trace, so under the same mesh; other arguments, such as static ones, are
    constants), checks the jaxpr (stage marks present, their count equal to
    `target_num_stages` when given and at least `mpmd_dim`, no `treduce`), and replays
    it as the loop body;
  - the schedule is `StagesInOrder(S, mpmd_dim)`: stage `s` runs on group
    `s % mpmd_dim` (as Interleaved1F1B places stages), each group runs its stages'
    forwards in stage order, then, for a function that takes gradients inside, their
    backwards in reverse;
  - every result is reduced with `Add`; over one microbatch that is `Op.state`, the
    value itself, so the step returns `fun`'s results, each an `MpmdArray` on the group
    of the stage that computes it (`Note: loop homes`).
  The split pass cuts the body at the marks like any loop body (`Note: stage
  assignment`): what follows the last mark runs in the last stage, and a value that
  only reads arguments (a weight transform) runs in the stage that uses it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.inline import inline_marked_calls
from jaxpp_mpi._src.frontend.api import MpmdFunction, mpmd_jit_with_loop
from jaxpp_mpi._src.primitives.stage_marks import is_stage_end
from jaxpp_mpi._src.primitives.treduce import (
    Add,
    find_treduce_eqns,
    nested_treduce_errors,
    treduce_i,
)
from jaxpp_mpi._src.schedules.library import BaseSchedule, check_positive
from jaxpp_mpi._src.schedules.tasks import ScheduleTasks, Task, TaskType

__all__ = ["StagesInOrder", "mpmd_jit_by_yield"]


@dataclasses.dataclass(frozen=True)
class StagesInOrder(BaseSchedule):
    """Each group runs its stages' forwards in stage order, then their backwards in
    reverse; stage `s` runs on group `s % mpmd_dim` (`Note: by_yield as a
    one-microbatch loop`).

    With one microbatch this is the whole pipeline: stage 0's forward on group 0, its
    result sent to stage 1 on group 1, and so on.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_positive(name, "mpmd_dim", self.mpmd_dim, "pass the number of MPMD groups")
        if self.num_stages < self.mpmd_dim:
            raise ValueError(
                f"{name}: num_stages={self.num_stages} is less than mpmd_dim="
                f"{self.mpmd_dim}; every group must run at least one stage"
            )

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        microbatches = range(num_microbatches)
        out = []
        for r in range(self.mpmd_dim):
            stages = range(r, self.num_stages, self.mpmd_dim)
            out.append(
                [Task(s, m, TaskType.FWD) for s in stages for m in microbatches]
                + [Task(s, m, TaskType.BWD) for s in reversed(stages) for m in microbatches]
            )
        return out


def _num_stages(jaxpr: jex_core.Jaxpr, target: int | None, mpmd_dim: int, what: str) -> int:
    """The number of stages `fun`'s stage marks make, checked (`Note: by_yield as a
    one-microbatch loop`).

    Raises:
      CompileError: a treduce in `fun`, no marks, a count other than `target`, or fewer
        stages than groups.
      InlineError: a mark inside control flow or a custom-derivative function.
    """
    if find_treduce_eqns(jaxpr) or nested_treduce_errors(jaxpr):
        raise CompileError(
            f"{what} calls treduce, but mpmd_jit_by_yield runs the function once through "
            "its stages, with no microbatch loop: compile a step with a treduce loop by "
            "mpmd_jit_with_loop, or drop the treduce and mark the stages directly"
        )
    marks = sum(is_stage_end(e, "fwd") for e in inline_marked_calls(jaxpr).eqns)
    if marks == 0:
        raise CompileError(
            f"{what} has no stage marks, so mpmd_jit_by_yield cannot cut it into "
            "stages: end every stage with jaxpp_mpi.mark_stage_end (the last stage "
            "too, e.g. on the output), x = mark_stage_end(x)"
        )
    if target is not None and marks != target:
        raise CompileError(
            f"{what} has {marks} stage marks (mark_stage_end calls) but target_num_stages="
            f"{target}: mark the end of every stage, the last one included, or pass "
            f"target_num_stages={marks}"
        )
    if marks < mpmd_dim:
        raise CompileError(
            f"{what} has {marks} stage(s), fewer than the mesh's {mpmd_dim} MPMD groups; "
            f"stage s runs on group s % {mpmd_dim}, so mark at least {mpmd_dim} stages "
            "(a multiple of it keeps the groups balanced), or use a mesh with fewer groups"
        )
    return marks


def _one_microbatch_step(fun: Callable, target: int | None, mpmd_dim: int) -> Callable:
    """The step that runs `fun` as a one-microbatch loop (`Note: by_yield as a
    one-microbatch loop`)."""
    what = getattr(fun, "__name__", "the function")

    @functools.wraps(fun)
    def step(*args: Any, **kwargs: Any) -> Any:
        # The traced arguments are `fun`'s inputs; anything else (a static argument, a
        # concrete array) is a constant of the traced jaxpr.
        leaves, in_tree = jax.tree.flatten((args, kwargs))
        traced = [k for k, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]

        def flat_fun(*inputs: Any) -> Any:
            flat = list(leaves)
            for k, x in zip(traced, inputs):
                flat[k] = x
            a, kw = jax.tree.unflatten(in_tree, flat)
            return fun(*a, **kw)

        inputs = [leaves[k] for k in traced]
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*inputs)
        num_stages = _num_stages(closed.jaxpr, target, mpmd_dim, what)
        out_tree = jax.tree.structure(out_shape)
        if out_tree.num_leaves == 0:
            raise CompileError(f"{what} returns no arrays; return the values to compute")
        run = jex_core.jaxpr_as_fun(closed)

        def body(microbatch_idx: jax.Array) -> Any:
            del microbatch_idx
            return jax.tree.unflatten(out_tree, run(*inputs))

        return treduce_i(body, 1, StagesInOrder(num_stages, mpmd_dim), operation=Add)

    return step


def mpmd_jit_by_yield(
    fun: Callable | None = None,
    mpmd_mesh: MpmdMesh | None = None,
    *,
    target_num_stages: int | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Sequence[int] = (),
    **jit_kwargs: Any,
) -> MpmdFunction | Callable[[Callable], MpmdFunction]:
    """Pipelines a function with no microbatch loop: one pass through its stages.

    The function marks the end of every stage with `mark_stage_end` (the last one
    included); stage `s` runs on group `s % mpmd_dim` and the whole function runs once,
    as one microbatch (`Note: by_yield as a one-microbatch loop`). The usual use is
    inference or evaluation (forward only); a function that takes gradients inside
    runs its backward stages too. Results are `MpmdArray`s on the groups of the stages
    that compute them, equal to `jax.jit(fun)`'s.

    Args:
      fun: the function; it calls no `treduce`.
      mpmd_mesh: the mesh.
      target_num_stages: None, or the number of stages `fun` must mark (checked).
      in_shardings: as for `mpmd_jit_with_loop`.
      out_shardings: as for `mpmd_jit_with_loop`.
      donate_argnums: as for `mpmd_jit_with_loop`.
      **jit_kwargs: passed to `mpmd_jit_with_loop` as they are.

    Returns:
      An `MpmdFunction` (used as a decorator without `fun`, the decorator). Calling it,
      or its `.compile`, raises `CompileError` when `fun` has no stage marks, a count
      other than `target_num_stages`, fewer stages than MPMD groups, or a `treduce`.

    Raises:
      TypeError: `mpmd_mesh` is missing or not an `MpmdMesh`.
      ValueError: `target_num_stages` is not a positive int.
    """
    if fun is None:
        return functools.partial(
            mpmd_jit_by_yield,
            mpmd_mesh=mpmd_mesh,
            target_num_stages=target_num_stages,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=donate_argnums,
            **jit_kwargs,
        )
    if not isinstance(mpmd_mesh, MpmdMesh):
        raise TypeError(
            f"mpmd_jit_by_yield needs mpmd_mesh, an MpmdMesh; got {type(mpmd_mesh).__name__}"
        )
    if target_num_stages is not None:
        check_positive(
            "mpmd_jit_by_yield",
            "target_num_stages",
            target_num_stages,
            "pass the number of stages fun marks, or None to count them",
        )
    step = _one_microbatch_step(fun, target_num_stages, mpmd_mesh.mpmd_dim)
    return mpmd_jit_with_loop(
        step,
        mpmd_mesh=mpmd_mesh,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=donate_argnums,
        **jit_kwargs,
    )
