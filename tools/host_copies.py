"""Device-to-host and host-to-device copies of one message, by every way JAX offers.

A diagnostic for the GPU machine (tools/gpu_check.sh's `hostcopies` step):
  python tools/host_copies.py --out host_copies.json
Smoke run (CPU):  python tools/host_copies.py --quick --out /tmp/host_copies.json

A staged message (`Note: staged messages` in jaxpp_mpi/_src/mpi/staged.py) crosses host
memory twice: the sender copies the activation to host, the receiver copies the received
bytes to its device. Today the sender takes `np.asarray` after `copy_to_host_async` and
the receiver hands a fresh `np.empty` buffer, filled by MPI, to `jax.device_put`: both
ends in pageable memory. This measures, per message size (one process, `jax.devices()[0]`,
median of `--reps` after a warm-up), what each alternative costs, so that the staged path
takes the fastest:
- `d2h_pageable`: `copy_to_host_async` then `np.asarray` (today's send side);
- `d2h_pinned`: `jax.device_put` into the device's `pinned_host` memory, then
  `np.asarray` of that array (`d2h_pinned_view`: that last read alone: zero-copy when
  JAX hands out the pinned buffer itself);
- `h2d_fresh`: `jax.device_put` of a freshly allocated, filled numpy buffer (today's
  receive side: MPI writes into new memory, then the copy);
- `h2d_reused`: the same from one buffer reused across messages (no page faults);
- `h2d_pinned`: `jax.device_put` of an array in `pinned_host` memory to the device.
Every copy is checked against the source's values once. The JSON names the device and
JAX's version; GB/s are bytes over median seconds (for D2H, seconds less the copy that
makes the fresh source array on the device, `source_copy_s`; null where not above it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

SIZES = [4 << 10, 256 << 10, 4 << 20, 25 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 1 << 20]


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: compiles, first allocations
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ready(x: jax.Array) -> jax.Array:
    return x.block_until_ready()


def bench_size(device, nbytes: int, reps: int) -> dict:
    """One row: seconds and GB/s of every copy of an `nbytes` float32 message."""
    n = nbytes // 4
    source = np.arange(n, dtype=np.float32)
    on_device = jax.device_put(source, device).block_until_ready()
    memories = {m.kind for m in device.addressable_memories()}
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    to_device = SingleDeviceSharding(device, memory_kind=device.default_memory().kind)
    fresh_source = lambda: jax.device_put(source + 0, device)  # noqa: E731 - a new buffer

    def d2h_pageable():
        x = fresh_source()
        x.copy_to_host_async()
        return np.asarray(x)

    def d2h_pinned():
        x = fresh_source()
        return np.asarray(_ready(jax.device_put(x, pinned)))

    def h2d_fresh():
        host = np.empty(n, np.float32)
        host[...] = source  # as MPI writes a received message into new memory
        return _ready(jax.device_put(host, device))

    reused = np.empty(n, np.float32)

    def h2d_reused():
        reused[...] = source
        return _ready(jax.device_put(reused, device))

    row: dict = {"bytes": nbytes}
    # the fresh source array's own copy is in every D2H path: time it to subtract
    base = _median_s(lambda: _ready(fresh_source()), reps)
    steps = {"d2h_pageable": d2h_pageable, "h2d_fresh": h2d_fresh, "h2d_reused": h2d_reused}
    if "pinned_host" in memories:
        on_pinned = _ready(jax.device_put(on_device, pinned))
        view = lambda: np.asarray(jax.device_put(on_device, pinned))  # noqa: E731
        steps.update({"d2h_pinned": d2h_pinned,
                      "h2d_pinned": lambda: _ready(jax.device_put(on_pinned, to_device))})
        row["d2h_pinned_view_s"] = _median_s(lambda: np.asarray(on_pinned), reps)
        np.testing.assert_array_equal(view(), source)
    for name, fn in steps.items():
        out = fn()
        np.testing.assert_array_equal(np.asarray(out), source)
        seconds = _median_s(fn, reps)
        row[f"{name}_s"] = seconds
        if name.startswith("d2h"):  # less the source's own device copy (None: within noise)
            seconds -= base
        row[f"{name}_GBps"] = nbytes / seconds / 1e9 if seconds > 0 else None
    row["source_copy_s"] = base
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two small sizes, few reps (CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed copies per size (20; 3)")
    p.add_argument("--out", default="host_copies.json")
    args = p.parse_args()
    reps = args.reps or (3 if args.quick else 20)
    device = jax.devices()[0]
    rows = [bench_size(device, b, reps) for b in (QUICK_SIZES if args.quick else SIZES)]
    names = [k[:-5] for k in rows[0] if k.endswith("_GBps")]
    print(f"{'bytes':>10} " + " ".join(f"{n + ' GB/s':>17}" for n in names))
    for r in rows:
        print(f"{r['bytes']:>10} " + " ".join(f"{r.get(n + '_GBps') or float('nan'):>17.2f}"
                                              for n in names))
    result = {"tool": "host_copies", "machine": platform.node(), "cpus": os.cpu_count(),
              "jax": jax.__version__, "quick": args.quick, "device": device.device_kind,
              "platform": device.platform,
              "memories": sorted(m.kind for m in device.addressable_memories()),
              "reps": reps, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
