"""bench/gpu.py's part c: per schedule and stage, the stage's executables against
`jax.jit` of that stage alone, streamed and alone (see bench/gpu.py's docstring)."""

from __future__ import annotations

import time
import traceback
from typing import Any

from _common import random_arrays, timed_call_ms, write_json
from _gpt import (
    Clock,
    bf16_loss,
    counts,
    grad_step,
    median,
    peak_bytes,
    stage_params,
    stage_reference,
)
from _replay import Compiler, StageReplay, exe_stage, plan_executables, stream_ms

from jaxpp_mpi.schedules import schedule_by_name


def submit_references(cfg, num_stages: int, params, batch, compiler: Compiler) -> dict:
    """Each stage's `stage_reference` for `num_stages` stages, lowered on its arguments
    (the first microbatch's tokens and targets, made-up activations and cotangents in
    bf16) and submitted: stage -> (future, arguments)."""
    import jax
    import jax.numpy as jnp

    mb = {k: v[0] for k, v in batch.items()}
    act = jax.ShapeDtypeStruct((*mb["inputs"].shape, cfg.hidden), jnp.bfloat16)
    refs = {}
    for s in range(num_stages):
        ps = stage_params(params, s, num_stages)
        x = mb["inputs"] if s == 0 else random_arrays([act], 100 + s)[0]
        t = mb["targets"] if s == num_stages - 1 else random_arrays([act], 200 + s)[0]
        acc = jax.tree.map(jnp.zeros_like, ps)
        fn = jax.jit(stage_reference(cfg, s, num_stages), donate_argnums=(0,))
        refs[s] = (compiler.submit(fn.lower(acc, ps, x, t)), [acc, ps, x, t])
    return refs


def time_stage(plan, g: int, s: int, runs: dict, ref, ref_args: list, arrays, rounds: int,
               n: int) -> dict[str, Any]:
    """Stage `s` (on group `g`) of `plan` against its reference `ref`, `rounds` rounds
    after one of warm-up; each round: the reference alone, each executable alone, the
    stage replayed (`StageReplay`), the reference streamed over `n` microbatches."""
    replay = StageReplay(plan, g, s, runs, arrays)
    mine = {e: exe for e, exe in plan.exes[g].items() if exe_stage(exe) == s}
    exe_args = {e: [arrays(a) for a in plan.exe_avals[g][e][0]] for e in mine}
    alone: dict[str, list[float]] = {e: [] for e in mine}
    ref_alone, streamed, ref_streamed = [], [], []
    for r in range(rounds + 1):
        ref_ms = timed_call_ms(ref, ref_args, (0,))
        times = {e: timed_call_ms(runs[g, e], exe_args[e], mine[e].donate_argnums) for e in mine}
        replayed, ref_stream = replay(), stream_ms(ref, ref_args[0], ref_args[1:], n)
        if r:  # round 0 warms up
            ref_alone.append(ref_ms)
            for e, t in times.items():
                alone[e].append(t)
            streamed.append(replayed)
            ref_streamed.append(ref_stream)
    runs_of = {e: sum(1 for i in plan.program.group(g).instrs if getattr(i, "exe", None) == e)
               for e in mine}
    alone_ms = sum(runs_of[e] * median(alone[e]) for e in mine) / n
    streamed_ms = median([t for _, t in streamed])
    jit_streamed_ms = median([t for _, t in ref_streamed])
    return {
        "stage": s, "group": g,
        "stage_ratio": streamed_ms / jit_streamed_ms,
        "stage_ratio_alone": alone_ms / median(ref_alone),
        "streamed_ms": streamed_ms, "jit_streamed_ms": jit_streamed_ms,
        "alone_ms_per_microbatch": alone_ms, "jit_alone_ms": median(ref_alone),
        "dispatch_ms": median([d for d, _ in streamed]),
        "jit_dispatch_ms": median([d for d, _ in ref_streamed]),
        "runs_per_step": replay.num_runs,
        "executables": {e: {"runs": runs_of[e], "alone_ms": median(alone[e])} for e in mine},
    }


def stage_part(args, clock: Clock, cfg, params, batch, compiler: Compiler,
               result: dict) -> None:
    """Part c into `result["parts"]["stages"]`, the JSON rewritten after each schedule;
    a schedule that fails is reported in `errors` and the others go on."""
    import jax

    from jaxpp_mpi._src.compiler.build import build_step

    n, device = args.num_microbatches, jax.devices()[0]
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    out: dict[str, Any] = {"schedules": {}}
    result["parts"]["stages"] = out
    errors = result.setdefault("errors", {})
    plans, thunks, refs = {}, {}, {}
    submitted, distinct = compiler.submitted, compiler.distinct
    start = time.perf_counter()
    for name in args.schedules:
        sched = schedule_by_name(name, 2)
        try:
            plans[name] = build_step(grad_step(bf16_loss(cfg, sched.num_stages), sched),
                                     structs, sched.mpmd_dim)
            thunks[name] = plan_executables(plans[name], device, compiler)
            if sched.num_stages not in refs:
                refs[sched.num_stages] = submit_references(cfg, sched.num_stages, params,
                                                           batch, compiler)
        except Exception as e:  # noqa: BLE001 - reported, the other schedules go on
            errors[f"stages/{name}"] = f"planning: {e!r}"
            traceback.print_exc()
            continue
        clock.log(f"{name}: planned, {len(thunks[name])} executables submitted")
    summed = compiler.wait()
    out["compile"] = {"modules_submitted": compiler.submitted - submitted,
                      "modules_compiled": compiler.distinct - distinct,
                      "wall_s": time.perf_counter() - start, "summed_s": summed,
                      "threads": args.compile_threads}
    clock.log(f"part c compiled: {out['compile']}")
    cache: dict[Any, Any] = {}

    def arrays(aval):
        if aval not in cache:
            cache[aval] = random_arrays([aval], len(cache))[0]
        return cache[aval]

    for name in plans:
        if clock.elapsed() > args.budget_s:
            result.setdefault("skipped", {})[f"stages/{name}"] = f"past --budget-s {args.budget_s}"
            continue
        plan, sched = plans[name], schedule_by_name(name, 2)
        count = counts(plan.program)
        try:
            runs = {key: thunk() for key, thunk in thunks[name].items()}
            stages = []
            for s in range(sched.num_stages):
                g = next(g for g, exes in enumerate(plan.exes)
                         for e in exes.values() if exe_stage(e) == s)
                future, ref_args = refs[sched.num_stages][s]
                row = time_stage(plan, g, s, runs, future.result()[0], ref_args, arrays,
                                 args.rounds, n)
                row["executables_per_microbatch"] = count["executables_per_microbatch"].get(s)
                row["by_kind"] = count["by_kind"].get(s)
                stages.append(row)
        except Exception as e:  # noqa: BLE001 - reported, the other schedules go on
            errors[f"stages/{name}"] = repr(e)
            traceback.print_exc()
            continue
        finally:
            runs = None
        out["schedules"][name] = {
            "schedule": repr(sched), "stages": stages, "peak_bytes": peak_bytes(),
            "streamed_ms": sum(st["streamed_ms"] for st in stages),
            "jit_streamed_ms": sum(st["jit_streamed_ms"] for st in stages),
            "per_group": count["per_group"]}
        clock.log(f"{name}: stage ratios (streamed) "
                  + ", ".join(f"{st['stage_ratio']:.3f}" for st in stages) + "; alone "
                  + ", ".join(f"{st['stage_ratio_alone']:.3f}" for st in stages))
        write_json(args.out, result)
