"""`mpmd_jit_with_loop`: the user-facing compile-and-run entry point.

A compiled step is an `MpmdCompiled` (compiled.py, Note: calling a compiled step); its
arguments' signature and layout checks are in arguments.py.

Note: rejecting input on every rank.
  `MpmdFunction.compile` (on a cache miss) makes each decision collectively, before the
  first message (DESIGN.md §7; Note: raise on every rank, in agree.py):
  1. before tracing, one allgather of (this rank's argument error, a digest of the
     argument signature, the group mesh shape): any error, different signatures or
     different group meshes raise on every rank, naming the first differing leaf;
  2. after tracing, splitting and scheduling, one allgather of the error each rank met
     (if any): every rank raises when any rank failed;
  3. `agree_on_program`: one allgather of the program hash;
  4. after compiling this rank's executables, one allgather of the errors again: the
     barrier before the first message.
  When every rank failed, each raises its own error; when only some did, every rank
  raises a `CompileError` naming the failed ranks and the first one's error (chained
  from its own, where it has one). The cache lookup itself is not collective: ranks
  must change a step's signature together, as they do when they run the same script.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxpp_mpi._src import agree
from jaxpp_mpi._src.arguments import (
    abstract,
    check_layout,
    describe_leaves,
    paths,
    per_leaf,
    signature,
    spec_entries,
)
from jaxpp_mpi._src.compiled import MpmdCompiled
from jaxpp_mpi._src.compiler.build import StepPlan, build_step
from jaxpp_mpi._src.errors import CompileError
from jaxpp_mpi._src.mesh import MpmdMesh
from jaxpp_mpi._src.retarget import trace_mesh
from jaxpp_mpi._src.types import Comm, PyTree

# MpmdCompiled is re-exported: `jaxpp_mpi._src.api.MpmdCompiled` stays importable.
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
    """A step wrapped by `mpmd_jit_with_loop`; call it, or `.compile(*args)` it."""

    def __init__(self, fun: Callable, mpmd_mesh: MpmdMesh, in_shardings: Any,
                 out_shardings: Any, donate_argnums: Sequence[int]):
        if not isinstance(mpmd_mesh, MpmdMesh):
            raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(mpmd_mesh).__name__}")
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.mpmd_mesh = mpmd_mesh
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        argnums = (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
        self._donate_argnums = tuple(int(i) for i in argnums)
        self._cache: dict[Any, MpmdCompiled] = {}

    def compile(self, *args: Any) -> MpmdCompiled:
        """Compiles for the signature of `args` (cached); returns the MpmdCompiled.

        Raises:
          TypeError: an argument leaf is not an array (a str, an object, ...).
          ValueError: a malformed `in_shardings` / `out_shardings` / `donate_argnums`,
            or a spec that does not fit its value on the group mesh.
          CompileError: the step cannot be pipelined (see `build_step`), or, in MPI
            mode, the ranks disagree (see `Note: rejecting input on every rank`).
        """
        key, error = None, None
        try:
            key = self._placed(signature(args))
        except TypeError as e:
            error = e
        else:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled
        mesh = self.mpmd_mesh
        name = getattr(self.fun, "__name__", "the step")
        # Local mode: one process, nothing to agree on; each step below simply raises.
        comm: Comm = None if mesh.is_local else mesh.comm
        self._agree_on_arguments(args, key, error, name, comm)
        plan = agree.run(lambda: self._plan(args, key, name), comm,
                         _ranks_failed(name, "to trace it"), own="if_all")
        agree.agree_on_program(plan.program, comm)
        # Everything is compiled when this returns: its allgather is the barrier before
        # this rank's first message (DESIGN.md §7).
        # Each executable is compiled for its group's devices, whatever mesh the caller
        # has set (`jax.set_mesh`) around the call.
        with jax.set_mesh(None):
            compiled = agree.run(lambda: MpmdCompiled(plan, mesh, key[0]), comm,
                                 _ranks_failed(name, "to compile it"), own="if_all")
        self._cache[key] = compiled
        return compiled

    def _placed(self, key: tuple) -> tuple:
        """The signature `key` with each leaf's spec as the step places it: the spec of
        its `in_shardings` entry where there is one (an array arriving in another layout
        is moved to it), so feeding results back hits the cache whatever their layout."""
        if self._in_shardings is None:
            return key
        tree, sig = key
        try:
            specs = [spec_entries(s, "in_shardings")
                     for s in per_leaf(self._in_shardings, tree, "in_shardings")]
        except (TypeError, ValueError):
            return key  # `_plan` rejects it on every rank
        placed = []
        for entry, spec in zip(sig, specs):
            if spec is not None:
                spec = list(spec)
                while spec and spec[-1] is None:
                    spec.pop()
                entry = (*entry[:3], tuple(spec))
            placed.append(entry)
        return tree, tuple(placed)

    def _plan(self, args: tuple, key: tuple, name: str) -> StepPlan:
        """Traces, splits and schedules the step for `args` (signature `key`)."""
        tree, sig = key
        for i in self._donate_argnums:
            if not 0 <= i < len(args):
                raise ValueError(f"donate_argnums has {i}, but the step got {len(args)} "
                                 "arguments")
        abstract_args = jax.tree.unflatten(tree, [abstract(x) for x in jax.tree.leaves(args)])
        specs = per_leaf(self._in_shardings, tree, "in_shardings")
        in_specs = [
            spec_entries(s, "in_shardings") if s is not None else entry[3]
            for s, entry in zip(specs, sig)
        ]
        mesh = self.mpmd_mesh
        group_shape, mpmd_axis = mesh.group_shape, mesh.mpmd_axis_name
        leaf_paths = None
        for j, (spec, entry) in enumerate(zip(in_specs, sig)):
            if spec:
                leaf_paths = leaf_paths or paths(args)
                check_layout(spec, entry[0], group_shape, f"argument {leaf_paths[j]}",
                             mpmd_axis)
        donate = []
        for i, a in enumerate(args):
            donate += [i in self._donate_argnums] * len(jax.tree.leaves(a))
        out_specs = None
        if self._out_shardings is not None:
            with jax.sharding.use_abstract_mesh(trace_mesh(mesh.jax_mesh)):  # as traced
                out_tree = jax.tree.structure(jax.eval_shape(self.fun, *abstract_args))
            out_specs = [spec_entries(s, "out_shardings")
                         for s in per_leaf(self._out_shardings, out_tree, "out_shardings")]
        start = time.perf_counter()
        plan = build_step(self.fun, abstract_args, mesh.mpmd_dim, in_specs=in_specs,
                          out_specs=out_specs, donate=donate, what=f"{name}", mesh=mesh)
        if out_specs is not None:
            out_paths = paths(jax.tree.unflatten(plan.out_tree, plan.output_avals))
            for k, (spec, aval) in enumerate(zip(out_specs, plan.output_avals)):
                where = "result" + out_paths[k].removeprefix("args")
                check_layout(spec, aval.shape, group_shape, where, mpmd_axis)
        if mesh.is_local or mesh.my_mpmd_axis_index == 0:
            logger.info("%s: traced, split and scheduled into %d groups' programs "
                        "(%d instructions) in %.1f s", name, plan.num_groups,
                        sum(len(g.instrs) for g in plan.program.groups),
                        time.perf_counter() - start)
        return plan

    def _agree_on_arguments(self, args: tuple, key: tuple | None,
                            error: Exception | None, name: str, comm: Comm) -> None:
        """Step 1 of `Note: rejecting input on every rank`.

        Raises:
          TypeError / CompileError: a rank's arguments are not arrays (its own error on
            every rank when all failed alike).
          CompileError: the ranks passed different argument signatures, or their group
            meshes differ in shape.
        """
        mesh = self.mpmd_mesh
        digest = None
        if key is not None:
            digest = hashlib.sha256(repr((key[0].num_leaves, key[1])).encode()).hexdigest()
        shape = tuple(mesh.group_shape.items())
        reports = agree.allgather_or_raise((digest, shape), error, comm,
                                           _ranks_failed(name, "the argument check"),
                                           own="if_all")
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
        everyone = agree.allgather(describe_leaves(args, key[1]), comm)
        r = differ[0]
        mine, theirs = everyone[0], everyone[r]
        if len(mine) != len(theirs):
            diff = (f"rank 0 passes {len(mine)} argument leaves, rank {r} passes "
                    f"{len(theirs)}")
        else:
            k = next(k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            diff = f"rank 0 passes {mine[k]}, rank {r} passes {theirs[k]}"
        raise CompileError(
            f"{name}: the ranks called the step with different arguments, so they would "
            f"build different programs whose messages do not match: {diff}. Every rank "
            "must pass the same shapes, dtypes and shardings"
        )

    def __call__(self, *args: Any) -> PyTree:
        """Compiles for `args` (cached) and runs one step; see `compile`."""
        return self.compile(*args)(*args)


def mpmd_jit_with_loop(
    fun: Callable | None = None,
    *,
    mpmd_mesh: MpmdMesh,
    in_shardings: Any = None,
    out_shardings: Any = None,
    donate_argnums: int | Sequence[int] = (),
) -> MpmdFunction | Callable[[Callable], MpmdFunction]:
    """Compiles a training step that calls `treduce` once into a pipelined MPMD step.

    Args:
      fun: the step. It calls `treduce` (or `treduce_i`) once; its loop body marks the
        end of every stage with `mark_stage_end`.
      mpmd_mesh: the mesh; its MPMD dimension must be the schedule's `mpmd_dim`.
      in_shardings: None, or a pytree prefix of the arguments with `PartitionSpec`
        (or None) leaves: the layout of each argument inside its group.
      out_shardings: likewise for the results.
      donate_argnums: arguments whose buffers the step may reuse (e.g. params and
        optimizer state); do not use them after the call.

    Returns:
      An `MpmdFunction` (used as a decorator without `fun`, the decorator).
    """
    if fun is None:
        return functools.partial(mpmd_jit_with_loop, mpmd_mesh=mpmd_mesh,
                                 in_shardings=in_shardings, out_shardings=out_shardings,
                                 donate_argnums=donate_argnums)
    return MpmdFunction(fun, mpmd_mesh, in_shardings, out_shardings, donate_argnums)
