"""Loop pass: the split body and the schedule become each group's loop tasks, in the order
`loop_order.loop_order` gives them (back-to-back pairs fused there).

Note: loop tasks.
  Task (kind, stage) of microbatch m becomes one TaskNode named like the schedule's
  task (`F3s1`: FWD of stage 1 on microbatch 3) on the stage's group, in the order the
  schedule lists it (a fused entry's parts back to back). A value `v` of the body is
  `v@m` for microbatch m (a block of the graph's dense values, `Note: dense values` in
  compiler/task_graph.py); loop invariants and the microbatch index are values of the
  group (given by the caller).

  Each body output k is reduced on the group of the task that computes it (its *host*:
  the task producing it; invariants, literals and the index are hosted by the last FWD
  task). The reduction is fused into the host's executable: the first microbatch the
  group runs calls the `_first` variant, which makes the state (`Op.state`, or for
  `Concat` zeros with that microbatch written in), and every later one calls the plain
  variant, which takes the state, donates it and returns `Op.update(state, v, m)`. So
  a weight gradient is accumulated where the weight lives, with no extra dispatch and
  no per-microbatch copy; the state after the last microbatch is the loop output. In a
  group of several devices, a task with `Add` states has a third variant, `_last`, for
  its last microbatch: the one that reduces a data-parallel gradient sum carried
  unreduced until then (`Note: deferred reduction` in compiler/deferred.py). A group
  may build a `_first` executable from its plain one (`Note: first variants` in
  compiler/exes.py).

A value of a PRNG key dtype is its key data outside an executable (`Note: keys as key
data` in compiler/keys.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax.numpy as jnp

from jaxpp_mpi._src.compiler import deferred
from jaxpp_mpi._src.compiler.exes import Exe, first_fills, first_state
from jaxpp_mpi._src.compiler.homes import LoopHomes
from jaxpp_mpi._src.compiler.keys import aval_of, key_boundary, replayable
from jaxpp_mpi._src.compiler.loop_order import LoopOrder, loop_order
from jaxpp_mpi._src.compiler.split import SplitBody, TaskJaxpr, TaskKey
from jaxpp_mpi._src.compiler.task_graph import TaskNode, Value, ValueNames
from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.primitives.treduce import Add, Max, Op
from jaxpp_mpi._src.schedules.library import BaseSchedule
from jaxpp_mpi._src.schedules.tasks import Task, task_label

__all__ = ["LoopExes", "LoopTasks", "build_loop_tasks", "loop_exes", "loop_task_nodes"]


@dataclasses.dataclass
class LoopTasks:
    """The loop's share of the task graph (the result of `build_loop_tasks`).

    Attributes:
      tasks: per group, its loop TaskNodes in schedule order.
      exes: per group, executable name -> Exe.
      avals: the aval of every value the tasks pass (values read only inside the task
        that makes them have none).
      mb_values: (microbatch, group) -> the value of that microbatch's index on that
        group, for each one a task reads (the caller binds them as step inputs).
      names: the names of the values (`Note: dense values` in task_graph.py): the
        tasks' values are ints, the caller's names (`inv_value`, `out_values`) made
        values here.
    """

    tasks: list[list[TaskNode]]
    exes: list[dict[str, Exe]]
    avals: dict[Value, Aval]
    mb_values: dict[tuple[int, int], Value]
    names: ValueNames = dataclasses.field(default_factory=ValueNames)


def _task_fn(task: TaskJaxpr, export: Sequence[int], sources: Sequence[tuple],
             ops: Sequence[Op], n: int, first: bool, with_index: bool) -> Callable:
    """The executable of one task variant: see `Note: loop tasks` for the arguments."""
    n_in = len(task.ins)
    n_extra = sum(src[0] == "arg" for src in sources)
    closed = task.jaxpr.replace(jaxpr=replayable(task.jaxpr.jaxpr))
    run = key_boundary(deferred.jaxpr_fun(closed), task.jaxpr.in_avals,
                       task.jaxpr.out_avals)

    def fn(*args):
        outs = run(*args[:n_in])
        extra = iter(args[n_in:n_in + n_extra])
        pos = n_in + n_extra
        index = args[pos] if with_index else None
        states = args[pos + with_index:]
        values = []
        for src in sources:
            if src[0] == "out":
                values.append(outs[src[1]])
            elif src[0] == "arg":
                values.append(next(extra))
            else:
                values.append(jnp.asarray(src[1]))
        # `Note: deferred reduction`: only an Add state may stay unreduced.
        values = [v if isinstance(op, Add) else deferred.reduced(v)
                  for op, v in zip(ops, values)]
        if first:
            new = [first_state(op, n, v, index) for op, v in zip(ops, values)]
        else:
            # Only an Add state takes `v`'s type; another op writes `v` into a part of
            # its state (e.g. a microbatch's row), whose type is not `v`'s.
            new = [op.update(s, deferred.like(v, s) if isinstance(op, Add) else v, index)
                   for op, s, v in zip(ops, states, values)]
        return (*(outs[j] for j in export), *new)

    return fn


class _KeyPlan(NamedTuple):
    """What every microbatch's task of one key on one group shares."""

    task: TaskJaxpr
    hosted: list[int]  # the body outputs it reduces
    ops: list[Op]  # their ops
    sources: list[tuple]  # per hosted output: ("out", j), ("arg",) or ("lit", value)
    extra: list[Value | None]  # per ("arg",) source: the invariant's value, None: the index
    with_index: bool  # whether the microbatch index is its last plain input
    export: list[int]  # the task outputs that another task reads
    adds: list[int]  # the positions among `hosted` of deferrable `Add` states
    family: str  # e.g. `F1`, `FB3`

    @property
    def num_ins(self) -> int:
        """Its inputs before the states: the task's, the extra ones, the index."""
        return len(self.task.ins) + len(self.extra) + self.with_index


def _key_plan(lo: LoopOrder, split: SplitBody, key: TaskKey, group: int,
              ops: Sequence[Op], inv_value: Callable[[int, int], Value],
              defer: bool) -> _KeyPlan:
    """The `_KeyPlan` of `key` on `group`."""
    task = lo.by_key[key]
    ks = lo.hosted.get(key, [])
    sources: list[tuple] = []
    extra: list[Value | None] = []
    for k in ks:
        ref = split.body_outputs[k]
        if ref[0] == "val":
            sources.append(("out", task.outs.index(ref[1])))
        elif ref[0] in ("inv", "mb"):
            sources.append(("arg",))
            extra.append(inv_value(ref[1], group) if ref[0] == "inv" else None)
        else:
            sources.append(("lit", ref[1]))
    k_ops = [ops[k] for k in ks]
    kinds = (key[0], *((lo.fused[key][0],) if key in lo.fused else ()))
    return _KeyPlan(
        task, ks, k_ops, sources, extra,
        any(not isinstance(op, (Add, Max)) for op in k_ops),
        [j for j, name in enumerate(task.outs) if name in lo.read_by_tasks],
        [j for j, op in enumerate(k_ops) if isinstance(op, Add)] if defer else [],
        "".join(kind.value for kind in kinds) + str(key[1]))


def _key_plans(lo: LoopOrder, split: SplitBody, ops: Sequence[Op],
               inv_value: Callable[[int, int], Value], defer: bool
               ) -> list[dict[TaskKey, _KeyPlan]]:
    """Per group, the `_KeyPlan` of each key it runs, in order of first run."""
    return [{key: _key_plan(lo, split, key, g, ops, inv_value, defer)
             for key in dict.fromkeys(key for key, _ in group_order)}
            for g, group_order in enumerate(lo.order)]


def _variant(plan: _KeyPlan, runs: Sequence[int], m: int) -> tuple[bool, bool, str]:
    """(first, last, executable name) of microbatch `m`'s task (`Note: loop tasks`)."""
    first = bool(plan.hosted) and runs[0] == m
    last = bool(plan.hosted) and runs[-1] == m
    return first, last, plan.family + (
        "_first" if first else "_last" if last and plan.adds else "")


def _acc_avals(ops: Sequence[Op], out_avals: Sequence, length: int) -> list[Aval]:
    """Per body output, the aval of its reduction's state."""
    return [aval_of(op.result_aval(length, a)) for op, a in zip(ops, out_avals)]


def _exe(plan: _KeyPlan, first: bool, last: bool, length: int,
         acc_avals: Sequence[Aval]) -> Exe:
    """The executable of one variant of a key's task (`Note: loop tasks`)."""
    ks, num_ins = plan.hosted, plan.num_ins
    num_states_in = 0 if first or not ks else len(ks)
    fn = _task_fn(plan.task, plan.export, plan.sources, plan.ops, length, first or not ks,
                  plan.with_index)
    fills = first_fills(plan.ops, [acc_avals[k] for k in ks]) if first and ks else None
    return Exe(fn, tuple(range(num_ins, num_ins + num_states_in)), plan.family,
               tuple(None if first else num_ins + j for j in plan.adds),
               tuple(None if last else len(plan.export) + j for j in plan.adds), fills)


@dataclasses.dataclass
class LoopExes:
    """The loop's executables and what the code around the loop sees of its tasks
    (`loop_exes`'s result): nothing per microbatch.

    Attributes:
      exes: per group, executable name -> Exe, in order of first run.
      reads: per group, the values of the group (not of a microbatch) its tasks read.
      state_avals: the aval of each loop output's final state.
    """

    exes: list[dict[str, Exe]]
    reads: list[tuple[Value, ...]]
    state_avals: dict[Value, Aval]


def loop_exes(lo: LoopOrder, split: SplitBody, ops: Sequence[Op], out_avals: Sequence,
              inv_value: Callable[[int, int], Value], out_values: Sequence[Value],
              defer: bool = False, state_length: int | None = None) -> LoopExes:
    """Each group's loop executables, without a task node (`Note: loop tasks`).

    Args:
      lo: from `loop_order`.
      split, ops, out_avals, inv_value, out_values, defer, state_length: as
        `build_loop_tasks`'.

    Returns:
      The LoopExes: the same executables as `build_loop_tasks`', in the same order.
    """
    length = lo.num_microbatches if state_length is None else state_length
    acc_avals = _acc_avals(ops, out_avals, length)
    plans = _key_plans(lo, split, ops, inv_value, defer)
    return _loop_exes(lo, plans, acc_avals, length, inv_value, out_values)


def _loop_exes(lo: LoopOrder, plans: Sequence[Mapping[TaskKey, _KeyPlan]],
               acc_avals: Sequence[Aval], length: int,
               inv_value: Callable[[int, int], Value], out_values: Sequence[Value]
               ) -> LoopExes:
    """`loop_exes`, given each group's key plans and the states' avals."""
    out = LoopExes([], [], {})
    for g, group_plans in enumerate(plans):
        exes: dict[str, Exe] = {}
        for key, m in lo.order[g]:
            plan = group_plans[key]
            first, last, name = _variant(plan, lo.runs[key], m)
            if name not in exes:
                exes[name] = _exe(plan, first, last, length, acc_avals)
        reads: dict[Value, None] = {}
        for plan in group_plans.values():
            reads.update((v, None) for v in plan.extra if v is not None)
            reads.update((inv_value(ref[1], g), None) for ref in plan.task.ins
                         if ref[0] == "inv")
            out.state_avals.update((out_values[k], acc_avals[k]) for k in plan.hosted)
        out.exes.append(exes)
        out.reads.append(tuple(reads))
    return out


class _Blocks(dict):
    """Body value name -> its value of each microbatch `m` in range(n), named
    `f"{name}@{m}"` (`Note: loop tasks`): a block of `names`, made on first use. Each
    value is one int object, which every node passing it holds (a range would make a
    new one per node)."""

    def __init__(self, names: ValueNames, n: int):
        super().__init__()
        self.names, self.n = names, n

    def __missing__(self, name: str) -> list[int]:
        values = self[name] = list(self.names.block(name, self.n))
        return values


class _NodeForm(NamedTuple):
    """What every microbatch's node of one key on one group shares: its label, inputs
    and outputs less the microbatch's part (`_loop_nodes`)."""

    plan: _KeyPlan
    runs: list[int]  # the key's microbatches in run order
    label: str  # its label with '{0}' for the microbatch
    ins: list[Value | None]  # the plain inputs; None: filled in per microbatch
    # per body value read: (position, its name, its value per microbatch)
    reads: list[tuple[int, str, list[int]]]
    index_ins: list[int]  # the positions of the microbatch index
    # per exported task output: (its name, its value per microbatch)
    exports: list[tuple[str, list[int]]]
    # per hosted body output k: ('acc<k>', its state's value per microbatch)
    acc: list[tuple[str, list[int]]]
    finals: list[Value]  # the loop output of each hosted body output
    acc_avals: list[Aval]  # the aval of each one's state
    prev: dict[int, int]  # microbatch -> the one the key ran before it
    states: dict[int, list[Value]]  # microbatch -> the states its node made (filled in)


def _node_form(lo: LoopOrder, plan: _KeyPlan, key: TaskKey, g: int,
               inv_value: Callable[[int, int], Value], out_values: Sequence[Value],
               acc_avals: Sequence[Aval], values: _Blocks) -> _NodeForm:
    """The `_NodeForm` of `key` on group `g`."""
    intern = values.names.intern
    ins: list[Value | None] = []
    reads: list[tuple[int, str, list[int]]] = []
    index_ins: list[int] = []
    for ref in plan.task.ins:
        if ref[0] == "mb":
            index_ins.append(len(ins))
        elif ref[0] == "inv":
            ins.append(intern(inv_value(ref[1], g)))
            continue
        else:
            reads.append((len(ins), ref[1], values[ref[1]]))
        ins.append(None)
    for v in plan.extra:
        if v is None:
            index_ins.append(len(ins))
        ins.append(None if v is None else intern(v))
    if plan.with_index:
        index_ins.append(len(ins))
        ins.append(None)
    ks = plan.hosted
    runs = lo.runs[key]
    kinds = (key[0], *((lo.fused[key][0],) if key in lo.fused else ()))
    # `task_label` of the parts with microbatch '{0}', for str.format to fill in: the
    # labels stay `task_label`'s (`Note: task labels` in schedules/tasks.py).
    label = task_label(tuple(Task(key[1], "{0}", kind) for kind in kinds))
    exports = [(plan.task.outs[j], values[plan.task.outs[j]]) for j in plan.export]
    return _NodeForm(
        plan, runs, label, ins, reads, index_ins, exports,
        [(f"acc{k}", values[f"acc{k}"]) for k in ks],
        [intern(out_values[k]) for k in ks], [acc_avals[k] for k in ks],
        dict(zip(runs[1:], runs[:-1])), {})


def _loop_nodes(lo: LoopOrder, split: SplitBody, plans: Sequence[Mapping[TaskKey, _KeyPlan]],
                acc_avals: Sequence[Aval], inv_value: Callable[[int, int], Value],
                out_values: Sequence[Value]) -> LoopTasks:
    """Every microbatch's task node, the avals of the values they pass and the
    microbatch indexes they read (`LoopTasks` less its executables)."""
    n = lo.num_microbatches
    result = LoopTasks([[] for _ in range(lo.num_groups)], [{} for _ in range(lo.num_groups)],
                       {}, {})
    avals, mb_values, intern = result.avals, result.mb_values, result.names.intern
    values = _Blocks(result.names, n)
    for name, aval in split.value_avals.items():
        if name in lo.read_by_tasks:  # the others never leave their task's executable
            avals.update(dict.fromkeys(values[name], aval_of(aval)))  # one for every m

    for g, group_order in enumerate(lo.order):
        forms: dict[TaskKey, _NodeForm] = {}  # made at the key's first node
        nodes = result.tasks[g]
        for key, m in group_order:
            form = forms.get(key)
            if form is None:
                form = forms[key] = _node_form(lo, plans[g][key], key, g, inv_value,
                                               out_values, acc_avals, values)
            first, last, exe = _variant(form.plan, form.runs, m)
            ins = form.ins.copy()
            inside = type(m) is int and 0 <= m < n  # its values are made
            if inside:
                for i, _, vs in form.reads:
                    ins[i] = vs[m]
                outs = [vs[m] for _, vs in form.exports]
            else:  # a schedule's microbatch out of range: named all the same
                for i, name, _ in form.reads:
                    ins[i] = intern(f"{name}@{m}")
                outs = [intern(f"{name}@{m}") for name, _ in form.exports]
            if form.index_ins:
                index = mb_values.get((m, g))
                if index is None:
                    index = mb_values[m, g] = intern(f"mb{m}g{g}")
                for i in form.index_ins:
                    ins[i] = index
            states_in: list[Value] = []
            if form.acc:
                if not first:  # the states of the key's previous run, on this group
                    states_in = form.states[form.prev[m]]
                if last:
                    states_out = form.finals
                elif inside:
                    states_out = form.states[m] = [vs[m] for _, vs in form.acc]
                else:
                    states_out = form.states[m] = [intern(f"{name}@{m}")
                                                   for name, _ in form.acc]
                avals.update(zip(states_out, form.acc_avals))
                outs += states_out
            ins += states_in
            nodes.append(TaskNode(form.label.format(m), g, exe, ins, outs, donate=states_in))
    index_aval = Aval((), "int32")
    for v in mb_values.values():
        avals[v] = index_aval
    return result


def loop_task_nodes(lo: LoopOrder, split: SplitBody, ops: Sequence[Op], out_avals: Sequence,
                    inv_value: Callable[[int, int], Value], out_values: Sequence[Value],
                    defer: bool = False, state_length: int | None = None) -> LoopTasks:
    """Every microbatch's task node (`Note: loop tasks`): `build_loop_tasks`' result
    less its executables (`loop_exes` makes those).

    Args:
      lo: from `loop_order`.
      split, ops, out_avals, inv_value, out_values, defer, state_length: as
        `build_loop_tasks`'.

    Returns:
      The LoopTasks, with no executable.
    """
    length = lo.num_microbatches if state_length is None else state_length
    return _loop_nodes(lo, split, _key_plans(lo, split, ops, inv_value, defer),
                       _acc_avals(ops, out_avals, length), inv_value, out_values)


def build_loop_tasks(
    split: SplitBody,
    homes: LoopHomes,
    schedule: BaseSchedule,
    num_microbatches: int,
    ops: Sequence[Op],
    out_avals: Sequence,
    inv_value: Callable[[int, int], Value],
    out_values: Sequence[Value],
    defer: bool = False,
    state_length: int | None = None,
) -> LoopTasks:
    """Builds each group's loop tasks (see `Note: loop tasks`): `loop_order`, then
    every microbatch's task node, and `loop_exes`'s executables.

    Args:
      split: the split body.
      homes: from `assign_loop_homes`.
      schedule: the loop's schedule.
      num_microbatches: n.
      ops: one Op per body output.
      out_avals: the JAX aval of each body output (per microbatch).
      inv_value: (invariant j, group g) -> the value name of loop operand j on g.
      out_values: per loop output, the value name of its final state.
      defer: give the last microbatch of a task with `Add` states its own variant
        (`_last`), so their reduction can be deferred to it (`Note: deferred
        reduction`; only worth it where a group has several devices).
      state_length: the microbatch count of the whole loop, when this pipeline runs
        only `num_microbatches` of them (pipeline replicas, `Note: replicas` in
        compiler/replicas.py): a `Concat` state has that length. Default n.

    Returns:
      The LoopTasks.

    Raises:
      CompileError: the schedule rejects `num_microbatches`, or does not run every
        task of the split body exactly once on the stage's group.
    """
    lo = loop_order(split, homes, schedule, num_microbatches)
    length = num_microbatches if state_length is None else state_length
    acc_avals = _acc_avals(ops, out_avals, length)
    plans = _key_plans(lo, split, ops, inv_value, defer)
    result = _loop_nodes(lo, split, plans, acc_avals, inv_value, out_values)
    result.exes = _loop_exes(lo, plans, acc_avals, length, inv_value, out_values).exes
    return result
