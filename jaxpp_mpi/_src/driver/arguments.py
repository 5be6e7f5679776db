"""A step's arguments: static and donated ones, their signature (the compile cache key),
specs and layout checks.

Note: the step's arguments.
  A call `step(*args, **kwargs)` is split as `jax.jit` splits it (`split_call`): the
  static arguments (`static_argnums` / `static_argnames`, each inferred from the other
  through the function's signature) are taken out and keyed by value; the program
  takes the rest as the pytree `(dynamic args, dynamic kwargs)`, whose dict flattens
  sorted by name, so the flat arguments are deterministic. `in_shardings` covers the
  dynamic positional arguments (as in `jax.jit`); keyword arguments keep their own
  layout (an `MpmdArray`'s spec, else replicated). The compile cache key is (that
  pytree's structure, per leaf (shape, dtype, weak type, spec), the static values);
  ranks compare its digest, static values by their `repr` (`static_lines`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.sharding import MpmdSharding, without_axis
from jaxpp_mpi._src.base.types import PyTree, Spec

__all__ = ["ArgNums", "Call", "abstract", "check_layout", "describe_leaves", "paths",
           "per_leaf", "resolve_argnums", "signature", "spec_entries", "split_call",
           "static_lines"]


# -- static and donated arguments (Note: the step's arguments) ---------------------------


def _ints(value: int | Iterable[int] | None, what: str) -> tuple[int, ...]:
    """None, an int or ints, as a tuple of ints.

    Raises:
      TypeError: an entry is not an int (a bool is not).
    """
    if value is None:
        return ()
    try:
        items = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    except TypeError:
        items = (value,)
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{what} must be an int or a sequence of ints, got {value!r}")
    return tuple(int(i) for i in items)


def _names(value: str | Iterable[str] | None, what: str) -> tuple[str, ...]:
    """None, a str or strs, as a tuple of strs.

    Raises:
      TypeError: an entry is not a str.
    """
    if value is None:
        return ()
    try:
        items = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        items = (value,)
    for n in items:
        if not isinstance(n, str):
            raise TypeError(f"{what} must be a str or a sequence of strs, got {value!r}")
    return items


@dataclasses.dataclass(frozen=True)
class ArgNums:
    """Which arguments of a step are static and which donated (`resolve_argnums`).

    Attributes:
      static_argnums / static_argnames: static arguments by position / by name.
      donate_argnums / donate_argnames: donated arguments by position / by name.
      params: the positions the function's signature has a parameter at (an index
        there may be absent from a call: passed by keyword, or defaulted); None when
        it takes `*args` or has no signature.
    """

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    params: int | None = None


def resolve_argnums(fun: Callable, *, static_argnums: Any = None, static_argnames: Any = None,
                    donate_argnums: Any = None, donate_argnames: Any = None) -> ArgNums:
    """The static and donated arguments of `fun`, each position completed with its
    parameter's name and each name with its position, as `jax.jit` does.

    Raises:
      TypeError: an argnum is not an int, or an argname not a str.
      ValueError: a position or name `fun` has no parameter for, or an argument both
        static and donated.
    """
    nums = {"static_argnums": _ints(static_argnums, "static_argnums"),
            "donate_argnums": _ints(donate_argnums, "donate_argnums")}
    names = {"static_argnames": _names(static_argnames, "static_argnames"),
             "donate_argnames": _names(donate_argnames, "donate_argnames")}
    fun_name = getattr(fun, "__name__", "the step")
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): take the options as given
        params = None
    count = None
    if params is not None:
        kinds = [p.kind for p in params]
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
        by_name = {p.name: i for i, p in enumerate(positional)
                   if p.kind is p.POSITIONAL_OR_KEYWORD}
        keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                         p.KEYWORD_ONLY)}
        if inspect.Parameter.VAR_POSITIONAL not in kinds:
            count = len(positional)
        for what, given in nums.items():
            if count is not None and any(not -count <= i < count for i in given):
                raise ValueError(f"{what}={given}, but {fun_name} takes {count} positional "
                                 "arguments")
        for what, given in names.items():
            unknown = [n for n in given if n not in keywords]
            if unknown and inspect.Parameter.VAR_KEYWORD not in kinds:
                raise ValueError(f"{what} has {unknown}, which {fun_name} has no keyword "
                                 f"parameter for (it has {sorted(keywords)})")
        for kind in ("static", "donate"):
            num_key, name_key = f"{kind}_argnums", f"{kind}_argnames"
            idx = [i % count if count and i < 0 else i for i in nums[num_key]]
            from_names = [by_name[n] for n in names[name_key] if n in by_name]
            from_nums = [positional[i].name for i in idx
                         if 0 <= i < len(positional) and positional[i].name in by_name]
            nums[num_key] = tuple(sorted(set(idx) | set(from_names)))
            names[name_key] = tuple(sorted(set(names[name_key]) | set(from_nums)))
    both = sorted(set(nums["static_argnums"]) & set(nums["donate_argnums"]))
    both += sorted(set(names["static_argnames"]) & set(names["donate_argnames"]))
    if both:
        raise ValueError(f"argument(s) {both} of {fun_name} are both static and donated: a "
                         "static argument is not passed to the program, so it has no "
                         "buffer to donate; drop it from one of the two")
    return ArgNums(**nums, **names, params=count)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a step, split (Note: the step's arguments).

    Attributes:
      args: the dynamic positional arguments.
      kwargs: the dynamic keyword arguments, sorted by name.
      static: (position or name, value) of each static argument, positions first.
      donated: per dynamic argument (positional, then keyword), whether it is donated.
    """

    args: tuple
    kwargs: dict[str, Any]
    static: tuple[tuple[int | str, Any], ...]
    donated: tuple[bool, ...]

    @property
    def dynamic(self) -> tuple[tuple, dict[str, Any]]:
        """The pytree the program takes: `(args, kwargs)`."""
        return self.args, self.kwargs

    def bind(self, fun: Callable) -> Callable:
        """`fun` as a function of `(args, kwargs)` like `dynamic`, the static values put
        back where the call had them."""
        at = {i: v for i, v in self.static if isinstance(i, int)}
        by_name = {k: v for k, v in self.static if isinstance(k, str)}
        count = len(self.args) + len(at)

        @functools.wraps(fun)
        def bound(args: tuple, kwargs: dict[str, Any]) -> Any:
            rest = iter(args)
            full = [at[i] if i in at else next(rest) for i in range(count)]
            return fun(*full, **kwargs, **by_name)

        return bound


def split_call(argnums: ArgNums, args: tuple, kwargs: dict[str, Any], name: str) -> Call:
    """Splits `step(*args, **kwargs)` into static and dynamic arguments.

    Raises:
      TypeError: a static value is not hashable (it keys the compile cache).
      ValueError: an argnum past the call's positional arguments where `fun` has no
        parameter there.
    """
    n = len(args)
    static_at = {i % n if i < 0 and n else i for i in argnums.static_argnums}
    donate_at = {i % n if i < 0 and n else i for i in argnums.donate_argnums}
    for what, idx in (("static_argnums", static_at), ("donate_argnums", donate_at)):
        missing = sorted(i for i in idx if not 0 <= i < n
                         and (argnums.params is None or i >= argnums.params))
        if missing:
            raise ValueError(f"{what} has {missing}, but {name} got {n} positional "
                             "arguments")
    static: list[tuple[int | str, Any]] = [(i, args[i]) for i in sorted(static_at) if i < n]
    static += [(k, kwargs[k]) for k in sorted(kwargs) if k in argnums.static_argnames]
    for where, value in static:
        try:
            hash(value)
        except TypeError:
            shown = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
            raise TypeError(
                f"static argument {shown} of {name} is a {type(value).__name__}, which is "
                "not hashable; static values key the compile cache (as with jax.jit): pass "
                "a hashable value (a tuple, not a list; a frozen dataclass)") from None
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_at)
    dyn_kwargs = {k: kwargs[k] for k in sorted(kwargs) if k not in argnums.static_argnames}
    donated = [i in donate_at for i in range(n) if i not in static_at]
    donated += [k in argnums.donate_argnames for k in dyn_kwargs]
    return Call(dyn_args, dyn_kwargs, tuple(static), tuple(donated))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def static_lines(call: Call) -> list[str]:
    """One line per static argument, as ranks compare them: its `repr`, or its type
    where the repr shows a memory address (different on every rank)."""
    out = []
    for where, value in call.static:
        shown = f"args[{where}]" if isinstance(where, int) else f"kwargs[{where!r}]"
        text = repr(value)
        if _ADDRESS.search(text):
            text = f"<{type(value).__module__}.{type(value).__qualname__}>"
        out.append(f"static {shown} = {text}")
    return out


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


def spec_entries(spec: Any, what: str, mpmd_axis: str | None = None) -> Spec | None:
    """The entries of a user's spec (a `PartitionSpec`, or a sharding's spec), the MPMD
    axis `mpmd_axis` dropped (`Note: MPMD axis in specs` in sharding.py).

    Raises:
      TypeError: `spec` is neither None, a `PartitionSpec` nor a sharding.
    """
    if spec is None:
        return None
    if isinstance(spec, (MpmdSharding, NamedSharding)):
        spec = spec.spec
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{what}: expected a PartitionSpec or None, got {spec!r}")
    if mpmd_axis is not None:
        spec = without_axis(spec, mpmd_axis)
    return tuple(spec)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and weak type of one argument leaf (a typed PRNG key array's
    dtype is its key dtype: `Note: keys as key data` in compiler/keys.py).

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
    """`args[0]['w']` / `kwargs['batch']`-style names of the leaves of `tree`, a call's
    `(args, kwargs)` (`Call.dynamic`)."""
    out = []
    for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        head = "args" if p[0].idx == 0 else "kwargs"
        out.append(head + jax.tree_util.keystr(p[1:]))
    return out


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


def signature(call: Call) -> tuple:
    """The cache key of `call`: (structure of `call.dynamic`, per leaf (shape, dtype
    name, weak type, spec), the static arguments).

    A `jax.Array` leaf is the whole value whatever its layout, one laid out over the
    MPMD axis included (`Note: MPMD axis in specs` in sharding.py): the group that reads
    it gets its own replica, laid out as the step wants.

    Args:
      call: the split call.

    Raises:
      TypeError: a leaf is not an array (see `abstract`), named by its path.
    """
    tree_args = call.dynamic
    leaves, tree = jax.tree.flatten(tree_args)
    sig = []
    for j, x in enumerate(leaves):
        try:
            a = abstract(x)
        except TypeError as e:
            raise TypeError(f"argument {paths(tree_args)[j]} {e}") from None
        # An MpmdArray's layout is part of the signature; a replicated one and a
        # plain array (placed replicated) compile alike, so a loop that feeds its
        # outputs back hits the cache.
        spec = list(x.spec) if isinstance(x, MpmdArray) else []
        while spec and spec[-1] is None:
            spec.pop()
        sig.append((a.shape, _dtype_name(a.dtype), a.weak_type, tuple(spec)))
    return tree, tuple(sig), call.static


def describe_leaves(args: PyTree, sig: tuple) -> list[str]:
    """One line per argument leaf: path, dtype, shape, weak type and spec (from the
    signature `sig` of `args`, a call's `(args, kwargs)`), as ranks compare them."""
    return [f"{a} {d}{list(s)}{' weak' if w else ''}"
            f"{' spec ' + str(PartitionSpec(*p)) if p else ''}"
            for a, (s, d, w, p) in zip(paths(args), sig)]
