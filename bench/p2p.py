"""Point-to-point bandwidth and latency: the runtime's transfer path vs raw mpi4py.

Run with 2 ranks:  launch/jpprun -n 2 python bench/p2p.py --out bench/results/p2p.json

All sides ping-pong the same bytes between rank 0 and rank 1 in the same run, taking
turns rep by rep (so a noisy neighbour hurts all alike):
- `jaxpp_mpi`: the MPI executor's message chains (`_Messenger` of runtime/mpi.py, see
  `Note: message chains`): jitted mpi4jax FFI calls ordered by an order array;
- `mpi4jax_effect`: jitted `mpi4jax.send` / `mpi4jax.recv` with their ordered effect
  (the runtime's previous path, kept for comparison);
- `mpi4py`: `comm.Send` / `comm.Recv` on preallocated numpy buffers (the floor).
Latency is half the median round trip; bandwidth is bytes / latency.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.mpi import chains, collectives
from jaxpp_mpi._src.mpi.heap import tune_heap
from jaxpp_mpi._src.runtime.mpi import ShardPlan, _Messenger

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def bench_size(comm, nbytes: int, reps: int, paths: tuple[str, ...] | None = None) -> dict:
    """Ping-pong `nbytes` between ranks 0 and 1 on each path (all three if None)."""
    rank, peer = comm.rank, 1 - comm.rank
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    buf = np.arange(n, dtype=np.float32)
    out = np.empty_like(buf)

    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    plan = ShardPlan(Aval((n,), "float32"), NamedSharding(mesh, PartitionSpec()))
    messenger = _Messenger(comm)
    chain = chains.Chain(jax.devices()[0])
    (_, send), (_, recv) = messenger.send(plan, 0, peer), messenger.recv(plan, 0, peer)

    def chain_step():
        if rank == 0:
            (chain.order,) = send(chain.order, x)
            chain.order, y = recv(chain.order)
            y.block_until_ready()
        else:
            chain.order, y = recv(chain.order)
            (chain.order,) = send(chain.order, y)
            chain.wait()

    e_send = jax.jit(lambda x: collectives.send(x, peer, 1, comm))
    e_recv = jax.jit(lambda: collectives.recv((n,), jnp.float32, peer, 1, comm))

    def effect_step():
        if rank == 0:
            e_send(x)
            e_recv().block_until_ready()
        else:
            e_send(e_recv())
            jax.effects_barrier()

    def mpi4py_step():
        if rank == 0:
            comm.Send(buf, dest=peer, tag=2)
            comm.Recv(out, source=peer, tag=2)
        else:
            comm.Recv(out, source=peer, tag=2)
            comm.Send(out, dest=peer, tag=2)

    steps = {"jaxpp_mpi": chain_step, "mpi4jax_effect": effect_step, "mpi4py": mpi4py_step}
    steps = {k: v for k, v in steps.items() if paths is None or k in paths}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for step in steps.values():  # warm-up (compiles the jitted sides)
        step()
    for _ in range(reps):
        for name, step in steps.items():
            comm.Barrier()
            times[name].append(_timed(step))
    row: dict = {"bytes": nbytes}
    for name, ts in times.items():
        t = float(np.median(ts)) / 2
        row[f"{name}_latency_us"] = t * 1e6
        row[f"{name}_GBps"] = nbytes / t / 1e9
    if "jaxpp_mpi" in steps and "mpi4py" in steps:
        row["bandwidth_ratio"] = row["jaxpp_mpi_GBps"] / row["mpi4py_GBps"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/p2p.json")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-heap-tuning", action="store_true",
                        help="keep glibc's malloc defaults (see mpi/heap.py)")
    args = parser.parse_args()
    comm = collectives.world_dup()
    if not args.no_heap_tuning:  # as the MPI executor does (Note: large buffers)
        tune_heap()
    if comm.size != 2:
        raise SystemExit(f"bench/p2p.py needs exactly 2 ranks, got {comm.size}")
    rows = [bench_size(comm, s, args.reps if s < (16 << 20) else max(5, args.reps // 4))
            for s in SIZES]
    if comm.rank == 0:
        result = {
            "benchmark": "p2p",
            "machine": platform.node(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "mpi": collectives.library_version(),
            "heap_tuning": not args.no_heap_tuning,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"{'bytes':>10} {'jaxpp_mpi us':>13} {'effect us':>10} {'mpi4py us':>10} "
              f"{'jaxpp GB/s':>10} {'mpi4py GB/s':>11} {'ratio':>6}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['jaxpp_mpi_latency_us']:>13.1f} "
                  f"{r['mpi4jax_effect_latency_us']:>10.1f} "
                  f"{r['mpi4py_latency_us']:>10.1f} {r['jaxpp_mpi_GBps']:>10.3f} "
                  f"{r['mpi4py_GBps']:>11.3f} {r['bandwidth_ratio']:>6.2f}")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
