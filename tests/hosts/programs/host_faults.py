"""Not a test: a pipelined 2-stage MLP trained across two hosts (one rank each), for
tests/hosts/test_host_faults.py, which injects one fault at a point this program reaches
and waits at.

    host_faults.py MODE DIR

At a point P, each rank that reaches it writes DIR/ready-P-RANK and waits for
DIR/go-P (the test cuts a link, or kills a host, in between). Every rank copies its
stderr to DIR/rank-R.err too: what a rank behind a cut link says cannot reach mpirun.
MODE:
  mid-step: in step 4, rank 1 waits at `mid-step` inside its stage (a host callback)
    while rank 0 waits for its message; the test cuts rank 1's link; the job must end.
  between: after step 3 every rank waits at `between`; the test cuts rank 1's link; the
    ranks meet next in step 4's call agreement; the job must end.
  flap-save: a checkpoint DIR/ckpt saved after step 2; rank 1 waits at `mid-step` in
    step 4 while the test cuts its link for a few seconds; the 6 steps must end with
    jax.jit's results (`rank R matches jax.jit`); then every rank waits at `save`, the
    test cuts the link again, and the save of step 6 over DIR/ckpt must not complete.
"""

from __future__ import annotations

import socket
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi import checkpoint

MODE, DIR = sys.argv[1], Path(sys.argv[2])
RANK = MPI.COMM_WORLD.rank
STEPS, FAULT_STEP, SAVED_STEP = 6, 4, 2
step_now = [0]
paused = [False]


class _Tee:
    """sys.stderr copied to a file of this rank's (flushed at every write)."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "a")  # noqa: SIM115 - lives as long

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def wait_at(point: str) -> None:
    """Says this rank reached `point` (a file the test polls for) and waits for go."""
    (DIR / f"ready-{point}-{RANK}").write_text(f"{time.time()}")
    print(f"rank {RANK} on {socket.gethostname()} waits at {point}", flush=True)
    go, give_up = DIR / f"go-{point}", time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > give_up:
            raise TimeoutError(f"rank {RANK}: no go at {point} in 120 s")
        time.sleep(0.02)


def in_stage_1(x) -> None:
    """Stage 1's host callback (rank 1 runs stage 1): the mid-step pause, once."""
    if step_now[0] == FAULT_STEP and not paused[0] and MODE in ("mid-step", "flap-save"):
        paused[0] = True
        wait_at("mid-step")


def loss_fn(params, mb):
    x, y = mb
    for s, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if s == 1:
            jax.debug.callback(in_stage_1, x)
        x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean((x - y) ** 2)


def step(params, batch):
    losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss_fn), params), batch,
                                      schedule=jaxpp_mpi.Std1F1B(2))
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), losses


def held(tree) -> dict[str, np.ndarray]:
    """The leaves of `tree` this rank holds, keyed by leaf index."""
    return {str(i): np.asarray(x.first_mpmd_replica)
            for i, x in enumerate(jax.tree.leaves(tree)) if x.is_partially_addressable}


def main() -> None:
    sys.stderr = _Tee(sys.stderr, DIR / f"rank-{RANK}.err")
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    keys = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:2]]
    batch = (jax.random.normal(keys[2], (4, 2, 8)), jax.random.normal(keys[3], (4, 2, 8)))
    reference = [params]
    for _ in range(STEPS):  # jax.jit's steps, before any fault (step_now is 0)
        reference.append(jax.jit(step)(reference[-1], batch)[0])
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    ckpt = str(DIR / "ckpt")
    for k in range(1, STEPS + 1):
        if MODE == "between" and k == FAULT_STEP:
            wait_at("between")
        step_now[0] = k
        params, losses = pipelined(params, batch)
        got = held(params)  # waits for this rank's results
        for i, value in got.items():
            np.testing.assert_allclose(value, reference[k][int(i)], rtol=1e-5, atol=1e-6)
        print(f"rank {RANK} step {k} done", flush=True)
        if MODE == "flap-save" and k == SAVED_STEP:
            checkpoint.save(ckpt, params, step=k, overwrite=True)
            np.savez(DIR / f"saved-rank{RANK}.npz", **got)
    print(f"rank {RANK} matches jax.jit", flush=True)
    if MODE == "flap-save":
        wait_at("save")
        checkpoint.save(ckpt, params, step=STEPS, overwrite=True)
    print(f"rank {RANK} finished", flush=True)


if __name__ == "__main__":
    main()
