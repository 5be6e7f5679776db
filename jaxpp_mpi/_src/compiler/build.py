"""The compiler's driver: a user step becomes a verified Program and its executables.

    trace_step ─▶ split_body ─▶ assign_loop_homes ─▶ assign_outer_homes
      ─▶ loop_order, loop_exes ─▶ outer_segments ─▶ segment_tasks (segment_tasks.py:
      exports, donations) ─▶ the step entry of an earlier launch (program_cache.py), or
      loop_task_nodes ─▶ TaskGraph ─▶ lower_cached (the lowering, or the program an
      earlier launch lowered from the same graph)

Every pass is a function of plain data; this module only wires them and names the
step's inputs and outputs. Nothing here touches devices: `StepPlan` is the same on
every rank, and each runtime compiles the executables of the groups it holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Spec
from jaxpp_mpi._src.compiler import replicas
from jaxpp_mpi._src.compiler.exes import Exe
from jaxpp_mpi._src.compiler.homes import LoopHomes, assign_loop_homes, assign_outer_homes
from jaxpp_mpi._src.compiler.keys import aval_of, is_key, key_impl
from jaxpp_mpi._src.compiler.loop_order import LoopOrder, loop_order
from jaxpp_mpi._src.compiler.loop_tasks import loop_exes, loop_task_nodes
from jaxpp_mpi._src.compiler.outer import OuterNames, input_value, outer_segments
from jaxpp_mpi._src.compiler.program_cache import ExeAvals, ProgramCache, step_key
from jaxpp_mpi._src.compiler.segment_tasks import segment_tasks
from jaxpp_mpi._src.compiler.split import SplitBody, split_body
from jaxpp_mpi._src.compiler.step_entry import cached_entry, key_parts, lowered_entry
from jaxpp_mpi._src.compiler.task_graph import TaskNode, Value
from jaxpp_mpi._src.compiler.trace_step import trace_step
from jaxpp_mpi._src.ir.program import Aval, Program

if TYPE_CHECKING:
    from jaxpp_mpi._src.arrays.mesh import MpmdMesh

__all__ = ["StepPlan", "build_step"]

logger = logging.getLogger("jaxpp_mpi")


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
      output_weak: per flat step output, whether it is weakly typed (as `jax.jit`'s
        result would be: a result fed back must hit the compile cache and promote alike).
      output_fixed: per flat step output, whether its spec is the user's
        (`out_shardings`) rather than left to the producer (`Note: layouts`).
      donated: per flat argument, whether the user lets the step reuse its buffer.
      out_tree: the result's pytree structure.
      key_args: per flat argument, whether it is a typed PRNG key (the program takes
        its key data: `Note: keys as key data`).
      key_outputs: per flat step output, the PRNG implementation of a key result
        (the program returns its key data), else None.
      num_replicas: pipeline replicas sharing the loop (`Note: replicas` in
        compiler/replicas.py); replica r adds `r * replica_microbatches` to each
        `mb_inputs` microbatch.
      replica_microbatches: microbatches each replica runs (the loop's count with one
        replica).
      step_jaxpr: the traced step the plan was built from (its first inputs are the
        constants, then the flat arguments): what the ranks compare (`Note: step
        fingerprints` in compiler/fingerprint.py).
      program_from_cache: whether the program was read from the program cache rather
        than lowered (`Note: program cache` in compiler/program_cache.py).
      step_from_cache: whether it came from a step entry: no loop task node, task
        graph, lowering or verification was built for this plan.
      cache_read_s: the seconds reading that step entry took (not compared).
    """

    program: Program
    buffer_names: tuple[dict[int, Value], ...]
    exes: tuple[dict[str, Exe], ...]
    exe_avals: tuple[dict[str, ExeAvals], ...]
    consts: tuple[Any, ...]
    num_args: int
    input_avals: tuple[Aval, ...]
    input_owner: tuple[int | None, ...]
    mb_inputs: tuple[tuple[int, int, int], ...]
    outputs: tuple[tuple, ...]
    output_avals: tuple[Aval, ...]
    output_fixed: tuple[bool, ...]
    donated: tuple[bool, ...]
    out_tree: Any
    key_args: tuple[bool, ...] = ()
    key_outputs: tuple[str | None, ...] = ()
    output_weak: tuple[bool, ...] = ()
    num_replicas: int = 1
    replica_microbatches: int = 0
    step_jaxpr: jex_core.Jaxpr | None = None
    program_from_cache: bool = False
    step_from_cache: bool = False
    cache_read_s: float = dataclasses.field(default=0.0, compare=False)

    @property
    def num_groups(self) -> int:
        return self.program.num_groups


class _Options(NamedTuple):
    """The caller's per-leaf options with their defaults filled in."""

    in_specs: list[Spec | None]  # per flat argument
    out_specs: list[Spec | None]  # per flat result
    donate: list[bool]  # per flat argument


class _Outputs(NamedTuple):
    """The step's results (see `StepPlan.outputs`)."""

    descs: list[tuple]  # per flat result: ("val", group) or ("lit", value)
    values: list[tuple[Value, int]]  # (value, flat result index) of each "val" result
    avals: list[Aval]  # per flat result


def _has_key(x: Any) -> bool:
    return hasattr(x, "dtype") and is_key(x.dtype)


def _keys_out(fun: Callable) -> tuple[Callable, list[str | None]]:
    """`fun` returning key data for its key results (`Note: keys as key data`), and the
    list that tracing it fills with each flat result's PRNG implementation (or None)."""
    impls: list[str | None] = []

    @functools.wraps(fun)
    def plain(*args):
        leaves, tree = jax.tree.flatten(fun(*args))
        impls[:] = [key_impl(x.dtype) if _has_key(x) else None for x in leaves]
        return jax.tree.unflatten(
            tree, [jax.random.key_data(x) if _has_key(x) else x for x in leaves])

    return plain, impls


def _check_schedule(schedule: Any, num_groups: int) -> None:
    """Raises CompileError unless `schedule` is built for `num_groups` groups."""
    dim = getattr(schedule, "mpmd_dim", None)
    if dim != num_groups:
        raise CompileError(
            f"the loop's schedule {schedule!r} has mpmd_dim={dim}, but the mesh has "
            f"{num_groups} MPMD groups: build the schedule for the mesh, e.g. "
            f"Std1F1B({num_groups}) or Interleaved1F1B(num_stages, mpmd_dim={num_groups})"
        )


def _options(in_specs, out_specs, donate, num_args: int, num_outputs: int) -> _Options:
    """The options of `build_step`, None meaning the default for every leaf."""
    return _Options(
        list(in_specs) if in_specs is not None else [None] * num_args,
        list(out_specs) if out_specs is not None else [None] * num_outputs,
        list(donate) if donate is not None else [False] * num_args,
    )


def _loop_outputs(
    loop: jex_core.JaxprEqn, names: OuterNames, homes: LoopHomes, num_microbatches: int
) -> tuple[list[Value], dict[Value, Aval]]:
    """Names the final state of each loop output.

    Args:
      loop: the loop eqn.
      names: the value names of the step's variables.
      homes: from `assign_loop_homes`.
      num_microbatches: the loop's microbatch count.

    Returns:
      Per loop output, the value name of its final state; and the avals of the states
      of dropped outputs (that no variable names: `loopout<k>`, still computed).
    """
    params = loop.params
    values: list[Value] = []
    dropped: dict[Value, Aval] = {}
    for k, (v, g) in enumerate(zip(loop.outvars, homes.out_groups)):
        if isinstance(v, jex_core.DropVar):
            values.append(f"loopout{k}")
            op, body_aval = params["ops"][k], params["body"].out_avals[k]
            dropped[values[-1]] = aval_of(op.result_aval(num_microbatches, body_aval))
        else:
            values.append(names.value(v, g))
    return values, dropped


def _value_avals(
    jaxpr: jex_core.Jaxpr, num_consts: int, options: _Options, names: OuterNames,
    loop_avals: dict[Value, Aval], dropped: dict[Value, Aval],
) -> tuple[list[Aval], dict[Value, Aval]]:
    """The avals of the step's inputs and of every value.

    A variable that is a step result carries that result's spec (its first one).

    Returns:
      Per flat step input, its aval; and the aval of every value (the loop tasks',
      the inputs', the named variables', and the dropped loop outputs').
    """
    avals: dict[Value, Aval] = dict(loop_avals)
    input_avals = []
    for k, v in enumerate(jaxpr.invars):
        spec = options.in_specs[k - num_consts] if k >= num_consts else None
        input_avals.append(aval_of(v.aval, spec or ()))
        avals[input_value(k)] = input_avals[-1]
    out_spec_of: dict[jex_core.Var, Spec] = {}
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, jex_core.Var) and not isinstance(v, jex_core.Literal):
            out_spec_of.setdefault(v, options.out_specs[k] or ())
    for v in names.defined():
        for g in names.groups(v):
            avals[names.value(v, g)] = aval_of(v.aval, out_spec_of.get(v, ()))
    avals.update(dropped)
    return input_avals, avals


def _step_outputs(
    jaxpr: jex_core.Jaxpr, names: OuterNames, output_group: Sequence[int],
    out_specs: Sequence[Spec | None], avals: dict[Value, Aval],
) -> _Outputs:
    """Where each step result comes from: a value on its holder, or a literal."""
    out = _Outputs([], [], [])
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, jex_core.Literal):
            out.descs.append(("lit", v.val))
            out.avals.append(aval_of(v.aval, out_specs[k] or ()))
            continue
        g = names.holder(v, output_group[k])
        value = names.value(v, g)
        out.descs.append(("val", g))
        out.values.append((value, k))
        out.avals.append(avals[value])
    return out


def _loop_order(split: SplitBody, homes: LoopHomes, schedule: Any, num_local: int,
                num_replicas: int, num_microbatches: int) -> LoopOrder:
    """`loop_order`; its CompileError says how many microbatches each replica runs."""
    try:
        return loop_order(split, homes, schedule, num_local)
    except CompileError as e:
        if num_replicas == 1:
            raise
        raise CompileError(f"{e} (each of the {num_replicas} pipeline replicas runs "
                           f"{num_local} of the loop's {num_microbatches} microbatches)"
                           ) from e


def build_step(
    fun: Callable,
    args: Sequence[Any],
    num_groups: int,
    *,
    in_specs: Sequence[Spec | None] | None = None,
    out_specs: Sequence[Spec | None] | None = None,
    donate: Sequence[bool] | None = None,
    what: str = "the step",
    mesh: MpmdMesh | None = None,
    num_replicas: int = 1,
    replica_bucket_bytes: int = 64 << 20,
    replica_dims: Sequence[int | None] | None = None,
    arg_names: Sequence[str] | None = None,
    task_times_ms: Mapping[str, float] | None = None,
    sends: str = "blocking",
    program_cache: ProgramCache | None = None,
) -> StepPlan:
    """Compiles `fun(*args)` into a StepPlan for `num_groups` MPMD groups.

    Args:
      fun: the user's step; it calls treduce once.
      args: its arguments (leaves: arrays or `jax.ShapeDtypeStruct`s); typed PRNG
        keys among them and among its results travel as their key data (`Note: keys
        as key data`).
      num_groups: the mesh's MPMD dimension.
      in_specs: per flat argument, its in-group spec entries (None: replicated).
      out_specs: per flat result, its in-group spec entries (None: replicated).
      donate: per flat argument, whether its buffer may be reused.
      what: the step's name for messages.
      mesh: the mesh: the step is traced under it (see `trace_step`).
      num_replicas: pipeline replicas sharing the microbatches (`Note: replicas`).
      replica_bucket_bytes: the largest all-reduce across replicas.
      replica_dims: per flat argument, the dimension split over the replicas (the
        argument is a replica's share: `Note: replica shares`), or None.
      arg_names: per flat argument, its path (for errors).
      task_times_ms: measured task times by task label, or None: the lowering orders
        messages for them (`build_program_with_names`).
      sends: how the runtime sends ("blocking" or "posted", `simulate.runtime_sends`):
        the lowering times its candidate orders that way.
      program_cache: where lowered programs are kept across processes (`Note: program
        cache` in compiler/program_cache.py), or None.

    Returns:
      The StepPlan.

    Raises:
      CompileError: the step cannot be pipelined (no loop, two loops, a stage count
        the schedule does not have, a microbatch count it rejects, ...).
    """
    with _collector_paused():
        return _build_step(fun, args, num_groups, in_specs=in_specs, out_specs=out_specs,
                           donate=donate, what=what, mesh=mesh, num_replicas=num_replicas,
                           replica_bucket_bytes=replica_bucket_bytes,
                           replica_dims=replica_dims, arg_names=arg_names,
                           task_times_ms=task_times_ms, sends=sends,
                           program_cache=program_cache)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block, as it was after it.

    Note: collector paused
      Building a plan allocates a few objects per instruction (walk states,
      instructions, buffer maps) and frees almost none of them until it ends, none in
      reference cycles. Each of the collector's full passes walks every live object,
      and their number grows with the program, so with the collector on the build's
      cost per instruction grows with the program's length (about 40% of lowering at
      30k instructions). It is paused while a plan is built; whatever cycles tracing
      leaves are collected at the collector's next pass after it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build_step(
    fun: Callable, args: Sequence[Any], num_groups: int, *,
    in_specs: Sequence[Spec | None] | None, out_specs: Sequence[Spec | None] | None,
    donate: Sequence[bool] | None, what: str, mesh: MpmdMesh | None, num_replicas: int,
    replica_bucket_bytes: int, replica_dims: Sequence[int | None] | None,
    arg_names: Sequence[str] | None, task_times_ms: Mapping[str, float] | None,
    sends: str, program_cache: ProgramCache | None,
) -> StepPlan:
    """`build_step`'s work, with the collector paused by the caller."""
    plain_fun, key_outputs = _keys_out(fun)
    traced = trace_step(plain_fun, args, what=what, mesh=mesh)
    jaxpr, loop, loop_index = traced.jaxpr, traced.loop, traced.loop_index
    params = loop.params
    schedule, n = params["schedule"], params["num_microbatches"]
    _check_schedule(schedule, num_groups)
    split = split_body(params["body"], schedule.num_stages,
                       partial_bwd=schedule.is_partial_bwd)
    num_consts = len(traced.consts)
    shares: dict[int, tuple[int, ...]] = {}
    if replica_dims is not None and any(d is not None for d in replica_dims):
        arg_names = arg_names or [f"#{j}" for j in range(len(replica_dims))]
        split, shares = replicas.localize_split(split, jaxpr, loop, num_consts, replica_dims,
                                                num_replicas, arg_names,
                                                getattr(mesh, "replica_axis_name", None))
    loop_homes = assign_loop_homes(split, schedule, len(loop.invars))
    homes = assign_outer_homes(jaxpr, loop_index, loop_homes.invariant_groups,
                               loop_homes.out_groups)
    names = OuterNames(jaxpr, loop_index, homes, loop_homes.out_groups)
    num_args = len(jaxpr.invars) - num_consts
    options = _options(in_specs, out_specs, donate, num_args, len(jaxpr.outvars))

    loop_outs, dropped = _loop_outputs(loop, names, loop_homes, n)
    n_local = replicas.local_microbatches(n, num_replicas)
    defer = mesh is not None and math.prod(mesh.group_shape.values()) > 1
    lo = _loop_order(split, loop_homes, schedule, n_local, num_replicas, n)

    def inv_value(j: int, g: int) -> Value:
        return names.value(loop.invars[j], g)

    lx = loop_exes(lo, split, params["ops"], params["body"].out_avals, inv_value, loop_outs,
                   defer=defer, state_length=n)
    pre, post = outer_segments(jaxpr, loop_index, homes, names, num_groups)
    input_avals, avals = _value_avals(jaxpr, num_consts, options, names, lx.state_avals,
                                      dropped)
    for k, shape in shares.items():  # `Note: replica shares`: each rank holds its share
        input_avals[k] = dataclasses.replace(input_avals[k], shape=shape)
        avals[input_value(k)] = input_avals[k]
    outputs = _step_outputs(jaxpr, names, homes.output_group, options.out_specs, avals)
    consts = tuple(jax.random.key_data(c) if _has_key(c) else c for c in traced.consts)

    # Each group runs its pre segment, its loop tasks, then its post segments by level.
    # The segments see of the loop tasks only the group's values they read (no value of
    # one microbatch is a segment's), so one stand-in task reading those takes their
    # place until the task graph is built (`step_entry.lowered_entry`), and a step
    # entry's hit makes the segments' executables without any loop task node.
    stand_ins = [TaskNode("loop", g, "loop", lx.reads[g], ()) for g in range(num_groups)]
    orders = [([pre[g]] if pre[g] else []) + [stand_ins[g]] + post[g] for g in range(num_groups)]
    kept = {v for v, _ in outputs.values}
    step_index = ({input_value(num_consts + k): k for k in range(num_args)},
                  {v: k for v, k in reversed(outputs.values)})
    read = kept.union(*(item.ins for order in orders for item in order))
    donatable = {input_value(num_consts + k) for k in range(num_args)
                 if options.donate[k]} - kept
    tasks: list[list[TaskNode]] = []
    exes: list[dict[str, Exe]] = []
    for g, order in enumerate(orders):
        group_tasks, segment_exes = segment_tasks(order, g, names, read, donatable, avals,
                                                  step_index)
        tasks.append(group_tasks)
        exes.append({**lx.exes[g], **segment_exes})

    key = None
    if program_cache is not None:
        key = step_key(key_parts(jaxpr, consts, split, schedule, lo, num_groups, options,
                                  num_replicas, replica_dims, defer, mesh),
                       task_times_ms, sends)
    entry, read_s = cached_entry(program_cache, key, exes, input_avals)
    from_cache = read_s is not None
    if entry is None:
        nodes = loop_task_nodes(lo, split, params["ops"], params["body"].out_avals,
                                inv_value, loop_outs, defer=defer, state_length=n)
        entry, from_cache = lowered_entry(
            nodes, tasks, stand_ins, input_avals, avals, homes.input_owner, outputs.values,
            what=what, split=split, task_times_ms=task_times_ms, sends=sends,
            cache=program_cache)
        if key is not None:
            program_cache.store_step(key, entry)
    program = entry.program
    if num_replicas > 1:
        program = replicas.add_reductions(program, entry.buffer_names, loop_outs,
                                          loop_homes.out_groups, params["ops"],
                                          replica_bucket_bytes)
    return StepPlan(
        program=program,
        buffer_names=entry.buffer_names,
        exes=tuple(exes),
        exe_avals=entry.exe_avals,
        consts=consts,
        num_args=num_args,
        input_avals=entry.input_avals,
        input_owner=entry.input_owner,
        mb_inputs=entry.mb_inputs,
        outputs=tuple(outputs.descs),
        output_avals=tuple(outputs.avals),
        output_fixed=tuple(spec is not None for spec in options.out_specs),
        donated=tuple(options.donate),
        out_tree=traced.out_tree,
        key_args=tuple(is_key(v.aval.dtype) for v in jaxpr.invars[num_consts:]),
        key_outputs=tuple(key_outputs),
        output_weak=tuple(bool(getattr(v.aval, "weak_type", False)) for v in jaxpr.outvars),
        num_replicas=num_replicas,
        replica_microbatches=n_local,
        step_jaxpr=jaxpr,
        program_from_cache=from_cache,
        step_from_cache=read_s is not None,
        cache_read_s=read_s or 0.0,
    )
