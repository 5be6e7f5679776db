"""`plan_schedules`: every schedule of the library simulated on a traced step, and ranked.

Note: planning a step.
  The step is traced once as written (`traced_loop`): its microbatch count n0, its M
  stage marks and its batch rows. Its loop body is split at all M marks and each
  segment's F, B, I and W task compiled once, for the cost table (`Note: planner task
  costs` in costs.py), priced by XLA's FLOPs (at the time per FLOP of the costliest
  segment's forward and backward, run once; under MPI the fastest rank's, so that the
  ranks rank alike: `agreed_rate`) or by measured task times. Then for every
  candidate (candidates.py: each registry schedule, with 1 to 4 stages per group where
  the marks allow, at each microbatch count that divides the batch rows) and each
  stage split worth trying (the even split; the one whose costliest stage, and the one
  whose busiest group, costs least: split.py), the step is
  restaged (`Note: restaging`) and lowered as `compile` would lower it
  (`MpmdFunction.step_plan`: no device, no compile of the loop tasks). Its program is
  played by the simulator (`ir/simulate.simulate`, with the runtime's sends on this
  platform and the given message cost) for the step time and the bubble, and walked by
  `ir/memory.live_bytes` for each group's peak device bytes, with each loop task's
  scratch estimated from the table (or XLA's own, compiled, with `exact_memory`) and
  the code around the loop compiled (each distinct module once) for its FLOPs and
  scratch. A candidate keeps its best split: one that fits before one that does not,
  then the faster. `ranking.rank` orders them and says why the first is first.

  A program lowered in local mode is the one `compile` in local mode runs; its memory is
  exactly `MpmdCompiled.memory_analysis()`'s with `exact_memory` (tested). Predicted
  times are estimates: the work of a row is taken as the same at every microbatch
  size, a message costs `message_cost` (nothing when not given), and every instruction
  what `runtime_cost` says the runtime adds for it, charged on its group's clock
  (`Note: runtime costs` in runtime_cost.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Comm
from jaxpp_mpi._src.driver.arguments import abstract
from jaxpp_mpi._src.frontend.api import MpmdFunction
from jaxpp_mpi._src.ir.memory import live_bytes
from jaxpp_mpi._src.ir.program import Run
from jaxpp_mpi._src.ir.simulate import MessageCost, runtime_sends, simulate
from jaxpp_mpi._src.planner import candidates as cands
from jaxpp_mpi._src.planner.costs import (
    SegmentCosts,
    from_flops,
    from_measured,
    run_ms,
    run_temp_bytes,
)
from jaxpp_mpi._src.planner.families import (
    ExeCosts,
    measured_ms_per_flop,
    probe_ms_per_flop,
    segment_tasks,
    traced_loop,
)
from jaxpp_mpi._src.planner.ranking import Plan, parse_bytes, rank
from jaxpp_mpi._src.planner.restage import microbatched, restage
from jaxpp_mpi._src.planner.runtime_cost import DEFAULT_RUNTIME_COST, RuntimeCost, run_charges
from jaxpp_mpi._src.planner.split import splits_to_try, stage_segments
from jaxpp_mpi._src.runtime.agree import allgather, allgather_or_raise
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = ["Planning", "agreed_rate", "plan", "plan_schedules", "same_inputs"]

logger = logging.getLogger("jaxpp_mpi")


@dataclasses.dataclass(frozen=True)
class Planning:
    """Everything a planning run found (`plan`).

    Attributes:
      plans: the ranked plans.
      costs: the segment cost table the plans were priced from.
      skipped: (schedule, stages, microbatches, reason) of each configuration not
        planned.
      num_marks: the step's stage marks.
      compiles: the XLA compiles the run took.
      runtime_cost: what the runtime was taken to add per instruction.
    """

    plans: list[Plan]
    costs: SegmentCosts
    skipped: list[tuple[str, int, int, str]]
    num_marks: int
    compiles: int
    runtime_cost: RuntimeCost = DEFAULT_RUNTIME_COST


def _argnums(batch_argnums: int | Sequence[int] | None) -> tuple[int, ...]:
    if batch_argnums is None:
        return ()
    return (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)


def _batch_rows(args: tuple, argnums: tuple[int, ...], n0: int) -> int:
    """The batch's rows (microbatches x rows per microbatch), checked against the loop."""
    totals = set()
    for k in argnums:
        if not 0 <= k < len(args):
            raise ValueError(f"batch_argnums names argument {k}; the step takes {len(args)}")
        for x in jax.tree.leaves(args[k]):
            if len(x.shape) < 2 or x.shape[0] != n0:
                raise ValueError(
                    f"batch argument {k} has a leaf of shape {x.shape}: a batch leaf is "
                    f"(microbatches={n0}, rows, ...), as the step's treduce slices it")
            totals.add(x.shape[0] * x.shape[1])
    if len(totals) > 1:
        raise ValueError(f"the batch's leaves disagree on their rows: {sorted(totals)}")
    return totals.pop() if totals else n0


def _counts(requested: Sequence[int] | None, total: int, mpmd_dim: int, n0: int,
            argnums: tuple[int, ...]) -> tuple[int, ...]:
    if not argnums:
        if requested is not None and tuple(requested) != (n0,):
            raise ValueError("planning other microbatch counts than the step's own "
                             f"({n0}) needs batch_argnums: which arguments to re-split")
        return (n0,)
    if requested is None:
        return cands.microbatch_counts(total, mpmd_dim)
    bad = [n for n in requested if n < 1 or total % n]
    if bad:
        raise ValueError(f"microbatch counts {bad} do not divide the batch's {total} rows")
    return tuple(requested)


def _sends(device: jax.Device) -> str:
    """How an MPI run on `device`'s platform sends (`simulate.runtime_sends`)."""
    options = config.options()
    return runtime_sends(device.platform, options.posted_sends,
                         config.stages_messages(options, device.platform))


RATE_LABEL = "plan_schedules agreement"
"""The deadline label of the ranks' agreements in `plan_schedules` (`agreed_rate`,
`same_inputs`)."""


def agreed_rate(measure: Callable[[], float], comm: Comm | None) -> float:
    """The planner's ms per FLOP, the same on every rank: each rank's `measure()`, the
    fastest of them (the best of the ranks' runs, as each rank keeps its best run).

    Ranks time the same segment at different speeds (measured on this VM: 10.8 to
    13.1 ms predicted for one plan in four processes), and two plans a percent apart
    would then be ranked differently on different ranks, which would then build
    different programs. So under MPI this is a collective of `comm` (every rank of the
    job), under the deadline `RATE_LABEL`; `comm=None` (local mode) measures alone.

    Raises:
      RuntimeError: on every rank, when some rank's `measure` raised (its own error,
        where every rank's did).
    """
    def failure(failed: list[int], messages: Sequence[str | None]) -> Exception:
        first = next(m for m in messages if m is not None)
        return RuntimeError(f"plan_schedules: rank(s) {failed} could not time the step's "
                            f"costliest segment ({first}); every rank stops planning")
    error, rate = None, 0.0
    try:
        rate = measure()
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    rates = allgather_or_raise(rate, error, comm, failure, own="if_all", label=RATE_LABEL)
    return min(rates)


def same_inputs(measured: Mapping[str, Any], comm: Comm | None) -> None:
    """Raises on every rank unless every rank of `comm` was given the same `measured`
    planning inputs (name -> value: task times, runtime and message costs); one
    allgather of their digests, under the deadline `RATE_LABEL` (nothing alone).

    Raises:
      ValueError: some differ, naming each input and the ranks where it differs from
        rank 0's.
    """
    def number(v: Any) -> str:
        # a number by its value (1 and 1.0 agree), anything else by its repr: a rank
        # alone passing a non-number is told so with the others, not left behind
        try:
            return repr(float(v))
        except (TypeError, ValueError):
            return f"not a number: {v!r}"

    def digest(value: Any) -> str:
        if isinstance(value, Mapping):
            value = sorted((repr(k), number(v)) for k, v in value.items())
        return hashlib.sha256(repr(value).encode()).hexdigest()

    every = allgather({name: digest(v) for name, v in measured.items()}, comm, RATE_LABEL)
    differ = {name: [r for r, d in enumerate(every) if d[name] != every[0][name]]
              for name in measured}
    named = [f"{name} on rank(s) {ranks}" for name, ranks in differ.items() if ranks]
    if named:
        raise ValueError(
            f"plan_schedules: {', '.join(named)} differ from rank 0's; every rank must "
            "plan from the same inputs, or the ranks rank the plans differently: merge "
            "every rank's measurements (e.g. collect_task_times_ms on each, allgathered "
            "into one dict, as in docs/performance.md) and pass the same on every rank")


def _segment_rate(task_ms: Mapping[str, float] | None, reference: Callable[[], Any],
                  exe_costs: ExeCosts, overhead_ms: float, default: float) -> float:
    """ms per FLOP of the code around the loop: from its measured times over the FLOPs
    of the step as written, when `task_ms` times it, else `default`."""
    measured = {label: t for label, t in (task_ms or {}).items()
                if all(p.kind in ("pre", "post") for p in parse_label(label))}
    if not measured:
        return default
    sp = reference()
    total_ms = total_flops = 0.0
    for g, gp in enumerate(sp.program.groups):
        for r in gp.instrs:
            if isinstance(r, Run) and r.task in measured and not sp.exes[g][r.exe].family:
                total_ms += max(0.0, measured[r.task] - overhead_ms)
                total_flops += exe_costs.of(sp, g, r.exe)[0]
    return total_ms / total_flops if total_flops > 0 else default


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """What pricing a candidate program takes (`Note: planning a step`)."""

    function: Callable[[Callable], MpmdFunction]  # a step -> its MpmdFunction
    rebatched: Callable[[int], tuple]  # microbatch count -> the example arguments
    rows: int  # the batch's rows
    costs: SegmentCosts
    exe_costs: ExeCosts
    segment_rate: float  # ms per FLOP of the code around the loop
    transfer: MessageCost
    runtime: RuntimeCost
    sends: str
    axis_sizes: dict[str, int]
    exact_memory: bool


def _evaluate(step: Callable, c: cands.Candidate, marks: tuple[int, ...],
              pricing: _Pricing) -> Plan:
    """The plan of one candidate and split: its program lowered, simulated and walked."""
    sp = pricing.function(restage(step, c.schedule, marks)).step_plan(
        *pricing.rebatched(c.num_microbatches))
    costs, stages = pricing.costs, stage_segments(marks)
    rows = pricing.rows // c.num_microbatches
    segment_ms: dict[str, float] = {}
    peaks = []
    for g, gp in enumerate(sp.program.groups):
        temp_of: dict[str, int] = {}
        for r in gp.instrs:
            if not isinstance(r, Run) or r.exe in temp_of:
                continue
            in_loop = bool(sp.exes[g][r.exe].family)
            if pricing.exact_memory or not in_loop:
                f, temp_of[r.exe] = pricing.exe_costs.of(sp, g, r.exe)
                if not in_loop:
                    segment_ms[r.task] = f * pricing.segment_rate
            else:
                temp_of[r.exe] = run_temp_bytes(r.task, costs, stages, rows)
        peaks.append(live_bytes(gp, pricing.axis_sizes, temp_of).peak_bytes)
    labels = {r.task for gp in sp.program.groups for r in gp.instrs if isinstance(r, Run)}
    # work alone; what the runtime adds is charged per instruction (`Note: runtime costs`)
    work = run_ms(labels, dataclasses.replace(costs, overhead_ms=0.0), stages, rows,
                  segment_ms)
    charges = run_charges(sp.program, pricing.runtime)
    sim = simulate(sp.program, lambda r: work[r.task] + charges[id(r)], pricing.transfer,
                   sends=pricing.sends)
    span = sim.makespan
    bubble = sum(1 - b / span for b in sim.busy) / len(sim.busy) if span > 0 else 0.0
    scale = rows / costs.rows
    stage_ms = tuple(scale * (costs.stage_work("F", seg) + costs.stage_work("B", seg))
                     for seg in stages)
    return Plan(c.schedule, c.num_microbatches, marks, span, bubble, tuple(peaks),
                busy_ms=tuple(sim.busy), stage_ms=stage_ms)


def _best_split(step: Callable, c: cands.Candidate, splits: Sequence[tuple[int, ...]],
                pricing: _Pricing, limit: int | None, skips: list) -> Plan | None:
    """The candidate's plan with its best split: one that fits, then the fastest."""
    best = None
    for marks in splits:
        try:
            p = _evaluate(step, c, marks, pricing)
        except CompileError as e:
            skips.append((c.name, c.num_stages, c.num_microbatches, str(e)))
            continue
        key = (limit is not None and p.peak > limit, p.step_ms)
        if best is None or key < best[0]:
            best = (key, p)
    return None if best is None else best[1]


def plan(step: Callable, *example_args: Any, mpmd_mesh: MpmdMesh,
         memory_limit: int | str | None = None,
         task_times_ms: Mapping[str, float] | None = None,
         measured_plan: Plan | None = None,
         batch_argnums: int | Sequence[int] | None = None,
         num_microbatches: Sequence[int] | None = None,
         schedules: Sequence[str] | None = None,
         in_shardings: Any = None, out_shardings: Any = None, donate_argnums: Any = None,
         balance_stages: bool = True, exact_memory: bool = False,
         message_cost: tuple[float, float] | None = None,
         runtime_cost: RuntimeCost | None = None,
         stages_per_group: Sequence[int] | None = None) -> Planning:
    """`plan_schedules`, with the cost table and what was skipped (`Note: planning a
    step`); the arguments are `plan_schedules`'."""
    mesh = mpmd_mesh
    if not isinstance(mesh, MpmdMesh):
        raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(mesh).__name__}")
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    runtime = DEFAULT_RUNTIME_COST if runtime_cost is None else runtime_cost
    if not isinstance(runtime, RuntimeCost):
        raise TypeError("runtime_cost must be a RuntimeCost (ms per Run, message half and "
                        f"Free), got {type(runtime).__name__}")
    overhead = runtime.run_ms
    comm = None if mesh.is_local else mesh.job_comm
    same_inputs({"task_times_ms": task_times_ms or {}, "runtime_cost": runtime,
                 "message_cost": message_cost}, comm)
    args = jax.tree.map(abstract, tuple(example_args))
    loop = traced_loop(step, args, mesh)
    n0, num_marks = loop.num_microbatches, loop.num_marks
    argnums = _argnums(batch_argnums)
    total = _batch_rows(args, argnums, n0)
    counts = _counts(num_microbatches, total, mesh.mpmd_dim, n0, argnums)
    device = mesh.group_mesh(mesh.local_groups[0]).devices.flat[0]
    tasks = segment_tasks(loop, device, math.prod(mesh.group_shape.values()))
    measured_n = n0 if measured_plan is None else measured_plan.num_microbatches
    if task_times_ms:
        marks = range(num_marks) if measured_plan is None else measured_plan.stage_marks
        costs, rate = from_measured(task_times_ms, tasks.flops, tasks.temp_bytes,
                                    total // measured_n, overhead,
                                    stage_segments(tuple(marks)))
    else:
        # a task timed alone is all work: the runtime's cost per Run is in-step
        rate = agreed_rate(
            lambda: measured_ms_per_flop(tasks, device, 0.0) or probe_ms_per_flop(device),
            comm)
        costs = from_flops(tasks.flops, tasks.temp_bytes, total // n0, rate, overhead)

    def function(fun: Callable) -> MpmdFunction:
        return MpmdFunction(fun, mesh, in_shardings, out_shardings, donate_argnums)

    def rebatched(n: int) -> tuple:
        return tuple(microbatched(a, n) if k in argnums else a for k, a in enumerate(args))

    def measured_step() -> Any:
        if measured_plan is None:
            return function(step).step_plan(*args)
        return function(measured_plan.apply(step)).step_plan(*rebatched(measured_n))

    exe_costs = ExeCosts(mesh, mesh.mpmd_dim)
    latency, bandwidth = message_cost if message_cost is not None else (0.0, float("inf"))
    pricing = _Pricing(
        function, rebatched, total, costs, exe_costs,
        _segment_rate(task_times_ms, measured_step, exe_costs, overhead, rate),
        MessageCost(latency, bandwidth), runtime, _sends(device),
        dict(mesh.group_shape), exact_memory)
    fb = [costs.work_ms["F"][j] + costs.work_ms["B"][j] for j in range(num_marks)]
    found, skipped = cands.candidates(mesh.mpmd_dim, num_marks, counts, schedules,
                                      stages_per_group)
    skips = [(s.name, s.num_stages, s.num_microbatches, s.reason) for s in skipped]
    plans = []
    for c in found:
        groups = [c.schedule.get_mpmd_idx(s) for s in range(c.num_stages)]
        splits = splits_to_try(fb, groups, balance_stages)
        if not splits:
            skips.append((c.name, c.num_stages, c.num_microbatches,
                          f"{c.num_stages} stages do not divide the step's {num_marks} "
                          "marks evenly (balance_stages=True chooses other splits)"))
        best = _best_split(step, c, splits, pricing, limit, skips)
        if best is not None:
            plans.append(best)
    for name, stages, n, why in skips:
        logger.info("plan: %s with %d stages and %d microbatches skipped: %s", name, stages,
                    n, why)
    return Planning(rank(plans, limit), costs, skips, num_marks,
                    tasks.compiles + exe_costs.compiles, runtime)


def plan_schedules(step: Callable, *example_args: Any, mpmd_mesh: MpmdMesh,
                   memory_limit: int | str | None = None,
                   task_times_ms: Mapping[str, float] | None = None,
                   measured_plan: Plan | None = None,
                   batch_argnums: int | Sequence[int] | None = None,
                   num_microbatches: Sequence[int] | None = None,
                   schedules: Sequence[str] | None = None,
                   in_shardings: Any = None, out_shardings: Any = None,
                   donate_argnums: Any = None, balance_stages: bool = True,
                   exact_memory: bool = False,
                   message_cost: tuple[float, float] | None = None,
                   runtime_cost: RuntimeCost | None = None,
                   stages_per_group: Sequence[int] | None = None) -> list[Plan]:
    """Predicts every library schedule's step time and memory on `step`, fastest first;
    under MPI a collective of every rank of the job.

    Nothing runs on a device but one compile per task kind and stage segment (and per
    distinct module of the code around the loop): see `Note: planning a step`. Under
    MPI every rank calls it, and the ranks take the fastest rank's time per FLOP
    (`agreed_rate`) and check that they were given the same `task_times_ms`,
    `runtime_cost` and `message_cost` (`same_inputs`), so that every rank ranks the
    plans alike and applies the same one.

    Args:
      step: the training step as for `mpmd_jit_with_loop` (one `treduce`, stage marks in
        its loop body; any schedule: the planner replaces it). Marked after every layer,
        it can be split into any number of stages up to its marks.
      *example_args: its arguments, arrays or `jax.ShapeDtypeStruct`s.
      mpmd_mesh: the mesh it will run on.
      memory_limit: device memory per device, bytes or text ('80GiB'): plans over it
        are marked as not fitting and ranked last.
      task_times_ms: measured task times of one traced step of `step` as written
        (`collect_task_times_ms`, every rank's merged), for times in ms to trust;
        without them the tasks are priced by XLA's FLOPs at the time per FLOP of the
        step's costliest segment, run once (`Note: planner task costs`).
      measured_plan: the plan `task_times_ms` were measured under (`Plan.apply`), when
        not the step as written.
      batch_argnums: the arguments holding the batch `treduce` slices (leaves
        (microbatches, rows, ...)): given, other microbatch counts are planned too.
      num_microbatches: the counts to plan (default: every divisor of the batch rows
        from `mpmd_dim` up to 64, or the step's own without `batch_argnums`).
      schedules: registry names to plan (default: all, `SCHEDULE_NAMES`).
      in_shardings, out_shardings, donate_argnums: as for `mpmd_jit_with_loop`.
      balance_stages: also try the splits whose costliest stage and busiest group cost
        least (`Note: restaging`; else only the even split).
      exact_memory: compile every distinct executable for XLA's scratch bytes instead of
        estimating the loop tasks' from the segment table.
      message_cost: (latency ms, bytes per ms) of a message between groups (default:
        free but for its dispatch).
      runtime_cost: what the runtime adds per Run, message half and Free, charged on
        the group's clock (`Note: runtime costs`; default `RuntimeCost()`, fitted on a
        2-core CPU VM: fit it on other machines, `RuntimeCost.fit_to_traced_steps`).
      stages_per_group: the stages per group to plan (default: 1 to 4, as the step's
        marks and each schedule allow).

    Returns:
      The plans, ranked (`Plan.reason` on the first says why); `Plan.apply(step)` and
      `Plan.batch(batch)` run one.

    Raises:
      TypeError, ValueError: bad arguments.
      CompileError: the step cannot be pipelined as written.
    """
    return plan(step, *example_args, mpmd_mesh=mpmd_mesh, memory_limit=memory_limit,
                task_times_ms=task_times_ms, measured_plan=measured_plan,
                batch_argnums=batch_argnums, num_microbatches=num_microbatches, schedules=schedules,
                in_shardings=in_shardings, out_shardings=out_shardings,
                donate_argnums=donate_argnums, balance_stages=balance_stages,
                exact_memory=exact_memory, message_cost=message_cost,
                runtime_cost=runtime_cost, stages_per_group=stages_per_group).plans
