"""The planner's first choice against the measured step time of every schedule.

Run with 2 ranks:  launch/jpprun -n 2 python bench/planner.py --out bench/results/planner.json

Two workloads, each marked after every layer so that one step serves every split:
- `transformer`: examples/train.py's decoder (8 blocks, d=128, 4 heads, 64 tokens,
  vocabulary 2048, untied head), adam, 8 microbatches of 4 sequences;
- `mlp`: bench/schedules.py's residual blocks (8 blocks, d=512, ffn=2048), gradient
  sums, 8 microbatches of 16 rows: the workload where a zero-bubble schedule should win.
For each, rank 0 plans every schedule at 8 microbatches, 1 or 2 stages per group, with
the even split (`plan_schedules`, priced by XLA's FLOPs at the time per FLOP of the
step's costliest segment: `flops`), then both ranks compile every plan and time it,
round by round in rotated order (median and minimum step, barrier to barrier); one
traced step of Std1F1B gives task times (`collect_task_times_ms`), with which rank 0
plans again (`measured`). `ratio` = measured median step of a planner's first choice
/ the fastest median (1.0: it chose the fastest).
- `split`: the transformer with a 8192-token vocabulary (embedding and head 8x a
  block's weights), Std1F1B on 2 groups: the planner's stage split (`balance_stages`)
  against the even one (4 blocks per stage), both measured.
Messages are priced from bench/results/p2p.json. Rank 0 writes the JSON (`--out`).
"""

from __future__ import annotations

import argparse
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


def run_workload(name: str, w: dict[str, Any], mesh, comm, rounds: int, cost,
                 split: bool = False) -> dict:
    import jax
    import numpy as np

    import jaxpp_mpi
    from jaxpp_mpi._src.planner.plan import plan

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

    reference = next(k for k in keys if k[0] == "Std1F1B(num_stages=2)")
    with jaxpp_mpi.collect_task_times_ms() as stats:
        for _ in range(3):
            step(reference)
    task_ms: dict[str, float] = {}
    for part in comm.allgather({k: float(np.median(v)) for k, v in stats.items()}):
        task_ms.update(part)
    by_measured, measured_s = planned(balance_stages=False, task_times_ms=task_ms,
                                      measured_plan=plans[reference])
    say("planned with measured task times")
    fastest = min(keys, key=median.get)
    measured_rank = {key(p): i for i, p in enumerate(by_measured.plans)}
    rows = []
    for i, p in enumerate(by_flops.plans):
        m = by_measured.plans[measured_rank[key(p)]]
        rows.append({**describe(p), "rank_flops": i + 1, "predicted_measured_ms": m.step_ms,
                     "rank_measured": measured_rank[key(p)] + 1,
                     "measured_ms": median[key(p)], "measured_ms_min": min(times[key(p)]),
                     "measured_ms_all": times[key(p)]})

    def choice(p) -> dict[str, Any]:
        return {"schedule": repr(p.schedule), "stage_marks": list(p.stage_marks),
                "measured_ms": median[key(p)], "ratio": median[key(p)] / median[fastest],
                "reason": p.reason}

    return {"config": w["config"], "plans": rows,
            "fastest_measured": {"schedule": fastest[0], "stage_marks": list(fastest[1]),
                                 "measured_ms": median[fastest]},
            "first_choice_flops": choice(by_flops.plans[0]),
            "first_choice_measured": choice(by_measured.plans[0]),
            "planning_s": {"flops": flops_s, "measured": measured_s},
            "task_times_from": reference[0]}


def main() -> None:
    args = parse_args()
    import jax  # noqa: F401
    from mpi4py import MPI

    import jaxpp_mpi

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit(f"bench/planner.py runs on exactly 2 ranks, got {comm.size}")
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    message = load_message_cost(args.p2p)
    cost = (message.latency, message.bandwidth)
    rounds = 2 if args.quick else args.rounds
    builders = {"transformer": transformer, "mlp": mlp,
                "split": partial(transformer, vocab=8192)}
    result = {"benchmark": "planner", **metadata(), "ranks": 2, "quick": args.quick,
              "rounds": rounds, "message_cost": {"latency_ms": cost[0], "bytes_per_ms": cost[1]},
              "workloads": {}}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        result["workloads"][name] = r = run_workload(
            name, builders[name](args.quick), mesh, comm, rounds, cost, split=name == "split")
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
                  f"{r['first_choice_measured']['ratio']:.3f}", flush=True)
    if comm.rank == 0:
        write_json(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
