"""Startup at depth: plan time, cached-plan time, first step and host memory against program size.

Run (the driver starts every measured process itself, fresh each time):

    .venv/bin/python bench/startup.py --out bench/results/startup.json \
        [--baseline DIR] [--first-step-max 15000]

Each workload is examples/train.py's tiny transformer (hidden 64, one block per stage)
in one process, local mode, `--groups S --microbatches M` under a schedule; the table
of workloads (`WORKLOADS`) runs from ~200 to ~300k instructions. `--repeats` turns,
each of every workload in order, so that workloads compare within a turn; per workload,
in fresh processes taking turns (this tree, then `--baseline`'s tree when given):

- `plan`: `MpmdFunction.step_plan` (trace, split, schedule, lower, verify) with the
  program cache off, its lowering part (`lower`: the task graph to the verified
  program) timed apart, and the process's peak resident memory;
- `cached`: a second process planning the same step with a program cache that the
  first filled (`Note: program cache`): a relaunch's plan time (this tree only); for
  programs of at most `--first-step-max` instructions both processes also compile and
  run the first steps with JAX's persistent compilation cache on (beside the program
  cache, as `JAXPP_MPI_PROGRAM_CACHE=auto` keeps them), so the second one gives a
  relaunch's time to its first step (`to_first_step_s`: plan, compile and first step);
- `baseline`: `plan` of the other tree, for programs up to `--baseline-max`
  instructions (the old lowering takes minutes beyond);
- `first_step`: for programs of at most `--first-step-max` instructions, compile and
  the first and second step's time (`compiled(*args)`, results ready), the time to
  the first step from a cold start (`to_first_step_s`), and the second step's time per
  instruction: the executor's dispatch cost. Larger programs are planned only: running
  them here takes minutes per step of XLA's CPU work.

Times are the measured process's CPU seconds (`time.process_time`; planning is one
Python thread), the primary figures because the machine is shared: its wall time grows
with other sessions' load, its CPU time much less; wall times are kept beside them
(`*_wall_s`). A step's CPU time covers the dispatching thread and XLA's (one compute
thread per device here).

The fit is least squares of the lowering time against instructions (`a + b n`), over
this tree's runs; `per_instruction` lists lower / n per workload, so the cost at 3k and
at 300k instructions can be compared (`growth`: turn by turn, the largest program's over
the one's nearest 3k). Beside it, `reference_us_per_item`: the same process, after
planning, times `reference_pass` over as many items as the program has instructions: the
machine's own cost per item of plain Python dict and set work at that size, over value
names and over dense ids (`Note: the memory floor`). The machine is shared and noisy:
repeats take turns and the JSON keeps each; the tables give medians.

Note: the memory floor
  Every pass of the lowering does a bounded number of steps per instruction (the Python
  lines it executes per instruction do not grow with the program:
  tests/unit/compiler/test_lowering_work.py), yet its time per instruction grows from 3k
  to 300k instructions. The growth is the memory hierarchy's: a few thousand
  instructions' values, dicts and sets fit the caches (32 MiB of L3 on the 2-core VM), a
  few hundred thousand do not, and every lookup of a value's name (a string, hashed to a
  random slot) then misses. `reference_pass` is that work and nothing else (a dict and a
  set of value names, each item reading two earlier ones), timed the same way, so the
  two ratios, 300k over 3k, can be read side by side; over dense int ids in a list
  instead of names in a dict, the same work stays in the caches' reach much longer.
  That is why a built step's values are dense ints (`Note: dense values` in
  compiler/task_graph.py): its lowering's growth is the dense pass's, not the names'.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py

from _common import metadata, write_json  # noqa: E402

# (schedule, groups, microbatches): from ~200 to ~300k instructions.
WORKLOADS = (
    ("1f1b", 4, 8),
    ("1f1b", 4, 64),
    ("1f1b", 4, 128),
    ("1f1b", 4, 512),
    ("1f1b", 16, 64),
    ("1f1b", 16, 256),
    ("1f1b", 32, 128),
    ("interleaved", 16, 128),
    ("interleaved", 16, 512),
    ("1f1b", 32, 1024),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="turns per workload")
    p.add_argument("--no-cached", action="store_true", help="skip the cached-plan runs")
    p.add_argument("--out", default="bench/results/startup.json")
    p.add_argument("--baseline", metavar="DIR",
                   help="another jaxpp_mpi source tree: its plan takes turns with this one's")
    p.add_argument("--baseline-max", type=int, default=40000,
                   help="plan the baseline only for programs up to this many instructions")
    p.add_argument("--first-step-max", type=int, default=15000,
                   help="run the first steps of programs up to this many instructions")
    p.add_argument("--only", metavar="S:G:M", action="append",
                   help="run only these workloads (e.g. 1f1b:16:256)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one measured process (JSON)
    return p.parse_args(argv)


# -- one measured process ------------------------------------------------------------


def reference_pass(n: int, dense: bool = False) -> float:
    """Microseconds per item of plain Python dict and set work over `n` value names
    (`Note: the memory floor`): each item looks up two earlier names (the one before,
    and one half-way back) and is added to a dict, a set and a list, once. With `dense`,
    the names are the ints 0..n-1 and the dict a list indexed by them."""
    names: list = list(range(n)) if dense else [f"v{i}@m{i % 64}" for i in range(n)]
    start = time.process_time()
    made: dict | list = [None] * n if dense else {}
    get = made.__getitem__ if dense else made.get
    seen: set = set()
    out: list[tuple] = []
    for i, name in enumerate(names):
        a, b = get(names[i - 1]), get(names[i // 2])
        made[name] = (i, a, b)
        seen.add(name)
        out.append((name, a is b))
    return 1e6 * (time.process_time() - start) / n


def child(spec: dict) -> dict:
    """Plans (and maybe runs) one workload in this process; returns its figures."""
    groups = spec["groups"]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={groups}").strip()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from functools import partial

    import jax
    import optax
    import train

    import jaxpp_mpi
    from jaxpp_mpi._src.compiler import build

    caller = build  # where the lowering is called from: build.py in older trees
    if not hasattr(build, "lower_cached") and not hasattr(build, "build_program_with_names"):
        from jaxpp_mpi._src.compiler import step_entry as caller
    from jaxpp_mpi.schedules import schedule_by_name

    lowering = [0.0, 0.0]  # wall, CPU seconds
    name = "lower_cached" if hasattr(caller, "lower_cached") else "build_program_with_names"
    original = getattr(caller, name)

    def timed(*a, **k):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*a, **k)
        finally:
            lowering[0] += time.perf_counter() - start
            lowering[1] += time.process_time() - cpu

    setattr(caller, name, timed)
    sched = schedule_by_name(spec["schedule"], groups)
    stages = sched.num_stages
    cfg = train.ModelConfig(vocab=256, hidden=64, heads=4, seq=32, layers=stages)
    optimizer = optax.adam(3e-3)
    step_fn = train.make_train_step(partial(train.loss_fn, cfg=cfg, num_stages=stages),
                                    sched, optimizer)
    run = spec.get("run", False)
    make = (lambda f: f()) if run else (lambda f: jax.eval_shape(f))
    batch = make(lambda: train.synthetic_batch(cfg, spec["microbatches"], 4))
    params = make(lambda: train.init_params(jax.random.PRNGKey(0), cfg))
    opt_state = make(lambda: optimizer.init(params))
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((groups, 1, 1), ("stage", "data", "model")),
                              "stage")
    step = jaxpp_mpi.mpmd_jit_with_loop(step_fn, mpmd_mesh=mesh, donate_argnums=(0, 1))
    out: dict = {}
    start, cpu = time.perf_counter(), time.process_time()
    plan = step.step_plan(opt_state, params, batch)
    out["plan_wall_s"] = time.perf_counter() - start
    out["plan_s"] = time.process_time() - cpu
    out["lower_wall_s"], out["lower_s"] = lowering
    out["instructions"] = sum(len(g.instrs) for g in plan.program.groups)
    out["from_cache"] = bool(getattr(plan, "program_from_cache", False))
    out["program_sha256"] = plan.program.hash()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gc_was = gc.isenabled()
    gc.disable()  # as while planning (`Note: collector paused` in build.py)
    out["reference_us_per_item"] = reference_pass(out["instructions"])
    out["reference_dense_us_per_item"] = reference_pass(out["instructions"], dense=True)
    if gc_was:
        gc.enable()
    if run:
        start, cpu = time.perf_counter(), time.process_time()
        compiled = step.compile(opt_state, params, batch)
        out["compile_wall_s"] = time.perf_counter() - start
        out["compile_s"] = time.process_time() - cpu
        state = (opt_state, params)
        for k in ("first_step", "second_step"):
            start, cpu = time.perf_counter(), time.process_time()
            *state, loss = compiled(*state, batch)
            jax.block_until_ready(loss.first_mpmd_replica)
            jax.block_until_ready(state)
            out[k + "_wall_s"] = time.perf_counter() - start
            out[k + "_s"] = time.process_time() - cpu
        out["dispatch_us_per_instruction"] = 1e6 * out["second_step_s"] / out["instructions"]
        out["to_first_step_s"] = out["plan_s"] + out["compile_s"] + out["first_step_s"]
        out["to_first_step_wall_s"] = (out["plan_wall_s"] + out["compile_wall_s"]
                                       + out["first_step_wall_s"])
        out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def measure(spec: dict, tree: str | None, cache_dir: str | None) -> dict:
    """Runs `child(spec)` in a fresh process with `tree` first on the path; with
    `cache_dir`, the program cache and JAX's compilation cache live there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree or ROOT, env.get("PYTHONPATH")) if p)
    env["JAXPP_MPI_PROGRAM_CACHE"] = os.path.join(cache_dir, "programs") if cache_dir else "0"
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)
    if cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache_dir, "jax")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env.pop("JAXPP_MPI_THREADS_PER_RANK", None)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), "--child",
               json.dumps({**spec, "result": f.name})]
        subprocess.run(cmd, env=env, check=True, cwd=tree or ROOT,
                       stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


# -- the driver ----------------------------------------------------------------------


def fit(points: list[tuple[int, float]]) -> dict:
    """Least squares `t = a + b n` over (n, t) points; b in microseconds per instruction."""
    if len(points) < 2:
        return {}
    ns, ts = [float(n) for n, _ in points], [t for _, t in points]
    mn, mt = statistics.fmean(ns), statistics.fmean(ts)
    b = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / sum((n - mn) ** 2 for n in ns)
    return {"a_s": mt - b * mn, "b_us_per_instruction": 1e6 * b}


def growth(rows: list[dict]) -> dict:
    """Per turn, the largest program's cost per item over the one's nearest 3k
    instructions: the lowering's, and `reference_pass`'s over names and dense ids
    (`Note: the memory floor`); each turn's pair ran minutes apart at most."""
    if len(rows) < 2:
        return {}
    size = lambda r: r["new"][0]["instructions"]  # noqa: E731
    big, small = max(rows, key=size), min(rows, key=lambda r: abs(size(r) - 3000))
    per = {"lower": lambda r: 1e6 * r["lower_s"] / r["instructions"],
           "reference": lambda r: r["reference_us_per_item"],
           "reference_dense": lambda r: r["reference_dense_us_per_item"]}
    turns = {k: [f(b) / f(s) for b, s in zip(big["new"], small["new"])]
             for k, f in per.items()}
    return {"large": size(big), "small": size(small), "per_turn": turns,
            "median": {k: statistics.median(v) for k, v in turns.items()}}


def _first_step_words(row: dict) -> str:
    """The times to the first step of a cold start and of a relaunch, when measured."""
    cold = row.get("first_step", {}).get("to_first_step_s")
    warm = row["median"].get("cached", {}).get("to_first_step_s")
    if cold is None or warm is None:
        return ""
    return f", to first step {cold:.2f} s (relaunch {warm:.2f} s)"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        result = child(spec)
        with open(spec["result"], "w") as f:
            json.dump(result, f)
        return 0
    workloads = [tuple(w.split(":")) for w in args.only] if args.only else WORKLOADS
    rows: list[dict] = [{"schedule": s, "groups": int(g), "microbatches": int(m),
                         "new": [], "cached": [], "baseline": []} for s, g, m in workloads]
    for _ in range(args.repeats):  # a turn of every workload: their ratios compare alike
        for row in rows:
            spec = {k: row[k] for k in ("schedule", "groups", "microbatches")}
            row["new"].append(measure(spec, None, None))
            n = row["new"][0]["instructions"]
            if args.baseline and n <= args.baseline_max:
                row["baseline"].append(measure(spec, os.path.abspath(args.baseline), None))
            if args.no_cached:
                continue
            relaunch = {**spec, "run": n <= args.first_step_max}
            with tempfile.TemporaryDirectory() as cache:
                measure(relaunch, None, cache)  # fills the caches
                row["cached"].append(measure(relaunch, None, cache))
        write_json(args.out, {"meta": {"partial": True}, "rows": rows})
    for row in rows:
        spec = {k: row[k] for k in ("schedule", "groups", "microbatches")}
        n = row["new"][0]["instructions"]
        if n <= args.first_step_max:
            row["first_step"] = measure({**spec, "run": True}, None, None)
        med = {side: {k: statistics.median(r[k] for r in row[side])
                      for k in ("plan_s", "lower_s", "peak_rss_mb", "reference_us_per_item",
                                "reference_dense_us_per_item")
                      if all(k in r for r in row[side])}
               for side in ("new", "cached", "baseline") if row[side]}
        row["median"] = med
        same = {r["program_sha256"] for side in ("new", "cached", "baseline")
                for r in row[side]}
        row["programs_equal"] = len(same) == 1
        if row["cached"] and "to_first_step_s" in row["cached"][0]:
            med["cached"]["to_first_step_s"] = statistics.median(
                r["to_first_step_s"] for r in row["cached"])
        old = med.get("baseline", {}).get("plan_s")
        cached = med.get("cached", {}).get("plan_s", float("nan"))
        print(f"{row['schedule']} {row['groups']}x{row['microbatches']}: {n} instructions, "
              f"plan {med['new']['plan_s']:.2f} s (lower {med['new']['lower_s']:.2f} s), "
              f"cached {cached:.2f} s" + (f", baseline {old:.2f} s" if old is not None else "")
              + _first_step_words(row)
              + f", same program: {row['programs_equal']}", flush=True)
    points = [(r["new"][0]["instructions"], r["median"]["new"]["lower_s"]) for r in rows]
    result = {
        "meta": {**metadata(), "date": time.strftime("%Y-%m-%d"), "baseline": args.baseline},
        "rows": rows,
        "fit_lower": fit(points),
        "per_instruction_us": {f"{r['schedule']} {r['groups']}x{r['microbatches']}":
                               1e6 * r["median"]["new"]["lower_s"] / r["new"][0]["instructions"]
                               for r in rows},
        **{k: {f"{r['schedule']} {r['groups']}x{r['microbatches']}": r["median"]["new"][k]
               for r in rows}
           for k in ("reference_us_per_item", "reference_dense_us_per_item")},
        "growth": growth(rows),
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("fit_lower", "per_instruction_us",
                                             "reference_us_per_item",
                                             "reference_dense_us_per_item", "growth")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
