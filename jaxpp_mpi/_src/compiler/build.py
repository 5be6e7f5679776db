"""The compiler's driver: a user step becomes a verified Program and its executables.

    trace_step ─▶ split_body ─▶ place_loop ─▶ place_outer ─▶ build_loop_tasks
      ─▶ outer_segments ─▶ TaskGraph ─▶ build_program_with_names (verified)

Every pass is a function of plain data; this module only wires them and names the
step's inputs and outputs. Nothing here touches devices: `StepPlan` is the same on
every rank, and each runtime compiles the executables of the groups it holds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jex_core

from jaxpp_mpi._src.compiler.loop_tasks import (
    Exe,
    LoopPlacement,
    aval_of,
    build_loop_tasks,
    place_loop,
)
from jaxpp_mpi._src.compiler.lower import build_program_with_names
from jaxpp_mpi._src.compiler.outer import (
    OuterNames,
    Segment,
    outer_segments,
    segment_exe,
    segment_exports,
)
from jaxpp_mpi._src.compiler.placement import place_outer
from jaxpp_mpi._src.compiler.split import SplitBody, split_body
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value
from jaxpp_mpi._src.compiler.trace_step import trace_step
from jaxpp_mpi._src.errors import CompileError
from jaxpp_mpi._src.ir.program import Aval, Program

__all__ = ["StepPlan", "build_step"]

Spec = tuple  # program spec entries (see program.Aval)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything a runtime needs to run one compiled step.

    Attributes:
      program: the verified program.
      buffer_names: per group, buffer id -> value name (for inspection and tests).
      exes: per group, executable name -> Exe.
      exe_avals: per group, executable name -> (input avals, output avals).
      consts: the step's constants; flat step input k < len(consts) is consts[k].
      num_args: the number of flat user arguments (step inputs len(consts) ...).
      input_avals: per flat step input (constants, arguments, microbatch indexes).
      input_owner: per flat step input, the group it is bound on (None: unused).
      mb_inputs: (flat step input index, group, microbatch) of each microbatch index.
      outputs: per flat step output, ("val", group) when the program produces it, or
        ("lit", value) for a constant result.
      output_avals: per flat step output, its Aval.
      out_tree: the result's pytree structure.
      schedule: the loop's schedule; num_microbatches: its microbatch count.
      split: the split loop body (the stage tasks).
      loop: where the loop's operands and results live.
    """

    program: Program
    buffer_names: tuple[dict[int, Value], ...]
    exes: tuple[dict[str, Exe], ...]
    exe_avals: tuple[dict[str, tuple[tuple[Aval, ...], tuple[Aval, ...]]], ...]
    consts: tuple[Any, ...]
    num_args: int
    input_avals: tuple[Aval, ...]
    input_owner: tuple[int | None, ...]
    mb_inputs: tuple[tuple[int, int, int], ...]
    outputs: tuple[tuple, ...]
    output_avals: tuple[Aval, ...]
    out_tree: Any
    schedule: Any
    num_microbatches: int
    split: SplitBody
    loop: LoopPlacement

    @property
    def num_groups(self) -> int:
        return self.program.num_groups


def _check_schedule(schedule: Any, num_groups: int) -> None:
    dim = getattr(schedule, "mpmd_dim", None)
    if dim != num_groups:
        raise CompileError(
            f"the loop's schedule {schedule!r} has mpmd_dim={dim}, but the mesh has "
            f"{num_groups} MPMD groups: build the schedule for the mesh, e.g. "
            f"Std1F1B({num_groups}) or Interleaved1F1B(num_stages, mpmd_dim={num_groups})"
        )


def _donations(
    order: list, seg_ins: dict[int, list[Value]], seg_outs: dict[int, list[Value]],
    donatable: set[Value], keep: set[Value], avals: dict[Value, Aval],
) -> dict[int, tuple[int, ...]]:
    """Per segment (by id), the argnums of donated step inputs.

    A step input may be donated by the segment that reads it last on its owner, if it
    is not a step result, and only as many of one aval as the segment returns values
    of that aval (XLA reuses a donated buffer only for an output of its shape).
    """
    later: set[Value] = set()
    out: dict[int, tuple[int, ...]] = {}
    for item in reversed(order):
        ins = seg_ins[id(item)] if isinstance(item, Segment) else list(item.ins)
        if isinstance(item, Segment):
            budget = Counter((avals[v].shape, avals[v].dtype) for v in seg_outs[id(item)])
            picked = []
            for j, v in enumerate(ins):
                key = (avals[v].shape, avals[v].dtype)
                if v in donatable and v not in later and v not in keep and budget[key] > 0:
                    budget[key] -= 1
                    picked.append(j)
            out[id(item)] = tuple(picked)
        later.update(ins)
    return out


def build_step(
    fun: Callable,
    args: Sequence[Any],
    num_groups: int,
    *,
    in_specs: Sequence[Spec | None] | None = None,
    out_specs: Sequence[Spec | None] | None = None,
    donate: Sequence[bool] | None = None,
    what: str = "the step",
) -> StepPlan:
    """Compiles `fun(*args)` into a StepPlan for `num_groups` MPMD groups.

    Args:
      fun: the user's step; it calls treduce once.
      args: its arguments (leaves: arrays or `jax.ShapeDtypeStruct`s).
      num_groups: the mesh's MPMD dimension.
      in_specs: per flat argument, its in-group spec entries (None: replicated).
      out_specs: per flat result, its in-group spec entries (None: replicated).
      donate: per flat argument, whether its buffer may be reused.
      what: the step's name for messages.

    Returns:
      The StepPlan.

    Raises:
      CompileError: the step cannot be pipelined (no loop, two loops, a stage count
        the schedule does not have, a microbatch count it rejects, ...).
    """
    traced = trace_step(fun, args, what=what)
    jaxpr, loop = traced.jaxpr, traced.loop
    params = loop.params
    schedule, n, ops = params["schedule"], params["num_microbatches"], params["ops"]
    _check_schedule(schedule, num_groups)
    split = split_body(params["body"], schedule.num_stages,
                       partial_bwd=schedule.is_partial_bwd)
    lp = place_loop(split, schedule, len(loop.invars))
    plan = place_outer(jaxpr, traced.loop_index, lp.invariant_groups, lp.out_groups)
    names = OuterNames(jaxpr, traced.loop_index, plan, lp.out_groups)

    n_consts = len(traced.consts)
    n_args = len(jaxpr.invars) - n_consts
    in_specs = list(in_specs) if in_specs is not None else [None] * n_args
    donate = list(donate) if donate is not None else [False] * n_args
    out_specs = list(out_specs) if out_specs is not None else [None] * len(jaxpr.outvars)

    def inv_value(j: int, g: int) -> Value:
        return names.value(loop.invars[j], g)

    loop_out_values = [
        names.value(v, g) if names.ids.get(v) is not None else f"loopout{k}"
        for k, (v, g) in enumerate(zip(loop.outvars, lp.out_groups))
    ]
    lt = build_loop_tasks(split, lp, schedule, n, ops, params["body"].out_avals,
                          inv_value, loop_out_values)
    pre, post = outer_segments(jaxpr, traced.loop_index, plan, names, num_groups)

    # Avals of every value.
    avals: dict[Value, Aval] = dict(lt.avals)
    input_avals = []
    for k, v in enumerate(jaxpr.invars):
        spec = in_specs[k - n_consts] if k >= n_consts else None
        input_avals.append(aval_of(v.aval, spec or ()))
        avals[f"in{k}"] = input_avals[-1]
    out_spec_of = {}
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, jex_core.Var) and not isinstance(v, jex_core.Literal):
            out_spec_of.setdefault(v, out_specs[k] or ())
    for v in names.ids:
        groups = [names.home[v]] if v in names.home else sorted(names.free_groups[v])
        for g in groups:
            avals[names.value(v, g)] = aval_of(v.aval, out_spec_of.get(v, ()))
    for k, v in enumerate(loop_out_values):
        if v.startswith("loopout"):
            avals[v] = aval_of(ops[k].result_aval(n, params["body"].out_avals[k]))

    # Step outputs.
    outputs, output_values, output_avals = [], [], []
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, jex_core.Literal):
            outputs.append(("lit", v.val))
            output_avals.append(aval_of(v.aval, out_specs[k] or ()))
            continue
        g = names.holder(v, plan.output_group[k])
        value = names.value(v, g)
        outputs.append(("val", g))
        output_values.append((value, k))
        output_avals.append(avals[value])

    # Each group's order: pre, loop tasks, post segments by level.
    orders: list[list] = []
    for g in range(num_groups):
        orders.append(([pre[g]] if pre[g] else []) + lt.tasks[g] + post[g])
    read: set[Value] = {v for v, _ in output_values}
    for order in orders:
        for item in order:
            read.update(item.ins)
    seg_exports: dict[int, list] = {}  # per segment (by id): the variables it exports
    seg_outs: dict[int, list[Value]] = {}  # ... and their value names
    for g, order in enumerate(orders):
        for item in order:
            if isinstance(item, Segment):
                seg_exports[id(item)] = segment_exports(item, names, read)
                seg_outs[id(item)] = [names.value(v, g) for v in seg_exports[id(item)]]
    donatable = {f"in{k + n_consts}" for k in range(n_args) if donate[k]}
    keep = {v for v, _ in output_values}
    exes: list[dict[str, Exe]] = [dict(e) for e in lt.exes]
    tasks: list[list[TaskNode]] = []
    for g, order in enumerate(orders):
        seg_ins = {id(s): s.ins for s in order if isinstance(s, Segment)}
        donations = _donations(order, seg_ins, seg_outs, donatable, keep, avals)
        group_tasks = []
        for item in order:
            if isinstance(item, Segment):
                argnums = donations[id(item)]
                exes[g][item.exe] = segment_exe(item, seg_exports[id(item)], argnums)
                group_tasks.append(TaskNode(item.task_name, g, item.exe, item.ins,
                                            seg_outs[id(item)],
                                            donate=tuple(item.ins[j] for j in argnums)))
            else:
                group_tasks.append(item)
        tasks.append(group_tasks)

    # Step inputs: constants and arguments on their owners, then microbatch indexes.
    graph_inputs = [(f"in{k}", g, k) for k, g in enumerate(plan.input_owner) if g is not None]
    input_owner = list(plan.input_owner)
    mb_inputs = []
    for (m, g), v in sorted(lt.mb_values.items(), key=lambda x: (x[0][1], x[0][0])):
        k = len(input_avals)
        graph_inputs.append((v, g, k))
        input_avals.append(avals[v])
        input_owner.append(g)
        mb_inputs.append((k, g, m))
    graph = TaskGraph(num_groups, tasks, graph_inputs, output_values, avals)
    try:
        program, buffer_names = build_program_with_names(graph)
    except ValueError as e:
        raise CompileError(f"{what}: internal error while building the program: {e}") from e

    exe_avals: list[dict] = [{} for _ in range(num_groups)]
    for g, group_tasks in enumerate(tasks):
        for t in group_tasks:
            exe_avals[g].setdefault(
                t.exe, (tuple(avals[v] for v in t.ins), tuple(avals[v] for v in t.outs)))
    return StepPlan(
        program=program,
        buffer_names=buffer_names,
        exes=tuple(exes),
        exe_avals=tuple(exe_avals),
        consts=traced.consts,
        num_args=n_args,
        input_avals=tuple(input_avals),
        input_owner=tuple(input_owner),
        mb_inputs=tuple(mb_inputs),
        outputs=tuple(outputs),
        output_avals=tuple(output_avals),
        out_tree=traced.out_tree,
        schedule=schedule,
        num_microbatches=n,
        split=split,
        loop=lp,
    )
