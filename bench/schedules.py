"""Every schedule on one fixed workload, against single-process jax.jit and an honest prediction.

Run with 2 ranks:  launch/jpprun -n 2 python bench/schedules.py --out bench/results/schedules.json

The workload: 8 residual blocks `x + W2 gelu(W1 layernorm(x))`, d=1024,
ffn=4096, float32, no biases, exact GELU, LayerNorm eps 1e-5 without scale or offset;
8 microbatches of 16 rows; loss per microbatch MSE / 8; one step = forward, backward and
gradient accumulation over the microbatches, no optimizer; weights made by numpy with a
fixed seed. 2 stages of 4 blocks (one per rank) or 4 stages of 2 blocks (two per rank).

In one run, taking turns round by round (each round: every schedule once plain and once
traced, in rotated order, then the reference on rank 0 while rank 1 waits, and the
reference on both ranks at once, those two in alternating order):
- `step_ms`: median pipelined step, barrier to barrier;
- `jit_ms`: the same step as one `jax.jit` (`lax.scan` over microbatches) in one process
  with one compute thread (rank 0 of this job);
- `ideal_ms` = jit_ms x makespan / (sum of busy time) of the schedule's own simulation
  (`analyze_schedule`, default task times F=1, B=2, I=W=1): the single-process work
  spread over the ranks, plus the schedule's bubble; `fraction` = ideal_ms / step_ms;
- `jit_both_ranks_ms`: the same jax.jit step run by both ranks at once, each its own
  copy, barrier to barrier; `corun_slowdown` = jit_both_ranks_ms / jit_ms: how much
  slower one core computes while the other computes too (shared memory bandwidth and
  cache), which a pipeline's ranks always do; `ideal_corun_ms` and
  `fraction_of_ideal_corun`: ideal and fraction taken from that time instead;
- `predicted_ms`: the simulator's makespan of the lowered program with posted sends
  (what the CPU runtime does, `Note: posted sends`; blocking sends for the `--chained`
  contenders, which run with JAXPP_MPI_POSTED_SENDS=0), every message at the measured
  `latency + bytes / bandwidth` (`MessageCost`, fitted to a ping-pong of the runtime's
  message chains in this run), every Run at the time its task took in one round's
  traced step: the median over the rounds of those makespans. `overhead` = step_ms /
  predicted_ms. (Task times are skewed: a step's tasks taken at their medians sum to
  less than a typical step's, so `predicted_of_medians_ms`, every task at its median,
  is lower and `overhead_of_medians` higher; both are kept.)
- `bound_ms`: the schedule's own dataflow timeline (`schedule_makespan`) when every task
  takes its executable's XLA FLOPs at jax.jit's measured time per FLOP, messages at the
  fitted cost: what a runtime adding nothing reaches on this stage split (the stages'
  FLOPs differ: the first stage computes no input gradient); `fraction_at_bound` =
  ideal_ms / bound_ms, the best `fraction` such a runtime could show;
- `breakdown`: per rank, where a traced step's time goes (see `breakdown`).
Then, alone (bench/_alone.py: rank 0 starts them outside MPI while rank 1 sleeps, so
nothing else runs; `--no-jit-alone`, `--no-torch` leave them out):
- `jit_alone`: the same jax.jit step in a process of its own, with XLA's default
  threading on every core it may use (`default_threads`) and with one thread pinned to
  rank 0's core (`one_thread`); `best` names the faster; `best_jit_over_step` =
  its step / step_ms (above 1: the 2-rank pipeline beats the best single process);
- `torch_pipelining`: torch.distributed.pipelining's GPipe and 1F1B on the same workload
  (bench/_torch_pipeline.py: 2 processes, gloo, one thread each, pinned to our ranks'
  cores), where torch is installed; `torch_over_step` = torch's step / step_ms, against
  torch's schedule of the same name (`torch_schedule`), else its fastest.
Rank 0 writes the JSON (`--out`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py, p2p.py

from _alone import alone_phase, torch_match  # noqa: E402
from _common import (  # noqa: E402
    add_block_options,
    block_options,
    fit_message_cost,
    load_message_cost,
    metadata,
    write_json,
)

from jaxpp_mpi.schedules import analyze_schedule, schedule_by_name  # noqa: E402 - no JAX import

DEFAULT_SCHEDULES = (
    "gpipe",
    "1f1b",
    "eager1f1b",
    "interleaved",
    "kimik2",
    "zerobubble",
    "dualpipev",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_block_options(
        p,
        schedules=DEFAULT_SCHEDULES,
        width=1024,
        ffn=4096,
        repeats=15,
        repeats_help="rounds (each: every schedule plain and traced, and jax.jit)",
        quick_help="d=256, ffn=1024, 3 rounds (a smoke run)",
    )
    p.add_argument(
        "--p2p",
        default=None,
        help="read the message model from this bench/p2p.py JSON instead of "
        "measuring it in this run",
    )
    p.add_argument(
        "--traces",
        default=None,
        help="folder for a Chrome trace and the program text of each schedule",
    )
    p.add_argument(
        "--tuned",
        action="store_true",
        help="also run each schedule lowered for its own task times (their medians over "
        "3 steps, `task_times_ms`), as the contender 'NAME+tuned' where the program differs",
    )
    p.add_argument(
        "--chained",
        action="store_true",
        help="also run each schedule with blocking sends (JAXPP_MPI_POSTED_SENDS=0: message "
        "chains, and the program lowered for them), as the contender 'NAME+chained': the "
        "same-run baseline of posted sends",
    )
    p.add_argument("--no-jit-alone", action="store_true",
                   help="leave out the phase that runs jax.jit alone (bench/_alone.py)")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out torch.distributed.pipelining (bench/_torch_pipeline.py)")
    p.add_argument("--out", default="bench/results/schedules.json")
    return block_options(p, p.parse_args(argv))


# ----------------------------------------------------------------------------- the workload


def make_data(args) -> tuple[list[dict[str, Any]], tuple[Any, Any]]:
    """Weights and the batch as numpy arrays (seed 0)."""
    import numpy as np

    rng = np.random.default_rng(0)
    d, f = args.width, args.ffn
    params = [
        {
            "w1": (rng.standard_normal((d, f)) / np.sqrt(d)).astype(np.float32),
            "w2": (rng.standard_normal((f, d)) / np.sqrt(f)).astype(np.float32),
        }
        for _ in range(args.blocks)
    ]
    shape = (args.num_microbatches, args.rows, d)
    batch = (
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(np.float32),
    )
    return params, batch


def block(p, x):
    """`x + W2 gelu(W1 layernorm(x))`: exact GELU, LayerNorm eps 1e-5, no biases."""
    import jax

    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-5)
    return x + jax.nn.gelu(h @ p["w1"], approximate=False) @ p["w2"]


def loss_fn(params, mb, num_stages: int = 1, num_microbatches: int = 8):
    """MSE / num_microbatches of one microbatch, a stage mark after every stage's blocks."""
    import jax.numpy as jnp

    import jaxpp_mpi

    x, y = mb
    per_stage = len(params) // num_stages
    for i, p in enumerate(params):
        x = block(p, x)
        if num_stages > 1 and (i + 1) % per_stage == 0:
            x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean((x - y) ** 2) / num_microbatches


def pipelined_step(sched, num_microbatches: int):
    import jax

    import jaxpp_mpi

    loss = partial(loss_fn, num_stages=sched.num_stages, num_microbatches=num_microbatches)

    def step(params, batch):
        return jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), params), batch, schedule=sched)

    return step


def reference_step(num_microbatches: int):
    """The same step for one process: `lax.scan` over the microbatches."""
    import jax
    import jax.numpy as jnp

    grad = jax.value_and_grad(partial(loss_fn, num_microbatches=num_microbatches))

    def step(params, batch):
        def body(acc, mb):
            loss, g = grad(params, mb)
            return jax.tree.map(lambda a, b: a + b, acc, (loss, g)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, zero, batch)[0]

    return step


# ----------------------------------------------------------------------------- analysis


def ideal_factor(sched, num_microbatches: int) -> float:
    """makespan / total busy time of the schedule's own simulation (default task times).

    Times the single-process step, this is the step of a runtime that adds nothing to the
    schedule: the work split evenly over the ranks, plus the schedule's bubble.
    """
    a = analyze_schedule(sched, num_microbatches)
    return a.makespan / sum(a.busy)


def breakdown(events, wall_ms: float, done_ms: float, cost) -> dict[str, float]:
    """Where one rank's traced step goes, in ms (see `Note: trace events`).

    A traced step runs one instruction at a time: every task blocks until its results
    are ready, every message until its MPI calls are done. So:
      `compute`: the tasks' executables (pipeline tasks: F, B, I, W and fused ones);
      `message_transfer`: what the message model says the messages cost;
      `message_wait`: the rest of the message calls, i.e. waiting for the peer;
      `other`: the rank's own time (`done_ms`: from the opening barrier to its results
        being ready) minus all that: Python dispatch of every instruction, executables
        outside the microbatch loop, placing inputs, collecting outputs (copies
        included);
      `idle_end`: `wall_ms - done_ms`, the rank idle at the closing barrier once its
        part is done (the other rank's cooldown: part of the bubble, not a cost).
    """
    compute = sum(e.end_ns - e.start_ns for e in events if e.cat == "task") * 1e-6
    message = sum(e.end_ns - e.start_ns for e in events if e.cat == "message") * 1e-6
    nbytes = [
        b
        for e in events
        if e.cat == "message"
        for b in (e.args.get("bytes"), e.args.get("send_bytes"), e.args.get("recv_bytes"))
        if b is not None
    ]
    transfer = sum(cost.latency + b / cost.bandwidth for b in nbytes)
    return {
        "wall": wall_ms,
        "compute": compute,
        "message_transfer": min(transfer, message),
        "message_wait": max(0.0, message - transfer),
        "other": done_ms - compute - message,
        "idle_end": wall_ms - done_ms,
        "tasks": sum(1 for e in events if e.cat == "task"),
        "messages": sum(1 for e in events if e.cat == "message"),
    }


def schedule_makespan(sched, n: int, task_ms: dict[str, float], message_ms: float) -> float:
    """The schedule's own dataflow timeline with the measured task times (ms).

    Each group runs its schedule entries in order (a fused entry's parts one after the
    other); a task starts when its group is free and its inputs exist (FWD(s, m) needs
    FWD(s-1, m); BWD / BWD_I (s, m) need FWD(s, m) and BWD / BWD_I (s+1, m); BWD_W needs
    BWD_I), an input from another group `message_ms` after it was made. A task the
    compiler emits no Run for (BWD_I of the first stage) takes 0. A task the compiler
    runs fused with the next one (`F7s1+B7s1`, `Note: back-to-back tasks` in
    compiler/loop_order.py) puts the whole time on its first part: the parts run back to
    back on one group and nothing but the second reads the first. This is what the
    schedule promises with these task times; the lowered program's prediction
    (`simulate`) can only be later where the program waits where the schedule does not.
    """
    from jaxpp_mpi.schedules import TaskType

    task_ms = dict(task_ms)
    for label, t in list(task_ms.items()):
        first, *rest = label.split("+")
        if rest:
            task_ms.update({first: t, **{part: 0.0 for part in rest}})

    tasks = sched.tasks(n)
    parts = [[t for e in row for t in (e if isinstance(e, tuple) else (e,))] for row in tasks]
    group = {t: g for g, row in enumerate(parts) for t in row}
    last = sched.num_stages - 1
    bwd = TaskType.BWD_I if sched.is_partial_bwd else TaskType.BWD

    def deps(t):
        s, m = t.stage_id, t.microbatch
        if t.type is TaskType.FWD:
            return [type(t)(s - 1, m, TaskType.FWD)] if s > 0 else []
        if t.type is TaskType.BWD_W:
            return [type(t)(s, m, TaskType.BWD_I)]
        out = [type(t)(s, m, TaskType.FWD)]
        return out + ([type(t)(s + 1, m, bwd)] if s < last else [])

    done: dict = {}
    pos, free = [0] * len(parts), [0.0] * len(parts)
    while any(p < len(row) for p, row in zip(pos, parts)):
        moved = False
        for g, row in enumerate(parts):
            while pos[g] < len(row):
                t = row[pos[g]]
                ready = [done.get(d) for d in deps(t)]
                if any(r is None for r in ready):
                    break
                start = max(
                    [free[g]]
                    + [r + (message_ms if group[d] != g else 0.0) for r, d in zip(ready, deps(t))]
                )
                label = f"{t.type.value}{t.microbatch}s{t.stage_id}"
                done[t] = free[g] = start + task_ms.get(label, 0.0)
                pos[g] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{sched!r}: the schedule's dataflow play is stuck")
    return max(free)


def run_step(exe, params, batch):
    """One pipelined step, to this rank's results being ready; its (distributed) losses."""
    import jax

    losses, grads = exe(params, batch)
    held = [
        x.first_mpmd_replica
        for x in jax.tree.leaves((losses, grads))
        if x.is_partially_addressable
    ]
    jax.block_until_ready(held)
    return losses


def barrier_timed(comm, fn) -> tuple[float, float]:
    """`fn()` between two barriers: (barrier to barrier, this rank's own part) in ms."""
    comm.Barrier()
    start = time.perf_counter()
    fn()
    own = (time.perf_counter() - start) * 1e3
    comm.Barrier()
    return (time.perf_counter() - start) * 1e3, own


def compile_schedule(sched, mesh, params, batch, num_microbatches: int):
    """The workload's step under `sched`, compiled for `mesh`."""
    import jaxpp_mpi

    return jaxpp_mpi.mpmd_jit_with_loop(
        pipelined_step(sched, num_microbatches), mpmd_mesh=mesh
    ).compile(params, batch)


def chained_compile(step, mesh, *args):
    """`step` compiled as with JAXPP_MPI_POSTED_SENDS=0 (blocking sends, `Note: posted
    sends`): the options are read when the step is lowered and its executor built."""
    import dataclasses

    import jaxpp_mpi
    from jaxpp_mpi._src.base import config
    blocking = dataclasses.replace(config.options(), posted_sends=False)
    real = config.options
    config.options = lambda: blocking
    try:
        return jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*args)
    finally:
        config.options = real


def round_times(per_rank: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per round, every rank's task times of that round's traced step, merged (each
    rank times its own tasks)."""
    merged: list[dict[str, float]] = [{} for _ in per_rank[0]]
    for rounds in per_rank:
        for m, times in zip(merged, rounds):
            m.update(times)
    return merged


def task_sums(medians: dict[str, float]) -> dict[str, float]:
    """Per task kind ('F', 'B', 'I', 'W', fused 'F+B'...), the sum of median task times."""
    from jaxpp_mpi.trace import parse_label

    sums: dict[str, float] = {}
    for label, t in medians.items():
        kind = "+".join(p.kind for p in parse_label(label))
        sums[kind] = sums.get(kind, 0.0) + t
    return sums


def flop_task_ms(program, per_exe: dict[int, dict[str, float]], ms_per_flop: float):
    """Per task label, the time its executable's XLA FLOPs take at `ms_per_flop`.

    Args:
      program: the lowered program (`compiled.program()`).
      per_exe: per group, `{executable name: per-device FLOPs of one run}`
        (`compiled.cost_analysis()[g]["per_executable"]`, gathered from the ranks).
      ms_per_flop: jax.jit's measured step time over its FLOPs.
    """
    from jaxpp_mpi._src.ir.program import Run

    return {
        i.task: per_exe[g.mpmd_idx][i.exe] * ms_per_flop
        for g in program.groups
        for i in g.instrs
        if isinstance(i, Run) and i.task
    }


# ----------------------------------------------------------------------------- the run


def measure_message_cost(comm, act_bytes: int, reps: int):
    """Ping-pong of the runtime's message chains around the activation size, fitted."""
    from p2p import bench_size

    sizes = sorted({4096, act_bytes, 4 * act_bytes, 16 * act_bytes})
    rows = [bench_size(comm, s, reps, paths=("jaxpp_mpi",)) for s in sizes]
    return fit_message_cost(rows), rows


def ratio(x: float | None) -> str:
    """A table cell of a ratio, '-' where it was not measured."""
    return f"{x:>5.2f}" if x is not None else f"{'-':>5}"


def print_alone(alone: dict[str, Any]) -> None:
    """The alone phase's lines of the summary (bench/_alone.py)."""
    jit = alone["jit_alone"]
    for key in ("default_threads", "one_thread"):
        e = jit.get(key, jit)
        what = (f"{e['step_ms']:.1f} ms on cores {e['cores']}" if "step_ms" in e
                else e.get("error", e.get("skipped")))
        print(f"jax.jit alone, {key.replace('_', ' ')}: {what}", flush=True)
    if "best" in jit:
        print(f"best single process: {jit['best'].replace('_', ' ')} (bjit = its step / "
              "the pipelined step)", flush=True)
    torch = alone["torch_pipelining"]
    for key, e in torch.get("schedules", {}).items():
        print(f"torch {torch['torch']} pipelining {key}: {e['step_ms']:.1f} ms"
              f"{'' if e.get('loss_ok') else ' (LOSS DIFFERS from jax.jit)'}", flush=True)
    if "schedules" not in torch:
        print(f"torch pipelining: {torch.get('error', torch.get('skipped'))}", flush=True)


def main() -> None:
    args = parse_args()
    import jax
    import numpy as np
    from mpi4py import MPI

    import jaxpp_mpi
    from jaxpp_mpi._src.driver.group_compiler import flops
    from jaxpp_mpi._src.ir.program import Aval
    from jaxpp_mpi._src.ir.simulate import simulate

    world = MPI.COMM_WORLD
    if world.size != 2:
        raise SystemExit(f"bench/schedules.py runs on exactly 2 ranks, got {world.size}")
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    comm = mesh.comm
    rank = comm.rank
    np_params, np_batch = make_data(args)
    params = jax.tree.map(jax.numpy.asarray, np_params)
    batch = jax.tree.map(jax.numpy.asarray, np_batch)
    n = args.num_microbatches
    act_bytes = args.rows * args.width * 4
    act_aval = Aval((args.rows, args.width), "float32")

    if args.p2p:
        cost, p2p_rows = load_message_cost(args.p2p), None
    else:
        cost, p2p_rows = measure_message_cost(comm, act_bytes, max(10, 2 * args.repeats))

    # Compile everything first: the reference on both ranks (rank 0 alone times it, both
    # at once time it too: see `Co-run` below), every schedule on both.
    ref = jax.jit(reference_step(n)).lower(params, batch).compile()
    ref_loss, _ = jax.block_until_ready(ref(params, batch))
    jit_flops = None
    if rank == 0:
        # jax.jit's FLOPs: one microbatch's forward + backward, times n (XLA's cost
        # analysis counts the scan's loop body once).
        one = jax.jit(jax.value_and_grad(partial(loss_fn, num_microbatches=n)))
        one_flops = one.lower(params, jax.tree.map(lambda x: x[0], batch)).compile()
        jit_flops = n * flops(one_flops)
    jit_flops = comm.bcast(jit_flops, root=0)
    scheds, compiled = {}, {}
    for name in args.schedules:
        sched = schedule_by_name(name, 2)
        blocks_ok = args.blocks % sched.num_stages == 0
        if not blocks_ok:
            raise SystemExit(f"{args.blocks} blocks do not split into {sched.num_stages} stages")
        scheds[name] = sched
        start = time.perf_counter()
        compiled[name] = compile_schedule(sched, mesh, params, batch, n)
        if rank == 0:
            print(f"compiled {sched!r} in {time.perf_counter() - start:.1f} s", flush=True)
    if args.chained:
        for name in list(args.schedules):
            cname = f"{name}+chained"
            scheds[cname], compiled[cname] = scheds[name], chained_compile(
                pipelined_step(scheds[name], n), mesh, params, batch)
            args.schedules.append(cname)

    def run_pipelined(name):
        return run_step(compiled[name], params, batch)

    done: list[float] = []  # the last timed call's own time (ms), before the closing barrier

    def timed(fn) -> float:
        wall, own = barrier_timed(comm, fn)
        done[:] = [own]
        return wall

    def run_reference():
        if rank == 0:
            jax.block_until_ready(ref(params, batch))

    def run_reference_both():
        jax.block_until_ready(ref(params, batch))

    def warm_loss(name) -> float:
        """Two warm-up steps of `name`; the second's loss, the same on every rank."""
        run_pipelined(name)
        out = run_pipelined(name)
        value = (
            float(np.asarray(out.first_mpmd_replica).sum())
            if out.is_partially_addressable
            else None
        )
        return comm.bcast(value, root=min(out.mpmd_idxs))

    def gathered_medians(times: dict[str, list[float]]) -> dict[str, float]:
        """Per task label, its median time; every rank's labels (each times its own)."""
        out: dict[str, float] = {}
        for part in comm.allgather({k: float(np.median(v)) for k, v in times.items()}):
            out.update(part)
        return out

    # Warm-up, and a check that every schedule computes the reference's loss.
    losses = {name: warm_loss(name) for name in args.schedules}
    ref_value = comm.bcast(float(ref_loss) if rank == 0 else None, root=0)
    for name, value in losses.items():
        if not np.isclose(value, ref_value, rtol=1e-4):
            raise SystemExit(f"{name}: loss {value} differs from jax.jit's {ref_value}")
    run_reference()

    if args.tuned:  # each schedule again, lowered for its own measured task times
        for name in list(args.schedules):
            with jaxpp_mpi.collect_task_times_ms() as stats:
                for _ in range(3):
                    run_pipelined(name)
            tuned = jaxpp_mpi.mpmd_jit_with_loop(
                pipelined_step(scheds[name], n),
                mpmd_mesh=mesh,
                task_times_ms=gathered_medians(stats),
            ).compile(params, batch)
            if tuned.program() == compiled[name].program():
                if rank == 0:
                    print(f"{name}: the same program for its measured times", flush=True)
                continue
            tname = f"{name}+tuned"
            scheds[tname], compiled[tname] = scheds[name], tuned
            args.schedules.append(tname)
            if not np.isclose(value := warm_loss(tname), ref_value, rtol=1e-4):
                raise SystemExit(f"{tname}: loss {value} differs from jax.jit's {ref_value}")

    # Rounds: per schedule (rotated order) one plain step and one traced step (task by
    # task: its task times feed the prediction, its events the breakdown), then the
    # reference; so a noisy neighbour hurts every contender alike.
    steps: dict[str, list[float]] = {name: [] for name in args.schedules}
    dispatch: dict[str, list[float]] = {name: [] for name in args.schedules}
    task_times: dict[str, dict[str, list[float]]] = {name: {} for name in args.schedules}
    task_rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.schedules}
    parts: dict[str, list[dict[str, float]]] = {name: [] for name in args.schedules}
    last_events: dict[str, list] = {}
    jit_times: list[float] = []
    jit_both: list[float] = []
    for r in range(args.repeats):
        k = r % len(args.schedules)
        for name in args.schedules[k:] + args.schedules[:k]:

            def one(name=name):
                start = time.perf_counter()
                out = compiled[name](params, batch)
                dispatch[name].append((time.perf_counter() - start) * 1e3)
                jax.block_until_ready(
                    [
                        x.first_mpmd_replica
                        for x in jax.tree.leaves(out)
                        if x.is_partially_addressable
                    ]
                )

            steps[name].append(timed(one))
            with jaxpp_mpi.trace.record() as events:
                traced_ms = timed(lambda name=name: run_pipelined(name))
            this_round = {}
            for e in events:
                if e.cat == "task":
                    this_round[e.name] = (e.end_ns - e.start_ns) * 1e-6
                    task_times[name].setdefault(e.name, []).append(this_round[e.name])
            task_rounds[name].append(this_round)
            parts[name].append(breakdown(events, traced_ms, done[0], cost))
            last_events[name] = events
        # Co-run: the whole step on both ranks at once, each its own copy. A pipeline's
        # two ranks compute at the same time; on a machine whose cores share memory
        # bandwidth and cache, each then runs slower than one process alone.
        for reference, out in ((run_reference, jit_times), (run_reference_both, jit_both))[
            :: 1 if r % 2 == 0 else -1
        ]:
            out.append(timed(reference))
    jit_ms = float(np.median(jit_times))
    jit_both_ms = float(np.median(jit_both))
    # Alone: the best single-process jax.jit and torch pipelining, nothing else running.
    alone = alone_phase(args, comm, ref_value)

    results = {}
    for name in args.schedules:
        sched, exe = scheds[name], compiled[name]
        all_medians = gathered_medians(task_times[name])
        program = exe.program()
        per_exe = {}
        for g, entry in enumerate(comm.allgather(exe.cost_analysis()[rank])):
            per_exe[g] = entry["per_executable"]
        flop_ms = flop_task_ms(program, per_exe, jit_ms / jit_flops)
        latency = lambda run, m=all_medians: m.get(run.task, 0.0)  # noqa: E731
        # the runtime posts a CPU group's sends (Note: posted sends in mpi/posted.py)
        sends = "blocking" if name.endswith("+chained") else "posted"
        predicted = simulate(program, latency=latency, transfer=cost, check_leaks=False,
                             sends=sends)
        predicted_free = simulate(program, latency=latency, check_leaks=False, sends=sends)
        predicted_blocking = simulate(program, latency=latency, transfer=cost,
                                      check_leaks=False)
        rounds = round_times(comm.allgather(task_rounds[name]))
        round_predicted = [
            simulate(program, latency=lambda run, m=m: m.get(run.task, 0.0), transfer=cost,
                     check_leaks=False, sends=sends).makespan
            for m in rounds
        ]
        round_own = [schedule_makespan(sched, n, m, cost(act_aval)) for m in rounds]
        mine = {key: float(np.median([p[key] for p in parts[name]])) for key in parts[name][0]}
        mine["dispatch_untimed"] = float(np.median(dispatch[name]))
        per_rank = comm.gather(mine, root=0)
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            jaxpp_mpi.trace.export(
                os.path.join(args.traces, f"{name}.trace.json"),
                last_events[name],
                mesh,
                other_data={"schedule": repr(sched)},
            )
            if rank == 0:
                with open(os.path.join(args.traces, f"{name}.program.txt"), "w") as f:
                    f.write(str(program))
        if rank != 0:
            continue
        step_ms = float(np.median(steps[name]))
        factor = ideal_factor(sched, n)
        ideal_ms = jit_ms * factor
        sim_rank_busy = [
            sum(e.end - e.start for e in g if hasattr(e.instr, "exe")) for g in predicted.events
        ]
        bound_ms = schedule_makespan(sched, n, flop_ms, cost(act_aval))
        best_jit_ms = alone["jit_alone"].get("best_ms")
        torch_ms = torch_match(name, alone["torch_pipelining"])
        results[name] = {
            "schedule": repr(sched),
            "step_ms": step_ms,
            "step_ms_min": float(np.min(steps[name])),
            "step_ms_all": steps[name],
            "ideal_factor": factor,
            "ideal_ms": ideal_ms,
            "fraction_of_ideal": ideal_ms / step_ms,
            "best_jit_over_step": best_jit_ms / step_ms if best_jit_ms else None,
            "torch_schedule": torch_ms[0] if torch_ms else None,
            "torch_over_step": torch_ms[1] / step_ms if torch_ms else None,
            "ideal_corun_ms": jit_both_ms * factor,
            "fraction_of_ideal_corun": jit_both_ms * factor / step_ms,
            "sends": sends,
            "predicted_ms": float(np.median(round_predicted)),
            "predicted_ms_all": round_predicted,
            "predicted_of_medians_ms": predicted.makespan,
            "predicted_free_messages_ms": predicted_free.makespan,
            "predicted_blocking_sends_ms": predicted_blocking.makespan,
            "schedule_ms": float(np.median(round_own)),
            "schedule_of_medians_ms": schedule_makespan(sched, n, all_medians, cost(act_aval)),
            "overhead": step_ms / float(np.median(round_predicted)),
            "overhead_of_medians": step_ms / predicted.makespan,
            "flops_over_jit": sum(flop_ms.values()) / (jit_ms),
            "bound_ms": bound_ms,
            "fraction_at_bound": ideal_ms / bound_ms,
            "predicted_busy_ms": sim_rank_busy,
            "task_ms": all_medians,
            "task_sum_ms": task_sums(all_medians),
            "breakdown": per_rank,
            "instructions": [len(g.instrs) for g in program.groups],
        }

    if rank == 0:
        result = {
            "benchmark": "schedules",
            **metadata(),
            "ranks": 2,
            "quick": args.quick,
            "width": args.width,
            "ffn": args.ffn,
            "blocks": args.blocks,
            "rows": args.rows,
            "num_microbatches": n,
            "repeats": args.repeats,
            "jit_ms": jit_ms,
            "jit_ms_all": jit_times,
            "jit_both_ranks_ms": jit_both_ms,
            "jit_both_ranks_ms_all": jit_both,
            "corun_slowdown": jit_both_ms / jit_ms,
            **alone,
            "message_cost": {"latency_ms": cost.latency, "bytes_per_ms": cost.bandwidth},
            "p2p_rows": p2p_rows,
            "schedules": results,
        }
        write_json(args.out, result)
        print(
            f"jax.jit (1 thread): {jit_ms:.1f} ms alone, {jit_both_ms:.1f} ms on both ranks at "
            f"once; message model {cost.latency * 1e3:.1f} us"
            f" + bytes / {cost.bandwidth / 1e6:.2f} GB/s",
            flush=True,
        )
        print_alone(alone)
        print(
            f"{'schedule':<26} {'step':>8} {'ideal':>8} {'frac':>5} {'bjit':>5} {'torch':>5} "
            f"{'pred':>8} "
            f"{'ovh':>5} {'sched':>8} {'bound':>8} {'best':>5} {'co':>5}  per rank: "
            "compute/wait/other/idle_end ms (traced step)"
        )
        for name, r in results.items():
            parts = "  ".join(
                f"{b['compute']:.0f}/{b['message_wait']:.0f}/{b['other']:.0f}/{b['idle_end']:.0f}"
                for b in r["breakdown"]
            )
            print(
                f"{name:<26} {r['step_ms']:>8.1f} {r['ideal_ms']:>8.1f} "
                f"{r['fraction_of_ideal']:>5.2f} {ratio(r['best_jit_over_step'])} "
                f"{ratio(r['torch_over_step'])} {r['predicted_ms']:>8.1f} "
                f"{r['overhead']:>5.2f} {r['schedule_ms']:>8.1f} {r['bound_ms']:>8.1f} "
                f"{r['fraction_at_bound']:>5.2f} {r['fraction_of_ideal_corun']:>5.2f}  {parts}",
                flush=True,
            )
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
