"""Point-to-point bandwidth and latency: the runtime's transfer path vs raw mpi4py.

Run with 2 ranks:  launch/jpprun -n 2 python bench/p2p.py --out bench/results/p2p.json

Both sides ping-pong the same bytes between rank 0 and rank 1 in the same run:
- `jaxpp_mpi`: jitted `transport.send` / `transport.recv` on jax arrays (what the MPI
  executor runs for a one-device group);
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

from jaxpp_mpi._src.runtime import transport

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _median_round_trip(step, reps: int) -> float:
    step()  # warm-up (compiles the jitted side)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_size(comm, nbytes: int, reps: int) -> dict:
    rank, peer = comm.rank, 1 - comm.rank
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    buf = np.arange(n, dtype=np.float32)
    out = np.empty_like(buf)

    send = jax.jit(lambda x: transport.send(x, peer, 0, comm))
    recv = jax.jit(lambda: transport.recv((n,), jnp.float32, peer, 0, comm))

    def jax_step():
        if rank == 0:
            send(x)
            recv().block_until_ready()
        else:
            y = recv()
            send(y)

    def mpi4py_step():
        if rank == 0:
            comm.Send(buf, dest=peer, tag=1)
            comm.Recv(out, source=peer, tag=1)
        else:
            comm.Recv(out, source=peer, tag=1)
            comm.Send(out, dest=peer, tag=1)

    comm.Barrier()
    t_jax = _median_round_trip(jax_step, reps) / 2
    comm.Barrier()
    t_raw = _median_round_trip(mpi4py_step, reps) / 2
    return {
        "bytes": nbytes,
        "jaxpp_mpi_latency_us": t_jax * 1e6,
        "mpi4py_latency_us": t_raw * 1e6,
        "jaxpp_mpi_GBps": nbytes / t_jax / 1e9,
        "mpi4py_GBps": nbytes / t_raw / 1e9,
        "bandwidth_ratio": t_raw / t_jax,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/p2p.json")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    comm = transport.world_dup()
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
            "mpi": transport.library_version(),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"{'bytes':>10} {'jaxpp_mpi us':>13} {'mpi4py us':>10} "
              f"{'jaxpp GB/s':>10} {'mpi4py GB/s':>11} {'ratio':>6}")
        for r in rows:
            print(f"{r['bytes']:>10} {r['jaxpp_mpi_latency_us']:>13.1f} "
                  f"{r['mpi4py_latency_us']:>10.1f} {r['jaxpp_mpi_GBps']:>10.3f} "
                  f"{r['mpi4py_GBps']:>11.3f} {r['bandwidth_ratio']:>6.2f}")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
