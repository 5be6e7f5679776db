"""Not a test: the preemption pattern of tests/jobs/test_preemption.py.

    launch/jpprun -n 2 python tests/jobs/harness/preempt_training.py DIR

Trains the tiny MLP of tests/models.py (one stage per rank, 1F1B) for STEPS steps,
resuming from the newest step of a `CheckpointManager` over DIR/ckpt (an interrupted
save's included), which saves every 2nd step in the background. Under a
`PreemptionGuard`, after every step all ranks ask `should_stop()`; when some rank got
SIGTERM (or SIGUSR1) they all save the step (after the save in flight), wait for it and
exit 0.
A fresh run (no checkpoint) first trains STEPS steps uninterrupted and stores what each
rank holds in DIR/reference_rank{r}.npz; a run that reaches STEPS stores the same in
DIR/final_rank{r}.npz. Each step sleeps PAUSE_S so that the test can signal mid-run.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from models import make_step, mlp  # noqa: E402

import jaxpp_mpi  # noqa: E402
from jaxpp_mpi import checkpoint  # noqa: E402

STEPS = 8
PAUSE_S = 0.4


def held(tree) -> dict[str, np.ndarray]:
    return {str(i): np.asarray(x.first_mpmd_replica)
            for i, x in enumerate(jax.tree.leaves(tree)) if x.is_partially_addressable}


def main(directory: str) -> None:
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    rank = mesh.my_mpmd_axis_index
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    params, batch, loss_fn = mlp(2, 4)
    step_fn, opt = make_step(loss_fn, jaxpp_mpi.Std1F1B(2))
    step = jaxpp_mpi.mpmd_jit_with_loop(step_fn, mpmd_mesh=mesh)
    state = {"opt_state": opt.init(params), "params": params}
    manager = checkpoint.CheckpointManager(os.path.join(directory, "ckpt"), mesh=mesh,
                                           save_interval_steps=2, max_to_keep=2)
    first = 0
    found = manager.latest_step()
    if found is not None:
        in_sh, _ = step.compile(state["opt_state"], state["params"], batch).in_shardings
        state = manager.restore(state, shardings={"opt_state": in_sh[0], "params": in_sh[1]})
        first = found
        print(f"rank {rank} resumed at {first}", flush=True)
    else:
        ref = (state["opt_state"], state["params"])
        for _ in range(STEPS):
            ref = step(*ref, batch)[:2]
        np.savez(os.path.join(directory, f"reference_rank{rank}.npz"), **held(ref))
    with jaxpp_mpi.PreemptionGuard(mesh) as guard:
        for s in range(first, STEPS):
            opt_state, params = step(state["opt_state"], state["params"], batch)[:2]
            state = {"opt_state": opt_state, "params": params}
            print(f"rank {rank} step {s + 1}", flush=True)
            manager.save(s + 1, state)  # every 2nd step, in the background
            time.sleep(PAUSE_S)
            if guard.should_stop():
                manager.save(s + 1, state, force=True)  # after the save in flight
                manager.wait()
                print(f"rank {rank} stopped at {s + 1} on {guard.received and guard.received.name}",
                      flush=True)
                return
    np.savez(os.path.join(directory, f"final_rank{rank}.npz"),
             **held((state["opt_state"], state["params"])))
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
