"""The configurations a planner tries: schedule, stages per group, microbatch count.

Pure Python (no JAX): the schedules come from the registry (`Note: schedule
registry`), and a configuration the schedule refuses (`tasks` raising ValueError) is
kept aside with the schedule's own reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpp_mpi._src.schedules.library import (
    SCHEDULES,
    BaseSchedule,
    DualPipeV,
    InterleavedBaseSchedule,
)

__all__ = ["Candidate", "Skipped", "candidates", "microbatch_counts"]

MAX_STAGES_PER_GROUP = 4
"""Interleaved schedules are tried with up to this many stages per group."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to simulate.

    Attributes:
      name: the schedule's registry name ('1f1b', 'zerobubble', ...).
      schedule: the schedule.
      num_microbatches: microbatches per step.
    """

    name: str
    schedule: BaseSchedule
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A configuration not simulated, and why."""

    name: str
    num_stages: int
    num_microbatches: int
    reason: str


def microbatch_counts(rows: int, mpmd_dim: int, limit: int = 64) -> tuple[int, ...]:
    """The microbatch counts worth trying for a batch of `rows` rows: the divisors of
    `rows` from `mpmd_dim` (fewer leave a group without work) up to `limit`."""
    return tuple(n for n in range(mpmd_dim, min(rows, limit) + 1) if rows % n == 0)


def _schedules(name: str, mpmd_dim: int, num_marks: int,
               per_group: Sequence[int]) -> list[BaseSchedule]:
    """The schedules of registry entry `name` for `mpmd_dim` groups, with `per_group`
    stages per group, that a step with `num_marks` stage marks can run (a stage needs at
    least one mark)."""
    cls = SCHEDULES[name]
    fit = [v for v in per_group if v * mpmd_dim <= num_marks]
    if cls is DualPipeV:
        return [DualPipeV(2 * mpmd_dim, mpmd_dim)] if 2 in fit else []
    if issubclass(cls, InterleavedBaseSchedule):
        return [cls(v * mpmd_dim, mpmd_dim) for v in fit if v >= 2]
    return [cls(mpmd_dim)] if 1 in fit else []


def candidates(mpmd_dim: int, num_marks: int, counts: Sequence[int],
               names: Sequence[str] | None = None,
               stages_per_group: Sequence[int] | None = None
               ) -> tuple[list[Candidate], list[Skipped]]:
    """Every (schedule, microbatch count) to simulate for a step.

    Args:
      mpmd_dim: the number of MPMD groups.
      num_marks: the step's stage marks: the most stages it can be split into.
      counts: the microbatch counts to try.
      names: registry names of the schedules to try (None: all of them).
      stages_per_group: the stages per group to try (None: 1 to
        `MAX_STAGES_PER_GROUP`); one-stage schedules need 1, DualPipeV 2, the
        interleaved ones 2 or more.

    Returns:
      The candidates, and the configurations a schedule refuses, with its reason.

    Raises:
      ValueError: an unknown schedule name.
    """
    names = tuple(SCHEDULES) if names is None else tuple(names)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; the names are {', '.join(SCHEDULES)}")
    per_group = (range(1, MAX_STAGES_PER_GROUP + 1) if stages_per_group is None
                 else tuple(stages_per_group))
    out: list[Candidate] = []
    skipped: list[Skipped] = []
    for name in names:
        scheds = _schedules(name, mpmd_dim, num_marks, per_group)
        if not scheds:
            interleaved = issubclass(SCHEDULES[name], InterleavedBaseSchedule)
            need = 2 * mpmd_dim if interleaved else mpmd_dim
            skipped.append(Skipped(name, need, 0, f"needs {need} stage marks (the step has "
                                   f"{num_marks}) and {need // mpmd_dim} stages per group"))
        for sched in scheds:
            for n in counts:
                try:
                    sched.tasks(n)
                except ValueError as e:
                    skipped.append(Skipped(name, sched.num_stages, n, str(e)))
                else:
                    out.append(Candidate(name, sched, n))
    return out, skipped
