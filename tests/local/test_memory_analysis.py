"""`MpmdCompiled.memory_analysis()`: the device bytes each group holds over a step.

The reference is the executor itself: the local executor is run instruction by
instruction and, after each one, the bytes of every array its buffer table holds for a
group are added up per device (`addressable_shards`). The program's lifetime walk
(`Note: live bytes` in ir/memory.py) must give exactly that peak, and the step inputs'
bytes as its argument bytes; XLA's own analysis of each executable comes with it.
"""

from __future__ import annotations

import jax
import pytest
from models import make_step, mlp, schedule, transformer

import jaxpp_mpi as jp
from jaxpp_mpi._src.runtime import local

MODELS = {"mlp": mlp, "transformer": transformer}


def _device_bytes(x) -> int:
    return x.addressable_shards[0].data.nbytes


def _measured(compiled, args, monkeypatch) -> tuple[dict[int, int], dict[int, int]]:
    """Per group: the most bytes (per device) its table slots held after any step, and
    what they held before the first step (the bound inputs)."""
    executor = compiled._executor
    offsets = sorted(executor.layout.offsets.items(), key=lambda kv: kv[1])
    bounds = [(g, start, end) for (g, start), (_, end) in
              zip(offsets, [*offsets[1:], (None, executor.layout.size)])]
    peak: dict[int, int] = {g: 0 for g, _, _ in bounds}
    start: dict[int, int] = {}

    def held(table) -> dict[int, int]:
        out = {}
        for g, lo, hi in bounds:
            arrays = {id(x): x for x in table[lo:hi] if x is not None}
            out[g] = sum(_device_bytes(x) for x in arrays.values())
        return out

    def recording(steps, table):
        start.update(held(table))
        for step in steps.untimed:
            step(table, None)
            for g, b in held(table).items():
                peak[g] = max(peak[g], b)

    monkeypatch.setattr(local, "execute", recording)
    jax.block_until_ready(jax.tree.leaves(compiled(*args)))
    return peak, start


@pytest.mark.parametrize("model,sched,groups", [
    ("mlp", "gpipe", 2), ("mlp", "1f1b", 2), ("transformer", "zerobubble", 2),
    ("transformer", "interleaved", 2), ("mlp", "dualpipev", 2),
])
def test_peak_live_bytes_equal_what_the_executor_holds(model, sched, groups, monkeypatch):
    params, batch, loss_fn = MODELS[model](schedule(sched, groups).num_stages, 4)
    step, optimizer = make_step(loss_fn, schedule(sched, groups))
    state = optimizer.init(params)
    mesh = jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")
    compiled = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(state, params, batch)
    report = compiled.memory_analysis()
    peak, start = _measured(compiled, (state, params, batch), monkeypatch)
    for g in range(groups):
        r = report[g]
        assert r["peak_live_bytes"] == peak[g], (g, r["peak_at"])
        assert r["argument_bytes"] == start[g]
        assert r["peak_bytes"] >= r["peak_live_bytes"]
        names = {i.exe for i in compiled.program(g).instrs if hasattr(i, "exe")}
        assert set(r["per_executable"]) >= names
        assert all(s is None or s["temp_size_in_bytes"] >= 0
                   for s in r["per_executable"].values())


def test_sharded_group_bytes_are_per_device(monkeypatch):
    """Two devices per group, the batch split over "data": per-device bytes, halved."""
    params, batch, loss_fn = mlp(2, 4, rows=8)
    sched = schedule("1f1b", 2)
    step, optimizer = make_step(loss_fn, sched)
    state = optimizer.init(params)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 2), ("stage", "data")), "stage")
    data = jax.sharding.PartitionSpec(None, "data")
    compiled = jp.mpmd_jit_with_loop(
        step, mpmd_mesh=mesh, in_shardings=(None, None, (data, data))).compile(
            state, params, batch)
    report = compiled.memory_analysis()
    peak, start = _measured(compiled, (state, params, batch), monkeypatch)
    for g in range(2):
        assert report[g]["peak_live_bytes"] == peak[g]
        assert report[g]["argument_bytes"] == start[g]
