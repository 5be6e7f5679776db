"""Deferred gradient reduction: data-parallel gradients summed once per step.

Note: deferred reduction.
  In a group whose batch is sharded over a mesh axis (`data`), a weight gradient is a
  sum over the batch: each device computes its shard's partial sum and XLA all-reduces
  them. Accumulated over microbatches (`treduce` with `Add`, `Note: loop tasks`), that
  is one all-reduce per weight per microbatch, where one per step would do: the sum of
  the partial sums is the partial sum of the sums. So an `Add` state whose updates are
  such partial sums is carried *unreduced* (JAX's `PartitionSpec(unreduced=...)`: each
  device holds its own addend, the value is their sum) from the first microbatch's
  executable to the last one's, which reduces it once (`_last` variant). Other groups
  and the runtime never see an unreduced buffer: the state never leaves its group, and
  the loop output (the last state) has its plain layout.

  JAX expresses unreduced values only under Explicit mesh axes, while stage executables
  are compiled on Auto meshes (`MpmdCompiled._auto_mesh`). So the executables of a
  deferred state (its `_first`, plain and `_last` variants) are compiled on the group's
  mesh with every axis Explicit, every input and output typed with the layout the layout
  pass gave it (`Note: layouts`), and their task jaxprs are replayed by `eval_jaxpr`
  here: a contraction (`dot_general`, `reduce_sum`) over a sharded dimension gets an
  unreduced result instead of an all-reduce, an operation that cannot take an unreduced
  operand gets it reduced first (the all-reduce XLA would have placed there), and each
  result is resharded to its layout at the end (`conform`).

  Which states to defer is decided during the layout pass (`Note: layouts` in
  ir/layouts.py), which resolves a family's first variant before the others (they take
  its states): `decide` traces that variant (no XLA compile) with its arguments' layouts,
  and a state whose value comes out unreduced over axes its layout does not split is
  deferred over those axes. Every variant of a deferred family is then compiled once,
  the deferred way (`compile_variant`), its free results laid out as their Explicit
  types say (mesh axes of size 1 left out), so no XLA layout choice has to be compiled
  first. A state whose value is already reduced (nothing to defer), and every state of a
  family whose tracing or compiling fails (an operation Explicit mode refuses, e.g. a
  scatter-add with batch-sharded updates), keeps today's per-microbatch reduction: the
  family's variants compiled so far are dropped and compiled as usual, for the layouts
  they were given. Deferral is an optimisation, never a new failure. The result differs
  from per-microbatch reduction only in the order of floating-point additions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src.base.compat import split_inputs
from jaxpp_mpi._src.ir.instructions import program_spec

__all__ = ["Unreduced", "axes_of", "compile_deferred", "compile_variant", "conform", "decide",
           "eval_jaxpr", "explicit_mesh", "first_variant", "is_explicit", "jaxpr_fun", "like",
           "reduced", "unreduced_axes", "variant_unreduced"]

# Higher-order primitives whose inner jaxpr `eval_jaxpr` runs in place (their semantics
# when evaluated is their inner jaxpr's; differentiation rules are not needed here).
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}

# What JAX raises for an operation whose operands' shardings it will not combine: its
# `ShardingTypeError` is not public (it derives from Exception), so every attempt but
# the last is guarded by Exception; the last one raises whatever it raises.
_REFUSALS = (Exception,)


def explicit_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Explicit (same devices, same names)."""
    return Mesh(mesh.devices, mesh.axis_names,
                axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _type(x: Any):
    return jax.typeof(x)


def is_explicit(x: Any) -> bool:
    """Whether `x` (an array or tracer) is typed with Explicit mesh axes."""
    mesh = getattr(_type(x).sharding, "mesh", None)
    return bool(mesh is not None and AxisType.Explicit in getattr(mesh, "axis_types", ()))


def unreduced_axes(x: Any) -> frozenset[str]:
    """The axes over which `x` (or a `jax.ShapeDtypeStruct`) is unreduced."""
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) \
        else _type(x).sharding
    spec = getattr(sharding, "spec", None)
    return frozenset(getattr(spec, "unreduced", ()) or ())


def _parts(x: Any) -> tuple[Any, ...]:
    """Per dimension of `x`, its spec entry (padded with None to its rank)."""
    t = _type(x)
    parts = tuple(t.sharding.spec.partitions) if t.sharding is not None else ()
    return parts + (None,) * (t.ndim - len(parts))


def reduced(x: Any) -> Any:
    """`x` with its unreduced axes summed (an all-reduce); `x` itself otherwise."""
    if not is_explicit(x) or not unreduced_axes(x):
        return x
    t = _type(x)
    return jax.sharding.reshard(x, NamedSharding(t.sharding.mesh, PartitionSpec(*_parts(x))))


def conform(x: Any, sharding: NamedSharding) -> Any:
    """`x` resharded to `sharding` where its type says otherwise (Explicit values only)."""
    if not is_explicit(x):
        return x
    want = sharding.spec
    have = _type(x).sharding.spec
    want_parts = tuple(want.partitions) + (None,) * (_type(x).ndim - len(want.partitions))
    if _parts(x) == want_parts and have.unreduced == want.unreduced:
        return x
    target = NamedSharding(_type(x).sharding.mesh, want)
    try:
        return jax.sharding.reshard(x, target)
    except _REFUSALS:  # e.g. unreduced over other axes: reduce, then lay out
        return jax.sharding.reshard(reduced(x), target)


def like(v: Any, state: Any) -> Any:
    """`v` laid out as the `Add` state it is added to: unreduced over the same axes
    when the state is (`Note: deferred reduction`); `v` itself otherwise."""
    if not is_explicit(state) or not is_explicit(v):
        return v
    return conform(v, _type(state).sharding)


def _contracted(eqn: jex_core.JaxprEqn, invals: Sequence[Any]) -> tuple[frozenset, tuple]:
    """(mesh axes a `dot_general`/`reduce_sum` sums over, its result's spec entries)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        ls, rs = _parts(invals[0]), _parts(invals[1])
        axes: set[str] = set()
        for a, b in zip(lc, rc):
            if ls[a] is not None and ls[a] == rs[b]:
                axes |= set(axes_of(ls[a]))
        out = ([ls[d] for d in lb]
               + [e for d, e in enumerate(ls) if d not in lc and d not in lb]
               + [e for d, e in enumerate(rs) if d not in rc and d not in rb])
        return frozenset(axes), tuple(out)
    if name == "reduce_sum":
        s = _parts(invals[0])
        dims = eqn.params["axes"]
        axes = {a for d in dims for a in axes_of(s[d])}
        return frozenset(axes), tuple(e for d, e in enumerate(s) if d not in dims)
    return frozenset(), ()


def _literal(x: Any) -> Any:
    if isinstance(x, jex_core.Literal):
        return np.asarray(x.val, dtype=x.aval.dtype)
    return x


def _explicit_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """`params` with the Auto-mesh shardings the step's trace recorded made Explicit:
    a sharding constraint keeps its spec on the current mesh; a result sharding
    (`out_sharding`, `sharding` of a reshape, ...) is dropped for the Explicit rules to
    infer (an Auto trace records the trace mesh there, saying nothing about layout)."""
    out = dict(params)
    current = jax.sharding.get_abstract_mesh()
    for k, v in params.items():
        mesh = getattr(v, "mesh", None)
        if not isinstance(v, NamedSharding) or AxisType.Explicit in mesh.axis_types:
            continue
        out[k] = NamedSharding(current, v.spec) if name == "sharding_constraint" else None
    if name == "sharding_constraint" and "context_mesh" in params:
        out["context_mesh"] = current
    return out


def _harmonized(invals: list[Any]) -> list[Any]:
    """Operands of one shape laid out alike, as Explicit elementwise operations demand
    (Auto mode reshards them implicitly): each takes the layout of the most sharded
    one (a slice of a replicated operand: no communication)."""
    arrays = [v for v in invals if is_explicit(v) and _type(v).ndim]
    if not arrays:
        return invals
    best = max(arrays, key=lambda v: sum(len(axes_of(e)) for e in _parts(v)))
    shape, parts = _type(best).shape, _parts(best)
    out = []
    for v in invals:
        if is_explicit(v) and _type(v).shape == shape and _parts(v) != parts:
            t = _type(v).sharding
            v = conform(v, NamedSharding(t.mesh, PartitionSpec(*parts, unreduced=t.spec.unreduced,
                                                               reduced=t.spec.reduced)))
        out.append(v)
    return out


def _as_reduced(invals: list[Any]) -> list[Any]:
    """The operands that are not unreduced, marked `reduced` over the axes another one
    is unreduced over (a product of an unreduced and a reduced value stays unreduced)."""
    ur = frozenset().union(*(unreduced_axes(v) for v in invals if is_explicit(v)))
    return [v if not is_explicit(v) or unreduced_axes(v) else
            conform(v, NamedSharding(_type(v).sharding.mesh,
                                     PartitionSpec(*_parts(v), reduced=ur)))
            for v in invals]


def _bind(eqn: jex_core.JaxprEqn, invals: list[Any]) -> list[Any]:
    """Binds one eqn with Explicit-typed operands (`Note: deferred reduction`).

    Tries, in order: a contraction over sharded dimensions with an unreduced result;
    the eqn as it is; its operands laid out alike; the other operands of an unreduced
    one as reduced; every operand reduced (and laid out alike). The last attempt raises
    what JAX raises.
    """
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # (subfuns, params) for call-like primitives
        return _bind_plain(eqn, invals)
    params = _explicit_params(eqn.primitive.name, params)
    bind = eqn.primitive.bind
    contracted, out_parts = _contracted(eqn, invals)
    if contracted and "out_sharding" in params:
        sizes = dict(jax.sharding.get_abstract_mesh().shape)
        axes = {a for a in contracted if sizes.get(a, 1) > 1}
        axes |= frozenset().union(*(unreduced_axes(v) for v in invals if is_explicit(v)))
        seen: set[str] = set()  # an axis shards one result dimension at most
        parts = []
        for e in out_parts:
            parts.append(None if set(axes_of(e)) & seen else e)
            seen |= set(axes_of(e))
        spec = PartitionSpec(*parts, unreduced=frozenset(axes - seen))
        params = {**params,
                  "out_sharding": NamedSharding(jax.sharding.get_abstract_mesh(), spec)}
    attempts = [lambda: invals, lambda: _harmonized(invals)]
    if any(is_explicit(v) and unreduced_axes(v) for v in invals):
        attempts += [lambda: _as_reduced(invals), lambda: _as_reduced(_harmonized(invals)),
                     lambda: _harmonized([reduced(v) for v in invals])]
    for k, operands in enumerate(attempts):
        if k == len(attempts) - 1:
            return _results(eqn, bind(*operands(), **params))
        try:
            return _results(eqn, bind(*operands(), **params))
        except _REFUSALS:
            continue
    raise AssertionError("unreachable")


def _bind_plain(eqn: jex_core.JaxprEqn, invals: list[Any]) -> list[Any]:
    subfuns, params = eqn.primitive.get_bind_params(eqn.params)
    return _results(eqn, eqn.primitive.bind(*subfuns, *invals, **params))


def _results(eqn: jex_core.JaxprEqn, out: Any) -> list[Any]:
    return list(out) if eqn.primitive.multiple_results else [out]


def _inner(eqn: jex_core.JaxprEqn) -> tuple[jex_core.Jaxpr, Sequence[Any]] | None:
    """The jaxpr (and consts) a call-like eqn evaluates, or None."""
    param = _CALLS.get(eqn.primitive.name)
    inner = eqn.params.get(param) if param else None
    if inner is None:
        return None
    if isinstance(inner, jex_core.ClosedJaxpr):
        return inner.jaxpr, inner.consts
    if isinstance(inner, jex_core.Jaxpr):
        return inner, ()
    return None


def eval_jaxpr(jaxpr: jex_core.Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """Evaluates `jaxpr` on Explicit-typed operands, deferring reductions (`Note:
    deferred reduction`); values may come out unreduced.

    Each eqn runs with no mesh context of its own (the step's trace recorded the whole
    mesh there; here the operands carry the group's) and its literals as numpy values.

    Raises:
      Whatever JAX raises for an operation it refuses even with reduced operands.
    """
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return _literal(a) if isinstance(a, jex_core.Literal) else env[a]

    constvars, invars = split_inputs(jaxpr, len(consts))
    for v, x in zip(constvars, consts):
        env[v] = x
    for v, x in zip(invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        inner = _inner(eqn)
        with jax.threefry_partitionable(eqn.ctx.threefry_partitionable):
            if inner is not None:
                outs = eval_jaxpr(inner[0], inner[1], *invals)
            else:
                outs = _bind(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [read(a) for a in jaxpr.outvars]


def jaxpr_fun(closed: jex_core.ClosedJaxpr) -> Callable[..., list[Any]]:
    """`jax.extend.core.jaxpr_as_fun(closed)`, evaluated by `eval_jaxpr` when its
    operands are Explicit-typed (a deferred state's executables) and by JAX otherwise."""
    plain = jex_core.jaxpr_as_fun(closed)

    def fn(*args: Any) -> list[Any]:
        if any(is_explicit(a) for a in args):
            return eval_jaxpr(closed.jaxpr, closed.consts, *args)
        return plain(*args)

    return fn


Unreduced = tuple[tuple[frozenset, ...], tuple[frozenset, ...]]
"""Per input and per output of one executable, the axes it is unreduced over."""


def _structs(avals: Sequence[Any], unreduced: Sequence[frozenset], mesh: Mesh) -> list:
    return [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype), sharding=NamedSharding(
        mesh, PartitionSpec(*a.spec, unreduced=u))) for a, u in zip(avals, unreduced)]


def _none(n: int) -> tuple[frozenset, ...]:
    return (frozenset(),) * n


def first_variant(exe: Any) -> bool:
    """Whether `exe` is the variant of its family that makes the `Add` states (the first
    microbatch's: it returns states and takes none)."""
    return any(p is not None for p in exe.state_outs) and not any(
        p is not None for p in exe.state_ins)


def decide(exe: Any, ins: Sequence[Any], outs: Sequence[Any], fixed: Sequence[bool],
           mesh: Mesh) -> tuple[tuple[frozenset, ...] | None, tuple[Any, ...] | None]:
    """Whether to defer the `Add` states of `exe`'s family (`Note: deferred reduction`).

    Traces `exe`, the family's first variant, on `mesh` with Explicit axes (no XLA
    compile) with its arguments laid out as `ins` say.

    Args:
      exe: the family's first variant (`first_variant`).
      ins: its argument Avals, with their layouts.
      outs: its result Avals; `fixed[j]`: whether result j's layout is already decided
        (else its Explicit type decides it, as `compile_variant` lays it out).
      mesh: the group's mesh.

    Returns:
      Per state (in `exe.state_outs` order), the axes its value comes out unreduced over
      beyond those its layout splits it over, or None when there is nothing to defer or
      Explicit mode refuses the executable; and the traced results (the first variant
      takes no state, so `compile_variant` needs no trace of its own), or None.
    """
    em = explicit_mesh(mesh)
    try:
        with jax.set_mesh(em):
            got = jax.eval_shape(exe.fn, *_structs(ins, _none(len(ins)), em))
    except Exception:  # noqa: BLE001 -- Explicit mode refuses the step: not deferred
        return None, None
    per_state = []
    for p in exe.state_outs:
        if p is None:
            per_state.append(frozenset())
            continue
        spec = outs[p].spec if fixed[p] else _struct_spec(got[p])
        per_state.append(unreduced_axes(got[p]) - {a for e in spec for a in axes_of(e)})
    return (tuple(per_state) if any(per_state) else None), tuple(got)


def variant_unreduced(exe: Any, num_ins: int, num_outs: int,
                      per_state: Sequence[frozenset]) -> Unreduced:
    """What each argument and result of `exe`, a variant of a deferred family, is
    unreduced over: its state arguments and state results those of the family."""
    in_u, out_u = list(_none(num_ins)), list(_none(num_outs))
    for u, p in zip(per_state, exe.state_ins):
        if p is not None:
            in_u[p] = u
    for u, p in zip(per_state, exe.state_outs):
        if p is not None:
            out_u[p] = u
    return tuple(in_u), tuple(out_u)


def compile_variant(exe: Any, ins: Sequence[Any], outs: Sequence[Any], fixed: Sequence[bool],
                    unreduced: Unreduced, mesh: Mesh, *,
                    compiler_options: dict[str, Any] | None = None,
                    traced: Sequence[Any] | None = None
                    ) -> tuple[jax.stages.Compiled, tuple[Any, ...]]:
    """Compiles a variant of a deferred family for the layout pass (`Note: layouts`).

    A result whose layout is not `fixed` takes the one its Explicit type has (traced
    first, unless `traced` gives the results of that trace: `decide`'s, for the first
    variant; no XLA choice to wait for), so each variant is compiled once.

    Returns:
      The executable (`compile_deferred`) and the result Avals with their layouts.

    Raises:
      Whatever JAX raises where Explicit mode refuses the variant: the caller then
      keeps the family's reduction per microbatch.
    """
    em = explicit_mesh(mesh)
    got = traced
    if got is None:
        with jax.set_mesh(em):
            got = jax.eval_shape(exe.fn, *_structs(ins, unreduced[0], em))
    outs = tuple(a if fixed[j] else dataclasses.replace(a, spec=_struct_spec(got[j]))
                 for j, a in enumerate(outs))
    return compile_deferred(exe, ins, outs, unreduced, mesh,
                            compiler_options=compiler_options), outs


def _struct_spec(x: jax.ShapeDtypeStruct) -> tuple[Any, ...]:
    """The spec entries (program form: `Aval.spec`) of a traced result's Explicit type,
    without mesh axes of size 1 (they split nothing; XLA's layouts leave them out too)."""
    if x.sharding is None:
        return ()
    sizes = dict(x.sharding.mesh.shape)
    return program_spec(tuple(a for a in axes_of(e) if sizes[a] > 1)
                        for e in x.sharding.spec.partitions)


def _jitted(exe: Any, in_avals: Sequence[Any], out_avals: Sequence[Any],
            unreduced: Unreduced, em: Mesh) -> tuple[Any, list]:
    in_s = _structs(in_avals, unreduced[0], em)
    out_sh = tuple(s.sharding for s in _structs(out_avals, unreduced[1], em))

    def fn(*args: Any) -> tuple:
        return tuple(conform(o, s) for o, s in zip(exe.fn(*args), out_sh))

    with jax.set_mesh(em):
        return jax.jit(fn, in_shardings=tuple(s.sharding for s in in_s),
                       out_shardings=out_sh, donate_argnums=exe.donate_argnums), in_s


def compile_deferred(exe: Any, in_avals: Sequence[Any], out_avals: Sequence[Any],
                     unreduced: Unreduced, mesh: Mesh, *,
                     compiler_options: dict[str, Any] | None = None) -> jax.stages.Compiled:
    """AOT-compiles one executable of a deferred state (`Note: deferred reduction`) on
    `mesh` with Explicit axes, each buffer laid out as its Aval and `unreduced` say
    (`compiler_options` as `compile_exe` takes them)."""
    em = explicit_mesh(mesh)
    jitted, in_s = _jitted(exe, in_avals, out_avals, unreduced, em)
    with jax.set_mesh(em):
        return jitted.lower(*in_s).compile(compiler_options or None)
