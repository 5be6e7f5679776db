"""`mpmd_init`: initialise values on their owning groups only, never as full replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree

__all__ = ["group_init_jaxprs", "mpmd_init"]


def _is_target(x: Any) -> bool:
    return x is None or isinstance(x, MpmdSharding)


def _trace(init_fn: Callable, mpmd_shardings: Any, args: tuple):
    """Traces `init_fn(*args)`; returns (closed jaxpr, flat shardings, out tree, mesh)."""
    flat_args, in_tree = jax.tree.flatten(args)

    def flat_fn(*leaves):
        return jax.tree.leaves(init_fn(*jax.tree.unflatten(in_tree, leaves)))

    closed = jax.make_jaxpr(flat_fn)(*flat_args)
    out_tree = jax.tree.structure(jax.eval_shape(lambda *a: init_fn(*a), *args))
    targets, target_tree = jax.tree.flatten(mpmd_shardings, is_leaf=_is_target)
    if target_tree != out_tree:
        raise ValueError(f"init_fn's result and mpmd_shardings differ in structure:\n  "
                         f"result: {out_tree}\n  mpmd_shardings: {target_tree}")
    bad = [t for t in targets if not _is_target(t)]
    if bad:
        raise ValueError(f"mpmd_shardings leaves must be MpmdSharding or None, got {bad[0]!r}")
    meshes = {t.mpmd_mesh for t in targets if t is not None}
    if len(meshes) > 1:
        raise ValueError("mpmd_shardings name more than one MpmdMesh")
    return closed, flat_args, targets, out_tree, next(iter(meshes), None)


def group_init_jaxprs(
    init_fn: Callable, mpmd_shardings: Any, *args: Any
) -> dict[int, tuple[jex_core.ClosedJaxpr, list[int], list[bool]]]:
    """Per group this process holds, the part of `init_fn` that group computes.

    Returns:
      `{mpmd_idx: (jaxpr, outputs, used_inputs)}`: `jaxpr` is `init_fn`'s jaxpr with
      every equation that does not feed an output owned by the group removed, `outputs`
      the flat result indexes it computes, `used_inputs` which flat arguments it reads.
      Groups owning nothing are absent.
    """
    closed, _, targets, _, mesh = _trace(init_fn, mpmd_shardings, args)
    if mesh is None:
        return {}
    return _group_jaxprs(closed, targets, mesh)


def _group_jaxprs(closed, targets, mesh: MpmdMesh):
    out = {}
    for g in mesh.local_groups:
        keep = [t is not None and g in t.mesh_ids for t in targets]
        if not any(keep):
            continue
        jaxpr, used_inputs = pe.dce_jaxpr(closed.jaxpr, keep)
        # dce_jaxpr keeps constvars; their values stay those of the full trace.
        pruned = jex_core.ClosedJaxpr(jaxpr, closed.consts)
        out[g] = (pruned, [k for k, b in enumerate(keep) if b], used_inputs)
    return out


def mpmd_init(init_fn: Callable, mpmd_shardings: PyTree, *args: Any) -> PyTree:
    """Runs `init_fn(*args)` so that each group computes only the results it owns.

    Every process traces `init_fn` once, then, for each group it holds, removes from
    the jaxpr every equation not needed by that group's results (dead-code
    elimination) and runs the rest, jitted with the results' layouts on that group's
    mesh. A model too large for one group's memory can thus be initialised, and the
    values equal those of `init_fn(*args)` run whole (same operations, same RNG keys).

    Args:
      init_fn: a function of `args` returning a pytree of arrays.
      mpmd_shardings: a pytree like `init_fn`'s result of `MpmdSharding`s (e.g. the
        parameters' part of `compiled.in_shardings`), all on one mesh; a None leaf
        is not computed and comes back as None.
      *args: `init_fn`'s arguments (e.g. a PRNG key), the same on every rank.

    Returns:
      A pytree like `init_fn`'s result, of `MpmdArray`s (None where the sharding was
      None).

    Raises:
      ValueError: the result and `mpmd_shardings` differ in structure, a leaf is not
        an `MpmdSharding` or None, or the shardings use several meshes.
    """
    closed, flat_args, targets, out_tree, mesh = _trace(init_fn, mpmd_shardings, args)
    avals = closed.out_avals
    results: list[Any] = [None] * len(targets)
    if mesh is None:
        return jax.tree.unflatten(out_tree, results)
    replicas: list[dict[int, jax.Array]] = [{} for _ in targets]
    for g, (jaxpr, outputs, used) in _group_jaxprs(closed, targets, mesh).items():
        group_mesh = mesh.group_mesh(g)
        out_sh = [targets[k].sharding_for(g) for k in outputs]
        fn = jax.jit(jex_core.jaxpr_as_fun(jaxpr), out_shardings=out_sh)
        here = NamedSharding(group_mesh, PartitionSpec())
        ins = [jax.device_put(a, here) for a, u in zip(flat_args, used) if u]
        for k, value in zip(outputs, fn(*ins)):
            replicas[k][g] = value
    for k, t in enumerate(targets):
        if t is None:
            continue
        held = [replicas[k][g] for g in t.local_mesh_ids]
        results[k] = MpmdArray(held, t, shape=avals[k].shape, dtype=np.dtype(avals[k].dtype))
    return jax.tree.unflatten(out_tree, results)
