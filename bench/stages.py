"""Each stage's executables against `jax.jit` of the same stage alone, on one device.

    launch/jpprun -n 1 python bench/stages.py --out bench/results/stages.json   # CPU, 1 core
    python bench/stages.py --out bench/results/stages_gpu.json                  # one GPU

The workload is bench/schedules.py's. Per schedule, the step is compiled into
its plan (`build_step`: no devices), and every executable of every group is compiled on
this process's first device and timed alone, inputs of its avals (`--rows` etc. as in
bench/schedules.py). Per stage, the reference is one `jax.jit` of that stage's share of
the single-process step for one microbatch: its blocks' forward and backward (with the
loss on the last stage, without an input gradient on the first), the weight gradients
added into a donated accumulator, as the `lax.scan` body of bench/schedules.py's
reference does. The rounds take turns: per round, per stage (rotated), the reference
once and each of the stage's executables once; and the whole single-process step once.

Reported per schedule and stage (per microbatch, medians over the rounds):
- `tasks_ms`: the stage's executables as the program runs them (each Run of the group's
  program at its executable's median, summed, over the microbatches), by kind (F, B, I, W);
- `jit_ms`: the reference; `ratio` = tasks_ms / jit_ms: what splitting the stage's work
  into the schedule's tasks costs (or saves) on this device, messages and the pipeline's
  order aside;
- `flops_ratio`: the tasks' XLA FLOPs over the reference's;
- `compile_s`: XLA compile seconds of the stage's executables the runtime compiles (a
  `_first` variant it builds from its plain variant is left out), against the
  reference's `jit_compile_s`.
And per schedule, the stages' sums against the whole step's `jax.jit` over the microbatches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, schedules.py

from _common import (  # noqa: E402
    add_block_options,
    block_options,
    metadata,
    random_arrays,
    timed_call_ms,
    write_json,
)
from schedules import block, loss_fn, make_data, pipelined_step, reference_step  # noqa: E402

from jaxpp_mpi.schedules import schedule_by_name  # noqa: E402 - no JAX import


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_block_options(
        p,
        schedules=("gpipe", "zerobubble", "interleaved", "dualpipev"),
        width=1024,
        ffn=4096,
        repeats=10,
        repeats_help="rounds (each: every stage's reference and executables once)",
        quick_help="smoke run: d=256, 3 rounds",
    )
    p.add_argument("--out", default="bench/results/stages.json")
    return block_options(p, p.parse_args(argv))


def forward(params, x):
    for p in params:
        x = block(p, x)
    return x


def stage_reference(stage: int, num_stages: int, num_microbatches: int):
    """One microbatch of stage `stage`'s share of the single-process step.

    `fn(acc, params, x, t)`: `t` is the target on the last stage and the output's
    cotangent elsewhere; returns the accumulated weight gradients, then the input
    gradient (not on the first stage), then the forward output (not on the last) or
    the loss (on the last).
    """
    import jax
    import jax.numpy as jnp

    first, last = stage == 0, stage == num_stages - 1
    argnums = (0,) if first else (0, 1)

    def fn(acc, params, x, t):
        if last:
            def loss(params, x):
                return jnp.mean((forward(params, x) - t) ** 2) / num_microbatches

            out, grads = jax.value_and_grad(loss, argnums)(params, x)
        else:
            if first:
                out, vjp = jax.vjp(lambda params: forward(params, x), params)
            else:
                out, vjp = jax.vjp(forward, params, x)
            grads = vjp(t)
        acc = jax.tree.map(jnp.add, acc, grads[0])
        return (acc, *grads[1:], out)

    return fn


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpp_mpi._src.compiler.build import build_step
    from jaxpp_mpi._src.compiler.exes import first_from_plain
    from jaxpp_mpi._src.driver.group_compiler import flops
    from jaxpp_mpi._src.ir.program import Run

    n = args.num_microbatches
    np_params, np_batch = make_data(args)
    params = jax.tree.map(jnp.asarray, np_params)
    batch = jax.tree.map(jnp.asarray, np_batch)
    whole = jax.jit(reference_step(n)).lower(params, batch).compile()
    jax.block_until_ready(whole(params, batch))
    mb = (batch[0][0], batch[1][0])

    # Per schedule: every executable compiled here, and how often its program runs it.
    exes: dict[str, dict[tuple[int, str], Any]] = {}
    for name in args.schedules:
        sched = schedule_by_name(name, 2)
        plan = build_step(pipelined_step(sched, n), (np_params, np_batch), sched.mpmd_dim)
        exes[name] = {}
        for g, group_exes in enumerate(plan.exes):
            runs = [i.exe for i in plan.program.group(g).instrs if isinstance(i, Run)]
            for k, (ename, exe) in enumerate(sorted(group_exes.items())):
                ins, _ = plan.exe_avals[g][ename]
                structs = [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype)) for a in ins]
                start = time.perf_counter()
                compiled = jax.jit(exe.fn, donate_argnums=exe.donate_argnums).lower(
                    *structs).compile()
                compile_s = time.perf_counter() - start
                exes[name][g, ename] = {
                    "compiled": compiled,
                    "args": random_arrays(ins, seed=k),
                    "donated": tuple(exe.donate_argnums),
                    # a family is its kinds and its stage: 'B1', or 'FB1' for a fused
                    # pair (`Note: back-to-back tasks` in compiler/loop_order.py)
                    "stage": int(exe.family.lstrip("FBIW")),
                    "kind": exe.family.rstrip("0123456789"),
                    "runs": runs.count(ename),
                    "flops": flops(compiled),
                    "compile_s": compile_s,
                    # built by the runtime from its plain variant (`Note: first variants`)
                    "shared": first_from_plain(group_exes, plan.exe_avals[g], ename) is not None,
                    "ms": [],
                }
        print(f"{name}: {len(exes[name])} executables compiled", flush=True)

    # Per number of stages: each stage's reference, compiled with its accumulator donated.
    refs: dict[tuple[int, int], dict[str, Any]] = {}
    for name in args.schedules:
        num_stages = schedule_by_name(name, 2).num_stages
        per = args.blocks // num_stages
        for s in range(num_stages):
            if (num_stages, s) in refs:
                continue
            ps = params[s * per:(s + 1) * per]
            acc = jax.tree.map(jnp.zeros_like, ps)
            x = mb[0] if s == 0 else random_arrays([mb[0]], seed=100 + s)[0]
            t = mb[1] if s == num_stages - 1 else random_arrays([mb[0]], seed=200 + s)[0]
            fn = stage_reference(s, num_stages, n)
            start = time.perf_counter()
            compiled = jax.jit(fn, donate_argnums=(0,)).lower(acc, ps, x, t).compile()
            refs[num_stages, s] = {"compiled": compiled, "args": [acc, ps, x, t],
                                   "flops": flops(compiled), "ms": [],
                                   "compile_s": time.perf_counter() - start}

    def run_ref(ref) -> float:  # the accumulator (argument 0) is donated
        return timed_call_ms(ref["compiled"], ref["args"], (0,))

    for e in (e for per in exes.values() for e in per.values()):  # warm-up
        timed_call_ms(e["compiled"], e["args"], e["donated"])
    for ref in refs.values():
        run_ref(ref)

    whole_ms: list[float] = []
    units = [(name, s) for name in args.schedules
             for s in range(schedule_by_name(name, 2).num_stages)]
    for r in range(args.repeats):
        k = r % len(units)
        for name, s in units[k:] + units[:k]:
            ref = refs[schedule_by_name(name, 2).num_stages, s]
            ref["ms"].append(run_ref(ref))
            for e in exes[name].values():
                if e["stage"] == s:
                    e["ms"].append(timed_call_ms(e["compiled"], e["args"], e["donated"]))
        start = time.perf_counter()
        jax.block_until_ready(whole(params, batch))
        whole_ms.append((time.perf_counter() - start) * 1e3)

    one = jax.jit(jax.value_and_grad(partial(loss_fn, num_microbatches=n)))
    whole_flops = n * flops(one.lower(params, mb).compile())
    results: dict[str, Any] = {}
    for name in args.schedules:
        num_stages = schedule_by_name(name, 2).num_stages
        stages = []
        for s in range(num_stages):
            mine = [(ename, e) for (g, ename), e in exes[name].items() if e["stage"] == s]
            by_kind: dict[str, float] = {}
            for _, e in mine:
                by_kind[e["kind"]] = by_kind.get(e["kind"], 0.0) + (
                    e["runs"] * float(np.median(e["ms"])) / n)
            ref = refs[num_stages, s]
            tasks_ms = sum(by_kind.values())
            jit_ms = float(np.median(ref["ms"]))
            flops = sum(e["runs"] * e["flops"] for _, e in mine) / n
            stages.append({
                "stage": s,
                "tasks_ms": tasks_ms,
                "tasks_ms_by_kind": by_kind,
                "jit_ms": jit_ms,
                "ratio": tasks_ms / jit_ms,
                "flops_ratio": flops / ref["flops"] if ref["flops"] else None,
                "compile_s": sum(e["compile_s"] for _, e in mine if not e["shared"]),
                "jit_compile_s": ref["compile_s"],
                "executables": {f"{g}:{ename}": {"runs": e["runs"], "ms": float(np.median(e["ms"])),
                                                 "flops": e["flops"], "compile_s": e["compile_s"],
                                                 "built_from_plain": e["shared"]}
                                for (g, ename), e in exes[name].items() if e["stage"] == s},
            })
        results[name] = {
            "schedule": repr(schedule_by_name(name, 2)),
            "stages": stages,
            "tasks_ms": sum(st["tasks_ms"] for st in stages),
            "jit_stages_ms": sum(st["jit_ms"] for st in stages),
        }
    jit_mb_ms = float(np.median(whole_ms)) / n
    result = {
        "benchmark": "stages",
        **metadata(),
        "device": str(jax.devices()[0]),
        "platform": jax.devices()[0].platform,
        "width": args.width, "ffn": args.ffn, "blocks": args.blocks, "rows": args.rows,
        "num_microbatches": n, "repeats": args.repeats,
        "jit_ms_per_microbatch": jit_mb_ms,
        "jit_flops_per_microbatch": whole_flops / n,
        "schedules": results,
    }
    write_json(args.out, result)
    print(f"device {result['device']}; whole step's jax.jit: {jit_mb_ms:.2f} ms per microbatch")
    print(f"{'schedule':<12} {'stage':>5} {'tasks':>8} {'jit':>8} {'ratio':>6} {'flops':>6}"
          f" {'compile':>8} {'jit':>6}  by kind")
    for name, r in results.items():
        for st in r["stages"]:
            kinds = " ".join(f"{k}={v:.2f}" for k, v in st["tasks_ms_by_kind"].items())
            print(f"{name:<12} {st['stage']:>5} {st['tasks_ms']:>8.2f} {st['jit_ms']:>8.2f} "
                  f"{st['ratio']:>6.3f} {st['flops_ratio'] or 0:>6.3f} "
                  f"{st['compile_s']:>7.2f}s {st['jit_compile_s']:>5.2f}s  {kinds}")
        print(f"{name:<12} {'all':>5} {r['tasks_ms']:>8.2f} {r['jit_stages_ms']:>8.2f} "
              f"{r['tasks_ms'] / r['jit_stages_ms']:>6.3f}         whole step's jit "
              f"{jit_mb_ms:.2f}: {r['tasks_ms'] / jit_mb_ms:.3f}")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
