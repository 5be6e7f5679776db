"""A leaf's file: its path kept inside the checkpoint, its .npy written and read checked.

The files are those of `Note: Checkpoint format`, read as `Note: Untrusted files` says
(both in checkpoint/format.py): a file must resolve inside the checkpoint directory, and a
.npy's header and size must match its manifest entry before any array is allocated.

Note: Direct writes.
  A background save (checkpoint/background.py) writes each leaf from one page-aligned
  host buffer that holds the whole file: numpy's own .npy header (the bytes
  `np.save` writes, so the files are those of a synchronous save), then the data.
  The buffer goes to the disk with `O_DIRECT` in large chunks (`CHUNK_BYTES`), past the
  page cache: no copy into the cache, no cache to flush, one stream at the disk's
  sequential speed; the last chunk is padded to the page and the file cut back to its
  size. One `fsync` per file then makes the data and its size durable before the
  rank marks its files written. Where the file system refuses `O_DIRECT` (tmpfs,
  some network file systems) the same bytes go through the page cache, then `fsync`
  and `posix_fadvise(DONTNEED)`, so a save does not fill the cache.
"""

from __future__ import annotations

import errno
import io
import math
import mmap
import os
from collections.abc import Callable

import numpy as np

from jaxpp_mpi._src.checkpoint.format import (
    CheckpointError,
    check_relative_file,
    from_storage,
    storage_dtype,
)

__all__ = ["CHUNK_BYTES", "PAGE", "npy_header", "read_npy", "resolve_inside",
           "write_buffer", "write_npy"]

PAGE = mmap.PAGESIZE
CHUNK_BYTES = 16 << 20
"""One direct write: large enough for the disk's sequential speed (16 MiB reached dd's
best on the benchmark's disk; 1 MiB lost ~15%)."""


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


def npy_header(shape: tuple[int, ...], store: np.dtype) -> bytes:
    """The header `np.save` writes before a C-ordered array of `shape` and `store` dtype."""
    header = {"descr": np.lib.format.dtype_to_descr(store), "fortran_order": False,
              "shape": tuple(shape)}
    out = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(out, header)
    except ValueError:  # a header past 64 KiB: numpy's version 2.0, as np.save picks
        out = io.BytesIO()
        np.lib.format.write_array_header_2_0(out, header)
    return out.getvalue()


def write_buffer(file: str, buffer: mmap.mmap, size: int,
                 after_first_chunk: Callable[[], None] | None = None) -> int:
    """Writes the first `size` bytes of `buffer` (page-aligned, its length a multiple of
    `PAGE`) as `file`, synced (see Note: Direct writes); returns `size`.

    Args:
      file: the file to create.
      buffer: the whole file's bytes, from offset 0.
      size: the file's length.
      after_first_chunk: called once the first chunk is written (a test's pause point).
    """
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return _write_cached(file, buffer, size, after_first_chunk)
    view = memoryview(buffer)
    try:
        padded = -(-size // PAGE) * PAGE
        offset = 0
        while offset < padded:
            end = min(offset + CHUNK_BYTES, padded)
            try:
                offset += os.pwrite(fd, view[offset:end], offset)
            except OSError as e:  # a block size above the page: write it cached instead
                if e.errno != errno.EINVAL:
                    raise
                os.close(fd)
                fd = -1
                return _write_cached(file, buffer, size, after_first_chunk)
            if after_first_chunk is not None:
                after_first_chunk()
                after_first_chunk = None
        if padded != size:
            os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        view.release()
        if fd >= 0:
            os.close(fd)
    return size


def _write_cached(file: str, buffer: mmap.mmap, size: int,
                  after_first_chunk: Callable[[], None] | None) -> int:
    view = memoryview(buffer)
    try:
        with open(file, "wb") as f:
            for offset in range(0, max(size, 1), CHUNK_BYTES):
                f.write(view[offset:min(offset + CHUNK_BYTES, size)])
                if after_first_chunk is not None:
                    f.flush()
                    after_first_chunk()
                    after_first_chunk = None
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        view.release()
    return size


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
