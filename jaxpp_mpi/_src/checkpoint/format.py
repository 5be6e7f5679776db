"""Checkpoint and plan files as data: JSON manifests, key paths, dtypes, specs.

Note: Checkpoint format.
  A checkpoint is a directory holding
    manifest.json        written last: a directory without it is no checkpoint
    arrays/NNNNNN.npy    one file per leaf: the whole logical array, written once
  manifest.json is {"format": "jaxpp_mpi.checkpoint", "version": 1, "step": int | null,
  "mpmd_dim": int | null, "leaves": [{"path": [[kind, key], ...], "shape": [...],
  "dtype": "bfloat16", "file": "arrays/000000.npy", "placement": null | {"mesh_ids":
  [...], "spec": [...]}}, ...]}. A leaf's path is its pytree key path, one [kind, key]
  pair per level: ["key", dict key (str or int)], ["idx", sequence index], ["attr",
  attribute name] or ["flat", flattened index]. `placement` says which MPMD groups held
  the leaf and its PartitionSpec inside each group (entries null, "axis" or ["a", "b"]);
  a whole-model checkpoint has no placement on any leaf. Dtypes that .npy cannot describe
  portably (bfloat16, float8) are stored bit for bit as the unsigned integer of the same
  width, always little-endian; the manifest keeps the logical dtype.

Note: Untrusted files.
  Manifests and plans are parsed as JSON and checked field by field; .npy files are read
  without pickle, and their header (dtype, shape, order) and byte size are checked
  against the manifest before any array is allocated. A file named in a manifest must
  resolve (symlinks followed) to a regular file inside the checkpoint directory (both
  in checkpoint/leaf_files.py). Every size that could drive an allocation is bounded
  before anything is allocated: the JSON text (`MAX_JSON_BYTES`, which bounds the
  number of leaves), a path's depth and a shape's rank (`MAX_NDIM`), a shape's byte
  size (`MAX_ARRAY_BYTES`, numpy's own limit, and then the .npy file's size); key-path
  indexes allocate nothing here (`load_whole` bounds the lists it rebuilds from them).
  Two leaves with the same path, or one leaf's path inside another's (a leaf cannot
  also hold leaves), are refused. Every rejection names the file and the leaf or field
  at fault.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from jaxpp_mpi._src.base.files import read_at_most

__all__ = ["CheckpointError", "KeyPath", "LeafEntry", "Manifest", "Placement"]

MANIFEST = "manifest.json"
FORMAT = "jaxpp_mpi.checkpoint"
VERSION = 1
MAX_JSON_BYTES = 64 << 20  # a manifest of a million leaves is ~200 MB; ours are far smaller
MAX_NDIM = 64
MAX_ARRAY_BYTES = int(np.iinfo(np.intp).max)  # numpy refuses larger arrays, even empty ones

PathEntry = tuple[str, Any]  # ("key", str | int) | ("idx", int) | ("attr", str) | ("flat", int)
KeyPath = tuple[PathEntry, ...]
SpecEntry = Any  # None | str | tuple[str, ...]

_NUMPY_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "complex64", "complex128"]
)
_BITS_DTYPES = frozenset(["bfloat16", "float8_e4m3fn", "float8_e5m2"])  # via ml_dtypes


class CheckpointError(ValueError):
    """A checkpoint, manifest or plan that is malformed or does not match what is asked."""


# -- key paths ----------------------------------------------------------------------


def encode_key_path(path: Sequence[Any]) -> KeyPath:
    """A JAX key path (from `tree_flatten_with_path`) as plain (kind, key) pairs.

    Raises:
      CheckpointError: a key kind or dict key type that JSON cannot carry.
    """
    tu = jax.tree_util
    out: list[PathEntry] = []
    for k in path:
        if isinstance(k, tu.DictKey):
            key = k.key
            if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
                key = int(key)
            elif not isinstance(key, str):
                raise CheckpointError(f"dict key {key!r} is neither a str nor an int")
            out.append(("key", key))
        elif isinstance(k, tu.SequenceKey):
            out.append(("idx", int(k.idx)))
        elif isinstance(k, tu.GetAttrKey):
            out.append(("attr", k.name))
        elif isinstance(k, tu.FlattenedIndexKey):
            out.append(("flat", int(k.key)))
        else:
            raise CheckpointError(f"unsupported pytree key {k!r}")
    return tuple(out)


def format_key_path(path: KeyPath) -> str:
    """A key path as Python would index it, e.g. `['params'][0].mu`; `<root>` if empty."""
    parts = []
    for kind, key in path:
        parts.append(f".{key}" if kind == "attr" else f"[{key!r}]")
    return "".join(parts) or "<root>"


def flatten_with_paths(tree: Any) -> tuple[list[KeyPath], list[Any], Any]:
    """Leaves of `tree` with their encoded key paths, and the treedef."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [encode_key_path(p) for p, _ in with_path], [x for _, x in with_path], treedef


def _decode_key_path(raw: Any, where: str) -> KeyPath:
    if not isinstance(raw, list) or len(raw) > MAX_NDIM:
        raise CheckpointError(
            f"{where}: path must be a list of at most {MAX_NDIM} [kind, key] pairs, got "
            f"{_clip(raw)}")
    out: list[PathEntry] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            raise CheckpointError(f"{where}: path entry {_clip(item)} is not a [kind, key] pair")
        kind, key = item
        ok = {
            "key": isinstance(key, str) or _is_int(key),
            "idx": _is_int(key) and key >= 0,
            "flat": _is_int(key) and key >= 0,
            "attr": isinstance(key, str),
        }.get(kind, False) if isinstance(kind, str) else False
        if not ok:
            raise CheckpointError(
                f"{where}: bad path entry {_clip(item)} (kinds: [\"key\", str or int], "
                "[\"idx\", int >= 0], [\"flat\", int >= 0], [\"attr\", str])")
        out.append((kind, key))
    return tuple(out)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _clip(raw: Any, limit: int = 80) -> str:
    """`repr(raw)` cut to `limit` characters, for messages about untrusted values."""
    text = repr(raw)
    return text if len(text) <= limit else f"{text[:limit]}..."


# -- dtypes -------------------------------------------------------------------------


def logical_dtype(name: Any) -> np.dtype:
    """The numpy dtype of a dtype name a checkpoint may hold.

    Raises:
      CheckpointError: a dtype outside the supported set (no object or structured dtypes).
    """
    if isinstance(name, str) and name in _NUMPY_DTYPES:
        return np.dtype(name)
    if isinstance(name, str) and name in _BITS_DTYPES:
        return np.dtype(getattr(ml_dtypes, name))
    raise CheckpointError(
        f"unsupported dtype {_clip(name)} (supported: "
        f"{', '.join(sorted(_NUMPY_DTYPES | _BITS_DTYPES))})"
    )


def decode_dtype(raw: Any, where: str) -> np.dtype:
    """A manifest's or plan's `dtype` field, checked (`logical_dtype` naming `where`).

    Raises:
      CheckpointError: naming `where` and the field.
    """
    try:
        return logical_dtype(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: dtype: {e}") from None


def dtype_name(dtype: Any) -> str:
    """The checkpoint name of `dtype`, checked to be supported."""
    name = np.dtype(dtype).name
    logical_dtype(name)
    return name


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian dtype a leaf of `dtype` is stored as (see Note: Checkpoint
    format)."""
    if dtype.name in _BITS_DTYPES:
        return np.dtype(f"<u{dtype.itemsize}")
    return dtype.newbyteorder("<")


def to_storage(value: np.ndarray) -> np.ndarray:
    """`value` as its stored bits: C-contiguous, little-endian, integer for bf16/fp8."""
    value = np.asarray(value, order="C")  # (np.ascontiguousarray makes 0-d arrays 1-d)
    store = storage_dtype(value.dtype)
    if value.dtype.name in _BITS_DTYPES:
        return value.view(store)
    return value.astype(store, copy=False)


def from_storage(stored: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Inverse of `to_storage`: the array in its logical dtype, native byte order."""
    if dtype.name in _BITS_DTYPES:
        return stored.view(dtype)
    return stored.astype(dtype.newbyteorder("="), copy=False)


# -- specs and placement ------------------------------------------------------------


def encode_spec(spec: Any) -> tuple[SpecEntry, ...]:
    """A PartitionSpec as a tuple of None / axis name / tuple of axis names."""
    out = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            out.append(tuple(entry))
        else:
            raise CheckpointError(f"cannot store PartitionSpec entry {entry!r}")
    return tuple(out)


def spec_json(spec: Sequence[SpecEntry]) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _decode_spec(raw: Any, where: str) -> tuple[SpecEntry, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_NDIM:
        raise CheckpointError(f"{where}: spec must be a list of at most {MAX_NDIM} entries")
    out: list[SpecEntry] = []
    for e in raw:
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, list) and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:
            raise CheckpointError(f"{where}: bad spec entry {_clip(e)}")
    return tuple(out)


def decode_mesh_ids(raw: Any, where: str, mpmd_dim: int | None) -> tuple[int, ...]:
    """Checked `mesh_ids`: a non-empty sorted list of distinct groups below `mpmd_dim`."""
    if not (isinstance(raw, list) and raw and all(_is_int(i) and i >= 0 for i in raw)):
        raise CheckpointError(f"{where}: mesh_ids must be a non-empty list of group indexes")
    ids = tuple(sorted(set(raw)))
    if mpmd_dim is not None and ids[-1] >= mpmd_dim:
        raise CheckpointError(f"{where}: mesh_ids {list(ids)} exceed mpmd_dim {mpmd_dim}")
    return ids


@dataclasses.dataclass(frozen=True)
class Placement:
    """The MPMD groups that held a leaf and its PartitionSpec inside each group."""

    mesh_ids: tuple[int, ...]
    spec: tuple[SpecEntry, ...]

    def to_json(self) -> dict:
        return {"mesh_ids": list(self.mesh_ids), "spec": spec_json(self.spec)}


@dataclasses.dataclass(frozen=True)
class LeafEntry:
    """One leaf of a checkpoint (see Note: Checkpoint format)."""

    path: KeyPath
    shape: tuple[int, ...]
    dtype: str
    file: str
    placement: Placement | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return logical_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize

    def to_json(self) -> dict:
        return {"path": [list(p) for p in self.path], "shape": list(self.shape),
                "dtype": self.dtype, "file": self.file,
                "placement": None if self.placement is None else self.placement.to_json()}


def leaf_file(index: int) -> str:
    """The relative file name of leaf `index`."""
    return f"arrays/{index:06d}.npy"


def decode_shape(raw: Any, where: str, itemsize: int = 1) -> tuple[int, ...]:
    """A manifest's or plan's `shape` field, checked to describe an array numpy can hold.

    Args:
      raw: the JSON value.
      where: the file and entry, for messages.
      itemsize: bytes per element of the leaf's dtype.

    Returns:
      The shape.

    Raises:
      CheckpointError: not a list of at most `MAX_NDIM` non-negative ints, or a byte
        size (zero dimensions left out, as numpy counts) above `MAX_ARRAY_BYTES`.
    """
    if not (isinstance(raw, list) and len(raw) <= MAX_NDIM and all(_is_int(d) for d in raw)):
        raise CheckpointError(
            f"{where}: shape must be a list of at most {MAX_NDIM} ints, got {_clip(raw)}")
    negative = [d for d in raw if d < 0]
    if negative:
        raise CheckpointError(
            f"{where}: shape {raw} has a negative dimension; shape must be a list of "
            "non-negative ints")
    nbytes = math.prod(d for d in raw if d) * itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise CheckpointError(
            f"{where}: shape {raw} is too large: its non-zero dimensions times the "
            f"{itemsize}-byte elements make {nbytes} bytes, above the {MAX_ARRAY_BYTES} "
            "numpy allows any array (even an empty one)")
    return tuple(raw)


def check_relative_file(name: Any, where: str) -> str:
    """A manifest's file name, checked to be a plain relative path without `..`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}: file must be a non-empty string")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(f"{where}: file {name!r} must stay inside the checkpoint dir")
    return name


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest (see Note: Checkpoint format)."""

    leaves: tuple[LeafEntry, ...]
    step: int | None = None
    mpmd_dim: int | None = None

    @property
    def is_whole(self) -> bool:
        """True when no leaf carries a placement (a whole-model checkpoint)."""
        return all(leaf.placement is None for leaf in self.leaves)

    def to_json(self) -> str:
        head = json.dumps({"format": FORMAT, "version": VERSION, "step": self.step,
                           "mpmd_dim": self.mpmd_dim})
        return dump_with_list(head, "leaves", [leaf.to_json() for leaf in self.leaves])

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """Parses and checks a manifest (see Note: Untrusted files).

        Raises:
          CheckpointError: malformed JSON or any field out of shape.
        """
        raw = _load_json(text, where)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise CheckpointError(
                f"{where}: not a {FORMAT} version {VERSION} manifest (format="
                f"{_clip(raw.get('format'))}, version={_clip(raw.get('version'))})"
            )
        step, dim, leaves = raw.get("step"), raw.get("mpmd_dim"), raw.get("leaves")
        if step is not None and not _is_int(step):
            raise CheckpointError(f"{where}: step must be an int or null")
        if dim is not None and not (_is_int(dim) and dim >= 1):
            raise CheckpointError(f"{where}: mpmd_dim must be a positive int or null")
        if not isinstance(leaves, list):
            raise CheckpointError(f"{where}: leaves must be a list")
        out: list[LeafEntry] = []
        files: dict[str, int] = {}
        paths: dict[KeyPath, int] = {}
        for i, item in enumerate(leaves):
            at = f"{where}: leaf {i}"
            if not isinstance(item, dict):
                raise CheckpointError(f"{at} is not an object")
            path = _decode_key_path(item.get("path"), at)
            dtype = item.get("dtype")
            shape = decode_shape(item.get("shape"), at, decode_dtype(dtype, at).itemsize)
            file = check_relative_file(item.get("file"), at)
            if path in paths:
                raise CheckpointError(f"{at}: path {format_key_path(path)} repeats leaf "
                                      f"{paths[path]}'s; every leaf needs its own path")
            if file in files:
                raise CheckpointError(f"{at}: file {file!r} repeats leaf {files[file]}'s; "
                                      "every leaf needs its own file")
            files[file] = i
            paths[path] = i
            placement = item.get("placement")
            if placement is not None:
                if not isinstance(placement, dict):
                    raise CheckpointError(f"{at}: placement must be an object or null")
                placement = Placement(decode_mesh_ids(placement.get("mesh_ids"), at, dim),
                                      _decode_spec(placement.get("spec"), at))
            out.append(LeafEntry(path, shape, dtype, file, placement))
        _check_no_nested_paths(paths, where)
        return cls(tuple(out), step, dim)


def _check_no_nested_paths(paths: dict[KeyPath, int], where: str) -> None:
    """Refuses a leaf whose path lies inside another leaf's: a pytree leaf holds no
    leaves, so no saved tree has both `['a']` and `['a']['b']` (nor a root leaf and others).

    Args:
      paths: each leaf's path and its index in the manifest.
      where: the manifest, for messages.

    Raises:
      CheckpointError: naming both leaves.
    """
    for path, i in paths.items():
        for depth in range(len(path)):
            outer = paths.get(path[:depth])
            if outer is not None:
                raise CheckpointError(
                    f"{where}: leaf {i}: path {format_key_path(path)} lies inside leaf "
                    f"{outer}'s path {format_key_path(path[:depth])}; a leaf cannot also "
                    "hold other leaves")


def dump_with_list(head: str, key: str, items: list) -> str:
    """JSON of the object `head` (already dumped) plus `key`: `items`, one item a line."""
    body = ",\n  ".join(json.dumps(item) for item in items)
    return f"{head[:-1]}, {json.dumps(key)}: [\n  {body}\n]}}\n"


def _load_json(text: str | bytes, where: str) -> dict:
    if len(text) > MAX_JSON_BYTES:
        raise CheckpointError(f"{where}: larger than {MAX_JSON_BYTES} bytes")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: the top level must be a JSON object")
    return raw


def read_json_file(file: str, what: str) -> str:
    """The text of a small JSON file, size-checked before reading.

    Raises:
      CheckpointError: naming `what` and `file`: missing, unreadable, larger than
        `MAX_JSON_BYTES`, or not UTF-8 text.
    """
    try:
        size = os.stat(file).st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{what} {file} is larger than {MAX_JSON_BYTES} bytes")
        with open(file, "rb") as f:
            data = read_at_most(f, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"no {what} at {file}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {file}: {e.strerror or e}") from None
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{what} {file} is larger than {MAX_JSON_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{what} {file} is not UTF-8 text (byte 0x{data[e.start]:02x} "
                              f"at offset {e.start})") from None
