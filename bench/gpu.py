"""What the pipeline runtime costs over `jax.jit` on one GPU, at GPT-2 small's size.

    python bench/gpu.py --out bench/results/gpu.json                           # parts a-c
    mpirun -n 2 python bench/gpu.py --pipeline --out bench/results/gpu_pipeline.json
    .venv/bin/python bench/gpu.py --quick --out /tmp/g.json                     # CPU smoke
    launch/jpprun -n 2 .venv/bin/python bench/gpu.py --pipeline --quick --out /tmp/g2.json

The workload (bench/_gpt.py): examples/train.py's decoder-only transformer at GPT-2
small's shape, 12 layers, d 768, 12 heads, seq 1024, vocab 50304, untied head; float32
master weights cast to bf16 inside the loss; adam; 8 microbatches of 8 sequences per step
(`--quick`: 4 layers, d 64, seq 32, vocab 256, 4 microbatches; other sizes by option, the
JSON's `sizes` and `reduced` say which ran). Every loss is checked against `jax.jit`'s on
the same data and initial state (|difference| <= 0.05: bf16 products; printed); a
mismatch makes the run exit 1 after writing its JSON.

One process (`parts` in the JSON):
- `jit` (a): `jax.jit` of the whole step, a `lax.scan` over the microbatches summing the
  gradients, then adam.
- `one_group` (b): the same step under `mpmd_jit_with_loop` on a mesh of ONE group (MPMD
  axis of size 1: MPI mode on a communicator of one rank, no messages), Std1F1B(1), the
  whole model one stage: what the runtime itself costs. `one_group_ratio` = its step /
  jit's. (a) and (b) take turns step by step.
- `stages` (c): per schedule on 2 groups (the blocks split by `mark_stage_end`, the
  embedding on the first stage, the head and loss on the last), every loop-task
  executable of the plan (`build_step`) compiled for this device and each stage timed
  against `jax.jit` of that stage alone (bench/stages.py's method; the reference is
  `stage_reference` in bench/_gpt.py): `stage_ratio` STREAMED, the stage's Runs of one
  step replayed in program order (bench/_replay.py: values flowing Run to Run, inputs
  from elsewhere made once) back to back with one wait at the end, against the stage's
  jit called back to back for every microbatch (its accumulator chained), as a runtime
  dispatching ahead of the device runs them; `stage_ratio_alone` each call waited for
  (bench/stages.py's figure, per microbatch: each executable's median x its runs).
  Each distinct module is compiled once, on `--compile-threads` threads; each stage is
  timed for `--rounds` rounds after one of warm-up.
Per part: `step_ms` (median; stage: `streamed_ms`), `ratio` to jit, executables per
microbatch per stage (`jaxpp_mpi._src.ir.counts`: loop-task Runs; jit: 1 per step),
`dispatch_ms` (the Python call of a step, or of a stage's replay, until it returns,
before waiting), `peak_bytes` (`memory_stats()["peak_bytes_in_use"]` once the part has
run: the process's peak so far, so only the first part's is its own; None on CPU).

Two ranks (`--pipeline`, one group each, both on jax.devices()[0]; the caller sets
XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_MEM_FRACTION=0.4): per
schedule, the real pipelined step in MPI mode, `step_ms` barrier to barrier, taking
turns with jax.jit of the same step on rank 0 while rank 1 waits (`jit_ms`, `ratio`),
the first step's loss against jit's, and one traced step (`jaxpp_mpi.trace.record`):
per rank the summed wall time of its message calls and of its tasks.

Progress lines carry timestamps; the JSON is rewritten after every part and schedule
(`complete` false until the end); past `--budget-s` the schedules not yet started are
skipped (`skipped`), and a schedule of part c that fails is reported in `errors` while
the others go on. The last lines printed are a summary table. Part c lives in
bench/_gpu_stages.py, the two-rank part in bench/_gpu_pipeline.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common, _gpt, _replay

from _common import write_json  # noqa: E402
from _gpt import (  # noqa: E402
    LOSS_TOLERANCE,
    Clock,
    add_model_options,
    bf16_loss,
    config,
    copy_tree,
    counts,
    header,
    initial_state,
    loss_value,
    median,
    model_options,
    peak_bytes,
    ready,
    scan_train_step,
)
from _gpu_stages import stage_part  # noqa: E402
from _replay import Compiler  # noqa: E402

from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name  # noqa: E402 - no JAX

STAGE_SCHEDULES = "gpipe,1f1b,zerobubble,interleaved,dualpipev"
PIPELINE_SCHEDULES = "1f1b,zerobubble,interleaved"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(p)
    p.add_argument("--pipeline", action="store_true",
                   help="the two-rank part (under mpirun -n 2)")
    p.add_argument("--schedules", default=None, help="comma-separated; default "
                   f"{STAGE_SCHEDULES} (part c), {PIPELINE_SCHEDULES} (--pipeline)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender")
    p.add_argument("--rounds", type=int, default=3, help="part c's timing rounds")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compile-threads", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--budget-s", type=float, default=270.0,
                   help="start no schedule past this many seconds (its part is skipped)")
    p.add_argument("--out", default="bench/results/gpu.json")
    args = p.parse_args(argv)
    args.sizes = model_options(args)
    names = args.schedules or (PIPELINE_SCHEDULES if args.pipeline else STAGE_SCHEDULES)
    args.schedules = [s for s in names.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULE_NAMES]
    if unknown:
        p.error(f"unknown schedule(s) {unknown}; the names are {', '.join(SCHEDULE_NAMES)}")
    return args


class Stepper:
    """A compiled training step fed its own results, timed call by call."""

    def __init__(self, fn: Any, state: tuple, batch: Any):
        self.fn, self.state, self.batch = fn, copy_tree(state), batch
        self.ms: list[float] = []
        self.dispatch_ms: list[float] = []

    def __call__(self, timed: bool = True) -> Any:
        start = time.perf_counter()
        opt_state, params, loss = self.fn(*self.state, self.batch)
        dispatched = time.perf_counter()
        ready((opt_state, params, loss))
        if timed:
            self.dispatch_ms.append((dispatched - start) * 1e3)
            self.ms.append((time.perf_counter() - start) * 1e3)
        self.state = (opt_state, params)
        return loss


def single_process(args: argparse.Namespace, clock: Clock, result: dict) -> bool:
    """Parts a-c into `result`; False when a loss is past its tolerance."""
    import jax
    import optax
    import train

    import jaxpp_mpi

    cfg, optimizer = config(args.sizes, args.fused_attention), optax.adam(args.lr)
    state = initial_state(cfg, optimizer)
    batch = train.synthetic_batch(cfg, args.num_microbatches, args.microbatch_size)
    n, parts, ok = args.num_microbatches, result["parts"], True
    compiler = Compiler(args.compile_threads)
    clock.log(f"{jax.devices()[0]}: compiling jax.jit's step and the one-group step")
    start = time.perf_counter()
    jit_step = jax.jit(scan_train_step(bf16_loss(cfg, 1), optimizer, n), donate_argnums=(0, 1))
    jit_future = compiler.submit(jit_step.lower(*state, batch))  # compiles meanwhile
    mesh = jaxpp_mpi.make_mpmd_mesh((1, 1), ("stage", "data"), "stage")
    sched = schedule_by_name("1f1b", 1)
    one = jaxpp_mpi.mpmd_jit_with_loop(
        train.make_train_step(bf16_loss(cfg, 1), sched, optimizer), mpmd_mesh=mesh,
        donate_argnums=(0, 1)).compile(*state, batch)
    one_s = time.perf_counter() - start
    jit_compiled, jit_s = jit_future.result()
    clock.log(f"compiled: jit {jit_s:.1f}s, one group {one_s:.1f}s (concurrently)")

    jit_run, one_run = Stepper(jit_compiled, state, batch), Stepper(one, state, batch)
    jit_loss = loss_value(jit_run(timed=False))
    jit_run(timed=False)
    jit_peak = peak_bytes()
    one_loss = loss_value(one_run(timed=False))
    one_run(timed=False)
    diff = abs(one_loss - jit_loss)
    ok &= diff <= LOSS_TOLERANCE
    clock.log(f"first-step loss: jit {jit_loss:.5f}, one group {one_loss:.5f}, "
              f"|diff| {diff:.3g} (tolerance {LOSS_TOLERANCE})")
    for _ in range(args.steps):  # taking turns
        jit_run()
        one_run()
    jit_ms, one_ms = median(jit_run.ms), median(one_run.ms)
    parts["jit"] = {"step_ms": jit_ms, "step_ms_all": jit_run.ms, "ratio": 1.0,
                    "dispatch_ms": median(jit_run.dispatch_ms), "loss": jit_loss,
                    "executables_per_step": 1, "executables_per_microbatch": {0: 1 / n},
                    "compile_s": jit_s, "peak_bytes": jit_peak}
    parts["one_group"] = {"step_ms": one_ms, "step_ms_all": one_run.ms,
                          "ratio": one_ms / jit_ms, "dispatch_ms": median(one_run.dispatch_ms),
                          "loss": one_loss, "loss_diff": diff, "compile_s": one_s,
                          "schedule": repr(sched), "peak_bytes": peak_bytes(),
                          **counts(one.program())}
    result["one_group_ratio"] = one_ms / jit_ms
    clock.log(f"jit {jit_ms:.2f} ms, one group {one_ms:.2f} ms: ratio {one_ms / jit_ms:.3f}")
    write_json(args.out, result)
    del jit_run, one_run, jit_compiled, one
    if clock.elapsed() > args.budget_s:
        result["skipped"] = {"stages": f"past --budget-s {args.budget_s} before part c"}
        return ok
    stage_part(args, clock, cfg, state[1], batch, compiler, result)
    return ok


def print_single(result: dict) -> None:
    parts = result["parts"]
    gb = lambda b: f"{b / 2**30:.2f}" if b else "-"  # noqa: E731
    print(f"device {result['device']}; sizes {result['sizes']}"
          + (" (REDUCED)" if result["reduced"] else ""))
    print(f"{'part':<22} {'ms':>9} {'ratio':>6} {'exe/mb':>12} {'dispatch':>9} {'peak GB':>7}")
    for key in ("jit", "one_group"):
        if key in parts:
            p = parts[key]
            per = p.get("executables_per_microbatch", {})
            exe = "/".join(f"{v:g}" for v in per.values()) or "1/step"
            print(f"{key:<22} {p['step_ms']:>9.2f} {p['ratio']:>6.3f} {exe:>12} "
                  f"{p['dispatch_ms']:>9.2f} {gb(p['peak_bytes']):>7}")
    for name, r in parts.get("stages", {}).get("schedules", {}).items():
        for st in r["stages"]:
            print(f"{name + ' s' + str(st['stage']):<22} {st['streamed_ms']:>9.2f} "
                  f"{st['stage_ratio']:>6.3f} {st['executables_per_microbatch'] or 0:>12g} "
                  f"{st['dispatch_ms']:>9.2f} {gb(r['peak_bytes']):>7}  alone "
                  f"{st['stage_ratio_alone']:.3f}, jit {st['jit_streamed_ms']:.2f} ms")
    for key, why in result.get("skipped", {}).items():
        print(f"skipped {key}: {why}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pipeline:
        from _gpu_pipeline import pipeline_main

        return pipeline_main(args)
    clock = Clock()
    result = header(args, "single_process")
    result["parts"] = {}
    clock.log(f"bench/gpu.py: sizes {args.sizes}, schedules {args.schedules}")
    ok = single_process(args, clock, result)
    result["complete"], result["losses_match"] = True, ok
    result["wall_s"] = clock.elapsed()
    write_json(args.out, result)
    print_single(result)
    print(f"wrote {args.out} after {clock.elapsed():.0f} s" + ("" if ok else
          "; LOSS MISMATCH against jax.jit"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
