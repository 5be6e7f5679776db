"""Not a test: the 2-rank jobs of tests/jobs/test_checkpoint_crash.py.

    launch/jpprun -n 2 python tests/jobs/harness/checkpoint_steps.py crash DIR
    launch/jpprun -n 2 python tests/jobs/harness/checkpoint_steps.py resume DIR OUT

Both open a `CheckpointManager` over DIR (keeping 2 steps) holding steps 1..3 of
`values(step)`: leaf "a" on group 0 (rank 0 writes it), "b" on group 1 (rank 1), "n" a
plain leaf (rank 0). `crash` saves step 4 asynchronously and waits for it: with
JAXPP_MPI_CHECKPOINT_PAUSE_AT set, a rank stops at that point of the save and the test
kills it there. `resume` restores the newest step onto the groups, checks every value
it holds against `values(step)` bit for bit (and writes them to OUT/rank{r}.npz), then
saves the next step while deleting the arrays at once (as a donating step does), makes
rank 1's write of the step after fail, and prints what each rank raised.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi import checkpoint
from jaxpp_mpi._src.arrays.array import mpmd_array_from_local


def values(step: int) -> dict:
    """The tree saved as `step` (numpy; tests/jobs/test_checkpoint_crash.py computes the
    same)."""
    rng = np.random.default_rng(step)
    b = rng.normal(size=(384, 512)).astype(ml_dtypes.bfloat16)
    b.view(np.uint16)[0, :3] = [0x7FC1, 0x8000, 0xFF80]  # a NaN payload, -0.0, -inf
    return {"a": rng.normal(size=(256, 1024)).astype(np.float32), "b": b,
            "n": np.int64(step)}


def placed(mesh, v: dict) -> dict:
    sh = [jaxpp_mpi.MpmdSharding(mesh, (g,), P()) for g in (0, 1)]
    return {"a": mpmd_array_from_local(mesh, v["a"], sh[0]),
            "b": mpmd_array_from_local(mesh, v["b"], sh[1]), "n": v["n"]}


def main(mode: str, directory: str, out: str | None = None) -> None:
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    rank = mesh.my_mpmd_axis_index
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    manager = checkpoint.CheckpointManager(directory, mesh=mesh, max_to_keep=2)
    latest = manager.latest_step()
    print(f"rank {rank} latest {latest} steps {manager.all_steps()}", flush=True)
    if mode == "crash":
        manager.save(latest + 1, placed(mesh, values(latest + 1)))
        manager.wait()
        print(f"rank {rank} saved {latest + 1}", flush=True)
        return
    like = {k: np.zeros_like(x) for k, x in values(0).items()}
    sh = {"a": jaxpp_mpi.MpmdSharding(mesh, (0,), P()),
          "b": jaxpp_mpi.MpmdSharding(mesh, (1,), P()), "n": None}
    restored = manager.restore(like, shardings=sh)
    held = {k: np.asarray(x.first_mpmd_replica) for k, x in restored.items()
            if isinstance(x, jaxpp_mpi.MpmdArray) and x.is_partially_addressable}
    held["n"] = np.asarray(restored["n"])
    want = values(latest)
    for k, x in held.items():  # bit for bit, against values computed afresh
        assert x.dtype == want[k].dtype and x.shape == want[k].shape, k
        assert x.tobytes() == want[k].tobytes(), k
    np.savez(os.path.join(out, f"rank{rank}.npz"), **{k: x.view(np.uint8) for k, x in
                                                       held.items() if x.ndim})
    tree = placed(mesh, values(latest + 1))
    manager.save(latest + 1, tree)
    for k in ("a", "b"):
        tree[k].delete()  # what a step donating its inputs does
    manager.wait()
    print(f"rank {rank} saved {latest + 1} steps {manager.all_steps()}", flush=True)
    if rank == 1:  # the next save's write fails on rank 1 only
        from jaxpp_mpi._src.checkpoint import background

        def refuse(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        background.write_buffer = refuse
    manager.save(latest + 2, placed(mesh, values(latest + 2)))
    try:
        manager.wait()
    except checkpoint.CheckpointError as e:
        print(f"rank {rank} raised CheckpointError: {e}", flush=True)
    except OSError as e:
        print(f"rank {rank} raised OSError: {e}", flush=True)
    print(f"rank {rank} done steps {manager.all_steps()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
