"""bench/gpu.py --pipeline: the pipelined step on two ranks sharing one GPU, against
`jax.jit` of the same step on rank 0 (see bench/gpu.py's docstring)."""

from __future__ import annotations

import time
from typing import Any

from _common import write_json
from _gpt import (
    LOSS_TOLERANCE,
    Clock,
    bf16_loss,
    config,
    copy_tree,
    counts,
    header,
    initial_state,
    loss_value,
    median,
    peak_bytes,
    ready,
    scan_train_step,
)
from _replay import Compiler

from jaxpp_mpi._src.timeline.timing import message_overlap
from jaxpp_mpi.schedules import schedule_by_name


def traced_summary(events: list, wall_ms: float) -> dict[str, Any]:
    """One rank's traced step: its message calls' and tasks' summed wall time (ms), and
    per group the message time and the share of it hidden behind tasks (`message_overlap`:
    with staged messages the sender and receiver threads' copies and transfers)."""
    spans = {"message": [], "task": []}
    for e in events:
        if e.cat in spans:
            spans[e.cat].append((e.end_ns - e.start_ns) * 1e-6)
    nbytes = sum(sum(b for b in (e.args.get("bytes"), e.args.get("send_bytes"),
                                 e.args.get("recv_bytes")) if b)
                 for e in events if e.cat == "message")
    overlap = {str(g): v for g, v in message_overlap(events).items()}
    return {"wall_ms": wall_ms, "message_ms": sum(spans["message"]), "overlap": overlap,
            "messages": len(spans["message"]), "message_bytes": nbytes,
            "task_ms": sum(spans["task"]), "tasks": len(spans["task"])}


class JitSide:
    """Rank 0's `jax.jit` of the whole step, compiled on a thread (while the first
    schedule compiles), then run on its own results.

    Attributes:
      loss: the first step's loss (after `start`); ms: the timed steps (ms);
      peak_bytes: the device's peak after the first two steps.
    """

    def __init__(self, step, state, batch):
        self.future = Compiler(1).submit(step.lower(*state, batch))
        self.state, self.batch = copy_tree(state), batch
        self.loss: float | None = None
        self.compile_s = 0.0
        self.peak_bytes: int | None = None
        self.ms: list[float] = []

    def start(self) -> float:
        """Waits for the compile, then runs the first step (its loss kept) and one more."""
        if self.loss is None:
            self.compiled, self.compile_s = self.future.result()
            self.loss = loss_value(self())
            self()
            self.peak_bytes = peak_bytes()
        return self.loss

    def __call__(self):
        *state, loss = self.compiled(*self.state, self.batch)
        self.state = ready(tuple(state))
        return ready(loss)


def run_schedule(args, clock: Clock, mesh, name: str, cfg, optimizer, state, batch,
                 jit: JitSide | None) -> dict[str, Any]:
    """One schedule's pipelined steps, taking turns with `jit` (rank 0's; None on rank
    1, which waits at a barrier meanwhile). Returns the schedule's row (on rank 0 with
    every rank's traced step and the comparison with jit)."""
    import train

    import jaxpp_mpi

    comm = mesh.comm
    sched = schedule_by_name(name, 2)
    clock.log(f"{name}: compiling {sched!r}")
    start = time.perf_counter()
    step = jaxpp_mpi.mpmd_jit_with_loop(
        train.make_train_step(bf16_loss(cfg, sched.num_stages), sched, optimizer),
        mpmd_mesh=mesh, donate_argnums=(0, 1)).compile(*state, batch)
    compile_s = time.perf_counter() - start
    pipe_state = copy_tree(state)
    dispatch: list[float] = []

    def run_pipe(timed_dispatch: bool = False):
        nonlocal pipe_state
        t0 = time.perf_counter()
        opt_state, params, loss = step(*pipe_state, batch)
        if timed_dispatch:
            dispatch.append((time.perf_counter() - t0) * 1e3)
        pipe_state = ready((opt_state, params))
        ready(loss)
        return loss

    def timed(fn) -> float:  # barrier to barrier, ms
        comm.Barrier()
        start = time.perf_counter()
        fn()
        comm.Barrier()
        return (time.perf_counter() - start) * 1e3

    if jit is not None:
        jit.start()
    comm.Barrier()  # rank 1 waits here while rank 0 finishes jit's compile
    out = run_pipe()  # the loss lives on the last stage's rank
    loss = comm.bcast(loss_value(out), root=min(out.mpmd_idxs))
    run_pipe()
    step_ms: list[float] = []
    jit_ms: list[float] = []
    for _ in range(args.steps):  # taking turns with jit (rank 0; rank 1 waits)
        step_ms.append(timed(lambda: run_pipe(True)))
        ms = timed(jit or (lambda: None))
        if jit is not None:
            jit_ms.append(ms)
    with jaxpp_mpi.trace.record() as events:
        traced_ms = timed(run_pipe)
    mine = {"rank": comm.rank, "dispatch_ms": median(dispatch), "peak_bytes": peak_bytes(),
            **traced_summary(events, traced_ms)}
    per_rank = comm.gather(mine, root=0)
    row = {"schedule": repr(sched), "step_ms": median(step_ms), "step_ms_all": step_ms,
           "loss": loss, "compile_s": compile_s, "traced": per_rank,
           **counts(step.program())}
    if jit is not None:
        jit.ms += jit_ms
        row.update(jit_ms=median(jit_ms), jit_ms_all=jit_ms, loss_diff=abs(loss - jit.loss))
        row["ratio"] = row["step_ms"] / row["jit_ms"]
        clock.log(f"{name}: compiled in {compile_s:.1f}s; first-step loss {loss:.5f}, "
                  f"|diff| vs jit {row['loss_diff']:.3g} (tolerance {LOSS_TOLERANCE}); "
                  f"step {row['step_ms']:.2f} ms, jit {row['jit_ms']:.2f} ms, ratio "
                  f"{row['ratio']:.3f}; message ms per rank "
                  + ", ".join(f"{r['message_ms']:.1f}" for r in per_rank))
    return row


def pipeline_main(args) -> int:
    """The two-rank part; rank 0 writes the JSON and prints the table. Returns the exit
    status (1 when a loss is past its tolerance)."""
    import jax
    import optax
    import train

    import jaxpp_mpi

    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    comm = mesh.comm
    if comm.size != 2:
        raise SystemExit(f"bench/gpu.py --pipeline runs on 2 ranks, got {comm.size}")
    rank = comm.rank
    clock = Clock(quiet=rank != 0)
    result = header(args, "pipeline")
    result.update(ranks=2, schedules={})
    cfg, optimizer = config(args.sizes, args.fused_attention), optax.adam(args.lr)
    state = initial_state(cfg, optimizer)
    batch = train.synthetic_batch(cfg, args.num_microbatches, args.microbatch_size)
    ok = True
    jit = None
    if rank == 0:
        clock.log(f"{jax.devices()[0]}: jax.jit's step compiling on rank 0 meanwhile")
        jit = JitSide(jax.jit(scan_train_step(bf16_loss(cfg, 1), optimizer,
                                              args.num_microbatches), donate_argnums=(0, 1)),
                      state, batch)
    for name in args.schedules:
        if comm.bcast(clock.elapsed() > args.budget_s, root=0):
            result.setdefault("skipped", {})[name] = f"past --budget-s {args.budget_s}"
            continue
        row = run_schedule(args, clock, mesh, name, cfg, optimizer, state, batch, jit)
        if rank == 0:
            ok &= row["loss_diff"] <= LOSS_TOLERANCE
            result["schedules"][name] = row
            result.update(jit_loss=jit.loss, jit_compile_s=jit.compile_s,
                          jit_peak_bytes=jit.peak_bytes)
            write_json(args.out, result)
    if rank != 0:
        return 0
    result.update(complete=True, losses_match=ok, wall_s=clock.elapsed(),
                  jit_ms=median(jit.ms), jit_ms_all=jit.ms)
    write_json(args.out, result)
    print(f"device {result['device']}; sizes {result['sizes']}"
          + (" (REDUCED)" if result["reduced"] else "") + "; 2 ranks, one group each")
    print(f"{'schedule':<12} {'step ms':>9} {'jit ms':>8} {'ratio':>6} {'loss diff':>9} "
          f"{'exe/mb':>9} {'msg ms r0/r1':>13} {'dispatch r0/r1':>15}")
    for name, r in result["schedules"].items():
        per = "/".join(f"{v:g}" for v in r["executables_per_microbatch"].values())
        msg = "/".join(f"{t['message_ms']:.1f}" for t in r["traced"])
        dis = "/".join(f"{t['dispatch_ms']:.1f}" for t in r["traced"])
        print(f"{name:<12} {r['step_ms']:>9.2f} {r['jit_ms']:>8.2f} {r['ratio']:>6.3f} "
              f"{r['loss_diff']:>9.2g} {per:>9} {msg:>13} {dis:>15}")
    for key, why in result.get("skipped", {}).items():
        print(f"skipped {key}: {why}")
    print(f"wrote {args.out} after {clock.elapsed():.0f} s" + ("" if ok else
          "; LOSS MISMATCH against jax.jit"), flush=True)
    return 0 if ok else 1
