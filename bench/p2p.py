"""Point-to-point bandwidth and latency: the runtime's transfer path vs raw mpi4py.

Run with 2 ranks:  launch/jpprun -n 2 python bench/p2p.py --out bench/results/p2p.json

All sides ping-pong the same bytes between rank 0 and rank 1 in the same run, taking
turns rep by rep (so a noisy neighbour hurts all alike):
- `jaxpp_mpi`: the MPI executor's message chains (`Messenger` of runtime/shards.py, see
  `Note: message chains`): jitted mpi4jax FFI calls ordered by an order array;
- `mpi4jax_effect`: jitted `mpi4jax.send` / `mpi4jax.recv` with their ordered effect
  (the runtime's previous path, kept for comparison);
- `mpi4py`: `comm.Send` / `comm.Recv` on preallocated numpy buffers (the floor).
Latency is half the median round trip; bandwidth is bytes / latency.

`--device gpu`: the same message chains on GPU buffers (each rank's `jax.devices()[0]`;
two ranks may share one GPU: start them with XLA_PYTHON_CLIENT_PREALLOCATE=false, e.g.
`XLA_PYTHON_CLIENT_PREALLOCATE=false mpirun -n 2 -x XLA_PYTHON_CLIENT_PREALLOCATE
python bench/p2p.py --device gpu`), default out bench/results/p2p_gpu.json:
- `device_mpi`: GPU buffers handed to MPI (mpi4jax's `MPI4JAX_USE_CUDA_MPI=1` path); run
  only where the CUDA-aware MPI check accepts this MPI (`Note: CUDA-aware MPI check`),
  else its columns are null and `device_mpi` in the JSON says why;
- `host_staged`: mpi4jax copies each message through host memory (`=0`);
- `device_copy`: one copy of the same bytes on rank 0's GPU, no MPI (the floor; its
  latency is the whole copy).
mpi4jax reads `MPI4JAX_USE_CUDA_MPI` once per process, but its CUDA calls read the mode
it sets on each execution: the bench sets that mode itself before each path's turn
(`_set_cuda_mpi`), so the first two alternate rep by rep like the CPU paths; the
variable's own value does not matter here. Rank 0 checks the round trip's values once per
path and size.
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
from jaxpp_mpi._src.runtime.shards import Messenger, ShardPlan

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
    messenger = Messenger(comm)
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


# --- GPU buffers -------------------------------------------------------------------------

def _set_cuda_mpi(enabled: bool) -> None:
    """mpi4jax's CUDA mode for the calls executed from now on: GPU buffers to MPI
    (`enabled`) or copied through host memory. Its set-up (which reads
    `MPI4JAX_USE_CUDA_MPI` once, at the first GPU lowering) runs first, so it cannot
    override this later."""
    from mpi4jax._src.decorators import setup_cuda_mpi
    from mpi4jax._src.xla_bridge import mpi_xla_bridge_cuda

    os.environ.setdefault("MPI4JAX_USE_CUDA_MPI", "0")  # its set-up warns when unset
    setup_cuda_mpi()
    mpi_xla_bridge_cuda.set_copy_to_host(not enabled)


def device_mpi_verdict(comm) -> str | None:
    """None when every rank's CUDA-aware MPI check accepts GPU buffers, else why not
    (the same text on both ranks)."""
    from jaxpp_mpi._src.mpi.cuda_mpi import cuda_mpi_problem

    problem = cuda_mpi_problem([jax.devices()[0].platform], {"MPI4JAX_USE_CUDA_MPI": "1"})
    problems = [(r, p) for r, p in enumerate(comm.allgather(problem)) if p]
    return f"rank {problems[0][0]}: {problems[0][1]}" if problems else None


def bench_gpu_size(comm, nbytes: int, reps: int, device_mpi: bool) -> dict:
    """Ping-pong `nbytes` of GPU memory between ranks 0 and 1, through MPI
    (`device_mpi` only when the check accepted it) and staged through host memory, and
    one device-to-device copy of them on rank 0."""
    rank, peer = comm.rank, 1 - comm.rank
    device = jax.devices()[0]
    n = nbytes // 4
    x = jax.device_put(np.arange(n, dtype=np.float32), device)
    mesh = jax.make_mesh((1,), ("data",), devices=[device])
    plan = ShardPlan(Aval((n,), "float32"), NamedSharding(mesh, PartitionSpec()))
    messenger = Messenger(comm)
    chain = chains.Chain(device)
    (_, send), (_, recv) = messenger.send(plan, 0, peer), messenger.recv(plan, 0, peer)
    copy = jax.jit(jnp.copy)

    def chain_step():
        if rank == 0:
            (chain.order,) = send(chain.order, x)
            chain.order, y = recv(chain.order)
            return y.block_until_ready()
        chain.order, y = recv(chain.order)
        (chain.order,) = send(chain.order, y)
        chain.wait()
        return None

    def on(enabled):  # one path of the chains: mpi4jax's CUDA mode set first
        def step():
            _set_cuda_mpi(enabled)
            return chain_step()
        return step

    def copy_step():
        if rank == 0:
            return copy(x).block_until_ready()
        return None

    steps = {"host_staged": on(False), "device_copy": copy_step}
    if device_mpi:
        steps = {"device_mpi": on(True), **steps}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for name, step in steps.items():  # warm-up (compiles), and the values
        comm.Barrier()
        y = step()
        if rank == 0 and not np.array_equal(np.asarray(y), np.asarray(x)):
            raise SystemExit(f"bench/p2p.py: {name} at {nbytes} bytes returned wrong values")
    for _ in range(reps):
        for name, step in steps.items():
            comm.Barrier()
            times[name].append(_timed(step))
    row: dict = {"bytes": nbytes}
    for name in ("device_mpi", "host_staged", "device_copy"):
        if name not in times:
            row[f"{name}_latency_us"] = row[f"{name}_GBps"] = None
            continue
        # Rank 0 reports (rank 1 does not copy); a copy is one way, a ping-pong two.
        t = float(np.median(times[name]))
        t = t if name == "device_copy" else t / 2
        row[f"{name}_latency_us"] = t * 1e6
        row[f"{name}_GBps"] = nbytes / t / 1e9
    return row


def _gpu_table(rows: list[dict]) -> None:
    def cell(v, fmt):
        return f"{'-':>{len(format(0.0, fmt))}}" if v is None else format(v, fmt)

    print(f"{'bytes':>10} {'device-MPI us':>13} {'staged us':>10} {'copy us':>9} "
          f"{'device GB/s':>11} {'staged GB/s':>11} {'copy GB/s':>9}")
    for r in rows:
        print(f"{r['bytes']:>10} {cell(r['device_mpi_latency_us'], '>13.1f')} "
              f"{cell(r['host_staged_latency_us'], '>10.1f')} "
              f"{cell(r['device_copy_latency_us'], '>9.1f')} "
              f"{cell(r['device_mpi_GBps'], '>11.3f')} "
              f"{cell(r['host_staged_GBps'], '>11.3f')} {cell(r['device_copy_GBps'], '>9.2f')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="JSON result (default bench/results/p2p.json, or "
                             "p2p_gpu.json with --device gpu)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="where the buffers live (gpu: see the module docstring)")
    parser.add_argument("--no-heap-tuning", action="store_true",
                        help="keep glibc's malloc defaults (see mpi/heap.py)")
    args = parser.parse_args()
    if args.out is None:
        args.out = f"bench/results/p2p{'_gpu' if args.device == 'gpu' else ''}.json"
    comm = collectives.world_dup()
    if not args.no_heap_tuning:  # as the MPI executor does (Note: large buffers)
        tune_heap()
    if comm.size != 2:
        raise SystemExit(f"bench/p2p.py needs exactly 2 ranks, got {comm.size}")
    if args.device == "gpu":
        main_gpu(comm, args)
        return
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


def main_gpu(comm, args) -> None:
    """`--device gpu`: the rows of `bench_gpu_size`, JSON and a table from rank 0."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit(f"bench/p2p.py --device gpu: this rank's first device is {device}")
    import mpi4jax

    if not mpi4jax.has_cuda_support():
        raise SystemExit("bench/p2p.py --device gpu: mpi4jax was built without its CUDA "
                         "part (build it from source with CUDA_PATH set)")
    refused = device_mpi_verdict(comm)
    if comm.rank == 0:
        print("device_mpi:", "accepted" if refused is None else f"skipped: {refused}",
              flush=True)
    rows = [bench_gpu_size(comm, s, args.reps if s < (16 << 20) else max(5, args.reps // 4),
                           device_mpi=refused is None)
            for s in SIZES]
    if comm.rank == 0:
        result = {
            "benchmark": "p2p",
            "device": "gpu",
            "gpu": device.device_kind,
            "machine": platform.node(),
            "jax": jax.__version__,
            "mpi": collectives.library_version(),
            "device_mpi": "accepted" if refused is None else f"skipped: {refused}",
            "heap_tuning": not args.no_heap_tuning,
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        _gpu_table(rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
