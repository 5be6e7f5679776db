"""A rank of bench/ranks.py: the tiny transformer of examples/train.py on P stages x R
replicas, timing the way from the launch to the first step; rank 0 writes the JSON.

    (started by bench/ranks.py) python bench/_ranks_rank.py OUT.json LAUNCHED_AT REPLICAS

Milestones, in seconds since LAUNCHED_AT (the launcher's start, wall clock), the latest
over the ranks: `imported` (JAX and jaxpp_mpi imported), `mesh` (make_mpmd_mesh
returned), `compiled` (the step compiled), `first_step` (its first call done, results
ready). `mesh_s`: make_mpmd_mesh alone, timed from a barrier (the ranks' mesh agreement
and the communicators made from it), the slowest rank's.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                "examples"))


def main(out: str, launched_at: float, replicas: int) -> None:
    import jax
    import numpy as np
    import optax
    from train import ModelConfig, init_params, loss_fn, make_train_step, synthetic_batch

    import jaxpp_mpi
    from jaxpp_mpi.launch import launcher_world_size
    from jaxpp_mpi.schedules import schedule_by_name

    marks = {"imported": time.time() - launched_at}
    from mpi4py import MPI  # after jaxpp_mpi: MPI is up by now under jpprun anyway

    world = MPI.COMM_WORLD
    world.Barrier()
    start = time.perf_counter()
    stages = launcher_world_size(os.environ) // replicas
    mesh = jaxpp_mpi.make_mpmd_mesh((replicas, stages), ("replica", "stage"), "stage",
                                    replica_axis_name="replica")
    mesh_s = time.perf_counter() - start
    marks["mesh"] = time.time() - launched_at
    cfg = ModelConfig(vocab=32, hidden=16, heads=2, seq=8, layers=stages)
    sched = schedule_by_name("1f1b", stages)
    optimizer = optax.adam(3e-3)
    step = jaxpp_mpi.mpmd_jit_with_loop(
        make_train_step(lambda p, mb: loss_fn(p, mb, cfg, stages), sched, optimizer),
        mpmd_mesh=mesh)
    params = init_params(jax.random.PRNGKey(0), cfg)
    batch = synthetic_batch(cfg, stages * replicas, 2)
    state = (optimizer.init(params), params)
    compiled = step.compile(*state, batch)
    marks["compiled"] = time.time() - launched_at
    results = compiled(*state, batch)
    jax.block_until_ready([np.asarray(r.first_mpmd_replica) for r in jax.tree.leaves(results)
                           if r.is_partially_addressable])
    marks["first_step"] = time.time() - launched_at
    every = world.gather([*marks.values(), mesh_s])
    if world.Get_rank() == 0:
        row = dict(zip([*marks, "mesh_s"], map(float, np.max(every, axis=0))))
        with open(out, "w") as f:
            json.dump({"ranks": world.Get_size(), "stages": stages, "replicas": replicas,
                       **row}, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
