"""`MpmdCompiled`: a step compiled for one signature: its executables, executor and call.

Note: calling a compiled step.
  `MpmdFunction.__call__` looks up (or builds) the `MpmdCompiled` for the arguments'
  signature — pytree structure, and per leaf shape, dtype, weak type and, for an
  `MpmdArray`, its spec — so a training loop compiles once. The compiled step takes
  each flat argument to the group that owns it (an `MpmdArray` already there is used
  as it is, with no copy), adds the constants and the microbatch indexes (placed once,
  at compile time), runs the executor and wraps every result as an `MpmdArray` on the
  groups that hold it. Results feed the next step with no transfer: each updated
  parameter is produced on the group that owns the parameter. It takes the call's
  dynamic arguments, `(args, kwargs)` as `jax.jit`'s compiled objects do (Note: the
  step's arguments, in arguments.py).

Note: checking a call on every rank.
  Before a step sends anything, its call is checked (`MpmdCompiled._check_call`): the
  pytree structure, each `MpmdArray` held by the group that reads it (metadata, alike on
  every rank), and each array this process reads not deleted (a donated input used
  again: this rank only). In MPI mode the outcome is agreed with one small allgather
  per step (Note: raise on every rank, in agree.py): when any rank failed, every rank
  raises, so a rank whose user catches the error does not leave the others in a step
  that waits for it. The allgather carries `(STEP_CHECK, program hash)`: ranks running
  different compiled steps raise too, and so do ranks running a step while another
  compiles (its first allgather meets theirs: `Note: rejecting input on every rank`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src import agree, compat, shared_compiles
from jaxpp_mpi._src.arguments import paths
from jaxpp_mpi._src.array import MpmdArray, MpmdSharding, mpmd_array_from_local
from jaxpp_mpi._src.compiler import deferred
from jaxpp_mpi._src.compiler.build import StepPlan
from jaxpp_mpi._src.compiler.loop_tasks import Exe, first_from_plain, key_struct
from jaxpp_mpi._src.errors import CompileError
from jaxpp_mpi._src.ir.instructions import program_spec
from jaxpp_mpi._src.ir.layouts import LayoutError, donation_pairs, infer_layouts
from jaxpp_mpi._src.ir.program import Aval, GroupProgram, Program, Run
from jaxpp_mpi._src.mesh import MpmdMesh
from jaxpp_mpi._src.runtime import failure
from jaxpp_mpi._src.types import PyTree, Spec

if TYPE_CHECKING:
    from jaxpp_mpi._src.runtime.local import LocalExecutor
    from jaxpp_mpi._src.runtime.mpi import MpiExecutor  # imports mpi4py: only when used

__all__ = ["STEP_CHECK", "MpmdCompiled", "compile_exe", "is_step_check"]

# Progress of compilation, at INFO on rank 0 (local mode: the one process); quiet unless
# the application enables it, e.g. logging.basicConfig(level=logging.INFO).
logger = logging.getLogger("jaxpp_mpi")
_REPORT_EVERY_S = 5.0
_FILL = "/fill"  # a `_first` variant's identity fill, among a group's compile jobs

STEP_CHECK = "jaxpp_mpi.step-call-check"
"""Tags a rank's report in a per-call check (`Note: checking a call on every rank`)."""


def is_step_check(report: Any) -> bool:
    """Whether an allgathered value is a rank's per-call check report."""
    return isinstance(report, tuple) and len(report) == 2 and report[0] == STEP_CHECK


def _call_failed(failed: list[int], messages: Sequence[str | None]) -> ValueError:
    """The error every rank raises when some ranks' call check failed."""
    ok = [r for r, m in enumerate(messages) if m is None]
    return ValueError(
        f"the step's arguments failed the check on rank(s) {failed} and passed on rank(s) "
        f"{ok}, so no rank runs the step (the others would wait for it): every rank must "
        f"call the step with the same, live arguments. Rank {failed[0]}: "
        f"{messages[failed[0]]}")


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


def _compile_failed(failed: list[int], messages: Sequence[str | None]) -> CompileError:
    """The error every rank raises when some ranks failed to compile their executables
    while the ranks were agreeing on layouts."""
    return CompileError(f"rank(s) {failed} failed to compile their executables: "
                        f"{messages[failed[0]]}")


def _flops(exe: jax.stages.Compiled) -> float:
    """Per-device FLOPs of one run of `exe`, from XLA's cost analysis (0 if none)."""
    cost = exe.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


class _FromPlain:
    """A `_first` variant run as its family's plain variant on states that hold each
    reduction's identity (`Note: first variants` in compiler/loop_tasks.py).

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


class MpmdCompiled:
    """A step compiled for one argument signature (see `Note: calling a compiled step`).

    Attributes:
      in_shardings: `(args, kwargs)` like the dynamic arguments, as for `jax.jit`'s
        compiled objects: per leaf, the `MpmdSharding` of the group that owns it (None
        for an argument the step does not read).
      out_shardings: a pytree like the result: per leaf, where it lives.
      plan: the `StepPlan` (program, executables' specs, input and output layout).
      shared_report: what compiling this process's executables took: XLA compiles run
        here, modules loaded from another rank's compile (`Note: shared compiles`),
        distinct modules needed here and across the job.

    Args:
      plan: the step's plan.
      mesh: the mesh.
      in_tree: the structure of the call's `(args, kwargs)`.
      compiler_options: XLA options for every executable (`compile_exe`).
      trace: returns the whole step traced as a `ClosedJaxpr` (`closed_jaxpr`).
    """

    def __init__(self, plan: StepPlan, mesh: MpmdMesh, in_tree: jax.tree_util.PyTreeDef,
                 *, compiler_options: dict[str, Any] | None = None,
                 trace: Callable[[], Any] | None = None):
        self.mesh = mesh
        self._compiler_options = compiler_options or None
        self._trace = trace
        self._in_tree = in_tree
        self._shardings: dict[tuple[int, Aval], NamedSharding] = {}
        self._auto_meshes: dict[int, Mesh] = {}
        self._executables: list[dict[str, jax.stages.Compiled]] = [
            {} for _ in range(plan.num_groups)]
        self._unreduced: dict[tuple[int, str], deferred.Unreduced] = {}
        self._deferred_families: dict[tuple[int, str], tuple[frozenset, ...] | None] = {}
        if math.prod(mesh.group_shape.values()) > 1:
            plan = self._infer_layouts(plan)
        self.plan = plan
        n_consts = len(plan.consts)
        in_sh = []
        for k in range(n_consts, n_consts + plan.num_args):
            owner = plan.input_owner[k]
            spec = PartitionSpec(*plan.input_avals[k].spec)
            in_sh.append(None if owner is None else MpmdSharding(mesh, (owner,), spec))
        self.in_shardings = jax.tree.unflatten(in_tree, in_sh)
        holders = self._output_holders()
        out_sh = [MpmdSharding(mesh, groups, PartitionSpec(*aval.spec))
                  for groups, aval in zip(holders, plan.output_avals)]
        self.out_shardings = jax.tree.unflatten(plan.out_tree, out_sh)
        self._out_sh = out_sh
        self._local_holders = [sh.local_mesh_ids for sh in out_sh]
        self._executor = self._make_executor()
        self._fixed = self._fixed_inputs()

    # -- inspection ---------------------------------------------------------------

    def program(self, group: int | None = None) -> Program | GroupProgram:
        """The whole program, or group `group`'s part; `print` it to read it."""
        return self.plan.program if group is None else self.plan.program.group(group)

    def cost_analysis(self) -> list[dict[str, Any] | None]:
        """XLA's per-device FLOPs of one step, per group, for checking balance and sharding.

        Returns:
          One entry per MPMD index: None for a group this process does not hold (in MPI
          mode, every group but this rank's), else a dict with `"flops"`, the per-device
          FLOPs of one whole step on the group (each executable's cost analysis times the
          number of `run` instructions of it in the group's program), and
          `"per_executable"`, `{executable name: per-device flops of one run}`.
        """
        out: list[dict[str, Any] | None] = []
        for g, exes in enumerate(self._executables):
            if g not in self.mesh.local_groups:
                out.append(None)
                continue
            per_exe = {name: _flops(exe) for name, exe in exes.items()}
            runs = [i.exe for i in self.plan.program.group(g).instrs if isinstance(i, Run)]
            out.append({"flops": float(sum(per_exe[name] for name in runs)),
                        "per_executable": per_exe})
        return out

    def as_text(self, group: int, name: str) -> str:
        """The optimized HLO of executable `name` of group `group` (held by this process).

        Raises:
          ValueError: if this process does not hold `group` or it has no such executable.
        """
        if group not in self.mesh.local_groups:
            raise ValueError(f"group {group} is not held by this process (it holds "
                             f"{sorted(self.mesh.local_groups)}); ask on its rank")
        exes = self._executables[group]
        if name not in exes:
            raise ValueError(f"group {group} has no executable {name!r}; it has "
                             f"{', '.join(sorted(exes))}")
        return exes[name].as_text()

    def _output_holders(self) -> list[tuple[int, ...]]:
        """Per output, the groups that hold it (group 0 for a literal)."""
        holders: list[set[int]] = [set() for _ in self.plan.outputs]
        for g in self.plan.program.groups:
            for _, k in g.outputs:
                holders[k].add(g.mpmd_idx)
        return [tuple(sorted(h)) if h else (0,) for h in holders]

    # -- running ------------------------------------------------------------------

    def sharding(self, group: int, aval: Aval) -> NamedSharding:
        """The sharding of a value with `aval` on group `group`."""
        key = (group, aval)
        sh = self._shardings.get(key)
        if sh is None:
            sh = NamedSharding(self._auto_mesh(group), PartitionSpec(*aval.spec))
            self._shardings[key] = sh
        return sh

    def _auto_mesh(self, group: int) -> Mesh:
        """Group `group`'s mesh with every axis `Auto`: stage executables are compiled
        without sharding-in-types, whatever axis types the user's mesh has."""
        mesh = self._auto_meshes.get(group)
        if mesh is None:
            gm = self.mesh.group_mesh(group)
            mesh = Mesh(gm.devices, gm.axis_names,
                        axis_types=(AxisType.Auto,) * len(gm.axis_names))
            self._auto_meshes[group] = mesh
        return mesh

    def _shared_variants(self, g: int) -> dict[str, tuple[str, Exe]]:
        """Group `g`'s `_first` variants to build from their plain variants (`Note: first
        variants` in compiler/loop_tasks.py): name -> (plain variant, identity fill).
        Only executables the layout pass has not compiled (it compiles every one whose
        reduction is deferred)."""
        plan, done = self.plan, self._executables[g]
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
        plan = self.plan
        exes = plan.exes[g]
        shared = self._shared_variants(g)
        total = sum(len(e) for e in plan.exes)
        if report:
            logger.info("compiling %d executables for group %d (%d across %d groups)",
                        len(exes), g, total, plan.num_groups)
        start = time.perf_counter()
        built = self._compile_jobs(g, self._group_jobs(g, shared), report)
        mine = {**{name: e for name, e in self._executables[g].items() if name in exes},
                **built}
        for name, (plain, _) in shared.items():
            mine[name] = _FromPlain(mine[plain], built[name + _FILL])
        if report:
            logger.info("group %d: %d/%d executables compiled in %.1f s (%d of them run "
                        "as their plain variant)", g, len(exes), len(exes),
                        time.perf_counter() - start, len(shared))
        return {name: mine[name] for name in exes}

    def _group_jobs(self, g: int, shared: dict[str, tuple[str, Exe]] | None = None
                    ) -> dict[str, tuple[Exe, Sequence[Aval], Sequence[Aval]]]:
        """What compiling group `g`'s executables takes: name -> (executable, input
        avals, output avals), a `_first` variant built from its plain one as the
        identity fill `NAME/fill`; those the layout pass compiled left out. `shared`:
        `_shared_variants(g)`, when known."""
        plan = self.plan
        shared = self._shared_variants(g) if shared is None else shared
        jobs = {name: (exe, *plan.exe_avals[g][name]) for name, exe in plan.exes[g].items()
                if name not in shared and name not in self._executables[g]}
        for name, (plain, fill) in shared.items():
            states = plan.exe_avals[g][plain][0][len(plan.exe_avals[g][name][0]):]
            jobs[name + _FILL] = (fill, (), states)
        return jobs

    def _compile_jobs(self, g: int, jobs: dict[str, tuple[Exe, Sequence[Aval], Sequence[Aval]]],
                      report: bool) -> dict[str, Any]:
        """Compiles `jobs` (name -> executable, input avals, output avals) for group `g`:
        one by one in local mode, with the other ranks in MPI mode (`Note: shared
        compiles`); records `shared_report`."""
        sharding = functools.partial(self.sharding, g)
        if self.mesh.is_local:
            start = last = time.perf_counter()
            out = {}
            for k, (name, (exe, ins, outs)) in enumerate(jobs.items(), 1):
                out[name] = compile_exe(exe, ins, outs, sharding,
                                        compiler_options=self._compiler_options)
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
            exe, ins, outs = self._group_jobs(rank % self.plan.num_groups)[name]
            return lower_exe(exe, ins, outs, sharding)

        built, self.shared_report = shared_compiles.compile_lowered(
            lowered, error, self.mesh.job_comm, devices=list(self._auto_mesh(g).devices.flat),
            compiler_options=self._compiler_options, lower_for=lower_for)
        if report:
            logger.info("group %d: %d distinct modules, %d compiled here, %d by other ranks "
                        "(%d distinct across the job)", g, self.shared_report["needed"],
                        self.shared_report["compiled"], self.shared_report["received"],
                        self.shared_report["distinct"])
        return built

    def _infer_layouts(self, plan: StepPlan) -> StepPlan:
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
                              compiler_options=self._compiler_options)
            mesh_of = self._auto_mesh(g)
            chosen = [compat.mesh_spec(sh, mesh_of) for sh in exe.output_shardings]
            if any(spec is None for spec in chosen):  # not a mesh layout: replicate it
                outs = tuple(a if spec is None else dataclasses.replace(a, spec=program_spec(spec))
                             for a, spec in zip(outs, chosen))
                exe = compile_exe(plan.exes[g][name], ins, outs, sharding,
                                  compiler_options=self._compiler_options)
                chosen = [sh.spec for sh in exe.output_shardings]
            self._executables[g][name] = exe
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
                per_state, traced = deferred.decide(exe, ins, outs, fixed, self._auto_mesh(g))
            self._deferred_families[family] = per_state
        per_state = self._deferred_families[family]
        if per_state is None:
            return None
        unreduced = deferred.variant_unreduced(exe, len(ins), len(outs), per_state)
        try:
            compiled, outs = deferred.compile_variant(
                exe, ins, outs, fixed, unreduced, self._auto_mesh(g),
                compiler_options=self._compiler_options, traced=traced)
        except Exception:  # noqa: BLE001 -- Explicit mode refuses a variant: not deferred
            self._deferred_families[family] = None
            for other in [n for (h, n) in self._unreduced
                          if h == g and plan.exes[g][n].family == exe.family]:
                del self._unreduced[(g, other)]
                self._executables[g].pop(other, None)
            return None
        self._executables[g][name] = compiled
        self._unreduced[(g, name)] = unreduced
        return tuple(a.spec for a in outs)

    def _make_executor(self) -> LocalExecutor | MpiExecutor:
        """Compiles the executables of this process's groups; returns the executor that
        runs them (no message yet: `MpmdFunction.compile` agrees with the other ranks
        first)."""
        plan, mesh = self.plan, self.mesh
        report = mesh.is_local or mesh.my_mpmd_axis_index == 0
        executables = [self._compile_group(g, report) if g in mesh.local_groups else {}
                       for g in range(plan.num_groups)]
        self._executables = executables
        if mesh.is_local:
            from jaxpp_mpi._src.runtime.local import LocalExecutor

            return LocalExecutor(plan.program, executables, self.sharding)
        from jaxpp_mpi._src.runtime.mpi import MpiExecutor

        g = mesh.my_mpmd_axis_index
        # No message yet: `MpmdFunction.compile` agrees with the other ranks first.
        return MpiExecutor(plan.program, g, executables[g],
                           functools.partial(self.sharding, g), mesh.comm,
                           replica_comm=mesh.replica_comm, job_comm=mesh.job_comm)

    def _fixed_inputs(self) -> list[Any]:
        """Constants and microbatch indexes, placed once on the groups that use them."""
        plan = self.plan
        fixed: list[Any] = [None] * len(plan.input_avals)
        local = self.mesh.local_groups
        for k, c in enumerate(plan.consts):
            owner = plan.input_owner[k]
            if owner in local:
                fixed[k] = jax.device_put(c, self.sharding(owner, plan.input_avals[k]))
        # `Note: replicas` in compiler/replicas.py: this replica's share of the loop.
        offset = self.mesh.replica_idx * plan.replica_microbatches
        for k, g, m in plan.mb_inputs:
            if g in local:
                fixed[k] = jax.device_put(np.int32(offset + m),
                                          self.sharding(g, plan.input_avals[k]))
        return fixed

    def _arg_for_owner(self, x: Any, k: int) -> Any:
        """Flat input `k` as its owner group reads it (None where no local group does)."""
        owner = self.plan.input_owner[k]
        if owner is None or owner not in self.mesh.local_groups:
            return None
        if isinstance(x, MpmdArray):
            held = x.local_arrays.get(owner)
            # Local mode: another group's replica (copied by the executor), or a clear
            # error for an array that holds no data here.
            return held if held is not None else x._value_replica(f"flat argument {k}")
        return x

    @functools.cached_property
    def _program_hash(self) -> str:
        return self.plan.program.hash()

    @functools.cached_property
    def closed_jaxpr(self) -> Any:
        """The whole step as JAX traced it, a `ClosedJaxpr` over the flat dynamic
        arguments (`(args, kwargs)` flattened), before it is split into stages (JaxPP's
        `closed_jaxpr` holds its transformed form; print this one to read the step).

        Raises:
          ValueError: this object was built without its step (not by `compile`).
        """
        if self._trace is None:
            raise ValueError("this MpmdCompiled was built without its step; compile it "
                             "with mpmd_jit_with_loop(...).compile(...)")
        return self._trace()

    def _describe_tree(self) -> str:
        args_tree, kwargs_tree = self._in_tree.children()
        names = sorted(jax.tree.unflatten(kwargs_tree, [0] * kwargs_tree.num_leaves))
        return (f"{len(args_tree.children())} positional argument(s) and keyword "
                f"argument(s) {names}")

    def _call_error(self, leaves: list, tree: Any, call: tuple) -> ValueError | None:
        """This process's verdict on a call (`Note: checking a call on every rank`)."""
        if tree != self._in_tree:
            return ValueError(
                f"the step was compiled for {self._describe_tree()} with structure "
                f"{self._in_tree}, and is called with structure {tree}; a compiled step "
                "takes the dynamic arguments only (static ones are part of it), as "
                "jax.jit's compiled objects do")
        n_consts = len(self.plan.consts)
        owners = self.plan.input_owner[n_consts:n_consts + len(leaves)]
        local = self.mesh.local_groups
        for j, (x, owner) in enumerate(zip(leaves, owners)):
            if (not self.mesh.is_local and isinstance(x, MpmdArray) and owner is not None
                    and owner not in x.mpmd_idxs):
                return ValueError(
                    f"argument {paths(call)[j]} is an MpmdArray held by groups "
                    f"{sorted(x.mpmd_idxs)}, but this step reads it on group {owner}: "
                    "pass the array this step's in_shardings place there "
                    "(compiled.in_shardings), or a plain array present on every rank")
        for j, (x, owner) in enumerate(zip(leaves, owners)):
            if owner in local and isinstance(x, (jax.Array, MpmdArray)) and x.is_deleted():
                return ValueError(
                    f"argument {paths(call)[j]} has been deleted (donated to an earlier "
                    "step, or consumed by a reshard): pass the step's result in its "
                    "place, or a fresh array")
        return None

    def _check_call(self, args: tuple, kwargs: dict[str, Any]) -> list:
        """Checks a call on every rank alike; returns its flat arguments (`Note:
        checking a call on every rank`).

        Raises:
          ValueError: on every rank, when the call failed the check on any rank.
          CompileError: on every rank, when the ranks run different compiled steps, or
            some rank compiles meanwhile.
        """
        call = (args, kwargs)
        leaves, tree = jax.tree.flatten(call)
        error = self._call_error(leaves, tree, call)
        comm = None if self.mesh.is_local else self.mesh.job_comm  # every replica
        reports = agree.allgather_or_raise((STEP_CHECK, self._program_hash), error, comm,
                                           _call_failed, own="if_all",
                                           label="step call agreement")
        compiling = [r for r, report in enumerate(reports) if not is_step_check(report)]
        differ = agree.differing_ranks(reports)
        if compiling or differ:
            running = [r for r in range(len(reports)) if r not in compiling]
            what = (f"rank(s) {compiling} compiled the step for new arguments while rank(s) "
                    f"{running} ran it as compiled before" if compiling else
                    f"rank(s) {differ} ran another compiled step than rank 0")
            raise CompileError(
                f"{what}, so their messages would not match: every rank must call the "
                "step with the same argument shapes, dtypes, shardings and static values")
        return leaves

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        """Runs one step.

        Args:
          *args, **kwargs: the dynamic arguments, with the pytree structure compiled for.

        Returns:
          The result pytree of `MpmdArray`s.

        Raises:
          ValueError: on every rank (MPI mode), when on any rank the arguments have
            another structure, an `MpmdArray` is held away from the group that reads
            it, or an array read here was deleted (donated); see `Note: checking a
            call on every rank`.
        """
        leaves = self._check_call(args, kwargs)
        plan = self.plan
        n_consts = len(plan.consts)
        inputs = list(self._fixed)
        for j, x in enumerate(leaves):
            x = self._arg_for_owner(x, n_consts + j)
            if x is not None and plan.key_args[j]:  # `Note: keys as key data`
                x = jax.random.key_data(x)
            inputs[n_consts + j] = x
        with jax.set_mesh(None):  # the executables run on their groups' devices
            replicas = self._executor.run_replicas(inputs)
        outs = []
        for k, (desc, aval) in enumerate(zip(plan.outputs, plan.output_avals)):
            sharding = self._out_sh[k]
            if desc[0] == "lit":
                lit = mpmd_array_from_local(self.mesh, desc[1], sharding)
                lit._weak_type = bool(plan.output_weak[k]) if plan.output_weak else False
                outs.append(lit)
                continue
            held = [replicas[k][g] for g in self._local_holders[k]]
            impl = plan.key_outputs[k]
            if impl is None:
                weak = bool(plan.output_weak[k]) if plan.output_weak else False
                outs.append(MpmdArray._trusted(held, sharding, aval.shape,
                                               np.dtype(aval.dtype), weak))
                continue
            key = key_struct(aval.shape, impl)  # `Note: keys as key data`
            held = [jax.random.wrap_key_data(a, impl=impl) for a in held]
            outs.append(MpmdArray._trusted(held, sharding, key.shape, key.dtype))
        return jax.tree.unflatten(plan.out_tree, outs)
