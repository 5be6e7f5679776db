"""The pieces of an asynchronous save, alone: a leaf's .npy written from its host buffer is
byte for byte what `np.save` writes, direct or cached (`Note: Direct writes`); host
copies land in reused buffers (`Note: Host copies`); the manager's keep policy
(`Note: Checkpoint steps`)."""

from __future__ import annotations

import errno
import io
import os

import ml_dtypes
import numpy as np
import pytest

from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint import leaf_files
from jaxpp_mpi._src.checkpoint.host_buffers import BufferPool, copy_to_host
from jaxpp_mpi._src.checkpoint.manager import steps_to_remove

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.float64(2.5) * np.ones(()),
    np.zeros((0, 5), np.int64),
    np.arange(7, dtype=np.complex128),
    np.array([True, False]),
    np.random.default_rng(0).normal(size=(1000, 1100)).astype(np.float32),  # > 4 MiB
    np.random.default_rng(1).normal(size=(33,)).astype(ml_dtypes.bfloat16),
]


def _npy(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, fmt.to_storage(value), allow_pickle=False)
    return out.getvalue()


def _leaf(value: np.ndarray) -> fmt.LeafEntry:
    return fmt.LeafEntry((("key", "x"),), value.shape, value.dtype.name, fmt.leaf_file(0))


@pytest.mark.parametrize("value", ARRAYS, ids=lambda a: f"{a.dtype.name}{list(a.shape)}")
@pytest.mark.parametrize("direct", [True, False])
def test_a_leaf_written_from_its_host_copy_is_what_np_save_writes(tmp_path, monkeypatch,
                                                                 value, direct):
    if not direct:  # a file system refusing O_DIRECT
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", no_direct)
    manifest = fmt.Manifest((_leaf(value),))
    (copy,) = copy_to_host(manifest, [(0, lambda: value)], BufferPool())
    monkeypatch.setattr(leaf_files, "CHUNK_BYTES", 1 << 20)  # several chunks for the large
    chunks = []
    file = str(tmp_path / "leaf.npy")
    assert leaf_files.write_buffer(file, copy.buffer, copy.size,
                                   lambda: chunks.append(os.path.getsize(file))) == copy.size
    assert open(file, "rb").read() == _npy(value)
    assert len(chunks) == 1  # the pause point is reached once, after the first chunk
    read = leaf_files.read_npy(file, value.shape, value.dtype)
    assert read.tobytes() == value.tobytes()


def test_host_copies_reuse_the_buffers_of_the_previous_save():
    pool = BufferPool()
    value = np.arange(3000, dtype=np.float32)
    manifest = fmt.Manifest((_leaf(value),))
    (first,) = copy_to_host(manifest, [(0, lambda: value)], pool)
    assert len(first.buffer) % leaf_files.PAGE == 0
    pool.give([first.buffer])
    assert pool.nbytes == len(first.buffer)
    (second,) = copy_to_host(manifest, [(0, lambda: value + 1)], pool)
    assert second.buffer is first.buffer and pool.nbytes == 0
    pool.give([second.buffer])
    pool.clear()
    assert pool.nbytes == 0


def test_a_value_unlike_its_manifest_entry_is_refused():
    manifest = fmt.Manifest((_leaf(np.zeros(3, np.float32)),))
    with pytest.raises(fmt.CheckpointError, match=r"\['x'\] is float64\[3\], the manifest"):
        copy_to_host(manifest, [(0, lambda: np.zeros(3))], BufferPool())


@pytest.mark.parametrize("steps, keep, period, removed", [
    ([1, 2, 3, 4], None, None, []),
    ([1, 2, 3, 4], 2, None, [1, 2]),
    ([1, 2, 3, 4, 5, 6], 1, 2, [1, 3, 5]),
    ([10, 20, 30], 5, None, []),
    ([3, 1, 2, 2], 1, None, [1, 2]),
])
def test_the_keep_policy(steps, keep, period, removed):
    assert steps_to_remove(steps, keep, period) == removed
