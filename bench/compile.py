"""Time to the first step: the 4-stage transformer of examples/train.py, pipelined, against jax.jit.

Run (the driver starts every measured process itself, fresh each time):

    .venv/bin/python bench/compile.py --repeats 5 --out bench/results/compile.json

Each repeat runs, in alternating order, two fresh processes' worth of work:
- `mpmd`: `launch/jpprun -n 4 python bench/compile.py --mpmd ...`, one rank per stage,
  one device and one compute thread each, as `make example` runs the example: the wall
  time from the start of `compile()` to the end of the first step (its results ready),
  per rank after a barrier, and its maximum over the ranks (`first_step_s`); with the
  time each rank spends tracing, splitting/scheduling/lowering (`plan` minus `trace`),
  agreeing on the program, in the layout pass, compiling executables (count, XLA part
  and total), building the executor (message chains compiled), and running step 1;
- `jit`: `python bench/compile.py --jit ...` pinned to one core with one compute thread,
  like a rank: `jax.jit` of the same whole step traced, lowered, compiled and run once.

Both sides start timing after their imports and data are made, and run with JAX's
persistent compilation cache OFF (`JAX_ENABLE_COMPILATION_CACHE=false`), so each
compiles everything afresh; each repeat is a new process (no in-process cache helps
either). With `--warm-cache`, each side instead runs once untimed to fill a cache
directory of its own (JAX's persistent compilation cache, every executable cached
whatever its compile time or size), and the timed repeats load from it: the first step
of a second launch, as `JAX_COMPILATION_CACHE_DIR` gives it. The machine is shared and
noisy: the result is the median over the repeats, every repeat kept in the JSON.
`--profile DIR` writes each rank's cProfile of its compile and first step
(`DIR/rank<r>.prof`, last repeat).

The model is examples/train.py's at its defaults (4 blocks, hidden 64, 4 heads, seq 32,
vocab 256, 8 microbatches of 4 sequences, adam, Std1F1B over 4 stages), imported from it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py
sys.path.insert(0, os.path.join(ROOT, "examples"))  # train.py: the model

from _common import metadata, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="mpmd/jit pairs, alternating")
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks = pipeline stages")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", dest="num_microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--data-axis", type=int, default=1,
                   help="devices per group (each rank's, forced on CPU): the batch's rows "
                   "split over them, as examples/train.py --data-axis does; the jax.jit "
                   "side stays on one device")
    p.add_argument("--out", default="bench/results/compile.json")
    p.add_argument("--profile", metavar="DIR", help="cProfile each rank (last repeat)")
    p.add_argument("--warm-cache", action="store_true",
                   help="time a second launch: each side fills its own persistent "
                   "compilation cache in an untimed run first")
    p.add_argument(
        "--baseline",
        metavar="DIR",
        help="another jaxpp_mpi source tree (e.g. `git archive HEAD` unpacked): "
        "its pipelined side takes turns with this tree's, as `baseline`",
    )
    p.add_argument("--mpmd", action="store_true", help=argparse.SUPPRESS)  # one MPI run
    p.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)  # one jit run
    p.add_argument("--result", help=argparse.SUPPRESS)  # where a run writes its JSON
    return p.parse_args(argv)


# -- the model (examples/train.py's, at its defaults) --------------------------------


def build(args: argparse.Namespace, num_stages: int, sched: Any):
    """The example's step, initial state and batch for `num_stages` stages of one block."""
    import jax
    import optax
    import train

    cfg = train.ModelConfig(vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                            seq=args.seq, layers=num_stages)
    optimizer = optax.adam(3e-3)
    loss = partial(train.loss_fn, cfg=cfg, num_stages=num_stages)
    train_step = train.make_train_step(loss, sched, optimizer)
    batch = train.synthetic_batch(cfg, args.num_microbatches, args.microbatch_size)
    params = train.init_params(jax.random.PRNGKey(0), cfg)
    return train_step, optimizer.init(params), params, batch


# -- where a rank's compile time goes ------------------------------------------------


class Probe:
    """Times the compiler's phases by wrapping the functions that run them (this process
    only; the library is unchanged).

    Attributes:
      seconds: phase -> total wall seconds.
      cpu_seconds: phase -> total CPU seconds of this process (all its threads).
      counts: phase -> calls.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []
        self._inside: list[str] = []

    def _wrap(self, owner: Any, attr: str, phase: str) -> None:
        original = getattr(owner, attr)

        def timed(*a, **k):
            # Phases nest (an XLA compile inside the layout pass): each is timed whole.
            name = phase
            if phase == "xla_compile":  # who asked for it: an executable or a message chain
                name = "xla_compile_exe" if "compile_exe" in self._inside else "xla_compile_other"
            self._inside.append(phase)
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*a, **k)
            finally:
                self._inside.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu
                self.counts[name] = self.counts.get(name, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    @contextlib.contextmanager
    def installed(self) -> Iterator[Probe]:
        import jax.stages

        from jaxpp_mpi._src.compiler import build as build_mod
        from jaxpp_mpi._src.compiler import deferred
        from jaxpp_mpi._src.driver import compiled
        from jaxpp_mpi._src.frontend import api
        from jaxpp_mpi._src.runtime import agree

        self._wrap(build_mod, "trace_step", "trace")
        self._wrap(api, "build_step", "plan")
        self._wrap(agree, "agree_on_program", "agree")
        self._wrap(compiled.MpmdCompiled, "_make_executor", "executor")
        try:  # group_compiler.py; compiled.py in older trees (the baseline)
            from jaxpp_mpi._src.driver import group_compiler as passes
            owner = passes.GroupCompiler
            names = ("infer_layouts", "_compile_group")
        except ImportError:
            passes, owner, names = compiled, compiled.MpmdCompiled, ("_infer_layouts",
                                                                     "_compile_group")
        self._wrap(owner, names[0], "layouts")
        self._wrap(owner, names[1], "compile_group")
        self._wrap(passes, "compile_exe", "compile_exe")
        try:  # Note: shared compiles (absent in older trees)
            from jaxpp_mpi._src.driver import shared_compiles
            self._wrap(shared_compiles, "compile_lowered", "compile_exe")
        except ImportError:
            pass
        self._wrap(deferred, "compile_deferred", "compile_exe")
        self._wrap(jax.stages.Lowered, "compile", "xla_compile")
        try:
            yield self
        finally:
            while self._undo:
                self._undo.pop()()


def _profiled(path: str | None):
    if path is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def run():
        prof = cProfile.Profile(time.process_time)  # CPU time: ranks share cores
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            prof.dump_stats(path)

    return run()


def run_mpmd(args: argparse.Namespace) -> None:
    """One MPI run: each rank's compile-to-first-step time and its phases."""
    import jax

    import jaxpp_mpi
    from jaxpp_mpi.schedules import schedule_by_name

    mesh = jaxpp_mpi.make_mpmd_mesh(
        (args.ranks, args.data_axis, 1),
        ("stage", "data", "model"),
        "stage",
    )
    comm, rank = mesh.comm, mesh.my_mpmd_axis_index
    sched = schedule_by_name(args.schedule, mesh.mpmd_dim)
    train_step, opt_state, params, batch = build(args, sched.num_stages, sched)
    in_shardings = None
    if args.data_axis > 1:  # as examples/train.py lays a data-parallel group out
        from jax.sharding import PartitionSpec as P

        rows = {k: P(None, "data") for k in batch}  # (microbatch, row, position)
        in_shardings = (None, None, rows)
    step = jaxpp_mpi.mpmd_jit_with_loop(train_step, mpmd_mesh=mesh, donate_argnums=(0, 1),
                                        in_shardings=in_shardings)
    jax.block_until_ready((opt_state, params, batch))
    profile = os.path.join(args.profile, f"rank{rank}.prof") if args.profile else None
    comm.Barrier()
    probe = Probe()
    with probe.installed(), _profiled(profile):
        start, cpu = time.perf_counter(), time.process_time()
        compiled = step.compile(opt_state, params, batch)
        compiled_at, compiled_cpu = time.perf_counter(), time.process_time()
        out = compiled(opt_state, params, batch)
        jax.block_until_ready(
            [x.first_mpmd_replica for x in jax.tree.leaves(out) if x.is_partially_addressable]
        )
        end, end_cpu = time.perf_counter(), time.process_time()
    mine = {
        "rank": rank,
        "total_s": end - start,
        "compile_s": compiled_at - start,
        "first_run_s": end - compiled_at,
        "cpu_s": end_cpu - cpu,
        "compile_cpu_s": compiled_cpu - cpu,
        "phases_s": probe.seconds,
        "phases_cpu_s": probe.cpu_seconds,
        "counts": probe.counts,
        "executables": len(compiled.plan.exes[rank]),
        # Note: shared compiles (absent in trees before it)
        "shared_compiles": dict(getattr(compiled, "shared_report", {}) or {}),
        "executables_all_groups": sum(len(e) for e in compiled.plan.exes),
    }
    ranks = comm.gather(mine, root=0)
    if rank == 0:
        write_json(args.result, {"ranks": ranks})


def run_jit(args: argparse.Namespace) -> None:
    """One process: `jax.jit` of the whole step traced, lowered, compiled and run once."""
    import jax

    from jaxpp_mpi.schedules import schedule_by_name

    sched = schedule_by_name(args.schedule, args.ranks)
    train_step, opt_state, params, batch = build(args, sched.num_stages, sched)
    jax.block_until_ready((opt_state, params, batch))
    start, cpu = time.perf_counter(), time.process_time()
    traced = jax.jit(train_step, donate_argnums=(0, 1)).trace(opt_state, params, batch)
    t_trace = time.perf_counter()
    lowered = traced.lower()
    t_lower = time.perf_counter()
    compiled = lowered.compile()
    t_compile = time.perf_counter()
    jax.block_until_ready(compiled(opt_state, params, batch))
    end = time.perf_counter()
    write_json(
        args.result,
        {
            "total_s": end - start,
            "cpu_s": time.process_time() - cpu,
            "compile_s": t_compile - start,
            "first_run_s": end - t_compile,
            "phases_s": {
                "trace": t_trace - start,
                "lower": t_lower - t_trace,
                "xla_compile": t_compile - t_lower,
            },
        },
    )


# -- the driver ----------------------------------------------------------------------


def _env(cache: str | None = None) -> dict[str, str]:
    """The environment of a measured process: no MPI job of ours; JAX's persistent
    compilation cache off, or in directory `cache` for every executable."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX", "PRTE"))
    }
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false" if cache is None else "true"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _model_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--ranks",
        str(args.ranks),
        "--schedule",
        args.schedule,
        "--microbatches",
        str(args.num_microbatches),
        "--microbatch-size",
        str(args.microbatch_size),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--data-axis",
        str(args.data_axis),
    ]


def _run(cmd: list[str], env: dict[str, str], result: str) -> dict[str, Any]:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    with open(result) as f:
        return json.load(f)


def measure_mpmd(args, tmp: str, profile: str | None, tree: str = ROOT,
                 cache: str | None = None) -> dict[str, Any]:
    """One `launch/jpprun` run of the pipelined side, with the jaxpp_mpi of `tree`, its
    persistent compilation cache in `cache` (None: off)."""
    result = os.path.join(tmp, "mpmd.json")
    cmd = [
        os.path.join(ROOT, "launch", "jpprun"),
        "-n",
        str(args.ranks),
        sys.executable,
        os.path.abspath(__file__),
        "--mpmd",
        "--result",
        result,
        *_model_flags(args),
    ]
    if profile:
        cmd += ["--profile", profile]
    env = _env(cache)
    if args.data_axis > 1:  # launch/jpprun adds its one-thread flags to these
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.data_axis}"
    if tree != ROOT:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    ranks = _run(cmd, env, result)["ranks"]
    worst = max(ranks, key=lambda r: r["total_s"])
    return {"first_step_s": worst["total_s"], "slowest_rank": worst["rank"], "ranks": ranks}


def measure_jit(args, tmp: str, cache: str | None = None) -> dict[str, Any]:
    """One process of the `jax.jit` side, its persistent compilation cache in `cache`
    (None: off)."""
    result = os.path.join(tmp, "jit.json")
    env = _env(cache)
    env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"  # one compute thread, as a rank
    env["OMP_NUM_THREADS"] = "1"
    core = min(os.sched_getaffinity(0))
    code = (
        f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
        f"sys.argv = {[__file__, '--jit', '--result', result, *_model_flags(args)]!r}; "
        "import runpy; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    out = _run([sys.executable, "-c", code], env, result)
    out["first_step_s"] = out["total_s"]
    return out


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: round(statistics.median(r.get(k, 0.0) for r in runs), 3) for k in keys}


def summarize(mpmd: list[dict], jit: list[dict]) -> dict[str, Any]:
    """Medians over the repeats: wall times (the slowest rank's phases), and CPU times
    (the busiest rank's phases; all ranks together), which the machine's other load
    disturbs less than wall times."""
    med = lambda xs: round(statistics.median(xs), 3)
    slowest = [next(r for r in m["ranks"] if r["rank"] == m["slowest_rank"]) for m in mpmd]
    busiest = [max(m["ranks"], key=lambda r: r["cpu_s"]) for m in mpmd]
    m_first = statistics.median(m["first_step_s"] for m in mpmd)
    j_first = statistics.median(j["first_step_s"] for j in jit)
    return {
        "mpmd_first_step_s": round(m_first, 3),
        "jit_first_step_s": round(j_first, 3),
        "ratio": round(m_first / j_first, 3),
        "mpmd_slowest_rank_phases_s": _median_phases([r["phases_s"] for r in slowest]),
        "mpmd_slowest_rank_counts": slowest[-1]["counts"],
        "mpmd_compile_s": med(r["compile_s"] for r in slowest),
        "mpmd_first_run_s": med(r["first_run_s"] for r in slowest),
        "jit_phases_s": _median_phases([j["phases_s"] for j in jit]),
        "jit_first_run_s": med(j["first_run_s"] for j in jit),
        "mpmd_busiest_rank_cpu_s": med(r["cpu_s"] for r in busiest),
        "mpmd_busiest_rank_phases_cpu_s": _median_phases([r["phases_cpu_s"] for r in busiest]),
        "mpmd_all_ranks_cpu_s": med(sum(r["cpu_s"] for r in m["ranks"]) for m in mpmd),
        "jit_cpu_s": med(j["cpu_s"] for j in jit),
    }


def _measure(into: list, measure: Callable[..., dict[str, Any]], *args: Any) -> None:
    into.append(measure(*args))


def main() -> None:
    args = parse_args()
    if args.mpmd:
        run_mpmd(args)
        return
    if args.jit:
        run_jit(args)
        return
    mpmd, jit, baseline = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        caches = {side: os.path.join(tmp, f"cache_{side}") if args.warm_cache else None
                  for side in ("mpmd", "jit", "baseline")}
        tree = os.path.abspath(args.baseline) if args.baseline else None
        if args.warm_cache:  # one untimed run each fills its cache
            measure_mpmd(args, tmp, None, cache=caches["mpmd"])
            measure_jit(args, tmp, caches["jit"])
            if tree:
                measure_mpmd(args, tmp, None, tree, caches["baseline"])
        for k in range(args.repeats):
            profile = args.profile if k == args.repeats - 1 else None
            # Rotate which side goes first, so drift in the machine's load hits all.
            sides = [
                partial(_measure, mpmd, measure_mpmd, args, tmp, profile, ROOT, caches["mpmd"]),
                partial(_measure, jit, measure_jit, args, tmp, caches["jit"]),
            ]
            if tree:
                sides.append(partial(_measure, baseline, measure_mpmd, args, tmp, None, tree,
                                     caches["baseline"]))
            for side in sides[k % len(sides) :] + sides[: k % len(sides)]:
                side()
            line = (
                f"repeat {k}: mpmd {mpmd[-1]['first_step_s']:.2f} s, "
                f"jax.jit {jit[-1]['first_step_s']:.2f} s"
            )
            if baseline:
                line += f", baseline mpmd {baseline[-1]['first_step_s']:.2f} s"
            print(line, flush=True)
    summary = summarize(mpmd, jit)
    if baseline:
        summary["baseline"] = summarize(baseline, jit)
    import jaxpp_mpi  # noqa: F401 - for metadata's jax import path only

    write_json(
        args.out,
        {
            **metadata(),
            "command": " ".join(["python", "bench/compile.py", *sys.argv[1:]]),
            "persistent_compilation_cache": "warm" if args.warm_cache else "off",
            "model": {
                k: getattr(args, k)
                for k in (
                    "ranks",
                    "schedule",
                    "num_microbatches",
                    "microbatch_size",
                    "hidden",
                    "heads",
                    "seq",
                    "vocab",
                )
            },
            "summary": summary,
            "mpmd": mpmd,
            "jit": jit,
            "baseline": baseline,
        },
    )
    print(
        f"first step: jaxpp_mpi {summary['mpmd_first_step_s']:.2f} s (max over "
        f"{args.ranks} ranks) vs jax.jit {summary['jit_first_step_s']:.2f} s: "
        f"{summary['ratio']:.2f}x; CPU: busiest rank {summary['mpmd_busiest_rank_cpu_s']:.2f}"
        f" s, all ranks {summary['mpmd_all_ranks_cpu_s']:.2f} s, jax.jit "
        f"{summary['jit_cpu_s']:.2f} s (median of {args.repeats}; wrote {args.out})"
        + (f"; baseline tree {summary['baseline']['mpmd_first_step_s']:.2f} s" if baseline else "")
    )


if __name__ == "__main__":
    main()
