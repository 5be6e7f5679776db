"""What the planner compiles: one task of each kind per stage segment, and the code around
the loop, for XLA's FLOPs and scratch bytes (`Note: planner task costs` in costs.py); and
the one thing it runs: the costliest segment's forward and backward, for the time a FLOP
of this step takes on this device.

A step with M stage marks is split at all of them (`split_body`, once whole and once
with the backward split into I and W): M segments of F, B, I and W tasks, each compiled
once on one device of the mesh, whatever the candidate schedules. The executables of a
candidate's program (its outer segments, or all of them for exact memory) are compiled
once per distinct module: two candidates, or two planning runs in one process, sharing
an executable share its compile.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.compiler.build import StepPlan
from jaxpp_mpi._src.compiler.exes import first_from_plain
from jaxpp_mpi._src.compiler.split import split_body
from jaxpp_mpi._src.compiler.trace_step import trace_step
from jaxpp_mpi._src.driver.group_compiler import GroupCompiler, flops, lower_exe, memory_stats
from jaxpp_mpi._src.planner.costs import KINDS
from jaxpp_mpi._src.planner.restage import count_marks
from jaxpp_mpi._src.schedules.tasks import TaskType

__all__ = ["Compiled", "ExeCosts", "Loop", "SegmentTasks", "measured_ms_per_flop",
           "probe_ms_per_flop", "segment_tasks", "traced_loop"]


@dataclasses.dataclass(frozen=True)
class Loop:
    """The traced step's microbatch loop.

    Attributes:
      body: the `treduce_p` body.
      num_microbatches: its microbatch count.
      schedule: the step's own schedule.
      num_marks: its forward stage marks.
    """

    body: jex_core.ClosedJaxpr
    num_microbatches: int
    schedule: Any
    num_marks: int


def traced_loop(step: Callable, args: Sequence[Any], mesh: MpmdMesh) -> Loop:
    """Traces `step(*args)` (abstract leaves allowed) as the compiler does; its loop."""
    leaves, tree = jax.tree.flatten(tuple(args))
    traced = trace_step(lambda *xs: step(*jax.tree.unflatten(tree, xs)), leaves,
                        what=getattr(step, "__name__", "the step"), mesh=mesh)
    params = traced.loop.params
    return Loop(params["body"], params["num_microbatches"], params["schedule"],
                count_marks(params["body"]))


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One compiled module: its per-device FLOPs and scratch bytes, and what runs it."""

    flops: float
    temp_bytes: int
    executable: Any


# Each module compiled in this process, by its text and the devices it was lowered for:
# plans of one step share their compiles.
_COMPILED: dict[tuple[str, str], Compiled] = {}


def _compiled(lowered: jax.stages.Lowered, where: str) -> tuple[Compiled, bool]:
    """The compiled module, and whether it was compiled now (not found in the cache)."""
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), where)
    if key in _COMPILED:
        return _COMPILED[key], False
    exe = lowered.compile()
    stats = memory_stats(exe)
    _COMPILED[key] = Compiled(flops(exe), (stats or {}).get("temp_size_in_bytes", 0), exe)
    return _COMPILED[key], True


@dataclasses.dataclass(frozen=True)
class SegmentTasks:
    """The result of `segment_tasks`.

    Attributes:
      flops: kind letter -> per segment, per-device FLOPs of one microbatch's task (0
        where a segment has no task of that kind: the first segment's I).
      temp_bytes: kind letter -> per segment, its scratch bytes.
      compiled: (kind letter, segment) -> the compiled task.
      in_avals: (kind letter, segment) -> its input avals.
      compiles: the XLA compiles it took (not found compiled in this process).
    """

    flops: dict[str, list[float]]
    temp_bytes: dict[str, list[int]]
    compiled: dict[tuple[str, int], Compiled]
    in_avals: dict[tuple[str, int], list[jax.ShapeDtypeStruct]]
    compiles: int


def segment_tasks(loop: Loop, device: jax.Device, devices_per_group: int = 1
                  ) -> SegmentTasks:
    """Each stage segment's F, B, I and W task of one microbatch, compiled alone on
    `device`, with XLA's per-device FLOPs and scratch bytes.

    On a group of several devices each is the whole task's over `devices_per_group`
    (an estimate: the task is compiled unsharded).
    """
    m = loop.num_marks
    out = SegmentTasks({k: [0.0] * m for k in KINDS}, {k: [0] * m for k in KINDS}, {}, {}, 0)
    compiles = 0
    one = jax.sharding.SingleDeviceSharding(device)
    for partial in (False, True):
        split = split_body(loop.body, m, partial_bwd=partial)
        for task in split.tasks:
            kind, s = task.key[0].value, task.key[1]
            if partial and kind == TaskType.FWD.value:
                continue  # the same forward either way
            avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)
                     for a in task.jaxpr.in_avals]
            lowered = jax.jit(jex_core.jaxpr_as_fun(task.jaxpr)).lower(*avals)
            c, new = _compiled(lowered, str(device))
            out.flops[kind][s] = c.flops / devices_per_group
            out.temp_bytes[kind][s] = int(c.temp_bytes // devices_per_group)
            out.compiled[(kind, s)], out.in_avals[(kind, s)] = c, avals
            compiles += new
    return dataclasses.replace(out, compiles=compiles)


def _best_ms(exe: Any, args: Sequence[Any], repeats: int) -> float:
    jax.block_until_ready(exe(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(exe(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


# ms per FLOP by the ids of the timed tasks' `Compiled` (kept alive by `_COMPILED`): a
# step is timed once per process, so its planning runs price alike.
_RATES: dict[tuple[int, ...], float | None] = {}


def measured_ms_per_flop(tasks: SegmentTasks, device: jax.Device, overhead_ms: float,
                         repeats: int = 3) -> float | None:
    """ms per FLOP of the step's own costliest segment: its forward and backward run
    on zeros, the best of `repeats` each, less `overhead_ms` each (once per process; the
    planner takes a task run alone as all work: 0); None
    where its inputs are not all numbers (typed keys) or it has no FLOPs."""
    fb = [tasks.flops["F"][j] + tasks.flops["B"][j] for j in range(len(tasks.flops["F"]))]
    j = max(range(len(fb)), key=fb.__getitem__)
    key = tuple(id(tasks.compiled.get((kind, j))) for kind in "FB")
    if key not in _RATES:
        _RATES[key] = _time_segment(tasks, j, fb[j], device, overhead_ms, repeats)
    return _RATES[key]


def _time_segment(tasks: SegmentTasks, j: int, flops_fb: float, device: jax.Device,
                  overhead_ms: float, repeats: int) -> float | None:
    total_ms = 0.0
    for kind in "FB":
        avals = tasks.in_avals.get((kind, j))
        if avals is None or not all(np.issubdtype(np.dtype(a.dtype), np.number)
                                    or np.dtype(a.dtype) == np.bool_ for a in avals):
            return None
        zeros = [jax.device_put(np.zeros(a.shape, a.dtype), device) for a in avals]
        total_ms += max(0.0, _best_ms(tasks.compiled[(kind, j)].executable, zeros, repeats)
                        - overhead_ms)
    return total_ms / flops_fb if flops_fb > 0 and total_ms > 0 else None


class ExeCosts:
    """Per-device FLOPs and scratch bytes of a candidate's executables, each distinct
    module compiled once (on a group of this process: every group has its shape).

    Args:
      mesh: the mesh.
      num_groups: the programs' group count.
    """

    def __init__(self, mesh: MpmdMesh, num_groups: int):
        self._compiler = GroupCompiler(mesh, num_groups)
        self._group = mesh.local_groups[0]
        self._where = str(self._compiler.auto_mesh(self._group))
        self.compiles = 0

    def of(self, plan: StepPlan, g: int, name: str) -> tuple[float, int]:
        """(FLOPs, scratch bytes) of one run of group `g`'s executable `name`; a `_first`
        variant built from its plain one (`Note: first variants`) counts as that one, as
        the runtime runs it."""
        via = first_from_plain(plan.exes[g], plan.exe_avals[g], name)
        if via is not None:
            name = via[0]
        ins, outs = plan.exe_avals[g][name]
        lowered = lower_exe(plan.exes[g][name], ins, outs,
                            functools.partial(self._compiler.sharding, self._group))
        c, new = _compiled(lowered, self._where)
        self.compiles += new
        return c.flops, c.temp_bytes


def probe_ms_per_flop(device: jax.Device, n: int = 512, repeats: int = 5) -> float:
    """ms per FLOP of a float32 n x n matrix product on `device`, the best of `repeats`:
    the rate at which the planner prices XLA's FLOPs when the step's own tasks cannot
    be timed (`measured_ms_per_flop`)."""
    x = jax.device_put(np.ones((n, n), np.float32), device)
    product = jax.jit(lambda a: a @ a).lower(x).compile()
    jax.block_until_ready(product(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(product(x))
        best = min(best, time.perf_counter() - start)
    return best * 1e3 / (2.0 * n ** 3)
