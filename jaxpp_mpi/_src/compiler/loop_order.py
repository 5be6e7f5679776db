"""Loop order: the schedule's order of the loop's stage tasks, per group, as plain data.

Note: back-to-back tasks.
  Where a group's schedule runs a stage's FWD of every microbatch immediately followed
  by that stage's backward (BWD, or BWD_I for a split backward) of the same microbatch,
  and nothing but that backward reads what the FWD makes (the last stage under 1F1B,
  Eager1F1B, Interleaved1F1B and ZeroBubble: its forward ends in the loss), the two run
  as one task, labelled like a fused schedule entry (`F3s1+B3s1`), with one executable
  family (`FB1`; `split.fuse_tasks`). The residuals the backward reads stay inside one
  executable instead of being written out and read back, the group dispatches one call
  per microbatch instead of two, and XLA compiles one module instead of two (the
  forward with its residuals as outputs compiles about as slowly as the whole fused
  forward-backward: `bench/README.md`). The order is the schedule's, unchanged. A pair
  that is back to back for only some microbatches (GPipe's turn) is left apart: fusing
  those would add a third executable to compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.homes import LoopHomes
from jaxpp_mpi._src.compiler.split import SplitBody, TaskJaxpr, TaskKey, fuse_tasks
from jaxpp_mpi._src.schedules.library import BaseSchedule, entry_tasks
from jaxpp_mpi._src.schedules.tasks import TaskType

__all__ = ["LoopOrder", "loop_order"]


def _keys_of(task_type: TaskType, stage: int, partial: bool) -> list[TaskKey]:
    """The split body's task keys that one schedule task of `stage` runs."""
    if task_type is TaskType.BWD and partial:
        return [(TaskType.BWD_I, stage), (TaskType.BWD_W, stage)]
    if task_type in (TaskType.BWD_I, TaskType.BWD_W) and not partial:
        raise CompileError(
            f"the schedule lists a split backward task ({task_type.value} of stage "
            f"{stage}) but says is_partial_bwd=False"
        )
    return [(task_type, stage)]


def _schedule_order(
    split: SplitBody, schedule: BaseSchedule, n: int, stage_group: Sequence[int]
) -> list[list[tuple[TaskKey, int]]]:
    """Per group, the (task key, microbatch) of its non-empty tasks in schedule order."""
    try:
        entries = schedule.tasks(n)
    except ValueError as e:  # ScheduleError is a ValueError
        raise CompileError(f"the schedule rejects {n} microbatches: {e}") from e
    partial = schedule.is_partial_bwd
    seen: dict[TaskKey, set[int]] = {t.key: set() for t in split.tasks}  # microbatches
    order: list[list[tuple[TaskKey, int]]] = []
    for g, group_entries in enumerate(entries):
        mine = []
        for entry in group_entries:
            for task in entry_tasks(entry):
                if stage_group[task.stage_id] != g:
                    raise CompileError(
                        f"{schedule!r} runs task {task} on group {g}, but get_mpmd_idx puts "
                        f"stage {task.stage_id} on group {stage_group[task.stage_id]}"
                    )
                for key in _keys_of(task.type, task.stage_id, partial):
                    runs = seen.get(key)
                    if runs is None:  # an empty task of the split body
                        continue
                    if task.microbatch in runs:
                        raise CompileError(f"{schedule!r} runs task {task} twice")
                    runs.add(task.microbatch)
                    mine.append((key, task.microbatch))
        order.append(mine)
    by_letter = sorted(seen, key=lambda key: (key[0].value, key[1]))
    missing = [(key, m) for key in by_letter for m in range(n) if m not in seen[key]]
    if missing:
        (kind, stage), m = missing[0]
        raise CompileError(
            f"{schedule!r} with {n} microbatches never runs {kind.value} of stage {stage} for "
            f"microbatch {m} ({len(missing)} task(s) missing)"
        )
    return order


def _back_to_back(by_key: Mapping[TaskKey, TaskJaxpr],
                  order: Sequence[Sequence[tuple[TaskKey, int]]],
                  read_by: Mapping[str, set[TaskKey]], stage_group: Sequence[int]
                  ) -> dict[TaskKey, TaskKey]:
    """FWD key -> the backward key it fuses with (`Note: back-to-back tasks`)."""
    pairs = {}
    for g, group_order in enumerate(order):
        for a in dict.fromkeys(key for key, _ in group_order if key[0] is TaskType.FWD):
            b = next(((kind, a[1]) for kind in (TaskType.BWD, TaskType.BWD_I)
                      if (kind, a[1]) in by_key), None)
            if b is None:
                continue
            at = [i for i, (key, _) in enumerate(group_order) if key == a]
            if any(i + 1 == len(group_order) or group_order[i + 1] != (b, group_order[i][1])
                   for i in at):
                continue
            readers = {r for name in by_key[a].outs for r in read_by.get(name, ())}
            if any(stage_group[r[1]] != g for r in readers):
                continue  # another group waits for the forward's values: no delay
            own = set(by_key[a].ins) | {("val", name) for name in by_key[a].outs}
            if any(ref[0] == "val" and ref not in own for ref in by_key[b].ins):
                continue  # the backward would make the forward wait for a message
            pairs[a] = b
    return pairs


@dataclasses.dataclass
class LoopOrder:
    """What the schedule decides of the loop's tasks, as plain data (`loop_order`'s
    result): no task node, no executable.

    Attributes:
      order: per group, the (task key, microbatch) of its tasks in run order; a fused
        pair runs under its forward's key (`Note: back-to-back tasks`).
      by_key: the task jaxpr of each key that runs (a fused pair's under the forward's).
      fused: FWD key -> the backward key fused with it.
      hosted: per key, the body outputs its task reduces (`Note: loop tasks`).
      read_by_tasks: the body values that a task reads from another task.
      runs: per key, its microbatches in run order.
      num_groups: the number of groups.
      num_microbatches: n.
    """

    order: list[list[tuple[TaskKey, int]]]
    by_key: dict[TaskKey, TaskJaxpr]
    fused: dict[TaskKey, TaskKey]
    hosted: dict[TaskKey, list[int]]
    read_by_tasks: set[str]
    runs: dict[TaskKey, list[int]]
    num_groups: int
    num_microbatches: int


def loop_order(split: SplitBody, homes: LoopHomes, schedule: BaseSchedule,
               num_microbatches: int) -> LoopOrder:
    """The schedule's order of the loop tasks, with back-to-back pairs fused (`Note:
    back-to-back tasks`) and each body output on its host task (`Note: loop tasks`).

    Args:
      split: the split body.
      homes: from `assign_loop_homes`.
      schedule: the loop's schedule.
      num_microbatches: n.

    Returns:
      The LoopOrder.

    Raises:
      CompileError: the schedule rejects `num_microbatches`, or does not run every
        task of the split body exactly once on the stage's group.
    """
    order = _schedule_order(split, schedule, num_microbatches, homes.stage_group)
    read_by: dict[str, set[TaskKey]] = {}
    for t in split.tasks:
        for ref in t.ins:
            if ref[0] == "val":
                read_by.setdefault(ref[1], set()).add(t.key)
    hosted: dict[TaskKey, list[int]] = {}
    for k, key in enumerate(homes.host):
        hosted.setdefault(key, []).append(k)
    by_key = {t.key: t for t in split.tasks}
    fused = _back_to_back(by_key, order, read_by, homes.stage_group)
    for a, b in fused.items():  # Note: back-to-back tasks
        keep = {name for name in by_key[a].outs if read_by.get(name, set()) - {b}}
        keep |= {split.body_outputs[k][1] for k in hosted.get(a, [])
                 if split.body_outputs[k][0] == "val"}
        by_key[a] = fuse_tasks(by_key[a], by_key.pop(b), keep)
        hosted[a] = hosted.get(a, []) + hosted.pop(b, [])
    if fused:
        gone = tuple(fused.values())
        order = [[(key, m) for key, m in group_order if key not in gone]
                 for group_order in order]
    read_by_tasks = {ref[1] for t in by_key.values() for ref in t.ins if ref[0] == "val"}
    runs: dict[TaskKey, list[int]] = {}  # microbatches of each key in execution order
    for group_order in order:
        for key, m in group_order:
            runs.setdefault(key, []).append(m)
    return LoopOrder(order, by_key, fused, hosted, read_by_tasks, runs,
                     1 + max(homes.stage_group), num_microbatches)
