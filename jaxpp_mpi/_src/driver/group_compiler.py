"""`GroupCompiler`: a step plan's executables compiled for this process's groups.

It runs the layout pass on groups of more than one device (`Note: layouts` in
ir/layouts.py), compiling the executables it lays out on the way (a deferred family
the deferred way: `Note: deferred reduction` in compiler/deferred.py), then compiles
the rest: one by one in local mode, with the other ranks in MPI mode (`Note: shared
compiles` in shared_compiles.py). A `_first` variant whose family's plain variant is
compiled runs as that plain variant on fresh identity states (`Note: first variants`
in compiler/exes.py), so each family costs one compile.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.base import compat
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Spec
from jaxpp_mpi._src.compiler import deferred
from jaxpp_mpi._src.compiler.build import StepPlan
from jaxpp_mpi._src.compiler.exes import Exe, first_from_plain
from jaxpp_mpi._src.driver import shared_compiles
from jaxpp_mpi._src.ir.instructions import program_spec
from jaxpp_mpi._src.ir.layouts import LayoutError, donation_pairs, infer_layouts
from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.runtime import agree, failure

__all__ = ["GroupCompiler", "compile_exe", "flops", "lower_exe"]

# Progress of compilation, at INFO on rank 0 (local mode: the one process); quiet unless
# the application enables it, e.g. logging.basicConfig(level=logging.INFO).
logger = logging.getLogger("jaxpp_mpi")
_REPORT_EVERY_S = 5.0
_FILL = "/fill"  # a `_first` variant's identity fill, among a group's compile jobs

Jobs = dict[str, tuple[Exe, Sequence[Aval], Sequence[Aval]]]
"""A group's compile jobs: name -> (executable, input avals, output avals)."""


def lower_exe(exe: Exe, in_avals: Sequence[Aval], out_avals: Sequence[Aval],
              sharding: Callable[[Aval], jax.sharding.Sharding],
              free: Sequence[bool] = ()) -> jax.stages.Lowered:
    """Lowers one executable for one group, every buffer laid out as its Aval says (the
    arguments as for `compile_exe`)."""
    in_sh = tuple(sharding(a) for a in in_avals)
    out_sh = tuple(None if j < len(free) and free[j] else sharding(a)
                   for j, a in enumerate(out_avals))
    structs = [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype), sharding=s)
               for a, s in zip(in_avals, in_sh)]
    jitted = jax.jit(exe.fn, in_shardings=in_sh, out_shardings=out_sh,
                     donate_argnums=exe.donate_argnums)
    return jitted.lower(*structs)


def compile_exe(exe: Exe, in_avals: Sequence[Aval], out_avals: Sequence[Aval],
                sharding: Callable[[Aval], jax.sharding.Sharding],
                free: Sequence[bool] = (),
                compiler_options: dict[str, Any] | None = None) -> jax.stages.Compiled:
    """AOT-compiles one executable for one group, every buffer laid out as its Aval says.

    Args:
      exe: the executable.
      in_avals: its input avals; out_avals: its output avals.
      sharding: Aval -> the sharding of such a value on the group.
      free: per output, True where XLA chooses its layout (`Note: layouts`); the
        compiled executable's `output_shardings` say what it chose.
      compiler_options: XLA options, as `jax.jit(...).lower(...).compile` takes them.

    Returns:
      A `jax.stages.Compiled`: called with the input arrays, it returns the outputs.
    """
    return lower_exe(exe, in_avals, out_avals, sharding, free).compile(compiler_options or None)


def flops(exe: jax.stages.Compiled) -> float:
    """Per-device FLOPs of one run of `exe`, from XLA's cost analysis (0 if none)."""
    cost = exe.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes")


def memory_stats(exe: jax.stages.Compiled) -> dict[str, int] | None:
    """XLA's memory analysis of one run of `exe`, per device, as a dict of its byte
    counts (`argument_size_in_bytes`, `output_size_in_bytes`, `alias_size_in_bytes`,
    `temp_size_in_bytes`, `generated_code_size_in_bytes`), or None where the backend
    gives none."""
    stats = exe.memory_analysis()
    if isinstance(stats, (list, tuple)):  # older JAX: one entry per program
        stats = stats[0] if stats else None
    if stats is None:
        return None
    return {f: int(getattr(stats, f, 0) or 0) for f in _MEMORY_FIELDS}


def _compile_failed(failed: list[int], messages: Sequence[str | None]) -> CompileError:
    """The error every rank raises when some ranks failed to compile their executables
    while the ranks were agreeing on layouts."""
    return CompileError(f"rank(s) {failed} failed to compile their executables: "
                        f"{messages[failed[0]]}")


class _FromPlain:
    """A `_first` variant run as its family's plain variant on states that hold each
    reduction's identity (`Note: first variants` in compiler/exes.py).

    Args:
      plain: the plain variant, compiled; its last inputs are the states (donated).
      fill: compiled, of no inputs: returns fresh identity states.
    """

    def __init__(self, plain: jax.stages.Compiled, fill: jax.stages.Compiled):
        self.plain = plain
        self.fill = fill

    def __call__(self, *args: Any) -> Sequence[jax.Array]:
        return self.plain(*args, *self.fill())

    def cost_analysis(self) -> Any:
        """The plain variant's (what runs)."""
        return self.plain.cost_analysis()

    def as_text(self) -> str:
        """The plain variant's optimized HLO (what runs)."""
        return self.plain.as_text()

    def memory_analysis(self) -> Any:
        """The plain variant's (what runs; the fill's states are its inputs)."""
        return self.plain.memory_analysis()


class GroupCompiler:
    """Compiles one step's executables for the groups this process holds.

    Use: `plan = c.infer_layouts(plan)` (groups of more than one device), then
    `c.compile_groups(plan)`; `c.executables[g]` then maps each executable name of a
    held group to what runs it.

    Attributes:
      executables: per group, name -> compiled executable (empty for a group held
        elsewhere).
      unreduced: (group, name) -> the `deferred.Unreduced` of an executable compiled
        the deferred way.
      shared_report: what compiling this process's executables took (`SharedReport`:
        XLA compiles run here, modules loaded from another rank's compile, distinct
        modules needed here and across the job).

    Args:
      mesh: the step's mesh.
      num_groups: the plan's number of groups.
      compiler_options: XLA options for every executable (`compile_exe`).
    """

    def __init__(self, mesh: MpmdMesh, num_groups: int,
                 compiler_options: dict[str, Any] | None = None):
        self.mesh = mesh
        self.compiler_options = compiler_options or None
        self.executables: list[dict[str, Any]] = [{} for _ in range(num_groups)]
        self.unreduced: dict[tuple[int, str], deferred.Unreduced] = {}
        self.shared_report: shared_compiles.SharedReport | None = None
        self._deferred_families: dict[tuple[int, str], tuple[frozenset, ...] | None] = {}
        self._shardings: dict[tuple[int, Aval], NamedSharding] = {}
        self._auto_meshes: dict[int, Mesh] = {}
        self._plan: StepPlan | None = None

    # -- meshes and shardings -----------------------------------------------------

    def sharding(self, group: int, aval: Aval) -> NamedSharding:
        """The sharding of a value with `aval` on group `group`."""
        key = (group, aval)
        sh = self._shardings.get(key)
        if sh is None:
            sh = NamedSharding(self.auto_mesh(group), PartitionSpec(*aval.spec))
            self._shardings[key] = sh
        return sh

    def auto_mesh(self, group: int) -> Mesh:
        """Group `group`'s mesh with every axis `Auto`: stage executables are compiled
        without sharding-in-types, whatever axis types the user's mesh has."""
        mesh = self._auto_meshes.get(group)
        if mesh is None:
            gm = self.mesh.group_mesh(group)
            mesh = Mesh(gm.devices, gm.axis_names,
                        axis_types=(AxisType.Auto,) * len(gm.axis_names))
            self._auto_meshes[group] = mesh
        return mesh

    # -- the layout pass ----------------------------------------------------------

    def infer_layouts(self, plan: StepPlan) -> StepPlan:
        """Runs the layout pass (`Note: layouts`), compiling this process's executables
        on the way; returns the plan whose program, executables and outputs carry the
        layouts."""
        mesh = self.mesh

        def resolve(g: int, name: str, ins: tuple[Aval, ...], outs: tuple[Aval, ...],
                    fixed: tuple[bool, ...]) -> tuple[Spec, ...]:
            specs = self._resolve_deferred(plan, g, name, ins, outs, fixed)
            if specs is not None:
                return specs
            sharding = functools.partial(self.sharding, g)
            exe = compile_exe(plan.exes[g][name], ins, outs, sharding,
                              free=[not f for f in fixed],
                              compiler_options=self.compiler_options)
            mesh_of = self.auto_mesh(g)
            chosen = [compat.mesh_spec(sh, mesh_of) for sh in exe.output_shardings]
            if any(spec is None for spec in chosen):  # not a mesh layout: replicate it
                outs = tuple(a if spec is None else dataclasses.replace(a, spec=program_spec(spec))
                             for a, spec in zip(outs, chosen))
                exe = compile_exe(plan.exes[g][name], ins, outs, sharding,
                                  compiler_options=self.compiler_options)
                chosen = [sh.spec for sh in exe.output_shardings]
            self.executables[g][name] = exe
            return tuple(program_spec(spec) for spec in chosen)

        exchange = None
        started = time.perf_counter()
        if not mesh.is_local:
            def exchange(mine):
                error = mine if isinstance(mine, Exception) else None
                # A peer may still be compiling: this rank's own compile time so far
                # extends the deadline (`Note: deadlines` in runtime/failure.py).
                failure.record_work("compile barrier", time.perf_counter() - started)
                agree.wait_idle(mesh.job_comm, "compile barrier")  # Note: idle waits
                gathered = agree.allgather_or_raise(
                    None if error else mine, error, mesh.job_comm, _compile_failed,
                    own="if_all", label="compile barrier")
                return {k: v for layouts in gathered for k, v in layouts.items()}

        fixed = {k: a.spec for k, (a, f) in enumerate(zip(plan.output_avals,
                                                           plan.output_fixed)) if f}
        args = plan.input_avals[len(plan.consts):len(plan.consts) + plan.num_args]
        argnums = [k for k, d in enumerate(plan.donated) if d]
        for k, i in donation_pairs(args, plan.output_avals, argnums).items():
            fixed.setdefault(k, args[i].spec)
        donated = {(g, name): exe.donate_argnums for g, exes in enumerate(plan.exes)
                   for name, exe in exes.items() if exe.donate_argnums}
        try:
            program, layouts = infer_layouts(
                plan.program, resolve, local_groups=mesh.local_groups, fixed_outputs=fixed,
                donated=donated, exchange=exchange)
        except LayoutError as e:
            raise CompileError(f"the step's layouts: {e}") from e
        exe_avals = tuple(
            {name: (tuple(dataclasses.replace(a, spec=s)
                          for a, s in zip(ins, layouts[(g, name)].ins)),
                    tuple(dataclasses.replace(a, spec=s)
                          for a, s in zip(outs, layouts[(g, name)].outs)))
             for name, (ins, outs) in group.items()}
            for g, group in enumerate(plan.exe_avals))
        output_avals = list(plan.output_avals)
        for g in program.groups:
            for b, k in g.outputs:
                output_avals[k] = g.aval(b)
        return dataclasses.replace(plan, program=program, exe_avals=exe_avals,
                                   output_avals=tuple(output_avals))

    def _resolve_deferred(self, plan: StepPlan, g: int, name: str, ins: tuple[Aval, ...],
                          outs: tuple[Aval, ...], fixed: tuple[bool, ...]
                          ) -> tuple[Spec, ...] | None:
        """The layout pass's `resolve` for an executable whose family's gradient sums are
        reduced once per step (`Note: deferred reduction`): compiles it, once, the
        deferred way and returns its results' layouts; None for any other executable
        (compiled as usual).

        The family is decided at its first variant, which the layout pass resolves
        before the others (they take its states). If a later variant fails to compile
        the deferred way, the whole family falls back to per-microbatch reduction: its
        variants compiled so far are dropped and compiled as usual later, for the
        layouts they were given.
        """
        exe = plan.exes[g][name]
        family = (g, exe.family)
        if not exe.family:
            return None
        traced = None  # the first variant's results, traced by `decide`
        if family not in self._deferred_families:
            per_state = None
            if deferred.first_variant(exe):
                per_state, traced = deferred.decide(exe, ins, outs, fixed, self.auto_mesh(g))
            self._deferred_families[family] = per_state
        per_state = self._deferred_families[family]
        if per_state is None:
            return None
        unreduced = deferred.variant_unreduced(exe, len(ins), len(outs), per_state)
        try:
            compiled, outs = deferred.compile_variant(
                exe, ins, outs, fixed, unreduced, self.auto_mesh(g),
                compiler_options=self.compiler_options, traced=traced)
        except Exception:  # noqa: BLE001 -- Explicit mode refuses a variant: not deferred
            self._deferred_families[family] = None
            for other in [n for (h, n) in self.unreduced
                          if h == g and plan.exes[g][n].family == exe.family]:
                del self.unreduced[(g, other)]
                self.executables[g].pop(other, None)
            return None
        self.executables[g][name] = compiled
        self.unreduced[(g, name)] = unreduced
        return tuple(a.spec for a in outs)

    # -- compiling ----------------------------------------------------------------

    def compile_groups(self, plan: StepPlan) -> list[dict[str, Any]]:
        """Compiles the executables of this process's groups (those the layout pass
        compiled kept); returns, per group, name -> what runs it (empty for a group held
        elsewhere). Logs progress at INFO on rank 0."""
        self._plan = plan
        mesh = self.mesh
        report = mesh.is_local or mesh.my_mpmd_axis_index == 0
        self.executables = [self._compile_group(g, report) if g in mesh.local_groups else {}
                            for g in range(plan.num_groups)]
        return self.executables

    def _shared_variants(self, g: int) -> dict[str, tuple[str, Exe]]:
        """Group `g`'s `_first` variants to build from their plain variants (`Note: first
        variants` in compiler/exes.py): name -> (plain variant, identity fill).
        Only executables the layout pass has not compiled (it compiles every one whose
        reduction is deferred)."""
        plan, done = self._plan, self.executables[g]
        shared = {}
        for name in plan.exes[g]:
            via = None if name in done else first_from_plain(plan.exes[g],
                                                             plan.exe_avals[g], name)
            if via is not None and via[0] not in done:
                shared[name] = via
        return shared

    def _compile_group(self, g: int, report: bool) -> dict[str, Any]:
        """Compiles group `g`'s executables, each distinct one once; logs progress when
        `report`. In MPI mode every rank calls it for its group: the ranks compile the
        modules they have in common once (`Note: shared compiles`)."""
        plan = self._plan
        exes = plan.exes[g]
        shared = self._shared_variants(g)
        total = sum(len(e) for e in plan.exes)
        if report:
            logger.info("compiling %d executables for group %d (%d across %d groups)",
                        len(exes), g, total, plan.num_groups)
        start = time.perf_counter()
        built = self._compile_jobs(g, self._group_jobs(g, shared), report)
        mine = {**{name: e for name, e in self.executables[g].items() if name in exes},
                **built}
        for name, (plain, _) in shared.items():
            mine[name] = _FromPlain(mine[plain], built[name + _FILL])
        if report:
            logger.info("group %d: %d/%d executables compiled in %.1f s (%d of them run "
                        "as their plain variant)", g, len(exes), len(exes),
                        time.perf_counter() - start, len(shared))
        return {name: mine[name] for name in exes}

    def _group_jobs(self, g: int, shared: dict[str, tuple[str, Exe]] | None = None) -> Jobs:
        """What compiling group `g`'s executables takes, a `_first` variant built from
        its plain one as the identity fill `NAME/fill`; those the layout pass compiled
        left out. `shared`: `_shared_variants(g)`, when known."""
        plan = self._plan
        shared = self._shared_variants(g) if shared is None else shared
        jobs = {name: (exe, *plan.exe_avals[g][name]) for name, exe in plan.exes[g].items()
                if name not in shared and name not in self.executables[g]}
        for name, (plain, fill) in shared.items():
            states = plan.exe_avals[g][plain][0][len(plan.exe_avals[g][name][0]):]
            jobs[name + _FILL] = (fill, (), states)
        return jobs

    def _compile_jobs(self, g: int, jobs: Jobs, report: bool) -> dict[str, Any]:
        """Compiles `jobs` for group `g`: one by one in local mode, with the other ranks
        in MPI mode (`Note: shared compiles`); records `shared_report`."""
        sharding = functools.partial(self.sharding, g)
        if self.mesh.is_local:
            start = last = time.perf_counter()
            out = {}
            for k, (name, (exe, ins, outs)) in enumerate(jobs.items(), 1):
                out[name] = compile_exe(exe, ins, outs, sharding,
                                        compiler_options=self.compiler_options)
                now = time.perf_counter()
                if report and k < len(jobs) and now - last >= _REPORT_EVERY_S:
                    logger.info("group %d: %d/%d compiled, %.1f s", g, k, len(jobs),
                                now - start)
                    last = now
            self.shared_report = shared_compiles.SharedReport(
                compiled=len(jobs), helped=0, received=0, needed=len(jobs),
                distinct=len(jobs))
            return out
        lowered, error = None, None
        try:
            lowered = {name: lower_exe(exe, ins, outs, sharding)
                       for name, (exe, ins, outs) in jobs.items()}
        except Exception as e:  # noqa: BLE001 - raised on every rank by compile_lowered
            error = e

        def lower_for(rank: int, name: str) -> jax.stages.Lowered:
            # Another rank's module, for this group's devices (every group has the same
            # shape): job rank = replica x groups + group (`Note: Pipeline replicas`).
            exe, ins, outs = self._group_jobs(rank % self._plan.num_groups)[name]
            return lower_exe(exe, ins, outs, sharding)

        built, self.shared_report = shared_compiles.compile_lowered(
            lowered, error, self.mesh.job_comm, devices=list(self.auto_mesh(g).devices.flat),
            compiler_options=self.compiler_options, lower_for=lower_for)
        if report:
            logger.info("group %d: %d distinct modules, %d compiled here, %d by other ranks "
                        "(%d distinct across the job)", g, self.shared_report["needed"],
                        self.shared_report["compiled"], self.shared_report["received"],
                        self.shared_report["distinct"])
        return built
