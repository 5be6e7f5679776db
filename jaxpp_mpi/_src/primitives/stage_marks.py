"""Stage-boundary marks: `mark_stage_end` and the `stage_end_p` primitive.

Note: stage marks
  `mark_stage_end(x, name=None)` binds `stage_end_p` once over the flat leaves
  of `x`. The primitive is the identity: abstract eval returns the input
  avals, the lowering returns its operands (no copy), the batching rule keeps
  the batch dims. It is bound everywhere, inside a `treduce` body or not;
  outside the compiler it costs nothing.

  Params (all hashable):
    * `name`: the user's label, or None.
    * `direction`: 'fwd' for a mark bound by the user (and for its JVP, the
      tangent mark), 'bwd' for a mark produced by transposition.
    * `leaves`: tuple of int, the positions, among the leaves of the
      originating `mark_stage_end` call, of the values this eqn carries
      (`len(leaves) == len(eqn.invars)`). A user mark carries all leaves
      `(0, ..., n-1)`; its tangent / transposed marks carry only the leaves
      that have a (non-symbolic-zero) tangent, so integer leaves and leaves
      the differentiated inputs do not reach are absent from them.

  AD: the mark is linear. Its JVP binds the mark on the non-zero tangents
  (same params); its transpose binds the mark on the cotangents with
  `direction` flipped ('fwd' <-> 'bwd'), instantiating symbolic-zero
  cotangents, so every transposed mark carries every leaf of its tangent mark.
  After `jax.value_and_grad` (or `jax.vjp`) of a function with marks
  m_0, ..., m_{S-1} (in trace order) the jaxpr holds, in order,
  fwd m_0 ... fwd m_{S-1} then bwd m_{S-1} ... bwd m_0.

  Matching a bwd mark to its stage: marks do not know their stage index when
  bound (a mark inside a `jax.jit`- or `jax.checkpoint`-wrapped function is
  traced once and reused, so a trace-time counter would be wrong). The
  compiler numbers them by order in the (inlined) loop body: the k-th 'fwd'
  mark ends stage k, the k-th 'bwd' mark from the *end* of the body belongs to
  stage k. A mark whose leaves all have symbolic-zero tangents (the boundary
  does not depend on anything differentiated) produces no bwd mark; since
  gradients stop flowing at such a boundary this only happens for a prefix of
  the stages, which therefore are the last bwd marks: counting bwd marks from
  the end keeps the matching right. The compiler must still check the counts.

  DCE never removes a mark (its rule keeps the eqn and all operands), and
  `jax.checkpoint` never recomputes a mark: a known mark stays in the forward
  (saved) part, so no fwd mark is duplicated into the backward pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from jaxpp_mpi._src.base import compat

__all__ = ["mark_stage_end", "pipeline_enter_stage", "stage_end_p", "is_stage_end"]

T = TypeVar("T")
Direction = Literal["fwd", "bwd"]

_FLIP: dict[str, Direction] = {"fwd": "bwd", "bwd": "fwd"}


def mark_stage_end(x: T, name: str | None = None) -> T:
    """Marks the end of a pipeline stage; the identity on a pytree.

    Call it on the values that flow from one stage to the next (the last stage
    is marked too, usually on the loss). See the `stage marks` Note in this
    module for what the compiler sees.

    Args:
      x: any pytree of arrays (float or not).
      name: optional label kept in the mark's params.

    Returns:
      `x`, unchanged.
    """
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    out = stage_end_p.bind(
        *leaves, name=name, direction="fwd", leaves=tuple(range(len(leaves)))
    )
    return jax.tree.unflatten(treedef, out)


_warned_enter_stage = False


def pipeline_enter_stage(x: T, name: str | None = None) -> T:
    """Deprecated alias of `mark_stage_end` (warns once per process).

    Args:
      x: any pytree of arrays.
      name: optional label kept in the mark's params.

    Returns:
      `x`, unchanged.
    """
    global _warned_enter_stage
    if not _warned_enter_stage:
        _warned_enter_stage = True
        warnings.warn(
            "pipeline_enter_stage is deprecated; use mark_stage_end",
            DeprecationWarning,
            stacklevel=2,
        )
    return mark_stage_end(x, name=name)


def is_stage_end(eqn: jex_core.JaxprEqn, direction: Direction | None = None) -> bool:
    """Whether `eqn` is a stage mark (of the given direction, if any)."""
    return eqn.primitive is stage_end_p and (
        direction is None or eqn.params["direction"] == direction
    )


stage_end_p = jex_core.Primitive("stage_end")
stage_end_p.multiple_results = True


def _stage_end_impl(*args: Any, name, direction, leaves) -> Sequence[Any]:
    del name, direction, leaves
    return args


stage_end_p.def_impl(_stage_end_impl)


def _stage_end_abstract_eval(*avals, name, direction, leaves):
    del name, leaves
    if direction not in _FLIP:
        raise ValueError(f"stage_end direction must be 'fwd' or 'bwd', got {direction!r}")
    return avals


stage_end_p.def_abstract_eval(_stage_end_abstract_eval)


def _stage_end_lowering(ctx: mlir.LoweringRuleContext, *args, name, direction, leaves):
    del ctx, name, direction, leaves
    return args


mlir.register_lowering(stage_end_p, _stage_end_lowering)


def _stage_end_jvp(primals, tangents, *, name, direction, leaves):
    primals_out = stage_end_p.bind(*primals, name=name, direction=direction, leaves=leaves)
    live = [i for i, t in enumerate(tangents) if type(t) is not ad.Zero]
    tangents_out = list(tangents)  # symbolic zeros pass through unmarked
    if live:
        marked = stage_end_p.bind(
            *(tangents[i] for i in live),
            name=name,
            direction=direction,
            leaves=tuple(leaves[i] for i in live),
        )
        for i, t in zip(live, marked):
            tangents_out[i] = t
    return primals_out, tangents_out


ad.primitive_jvps[stage_end_p] = _stage_end_jvp


def _stage_end_transpose(cts, *args, name, direction, leaves):
    linear = [i for i, x in enumerate(args) if ad.is_undefined_primal(x)]
    cts_out: list[Any] = [None] * len(args)
    if not linear:
        return cts_out
    marked = stage_end_p.bind(
        *(ad.instantiate_zeros(cts[i]) for i in linear),
        name=name,
        direction=_FLIP[direction],
        leaves=tuple(leaves[i] for i in linear),
    )
    for i, ct in zip(linear, marked):
        cts_out[i] = ct
    return cts_out


ad.primitive_transposes[stage_end_p] = _stage_end_transpose


def _stage_end_batching(args, dims, *, name, direction, leaves):
    out = stage_end_p.bind(*args, name=name, direction=direction, leaves=leaves)
    return out, dims


batching.primitive_batchers[stage_end_p] = _stage_end_batching


def _stage_end_dce(used_outputs: list[bool], eqn: jex_core.JaxprEqn):
    del used_outputs
    return [True] * len(eqn.invars), eqn  # structural: never removed


compat.register_dce_rule(stage_end_p, _stage_end_dce)


def _stage_end_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    del saveable
    n = len(eqn.outvars)
    if any(unks_in):
        residuals = [
            v for v, inst in zip(eqn.invars, inst_in)
            if isinstance(v, jex_core.Var) and not inst
        ]
        return None, eqn, [True] * n, [True] * n, residuals
    # Known: keep it in the known (forward) jaxpr and save its outputs instead
    # of recomputing, so remat never duplicates a fwd mark into the backward.
    return eqn, None, [False] * n, [False] * n, []


pe.partial_eval_jaxpr_custom_rules[stage_end_p] = _stage_end_partial_eval_custom
