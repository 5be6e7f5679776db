"""Homes pass: which group runs each part of the step and holds each of its values.

Note: loop homes.
  Stage s runs on group `schedule.get_mpmd_idx(s)`. Body output k is reduced by its
  *host*, the task that produces it (invariants, literals and the microbatch index:
  the last FWD task), so loop output k lives on the host's group. Loop operand j is
  needed on the groups of the tasks that read it (or host it).

Note: outer homes.
  The loop decides where its values live (`Note: loop homes`). Around the loop:
  - a post-loop eqn with an operand that lives somewhere (a *homed* operand) runs on
    one group: the home of its largest homed operand (ties: the lowest group), so big
    values stay put and small ones (a norm, a loss) move; its results live there.
    A global gradient-norm clip thus sums per-group partial norms on one group and
    sends the scale back to every group's update.
  - any other eqn (pre-loop, or post-loop on step inputs only) is *free*: it runs on
    every group that needs one of its results (replicated compute, no transfer);
  - a step input is owned by one group: the group of the first homed post-loop eqn
    that reads it (so an updated parameter is produced where its input lives and the
    next step needs no reshard), else the lowest group that needs it. Other groups
    that need it receive it from the owner at the start of the step.
  - a step output is held by the group that computes it; a free output (computed from
    step inputs only) is computed on group 0; an input passed through stays on its owner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.extend import core as jex_core

from jaxpp_mpi._src.compiler.split import FWD, SplitBody, TaskKey
from jaxpp_mpi._src.schedules.library import BaseSchedule

__all__ = ["LoopHomes", "OuterHomes", "assign_loop_homes", "assign_outer_homes"]


@dataclasses.dataclass(frozen=True)
class LoopHomes:
    """Where the loop's stages, reductions, operands and results live.

    The result of `assign_loop_homes` (see `Note: loop homes`).

    Attributes:
      stage_group: stage -> group.
      host: per body output, the key of the task that reduces it.
      invariant_groups: per loop operand, the groups whose tasks read it.
      out_groups: per loop output, the group that holds it.
    """

    stage_group: tuple[int, ...]
    host: tuple[TaskKey, ...]
    invariant_groups: tuple[frozenset[int], ...]
    out_groups: tuple[int, ...]


def assign_loop_homes(
    split: SplitBody, schedule: BaseSchedule, num_invariants: int
) -> LoopHomes:
    """Puts the loop's stages, reductions and operands on groups (`Note: loop homes`).

    Args:
      split: the split loop body.
      schedule: the loop's schedule (its `get_mpmd_idx` maps stages to groups).
      num_invariants: the number of loop operands.

    Returns:
      The LoopHomes.
    """
    stage_group = tuple(schedule.get_mpmd_idx(s) for s in range(split.num_stages))
    last_fwd = (FWD, split.num_stages - 1)
    host = tuple(split.value_task[ref[1]] if ref[0] == "val" else last_fwd
                 for ref in split.body_outputs)
    groups: list[set[int]] = [set() for _ in range(num_invariants)]
    for task in split.tasks:
        for ref in task.ins:
            if ref[0] == "inv":
                groups[ref[1]].add(stage_group[task.key[1]])
    for ref, key in zip(split.body_outputs, host):
        if ref[0] == "inv":
            groups[ref[1]].add(stage_group[key[1]])
    out_groups = tuple(stage_group[key[1]] for key in host)
    return LoopHomes(stage_group, host, tuple(frozenset(g) for g in groups), out_groups)


@dataclasses.dataclass(frozen=True)
class OuterHomes:
    """Which groups run the eqns around the loop, own the inputs and hold the outputs.

    The result of `assign_outer_homes` (see `Note: outer homes`).

    Attributes:
      eqn_groups: for each outer eqn index except the loop's, the sorted groups that
        run it (one group for homed eqns; empty for dead eqns).
      input_owner: per flat step input, its owner group (None: unused).
      input_needed: per flat step input, every group that reads it (owner included).
      output_group: per flat step output, the group that holds it.
      homed: the post-loop eqns that run on one group because an operand lives there
        (the others in `eqn_groups` are free: replicated on every group needing them).
    """

    eqn_groups: dict[int, tuple[int, ...]]
    input_owner: tuple[int | None, ...]
    input_needed: tuple[frozenset[int], ...]
    output_group: tuple[int, ...]
    homed: frozenset[int] = frozenset()


def _is_var(x) -> bool:
    return isinstance(x, jex_core.Var) and not isinstance(x, jex_core.Literal)


def _nbytes(v) -> int:
    aval = v.aval
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize  # keys too


def assign_outer_homes(
    jaxpr: jex_core.Jaxpr,
    loop_index: int,
    invariant_groups: Sequence[frozenset[int]],
    loop_out_groups: Sequence[int],
) -> OuterHomes:
    """Puts the eqns around the loop on groups (see `Note: outer homes`).

    Args:
      jaxpr: the step's jaxpr (top level, one loop eqn).
      loop_index: index of the loop eqn in `jaxpr.eqns`.
      invariant_groups: per loop operand, the groups whose tasks read it.
      loop_out_groups: per loop output, the group that produces it.

    Returns:
      The OuterHomes.
    """
    eqns = jaxpr.eqns
    loop = eqns[loop_index]
    home: dict = {v: g for v, g in zip(loop.outvars, loop_out_groups)}
    eqn_home: dict[int, int] = {}
    nbytes: dict = {}  # (shape, dtype) -> `_nbytes` of a var of that aval

    def size(v) -> int:
        aval = v.aval
        n = nbytes.get((aval.shape, aval.dtype))
        if n is None:
            n = nbytes[aval.shape, aval.dtype] = _nbytes(v)
        return n

    for k in range(loop_index + 1, len(eqns)):
        homed = [v for v in eqns[k].invars if _is_var(v) and v in home]
        if not homed:
            continue
        best = max(homed, key=lambda v: (size(v), -home[v]))
        eqn_home[k] = home[best]
        for v in eqns[k].outvars:
            home[v] = home[best]

    needed: dict = {}

    def need(v, groups):
        if _is_var(v) and v not in home:
            needed.setdefault(v, set()).update(groups)

    invars = list(jaxpr.invars)
    position = {v: j for j, v in reversed(list(enumerate(invars)))}  # first positions
    first_reader: dict = {}
    for k in range(loop_index + 1, len(eqns)):
        if k in eqn_home:
            for v in eqns[k].invars:
                if _is_var(v) and v in position:
                    first_reader.setdefault(v, eqn_home[k])
    for v in jaxpr.outvars:
        need(v, {0})
    eqn_groups: dict[int, tuple[int, ...]] = {}
    for k in range(len(eqns) - 1, -1, -1):
        eqn = eqns[k]
        if k == loop_index:
            for v, groups in zip(eqn.invars, invariant_groups):
                need(v, groups)
            continue
        if k in eqn_home:
            groups = {eqn_home[k]}
        else:
            groups = set().union(*(needed.get(v, set()) for v in eqn.outvars))
        eqn_groups[k] = tuple(sorted(groups))
        for v in eqn.invars:
            need(v, groups)

    owners, needs = [], []
    for v in invars:
        groups = frozenset(needed.get(v, ()))
        owner = first_reader.get(v, min(groups) if groups else None)
        needs.append(groups | ({owner} if owner is not None else set()))
        owners.append(owner)
    output_group = []
    for v in jaxpr.outvars:
        if _is_var(v) and v in home:
            output_group.append(home[v])
        elif _is_var(v) and v in position:  # an input passed through stays with its owner
            output_group.append(owners[position[v]])
        else:
            output_group.append(0)
    return OuterHomes(eqn_groups, tuple(owners), tuple(needs), tuple(output_group),
                     frozenset(eqn_home))
