"""Sharding constraints of the user's step, retargeted from the user's mesh to a group's.

Note: sharding constraints.
  `mpmd_jit_with_loop` traces the step under `trace_mesh(mesh)`: the user's mesh (in
  local mode the whole mesh, MPMD axis included; in MPI mode this rank's group mesh)
  as an abstract mesh with every axis `Auto`. So `with_sharding_constraint(x, P(...))`
  with a bare PartitionSpec needs no mesh context from the user, and means the same
  under `Auto` and `Explicit` axes: a constraint, as stage executables are compiled
  without sharding-in-types. A `NamedSharding` given instead names the mesh captured
  in the user's code: its devices span every group in local mode, and the same spec
  on another rank's group means other devices in MPI mode.
  `retarget_jaxpr` then rewrites every sharding the traced step holds (the
  `sharding_constraint` eqns, and any `NamedSharding` parameter of another primitive,
  such as the replicated `sharding` JAX gives a `reshape` traced under a mesh), in
  sub-jaxprs too (the treduce body, jit, scan, cond, while, remat, custom_jvp and
  custom_vjp), to a `NamedSharding` on `group_mesh(mesh, mpmd_axis)`: the group's axes,
  all `Auto`, without devices.
  Each executable binds that abstract mesh to its own group's devices when it is
  compiled, so the rewrite is done once per step, identical on every rank. A spec
  entry naming the MPMD axis drops it (a group holds one slice of that axis).
  Such a constraint places a value, it never changes it, and jaxpp_mpi keeps `jax.jit`'s
  meaning, checked against `jax.jit` of the same step: a constraint naming the MPMD axis
  is accepted, the value whole along that dimension in each group (`jax.jit` spreads it
  over the MPMD axis's devices too); one whose axes do not divide the dimension is
  accepted as `jax.jit` accepts it, XLA padding the last shard (uneven shards), whether
  the axes are the group's or the MPMD axis. Neither is an error under `jax.jit`, so
  neither is one here: the results equal `jax.jit`'s (tests/local and tests/mpi
  `test_sharding_constraint*`: the group's "data" axis of 2 over 3 rows, the MPMD axis
  over 3 rows, both).
  JAX itself rejects a `NamedSharding` naming an `Explicit` axis in
  `with_sharding_constraint` (it asks for `reshard`, which in turn needs sharding in
  types); `trace_step` turns that error into one that says to pass a bare
  PartitionSpec or to build the mesh with `Auto` axes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.extend import core as jex_core
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src.base.errors import CompileError

__all__ = ["group_mesh", "retarget_jaxpr", "trace_mesh"]

_CONSTRAINT = "sharding_constraint"


def trace_mesh(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    """`mesh` as an abstract mesh with every axis `Auto` (see Note: sharding constraints)."""
    return _auto(dict(mesh.shape))


def group_mesh(mesh: Mesh | AbstractMesh, mpmd_axis: str) -> AbstractMesh:
    """One group's abstract mesh: `mesh` without `mpmd_axis`, every axis `Auto`."""
    return _auto({n: s for n, s in mesh.shape.items() if n != mpmd_axis})


def _auto(shape: Mapping[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(shape.values()), tuple(shape),
                        axis_types=(AxisType.Auto,) * len(shape))


def retarget_jaxpr(jaxpr: jex_core.Jaxpr, mesh: Mesh | AbstractMesh,
                   mpmd_axis: str) -> jex_core.Jaxpr:
    """Rewrites the shardings of a traced step onto one group's abstract mesh.

    Args:
      jaxpr: the traced step.
      mesh: the user's mesh (see Note: sharding constraints).
      mpmd_axis: the axis that separates the groups.

    Returns:
      `jaxpr` itself when it holds no sharding to rewrite, else an equivalent jaxpr
      (same vars) whose every `NamedSharding` lies on `group_mesh(mesh, mpmd_axis)`.

    Raises:
      CompileError: a constraint with a sharding other than a `NamedSharding`, or
        naming an axis the mesh lacks or has with another size.
    """
    return _Retarget(mesh, mpmd_axis).jaxpr(jaxpr)


# Param types `_Retarget.param` leaves as they are without a look (no sharding inside).
_PLAIN = frozenset({bool, int, float, complex, str, type(None)})


class _Retarget:
    """One rewrite: the target mesh and a memo of the sub-jaxprs already rewritten."""

    def __init__(self, mesh: Mesh | AbstractMesh, mpmd_axis: str):
        self.whole = dict(mesh.shape)
        self.mpmd_axis = mpmd_axis
        self.group = group_mesh(mesh, mpmd_axis)
        self.memo: dict[Any, Any] = {}  # a (Closed)Jaxpr -> its rewrite; identity keys

    def jaxpr(self, jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
        done = self.memo.get(jaxpr)
        if done is not None:
            return done
        eqns = [self.eqn(e) for e in jaxpr.eqns]
        if any(new is not old for new, old in zip(eqns, jaxpr.eqns)):
            out = jaxpr.replace(eqns=eqns)
        else:
            out = jaxpr
        self.memo[jaxpr] = out
        return out

    def eqn(self, eqn: jex_core.JaxprEqn) -> jex_core.JaxprEqn:
        if eqn.primitive.name == _CONSTRAINT:
            return self.constraint(eqn)
        params = None  # a copy of eqn.params once one of them changes
        for k, v in eqn.params.items():
            new = self.param(v)
            if new is not v:
                if params is None:
                    params = dict(eqn.params)
                params[k] = new
        return eqn if params is None else eqn.replace(params=params)

    def constraint(self, eqn: jex_core.JaxprEqn) -> jex_core.JaxprEqn:
        sharding = eqn.params["sharding"]
        if not isinstance(sharding, NamedSharding):
            raise CompileError(
                f"with_sharding_constraint with a {type(sharding).__name__} ({sharding}): "
                "inside a pipelined step give a NamedSharding on the mesh, or a bare "
                "PartitionSpec (the step is traced under the mesh), so that every group "
                "can apply it to its own devices"
            )
        new = self.sharding(sharding)
        if new is sharding and eqn.params["context_mesh"] == self.group:
            return eqn
        return eqn.replace(params={**eqn.params, "sharding": new, "context_mesh": self.group})

    def param(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:  # most params (axes, sizes, flags): nothing to rewrite
            return value
        if kind is tuple or kind is list:  # not NamedTuples: no sharding there
            new = None  # a copy of `value` once one of its items changes
            for j, v in enumerate(value):
                if type(v) in _PLAIN:
                    continue
                w = self.param(v)
                if w is not v:
                    if new is None:
                        new = list(value)
                    new[j] = w
            return value if new is None else kind(new)
        if isinstance(value, jex_core.ClosedJaxpr):
            done = self.memo.get(value)
            if done is None:
                inner = self.jaxpr(value.jaxpr)
                done = value if inner is value.jaxpr else jex_core.ClosedJaxpr(
                    inner, value.consts)
                self.memo[value] = done
            return done
        if isinstance(value, jex_core.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, NamedSharding):
            return self.sharding(value)
        return value

    def sharding(self, sharding: NamedSharding) -> NamedSharding:
        """`sharding` on the group's abstract mesh, the MPMD axis dropped."""
        if sharding.mesh == self.group:
            return sharding
        sizes = dict(sharding.mesh.shape)
        spec = PartitionSpec(*(self.entry(e, sizes, sharding) for e in sharding.spec))
        return NamedSharding(self.group, spec, memory_kind=sharding.memory_kind)

    def entry(self, entry: Any, sizes: dict[str, int], sharding: NamedSharding) -> Any:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            return entry
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = []
        for name in names:
            if name == self.mpmd_axis:
                continue
            if name not in self.whole:
                raise CompileError(
                    f"a sharding inside the step ({sharding}) names axis {name!r}, which "
                    f"the mesh lacks (axes {self.whole}): name the mesh's axes"
                )
            if sizes.get(name, self.whole[name]) != self.whole[name]:
                raise CompileError(
                    f"a sharding inside the step ({sharding}) has axis {name!r} of size "
                    f"{sizes[name]}, but the mesh's {name!r} has size {self.whole[name]}: "
                    "build shardings on the mesh given to mpmd_jit_with_loop"
                )
            kept.append(name)
        if not kept:
            return None
        return kept[0] if not isinstance(entry, tuple) else tuple(kept)

