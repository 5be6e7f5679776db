"""The microbatch loop: `treduce`, `treduce_i`, their ops and `treduce_p`.

Note: treduce_p params
  `treduce` / `treduce_i` bind exactly one `treduce_p` eqn. Its operands
  (`eqn.invars`) are the *loop invariants*: every value the per-microbatch
  function closes over, in first-use order, deduplicated. Under `jax.jit` or
  `jax.make_jaxpr` these are the enclosing trace's vars (the params, the whole
  `xs` batch, ...); eagerly they are concrete arrays. For `treduce` the
  microbatch slicing of `xs` happens *inside* the body (a `dynamic_slice` /
  `squeeze` on the `xs` invariant indexed by the microbatch index), so the
  sliced microbatch flows into the first stage.

  Params (all hashable):
    * `body`: `ClosedJaxpr` of one microbatch, `consts == ()`.
      `body.jaxpr.invars == (microbatch_idx, *invariants)` where
      `microbatch_idx` is an int32 scalar and `invariants` line up one to one
      with `eqn.invars`; `body.jaxpr.outvars` are the flat leaves of the
      per-microbatch output Y (`jax.tree.leaves` order). Stage marks (see
      `stage_marks.py`, Note: stage marks) sit inside it, possibly nested in
      `pjit` / `remat` / `custom_vjp` eqns.
    * `num_microbatches`: int >= 1.
    * `schedule`: the user's schedule object, opaque here (hashable).
    * `ops`: tuple of `Op` instances, one per body outvar.
  `eqn.outvars[k]` is the reduction of body outvar k under `ops[k]`:
  `Add` / `Max` keep the aval, `Concat(axis)` inserts `num_microbatches` at
  `axis` (normalised to be non-negative, `0 <= axis <= ndim`).

  Semantics (the contract a pipelined runtime must reproduce bitwise):
  `state_k = ops[k].state(n, body(0)[k])`, then for `i = 1 .. n-1` in order
  `state_k = ops[k].update(state_k, body(i)[k], i)`. `Add` therefore sums in
  microbatch order 0, 1, 2, ...; without `mpmd_jit` (eagerly, or under plain
  `jax.jit`) this is exactly what runs. Differentiating *through* treduce_p,
  and vmapping it, are rejected: take gradients inside the body.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxpp_mpi._src.base import compat

__all__ = [
    "Add",
    "Concat",
    "Max",
    "Op",
    "find_treduce_eqns",
    "nested_treduce_errors",
    "treduce",
    "treduce_i",
    "treduce_p",
]

X = TypeVar("X")
Y = TypeVar("Y")


# --------------------------------------------------------------------------- ops


class Op:
    """How per-microbatch values of one output leaf are reduced.

    Subclasses are frozen dataclasses, so ops are hashable and compare by value.
    """

    def state(self, length: int, a: jax.Array) -> jax.Array:
        """The initial state from the value of microbatch 0."""
        raise NotImplementedError

    def update(self, state: jax.Array, v: jax.Array, i: Any) -> jax.Array:
        """The state after folding in the value `v` of microbatch `i`."""
        raise NotImplementedError

    def result_aval(self, length: int, aval: jax.core.ShapedArray) -> jax.core.ShapedArray:
        """The aval of the reduced result for a value of aval `aval`."""
        return aval

    def check(self, aval: jax.core.ShapedArray) -> None:
        """Raises ValueError if this op cannot reduce values of aval `aval`."""


@dataclasses.dataclass(frozen=True)
class Add(Op):
    """Element-wise sum over microbatches, in microbatch order."""

    def state(self, length: int, a: jax.Array) -> jax.Array:
        return a

    def update(self, state: jax.Array, v: jax.Array, i: Any) -> jax.Array:
        return jnp.add(state, v)


@dataclasses.dataclass(frozen=True)
class Max(Op):
    """Element-wise maximum over microbatches."""

    def state(self, length: int, a: jax.Array) -> jax.Array:
        return a

    def update(self, state: jax.Array, v: jax.Array, i: Any) -> jax.Array:
        return jnp.maximum(state, v)


@dataclasses.dataclass(frozen=True)
class Concat(Op):
    """Stacks per-microbatch values; the microbatch dimension is `axis` of the result."""

    axis: int = 0

    def _axis(self, ndim: int) -> int:
        return self.axis + ndim + 1 if self.axis < 0 else self.axis

    def check(self, aval: jax.core.ShapedArray) -> None:
        if not -(aval.ndim + 1) <= self.axis <= aval.ndim:
            raise ValueError(
                f"Concat(axis={self.axis}) is out of range for a per-microbatch value "
                f"of shape {aval.shape} (the result has {aval.ndim + 1} dimensions)"
            )

    def result_aval(self, length: int, aval: jax.core.ShapedArray) -> jax.core.ShapedArray:
        axis = self._axis(aval.ndim)
        shape = (*aval.shape[:axis], length, *aval.shape[axis:])
        return aval.update(shape=shape, weak_type=False)

    def state(self, length: int, a: jax.Array) -> jax.Array:
        a = jnp.asarray(a)
        axis = self._axis(a.ndim)
        zeros = jnp.zeros((*a.shape[:axis], length, *a.shape[axis:]), a.dtype)
        return lax.dynamic_update_index_in_dim(zeros, a, 0, axis)

    def update(self, state: jax.Array, v: jax.Array, i: Any) -> jax.Array:
        return lax.dynamic_update_index_in_dim(state, v, i, self._axis(jnp.ndim(v)))


def _as_op(leaf: Any) -> Op:
    if isinstance(leaf, Op):
        return leaf
    if isinstance(leaf, type) and issubclass(leaf, Op):
        return leaf()  # `Add` / `Max` may be given as the class
    raise TypeError(
        f"treduce operation leaves must be Op instances (Add, Max, Concat(axis)), got {leaf!r}"
    )


def _ops_per_leaf(operation: Any, out_tree: jax.tree_util.PyTreeDef) -> tuple[Op, ...]:
    """Broadcasts the `operation` prefix tree to one op per output leaf."""
    op_leaves, op_tree = jax.tree.flatten(operation)
    ops = [_as_op(leaf) for leaf in op_leaves]
    leaf_ids = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
    try:
        subtrees = op_tree.flatten_up_to(leaf_ids)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "treduce `operation` must be a pytree prefix of the output of `fun`: "
            f"operation has structure {op_tree}, the output has {out_tree}."
        ) from e
    per_leaf: list[Op | None] = [None] * out_tree.num_leaves
    for op, sub in zip(ops, subtrees):
        for k in jax.tree.leaves(sub):
            per_leaf[k] = op
    assert all(op is not None for op in per_leaf)
    return tuple(per_leaf)  # type: ignore[arg-type]


DEFAULT_OPERATION = (Concat(), Add)

# ------------------------------------------------------------------ public API


def treduce_i(
    fun: Callable[[jax.Array], Y],
    length: int,
    schedule: Hashable,
    operation: Any = DEFAULT_OPERATION,
) -> Y:
    """Reduces `fun(i)` over microbatches `i = 0 .. length-1` (JaxPP's `treduce_i`).

    Equivalent to::

      state = tree_map(lambda op, a: op.state(length, a), operation, fun(0))
      for i in range(1, length):
        state = tree_map(lambda op, s, v: op.update(s, v, i), operation, state, fun(i))

    with `operation` broadcast as a prefix of the output. Under `mpmd_jit_with_loop`
    the iterations are pipelined according to `schedule`.

    Args:
      fun: function of the microbatch index (an int32 scalar) returning a pytree.
      length: number of microbatches, a Python int >= 1.
      schedule: the pipeline schedule (any hashable object; not used here).
      operation: pytree prefix of the output of `fun` with `Op` leaves
        (`Add`, `Max`, `Concat(axis)`; `Add` and `Max` may be given as classes).

    Returns:
      The reduced pytree, with the structure of `fun`'s output.

    Raises:
      ValueError: `length < 1`, `operation` is not a prefix of the output, or an
        op does not fit its value.
      TypeError: `operation` has a leaf that is not an `Op`, or `schedule` is
        not hashable.
    """
    length = _check_length(length)
    try:
        hash(schedule)
    except TypeError as e:
        raise TypeError(f"treduce schedule must be hashable, got {schedule!r}") from e

    out_tree_box: list[jax.tree_util.PyTreeDef] = []

    def flat_body(microbatch_idx):
        out = fun(microbatch_idx)
        leaves, tree = jax.tree.flatten(out)
        out_tree_box.append(tree)
        return leaves

    idx_aval = jax.core.ShapedArray((), jnp.int32)
    body, invariants = compat.trace_closure_converted(flat_body, [idx_aval], name="treduce")
    (out_tree,) = out_tree_box
    ops = _ops_per_leaf(operation, out_tree)
    for op, aval in zip(ops, body.out_avals):
        op.check(aval)
    outs = treduce_p.bind(
        *invariants, body=body, num_microbatches=length, schedule=schedule, ops=ops
    )
    return jax.tree.unflatten(out_tree, outs)


def treduce(
    fun: Callable[[X], Y],
    xs: X,
    schedule: Hashable,
    axis: int = 0,
    operation: Any = DEFAULT_OPERATION,
) -> Y:
    """Reduces `fun` over the microbatches of `xs` (JaxPP's `treduce`).

    `treduce(fun, xs, ...)` is `treduce_i(lambda i: fun(xs[i]), n, ...)` where
    `xs[i]` takes index `i` along `axis` of every leaf of `xs` (removing that
    axis) and `n` is the size of that axis, which all leaves must share.

    Args:
      fun: function of one microbatch (a pytree like `xs` without `axis`).
      xs: pytree of arrays holding all microbatches along `axis`.
      schedule: the pipeline schedule (any hashable object; not used here).
      axis: the microbatch axis of every leaf of `xs`.
      operation: pytree prefix of the output of `fun` with `Op` leaves; see
        `treduce_i`.

    Returns:
      The reduced pytree, with the structure of `fun`'s output.

    Raises:
      ValueError: `xs` has no leaves, a leaf lacks `axis`, the leaves disagree
        on its size, or any error of `treduce_i`.
    """
    leaves = jax.tree.leaves(xs)
    if not leaves:
        raise ValueError("treduce needs at least one array in xs; use treduce_i otherwise")
    sizes = []
    for path, x in jax.tree_util.tree_leaves_with_path(xs):
        ndim = np.ndim(x)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"treduce axis={axis} is out of range for xs{jax.tree_util.keystr(path)} "
                f"of shape {np.shape(x)}"
            )
        sizes.append((jax.tree_util.keystr(path), np.shape(x)[axis]))
    if len({n for _, n in sizes}) > 1:
        listing = ", ".join(f"xs{p}: {n}" for p, n in sizes)
        raise ValueError(
            f"all leaves of xs must have the same size along axis {axis}; got {listing}"
        )

    def take(x, microbatch_idx):
        # Plain dynamic_slice + squeeze (lax.dynamic_index_in_dim would add a
        # nested jit eqn to the body).
        x = jnp.asarray(x)
        ax = axis % x.ndim
        starts = [np.int32(0)] * x.ndim
        starts[ax] = microbatch_idx
        sizes = (*x.shape[:ax], 1, *x.shape[ax + 1 :])
        return lax.squeeze(lax.dynamic_slice(x, starts, sizes), (ax,))

    def body(microbatch_idx):
        return fun(jax.tree.map(lambda x: take(x, microbatch_idx), xs))

    return treduce_i(body, sizes[0][1], schedule, operation)


def _check_length(length: Any) -> int:
    try:
        n = int(length)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"treduce length must be a static Python int, got {length!r}") from e
    if n != length or n < 1:
        raise ValueError(f"treduce needs at least one microbatch (length >= 1), got {length!r}")
    return n


# ------------------------------------------------------------------- treduce_p

treduce_p = jex_core.Primitive("treduce")
treduce_p.multiple_results = True


def _sequential_reduce(
    invariants: Sequence[Any],
    body: jex_core.ClosedJaxpr,
    num_microbatches: int,
    ops: tuple[Op, ...],
    *,
    python_loop: bool,
) -> list[Any]:
    """The reference semantics (Note: treduce_p params), as a Python or fori loop."""
    fun = jex_core.jaxpr_as_fun(body)
    first = fun(np.int32(0), *invariants)
    state = [op.state(num_microbatches, a) for op, a in zip(ops, first)]

    def step(i, state):
        values = fun(i, *invariants)
        return [op.update(s, v, i) for op, s, v in zip(ops, state, values)]

    if python_loop:
        for i in range(1, num_microbatches):
            state = step(np.int32(i), state)
    elif num_microbatches > 1:
        state = lax.fori_loop(np.int32(1), np.int32(num_microbatches), step, state)
    return state


def _treduce_impl(*invariants, body, num_microbatches, schedule, ops):
    del schedule
    # Eager: op by op, exactly the reference loop.
    return _sequential_reduce(invariants, body, num_microbatches, ops, python_loop=True)


treduce_p.def_impl(_treduce_impl)


def _treduce_abstract_eval(*avals, body, num_microbatches, schedule, ops):
    del schedule
    in_avals = [v.aval for v in body.jaxpr.invars[1:]]
    if len(avals) != len(in_avals) or len(ops) != len(body.out_avals):
        raise ValueError("treduce_p: operands or ops do not match the body")
    outs = [op.result_aval(num_microbatches, a) for op, a in zip(ops, body.out_avals)]
    return outs, body.effects


treduce_p.def_effectful_abstract_eval(_treduce_abstract_eval)


def _treduce_lowering(ctx: mlir.LoweringRuleContext, *invariants, body, num_microbatches,
                      schedule, ops):
    del schedule
    # Plain jax.jit: microbatch 0 then a sequential loop over 1 .. n-1.
    fn = partial(_loop_fn, body=body, num_microbatches=num_microbatches, ops=ops)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *invariants)


def _loop_fn(*invariants, body, num_microbatches, ops):
    return _sequential_reduce(invariants, body, num_microbatches, ops, python_loop=False)


mlir.register_lowering(treduce_p, _treduce_lowering)


_NO_OUTER_AD = (
    "Differentiating through treduce is not supported: take the gradient inside "
    "the loop body, e.g. treduce(partial(jax.value_and_grad(loss), params), batch, "
    "schedule, operation=(Concat(), Add)), as in JaxPP."
)


def _treduce_jvp(primals, tangents, **params):
    del primals, tangents, params
    raise NotImplementedError(_NO_OUTER_AD)


ad.primitive_jvps[treduce_p] = _treduce_jvp


def _treduce_transpose(cts, *args, **params):
    del cts, args, params
    raise NotImplementedError(_NO_OUTER_AD)


ad.primitive_transposes[treduce_p] = _treduce_transpose


def _treduce_batching(args, dims, **params):
    del args, dims, params
    raise NotImplementedError(
        "jax.vmap of treduce is not supported: vmap inside the loop body instead."
    )


batching.primitive_batchers[treduce_p] = _treduce_batching


# ------------------------------------------------------------ compiler helpers


def _as_jaxpr(jaxpr: jex_core.Jaxpr | jex_core.ClosedJaxpr) -> jex_core.Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def find_treduce_eqns(
    jaxpr: jex_core.Jaxpr | jex_core.ClosedJaxpr,
) -> list[tuple[int, jex_core.JaxprEqn]]:
    """The `treduce_p` eqns at the top level of `jaxpr`, with their positions.

    Args:
      jaxpr: the traced step (e.g. from `jax.make_jaxpr`).

    Returns:
      `(index into jaxpr.eqns, eqn)` for each top-level `treduce_p` eqn.
      Eqns nested in other eqns' sub-jaxprs are not returned; see
      `nested_treduce_errors`.
    """
    return [(k, e) for k, e in enumerate(_as_jaxpr(jaxpr).eqns) if e.primitive is treduce_p]


def nested_treduce_errors(jaxpr: jex_core.Jaxpr | jex_core.ClosedJaxpr) -> list[str]:
    """Describes every `treduce_p` eqn that is *not* at the top level of `jaxpr`.

    The compiler splits only a top-level loop; a treduce inside a `jax.jit`,
    `lax.cond`, `lax.scan`, ... called from the step is reported here (one line
    each, with its path) so the compiler can raise one clear error.

    Args:
      jaxpr: the traced step.

    Returns:
      One message per nested `treduce_p` eqn; empty when there is none.
    """
    errors: list[str] = []

    def walk(j: jex_core.Jaxpr, path: str) -> None:
        for k, eqn in enumerate(j.eqns):
            here = f"{path}eqns[{k}]"
            if eqn.primitive is treduce_p and path:
                errors.append(
                    f"treduce at {here} is nested inside another primitive "
                    f"({path.rstrip('/ ')}); call treduce at the top level of the "
                    "function given to mpmd_jit (not inside jax.jit / lax control flow)"
                )
            if eqn.primitive is treduce_p:
                continue  # the body's own structure is the compiler's business
            for sub in jex_core.jaxprs_in_params(eqn.params):
                walk(_as_jaxpr(sub), f"{here}({eqn.primitive.name})/")

    walk(_as_jaxpr(jaxpr), "")
    return errors
