"""The runtime at depth: each rank's CPU per instruction of a 16-group 1F1B step as the
microbatch count grows, against the same executables replayed without the runtime.

Run under MPI, one group per rank (rank 0 writes the JSON and prints a line per count):

    launch/jpprun -n 16 .venv/bin/python bench/depth.py \
        [--microbatches 16,32,64,128,256] [--steps 3] [--profile] [--out FILE.json]

The workload is examples/train.py's tiny transformer (hidden 32, one block per stage,
2 sequences of 8 tokens a microbatch), 1F1B over as many groups as ranks. Per
microbatch count M it is compiled once (JAX's compilation cache in
$TMPDIR/jaxpp_mpi_bench_depth_cache, shared by the ranks, the counts and later runs,
so the same stage compiles once), run once (the first step, untimed) and then
`--steps` times. Per rank and step:

- `step_cpu_s`: the process's CPU seconds of the call (`time.process_time`), results
  ready: the dispatching thread, XLA's and MPI's;
- `dispatch_cpu_s`: the dispatching thread's CPU seconds inside the executor's
  `run_replicas` (`time.thread_time`): the instructions' steps, the executables run on
  that thread, and the receives' waits (Open MPI polls while it waits);
- `replay_cpu_s` / `replay_thread_cpu_s`: the same rank's Runs called in program order in
  a plain Python loop (received values made beforehand, sends skipped), from a
  barrier so no rank waits: the executables' own cost, JAX's dispatch and XLA's
  compute; the process's CPU and the calling thread's;
- `by_type_us`: in `--steps` more steps, each instruction's step timed on the
  dispatching thread (`time.thread_time`), µs per instruction of each type: a Recv's
  includes its wait (Open MPI polls), a Send's the wait for the value it posts;
- per instruction (the rank's program length n): each in µs, and `overhead_us`:
  (dispatch - replay_thread) / n, what the runtime and its messages add on the
  dispatching thread;
- `profile` (rank 0, with `--profile`): cProfile of the timed steps with the thread's
  CPU clock, the top functions by own time, calls and µs per step.

Per M: the slowest rank's (by median step) and the median rank's figures. The fit is
least squares of each rank's median step CPU against its instruction count
(`a + b n`) over every rank and M; `flatness` is the per-instruction cost at the
largest M over that at the smallest (1.0: flat). Every figure is CPU time: with 16
ranks on a few cores a rank's wall time is mostly other ranks' turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/_common.py
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from _common import metadata, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", default="16,32,64,128,256",
                   help="comma-separated microbatch counts")
    p.add_argument("--steps", type=int, default=3, help="timed steps per count")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--profile", action="store_true",
                   help="cProfile rank 0's timed steps (thread CPU): top functions in the JSON")
    p.add_argument("--out", default="bench/results/depth.json")
    return p.parse_args(argv)


def fit(points: list[tuple[float, float]]) -> dict:
    """Least squares `t = a + b n` over (n, t) points; b in µs per instruction."""
    if len({n for n, _ in points}) < 2:
        return {}
    mn = statistics.fmean(n for n, _ in points)
    mt = statistics.fmean(t for _, t in points)
    b = (sum((n - mn) * (t - mt) for n, t in points)
         / sum((n - mn) ** 2 for n, _ in points))
    return {"a_s": mt - b * mn, "b_us_per_instruction": 1e6 * b}


class DispatchClock:
    """The dispatching thread's CPU seconds inside `MpiExecutor.run_replicas`, summed
    since the last `take()`."""

    def __init__(self):
        from jaxpp_mpi._src.runtime.mpi import MpiExecutor

        self.total = 0.0
        original = MpiExecutor.run_replicas

        def run_replicas(executor, step_inputs):
            start = time.thread_time()
            try:
                return original(executor, step_inputs)
            finally:
                self.total += time.thread_time() - start

        MpiExecutor.run_replicas = run_replicas

    def take(self) -> float:
        out, self.total = self.total, 0.0
        return out


class InputCapture:
    """Copies of the values an executor binds to its input buffers, by buffer id, the
    next time it binds them (after `arm()`)."""

    def __init__(self, executor):
        self.values: dict[int, object] | None = None
        self._armed = False
        bind, slots = executor._bind_inputs, {}
        gp, layout = executor.group_program, executor.layout
        for b, _ in gp.inputs:
            slots[layout.slot(gp.mpmd_idx, b)] = b

        def capture(table, step_inputs):
            bind(table, step_inputs)
            if self._armed:
                self.values = {b: table[s].copy() for s, b in slots.items()
                               if table[s] is not None}
                self._armed = False

        executor._bind_inputs = capture

    def arm(self) -> None:
        self._armed = True


class ByType:
    """The executor's steps, each timed on the dispatching thread (`time.thread_time`)
    and summed per instruction type, while installed (`with ByType(executor) as t`)."""

    def __init__(self, executor):
        self.executor = executor
        self.cpu_s: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def __enter__(self) -> ByType:
        ex = self.executor
        self._steps = ex._steps
        cpu = self.cpu_s

        def timed(name, step):
            def run(table, times):
                start = time.thread_time()
                step(table, times)
                cpu[name] += time.thread_time() - start

            return run

        names = [type(i).__name__ for i in ex.group_program.instrs]
        for name in names:
            cpu.setdefault(name, 0.0)
            self.count[name] = self.count.get(name, 0) + 1
        wrapped = tuple(timed(n, s) for n, s in zip(names, self._steps.untimed))
        ex._steps = types.SimpleNamespace(untimed=wrapped, timed=self._steps.timed)
        return self

    def __exit__(self, *exc) -> None:
        self.executor._steps = self._steps


def replay_cpu_s(gp, exes, inputs: dict) -> tuple[float, float]:
    """CPU seconds (the process's, this thread's) of `gp`'s Runs in program order in a
    plain loop, without messages (received values made before the clock starts),
    results ready."""
    import jax
    import jax.numpy as jnp

    from jaxpp_mpi._src.ir.program import Free, Recv, Run, SendRecv

    table = {b: x.copy() for b, x in inputs.items()}
    received = {}
    for i in gp.instrs:
        if isinstance(i, (Recv, SendRecv)):
            buf = i.buf if isinstance(i, Recv) else i.recv_buf
            received[buf] = jnp.zeros(i.aval.shape, i.aval.dtype)
    jax.block_until_ready((table, received))
    start, thread = time.process_time(), time.thread_time()
    for i in gp.instrs:
        if isinstance(i, Run):
            args = [table[b] for b in i.ins]
            for b in i.donate:
                table.pop(b, None)
            table.update(zip(i.outs, exes[i.exe](*args)))
        elif isinstance(i, Recv):
            table[i.buf] = received[i.buf]
        elif isinstance(i, SendRecv):
            table[i.recv_buf] = received[i.recv_buf]
        elif isinstance(i, Free):
            for b in i.bufs:
                table.pop(b, None)
    jax.block_until_ready(table)
    return time.process_time() - start, time.thread_time() - thread


def run_count(args, mesh, world, clock, num_mb: int) -> dict:
    """One microbatch count on this rank: compile, a first step, the timed steps and
    the replay; returns this rank's figures."""
    import jax
    import optax
    from train import ModelConfig, init_params, loss_fn, make_train_step, synthetic_batch

    import jaxpp_mpi
    from jaxpp_mpi.schedules import schedule_by_name

    stages = world.Get_size()
    cfg = ModelConfig(vocab=32, hidden=args.hidden, heads=2, seq=8, layers=stages)
    sched = schedule_by_name("1f1b", stages)
    optimizer = optax.adam(3e-3)
    step = jaxpp_mpi.mpmd_jit_with_loop(
        make_train_step(lambda p, mb: loss_fn(p, mb, cfg, stages), sched, optimizer),
        mpmd_mesh=mesh, donate_argnums=(0, 1))
    params = init_params(jax.random.PRNGKey(0), cfg)
    batch = synthetic_batch(cfg, num_mb, 2)
    state = (optimizer.init(params), params)
    start = time.process_time()
    compiled = step.compile(*state, batch)
    row = {"compile_cpu_s": time.process_time() - start}
    executor = compiled._executor
    gp = executor.group_program
    capture = InputCapture(executor)

    def one_step(state):
        *state, loss = compiled(*state, batch)
        mine = [a for r in jax.tree.leaves((state, loss))
                for a in r.local_arrays.values()]
        jax.block_until_ready(mine)
        return state

    capture.arm()
    state = one_step(state)  # the first step: untimed
    row.update(instructions=len(gp.instrs), step_cpu_s=[], dispatch_cpu_s=[],
               replay_cpu_s=[], replay_thread_cpu_s=[])
    profiler = None
    if args.profile and world.Get_rank() == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # the dispatching thread's CPU
    for _ in range(args.steps):
        world.Barrier()
        if profiler is not None:
            profiler.enable()
        clock.take()
        start = time.process_time()
        state = one_step(state)
        row["step_cpu_s"].append(time.process_time() - start)
        row["dispatch_cpu_s"].append(clock.take())
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        row["profile"] = top_functions(profiler, args.steps)
    with ByType(executor) as by_type:
        for _ in range(args.steps):
            world.Barrier()
            state = one_step(state)
    row["by_type_us"] = {k: 1e6 * v / (args.steps * by_type.count[k])
                         for k, v in by_type.cpu_s.items()}
    row["by_type_count"] = by_type.count
    exes = compiled._executables[gp.mpmd_idx]
    for _ in range(args.steps):
        world.Barrier()
        cpu, thread = replay_cpu_s(gp, exes, capture.values)
        row["replay_cpu_s"].append(cpu)
        row["replay_thread_cpu_s"].append(thread)
    n = row["instructions"]
    for k in ("step", "dispatch", "replay", "replay_thread"):
        row[f"{k}_us_per_instruction"] = 1e6 * statistics.median(row[f"{k}_cpu_s"]) / n
    runs = sum(1 for i in gp.instrs if type(i).__name__ == "Run")
    row["replay_thread_us_per_run"] = (1e6 * statistics.median(row["replay_thread_cpu_s"])
                                       / max(runs, 1))
    row["overhead_us"] = (row["dispatch_us_per_instruction"]
                          - row["replay_thread_us_per_instruction"])
    return row


def top_functions(profiler, steps: int, top: int = 20) -> list[dict]:
    """The profile's `top` functions by own time: calls and own µs per step."""
    import pstats

    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{os.path.basename(f)}:{line}({name})", "calls": nc / steps,
             "own_us": 1e6 * tt / steps, "cumulative_us": 1e6 * ct / steps}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def summary(num_mb: int, rows: list[dict]) -> dict:
    """Per count: the slowest rank (by median step CPU) and the median over ranks."""
    keys = ("instructions", "step_us_per_instruction", "dispatch_us_per_instruction",
            "replay_us_per_instruction", "replay_thread_us_per_instruction", "overhead_us",
            "replay_thread_us_per_run")
    slow = max(range(len(rows)), key=lambda r: statistics.median(rows[r]["step_cpu_s"]))
    return {
        "microbatches": num_mb,
        "instructions_total": sum(r["instructions"] for r in rows),
        "slowest_rank": slow,
        "slowest": {k: rows[slow][k] for k in keys}
        | {"step_cpu_s": statistics.median(rows[slow]["step_cpu_s"])},
        "median": {k: statistics.median(r[k] for r in rows) for k in keys}
        | {"step_cpu_s": statistics.median(statistics.median(r["step_cpu_s"])
                                           for r in rows)},
        "by_type_us_median": {t: statistics.median(r["by_type_us"][t] for r in rows
                                                   if t in r.get("by_type_us", {}))
                              for t in sorted({t for r in rows
                                               for t in r.get("by_type_us", {})})},
        "ranks": rows,
    }


def _commit() -> str:
    """This tree's commit (short hash), or "" outside git."""
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                         capture_output=True, text=True)
    return out.stdout.strip()


def main(argv=None) -> int:
    args = parse_args(argv)
    cache = os.path.join(tempfile.gettempdir(), "jaxpp_mpi_bench_depth_cache")
    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from mpi4py import MPI

    import jaxpp_mpi
    from jaxpp_mpi.launch import launcher_world_size

    world = MPI.COMM_WORLD
    stages = launcher_world_size(os.environ)
    mesh = jaxpp_mpi.make_mpmd_mesh((1, stages), ("replica", "stage"), "stage",
                                    replica_axis_name="replica")
    clock = DispatchClock()
    rank0 = world.Get_rank() == 0
    counts = [int(m) for m in args.microbatches.split(",") if m]
    result = {"meta": {**metadata(), "date": time.strftime("%Y-%m-%d"),
                       "ranks": stages, "hidden": args.hidden, "steps": args.steps,
                       "load": os.getloadavg()[0], "commit": _commit()},
              "rows": []}
    for num_mb in counts:
        row = run_count(args, mesh, world, clock, num_mb)
        rows = world.gather(row)
        if not rank0:
            continue
        s = summary(num_mb, rows)
        result["rows"].append(s)
        write_json(args.out, {**result, "meta": {**result["meta"], "partial": True}})
        sl, md = s["slowest"], s["median"]
        print(f"M={num_mb}: {s['instructions_total']} instructions, per rank median "
              f"{md['instructions']:.0f}; step µs/instr slowest {sl['step_us_per_instruction']:.0f}"
              f" median {md['step_us_per_instruction']:.0f}; dispatch "
              f"{md['dispatch_us_per_instruction']:.0f}, replay "
              f"{md['replay_us_per_instruction']:.0f} (thread "
              f"{md['replay_thread_us_per_instruction']:.0f}), overhead {md['overhead_us']:.0f}"
              f"; replay per Run {md['replay_thread_us_per_run']:.0f}; by type "
              f"{({t: round(v, 1) for t, v in s['by_type_us_median'].items()})}",
              flush=True)
        for f in rows[0].get("profile", [])[:12]:
            print(f"  rank 0 {f['function']}: {f['calls']:.0f} calls, own "
                  f"{f['own_us']:.0f} µs, cumulative {f['cumulative_us']:.0f} µs a step",
                  flush=True)
    if rank0:
        points = [(r["instructions"], statistics.median(r["step_cpu_s"]))
                  for s in result["rows"] for r in s["ranks"]]
        first, last = result["rows"][0]["median"], result["rows"][-1]["median"]
        result["fit_step"] = fit(points)
        result["flatness"] = {k: last[k] / first[k] for k in
                              ("step_us_per_instruction", "dispatch_us_per_instruction",
                               "replay_us_per_instruction", "overhead_us")}
        result["meta"]["load_end"] = os.getloadavg()[0]
        write_json(args.out, result)
        print("fit", result["fit_step"], "flatness", result["flatness"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
