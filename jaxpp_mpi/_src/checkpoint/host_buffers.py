"""Host copies of the leaves a rank writes, each in a page-aligned buffer laid out as its
.npy file (`Note: Direct writes` in checkpoint/leaf_files.py), kept for the next save.

Note: Host copies.
  An asynchronous save returns once this rank holds a copy of every leaf it writes, so
  the caller may donate, delete or overwrite its arrays at once. `copy_to_host` first
  starts every leaf's device-to-host transfer (`copy_to_host_async`), then copies each
  leaf, shard by shard (the first replica of each), into its buffer, after the .npy
  header: nothing is assembled twice, and a CPU array is read in place. The buffers are
  anonymous memory maps, page-aligned for direct I/O. Fresh memory costs a page fault per
  page on first touch (on the benchmark's machine a first copy took 6x as long as a
  copy into touched memory; mapping with MAP_POPULATE, faulting every page in at once,
  halves that), so the buffers of a save go back to a `BufferPool` once
  written and the next save of the same tree copies into them: the pool holds at most
  one save's buffers, kept until `BufferPool.clear`.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint.commit import Producer
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest
from jaxpp_mpi._src.checkpoint.leaf_files import PAGE, npy_header

__all__ = ["BufferPool", "LeafCopy", "copy_to_host"]

_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


@dataclasses.dataclass
class LeafCopy:
    """Leaf `index`'s whole .npy file in the first `size` bytes of `buffer`."""

    index: int
    buffer: mmap.mmap
    size: int


class BufferPool:
    """Page-aligned host buffers kept from one save to the next (see Note: Host copies)."""

    def __init__(self) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        """A buffer of `size` bytes rounded up to the page: a kept one, else a new one."""
        length = max(PAGE, -(-size // PAGE) * PAGE)
        with self._lock:
            kept = self._free.get(length)
            if kept:
                return kept.pop()
        # Faulted in by the kernel at once: several times faster than page by page.
        return mmap.mmap(-1, length, flags=_MAP_FLAGS)

    def give(self, buffers: Sequence[mmap.mmap]) -> None:
        """Keeps `buffers` (written) for the next save, in place of any kept before."""
        free: dict[int, list[mmap.mmap]] = {}
        for b in buffers:
            free.setdefault(len(b), []).append(b)
        with self._lock:
            self._free = free

    def clear(self) -> None:
        """Drops every kept buffer (its memory returns to the system once unreferenced)."""
        with self._lock:
            self._free = {}

    @property
    def nbytes(self) -> int:
        """Bytes kept."""
        with self._lock:
            return sum(len(b) for kept in self._free.values() for b in kept)


def _fill(dst: np.ndarray, source: Any, name: str, leaf: fmt.LeafEntry) -> None:
    """Copies `source` (a jax.Array, numpy array or scalar) into `dst`, its storage view."""
    if isinstance(source, jax.Array):
        shape, dtype = tuple(source.shape), np.dtype(source.dtype)
    else:
        source = np.asarray(source)
        shape, dtype = source.shape, source.dtype
    if shape != leaf.shape or dtype != leaf.np_dtype:
        raise CheckpointError(f"{name} is {dtype.name}{list(shape)}, the manifest says "
                              f"{leaf.dtype}{list(leaf.shape)}")
    if not isinstance(source, jax.Array):
        np.copyto(dst, fmt.to_storage(source), casting="no")
        return
    for shard in source.addressable_shards:
        if shard.replica_id == 0:
            dst[shard.index] = fmt.to_storage(np.asarray(shard.data))


def copy_to_host(manifest: Manifest, mine: Sequence[tuple[int, Producer]],
                 pool: BufferPool) -> list[LeafCopy]:
    """This rank's leaves, each as its .npy file in a host buffer (see Note: Host copies).

    Args:
      manifest: the save's manifest.
      mine: (leaf index, function returning its value) for the leaves this rank writes.
      pool: where the buffers come from.

    Raises:
      CheckpointError: a value whose shape or dtype differs from its manifest entry.
    """
    sources = [(i, produce()) for i, produce in mine]
    for _, source in sources:
        if isinstance(source, jax.Array):
            source.copy_to_host_async()
    out = []
    for i, source in sources:
        leaf = manifest.leaves[i]
        store = fmt.storage_dtype(leaf.np_dtype)
        header = npy_header(leaf.shape, store)
        size = len(header) + leaf.nbytes
        buffer = pool.take(size)
        raw = np.frombuffer(buffer, np.uint8, count=size)
        raw[:len(header)] = np.frombuffer(header, np.uint8)
        dst = raw[len(header):].view(store).reshape(leaf.shape)
        _fill(dst, source, fmt.format_key_path(leaf.path), leaf)
        out.append(LeafCopy(i, buffer, size))
    return out
