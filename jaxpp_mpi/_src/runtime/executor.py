"""What the local and MPI executors share: buffer slots, step closures, dispatch, timing.

Note: executor steps.
  An executor turns its program into a flat list of *steps* once, in its constructor;
  a step is a closure `step(table, times) -> None` over precomputed slot indexes. `table`
  is the buffer table of one `run`: a list indexed by slot (a group's buffer id plus the
  group's offset, see `BufferLayout`), holding arrays or None. `times` is the dict of the
  active `collect_task_times_ms` block or None. Instructions become steps through a
  dispatch table keyed by instruction type (`bind_steps`); Run and Free binders live
  here, and the AllReduce binder of a single replica (the identity); the message
  binders, and the AllReduce binder across replicas, in each executor. Every Run with
  a task label gets two steps, an untimed one and a timed one (see `Note: task timing`
  in timing.py); the executor picks the whole list once per `run`, so untimed steps
  never block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from jaxpp_mpi._src.ir.program import AllReduce, Aval, Free, GroupProgram, Run
from jaxpp_mpi._src.timeline.timing import TaskTimes, TraceEvent, active_task_times

__all__ = [
    "BufferLayout",
    "Step",
    "StepBinder",
    "StepLists",
    "bind_allreduce_identity",
    "bind_free",
    "bind_run",
    "bind_steps",
    "execute",
    "timed_message",
    "wall_ns",
    "InputBinder",
    "OutputCollector",
]

Table = list[Any]
Step = Callable[[Table, "TaskTimes | None"], None]
Executable = Callable[..., Sequence[jax.Array]]
ShardingFn = Callable[[int, Aval], jax.sharding.Sharding]
# A binder turns (group, op) into (untimed step, timed step).
StepBinder = Callable[[int, Any], tuple[Step, Step]]


class BufferLayout:
    """Maps (group, buffer id) to a slot of one flat buffer table.

    Args:
      groups: the group programs laid out one after another.
    """

    def __init__(self, groups: Sequence[GroupProgram]):
        self.offsets: dict[int, int] = {}
        size = 0
        for g in groups:
            self.offsets[g.mpmd_idx] = size
            size += 1 + max((b for b, _ in g.avals), default=-1)
        self.size = size

    def slot(self, group: int, buf: int) -> int:
        """The table slot of buffer `buf` of group `group`."""
        return self.offsets[group] + buf

    def new_table(self) -> Table:
        """An empty buffer table (every slot None)."""
        return [None] * self.size


class StepLists:
    """The untimed and the timed step lists of one executor."""

    def __init__(self, pairs: Iterable[tuple[Step, Step]]):
        pairs = list(pairs)
        self.untimed: tuple[Step, ...] = tuple(p[0] for p in pairs)
        self.timed: tuple[Step, ...] = tuple(p[1] for p in pairs)


def wall_ns(start: int, end: int) -> tuple[int, int]:
    """`perf_counter_ns` readings `start`, `end` (just taken) as wall-clock ns."""
    offset = time.time_ns() - time.perf_counter_ns()
    return start + offset, end + offset


def timed_message(step: Step, group: int, name: str, args: dict[str, Any],
                  wait: Callable[[], None]) -> Step:
    """`step` (a message step) timed as a `TraceEvent` when events are recorded; `wait()`
    returns once the message's MPI calls have finished.

    The message's wait is not part of any task's time, so only the event list sees it.
    """

    def timed(table: Table, times: TaskTimes | None) -> None:
        events = times.events  # type: ignore[union-attr]
        if events is None:
            step(table, times)
            return
        start = time.perf_counter_ns()
        step(table, times)
        wait()
        end = time.perf_counter_ns()
        events.append(TraceEvent(name, "message", group, *wall_ns(start, end), args))

    return timed


def execute(steps: StepLists, table: Table) -> None:
    """Runs every step on `table`, timed iff a `collect_task_times_ms` block is active."""
    times = active_task_times()
    for step in steps.untimed if times is None else steps.timed:
        step(table, times)


def bind_steps(ops: Iterable[tuple[int, Any]], binders: Mapping[type, StepBinder]) -> StepLists:
    """Turns (group, op) pairs into steps through the dispatch table `binders`.

    Raises:
      TypeError: if an op's type has no binder.
    """
    pairs = []
    for group, op in ops:
        binder = binders.get(type(op))
        if binder is None:
            raise TypeError(f"group {group}: this executor cannot run {op!r}")
        pairs.append(binder(group, op))
    return StepLists(pairs)


def bind_run(
    layout: BufferLayout,
    executables: Sequence[Mapping[str, Executable]],
) -> StepBinder:
    """The binder of Run: call the executable, drop donated inputs, store outputs.

    Args:
      layout: the buffer layout.
      executables: `executables[g][name]` is group g's executable `name`.

    Returns:
      A binder raising ValueError (at bind time) for an unknown executable name.
    """

    def bind(group: int, instr: Run) -> tuple[Step, Step]:
        exe = executables[group].get(instr.exe)
        if exe is None:
            known = ", ".join(sorted(executables[group])) or "none"
            raise ValueError(
                f"group {group}: no executable {instr.exe!r} for `{instr}` (known: {known})"
            )
        ins = tuple(layout.slot(group, b) for b in instr.ins)
        outs = tuple(layout.slot(group, b) for b in instr.outs)
        donate = tuple(layout.slot(group, b) for b in instr.donate)
        n_outs, where = len(outs), f"group {group} `{instr}`"

        def store(table: Table, results: Sequence[Any]) -> None:
            if len(results) != n_outs:
                raise ValueError(f"{where}: executable returned {len(results)} values")
            for s in donate:
                table[s] = None
            for s, x in zip(outs, results):
                table[s] = x

        def run(table: Table, times: TaskTimes | None) -> None:
            store(table, exe(*[table[s] for s in ins]))

        if not instr.task:
            return run, run
        label = instr.task

        def timed_run(table: Table, times: TaskTimes | None) -> None:
            args = [table[s] for s in ins]
            jax.block_until_ready(args)
            start = time.perf_counter_ns()
            results = jax.block_until_ready(exe(*args))
            end = time.perf_counter_ns()
            times.setdefault(label, []).append((end - start) * 1e-6)  # type: ignore[union-attr]
            events = times.events  # type: ignore[union-attr]
            if events is not None:
                events.append(TraceEvent(label, "task", group, *wall_ns(start, end)))
            store(table, results)

        return run, timed_run

    return bind


def bind_free(layout: BufferLayout) -> StepBinder:
    """The binder of Free: drop the table's references to the freed buffers."""

    def bind(group: int, instr: Free) -> tuple[Step, Step]:
        slots = tuple(layout.slot(group, b) for b in instr.bufs)

        def free(table: Table, times: TaskTimes | None) -> None:
            for s in slots:
                table[s] = None

        return free, free

    return bind


def bind_allreduce_identity() -> StepBinder:
    """The binder of AllReduce when this executor runs one replica: a step that does
    nothing (combining a value over one replica leaves it as it is, in place)."""

    def bind(group: int, instr: AllReduce) -> tuple[Step, Step]:
        def identity(table: Table, times: TaskTimes | None) -> None:
            pass

        return identity, identity

    return bind


def _placed(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


class InputBinder:
    """Binds the flat step inputs to the groups' input buffers.

    An input already a `jax.Array` with exactly the wanted sharding is used as is;
    anything else (a NumPy array, an array elsewhere) is `jax.device_put` to
    `shardings(g, aval)`. An input used by several groups is placed on each.

    Args:
      layout: the buffer layout.
      groups: the group programs whose inputs to bind.
      shardings: `shardings(g, aval)` is the sharding of a value of group g.
      num_inputs: the length of the flat input list.
    """

    def __init__(
        self,
        layout: BufferLayout,
        groups: Sequence[GroupProgram],
        shardings: ShardingFn,
        num_inputs: int,
    ):
        self.num_inputs = num_inputs
        self._binds = tuple(
            (layout.slot(g.mpmd_idx, b), k, shardings(g.mpmd_idx, g.aval(b)), g.mpmd_idx)
            for g in groups
            for b, k in g.inputs
        )

    def __call__(self, table: Table, step_inputs: Sequence[Any]) -> None:
        """Places `step_inputs` into `table`.

        Raises:
          ValueError: on a wrong number of inputs, or a None input that a group uses.
        """
        if len(step_inputs) != self.num_inputs:
            raise ValueError(f"expected {self.num_inputs} step inputs, got {len(step_inputs)}")
        for slot, k, sharding, group in self._binds:
            x = step_inputs[k]
            if x is None:
                raise ValueError(f"step input {k} is None but group {group} uses it")
            table[slot] = _placed(x, sharding)


class OutputCollector:
    """Reads the flat step outputs from a finished buffer table.

    Args:
      layout: the buffer layout.
      groups: the group programs whose outputs to read.
      num_outputs: the length of the flat output list.
    """

    def __init__(self, layout: BufferLayout, groups: Sequence[GroupProgram], num_outputs: int):
        self.num_outputs = num_outputs
        self._reads = tuple(
            (k, g.mpmd_idx, layout.slot(g.mpmd_idx, b), b)
            for g in groups
            for b, k in g.outputs
        )

    def __call__(self, table: Table) -> list[dict[int, Any]]:
        """Per flat output index, {group: array} for every group holding that output.

        Raises:
          ValueError: if an output buffer is not live at the end.
        """
        out: list[dict[int, Any]] = [{} for _ in range(self.num_outputs)]
        for k, group, slot, buf in self._reads:
            x = table[slot]
            if x is None:
                raise ValueError(f"group {group}: output {k} (%{buf}) is not live at the end")
            out[k][group] = x
        return out
