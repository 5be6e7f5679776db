"""Not a test: one half of the checkpoint resume check in tests/unit/test_checkpoint_mpi.py.

    launch/jpprun -n 2 python tests/jobs/harness/resume_training.py first DIR
    launch/jpprun -n 2 python tests/jobs/harness/resume_training.py second DIR

`first` trains the tiny MLP of tests/models.py (one stage per rank, 1F1B) for 6 steps
uninterrupted and writes, per rank, the values it holds to DIR/reference_rank{r}.npz;
then trains 3 steps from the same start and saves a checkpoint to DIR/ckpt. `second`
(a new MPI job) restores DIR/ckpt onto the step's input shardings, trains 3 more steps
and writes DIR/resumed_rank{r}.npz the same way. The test compares the two files.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from models import make_step, mlp  # noqa: E402

import jaxpp_mpi  # noqa: E402
from jaxpp_mpi import checkpoint  # noqa: E402

STEPS = 6
SAVE_AT = 3


def held(prefix: str, tree, out: dict) -> None:
    """Adds the leaves of `tree` this rank holds to `out`, keyed `prefix/leaf index`."""
    for i, x in enumerate(jax.tree.leaves(tree)):
        if x.is_partially_addressable:
            out[f"{prefix}/{i}"] = np.asarray(x.first_mpmd_replica)


def train(step, state, batch, steps: int, first_step: int, out: dict):
    for s in range(first_step, first_step + steps):
        opt_state, params, losses, _ = step(*state, batch)
        state = (opt_state, params)
        held(f"loss{s}", losses, out)
    return state


def main(phase: str, directory: str) -> None:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    rank = mesh.my_mpmd_axis_index
    params, batch, loss_fn = mlp(size, 2 * size)
    step_fn, opt = make_step(loss_fn, jaxpp_mpi.Std1F1B(size))
    step = jaxpp_mpi.mpmd_jit_with_loop(step_fn, mpmd_mesh=mesh)
    start = (opt.init(params), params)
    ckpt = os.path.join(directory, "ckpt")
    out: dict[str, np.ndarray] = {}
    if phase == "first":
        final = train(step, start, batch, STEPS, 1, out)
        held("state", final, out)
        np.savez(os.path.join(directory, f"reference_rank{rank}.npz"), **out)
        saved = train(step, start, batch, SAVE_AT, 1, {})
        checkpoint.save(ckpt, {"opt_state": saved[0], "params": saved[1]}, step=SAVE_AT)
    else:
        in_sh, _ = step.compile(*start, batch).in_shardings
        like = {"opt_state": start[0], "params": start[1]}
        restored = checkpoint.restore(ckpt, like,
                                      shardings={"opt_state": in_sh[0], "params": in_sh[1]})
        assert checkpoint.read_manifest(ckpt).step == SAVE_AT
        for x in jax.tree.leaves(restored):  # each rank holds exactly its groups' leaves
            assert isinstance(x, jaxpp_mpi.MpmdArray)
            assert x.is_partially_addressable == (rank in x.mpmd_idxs), x
        state = (restored["opt_state"], restored["params"])
        final = train(step, state, batch, STEPS - SAVE_AT, SAVE_AT + 1, out)
        held("state", final, out)
        np.savez(os.path.join(directory, f"resumed_rank{rank}.npz"), **out)
    print(f"rank {rank} {phase} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
