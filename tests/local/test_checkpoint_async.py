"""Asynchronous saves and the CheckpointManager in local mode (one process, 4 groups of
2 CPU devices): the files are those of a synchronous save, arrays may be deleted or
changed once the call returns, failures are raised at the next wait or save, steps are
kept and removed by the policy, and what crashes leave is cleaned up (`Note: Background
saves`, `Note: Checkpoint steps`). Killed jobs: tests/jobs/test_checkpoint_crash.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpp_mpi as jp
from jaxpp_mpi import checkpoint as ck
from jaxpp_mpi._src.arrays.array import mpmd_array_from_local
from jaxpp_mpi._src.checkpoint import background

MESH = jp.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")


def values(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    bf16 = rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16)
    bf16.view(np.uint16)[0, :3] = [0x7FC1, 0x8000, 0xFF80]  # NaN payload, -0.0, -inf
    return {"w": rng.normal(size=(8, 4)).astype(np.float32), "bf16": bf16,
            "big": rng.normal(size=(300, 1000)).astype(np.float32),  # > one 1 MiB page run
            "ids": rng.integers(-5, 5, size=(3, 2)).astype(np.int32),
            "plain": rng.normal(size=(2, 2)).astype(np.float32), "n": np.int64(seed)}


def tree_of(v: dict) -> dict:
    def put(x, ids, spec=None):
        return mpmd_array_from_local(MESH, x, jp.MpmdSharding(MESH, ids, spec))

    return {"params": [put(v["w"], (1,), P("data")), put(v["bf16"], (0, 2), P(None, "data")),
                       put(v["big"], (3,), P("data"))],
            "ids": put(v["ids"], (2,)), "plain": jnp.asarray(v["plain"]),
            "np": v["plain"].copy(), "n": v["n"], "f": 2.5}


def expected(v: dict) -> dict:
    """What load_whole returns for `tree_of(v)`, from the numpy values."""
    return {"params": [v["w"], v["bf16"], v["big"]], "ids": v["ids"], "plain": v["plain"],
            "np": v["plain"], "n": v["n"], "f": np.float64(2.5)}


def assert_same_bits(got, want) -> None:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def files(path) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            full = os.path.join(root, n)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def test_the_files_are_those_a_synchronous_save_writes(tmp_path):
    v = values(1)
    ck.save(str(tmp_path / "sync"), tree_of(v), step=3)
    pending = ck.save_async(str(tmp_path / "async"), tree_of(v), step=3)
    pending.wait()
    assert pending.done()
    sync, done = files(tmp_path / "sync"), files(tmp_path / "async")
    assert sorted(done) == sorted(sync) and len(sync) == 9  # manifest + 8 leaves
    for name, data in sync.items():
        assert done[name] == data, name
    assert sorted(os.listdir(tmp_path)) == ["async", "sync"]  # no lock, temp dir or mark


def test_arrays_may_be_deleted_or_changed_once_the_call_returns(tmp_path):
    v = values(2)
    tree = tree_of(v)
    pending = ck.save_async(str(tmp_path / "ckpt"), tree, step=1)
    for x in jax.tree.leaves(tree):  # as a step donating its inputs would
        if isinstance(x, jp.MpmdArray):
            x.delete()
    tree["np"][:] = -1.0
    donate = jax.jit(lambda x: x * 0, donate_argnums=0)
    tree["plain"] = donate(tree["plain"])
    pending.wait()
    assert_same_bits(ck.load_whole(str(tmp_path / "ckpt")), expected(v))


def _fail_writes(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(background, "write_buffer", refuse)


def test_a_failed_write_is_raised_at_wait_and_keeps_the_checkpoint_there(tmp_path,
                                                                         monkeypatch):
    path = str(tmp_path / "ckpt")
    v = values(3)
    ck.save_async(path, tree_of(v), step=1).wait()
    _fail_writes(monkeypatch)
    pending = ck.save_async(path, tree_of(values(4)), step=2, overwrite=True)
    while not pending.done():
        time.sleep(0.01)
    assert isinstance(pending.error(), OSError)  # seen here before any wait
    with pytest.raises(OSError, match="injected"):
        pending.wait()
    pending.wait()  # raised once; nothing in flight now
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert ck.read_manifest(path).step == 1
    assert_same_bits(ck.load_whole(path), expected(v))
    monkeypatch.undo()
    ck.save_async(path, tree_of(values(4)), step=2, overwrite=True).wait()  # lock free
    assert_same_bits(ck.load_whole(path), expected(values(4)))


def test_the_next_save_waits_for_the_one_in_flight_and_raises_its_failure(tmp_path,
                                                                          monkeypatch):
    _fail_writes(monkeypatch)
    ck.save_async(str(tmp_path / "a"), tree_of(values(5)), step=1)
    monkeypatch.undo()
    with pytest.raises(OSError, match="injected"):
        ck.save_async(str(tmp_path / "b"), tree_of(values(6)), step=2)
    assert not os.path.exists(tmp_path / "b")  # that save did not start
    first = ck.save_async(str(tmp_path / "a"), tree_of(values(5)), step=1)
    ck.save(str(tmp_path / "a"), tree_of(values(6)), step=2, overwrite=True)  # waits
    assert first.done()
    assert_same_bits(ck.load_whole(str(tmp_path / "a")), expected(values(6)))


def test_an_unwaited_failure_ends_the_process_with_status_1(tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np
        from jaxpp_mpi import checkpoint
        from jaxpp_mpi._src.checkpoint import background

        def refuse(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        background.write_buffer = refuse
        checkpoint.save_async({str(tmp_path / "ckpt")!r}, {{"a": np.ones(3)}}, step=7)
        print("returned", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != "XLA_FLAGS"})
    assert proc.stdout == "returned\n"
    assert proc.returncode == 1, proc.stderr
    assert ("[rank 0] jaxpp_mpi checkpoint: the asynchronous save of "
            f"{tmp_path / 'ckpt'} (step 7), never waited for, failed: OSError: [Errno 28] "
            "No space left on device (injected)") in proc.stderr
    assert os.listdir(tmp_path) == []


# -- the manager --------------------------------------------------------------------


def small(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.normal(size=(5, 3)).astype(np.float32), "step": np.int64(step)}


@pytest.mark.parametrize("async_saves", [True, False])
def test_manager_saves_every_k_steps_and_keeps_the_last_n_and_every_mth(tmp_path,
                                                                        async_saves):
    manager = ck.CheckpointManager(str(tmp_path), save_interval_steps=2, max_to_keep=2,
                                   keep_period=4, async_saves=async_saves)
    assert manager.latest_step() is None and manager.all_steps() == []
    saved = [s for s in range(1, 12) if manager.save(s, small(s))]
    assert saved == [2, 4, 6, 8, 10]
    assert manager.save(11, small(11), force=True)
    manager.wait()
    assert manager.all_steps() == [4, 8, 10, 11]  # the last 2, and multiples of 4
    assert sorted(os.listdir(tmp_path)) == ["10", "11", "4", "8"]
    assert manager.latest_step() == 11
    assert_same_bits(manager.restore(small(0)), small(11))
    assert_same_bits(manager.restore(small(0), step=8), small(8))
    assert_same_bits(ck.load_whole(manager.step_path(4)), small(4))
    manager.close()


def test_manager_restores_placed_arrays_from_the_newest_step(tmp_path):
    manager = ck.CheckpointManager(str(tmp_path), max_to_keep=1)
    for s in (1, 2):
        manager.save(s, tree_of(values(s)))
    like = tree_of(values(0))
    restored = manager.restore(like)
    assert restored["params"][0].mpmd_sharding == like["params"][0].mpmd_sharding
    whole = jax.tree.map(lambda x: np.asarray(x.first_mpmd_replica)
                         if isinstance(x, jp.MpmdArray) else x, restored)
    assert_same_bits(whole, expected(values(2)))
    assert manager.all_steps() == [2]


def test_manager_never_goes_backwards_and_skips_a_saved_step(tmp_path):
    manager = ck.CheckpointManager(str(tmp_path))
    manager.save(5, small(5))
    manager.wait()
    again = ck.CheckpointManager(str(tmp_path))
    assert not again.save(5, small(50))  # the newest step already
    with pytest.raises(ck.CheckpointError, match="holds step 5, newer than the step 3"):
        again.save(3, small(3))
    assert_same_bits(again.restore(small(0)), small(5))
    with pytest.raises(ck.CheckpointError, match="no complete step"):
        ck.CheckpointManager(str(tmp_path / "empty")).restore(small(0))


def test_manager_cleans_up_what_crashes_leave(tmp_path):
    manager = ck.CheckpointManager(str(tmp_path), async_saves=False)
    for s in (4, 6):
        manager.save(s, small(s))
    # step 9 complete in its temp dir (killed before the rename), step 7 half-written,
    # an old copy of 6 (killed between two renames), step 2 half-removed, a stale lock
    ck.save(str(tmp_path / "nine"), small(9), step=9)
    os.rename(tmp_path / "nine", tmp_path / ".9.tmp-0123456789ab")
    os.makedirs(tmp_path / ".7.tmp-aaaaaaaaaaaa" / "arrays")
    ck.save(str(tmp_path / ".6.old-bbbbbbbbbbbb"), small(60), step=6)
    os.makedirs(tmp_path / ".2.del-cccccccccccc" / "arrays")
    (tmp_path / ".8.lock").write_text("{}")
    (tmp_path / "notes").write_text("the user's")
    manager = ck.CheckpointManager(str(tmp_path))
    assert manager.all_steps() == [4, 6, 9]
    assert sorted(os.listdir(tmp_path)) == ["4", "6", "9", "notes"]
    for s in (4, 6, 9):
        assert_same_bits(ck.load_whole(manager.step_path(s)), small(s))


def test_manager_arguments_are_checked(tmp_path):
    for kwargs in ({"save_interval_steps": 0}, {"max_to_keep": 0}, {"keep_period": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            ck.CheckpointManager(str(tmp_path), **kwargs)
