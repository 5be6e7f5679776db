"""Placement pass: which groups run the step's pre- and post-loop eqns, own its inputs
and hold its outputs.

Note: outer placement.
  The loop decides where its values live: loop output k lives on the group of the task
  that produces body output k; loop invariant j is needed on the groups of the tasks
  that use it. Around the loop:
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


@dataclasses.dataclass(frozen=True)
class OuterPlan:
    """Result of `place_outer`.

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
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def place_outer(
    jaxpr: jex_core.Jaxpr,
    loop_index: int,
    invariant_groups: Sequence[frozenset[int]],
    loop_out_groups: Sequence[int],
) -> OuterPlan:
    """Places the eqns around the loop (see Note: outer placement).

    Args:
      jaxpr: the step's jaxpr (top level, one loop eqn).
      loop_index: index of the loop eqn in `jaxpr.eqns`.
      invariant_groups: per loop operand, the groups whose tasks read it.
      loop_out_groups: per loop output, the group that produces it.

    Returns:
      The OuterPlan.
    """
    eqns = jaxpr.eqns
    loop = eqns[loop_index]
    home: dict = {v: g for v, g in zip(loop.outvars, loop_out_groups)}
    eqn_home: dict[int, int] = {}
    for k in range(loop_index + 1, len(eqns)):
        homed = [v for v in eqns[k].invars if _is_var(v) and v in home]
        if not homed:
            continue
        best = max(homed, key=lambda v: (_nbytes(v), -home[v]))
        eqn_home[k] = home[best]
        for v in eqns[k].outvars:
            home[v] = home[best]

    needed: dict = {}

    def need(v, groups):
        if _is_var(v) and v not in home:
            needed.setdefault(v, set()).update(groups)

    invars = list(jaxpr.invars)
    first_reader: dict = {}
    for k in range(loop_index + 1, len(eqns)):
        if k in eqn_home:
            for v in eqns[k].invars:
                if _is_var(v) and v in invars:
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
        elif _is_var(v) and v in invars:  # an input passed through stays with its owner
            output_group.append(owners[invars.index(v)])
        else:
            output_group.append(0)
    return OuterPlan(eqn_groups, tuple(owners), tuple(needs), tuple(output_group),
                     frozenset(eqn_home))
