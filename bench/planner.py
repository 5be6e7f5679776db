"""The planner's first choice against the measured step time of every schedule.

Run with 2 ranks:  launch/jpprun -n 2 python bench/planner.py --out bench/results/planner.json

Two workloads, each marked after every layer so that one step serves every split:
- `transformer`: examples/train.py's decoder (8 blocks, d=128, 4 heads, 64 tokens,
  vocabulary 2048, untied head), adam, 8 microbatches of 4 sequences;
- `mlp`: bench/schedules.py's residual blocks (8 blocks, d=512, ffn=2048), gradient
  sums, 8 microbatches of 16 rows: the workload where a zero-bubble schedule should win.
For each, rank 0 plans every schedule at 8 microbatches, 1 or 2 stages per group, with
the even split (`plan_schedules`, priced by XLA's FLOPs at the time per FLOP of the
step's costliest segment, with the default runtime cost per instruction, `RuntimeCost()`:
`flops`), then both ranks compile every plan and time it, round by round in rotated
order (median and minimum step, barrier to barrier). One traced step of Std1F1B gives
task times (`collect_task_times_ms`, the median of 3 steps), with which rank 0 plans
again (`measured`). For reference: a traced step of Interleaved1F1B too (two stages per
group: the same work in twice the Runs) fits the cost of a Run to the traced steps
(`RuntimeCost.fit_to_traced_steps`), with which rank 0 plans by FLOPs again
(`flops_fitted_cost`); it plans by FLOPs with what the runtime's dispatch alone costs
(bench/results/dispatch.json: `dispatch_only`, about the model before runtime costs);
and it fits the costs of a Run and a message half to this run's own step times
(`steps_fit`: measured step less the step predicted without runtime costs, over the
Runs and message halves of the plan's busiest group; used for no choice). `ratio` =
measured median step of a planner's first choice / the fastest median (1.0: it chose
the fastest); `rank_agreement` is Spearman's rank correlation of a prediction with the
measured medians.
- `split`: the transformer with a 8192-token vocabulary (embedding and head 8x a
  block's weights), Std1F1B on 2 groups: the planner's stage split (`balance_stages`)
  against the even one (4 blocks per stage), both measured.
Messages are priced from bench/results/p2p.json. Rank 0 writes the JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/_common.py, schedules.py
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))  # train.py

from _common import load_message_cost, metadata, write_json  # noqa: E402

N = 8  # microbatches


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="transformer,mlp,split")
    p.add_argument("--rounds", type=int, default=9, help="timed steps of every plan")
    p.add_argument("--quick", action="store_true", help="smaller models, 2 rounds")
    p.add_argument("--p2p", default=os.path.join(HERE, "results", "p2p.json"))
    p.add_argument("--dispatch", default=os.path.join(HERE, "results", "dispatch.json"),
                   help="bench/dispatch.py's figures, for the dispatch-only reference")
    p.add_argument("--out", default=os.path.join(HERE, "results", "planner.json"))
    return p.parse_args(argv)


def transformer(quick: bool, vocab: int = 2048) -> dict[str, Any]:
    """examples/train.py's model, a mark after every block; adam; donated state."""
    import jax
    import optax
    import train

    import jaxpp_mpi

    cfg = train.ModelConfig(vocab=vocab // 4 if quick else vocab, hidden=64 if quick else 128,
                            heads=4, seq=32 if quick else 64, layers=8)
    optimizer = optax.adam(1e-3)
    step = train.make_train_step(partial(train.loss_fn, cfg=cfg, num_stages=cfg.layers),
                                 jaxpp_mpi.Interleaved1F1B(cfg.layers, 2), optimizer)
    params = train.init_params(jax.random.key(0), cfg)

    def fresh() -> tuple:
        copy = jax.tree.map(lambda x: x.copy(), params)
        return optimizer.init(copy), copy

    return {"step": step, "fresh": fresh, "batch": train.synthetic_batch(cfg, N, 4),
            "donate_argnums": (0, 1), "state_args": 2,
            "config": {"model": "examples/train.py", **vars(cfg), "optimizer": "adam",
                       "microbatches": N, "microbatch_size": 4}}


def mlp(quick: bool) -> dict[str, Any]:
    """bench/schedules.py's residual blocks, a mark after every block; gradient sums."""
    import jax
    import jax.numpy as jnp
    import schedules as blocks

    import jaxpp_mpi

    width, ffn, rows = (128, 512, 16) if quick else (512, 2048, 16)
    args = argparse.Namespace(width=width, ffn=ffn, blocks=8, rows=rows, num_microbatches=N)
    np_params, np_batch = blocks.make_data(args)
    loss = partial(blocks.loss_fn, num_stages=8, num_microbatches=N)

    def step(params, batch):
        return jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), params), batch,
                                 schedule=jaxpp_mpi.Interleaved1F1B(8, 2))

    params = jax.tree.map(jnp.asarray, np_params)
    return {"step": step, "fresh": lambda: (params,), "batch": jax.tree.map(jnp.asarray, np_batch),
            "donate_argnums": None, "state_args": 0,
            "config": {"model": "bench/schedules.py blocks", "width": width, "ffn": ffn,
                       "blocks": 8, "rows": rows, "microbatches": N}}


def describe(p) -> dict[str, Any]:
    return {"schedule": repr(p.schedule), "num_stages": p.schedule.num_stages,
            "stage_marks": list(p.stage_marks), "num_microbatches": p.num_microbatches,
            "predicted_ms": p.step_ms, "bubble": p.bubble, "peak_bytes": list(p.peak_bytes)}


def key(p) -> tuple:
    return (repr(p.schedule), tuple(p.stage_marks), p.num_microbatches)


def spearman(xs, ys) -> float:
    """Spearman's rank correlation of two sequences (no ties expected)."""
    import numpy as np

    def ranks(v):
        return np.argsort(np.argsort(np.asarray(v, dtype=float)))

    return float(np.corrcoef(ranks(xs), ranks(ys))[0, 1])


def cost_dict(c) -> dict[str, float]:
    return {"run_ms": c.run_ms, "message_ms": c.message_ms, "free_ms": c.free_ms}


def run_workload(name: str, w: dict[str, Any], mesh, comm, rounds: int, cost,
                 dispatch_cost=None, split: bool = False) -> dict:
    import jax
    import numpy as np

    import jaxpp_mpi
    from jaxpp_mpi._src.planner.plan import plan
    from jaxpp_mpi._src.planner.runtime_cost import (
        RuntimeCost,
        RuntimeSample,
        fit_runtime_cost,
        runtime_counts,
    )

    rank = comm.rank
    args = (*w["fresh"](), w["batch"])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    options = dict(mpmd_mesh=mesh, batch_argnums=len(args) - 1, num_microbatches=(N,),
                   donate_argnums=w["donate_argnums"], message_cost=cost,
                   stages_per_group=(1, 2))

    def planned(**kw):
        start = time.perf_counter()
        out = plan(w["step"], *abstract, **options, **kw) if rank == 0 else None
        return comm.bcast(out, root=0), time.perf_counter() - start

    if split:
        even, flops_s = planned(balance_stages=False, schedules=["1f1b"])
        chosen, _ = planned(balance_stages=True, schedules=["1f1b"])
        plans = {key(p): p for p in (even.plans[0], chosen.plans[0])}
    else:
        by_flops, flops_s = planned(balance_stages=False)
        plans = {key(p): p for p in by_flops.plans}
    say = (lambda what: print(f"  {name}: {what} ({time.perf_counter() - t0:.0f} s)",
                              flush=True)) if rank == 0 else (lambda what: None)
    t0 = time.perf_counter()
    say(f"planned {len(plans)} configurations")
    compiled = {}
    for k, p in plans.items():
        fn = jaxpp_mpi.mpmd_jit_with_loop(p.apply(w["step"]), mpmd_mesh=mesh,
                                          donate_argnums=w["donate_argnums"])
        state = w["fresh"]()
        compiled[k] = [fn.compile(*state, p.batch(w["batch"])), state, p.batch(w["batch"])]

    def step(k) -> None:
        fn, state, batch = compiled[k]
        out = fn(*state, batch)
        if w["state_args"]:
            compiled[k][1] = tuple(out[:w["state_args"]])
        jax.block_until_ready([x.first_mpmd_replica for x in jax.tree.leaves(out)
                               if x.is_partially_addressable])

    def timed(k) -> float:
        comm.Barrier()
        start = time.perf_counter()
        step(k)
        comm.Barrier()
        return (time.perf_counter() - start) * 1e3

    say("compiled them")
    keys = list(plans)
    for k in keys:  # warm-up
        step(k)
        step(k)
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(timed(k))

    say(f"timed {rounds} rounds")
    median = {k: float(np.median(v)) for k, v in times.items()}
    if split:
        e, c = even.plans[0], chosen.plans[0]
        return {"config": w["config"], "schedule": repr(e.schedule),
                "even": {**describe(e), "stage_ms": list(e.stage_ms),
                         "measured_ms": median[key(e)], "measured_ms_min": min(times[key(e)]),
                         "measured_ms_all": times[key(e)]},
                "chosen": {**describe(c), "stage_ms": list(c.stage_ms),
                           "measured_ms": median[key(c)],
                           "measured_ms_min": min(times[key(c)]),
                           "measured_ms_all": times[key(c)]},
                "speedup": median[key(e)] / median[key(c)], "planning_s": flops_s}

    def traced(k) -> dict[str, float]:
        with jaxpp_mpi.collect_task_times_ms() as stats:
            for _ in range(3):
                step(k)
        task_ms: dict[str, float] = {}
        for part in comm.allgather({label: float(np.median(v)) for label, v in stats.items()}):
            task_ms.update(part)
        return task_ms

    reference = next(k for k in keys if k[0] == "Std1F1B(num_stages=2)")
    two_stages = next(k for k in keys if k[0].startswith("Interleaved1F1B(num_stages=4,"))
    task_ms = traced(reference)
    fitted = RuntimeCost.fit_to_traced_steps([task_ms, traced(two_stages)])
    by_measured, measured_s = planned(balance_stages=False, task_times_ms=task_ms,
                                      measured_plan=plans[reference])
    by_fitted, _ = planned(balance_stages=False, runtime_cost=fitted)
    by_dispatch, _ = planned(balance_stages=False, runtime_cost=dispatch_cost)
    by_free, _ = planned(balance_stages=False, runtime_cost=RuntimeCost(0.0, 0.0, 0.0))
    say("planned with measured task times and runtime costs")
    fastest = min(keys, key=median.get)
    busiest = {k: max(runtime_counts(compiled[k][0].program()), key=lambda c: c["run"])
               for k in keys}
    runs = {k: busiest[k]["run"] for k in keys}
    free_ms = {key(p): p.step_ms for p in by_free.plans}
    steps_fit, _ = fit_runtime_cost(
        [RuntimeSample(busiest[k], median[k] - free_ms[k]) for k in keys],
        fit=("run", "message"), fixed=RuntimeCost(0.0, 0.0, 0.0))
    ways = {"flops": by_flops, "measured": by_measured, "flops_fitted_cost": by_fitted,
            "dispatch_only": by_dispatch}
    ranks = {way: {key(p): i + 1 for i, p in enumerate(found.plans)}
             for way, found in ways.items()}
    predicted = {way: {key(p): p.step_ms for p in found.plans} for way, found in ways.items()}
    rows = []
    for p in by_flops.plans:
        k = key(p)
        rows.append({**describe(p), "runs_busiest_group": runs[k],
                     "rank_flops": ranks["flops"][k],
                     "predicted_measured_ms": predicted["measured"][k],
                     "rank_measured": ranks["measured"][k],
                     "predicted_fitted_cost_ms": predicted["flops_fitted_cost"][k],
                     "rank_fitted_cost": ranks["flops_fitted_cost"][k],
                     "predicted_dispatch_only_ms": predicted["dispatch_only"][k],
                     "rank_dispatch_only": ranks["dispatch_only"][k],
                     "measured_ms": median[k], "measured_ms_min": min(times[k]),
                     "measured_ms_all": times[k]})

    def choice(p) -> dict[str, Any]:
        return {"schedule": repr(p.schedule), "stage_marks": list(p.stage_marks),
                "measured_ms": median[key(p)], "ratio": median[key(p)] / median[fastest],
                "reason": p.reason}

    return {"config": w["config"], "plans": rows,
            "fastest_measured": {"schedule": fastest[0], "stage_marks": list(fastest[1]),
                                 "measured_ms": median[fastest]},
            **{f"first_choice_{way}": choice(found.plans[0]) for way, found in ways.items()},
            "rank_agreement": {way: spearman([predicted[way][k] for k in keys],
                                             [median[k] for k in keys]) for way in ways},
            "runtime_cost": {"default": cost_dict(by_flops.runtime_cost),
                             "fitted_to_traced_steps": cost_dict(fitted),
                             "dispatch_only": cost_dict(dispatch_cost),
                             "steps_fit": cost_dict(steps_fit)},
            "planning_s": {"flops": flops_s, "measured": measured_s},
            "task_times_from": reference[0], "run_cost_from": [reference[0], two_stages[0]]}


def main() -> None:
    args = parse_args()
    import jax  # noqa: F401
    from mpi4py import MPI

    import jaxpp_mpi
    from jaxpp_mpi._src.planner.runtime_cost import RuntimeCost

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit(f"bench/planner.py runs on exactly 2 ranks, got {comm.size}")
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    message = load_message_cost(args.p2p)
    cost = (message.latency, message.bandwidth)
    with open(args.dispatch) as f:
        dispatch_cost = RuntimeCost.from_dispatch(json.load(f))
    rounds = 2 if args.quick else args.rounds
    builders = {"transformer": transformer, "mlp": mlp,
                "split": partial(transformer, vocab=8192)}
    result = {"benchmark": "planner", **metadata(), "ranks": 2, "quick": args.quick,
              "rounds": rounds, "message_cost": {"latency_ms": cost[0], "bytes_per_ms": cost[1]},
              "workloads": {}}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        result["workloads"][name] = r = run_workload(
            name, builders[name](args.quick), mesh, comm, rounds, cost, dispatch_cost,
            split=name == "split")
        if comm.rank == 0 and name == "split":
            print(f"split ({time.perf_counter() - start:.0f} s): marks "
                  f"{r['chosen']['stage_marks']} {r['chosen']['measured_ms']:.1f} ms against "
                  f"even {r['even']['stage_marks']} {r['even']['measured_ms']:.1f} ms", flush=True)
        elif comm.rank == 0:
            print(f"{name} ({time.perf_counter() - start:.0f} s): fastest "
                  f"{r['fastest_measured']['schedule']} {r['fastest_measured']['measured_ms']:.1f} "
                  f"ms; flops choice {r['first_choice_flops']['schedule']} ratio "
                  f"{r['first_choice_flops']['ratio']:.3f}; measured choice "
                  f"{r['first_choice_measured']['schedule']} ratio "
                  f"{r['first_choice_measured']['ratio']:.3f}; with a Run fitted at "
                  f"{r['runtime_cost']['fitted_to_traced_steps']['run_ms']:.3f} ms "
                  f"{r['first_choice_flops_fitted_cost']['schedule']} ratio "
                  f"{r['first_choice_flops_fitted_cost']['ratio']:.3f}; dispatch-only choice "
                  f"{r['first_choice_dispatch_only']['schedule']} ratio "
                  f"{r['first_choice_dispatch_only']['ratio']:.3f}", flush=True)
    if comm.rank == 0:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
