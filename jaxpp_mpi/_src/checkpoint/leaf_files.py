"""A leaf's file: its path kept inside the checkpoint, its .npy written and read checked.

The files are those of `Note: Checkpoint format`, read as `Note: Untrusted files` says
(both in checkpoint/format.py): a file must resolve inside the checkpoint directory, and a
.npy's header and size must match its manifest entry before any array is allocated.
"""

from __future__ import annotations

import math
import os

import numpy as np

from jaxpp_mpi._src.checkpoint.format import (
    CheckpointError,
    check_relative_file,
    from_storage,
    storage_dtype,
)

__all__ = ["read_npy", "resolve_inside", "write_npy"]


def resolve_inside(directory: str, name: str) -> str:
    """`directory/name` with symlinks resolved, checked to be a file inside `directory`.

    Raises:
      CheckpointError: the path escapes the directory or is not a regular file.
    """
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, check_relative_file(name, "manifest")))
    if os.path.commonpath([root, full]) != root or full == root:
        raise CheckpointError(f"file {name!r} resolves outside the checkpoint {directory}")
    if not os.path.isfile(full):
        raise CheckpointError(f"checkpoint file {name!r} is missing from {directory}")
    return full


def write_npy(file: str, value: np.ndarray) -> int:
    """Writes `value` (already in storage form) as a .npy file, synced; returns bytes."""
    with open(file, "wb") as f:
        np.lib.format.write_array(f, value, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return int(value.nbytes)


def read_npy(file: str, shape: tuple[int, ...], dtype: np.dtype,
             leaf: str | None = None) -> np.ndarray:
    """Reads a stored leaf of logical `dtype` and `shape` (see Note: Untrusted files).

    Args:
      file: the .npy file.
      shape: the leaf's shape in the manifest (checked by `decode_shape`).
      dtype: the leaf's logical dtype in the manifest.
      leaf: the leaf's key path as text, named in messages.

    Raises:
      CheckpointError: naming the file (and leaf): not a .npy file, or its header or
        size disagree with the manifest's `shape` / `dtype`.
    """
    store = storage_dtype(dtype)
    fmt = np.lib.format
    name = file if leaf is None else f"{file} (leaf {leaf})"
    with open(file, "rb") as f:
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                header = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                header = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except (ValueError, SyntaxError) as e:
            raise CheckpointError(f"{name}: not a valid .npy file ({e})") from None
        file_shape, fortran, file_dtype = header
        if file_dtype != store or tuple(file_shape) != shape or fortran:
            raise CheckpointError(
                f"{name}: holds {file_dtype.str}{list(file_shape)}"
                f"{' (Fortran order)' if fortran else ''}, the manifest's dtype and shape say "
                f"{dtype.name}{list(shape)} stored as {store.str}"
            )
        count = math.prod(shape)
        size = os.fstat(f.fileno()).st_size
        if size != f.tell() + count * store.itemsize:
            raise CheckpointError(
                f"{name}: {size} bytes, expected {f.tell() + count * store.itemsize} for "
                f"{dtype.name}{list(shape)}"
            )
        stored = np.fromfile(f, dtype=store, count=count)
    if stored.size != count:
        raise CheckpointError(f"{name}: truncated while reading")
    return from_storage(stored.reshape(shape), dtype)
