"""A step's arguments: their signature (the compile cache key), specs and layout checks."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.array import MpmdArray, MpmdSharding
from jaxpp_mpi._src.types import PyTree, Spec

__all__ = ["abstract", "check_layout", "describe_leaves", "paths", "per_leaf", "signature",
           "spec_entries"]


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, MpmdSharding, NamedSharding))


def per_leaf(prefix: PyTree, tree: jax.tree_util.PyTreeDef, what: str) -> list[Any]:
    """Broadcasts a pytree prefix of specs to one entry per leaf of `tree`.

    Raises:
      ValueError: `prefix` is not a pytree prefix of `tree` (`what` names it).
    """
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


def spec_entries(spec: Any, what: str) -> Spec | None:
    """The entries of a user's spec (a `PartitionSpec`, or a sharding's spec).

    Raises:
      TypeError: `spec` is neither None, a `PartitionSpec` nor a sharding.
    """
    if spec is None:
        return None
    if isinstance(spec, (MpmdSharding, NamedSharding)):
        spec = spec.spec
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{what}: expected a PartitionSpec or None, got {spec!r}")
    return tuple(spec)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and weak type of one argument leaf (a typed PRNG key array's
    dtype is its key dtype: `Note: keys as key data` in compiler/loop_tasks.py).

    Raises:
      TypeError: `x` is neither an array nor a number (a str, an arbitrary object, a
        numpy array of strings or objects). The message says what `x` is;
        `signature` prefixes the leaf's path.
    """
    if isinstance(x, (MpmdArray, jax.Array, jax.ShapeDtypeStruct)):
        weak = getattr(x, "weak_type", False)
        out = jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak)
    elif isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        arr = np.asarray(x)
        if arr.dtype != np.bool_ and not jnp.issubdtype(arr.dtype, np.number):
            raise TypeError(f"is a numpy value of dtype {arr.dtype}, not a number or an "
                            f"array of numbers{NON_ARRAY_HINT}")
        weak = isinstance(x, (bool, int, float, complex))
        out = jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype),
                                   weak_type=weak)
    else:
        what = (f"a str ({x!r:.40})" if isinstance(x, str)
                else f"an object of type {type(x).__qualname__}")
        raise TypeError(f"is {what}, not an array{NON_ARRAY_HINT}")
    if _is_extended(out.dtype) and not jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key):
        raise TypeError(f"has dtype {out.dtype}; jaxpp_mpi takes arrays of numpy dtypes "
                        "and typed PRNG key arrays only")
    return out


def _is_extended(dtype: Any) -> bool:
    return not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _dtype_name(dtype: Any) -> str:
    """'float32', or a key dtype's name ('key<fry>')."""
    return str(dtype) if _is_extended(dtype) else np.dtype(dtype).name


NON_ARRAY_HINT = (
    ": mpmd_jit_with_loop traces every argument leaf as an array, as jax.jit does; pass "
    "strings, flags and other Python values by closing over them (e.g. "
    "functools.partial(step, flag=...)), not as arguments"
)


def paths(tree: PyTree) -> list[str]:
    """`args[0]['w']`-style names of the leaves of `tree` (an argument tuple)."""
    return ["args" + jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_layout(spec: Spec | None, shape: tuple[int, ...], group_shape: dict[str, int],
                 where: str, mpmd_axis: str) -> None:
    """Checks that `spec` can lay out a value of `shape` on a group mesh of `group_shape`.

    Raises:
      ValueError: an unknown axis, more entries than dimensions, or a dimension its
        axes do not divide; `where` names the value.
    """
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


def signature(args: tuple) -> tuple:
    """The cache key of `args`: (pytree structure, per leaf (shape, dtype name, weak
    type, spec)).

    Raises:
      TypeError: a leaf is not an array (see `abstract`), named by its path.
    """
    leaves, tree = jax.tree.flatten(args)
    sig = []
    for j, x in enumerate(leaves):
        try:
            a = abstract(x)
        except TypeError as e:
            raise TypeError(f"argument {paths(args)[j]} {e}") from None
        # An MpmdArray's layout is part of the signature; a replicated one and a
        # plain array (placed replicated) compile alike, so a loop that feeds its
        # outputs back hits the cache.
        spec = list(x.spec) if isinstance(x, MpmdArray) else []
        while spec and spec[-1] is None:
            spec.pop()
        sig.append((a.shape, _dtype_name(a.dtype), a.weak_type, tuple(spec)))
    return tree, tuple(sig)


def describe_leaves(args: tuple, sig: tuple) -> list[str]:
    """One line per argument leaf: path, dtype, shape, weak type and spec (from the
    signature `sig` of `args`), as ranks compare them."""
    return [f"{a} {d}{list(s)}{' weak' if w else ''}"
            f"{' spec ' + str(PartitionSpec(*p)) if p else ''}"
            for a, (s, d, w, p) in zip(paths(args), sig)]
