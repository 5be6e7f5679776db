"""Pipeline replicas: what the cross-replica all-reduces cost, and how they overlap backward work.

Run with 4 ranks:
    launch/jpprun -n 4 .venv/bin/python bench/replicas.py --out bench/results/replicas.json

The workload is bench/schedules.py's (its functions, imported): residual blocks with
numpy-made weights, MSE loss, one step = forward, backward and gradient sums over the
microbatches, no optimizer; here smaller by default (d=512, ffn=2048, 8 blocks, 8
microbatches of 16 rows). Per schedule, three pipelines run in one 4-rank job, taking
turns round by round (each: a plain step and a traced step of every pipeline):
- `1x2`: one replica of 2 stages on ranks 0-1 (a communicator of its own; ranks 2-3
  wait): the 1-replica baseline, all 8 microbatches on one pipeline;
- `2x2`: 2 replicas x 2 stages on ranks 0-3, 4 microbatches each, the gradients and
  the loss combined by AllReduce instructions (`Note: replicas` in compiler/replicas.py);
- `1xS`: one replica of `--sim-stages` stages on S ranks (S = 4 by default), measured
  only for its task times, which the projection below uses.

Per rank of `2x2`, from one traced step per round (`Note: trace events`):
- bytes all-reduced (the "allreduce" events' `bytes`) against the parameter bytes of the
  stages the rank's group holds (numpy `nbytes` of their weights; the group of the last
  stage also combines the loss stack, one float32 per global microbatch), and the
  AllReduce count;
- per AllReduce on group g: its wall time, the fraction of that interval during which
  another group of the same replica runs a backward task (kind B, I or W; a fused task
  with a backward part counts), and its gap after group g's own last backward task;
- per AllReduce in group g's program: its index, the index of the group's last
  backward Run before it, and the backward Runs after it (0: it comes after all of them).

Then the simulator (`simulate`, `Note: message model` in ir/simulate.py): the `2x2`
program with its measured task times and the message model fitted to
`bench/results/p2p.json` (predicted vs measured step and AllReduce times), and a
projection: the program the compiler builds for `--sim-replicas` replicas of
`--sim-stages` stages with `--sim-microbatches` microbatches per replica (`build_step`
with `num_replicas`, the same function `compile()` calls: checked equal to the compiled
`2x2` program), every Run at the median measured time of its task on the `1xS`
pipeline, every message and every AllReduce (ring model) at the stated link
(`--bandwidth-gbs`, `--latency-us`). Its makespan with the reductions and without them
(the same program played with one replica: every AllReduce free), where each group's
reductions land, and the same for "before": the program with every AllReduce moved back
to right after the definition of its buffers (`at_definition`: where
`reductions.add_replica_reductions` put it before it learnt to let the sends that follow
the definition go first, `Note: replica reductions`).

Last, a sweep of the bucket size (`--sweep-buckets-mb`, 0: one AllReduce per task and
op, `bucket_bytes <= 0`) over replicas x stages layouts (`--sweep`, each RxS played with
the task times of the measured `1xS` pipeline): per size, the program `build_step`
builds with that `replica_bucket_bytes`, its AllReduces per step and largest bucket per
group (the bytes the runtime stages into one flat buffer, `Note: messages` in
runtime/mpi_messages.py), and the exposed reduction time.

Four ranks share the machine's cores here: step times are reported, but more ranks
cannot make a step faster on it, and no speed-up is claimed. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py, schedules.py

from _common import (  # noqa: E402
    add_block_options,
    block_options,
    load_message_cost,
    metadata,
    write_json,
)
from schedules import make_data, pipelined_step, reference_step  # noqa: E402

from jaxpp_mpi._src.ir.program import (  # noqa: E402
    AllReduce,
    GroupProgram,
    Instr,
    Program,
    Recv,
    Run,
    SendRecv,
)
from jaxpp_mpi._src.ir.simulate import (  # noqa: E402
    MessageCost,
    SimResult,
    aval_nbytes,
    simulate,
)
from jaxpp_mpi.schedules import schedule_by_name  # noqa: E402
from jaxpp_mpi.trace import TraceEvent, parse_label  # noqa: E402

BACKWARD_KINDS = frozenset({"B", "I", "W"})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_block_options(p, schedules=("gpipe", "1f1b", "zerobubble"), width=512, ffn=2048,
                      repeats=7, repeats_help="rounds", quick_help="d=256, ffn=1024, 3 rounds")
    p.add_argument("--p2p", default="bench/results/p2p.json",
                   help="bench/p2p.py JSON: the message model of this machine")
    p.add_argument("--sim-replicas", type=int, default=16)
    p.add_argument("--sim-stages", type=int, default=4,
                   help="groups per replica of the projection (also the 1xS pipeline measured)")
    p.add_argument("--sim-microbatches", type=int, default=8, help="per replica")
    p.add_argument("--bandwidth-gbs", type=float, default=25.0,
                   help="the projection's link: GB/s (1e9 bytes) per direction")
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument("--sweep", default="16x4,64x4,16x2,64x2",
                   help="comma-separated RxS layouts of the bucket sweep (S: 2 or --sim-stages)")
    p.add_argument("--sweep-buckets-mb", default="1,4,16,64,0",
                   help="bucket sizes in MiB (0: one AllReduce per task and op)")
    p.add_argument("--out", default="bench/results/replicas.json")
    args = block_options(p, p.parse_args(argv))
    try:
        args.sweep = [tuple(int(v) for v in x.split("x")) for x in args.sweep.split(",") if x]
        args.sweep_buckets_mb = [float(x) for x in args.sweep_buckets_mb.split(",") if x]
    except ValueError:
        p.error(f"--sweep wants RxS layouts (16x4,64x4), --sweep-buckets-mb numbers; got "
                f"{args.sweep!r}, {args.sweep_buckets_mb!r}")
    bad = [f"{r}x{s}" for r, s in args.sweep if r < 2 or s not in (2, args.sim_stages)]
    if bad:
        p.error(f"--sweep layouts {bad}: R >= 2 replicas and S stages, S 2 or --sim-stages "
                f"({args.sim_stages}): the measured pipelines' task times")
    return args


# ----------------------------------------------------------------------------- analysis


def is_backward(label: str) -> bool:
    """Whether a task label has a backward part (B, I or W; fused ones included)."""
    return any(p.kind in BACKWARD_KINDS for p in parse_label(label))


def covered(start: float, end: float, intervals: Sequence[tuple[float, float]]) -> float:
    """How much of [start, end) the union of `intervals` covers (any time unit)."""
    clipped = sorted((max(s, start), min(e, end)) for s, e in intervals if s < end and e > start)
    total, reach = 0, start
    for s, e in clipped:
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def group_stages(sched, num_microbatches: int) -> list[set[int]]:
    """Per group, the stages whose tasks its schedule rows hold."""
    return [{t.stage_id for e in row for t in (e if isinstance(e, tuple) else (e,))}
            for row in sched.tasks(num_microbatches)]


def stage_param_bytes(np_params, stages: set[int], num_stages: int) -> int:
    """Bytes of the weights of `stages` (numpy `nbytes`), blocks split evenly."""
    per_stage = len(np_params) // num_stages
    return sum(int(w.nbytes) for s in stages for p in np_params[s * per_stage:(s + 1) * per_stage]
               for w in p.values())


def program_positions(group: GroupProgram) -> list[dict[str, Any]]:
    """Per AllReduce of a group program: where it sits among the group's backward Runs."""
    backward = [i for i, x in enumerate(group.instrs) if isinstance(x, Run) and is_backward(x.task)]
    out = []
    for i, x in enumerate(group.instrs):
        if isinstance(x, AllReduce):
            before = [j for j in backward if j < i]
            out.append({
                "index": i,
                "bufs": len(x.bufs),
                "last_backward_before": before[-1] if before else None,
                "last_backward_task": group.instrs[before[-1]].task if before else None,
                "instructions_since": i - before[-1] if before else None,
                "backward_runs_after": sum(1 for j in backward if j > i),
                "length": len(group.instrs),
            })
    return out


def definitions(group: GroupProgram) -> dict[int, list[int]]:
    """Buffer -> the positions defining it in `group.instrs`: -1 for an input binding,
    else the index of the Run, Recv or SendRecv whose output or received buffer it is."""
    defs: dict[int, list[int]] = {}
    for b, _ in group.inputs:
        defs.setdefault(b, []).append(-1)
    for i, x in enumerate(group.instrs):
        if isinstance(x, Run):
            outs: tuple[int, ...] = x.outs
        elif isinstance(x, Recv):
            outs = (x.buf,)
        elif isinstance(x, SendRecv):
            outs = (x.recv_buf,)
        else:
            continue
        for b in outs:
            defs.setdefault(b, []).append(i)
    return defs


def at_definition(program: Program) -> Program:
    """The "before" what-if: every AllReduce moved back to right after the definition of
    its buffers, ahead of the sends and frees that follow it.

    That is where `reductions.add_replica_reductions` placed them before commit 1fe32ea
    (`Note: replica reductions`): on a group that sends an input gradient right after its
    last backward task, the reduction then runs before that send and the previous group's
    last backward waits for it. The AllReduces after one definition keep their order in
    `program`. The result is verified.

    Raises:
      ValueError: for an AllReduce whose buffers are not all defined exactly once, by
        one instruction.
    """
    from jaxpp_mpi._src.ir.simulate import verify

    groups = []
    for g in program.groups:
        rest = [x for x in g.instrs if not isinstance(x, AllReduce)]
        defs = definitions(dataclasses.replace(g, instrs=tuple(rest)))
        after: dict[int, list[AllReduce]] = {}
        for x in g.instrs:
            if isinstance(x, AllReduce):
                where = {tuple(defs.get(b, ())) for b in x.bufs}
                if len(where) != 1 or len(next(iter(where))) != 1:
                    raise ValueError(f"group {g.mpmd_idx}: {x} reduces buffers not defined "
                                     f"once by one instruction ({where})")
                after.setdefault(next(iter(where))[0], []).append(x)
        instrs: list[Instr] = list(after.get(-1, ()))
        for i, x in enumerate(rest):
            instrs.append(x)
            instrs.extend(after.get(i, ()))
        groups.append(dataclasses.replace(g, instrs=tuple(instrs)))
    out = dataclasses.replace(program, groups=tuple(groups))
    verify(out, check_leaks=False)
    return out


def allreduce_overlap(events: Sequence[Sequence[TraceEvent]], num_groups: int
                      ) -> list[dict[str, Any]]:
    """Per "allreduce" event of a traced step (events per world rank, rank = replica x
    num_groups + group): its time, the fraction of it during which another group of the
    same replica runs a backward task, and its gap after its own group's last backward."""
    out = []
    for rank, mine in enumerate(events):
        replica, group = divmod(rank, num_groups)
        others = [(e.start_ns, e.end_ns) for h in range(num_groups) if h != group
                  for e in events[replica * num_groups + h]
                  if e.cat == "task" and is_backward(e.name)]
        own_bwd = [e.end_ns for e in mine if e.cat == "task" and is_backward(e.name)]
        for e in mine:
            if e.name != "allreduce":
                continue
            dur = e.end_ns - e.start_ns
            before = [t for t in own_bwd if t <= e.start_ns]
            out.append({
                "rank": rank, "replica": replica, "group": group,
                "bytes": int(e.args["bytes"]), "ms": dur * 1e-6,
                "overlap_backward_elsewhere": covered(e.start_ns, e.end_ns, others) / dur
                if dur else 0.0,
                "gap_after_own_last_backward_ms": (e.start_ns - max(before)) * 1e-6
                if before else None,
            })
    return out


def rank_rows(rounds: Sequence[Sequence[dict[str, Any]]], counts: Sequence[Sequence[int]],
              num_groups: int, param_bytes: Sequence[int], loss_bytes: Sequence[int]
              ) -> list[dict[str, Any]]:
    """Per world rank of a replicated pipeline, its AllReduces over the traced steps.

    Args:
      rounds: per traced step, `allreduce_overlap` of it.
      counts: per traced step, the number of "allreduce" events per world rank.
      num_groups: groups per replica.
      param_bytes: per group, the weights' bytes of its stages.
      loss_bytes: per group, the bytes of the loss stack it all-reduces besides (0 or
        the stack's).

    Returns:
      Per rank: bytes all-reduced per step and the expected bytes, AllReduces per step,
      and per AllReduce (k-th of the step) medians of its time, overlap and gap.
    """
    import numpy as np

    def median(xs):
        xs = [x for x in xs if x is not None]
        return float(np.median(xs)) if xs else None

    out = []
    for rk in range(len(counts[0])):
        g = rk % num_groups
        steps = [[a for a in one if a["rank"] == rk] for one in rounds]
        per_k = list(zip(*steps))  # the k-th AllReduce of every traced step
        out.append({
            "rank": rk, "replica": rk // num_groups, "group": g,
            "param_bytes": param_bytes[g],
            "expected_bytes": param_bytes[g] + loss_bytes[g],
            "allreduced_bytes_per_step": sorted({sum(a["bytes"] for a in st) for st in steps}),
            "allreduces_per_step": sorted({c[rk] for c in counts}),
            "allreduce_ms_per_step": median([sum(a["ms"] for a in st) for st in steps]),
            "allreduces": [{
                "bytes": ks[0]["bytes"],
                "ms": median([a["ms"] for a in ks]),
                "overlap_backward_elsewhere": median(
                    [a["overlap_backward_elsewhere"] for a in ks]),
                "gap_after_own_last_backward_ms": median(
                    [a["gap_after_own_last_backward_ms"] for a in ks]),
            } for ks in per_k],
        })
    return out


def sim_overlap(result: SimResult, program: Program) -> list[dict[str, Any]]:
    """`allreduce_overlap` for a simulated step (one replica stands for all)."""
    out = []
    for g, events in enumerate(result.events):
        others = [(e.start, e.end) for h, evs in enumerate(result.events) if h != g
                  for e in evs if e.kind == "task" and is_backward(e.instr.task)]
        own_bwd = [e.end for e in events if e.kind == "task" and is_backward(e.instr.task)]
        group = program.group(g)
        for e in events:
            if e.kind != "allreduce":
                continue
            dur = e.end - e.start
            before = [t for t in own_bwd if t <= e.start]
            out.append({
                "group": g, "index": e.index,
                "bytes": sum(aval_nbytes(group.aval(b)) for b in e.instr.bufs),
                "start_ms": e.start, "ms": dur,
                "overlap_backward_elsewhere": covered(e.start, e.end, others) / dur
                if dur else 0.0,
                "gap_after_own_last_backward_ms": e.start - max(before) if before else None,
                "last_backward_end_ms": max(own_bwd) if own_bwd else None,
            })
    return out


def part_medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Median time per task part (kind and stage, over microbatches) or segment label.

    Fused labels are left out (the schedules measured here fuse nothing); `run_latency`
    times a fused Run as the sum of its parts."""
    import numpy as np

    per: dict[str, list[float]] = {}
    for label, ts in times.items():
        parts = parse_label(label)
        if len(parts) == 1:
            p = parts[0]
            key = label if p.microbatch is None else f"{p.kind}s{p.stage}"
            per.setdefault(key, []).extend(ts)
    return {k: float(np.median(v)) for k, v in per.items()}


def run_latency(medians: dict[str, float]):
    """A `simulate` latency: a Run's time from its parts' medians (`part_medians`)."""

    def latency(run: Run) -> float:
        if run.task in medians:
            return medians[run.task]
        return sum(medians.get(f"{p.kind}s{p.stage}", 0.0) for p in parse_label(run.task))

    return latency


def allreduce_nbytes(program: Program) -> list[int]:
    """Per group, the bytes its AllReduce instructions combine."""
    return [sum(aval_nbytes(g.aval(b)) for x in g.instrs if isinstance(x, AllReduce)
                for b in x.bufs) for g in program.groups]


def sim_summary(program: Program, latency, cost: MessageCost, replicas: int) -> dict[str, Any]:
    """Makespan with the reductions (`replicas`) and without (1), and where they land."""
    with_r = simulate(program, latency=latency, transfer=cost, replicas=replicas,
                      check_leaks=False)
    without = simulate(program, latency=latency, transfer=cost, check_leaks=False)
    overlap = sim_overlap(with_r, program)
    per_group = [sum(o["ms"] for o in overlap if o["group"] == g)
                 for g in range(program.num_groups)]
    exposed = with_r.makespan - without.makespan
    return {
        "replicas": replicas,
        "makespan_ms": with_r.makespan,
        "makespan_no_reductions_ms": without.makespan,
        "exposed_ms": exposed,
        "allreduce_ms_per_group": per_group,
        "allreduce_bytes_per_group": allreduce_nbytes(program),
        "hidden_fraction": 1.0 - exposed / max(per_group) if max(per_group) > 0 else None,
        "finish_ms": list(with_r.finish),
        "allreduces": overlap,
    }


def bucket_row(program: Program, latency, cost: MessageCost, replicas: int
               ) -> dict[str, Any]:
    """One size of the bucket sweep: per group the AllReduces per step and the largest
    one's bytes (what the runtime stages at once), and `sim_summary`'s times."""
    counts, largest = [], []
    for g in program.groups:
        sizes = [sum(aval_nbytes(g.aval(b)) for b in x.bufs) for x in g.instrs
                 if isinstance(x, AllReduce)]
        counts.append(len(sizes))
        largest.append(max(sizes, default=0))
    summary = sim_summary(program, latency, cost, replicas)
    return {
        "allreduces_per_group": counts,
        "largest_allreduce_bytes_per_group": largest,
        "allreduce_bytes_per_group": summary["allreduce_bytes_per_group"],
        "makespan_ms": summary["makespan_ms"],
        "makespan_no_reductions_ms": summary["makespan_no_reductions_ms"],
        "exposed_ms": summary["exposed_ms"],
        "allreduce_ms_per_group": summary["allreduce_ms_per_group"],
    }


# ----------------------------------------------------------------------------- the run


class Pipeline:
    """One measured pipeline of the job: `replicas` x `groups` ranks from world rank 0."""

    def __init__(self, name: str, replicas: int, groups: int, world):
        import jaxpp_mpi

        self.name, self.replicas, self.groups = name, replicas, groups
        self.size = replicas * groups
        member = world.rank < self.size
        comm = world.Split(0 if member else 1, world.rank)
        self.mesh = None
        if member:
            self.mesh = jaxpp_mpi.make_mpmd_mesh(
                (replicas, groups, 1), ("replica", "stage", "data"), "stage", comm=comm,
                replica_axis_name="replica")

    @property
    def member(self) -> bool:
        return self.mesh is not None


def main() -> None:
    args = parse_args()
    import jax
    import numpy as np
    from mpi4py import MPI

    import jaxpp_mpi
    from jaxpp_mpi._src.base import config
    from jaxpp_mpi._src.compiler.build import build_step

    world = MPI.COMM_WORLD
    if world.size != 4:
        raise SystemExit(f"bench/replicas.py runs on exactly 4 ranks, got {world.size}")
    rank = world.rank
    n, s = args.num_microbatches, args.sim_stages
    if s > world.size:
        raise SystemExit(f"--sim-stages {s} needs {s} ranks; the job has {world.size}")
    np_params, np_batch = make_data(args)
    params = jax.tree.map(jax.numpy.asarray, np_params)
    batch = jax.tree.map(jax.numpy.asarray, np_batch)
    p2p_cost = load_message_cost(args.p2p)  # bytes per ms
    link = MessageCost(latency=args.latency_us * 1e-3, bandwidth=args.bandwidth_gbs * 1e6)
    bucket = config.options().replica_bucket_bytes

    pipelines = [Pipeline("1x2", 1, 2, world), Pipeline("2x2", 2, 2, world)]
    if s != 2:
        pipelines.append(Pipeline(f"1x{s}", 1, s, world))
    num_groups = {pl.name: pl.groups for pl in pipelines}
    # The loss stack (treduce's default for a per-microbatch scalar: one entry per global
    # microbatch, combined across replicas by a bitwise OR): the last stage's group
    # all-reduces it besides its gradients.
    loss_aval = jax.eval_shape(pipelined_step(schedule_by_name("1f1b", 2), n), params, batch)[0]
    loss_bytes = int(np.prod(loss_aval.shape)) * np.dtype(loss_aval.dtype).itemsize
    ref = None
    if rank == 0:
        ref = jax.jit(reference_step(n)).lower(params, batch).compile()
        ref_loss = float(jax.block_until_ready(ref(params, batch))[0])

    compiled: dict[tuple[str, str], Any] = {}
    scheds: dict[tuple[str, str], Any] = {}
    for name in args.schedules:
        for pl in pipelines:
            sched = schedule_by_name(name, pl.groups)
            if args.blocks % sched.num_stages:
                raise SystemExit(f"{args.blocks} blocks do not split into {sched.num_stages} "
                                 "stages")
            scheds[name, pl.name] = sched
            if pl.member:
                start = time.perf_counter()
                compiled[name, pl.name] = jaxpp_mpi.mpmd_jit_with_loop(
                    pipelined_step(sched, n), mpmd_mesh=pl.mesh).compile(params, batch)
                if rank == 0:
                    print(f"compiled {name} {pl.name} in {time.perf_counter() - start:.1f} s",
                          flush=True)

    def run(key) -> float | None:
        exe = compiled.get(key)
        if exe is None:
            return None
        losses, grads = exe(params, batch)
        jax.block_until_ready([x.first_mpmd_replica for x in jax.tree.leaves((losses, grads))
                               if x.is_partially_addressable])
        if losses.is_partially_addressable:
            return float(np.asarray(losses.first_mpmd_replica).sum())
        return None

    def timed(key) -> float:
        world.Barrier()
        start = time.perf_counter()
        run(key)
        world.Barrier()
        return (time.perf_counter() - start) * 1e3

    # Warm-up, and every pipeline's loss against jax.jit's on every rank that holds it.
    keys = list(compiled) if rank == 0 else None
    keys = [tuple(k) for k in world.bcast(keys, root=0)]
    for key in keys:
        run(key)
        got = world.gather(run(key), root=0)
        if rank == 0:
            bad = [v for v in got if v is not None and not np.isclose(v, ref_loss, rtol=1e-4)]
            if bad or all(v is None for v in got):
                raise SystemExit(f"{key}: losses {got} differ from jax.jit's {ref_loss}")

    steps: dict[tuple, list[float]] = {k: [] for k in keys}
    traced: dict[tuple, list[float]] = {k: [] for k in keys}
    task_times: dict[tuple, dict[str, list[float]]] = {k: {} for k in keys}
    rounds: dict[tuple, list[list[dict[str, Any]]]] = {k: [] for k in keys}
    counts: dict[tuple, list[list[int]]] = {k: [] for k in keys}
    for r in range(args.repeats):
        k = r % len(keys)
        for key in keys[k:] + keys[:k]:
            steps[key].append(timed(key))
            with jaxpp_mpi.trace.record() as events:
                traced[key].append(timed(key))
            for e in events:
                if e.cat == "task":
                    task_times[key].setdefault(e.name, []).append((e.end_ns - e.start_ns) * 1e-6)
            everyone = world.gather(events, root=0)
            if rank == 0:
                rounds[key].append(allreduce_overlap(everyone, num_groups[key[1]]))
                counts[key].append([sum(1 for e in evs if e.name == "allreduce")
                                    for evs in everyone])

    results: dict[str, Any] = {}
    for key in keys:
        name, pl_name = key
        pl = next(p for p in pipelines if p.name == pl_name)
        merged: dict[str, list[float]] = {}
        for part in world.allgather(task_times[key]):
            for label, ts in part.items():
                merged.setdefault(label, []).extend(ts)
        if rank != 0:
            continue
        sched = scheds[key]
        program = compiled[key].program()
        medians = part_medians(merged)
        stages = group_stages(sched, n // pl.replicas)
        last = sched.num_stages - 1
        entry: dict[str, Any] = {
            "schedule": repr(sched),
            "replicas": pl.replicas,
            "groups": pl.groups,
            "ranks": pl.size,
            "microbatches_per_replica": n // pl.replicas,
            "step_ms": float(np.median(steps[key])),
            "step_ms_all": steps[key],
            "traced_step_ms": float(np.median(traced[key])),
            "task_part_ms": medians,
            "instructions": [len(g.instrs) for g in program.groups],
        }
        if pl.replicas > 1:
            expected = [stage_param_bytes(np_params, stages[g], sched.num_stages)
                        for g in range(pl.groups)]
            per_rank = rank_rows(rounds[key], counts[key], pl.groups, expected,
                                 [loss_bytes if last in st else 0 for st in stages])
            for row in per_rank:
                row["stages"] = sorted(stages[row["group"]])
            entry["per_rank"] = per_rank
            entry["program_positions"] = [program_positions(g) for g in program.groups]
            # The simulator on this machine: measured task times, the p2p message model.
            check = sim_summary(program, run_latency(medians), p2p_cost, pl.replicas)
            entry["predicted_here"] = {
                "step_ms": check["makespan_ms"],
                "step_no_reductions_ms": check["makespan_no_reductions_ms"],
                "allreduce_ms_per_group": check["allreduce_ms_per_group"],
                "measured_traced_step_ms": entry["traced_step_ms"],
                "measured_allreduce_ms_per_group": [
                    float(np.median([p["allreduce_ms_per_step"] for p in per_rank
                                     if p["group"] == g])) for g in range(pl.groups)],
            }
            # build_step (used for the projection) builds the program compile() runs.
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    (params, batch))
            rebuilt = build_step(pipelined_step(sched, n), abstract, pl.groups,
                                 num_replicas=pl.replicas, replica_bucket_bytes=bucket).program
            entry["build_step_matches_compiled"] = rebuilt == program
        results[f"{name} {pl_name}"] = entry

    if rank != 0:
        return

    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)

    def project(name: str, replicas: int, stages: int, bucket_bytes: float) -> Program:
        """The program compile() builds for `replicas` x `stages`, `--sim-microbatches`
        per replica, with AllReduces of at most `bucket_bytes`."""
        global_n = replicas * args.sim_microbatches
        big_batch = tuple(jax.ShapeDtypeStruct((global_n, *x.shape[1:]), x.dtype)
                          for x in batch)
        return build_step(pipelined_step(schedule_by_name(name, stages), global_n),
                          (abstract_params, big_batch), stages, num_replicas=replicas,
                          replica_bucket_bytes=bucket_bytes).program

    # The projection: sim_replicas x sim_stages, task times of the measured 1xS pipeline;
    # "now" is the compiled program, "before" the what-if `at_definition` of it.
    projection = {}
    for name in args.schedules:
        latency = run_latency(results[f"{name} 1x{s}"]["task_part_ms"])
        sched = schedule_by_name(name, s)
        start = time.perf_counter()
        program = project(name, args.sim_replicas, s, bucket)
        build_s = time.perf_counter() - start
        summary = sim_summary(program, latency, link, args.sim_replicas)
        summary["program_positions"] = [program_positions(g) for g in program.groups]
        summary["build_s"] = build_s
        before = at_definition(program)
        summary["before"] = sim_summary(before, latency, link, args.sim_replicas)
        summary["before"]["program_positions"] = [program_positions(g) for g in before.groups]
        summary["param_bytes_per_group"] = [
            stage_param_bytes(np_params, st, sched.num_stages)
            for st in group_stages(sched, args.sim_microbatches)]
        projection[name] = summary

    # The bucket sweep: per layout and size, the compiled program's AllReduces and cost.
    sweep: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for name in args.schedules:
        sweep[name] = {}
        for replicas, stages in args.sweep:
            latency = run_latency(results[f"{name} 1x{stages}"]["task_part_ms"])
            rows = []
            for mb in args.sweep_buckets_mb:
                program = project(name, replicas, stages, mb * (1 << 20))
                rows.append({"bucket_mb": mb, **bucket_row(program, latency, link, replicas)})
            sweep[name][f"{replicas}x{stages}"] = rows
            print(f"swept {name} {replicas}x{stages}", flush=True)

    result = {
        "benchmark": "replicas",
        **metadata(),
        "ranks": world.size,
        "quick": args.quick,
        "width": args.width, "ffn": args.ffn, "blocks": args.blocks, "rows": args.rows,
        "num_microbatches": n,
        "repeats": args.repeats,
        "replica_bucket_bytes": bucket,
        "p2p_message_cost": {"source": args.p2p, "latency_ms": p2p_cost.latency,
                             "bytes_per_ms": p2p_cost.bandwidth},
        "projection_link": {"bandwidth_gbs": args.bandwidth_gbs, "latency_us": args.latency_us,
                            "replicas": args.sim_replicas, "stages": s,
                            "microbatches_per_replica": args.sim_microbatches,
                            "allreduce_model": "ring: 2(R-1)/R bytes/bandwidth + 2(R-1) latency"},
        "jit_loss": ref_loss,
        "loss_stack_bytes": loss_bytes,
        "pipelines": results,
        "projection": projection,
        "bucket_sweep": {"buckets_mb": args.sweep_buckets_mb,
                         "layouts": [f"{r}x{st}" for r, st in args.sweep], "rows": sweep},
    }
    write_json(args.out, result)
    report(result)
    print(f"wrote {args.out}", flush=True)


def report(result: dict[str, Any]) -> None:
    """Prints what bench/README.md's `bench/replicas.py` section tabulates."""
    print(f"{'pipeline':<18} {'step ms':>8} {'traced':>8}")
    for key, e in result["pipelines"].items():
        print(f"{key:<18} {e['step_ms']:>8.1f} {e['traced_step_ms']:>8.1f}", flush=True)
        for p in e.get("per_rank", []):
            ars = "; ".join(
                f"{a['bytes']} B {a['ms']:.1f} ms overlap {a['overlap_backward_elsewhere']:.2f}"
                for a in p["allreduces"])
            print(f"    rank {p['rank']} group {p['group']}: {p['allreduced_bytes_per_step']} "
                  f"of {p['expected_bytes']} B expected, {p['allreduces_per_step']} "
                  f"all-reduces: {ars}", flush=True)
        if "predicted_here" in e:
            h = e["predicted_here"]
            print(f"    predicted here {h['step_ms']:.1f} ms (without reductions "
                  f"{h['step_no_reductions_ms']:.1f}); all-reduce ms predicted "
                  f"{[round(x, 1) for x in h['allreduce_ms_per_group']]}, measured "
                  f"{[round(x, 1) for x in h['measured_allreduce_ms_per_group']]}", flush=True)
    link = result["projection_link"]
    print(f"projection: {link['replicas']} replicas x {link['stages']} stages, "
          f"{link['microbatches_per_replica']} microbatches each, {link['bandwidth_gbs']} GB/s, "
          f"{link['latency_us']} us")
    for name, p in result["projection"].items():
        b = p["before"]
        print(f"{name:<12} no reductions {p['makespan_no_reductions_ms']:.2f} ms; before "
              f"{b['makespan_ms']:.2f} (exposed {b['exposed_ms']:.2f}), now "
              f"{p['makespan_ms']:.2f} (exposed {p['exposed_ms']:.2f}); all-reduce ms per "
              f"group {[round(x, 2) for x in p['allreduce_ms_per_group']]}", flush=True)
    print("bucket sweep: exposed ms (all-reduces per step, largest group's) per bucket MiB")
    for name, layouts in result["bucket_sweep"]["rows"].items():
        for layout, rows in layouts.items():
            cells = "; ".join(f"{r['bucket_mb']:g}: {r['exposed_ms']:.2f} "
                              f"({sum(r['allreduces_per_group'])}, "
                              f"{max(r['largest_allreduce_bytes_per_group']) / (1 << 20):.1f} MiB)"
                              for r in rows)
            print(f"{name:<12} {layout:<6} {cells}", flush=True)

if __name__ == "__main__":
    main()
