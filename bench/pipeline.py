"""Pipeline step time against the simulator's prediction and against plain jax.jit.

Run with one rank per group:  launch/jpprun -n 4 python bench/pipeline.py

In one run, for a tanh MLP (one layer per stage, `--width`, `--rows` per microbatch):
- `step_ms`: the median wall time of a pipelined training step (all ranks, barrier to
  barrier, results ready);
- `predicted_ms`: the makespan the simulator predicts for the same program when every
  Run takes the median time measured for its task label (`collect_task_times_ms`, in
  separate steps) and messages are free; `overhead` = step_ms / predicted_ms is what
  the runtime adds (dispatch, messages, waiting) beyond the schedule's own bubble;
- `jit_ms`: the same step under single-process `jax.jit` with as many compute threads
  as the pipeline has ranks (a child process, affinity widened to all cores).
Rank 0 writes the JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from functools import partial

from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name  # no JAX import


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    p.add_argument("--microbatches", dest="num_microbatches", type=int, default=8)
    # Deprecated spelling of --microbatches, kept working but hidden from --help.
    p.add_argument("--mubatches", dest="num_microbatches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--stages", type=int, default=0, help="(reference child only)")
    p.add_argument("--out", default="bench/results/pipeline.json")
    p.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, stages: int, sched):
    import jax
    import jax.numpy as jnp
    import optax

    import jaxpp_mpi

    keys = jax.random.split(jax.random.PRNGKey(0), stages + 2)
    params = [jax.random.normal(k, (args.width, args.width)) / args.width ** 0.5
              for k in keys[:stages]]
    batch = (jax.random.normal(keys[-2], (args.num_microbatches, args.rows, args.width)),
             jax.random.normal(keys[-1], (args.num_microbatches, args.rows, args.width)))

    def loss_fn(params, mb):
        x, y = mb
        for w in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w))
        return jnp.mean((x - y) ** 2)

    opt = optax.adam(1e-3)

    def step(opt_state, params, batch):
        losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss_fn), params), batch,
                                          schedule=sched)
        updates, opt_state = opt.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses

    return step, opt.init(params), params, batch


def reference(args) -> None:
    """Child process: the jax.jit step time, printed as one JSON line."""
    import jax
    import numpy as np

    sched = schedule_by_name(args.schedule, args.stages)
    step, opt_state, params, batch = build(args, sched.num_stages, sched)
    jitted = jax.jit(step)
    state = (opt_state, params)
    for _ in range(2):
        *state_, _ = jitted(*state, batch)
        state = tuple(state_)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        *state_, losses = jitted(*state, batch)
        state = tuple(state_)
        jax.block_until_ready((state, losses))
        times.append(time.perf_counter() - start)
    print(json.dumps({"jit_ms": float(np.median(times)) * 1e3}))


def run_reference(args, threads: int) -> float:
    env = dict(os.environ)
    for var in list(env):
        if var.startswith(("OMPI_", "PMI", "PMIX", "PRTE")):
            del env[var]
    env["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"
    env["OMP_NUM_THREADS"] = str(threads)
    code = (f"import os, sys; os.sched_setaffinity(0, range({os.cpu_count()})); "
            f"sys.argv = {[__file__, '--reference', '--stages', str(threads)] + sys.argv[1:]!r}; "
            "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["jit_ms"]


def main() -> None:
    args = parse_args()
    if args.reference:
        reference(args)
        return
    import jax
    import numpy as np
    from mpi4py import MPI

    import jaxpp_mpi
    from jaxpp_mpi._src.ir.simulate import simulate

    world = MPI.COMM_WORLD
    groups = world.size
    mesh = jaxpp_mpi.make_mpmd_mesh((groups, 1), ("stage", "data"), "stage")
    comm = mesh.comm
    sched = schedule_by_name(args.schedule, groups)
    step, opt_state, params, batch = build(args, sched.num_stages, sched)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
        opt_state, params, batch)

    def one_step(state):
        *new, losses = compiled(*state, batch)
        held = [x.first_mpmd_replica for x in jax.tree.leaves((new, losses))
                if x.is_partially_addressable]
        jax.block_until_ready(held)
        return tuple(new)

    state = (opt_state, params)
    for _ in range(2):
        state = one_step(state)
    times = []
    for _ in range(args.steps):
        comm.Barrier()
        start = time.perf_counter()
        state = one_step(state)
        comm.Barrier()
        times.append(time.perf_counter() - start)
    step_ms = float(np.median(times)) * 1e3

    with jaxpp_mpi.collect_task_times_ms() as task_times:
        for _ in range(3):
            state = one_step(state)
    medians = {label: float(np.median(t)) for label, t in task_times.items()}
    all_medians = {}
    for part in comm.allgather(medians):
        all_medians.update(part)
    program = compiled.program()
    predicted = simulate(program, latency=lambda run: all_medians.get(run.task, 0.0),
                         check_leaks=False).makespan

    if comm.rank == 0:
        jit_ms = run_reference(args, groups)
        result = {
            "benchmark": "pipeline",
            "machine": platform.node(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "ranks": groups,
            "schedule": repr(sched),
            "mubatches": args.num_microbatches,
            "width": args.width,
            "rows": args.rows,
            "step_ms": step_ms,
            "predicted_ms": predicted,
            "overhead": step_ms / predicted,
            "jit_ms": jit_ms,
            "speedup_vs_jit": jit_ms / step_ms,
            "task_ms": all_medians,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"{sched!r}, {args.num_microbatches} microbatches, width {args.width}: step "
              f"{step_ms:.1f} ms, predicted {predicted:.1f} ms "
              f"(overhead x{step_ms / predicted:.2f}), jax.jit with {groups} threads "
              f"{jit_ms:.1f} ms; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
