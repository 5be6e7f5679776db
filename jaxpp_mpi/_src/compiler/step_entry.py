"""A step's entry: the lowered task graph with what the runtimes need beside it, and
its key and read-back in the program cache (`Note: program cache` in
compiler/program_cache.py). build.py calls these once the segments' tasks are known.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler import fingerprint
from jaxpp_mpi._src.compiler.exes import Exe
from jaxpp_mpi._src.compiler.internal_errors import internal_error
from jaxpp_mpi._src.compiler.loop_order import LoopOrder
from jaxpp_mpi._src.compiler.loop_tasks import LoopTasks
from jaxpp_mpi._src.compiler.outer import input_value
from jaxpp_mpi._src.compiler.program_cache import (
    ExeAvals,
    ProgramCache,
    StepEntry,
    lower_cached,
)
from jaxpp_mpi._src.compiler.split import SplitBody
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value, ValueNames
from jaxpp_mpi._src.ir.program import Aval

if TYPE_CHECKING:
    from jax.extend import core as jex_core

    from jaxpp_mpi._src.arrays.mesh import MpmdMesh

__all__ = ["cached_entry", "key_parts", "lowered_entry"]

logger = logging.getLogger("jaxpp_mpi")


class _Inputs(NamedTuple):
    """The step's inputs: user inputs on their owners, then microbatch indexes."""

    bindings: list[tuple[Value, int, int]]  # (value, owner group, flat input index)
    avals: list[Aval]  # per flat input
    owner: list[int | None]  # per flat input
    mb_inputs: list[tuple[int, int, int]]  # (flat input index, group, microbatch)


def _step_inputs(
    input_owner: Sequence[int | None], input_avals: Sequence[Aval],
    mb_values: dict[tuple[int, int], Value], avals: dict[Value, Aval],
    names: ValueNames,
) -> _Inputs:
    """Binds the step's inputs: constants and arguments on their owners, then one
    microbatch index per (microbatch, group) that a task reads, by group (each a value
    of `names`)."""
    bindings = [(names.intern(input_value(k)), g, k) for k, g in enumerate(input_owner)
                if g is not None]
    out = _Inputs(bindings, list(input_avals), list(input_owner), [])
    for (m, g), v in sorted(mb_values.items(), key=lambda x: (x[0][1], x[0][0])):
        k = len(out.avals)
        out.bindings.append((v, g, k))
        out.avals.append(avals[v])
        out.owner.append(g)
        out.mb_inputs.append((k, g, m))
    return out


def _exe_avals(tasks: Sequence[Sequence[TaskNode]], avals: dict[Value, Aval]
               ) -> tuple[dict[str, ExeAvals], ...]:
    """Per group, executable name -> (input avals, output avals) of its first run."""
    out: list[dict[str, ExeAvals]] = [{} for _ in tasks]
    for group_tasks, exe_avals in zip(tasks, out):
        for t in group_tasks:
            if t.exe not in exe_avals:
                exe_avals[t.exe] = (tuple(avals[v] for v in t.ins),
                                    tuple(avals[v] for v in t.outs))
    return tuple(out)


def _check_task_times(graph: TaskGraph, task_times_ms: Mapping[str, float], what: str) -> None:
    """Refuses measured task times that name none of the step's tasks (times of another
    step or schedule would otherwise silently order this one by their kind means)."""
    labels = {part for ts in graph.tasks for t in ts for part in (t.name, *t.name.split("+"))}
    if not labels & set(task_times_ms):
        mine = sorted(label for label in labels if label[:1] in "FBIW")[:4]
        raise CompileError(
            f"{what}: task_times_ms names none of its tasks (it has {', '.join(mine)}, ...; "
            f"got {', '.join(sorted(task_times_ms)[:4])}, ...): pass times collected from "
            "this step with collect_task_times_ms")


def _split_text(split: SplitBody) -> str:
    """What the split decided, as the loop tasks see it: each stage task's inputs and
    exported values with their avals (which residuals cross, which are recomputed), and
    what each body output is."""
    avals = split.value_avals
    tasks = [(t.key[0].value, t.key[1], t.ins, [(v, str(avals[v])) for v in t.outs])
             for t in split.tasks]
    return repr((split.num_stages, tasks, split.body_outputs))


def key_parts(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], split: SplitBody,
              schedule: Any, lo: LoopOrder, num_groups: int, options: Any,
              num_replicas: int, replica_dims: Sequence[int | None] | None, defer: bool,
              mesh: MpmdMesh | None) -> list[str]:
    """What a step entry's key covers besides the task times and the sends (`Note:
    program cache` in compiler/program_cache.py): the traced step's text (`Note: step
    fingerprints`: `fingerprint.jaxpr_text`), the split's stage tasks, the schedule and
    the order it gives the tasks, and the options."""
    step = fingerprint.jaxpr_text(jaxpr, consts)
    order = ";".join(" ".join(f"{kind.value}{stage}.{m}" for (kind, stage), m in group)
                     for group in lo.order)
    fused = sorted((a[0].value, a[1], b[0].value, b[1]) for a, b in lo.fused.items())
    where = None if mesh is None else (dict(mesh.jax_mesh.shape), mesh.mpmd_axis_name,
                                       mesh.group_shape, mesh.replica_axis_name)
    return [jax.__version__, step, _split_text(split), repr(schedule),
            type(schedule).__qualname__, order,
            repr(fused), repr((num_groups, options, num_replicas, replica_dims, defer)),
            repr(where)]


def cached_entry(cache: ProgramCache | None, key: str | None,
                 exes: Sequence[Mapping[str, Exe]], input_avals: Sequence[Aval]
                 ) -> tuple[StepEntry | None, float | None]:
    """The step entry under `key` and the seconds reading it took, or (None, None).

    An entry whose executables or user inputs are not this plan's (a stale or foreign
    entry that passed its checks) is not used: the plan is built, and its entry
    replaces it.
    """
    if cache is None or key is None:
        return None, None
    start = time.perf_counter()
    entry = cache.load_step(key)
    if entry is None:
        return None, None
    if (entry.program.num_groups != len(exes)
            or [set(e) for e in entry.exe_avals] != [set(e) for e in exes]
            or entry.input_avals[:len(input_avals)] != tuple(input_avals)):
        logger.warning("program cache: ignoring %s (another step's executables or "
                       "inputs); building again", cache.path(key))
        return None, None
    return entry, time.perf_counter() - start


def _with_loop_tasks(tasks: Sequence[TaskNode], stand_in: TaskNode,
                     loop_tasks: Sequence[TaskNode], names: ValueNames) -> list[TaskNode]:
    """A group's tasks with its loop's stand-in replaced by its loop tasks, the
    others' value names made values of `names` (the loop tasks' are already)."""
    k = next(k for k, t in enumerate(tasks) if t is stand_in)
    return [*_interned(tasks[:k], names), *loop_tasks, *_interned(tasks[k + 1:], names)]


def _interned(tasks: Sequence[TaskNode], names: ValueNames) -> list[TaskNode]:
    """`tasks` with their value names made values of `names` (`Note: dense values`)."""
    intern = names.intern
    return [TaskNode(t.name, t.group, t.exe, [intern(v) for v in t.ins],
                     [intern(v) for v in t.outs], [intern(v) for v in t.donate])
            for t in tasks]


def lowered_entry(
    nodes: LoopTasks, tasks: Sequence[Sequence[TaskNode]], stand_ins: Sequence[TaskNode],
    input_avals: Sequence[Aval], avals: dict[Value, Aval], input_owner: Sequence[int | None],
    output_values: Sequence[tuple[Value, int]], *, what: str, split: SplitBody,
    task_times_ms: Mapping[str, float] | None, sends: str, cache: ProgramCache | None,
) -> tuple[StepEntry, bool]:
    """The task graph, lowered (through `cache`'s program entries), as a step entry.

    Args:
      nodes: from `loop_task_nodes`; its `avals` gain every other value's.
      tasks: per group, its tasks with its loop's stand-in (`stand_ins[g]`).
      input_avals: per flat user input, its aval; avals: every value's, but the loop
        tasks'.
      input_owner, output_values: the step's inputs' owners, and its outputs'
        (value, flat result index) pairs.
      what, split, task_times_ms, sends, cache: as `build.build_step`'s.

    Returns:
      The entry, and whether its program came from a program entry.
    """
    # Every value as an int of `names` (`Note: dense values` in task_graph.py): the
    # loop tasks' are; the segments', the step's inputs' and outputs' become ones here.
    names = nodes.names
    intern = names.intern
    tasks = [_with_loop_tasks(ts, s, lt, names)
             for ts, s, lt in zip(tasks, stand_ins, nodes.tasks)]
    # the values of the loop tasks first, as they make them; their dict takes the others
    # (one dict of every value fewer alive while lowering: 13 MB at 257k instructions)
    loop_avals = nodes.avals
    loop_avals.update((intern(v), a) for v, a in avals.items())
    avals = loop_avals
    inputs = _step_inputs(input_owner, input_avals, nodes.mb_values, avals, names)
    graph = TaskGraph(len(tasks), tasks, inputs.bindings,
                      [(intern(v), k) for v, k in output_values], avals, names)
    if task_times_ms:
        _check_task_times(graph, task_times_ms, what)
    try:
        program, buffer_names, from_cache = lower_cached(graph, task_times_ms, sends, cache)
    except ValueError as e:  # a failed internal check: a bug of the compiler
        raise internal_error(what, e, split) from e
    return StepEntry(program, buffer_names, _exe_avals(tasks, avals), tuple(inputs.avals),
                     tuple(inputs.owner), tuple(inputs.mb_inputs)), from_cache
