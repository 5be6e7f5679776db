"""Checkpoint saves of a multi-GiB train state on 2 ranks: synchronous, asynchronous, and
the disk's own direct-I/O speed, in one run.

    launch/jpprun -n 2 python bench/checkpoint.py --out bench/results/checkpoint_DATE.json

The state: a 2-stage tanh MLP, one DxD float32 weight per stage (D=8192 by default),
with adam's two moments: 3 x 2 x D^2 x 4 bytes (1.5 GiB), each rank holding its stage's
third. The step donates its state. Measured, medians over `--repeats`:

  step_s               a step (state ready to state ready), no save in flight
  sync_save_s          `checkpoint.save` of the state (call to return)
  async_pause_s        `checkpoint.save_async` (call to return: host copies taken), the
                       first save's left out (its host buffers are fresh memory)
  async_write_MiBps    state bytes / (return to committed) of an asynchronous save with
                       nothing else running
  step_during_save_s   a step that starts while an asynchronous save is being written
                       (`--during` such saves per repeat, each after 2 steps without)
  step_during_over_step  per such save, its steps' mean over the 2 steps' just before
                       (the machine is shared: a ratio under the same load)
  write_during_steps_MiBps  that save's state bytes / (return to committed)
  disk_direct_MiBps    `dd if=/dev/zero bs=16M oflag=direct` of the state's size, rank 0
                       alone, in the same directory

Each figure is the slowest rank's (max over ranks). Needs ~2 x the state in free disk
space under --dir and ~3 x in memory; files are removed as it goes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import metadata, write_json  # noqa: E402

import jaxpp_mpi  # noqa: E402
from jaxpp_mpi import checkpoint  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _dd_MiBps(directory: str, nbytes: int) -> float:
    """Rank 0's direct-I/O write of `nbytes` zeros with dd, in MiB/s."""
    file = os.path.join(directory, "dd.bin")
    count = max(1, nbytes // (16 << 20))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={file}", "bs=16M", f"count={count}",
                    "oflag=direct", "conv=fsync"], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    os.unlink(file)
    return count * 16 / seconds


def _when_done(pending) -> threading.Thread:
    """A thread noting (`.at`) when this rank's part of `pending` is over (polled every
    5 ms: the figure does not wait for the loop's next look between steps)."""
    def watch() -> None:
        while not pending.done():
            time.sleep(0.005)
        thread.at = time.perf_counter()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=8192, help="D: each stage's weight is DxD")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps timed per repeat")
    p.add_argument("--during", type=int, default=3,
                   help="asynchronous saves with steps running, per repeat")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the saves go")
    p.add_argument("--out", default=None, help="the JSON result file")
    args = p.parse_args()

    load_before = os.getloadavg()  # the machine is shared: how busy it was, recorded
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    comm = mesh.job_comm
    rank = comm.Get_rank()
    work = comm.bcast(tempfile.mkdtemp(prefix="jaxpp_ckpt_bench_", dir=args.dir)
                      if rank == 0 else None)
    optimizer = optax.adam(1e-4)

    def loss_fn(params, microbatch):
        x, y = microbatch
        for w in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w))
        return jnp.mean((x - y) ** 2)

    def train_step(opt_state, params, batch):
        losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss_fn), params), batch,
                                          schedule=jaxpp_mpi.GPipe(mesh.mpmd_dim))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses

    d = args.dim
    keys = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k, (d, d), jnp.float32) / np.sqrt(d) for k in keys[:2]]
    batch = (jax.random.normal(keys[2], (2, 16, d)), jax.random.normal(keys[3], (2, 16, d)))
    step = jaxpp_mpi.mpmd_jit_with_loop(train_step, mpmd_mesh=mesh, donate_argnums=(0, 1))
    opt_state = optimizer.init(params)
    compiled = step.compile(opt_state, params, batch)
    state = (opt_state, params)

    def run(s):
        o, w, _ = compiled(*s, batch)
        for x in jax.tree.leaves((o, w)):
            x.block_until_ready()
        return (o, w)

    for _ in range(2):  # warm-up: the first steps place the state on the groups
        state = run(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def slowest(seconds: float) -> float:
        return max(comm.allgather(seconds))

    def timed_steps(n: int) -> list[float]:
        nonlocal state
        out = []
        for _ in range(n):
            comm.Barrier()
            t0 = time.perf_counter()
            state = run(state)
            out.append(slowest(time.perf_counter() - t0))
        return out

    def tree():
        return {"opt_state": state[0], "params": state[1]}

    result: dict = {"step_s": [], "sync_save_s": [], "async_pause_s": [],
                    "async_write_MiBps": [], "step_during_save_s": [],
                    "write_during_steps_MiBps": [], "step_during_over_step": [],
                    "disk_direct_MiBps": []}
    path = os.path.join(work, "ckpt")
    first_pause = None
    for repeat in range(args.repeats):
        result["step_s"] += timed_steps(args.steps)

        comm.Barrier()
        t0 = time.perf_counter()
        checkpoint.save(path, tree(), step=repeat, overwrite=True)
        result["sync_save_s"].append(slowest(time.perf_counter() - t0))

        comm.Barrier()
        t0 = time.perf_counter()
        pending = checkpoint.save_async(path, tree(), step=100 + repeat, overwrite=True)
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        pause = slowest(t1 - t0)
        if first_pause is None:
            first_pause = pause
        else:
            result["async_pause_s"].append(pause)
        result["async_write_MiBps"].append(nbytes / 2**20 / slowest(t2 - t1))

        for k in range(args.during):
            before = timed_steps(2)  # the steps just before, under the same load
            result["step_s"] += before
            comm.Barrier()
            t0 = time.perf_counter()
            pending = checkpoint.save_async(path, tree(), step=200 + 10 * repeat + k,
                                            overwrite=True)
            t1 = time.perf_counter()
            result["async_pause_s"].append(slowest(t1 - t0))
            finished = _when_done(pending)
            during = []
            while True:  # steps while the save is written (every rank decides alike)
                if all(comm.allgather(pending.done())):
                    break
                s0 = time.perf_counter()
                state = run(state)
                during.append(slowest(time.perf_counter() - s0))
                comm.Barrier()
            pending.wait()
            finished.join()
            result["step_during_save_s"] += during
            if during:
                result["step_during_over_step"].append(
                    statistics.mean(during) / statistics.mean(before))
            written = slowest(finished.at - t1)
            result["write_during_steps_MiBps"].append(nbytes / 2**20 / written)

        comm.Barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            result["disk_direct_MiBps"].append(_dd_MiBps(work, nbytes))
        comm.Barrier()

    checkpoint.wait_for_saves()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        summary = {k: statistics.median(v) for k, v in result.items() if v}
        summary["async_first_pause_s"] = first_pause
        summary["pause_over_sync"] = summary["async_pause_s"] / summary["sync_save_s"]
        summary["write_over_disk"] = summary["async_write_MiBps"] / summary["disk_direct_MiBps"]
        out = {**metadata(), "date": datetime.date.today().isoformat(), "commit": _commit(),
               "ranks": comm.Get_size(), "state_bytes": nbytes, "state_GiB": nbytes / 2**30,
               "dim": d, "repeats": args.repeats, "loadavg_1min": [load_before[0],
                                                                    os.getloadavg()[0]],
               **summary, "runs": result}
        for k, v in summary.items():
            print(f"{k:>26}: {v:.3f}", flush=True)
        if args.out:
            write_json(args.out, out)
            print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
