"""Schedule checker and analysis: completeness, dependency order, simulated timeline.

Note: schedule simulation.
  `check_tasks` plays a schedule's task lists as a dataflow list schedule: each group
  runs its entries in order, an entry starts once its group is free and the tasks it
  depends on (`_dependencies`: the pipeline's data dependencies between F, B, I and W of
  neighbouring stages) have ended, plus ``comm_latency`` across groups, and lasts the sum
  of its parts' latencies. It sees tasks only, before anything is compiled: no messages,
  buffers or tags. It is deliberately not the rendezvous player of programs
  (`ir/simulate.py`), which matches the Send/Recv instructions of a lowered `Program`
  rank by rank and checks buffers; that one needs a program, this one judges a schedule
  (also a user's CSV) and gives its timeline, bubbles and peak activations without one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from jaxpp_mpi._src.schedules.library import BaseSchedule
from jaxpp_mpi._src.schedules.tasks import (
    DEFAULT_LATENCIES,
    ScheduleEntry,
    Task,
    TaskType,
    entry_tasks,
)

__all__ = [
    "ScheduleAnalysis",
    "ScheduleError",
    "TimelineEntry",
    "analyze_schedule",
    "check_schedule",
    "check_tasks",
    "describe",
]

# Where(group, position) -> human-readable location of an entry, e.g. "group 1, position 4".
Where = Callable[[int, int], str]


class ScheduleError(ValueError):
    """A schedule is incomplete, runs a task before its inputs exist, or waits forever."""


@dataclass(frozen=True)
class TimelineEntry:
    """One entry of a group's simulated timeline: it runs from ``start`` to ``end``."""

    entry: ScheduleEntry
    start: float
    end: float


@dataclass(frozen=True)
class ScheduleAnalysis:
    """Figures of one simulated run of a schedule; tuples are indexed by MPMD index.

    Attributes:
      makespan: Time at which the last task ends.
      busy: Per group, total time spent running tasks.
      bubble_fraction: Per group, ``1 - busy / makespan`` (idle share of the step).
      peak_activations: Per group, the most microbatch activations alive at once, summed
        over the group's stages (an activation of stage ``s`` lives from the start of
        FWD(s, m) to the end of BWD(s, m), or of BWD_W(s, m) when the backward is split).
      timeline: Per group, its entries with simulated start and end times, in order.
    """

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    peak_activations: tuple[int, ...]
    timeline: tuple[tuple[TimelineEntry, ...], ...]


def describe(task: Task) -> str:
    """Returns a task as error messages name it, e.g. ``BWD_I(stage=2, microbatch=3)``."""
    return f"{task.type.name}(stage={task.stage_id}, microbatch={task.microbatch})"


def _default_where(group: int, position: int) -> str:
    return f"group {group}, position {position}"


def _dependencies(task: Task, num_stages: int, partial_bwd: bool) -> list[Task]:
    """Tasks whose results ``task`` needs."""
    s, m, kind = task.stage_id, task.microbatch, task.type
    if kind is TaskType.FWD:
        return [Task(s - 1, m, TaskType.FWD)] if s > 0 else []
    if kind is TaskType.BWD_W:
        return [Task(s, m, TaskType.BWD_I)]
    deps = [Task(s, m, TaskType.FWD)]
    if s + 1 < num_stages:
        deps.append(Task(s + 1, m, TaskType.BWD_I if partial_bwd else TaskType.BWD))
    return deps


def _inputs(
    entry: ScheduleEntry, num_stages: int, partial_bwd: bool
) -> Iterator[tuple[Task, Task]]:
    """Yields (task, dependency) for the dependencies an entry does not produce itself."""
    parts = entry_tasks(entry)
    for t in parts:
        for dep in _dependencies(t, num_stages, partial_bwd):
            if dep not in parts:
                yield t, dep


def _index_tasks(
    tasks: Sequence[Sequence[ScheduleEntry]],
    num_stages: int,
    num_microbatches: int,
    stage_to_group: Sequence[int],
    partial_bwd: bool,
    name: str,
    where: Where,
) -> dict[Task, tuple[int, int, int]]:
    """Maps each task to (group, entry position, part index); checks each appears once."""
    kinds = (
        (TaskType.FWD, TaskType.BWD_I, TaskType.BWD_W)
        if partial_bwd
        else (TaskType.FWD, TaskType.BWD)
    )
    kind_names = "+".join(k.name for k in kinds)
    located: dict[Task, tuple[int, int, int]] = {}
    for g, row in enumerate(tasks):
        for i, entry in enumerate(row):
            parts = entry_tasks(entry)
            if not parts or not all(isinstance(t, Task) for t in parts):
                raise ScheduleError(
                    f"{name}: {where(g, i)}: {entry!r} is not a Task or a non-empty tuple of Tasks"
                )
            for j, t in enumerate(parts):
                at = f"{name}: {where(g, i)}: {describe(t)}"
                if t.type not in kinds:
                    raise ScheduleError(
                        f"{at}: this schedule's tasks are {kind_names}, so {t.type.name} has "
                        "no place in it (split every backward into BWD_I+BWD_W or none)"
                    )
                if not 0 <= t.stage_id < num_stages:
                    raise ScheduleError(f"{at}: stage is outside 0..{num_stages - 1}")
                if not 0 <= t.microbatch < num_microbatches:
                    raise ScheduleError(f"{at}: microbatch is outside 0..{num_microbatches - 1}")
                if stage_to_group[t.stage_id] != g:
                    raise ScheduleError(
                        f"{at}: stage {t.stage_id} belongs to group "
                        f"{stage_to_group[t.stage_id]}, not to group {g}"
                    )
                if t in located:
                    g0, i0, _ = located[t]
                    raise ScheduleError(f"{at}: appears twice; it already ran at {where(g0, i0)}")
                located[t] = (g, i, j)
    expected = num_stages * num_microbatches * len(kinds)
    if len(located) != expected:  # Only reached when something is missing: stop at the first.
        for s in range(num_stages):
            for m in range(num_microbatches):
                for kind in kinds:
                    if Task(s, m, kind) not in located:
                        raise ScheduleError(
                            f"{name}: {describe(Task(s, m, kind))} is missing; group "
                            f"{stage_to_group[s]} must run it exactly once"
                        )
    return located


def check_tasks(
    tasks: Sequence[Sequence[ScheduleEntry]],
    *,
    num_stages: int,
    num_microbatches: int,
    stage_to_group: Sequence[int],
    partial_bwd: bool,
    name: str = "schedule",
    where: Where | None = None,
    latencies: Mapping[TaskType, float] | None = None,
    comm_latency: float = 0.0,
) -> tuple[tuple[TimelineEntry, ...], ...]:
    """Checks per-group task lists and simulates them (`Note: schedule simulation`).

    Every (stage, microbatch, kind) must appear exactly once, on the group of its stage;
    a task may only run after the tasks it needs (FWD(s, m) after FWD(s-1, m); BWD or BWD_I
    of (s, m) after FWD(s, m) and after the BWD/BWD_I of (s+1, m); BWD_W(s, m) after
    BWD_I(s, m)); and the simulation of all groups together must complete. A fused task
    starts once the group is free and every input it does not produce itself is ready; its
    results are ready when it ends; a result made on another group arrives
    ``comm_latency`` later.

    Args:
      tasks: One ordered entry list per group.
      num_stages: Number of pipeline stages.
      num_microbatches: Number of microbatches the lists are meant for.
      stage_to_group: Group of each stage.
      partial_bwd: Whether backwards are split into BWD_I + BWD_W.
      name: Schedule name used in error messages.
      where: Formats the location of entry (group, position) for error messages.
      latencies: Task durations by kind (defaults: FWD 1, BWD 2, BWD_I 1, BWD_W 1).
      comm_latency: Delay for a result to reach another group.

    Returns:
      Per group, its timeline.

    Raises:
      ScheduleError: naming the offending task, its location and group.
    """
    where = where or _default_where
    lat = _latencies(latencies)
    if comm_latency < 0:
        raise ValueError(f"comm_latency must be >= 0, got {comm_latency}")
    if len(stage_to_group) != num_stages:
        raise ScheduleError(
            f"{name}: stage_to_group has {len(stage_to_group)} entries, "
            f"expected one per stage ({num_stages})"
        )
    located = _index_tasks(
        tasks, num_stages, num_microbatches, stage_to_group, partial_bwd, name, where
    )
    for t, (g, i, j) in located.items():
        for dep in _dependencies(t, num_stages, partial_bwd):
            dg, di, dj = located[dep]
            if dg == g and (di, dj) > (i, j):
                later = "later in the same fused task" if di == i else f"at {where(dg, di)}"
                raise ScheduleError(
                    f"{name}: {where(g, i)}: {describe(t)} runs before {describe(dep)}, "
                    f"which it needs and which group {g} only runs later, {later}"
                )
    return _simulate(tasks, located, num_stages, partial_bwd, lat, comm_latency, name, where)


def _latencies(latencies: Mapping[TaskType, float] | None) -> dict[TaskType, float]:
    lat = dict(DEFAULT_LATENCIES)
    for kind, value in (latencies or {}).items():
        if not isinstance(kind, TaskType):
            raise ValueError(f"latency keys must be TaskType members, got {kind!r}")
        if not value >= 0:
            raise ValueError(f"latency of {kind.name} must be >= 0, got {value!r}")
        lat[kind] = float(value)
    return lat


def _simulate(
    tasks: Sequence[Sequence[ScheduleEntry]],
    located: Mapping[Task, tuple[int, int, int]],
    num_stages: int,
    partial_bwd: bool,
    lat: Mapping[TaskType, float],
    comm_latency: float,
    name: str,
    where: Where,
) -> tuple[tuple[TimelineEntry, ...], ...]:
    """Plays all groups together (`Note: schedule simulation`); raises on a cyclic wait."""
    num_groups = len(tasks)
    pos = [0] * num_groups
    free = [0.0] * num_groups
    done_at: dict[Task, float] = {}
    timeline: list[list[TimelineEntry]] = [[] for _ in range(num_groups)]
    progress = True
    while progress:
        progress = False
        for g in range(num_groups):
            while pos[g] < len(tasks[g]):
                entry = tasks[g][pos[g]]
                start = _start_time(
                    entry, g, free[g], located, done_at, num_stages, partial_bwd, comm_latency
                )
                if start is None:
                    break
                parts = entry_tasks(entry)
                end = start + sum(lat[t.type] for t in parts)
                done_at.update((t, end) for t in parts)
                timeline[g].append(TimelineEntry(entry, start, end))
                free[g] = end
                pos[g] += 1
                progress = True
    if any(pos[g] < len(tasks[g]) for g in range(num_groups)):
        raise ScheduleError(
            f"{name}: the groups wait for each other forever (cyclic wait): "
            + "; ".join(
                _blocked_on(
                    g, tasks[g][pos[g]], pos[g], located, done_at, num_stages, partial_bwd, where
                )
                for g in range(num_groups)
                if pos[g] < len(tasks[g])
            )
        )
    return tuple(tuple(row) for row in timeline)


def _start_time(
    entry: ScheduleEntry,
    g: int,
    free: float,
    located: Mapping[Task, tuple[int, int, int]],
    done_at: Mapping[Task, float],
    num_stages: int,
    partial_bwd: bool,
    comm_latency: float,
) -> float | None:
    """Earliest start of ``entry`` on group ``g``, or None while an input is not ready."""
    start = free
    for _, dep in _inputs(entry, num_stages, partial_bwd):
        if dep not in done_at:
            return None
        delay = comm_latency if located[dep][0] != g else 0.0
        start = max(start, done_at[dep] + delay)
    return start


def _blocked_on(
    g: int,
    entry: ScheduleEntry,
    i: int,
    located: Mapping[Task, tuple[int, int, int]],
    done_at: Mapping[Task, float],
    num_stages: int,
    partial_bwd: bool,
    where: Where,
) -> str:
    for t, dep in _inputs(entry, num_stages, partial_bwd):
        if dep not in done_at:
            dg, di, _ = located[dep]
            return f"{where(g, i)} ({describe(t)}) waits for {describe(dep)} at {where(dg, di)}"
    return f"{where(g, i)} waits"  # pragma: no cover - a blocked entry has a missing input


def _stage_to_group(schedule: BaseSchedule) -> list[int]:
    return [schedule.get_mpmd_idx(s) for s in range(schedule.num_stages)]


def check_schedule(
    schedule: BaseSchedule, num_microbatches: int, *, comm_latency: float = 0.0
) -> None:
    """Checks ``schedule.tasks(num_microbatches)`` (see ``check_tasks`` for the rules).

    Args:
      schedule: The schedule to check.
      num_microbatches: Number of microbatches.
      comm_latency: Delay for a result to reach another group in the simulation.

    Raises:
      ScheduleError: if the task lists are invalid or would wait forever.
      ValueError: if the schedule rejects ``num_microbatches``.
    """
    _run(schedule, num_microbatches, None, comm_latency)


def _run(
    schedule: BaseSchedule,
    n: int,
    latencies: Mapping[TaskType, float] | None,
    comm_latency: float,
) -> tuple[tuple[TimelineEntry, ...], ...]:
    tasks = schedule.tasks(n)
    if len(tasks) != schedule.mpmd_dim:  # type: ignore[attr-defined]
        raise ScheduleError(
            f"{schedule!r}: tasks() returned {len(tasks)} groups, expected mpmd_dim="
            f"{schedule.mpmd_dim}"  # type: ignore[attr-defined]
        )
    return check_tasks(
        tasks,
        num_stages=schedule.num_stages,
        num_microbatches=n,
        stage_to_group=_stage_to_group(schedule),
        partial_bwd=schedule.is_partial_bwd,
        name=repr(schedule),
        latencies=latencies,
        comm_latency=comm_latency,
    )


def analyze_schedule(
    schedule: BaseSchedule,
    num_microbatches: int,
    latencies: Mapping[TaskType, float] | None = None,
    *,
    comm_latency: float = 0.0,
) -> ScheduleAnalysis:
    """Checks and simulates a schedule, and reports makespan, bubbles and memory.

    Args:
      schedule: The schedule to analyse.
      num_microbatches: Number of microbatches.
      latencies: Task durations by kind, merged over FWD=1, BWD=2, BWD_I=1, BWD_W=1;
        a fused task lasts the sum of its parts.
      comm_latency: Delay for a result to reach another group.

    Returns:
      A ``ScheduleAnalysis``.

    Raises:
      ScheduleError: if the schedule is invalid for ``num_microbatches``.
    """
    lat = _latencies(latencies)
    timeline = _run(schedule, num_microbatches, lat, comm_latency)
    makespan = max((row[-1].end for row in timeline if row), default=0.0)
    busy = tuple(sum(e.end - e.start for e in row) for row in timeline)
    bubble = tuple(1.0 - b / makespan if makespan > 0 else 0.0 for b in busy)
    last_bwd = TaskType.BWD_W if schedule.is_partial_bwd else TaskType.BWD
    peaks = []
    for row in timeline:
        events: list[tuple[float, int]] = []
        for e in row:
            t0 = e.start
            for t in entry_tasks(e.entry):
                t1 = t0 + lat[t.type]
                if t.type is TaskType.FWD:
                    events.append((t0, 1))
                elif t.type is last_bwd:
                    events.append((t1, -1))
                t0 = t1
        live = peak = 0
        for _, delta in sorted(events):  # at equal times, frees (-1) come before allocations
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return ScheduleAnalysis(makespan, busy, bubble, tuple(peaks), timeline)
