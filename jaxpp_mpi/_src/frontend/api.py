"""`mpmd_jit_with_loop`: the user-facing compile-and-run entry point.

A compiled step is an `MpmdCompiled` (compiled.py, Note: calling a compiled step); its
arguments' signature and layout checks are in arguments.py.

Note: rejecting input on every rank.
  `MpmdFunction.compile` (on a cache miss) makes each decision collectively, before the
  first message (DESIGN.md §7; Note: raise on every rank, in agree.py):
  1. before tracing, one allgather of (this rank's argument error, a digest of the
     argument signature and static values, the group mesh shape): any error,
     different signatures or different group meshes raise on every rank, naming the
     first differing leaf or static value;
  2. after tracing, splitting and scheduling, one allgather of the error each rank met
     (if any): every rank raises when any rank failed;
  3. `agree_on_program`: one allgather of the program hash;
  4. after compiling this rank's executables, one allgather of the errors again: the
     barrier before the first message.
  When every rank failed, each raises its own error; when only some did, every rank
  raises a `CompileError` naming the failed ranks and the first one's error (chained
  from its own, where it has one). The cache lookup itself is not collective: ranks
  must change a step's signature together, as they do when they run the same script;
  a rank that compiles while the others run the step compiled before meets their
  per-call check in its step 1 allgather, and every rank raises (`Note: checking a
  call on every rank`, in compiled.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import numbers
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import without_axis
from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Comm, PyTree
from jaxpp_mpi._src.compiler import replicas
from jaxpp_mpi._src.compiler.build import StepPlan, build_step
from jaxpp_mpi._src.compiler.fingerprint import step_texts
from jaxpp_mpi._src.compiler.program_cache import ProgramCache
from jaxpp_mpi._src.compiler.retarget import trace_mesh
from jaxpp_mpi._src.driver.arguments import (
    Call,
    abstract,
    check_layout,
    describe_leaves,
    paths,
    per_leaf,
    resolve_argnums,
    signature,
    spec_entries,
    split_call,
    static_lines,
)
from jaxpp_mpi._src.driver.compiled import MpmdCompiled, is_step_check
from jaxpp_mpi._src.ir.simulate import runtime_sends
from jaxpp_mpi._src.runtime import agree

# MpmdCompiled is re-exported: `jaxpp_mpi._src.frontend.api.MpmdCompiled` stays importable.
__all__ = ["MpmdCompiled", "MpmdFunction", "mpmd_jit_with_loop"]

logger = logging.getLogger("jaxpp_mpi")


def _ranks_failed(name: str, when: str) -> agree.Failure:
    """The error every rank raises when only some ranks failed `when` (Note: rejecting
    input on every rank)."""

    def failure(failed: list[int], messages: Sequence[str | None]) -> CompileError:
        ok = [r for r, m in enumerate(messages) if m is None]
        return CompileError(
            f"{name}: rank(s) {failed} failed {when} and rank(s) {ok} did not, so the "
            "ranks cannot run one program; every rank must call the step with the same "
            f"arguments and the same code. Rank {failed[0]}: {messages[failed[0]]}"
        )

    return failure


class MpmdFunction:
    """A step wrapped by `mpmd_jit_with_loop`; call it, or `.compile(*args, **kwargs)` it."""

    def __init__(self, fun: Callable, mpmd_mesh: MpmdMesh, in_shardings: Any,
                 out_shardings: Any, donate_argnums: Any = None, *,
                 static_argnums: Any = None, static_argnames: Any = None,
                 donate_argnames: Any = None,
                 compiler_options: dict[str, Any] | None = None,
                 task_times_ms: Mapping[str, float] | None = None):
        if not isinstance(mpmd_mesh, MpmdMesh):
            raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(mpmd_mesh).__name__}")
        if compiler_options is not None and not (
                isinstance(compiler_options, dict)
                and all(isinstance(k, str) for k in compiler_options)):
            raise TypeError("compiler_options must be a dict of XLA option names to values "
                            f"(as for jax.jit), got {compiler_options!r}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.mpmd_mesh = mpmd_mesh
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._argnums = resolve_argnums(
            fun, static_argnums=static_argnums, static_argnames=static_argnames,
            donate_argnums=donate_argnums, donate_argnames=donate_argnames)
        self._compiler_options = dict(compiler_options or {})
        self._task_times_ms = _task_times(task_times_ms)
        self._cache: dict[Any, MpmdCompiled] = {}

    def compile(self, *args: Any, **kwargs: Any) -> MpmdCompiled:
        """Compiles for the signature of the call (cached); returns the MpmdCompiled;
        collective: every rank of the job compiles alike (agreement, shared compiles).

        The compiled step takes the dynamic arguments only, as `jax.jit`'s does: the
        static ones (`static_argnums` / `static_argnames`) are part of it.

        Raises:
          TypeError: an argument leaf is not an array (a str, an object, ...), or a
            static value is not hashable.
          ValueError: a malformed `in_shardings` / `out_shardings` / `donate_argnums`,
            or a spec that does not fit its value on the group mesh.
          CompileError: the step cannot be pipelined (see `build_step`), or, in MPI
            mode, the ranks disagree (see `Note: rejecting input on every rank`).
        """
        return self._compile(args, kwargs)[0]

    def step_plan(self, *args: Any, **kwargs: Any) -> StepPlan:
        """The step for the call's signature traced, split and scheduled, not compiled.

        No device is touched and no other rank is asked: this is the `StepPlan` (the
        program every group would run, its executables' avals) that `compile` builds
        before compiling, for tools that reason about a schedule without running it
        (`jaxpp_mpi.plan_schedules`). Leaves may be `jax.ShapeDtypeStruct`s.

        Raises:
          TypeError, ValueError, CompileError: as `compile` does for a bad call or a step
            that cannot be pipelined.
        """
        name = getattr(self.fun, "__name__", "the step")
        call = split_call(self._argnums, args, kwargs, name)
        key = self._placed(signature(call))
        return self._plan(call, key, name)

    def _compile(self, args: tuple, kwargs: dict[str, Any]) -> tuple[MpmdCompiled, Call]:
        """The compiled step for a call (cached), and the call split (Note: the step's
        arguments); a bad call raises on every rank (Note: rejecting input on every
        rank)."""
        name = getattr(self.fun, "__name__", "the step")
        call, key, error = None, None, None
        try:
            call = split_call(self._argnums, args, kwargs, name)
            key = self._placed(signature(call))
        except (TypeError, ValueError) as e:
            error = e
        else:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled, call
        mesh = self.mpmd_mesh
        # Local mode: one process, nothing to agree on; each step below simply raises.
        comm: Comm = None if mesh.is_local else mesh.job_comm  # every replica
        self._agree_on_arguments(call, key, error, name, comm)
        plan = agree.run(lambda: self._plan(call, key, name), comm,
                         _ranks_failed(name, "to trace it"), own="if_all",
                         label="step trace agreement")
        agree.agree_on_program(plan.program, comm, computations=lambda: step_texts(plan))
        # Everything is compiled when this returns: its allgather is the barrier before
        # this rank's first message (DESIGN.md §7).
        # Each executable is compiled for its group's devices, whatever mesh the caller
        # has set (`jax.set_mesh`) around the call.
        with jax.set_mesh(None):
            compiled = agree.run(
                lambda: MpmdCompiled(plan, mesh, key[0],
                                     compiler_options=self._compiler_options,
                                     trace=functools.partial(self._closed_jaxpr, call)),
                comm, _ranks_failed(name, "to compile it"), own="if_all",
                label="compile barrier")
        self._cache[key] = compiled
        return compiled, call

    def _in_specs(self, call: Call, tree: jax.tree_util.PyTreeDef) -> list[Any]:
        """Per flat argument, its `in_shardings` entry: `in_shardings` covers the dynamic
        positional arguments; keyword arguments get None (Note: the step's arguments)."""
        n_args = jax.tree.structure(call.args).num_leaves
        specs = per_leaf(self._in_shardings, jax.tree.structure(call.args), "in_shardings")
        return specs + [None] * (tree.num_leaves - n_args)

    def _placed(self, key: tuple) -> tuple:
        """The signature `key` with each leaf's spec as the step places it: the spec of
        its `in_shardings` entry where there is one (an array arriving in another layout
        is moved to it), so feeding results back hits the cache whatever their layout."""
        if self._in_shardings is None:
            return key
        tree, sig, static = key
        axis = self.mpmd_mesh.mpmd_axis_name
        try:
            args_tree = tree.children()[0]
            specs = per_leaf(self._in_shardings, args_tree, "in_shardings")
            specs = [spec_entries(s, "in_shardings", axis) for s in specs]
        except (TypeError, ValueError):
            return key  # `_plan` rejects it on every rank
        placed = []
        for j, entry in enumerate(sig):
            spec = specs[j] if j < len(specs) else None
            if spec is not None:
                spec = list(spec)
                while spec and spec[-1] is None:
                    spec.pop()
                entry = (*entry[:3], tuple(spec))
            placed.append(entry)
        return tree, tuple(placed), static

    def _abstract(self, call: Call, replica_dims: Sequence[int | None] | None = None
                  ) -> tuple[tuple, dict[str, Any]]:
        """`call.dynamic` with every leaf abstract, a replica's share as the global array
        it is part of (`Note: replica shares` in compiler/replicas.py)."""
        leaves, tree = jax.tree.flatten(jax.tree.map(abstract, call.dynamic))
        r = self.mpmd_mesh.num_replicas
        for j, d in enumerate(replica_dims or ()):
            if d is not None:
                x = leaves[j]
                shape = (*x.shape[:d], x.shape[d] * r, *x.shape[d + 1:])
                leaves[j] = jax.ShapeDtypeStruct(shape, x.dtype, weak_type=x.weak_type)
        return jax.tree.unflatten(tree, leaves)

    def _replica_shares(self, in_specs: list) -> tuple[list[int | None], list]:
        """Per flat argument, the dimension its spec splits over the replica axis (or
        None), and the specs without that axis (`Note: replica shares`).

        Raises:
          ValueError: a spec naming the replica axis in a way that does not split one
            dimension into consecutive blocks (see `replicas.split_dim`).
        """
        axis = self.mpmd_mesh.replica_axis_name
        dims = [replicas.split_dim(spec, axis) for spec in in_specs]
        specs = [spec if d is None else tuple(without_axis(PartitionSpec(*spec), axis))
                 for spec, d in zip(in_specs, dims)]
        return dims, specs

    def _closed_jaxpr(self, call: Call) -> jex_core.ClosedJaxpr:
        """The whole step traced for `call` (`MpmdCompiled.closed_jaxpr`), as `build_step`
        traces it: over the flat dynamic arguments (a replica's share as the global
        array), under the mesh's abstract copy."""
        axis = self.mpmd_mesh.mpmd_axis_name
        specs = [spec_entries(s, "in_shardings", axis)
                 for s in self._in_specs(call, jax.tree.structure(call.dynamic))]
        replica_dims, _ = self._replica_shares(specs)
        leaves, tree = jax.tree.flatten(self._abstract(call, replica_dims))
        bound = call.bind(self.fun)

        def flat(*xs: Any) -> Any:
            return bound(*jax.tree.unflatten(tree, xs))

        with jax.sharding.use_abstract_mesh(trace_mesh(self.mpmd_mesh.jax_mesh)):
            return jax.make_jaxpr(flat)(*leaves)

    def _plan(self, call: Call, key: tuple, name: str) -> StepPlan:
        """Traces, splits and schedules the step for `call` (signature `key`)."""
        tree, sig, _ = key
        mesh = self.mpmd_mesh
        group_shape, mpmd_axis = mesh.group_shape, mesh.mpmd_axis_name
        in_specs = [
            spec_entries(s, "in_shardings", mpmd_axis) if s is not None else entry[3]
            for s, entry in zip(self._in_specs(call, tree), sig)
        ]
        replica_dims, in_specs = self._replica_shares(in_specs)
        abstract_args = self._abstract(call, replica_dims)
        leaf_paths = paths(call.dynamic)
        for j, (spec, entry) in enumerate(zip(in_specs, sig)):
            if spec:
                check_layout(spec, entry[0], group_shape, f"argument {leaf_paths[j]}",
                             mpmd_axis)
        donate = []
        for donated, a in zip(call.donated, [*call.args, *call.kwargs.values()]):
            donate += [donated] * len(jax.tree.leaves(a))
        bound = call.bind(self.fun)
        out_specs = None
        if self._out_shardings is not None:
            with jax.sharding.use_abstract_mesh(trace_mesh(mesh.jax_mesh)):  # as traced
                out_tree = jax.tree.structure(jax.eval_shape(bound, *abstract_args))
            out_specs = [spec_entries(s, "out_shardings", mpmd_axis)
                         for s in per_leaf(self._out_shardings, out_tree, "out_shardings")]
        start = time.perf_counter()
        plan = build_step(bound, abstract_args, mesh.mpmd_dim, in_specs=in_specs,
                          out_specs=out_specs, donate=donate, what=f"{name}", mesh=mesh,
                          num_replicas=mesh.num_replicas,
                          replica_bucket_bytes=config.options().replica_bucket_bytes,
                          replica_dims=replica_dims, arg_names=leaf_paths,
                          task_times_ms=self._task_times_ms, sends=_runtime_sends(mesh),
                          program_cache=_program_cache())
        if out_specs is not None:
            out_paths = paths((jax.tree.unflatten(plan.out_tree, plan.output_avals),))
            for k, (spec, aval) in enumerate(zip(out_specs, plan.output_avals)):
                where = "result" + out_paths[k].removeprefix("args")
                check_layout(spec, aval.shape, group_shape, where, mpmd_axis)
        if mesh.is_local or mesh.my_mpmd_axis_index == 0:
            logger.info("%s: traced, split and scheduled into %d groups' programs "
                        "(%d instructions) in %.1f s%s", name, plan.num_groups,
                        sum(len(g.instrs) for g in plan.program.groups),
                        time.perf_counter() - start, _cache_words(plan))
        return plan

    def _agree_on_arguments(self, call: Call | None, key: tuple | None,
                            error: Exception | None, name: str, comm: Comm) -> None:
        """Step 1 of `Note: rejecting input on every rank`.

        Raises:
          TypeError / ValueError / CompileError: a rank's arguments are not arrays, or
            not whole arrays (its own error on every rank when all failed alike).
          CompileError: the ranks passed different argument signatures or static
            values, their group meshes differ in shape, or some ranks ran a compiled
            step meanwhile (`Note: checking a call on every rank` in compiled.py).
        """
        mesh = self.mpmd_mesh
        digest = None
        if key is not None:
            text = repr((key[0].num_leaves, sorted(call.kwargs), key[1], static_lines(call)))
            digest = hashlib.sha256(text.encode()).hexdigest()
        shape = tuple(mesh.group_shape.items())
        reports = agree.allgather_or_raise((digest, shape), error, comm,
                                           _ranks_failed(name, "the argument check"),
                                           own="if_all", label="argument agreement")
        running = [r for r, report in enumerate(reports) if is_step_check(report)]
        if running:
            compiling = [r for r in range(len(reports)) if r not in running]
            raise CompileError(
                f"{name}: rank(s) {compiling} compiled the step for new arguments while "
                f"rank(s) {running} ran it as compiled before, so the ranks would run "
                "different programs: every rank must call the step with the same "
                "argument shapes, dtypes, shardings and static values")
        shapes = [dict(r[1]) for r in reports]
        bad = agree.differing_ranks(shapes)
        if bad:
            raise CompileError(
                f"{name}: the ranks' group meshes differ: rank {bad[0]} has "
                f"{shapes[bad[0]]}, rank 0 has {shapes[0]}; every MPMD group must have the "
                "same mesh shape: give every rank the same number of devices (e.g. "
                "make_mpmd_mesh with the same axis_shapes on every rank)"
            )
        differ = agree.differing_ranks([r[0] for r in reports])
        if not differ:
            return
        mine = describe_leaves(call.dynamic, key[1]) + static_lines(call)
        everyone = agree.allgather(mine, comm, "argument agreement")
        r = differ[0]
        mine, theirs = everyone[0], everyone[r]
        k = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if k is None:
            diff = (f"rank 0 passes {len(mine)} argument leaves and static values, rank "
                    f"{r} passes {len(theirs)}")
        else:
            diff = f"rank 0 passes {mine[k]}, rank {r} passes {theirs[k]}"
        raise CompileError(
            f"{name}: the ranks called the step with different arguments, so they would "
            f"build different programs whose messages do not match: {diff}. Every rank "
            "must pass the same shapes, dtypes, shardings and static values"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        """Compiles for the call (cached) and runs one step; see `compile`; collective:
        every rank of the job calls it alike."""
        compiled, call = self._compile(args, kwargs)
        return compiled(*call.args, **call.kwargs)


def mpmd_jit_with_loop(
    fun: Callable | None = None,
    mpmd_mesh: MpmdMesh | None = None,
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
    in_specs: Any = None,
    out_specs: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Iterable[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    compiler_options: dict[str, Any] | None = None,
    task_times_ms: Mapping[str, float] | None = None,
) -> MpmdFunction | Callable[[Callable], MpmdFunction]:
    """Compiles a training step that calls `treduce` once into a pipelined MPMD step.

    The options are `jax.jit`'s, as in JaxPP; see Note: the step's arguments (in
    arguments.py) for how a call is split.

    Args:
      fun: the step. It calls `treduce` (or `treduce_i`) once; its loop body marks the
        end of every stage with `mark_stage_end`.
      mpmd_mesh: the mesh; its MPMD dimension must be the schedule's `mpmd_dim`.
      in_shardings: None, or a pytree prefix of the dynamic positional arguments with
        `PartitionSpec` (or sharding, or None) leaves: the layout of each argument
        inside its group. A spec naming the MPMD axis has it dropped (Note: MPMD axis
        in specs, in array.py). Keyword arguments keep their own layout.
      out_shardings: likewise for the results.
      in_specs / out_specs: JaxPP's other names of `in_shardings` / `out_shardings`
        (give one of each pair).
      static_argnums / static_argnames: arguments that are Python values, not
        arrays: hashable, part of the compile cache key, not passed to the program.
      donate_argnums / donate_argnames: arguments whose buffers the step may reuse
        (e.g. params and optimizer state); do not use them after the call.
      compiler_options: XLA options for every stage executable, as for `jax.jit`.
      task_times_ms: measured task times in ms by task label ('F3s1', 'W0s2'), e.g. each
        label's median from `collect_task_times_ms` over earlier steps of the same step,
        gathered from every rank (each rank times only its own tasks). Given, the
        compiler orders each group's messages for these times (`Note: timed order` in
        compiler/timed_walk.py) instead of for the best case across task-time models; labels
        it lacks take the mean of their kind. Results are unchanged; only the program's
        order differs. Pass the same times on every rank (the ranks agree on the
        program: different times are refused as different programs).

    Returns:
      An `MpmdFunction` (used as a decorator without `fun`, the decorator).

    Raises:
      TypeError: `mpmd_mesh` is not an `MpmdMesh`, a malformed argnum, argname,
        `compiler_options` or `task_times_ms`.
      ValueError: both names of one option, an argnum or argname the function has no
        parameter for, or an argument both static and donated.
    """
    for a, b, x, y in (("in_shardings", "in_specs", in_shardings, in_specs),
                       ("out_shardings", "out_specs", out_shardings, out_specs)):
        if x is not None and y is not None:
            raise ValueError(f"mpmd_jit_with_loop got both {a} and {b}, two names of one "
                             f"option: give one ({b} is JaxPP's alias)")
    options = dict(
        in_shardings=in_specs if in_shardings is None else in_shardings,
        out_shardings=out_specs if out_shardings is None else out_shardings,
        static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames,
        compiler_options=compiler_options, task_times_ms=task_times_ms)
    if fun is None:
        return functools.partial(_wrap, mpmd_mesh=mpmd_mesh, **options)
    return _wrap(fun, mpmd_mesh, **options)


def _runtime_sends(mesh: MpmdMesh) -> str:
    """How this step's messages will be sent (`simulate.runtime_sends`): in MPI mode by
    the platform of this rank's devices; in local mode messages are device copies made
    in the rendezvous play's order (`Note: local order`), timed as blocking sends."""
    if mesh.is_local:
        return "blocking"
    device = next(iter(mesh.jax_mesh.devices.flat), None)  # none: a submesh without us
    platform = device.platform if device is not None else jax.default_backend()
    options = config.options()
    return runtime_sends(platform, options.posted_sends,
                         config.stages_messages(options, platform))


def _cache_words(plan: StepPlan) -> str:
    """What the program cache spared a plan, for the log (`Note: program cache`)."""
    if plan.step_from_cache:
        return (f"; program cache hit: loop tasks, task graph, lowering and verification "
                f"skipped (the step's entry read in {plan.cache_read_s:.2f} s; an earlier "
                "launch, or a rank of this host that got there first, built it)")
    if plan.program_from_cache:
        return ("; program cache hit: lowering and verification skipped (the same task "
                "graph was lowered before)")
    return ""


def _program_cache() -> ProgramCache | None:
    """Where lowered programs are kept across launches (JAXPP_MPI_PROGRAM_CACHE, `Note:
    program cache` in compiler/program_cache.py): `auto` puts them in
    `jaxpp_mpi_programs/` inside JAX's persistent compilation cache directory while
    that cache is on (a local directory; JAX's own eviction only touches its
    `*-cache` files), else keeps none."""
    setting = config.options().program_cache
    if setting == "off":
        return None
    if setting != "auto":
        return ProgramCache(setting)
    directory = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and directory) or "://" in directory:
        return None
    return ProgramCache(os.path.join(directory, "jaxpp_mpi_programs"))


def _task_times(task_times_ms: Any) -> dict[str, float] | None:
    """`task_times_ms` checked: None, or a dict of task label to a finite time >= 0."""
    if task_times_ms is None:
        return None
    bad = TypeError(
        "task_times_ms must map task labels (str, e.g. 'F3s1') to times in ms (finite "
        f"numbers >= 0), as collect_task_times_ms gives them; got {task_times_ms!r}")
    if not isinstance(task_times_ms, Mapping):
        raise bad
    out = {}
    for label, t in task_times_ms.items():
        if (not isinstance(label, str) or isinstance(t, bool)
                or not isinstance(t, numbers.Real) or not 0 <= float(t) < float("inf")):
            raise bad
        out[label] = float(t)
    return out


def _wrap(fun: Callable, mpmd_mesh: MpmdMesh | None, *, in_shardings: Any,
          out_shardings: Any, donate_argnums: Any, **options: Any) -> MpmdFunction:
    if mpmd_mesh is None:
        raise TypeError("mpmd_jit_with_loop needs mpmd_mesh, the MpmdMesh to pipeline "
                        "over: mpmd_jit_with_loop(step, mpmd_mesh=mesh)")
    return MpmdFunction(fun, mpmd_mesh, in_shardings, out_shardings, donate_argnums,
                        **options)
