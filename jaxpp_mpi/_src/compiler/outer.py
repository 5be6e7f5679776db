"""Outer pass: the eqns around the loop become per-group segments (one executable each).

Note: outer segments.
  Following the OuterHomes (`Note: outer homes`), group g runs:
  - `pre`: every free eqn that runs on g and that the loop or another `pre` eqn reads
    (a free eqn reads step inputs only, so it can run before the loop), in step order;
  - `post<l>` for l = 0, 1, ...: the homed eqns whose home is g at *level* l. An eqn's
    level is the largest over its operands of the producer's level, plus one when the
    producer is homed on another group (loop outputs and free values: level 0). Every
    cross-group edge rises a level, so the segments of all groups form no cycle: a
    global-norm clip is `post0` on each group (partial sums of squares), `post1` on
    one group (the total, the scale), `post2` on each (the scaled update).
    A free eqn only g's post segments read runs in g's `post0` instead (when g has
    one), in step order among its eqns: the part of an optimizer update that does not
    need the gradients (Adam's moment decays, its bias corrections) then costs no
    executable and no dispatch of its own.
  A value is named per group where it is replicated (free eqns) and once where it is
  homed (see `OuterNames`); a segment exports what another task or the step's result
  reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from jax.extend import core as jex_core

from jaxpp_mpi._src.compiler.exes import Exe
from jaxpp_mpi._src.compiler.homes import OuterHomes
from jaxpp_mpi._src.compiler.jaxpr_util import new_jaxpr
from jaxpp_mpi._src.compiler.keys import key_boundary, replayable
from jaxpp_mpi._src.compiler.task_graph import Value

__all__ = [
    "OuterNames", "Segment", "input_value", "outer_segments", "segment_exe",
    "segment_exports",
]


def _is_var(x) -> bool:
    return isinstance(x, jex_core.Var) and not isinstance(x, (jex_core.Literal, jex_core.DropVar))


def input_value(k: int) -> Value:
    """The value name of flat step input `k` (one value, on its owner)."""
    return f"in{k}"


class OuterNames:
    """Value names of the step's variables.

    A step input k is `in<k>` (one value, on its owner); a variable homed on one group
    (a loop output or a homed eqn's result) is `x<i>`; a variable of a free eqn is
    `x<i>g<g>` on each group g that computes it. Dropped loop outputs are not named.
    """

    def __init__(self, jaxpr: jex_core.Jaxpr, loop_index: int, homes: OuterHomes,
                 loop_out_groups: tuple[int, ...]):
        self.input_index = {v: k for k, v in enumerate(jaxpr.invars)}
        self.ids: dict = {}
        self.home: dict = {}
        self.free_groups: dict = {}
        for k, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                if not _is_var(v):
                    continue
                self.ids[v] = len(self.ids)
                if k == loop_index:
                    self.home[v] = loop_out_groups[eqn.outvars.index(v)]
                elif k in homes.homed:
                    self.home[v] = homes.eqn_groups[k][0]
                else:
                    self.free_groups[v] = frozenset(homes.eqn_groups.get(k, ()))

    def defined(self) -> list:
        """The variables the step's eqns define (in eqn order), each named here."""
        return list(self.ids)

    def groups(self, var) -> list[int]:
        """The groups holding a value of `var`, an eqn's result: its home, or every
        group computing it."""
        return [self.home[var]] if var in self.home else sorted(self.free_groups[var])

    def value(self, var, group: int) -> Value:
        """The name of `var` as group `group` reads it."""
        if var in self.input_index:
            return input_value(self.input_index[var])
        if var in self.home:
            return f"x{self.ids[var]}"
        if group not in self.free_groups[var]:
            raise AssertionError(f"internal: x{self.ids[var]} is not computed on group {group}")
        return f"x{self.ids[var]}g{group}"

    def holder(self, var, output_group: int) -> int:
        """The group holding step output `var`: its home, else `output_group` (the
        group `assign_outer_homes` chose for the output)."""
        return self.home.get(var, output_group)


@dataclasses.dataclass
class Segment:
    """Consecutive outer eqns of one group, run as one executable.

    Attributes:
      group: the group that runs it.
      exe: its executable name (`pre`, `post<level>`).
      eqns: its eqns, in step order.
      in_vars: the variables it reads and does not define, in first-use order.
      ins: their value names on `group`.
      defined: the variables its eqns define.
    """

    group: int
    exe: str
    eqns: list
    in_vars: list
    ins: list[Value]
    defined: list

    @property
    def task_name(self) -> str:
        return f"{self.exe}g{self.group}"


def _segment(group: int, exe: str, eqns: list, names: OuterNames) -> Segment:
    defined, in_vars, seen = [], [], set()
    for eqn in eqns:
        for v in eqn.invars:
            if _is_var(v) and v not in seen:
                seen.add(v)
                in_vars.append(v)
        for v in eqn.outvars:
            if _is_var(v):
                seen.add(v)
                defined.append(v)
    return Segment(group, exe, eqns, in_vars, [names.value(v, group) for v in in_vars], defined)


def outer_segments(
    jaxpr: jex_core.Jaxpr, loop_index: int, homes: OuterHomes, names: OuterNames,
    num_groups: int,
) -> tuple[list[Segment | None], list[list[Segment]]]:
    """Cuts the eqns around the loop into per-group segments (`Note: outer segments`).

    Args:
      jaxpr: the step's jaxpr (top level, one loop eqn).
      loop_index: index of the loop eqn in `jaxpr.eqns`.
      homes: from `assign_outer_homes`.
      names: the value names of the step's variables.
      num_groups: the number of MPMD groups.

    Returns:
      Per group, its `pre` segment (None when it runs no free eqn), and per group its
      `post<l>` segments by ascending level.
    """
    eqns = jaxpr.eqns
    level: dict[int, int] = {}
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars if _is_var(v)}
    by_level: dict[tuple[int, int], list[int]] = {}
    for k in sorted(homes.homed):
        g = homes.eqn_groups[k][0]
        lvl = 0
        for v in eqns[k].invars:
            p = producer.get(v) if _is_var(v) else None
            if p is not None and p in homes.homed:
                lvl = max(lvl, level[p] + (homes.eqn_groups[p][0] != g))
        level[k] = lvl
        by_level.setdefault((g, lvl), []).append(k)
    readers: dict = {}
    for j, e in enumerate(eqns):
        for v in e.invars:
            if _is_var(v):
                readers.setdefault(v, []).append(j)
    free: dict[int, list[int]] = {}  # group -> the free eqns it computes, in step order
    for k in range(len(eqns)):
        if k != loop_index and k not in homes.homed:
            for g in homes.eqn_groups.get(k, ()):
                free.setdefault(g, []).append(k)
    pre: list[Segment | None] = []
    for g in range(num_groups):
        mine = free.get(g, [])
        sunk = _sunk(eqns, mine, g, homes, readers, loop_index) if (g, 0) in by_level else set()
        if sunk:
            by_level[(g, 0)] = sorted(by_level[(g, 0)] + sorted(sunk))
        kept = [eqns[k] for k in mine if k not in sunk]
        pre.append(_segment(g, "pre", kept, names) if kept else None)
    post: list[list[Segment]] = [[] for _ in range(num_groups)]
    for (g, lvl) in sorted(by_level, key=lambda x: (x[1], x[0])):
        post[g].append(_segment(g, f"post{lvl}", [eqns[k] for k in by_level[(g, lvl)]], names))
    return pre, post


def _sunk(eqns: list, free: list[int], g: int, homes: OuterHomes, readers: dict,
          loop_index: int) -> set[int]:
    """The free eqns of group `g` that only its post segments read (`Note: outer
    segments`): not the loop, not a free eqn `g` runs in its `pre` (a step result they
    make is exported by `post0`). Decided last eqn first, so a chain of such eqns sinks
    whole."""
    sunk: set[int] = set()
    for k in reversed(free):
        def stays(j: int) -> bool:
            if j == loop_index:
                return True
            if j in homes.homed:
                return False  # on g: a post segment; elsewhere: it reads its own copy
            return g in homes.eqn_groups.get(j, ()) and j not in sunk
        outs = [v for v in eqns[k].outvars if _is_var(v)]
        if not any(stays(j) for v in outs for j in readers.get(v, ())):
            sunk.add(k)
    return sunk


def segment_exports(seg: Segment, names: OuterNames, read: Collection[Value]) -> list:
    """The variables `seg` defines that some task or the step's result reads.

    Args:
      seg: a segment.
      names: the value names of the step's variables.
      read: every value a task or the step's result reads.

    Returns:
      The variables to export, in definition order.
    """
    return [v for v in seg.defined if names.value(v, seg.group) in read]


def segment_exe(seg: Segment, export: list, donate_argnums: tuple[int, ...] = ()) -> Exe:
    """The executable of `seg`.

    Args:
      seg: a segment.
      export: the variables it returns (from `segment_exports`).
      donate_argnums: which of its inputs it may donate.

    Returns:
      The Exe mapping the values of `seg.in_vars` to those of `export` (keys as their
      key data: `Note: keys as key data`).
    """
    jaxpr = new_jaxpr(seg.in_vars, export, seg.eqns, name=f"{seg.task_name} segment")
    run = key_boundary(jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(replayable(jaxpr), [])),
                       [v.aval for v in seg.in_vars], [v.aval for v in export])

    def fn(*args):
        return tuple(run(*args))

    return Exe(fn, donate_argnums)
