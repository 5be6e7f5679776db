"""`mpmd_jit_with_loop`: the user-facing compile-and-run entry point.

Note: calling a compiled step.
  `MpmdFunction.__call__` looks up (or builds) the `MpmdCompiled` for the arguments'
  signature — pytree structure, and per leaf shape, dtype, weak type and, for an
  `MpmdArray`, its spec — so a training loop compiles once. The compiled step takes
  each flat argument to the group that owns it (an `MpmdArray` already there is used
  as it is, with no copy), adds the constants and the microbatch indexes (placed once,
  at compile time), runs the executor and wraps every result as an `MpmdArray` on the
  groups that hold it. Results feed the next step with no transfer: each updated
  parameter is produced on the group that owns the parameter.

Note: rejecting input on every rank.
  In MPI mode an error that only some ranks see would leave the others waiting for
  messages that never come. So `MpmdFunction.compile` (on a cache miss) makes each
  decision collectively, before the first message (DESIGN.md §7):
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
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src.array import MpmdArray, MpmdSharding, mpmd_array_from_local
from jaxpp_mpi._src.compiler.build import StepPlan, build_step, compile_exe
from jaxpp_mpi._src.errors import CompileError
from jaxpp_mpi._src.mesh import MpmdMesh
from jaxpp_mpi._src.ir.program import Aval, GroupProgram, Program

__all__ = ["MpmdCompiled", "MpmdFunction", "mpmd_jit_with_loop"]

# Progress of compilation, at INFO on rank 0 (local mode: the one process); quiet unless
# the application enables it, e.g. logging.basicConfig(level=logging.INFO).
logger = logging.getLogger("jaxpp_mpi")
_REPORT_EVERY_S = 5.0


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, MpmdSharding, NamedSharding))


def _per_leaf(prefix: Any, tree: jax.tree_util.PyTreeDef, what: str) -> list[Any]:
    """Broadcasts a pytree prefix of specs to one entry per leaf of `tree`."""
    if prefix is None:
        return [None] * tree.num_leaves
    leaves, spec_tree = jax.tree.flatten(prefix, is_leaf=_is_spec_leaf)
    ids = jax.tree.unflatten(tree, range(tree.num_leaves))
    try:
        subtrees = spec_tree.flatten_up_to(ids)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} must be a pytree prefix of the arguments/results with PartitionSpec "
            f"or None leaves; got structure {spec_tree} for {tree}"
        ) from e
    out: list[Any] = [None] * tree.num_leaves
    for spec, sub in zip(leaves, subtrees):
        for k in jax.tree.leaves(sub):
            out[k] = spec
    return out


def _spec_entries(spec: Any, what: str) -> tuple | None:
    if spec is None:
        return None
    if isinstance(spec, (MpmdSharding, NamedSharding)):
        spec = spec.spec
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{what}: expected a PartitionSpec or None, got {spec!r}")
    return tuple(spec)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and weak type of one argument leaf.

    Raises:
      TypeError: `x` is neither an array nor a number (a str, an arbitrary object, a
        numpy array of strings or objects), or is a typed PRNG key array. The message
        says what `x` is; `MpmdFunction._signature` prefixes the leaf's path.
    """
    if isinstance(x, (MpmdArray, jax.Array, jax.ShapeDtypeStruct)):
        weak = getattr(x, "weak_type", False)
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
    elif isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        arr = np.asarray(x)
        if arr.dtype != np.bool_ and not jnp.issubdtype(arr.dtype, np.number):
            raise TypeError(f"is a numpy value of dtype {arr.dtype}, not a number or an "
                            f"array of numbers{_NON_ARRAY_HINT}")
        weak = isinstance(x, (bool, int, float, complex))
        out = jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype),
                                   weak_type=weak)
    else:
        what = (f"a str ({x!r:.40})" if isinstance(x, str)
                else f"an object of type {type(x).__qualname__}")
        raise TypeError(f"is {what}, not an array{_NON_ARRAY_HINT}")
    if not isinstance(out.dtype, np.dtype) and jax.dtypes.issubdtype(
            out.dtype, jax.dtypes.extended):
        raise TypeError(
            f"is a typed PRNG key array (dtype {out.dtype}); jaxpp_mpi places and sends "
            "plain arrays only: pass jax.random.key_data(key) and rebuild the key inside "
            "the step with jax.random.wrap_key_data"
        )
    return out


_NON_ARRAY_HINT = (
    ": mpmd_jit_with_loop traces every argument leaf as an array, as jax.jit does; pass "
    "strings, flags and other Python values by closing over them (e.g. "
    "functools.partial(step, flag=...)), not as arguments"
)


def _paths(tree: Any) -> list[str]:
    """`args[0]['w']`-style names of the leaves of `tree` (an argument tuple)."""
    return ["args" + jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _check_layout(spec: tuple | None, shape: tuple[int, ...], group_shape: dict[str, int],
                  where: str, mpmd_axis: str) -> None:
    """Raises ValueError unless `spec` can lay out a value of `shape` on a group mesh of
    `group_shape`: known axes, at most one entry per dimension, dimensions divisible."""
    if not spec:
        return
    shown = PartitionSpec(*spec)
    if len(spec) > len(shape):
        raise ValueError(f"{where} has shape {shape}, but its spec {shown} has {len(spec)} "
                         "entries: give at most one entry per dimension")
    for dim, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        unknown = [a for a in axes if a not in group_shape]
        if unknown:
            hint = (f"{mpmd_axis!r} is the MPMD axis, which separates the groups; "
                    if mpmd_axis in unknown else "")
            raise ValueError(f"{where}: spec {shown} names {unknown}, not axes of the group "
                             f"mesh {group_shape}: {hint}name only the group axes "
                             f"{tuple(group_shape)}")
        ways = math.prod(group_shape[a] for a in axes)
        if shape[dim] % ways:
            raise ValueError(
                f"{where} has shape {shape}; its spec {shown} splits dimension {dim} (size "
                f"{shape[dim]}) {ways} ways over {axes} of the group mesh {group_shape}, "
                f"which does not divide it: make that dimension a multiple of {ways} (e.g. "
                "the rows of every microbatch), or leave it unsplit (None) in the spec"
            )


class MpmdCompiled:
    """A step compiled for one argument signature (see `Note: calling a compiled step`).

    Attributes:
      in_shardings: a pytree like the arguments: per leaf, the `MpmdSharding` of the
        group that owns it (None for an argument the step does not read).
      out_shardings: a pytree like the result: per leaf, where it lives.
      plan: the `StepPlan` (program, executables' specs, input and output layout).
    """

    def __init__(self, plan: StepPlan, mesh: MpmdMesh, in_tree: jax.tree_util.PyTreeDef):
        self.plan = plan
        self.mesh = mesh
        self._in_tree = in_tree
        self._shardings: dict[tuple[int, Aval], NamedSharding] = {}
        self._auto_meshes: dict[int, Mesh] = {}
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

    def _output_holders(self) -> list[tuple[int, ...]]:
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

    def _compile_group(self, g: int, report: bool) -> dict[str, Any]:
        """Compiles group `g`'s executables; logs progress when `report`."""
        plan = self.plan
        exes = plan.exes[g]
        total = sum(len(e) for e in plan.exes)
        if report:
            logger.info("compiling %d executables for group %d (%d across %d groups)",
                        len(exes), g, total, plan.num_groups)
        start = last = time.perf_counter()
        mine = {}
        for k, (name, exe) in enumerate(exes.items(), 1):
            ins, outs = plan.exe_avals[g][name]
            mine[name] = compile_exe(exe, ins, outs, functools.partial(self.sharding, g))
            now = time.perf_counter()
            if report and k < len(exes) and now - last >= _REPORT_EVERY_S:
                logger.info("group %d: %d/%d compiled, %.1f s", g, k, len(exes), now - start)
                last = now
        if report:
            logger.info("group %d: %d/%d executables compiled in %.1f s", g, len(exes),
                        len(exes), time.perf_counter() - start)
        return mine

    def _make_executor(self):
        plan, mesh = self.plan, self.mesh
        report = mesh.is_local or mesh.my_mpmd_axis_index == 0
        executables = [self._compile_group(g, report) if g in mesh.local_groups else {}
                       for g in range(plan.num_groups)]
        if mesh.is_local:
            from jaxpp_mpi._src.runtime.local import LocalExecutor

            return LocalExecutor(plan.program, executables, self.sharding)
        from jaxpp_mpi._src.runtime.mpi import MpiExecutor

        g = mesh.my_mpmd_axis_index
        # No message yet: `MpmdFunction.compile` agrees with the other ranks first.
        return MpiExecutor(plan.program, g, executables[g],
                           functools.partial(self.sharding, g), mesh.comm)

    def _fixed_inputs(self) -> list[Any]:
        """Constants and microbatch indexes, placed once on the groups that use them."""
        plan = self.plan
        fixed: list[Any] = [None] * len(plan.input_avals)
        local = self.mesh.local_groups
        for k, c in enumerate(plan.consts):
            owner = plan.input_owner[k]
            if owner in local:
                fixed[k] = jax.device_put(c, self.sharding(owner, plan.input_avals[k]))
        for k, g, m in plan.mb_inputs:
            if g in local:
                fixed[k] = jax.device_put(np.int32(m), self.sharding(g, plan.input_avals[k]))
        return fixed

    def _arg_for_owner(self, x: Any, k: int) -> Any:
        owner = self.plan.input_owner[k]
        if owner is None or owner not in self.mesh.local_groups:
            return None
        if isinstance(x, MpmdArray):
            local = x.local_arrays
            if owner in local:
                return local[owner]
            return next(iter(local.values()))  # local mode: another group's replica
        return x

    def _check_args(self, leaves: list, args: tuple) -> None:
        """Raises, on every rank alike, for an MpmdArray held away from its owner group.

        In local mode the executor copies such an array; in MPI mode only its holders
        have the data, so the step cannot start.
        """
        if self.mesh.is_local:
            return
        n_consts = len(self.plan.consts)
        for j, x in enumerate(leaves):
            owner = self.plan.input_owner[n_consts + j]
            if isinstance(x, MpmdArray) and owner is not None and owner not in x.mpmd_idxs:
                raise ValueError(
                    f"argument {_paths(args)[j]} is an MpmdArray held by groups "
                    f"{sorted(x.mpmd_idxs)}, "
                    f"but this step reads it on group {owner}: pass the array this step's "
                    f"in_shardings place there (compiled.in_shardings), or a plain array "
                    "present on every rank"
                )

    def __call__(self, *args: Any) -> Any:
        """Runs one step; returns the result pytree of `MpmdArray`s."""
        leaves, tree = jax.tree.flatten(args)
        if tree != self._in_tree:
            raise ValueError(f"arguments have structure {tree}, compiled for {self._in_tree}")
        self._check_args(leaves, args)
        plan = self.plan
        n_consts = len(plan.consts)
        inputs = list(self._fixed)
        for j, x in enumerate(leaves):
            inputs[n_consts + j] = self._arg_for_owner(x, n_consts + j)
        replicas = self._executor.run_replicas(inputs)
        outs = []
        for k, (desc, aval) in enumerate(zip(plan.outputs, plan.output_avals)):
            sharding = self._out_sh[k]
            if desc[0] == "lit":
                outs.append(mpmd_array_from_local(self.mesh, desc[1], sharding))
                continue
            held = replicas[k]
            outs.append(MpmdArray._trusted([held[g] for g in self._local_holders[k]],
                                           sharding, aval.shape, np.dtype(aval.dtype)))
        return jax.tree.unflatten(plan.out_tree, outs)


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _allgather(mesh: MpmdMesh, obj: Any) -> list[Any]:
    from jaxpp_mpi._src.mpi import collectives  # the MPI layer (imports mpi4py)

    return collectives.allgather_object(obj, mesh.comm)


def _raise_gathered(name: str, messages: list[str | None], error: Exception | None,
                    when: str) -> None:
    """Raises on every rank if any rank's message is set (`Note: rejecting input on
    every rank`); `error` is this rank's own error (None if it had none)."""
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None and len(failed) == len(messages):
        raise error
    ok = [r for r, m in enumerate(messages) if m is None]
    raise CompileError(
        f"{name}: rank(s) {failed} failed {when} and rank(s) {ok} did not, so the ranks "
        "cannot run one program; every rank must call the step with the same arguments "
        f"and the same code. Rank {failed[0]}: {messages[failed[0]]}"
    ) from error


def _raise_if_any_rank_failed(mesh: MpmdMesh, name: str, error: Exception | None,
                              when: str) -> None:
    """Steps 2 and 4 of `Note: rejecting input on every rank`: allgathers the errors."""
    _raise_gathered(name, _allgather(mesh, _describe(error)), error, when)


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

    def _signature(self, args: tuple) -> tuple:
        """The cache key of `args`: (pytree structure, per leaf (shape, dtype name, weak
        type, spec)).

        Raises:
          TypeError: a leaf is not an array (see `_abstract`), named by its path.
        """
        leaves, tree = jax.tree.flatten(args)
        sig = []
        for j, x in enumerate(leaves):
            try:
                a = _abstract(x)
            except TypeError as e:
                raise TypeError(f"argument {_paths(args)[j]} {e}") from None
            # An MpmdArray's layout is part of the signature; a replicated one and a
            # plain array (placed replicated) compile alike, so a loop that feeds its
            # outputs back hits the cache.
            spec = list(x.spec) if isinstance(x, MpmdArray) else []
            while spec and spec[-1] is None:
                spec.pop()
            sig.append((a.shape, np.dtype(a.dtype).name, a.weak_type, tuple(spec)))
        return tree, tuple(sig)

    def compile(self, *args: Any) -> MpmdCompiled:
        """Compiles for the signature of `args` (cached); returns the MpmdCompiled.

        Raises:
          TypeError: an argument leaf is not an array (a str, an object, ...) or is a
            typed PRNG key array.
          ValueError: a malformed `in_shardings` / `out_shardings` / `donate_argnums`,
            or a spec that does not fit its value on the group mesh.
          CompileError: the step cannot be pipelined (see `build_step`), or, in MPI
            mode, the ranks disagree (see `Note: rejecting input on every rank`).
        """
        key, error = None, None
        try:
            key = self._signature(args)
        except TypeError as e:
            error = e
        else:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled
        mesh = self.mpmd_mesh
        name = getattr(self.fun, "__name__", "the step")
        if mesh.is_local:
            if error is not None:
                raise error
            compiled = MpmdCompiled(self._plan(args, key, name), mesh, key[0])
        else:
            from jaxpp_mpi._src.runtime.mpi import agree_on_program

            self._agree_on_arguments(args, key, error, name)
            plan = None
            try:
                plan = self._plan(args, key, name)
            except Exception as e:  # noqa: BLE001 - raised on every rank just below
                error = e
            _raise_if_any_rank_failed(mesh, name, error, "to trace it")
            agree_on_program(plan.program, mesh.comm)
            compiled = None
            try:
                compiled = MpmdCompiled(plan, mesh, key[0])
            except Exception as e:  # noqa: BLE001 - raised on every rank just below
                error = e
            # Everything is compiled: this allgather is the barrier before this rank's
            # first message (DESIGN.md §7).
            _raise_if_any_rank_failed(mesh, name, error, "to compile it")
        self._cache[key] = compiled
        return compiled

    def _plan(self, args: tuple, key: tuple, name: str) -> StepPlan:
        """Traces, splits and schedules the step for `args` (signature `key`)."""
        tree, sig = key
        for i in self._donate_argnums:
            if not 0 <= i < len(args):
                raise ValueError(f"donate_argnums has {i}, but the step got {len(args)} "
                                 "arguments")
        abstract = jax.tree.unflatten(tree, [_abstract(x) for x in jax.tree.leaves(args)])
        specs = _per_leaf(self._in_shardings, tree, "in_shardings")
        in_specs = [
            _spec_entries(s, "in_shardings") if s is not None else entry[3]
            for s, entry in zip(specs, sig)
        ]
        mesh = self.mpmd_mesh
        group_shape, mpmd_axis = mesh.group_shape, mesh.mpmd_axis_name
        paths = None
        for j, (spec, entry) in enumerate(zip(in_specs, sig)):
            if spec:
                paths = paths or _paths(args)
                _check_layout(spec, entry[0], group_shape, f"argument {paths[j]}", mpmd_axis)
        donate = []
        for i, a in enumerate(args):
            donate += [i in self._donate_argnums] * len(jax.tree.leaves(a))
        out_specs = None
        if self._out_shardings is not None:
            out_tree = jax.tree.structure(jax.eval_shape(self.fun, *abstract))
            out_specs = [_spec_entries(s, "out_shardings")
                         for s in _per_leaf(self._out_shardings, out_tree, "out_shardings")]
        start = time.perf_counter()
        plan = build_step(self.fun, abstract, mesh.mpmd_dim, in_specs=in_specs,
                          out_specs=out_specs, donate=donate, what=f"{name}")
        if out_specs is not None:
            out_paths = _paths(jax.tree.unflatten(plan.out_tree, plan.output_avals))
            for k, (spec, aval) in enumerate(zip(out_specs, plan.output_avals)):
                where = "result" + out_paths[k].removeprefix("args")
                _check_layout(spec, aval.shape, group_shape, where, mpmd_axis)
        if mesh.is_local or mesh.my_mpmd_axis_index == 0:
            logger.info("%s: traced, split and scheduled into %d groups' programs "
                        "(%d instructions) in %.1f s", name, plan.num_groups,
                        sum(len(g.instrs) for g in plan.program.groups),
                        time.perf_counter() - start)
        return plan

    def _agree_on_arguments(self, args: tuple, key: tuple | None,
                            error: Exception | None, name: str) -> None:
        """Step 1 of `Note: rejecting input on every rank` (MPI mode).

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
        reports = _allgather(mesh, (_describe(error), digest, shape))
        _raise_gathered(name, [r[0] for r in reports], error, "the argument check")
        shapes = [dict(r[2]) for r in reports]
        bad = [r for r, s in enumerate(shapes) if s != shapes[0]]
        if bad:
            raise CompileError(
                f"{name}: the ranks' group meshes differ: rank {bad[0]} has "
                f"{shapes[bad[0]]}, rank 0 has {shapes[0]}; every MPMD group must have the "
                "same mesh shape: give every rank the same number of devices (e.g. "
                "make_mpmd_mesh with the same axis_shapes on every rank)"
            )
        if len({r[1] for r in reports}) == 1:
            return
        leaves = [f"{a} {np.dtype(d).name}{list(s)}{' weak' if w else ''}"
                  f"{' spec ' + str(PartitionSpec(*p)) if p else ''}"
                  for a, (s, d, w, p) in zip(_paths(args), key[1])]
        everyone = _allgather(mesh, leaves)
        r = next(r for r, d in enumerate(reports) if d[1] != reports[0][1])
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

    def __call__(self, *args: Any) -> Any:
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
