"""A group's outer segments become tasks: what each exports, and which step inputs it donates.

`build_step` runs each group's pre segment, loop tasks and post segments in that order
(`Note: outer segments` in compiler/outer.py); here each segment becomes a `TaskNode` and
its executable. A segment donates the step inputs the user lets go that no later task of
its group reads, as many of one aval as it returns, and its results are ordered so that
JAX pairs each donated argument with the result `jax.jit` of the whole step would give it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from jaxpp_mpi._src.compiler.exes import Exe
from jaxpp_mpi._src.compiler.outer import OuterNames, Segment, segment_exe, segment_exports
from jaxpp_mpi._src.compiler.task_graph import TaskNode, Value
from jaxpp_mpi._src.ir.program import Aval

__all__ = ["StepIndex", "segment_tasks"]

StepIndex = tuple[dict[Value, int], dict[Value, int]]  # (argument index, result index)


def _donated_argnums(
    ins: Sequence[Value], outs: Sequence[Value], donatable: Collection[Value],
    avals: dict[Value, Aval],
) -> tuple[int, ...]:
    """The argnums of a segment's donatable inputs that it may donate.

    Only as many of one aval as the segment returns values of that aval: XLA reuses
    a donated buffer only for an output of its shape.
    """
    budget = Counter((avals[v].shape, avals[v].dtype) for v in outs)
    picked = []
    for j, v in enumerate(ins):
        key = (avals[v].shape, avals[v].dtype)
        if v in donatable and budget[key] > 0:
            budget[key] -= 1
            picked.append(j)
    return tuple(picked)


def _pair_like_jit(ins: Sequence[Value], outs: Sequence[Value], argnums: Sequence[int],
                   step_index: StepIndex, avals: dict[Value, Aval]) -> list[int]:
    """The segment's results reordered so that JAX pairs each donated argument with the
    result the step returns for it, as `jax.jit` of the whole step would.

    JAX gives a result the first donated argument (in argument order) of its shape and
    dtype, in result order. For the whole step that pairs a donated parameter with its
    update (steps return their state in the order they take it); a segment's own order
    need not, so the results the step returns go first, ordered by the argument the
    step-level pairing gives them (`Note: layouts`: a donated argument's result keeps
    its layout).

    Args:
      ins: the segment's inputs; outs: its results; argnums: its donated inputs.
      step_index: the flat index of each step input value and each step result value.
      avals: the aval of every value.

    Returns:
      A permutation of `range(len(outs))`.
    """
    key = lambda v: (avals[v].shape, avals[v].dtype)
    arg_of, result_of = step_index
    donated = sorted((arg_of[ins[j]], j) for j in argnums if ins[j] in arg_of)
    paired: dict[int, int] = {}  # result position -> donated argnum
    for _, i in sorted((result_of[v], i) for i, v in enumerate(outs) if v in result_of):
        match = next(((k, j) for k, j in donated if key(ins[j]) == key(outs[i])), None)
        if match is not None:
            donated.remove(match)
            paired[i] = match[1]
    first = sorted(paired, key=paired.__getitem__)
    return first + [i for i in range(len(outs)) if i not in paired]


def segment_tasks(
    order: Sequence[Segment | TaskNode], group: int, names: OuterNames,
    read: Collection[Value], donatable: Collection[Value], avals: dict[Value, Aval],
    step_index: StepIndex,
) -> tuple[list[TaskNode], dict[str, Exe]]:
    """Turns one group's segments into tasks and executables.

    A segment exports the variables it defines that something reads (`read`), and
    donates a donatable step input if no later task of the group reads it (see
    `_donated_argnums` for how many).

    Args:
      order: the group's pre segment, loop tasks and post segments, in run order.
      group: the group.
      names: the value names of the step's variables.
      read: every value a task or the step's result reads.
      donatable: the step inputs the user lets go that are not step results.
      avals: the aval of every value.
      step_index: the flat index of each step input and step result value.

    Returns:
      The group's tasks in run order, and the executables of its segments.
    """
    later: set[Value] = set()  # values read after the current item (reverse walk)
    done: list[tuple[TaskNode, Exe | None]] = []
    for item in reversed(order):
        if isinstance(item, Segment):
            export = segment_exports(item, names, read)
            outs = [names.value(v, group) for v in export]
            free = [v for v in item.ins if v in donatable and v not in later]
            argnums = _donated_argnums(item.ins, outs, free, avals)
            if argnums:
                perm = _pair_like_jit(item.ins, outs, argnums, step_index, avals)
                export, outs = [export[i] for i in perm], [outs[i] for i in perm]
            node = TaskNode(item.task_name, group, item.exe, item.ins, outs,
                            donate=tuple(item.ins[j] for j in argnums))
            done.append((node, segment_exe(item, export, argnums)))
        else:
            done.append((item, None))
        later.update(item.ins)
    done.reverse()
    return [node for node, _ in done], {node.exe: exe for node, exe in done if exe is not None}
