"""Not a test: one small pipelined step whose ranks report their settings, for
tests/jobs/test_auto_settings.py, which starts it under each launcher:

    mpirun -n 2 python tests/jobs/harness/auto_settings_step.py OUT_DIR
    launch/jpprun -n 2 python tests/jobs/harness/auto_settings_step.py OUT_DIR

Two stages of three tanh layers each under ZeroBubble, so the weight-gradient task holds
three independent dots and its compiled schedule depends on XLA's CPU scheduler flag.
JAX is imported before jaxpp_mpi, as scripts do (importing JAX starts no backend). Each
rank compiles the step once, runs it once and writes OUT_DIR/rank{r}.json: its
`XLA_FLAGS`, `OMP_NUM_THREADS`, affinity mask, a hash of each of its executables'
optimized HLO (`MpmdCompiled.as_text`, source locations left out) and the per-microbatch
losses where it holds them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxpp_mpi

LAYERS_PER_STAGE = 3
WIDTH = 16
MICROBATCHES = 4
# Source locations in optimized HLO: the tables atop the module and each op's metadata.
_LOCATION_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def program_text(hlo: str) -> str:
    """Optimized HLO without its source locations, which name the launcher's frames too
    (`python -m mpi4py` under jpprun): the program alone, instruction order included."""
    lines, in_table = [], False
    for line in hlo.splitlines():
        if line in _LOCATION_TABLES:
            in_table = True
        elif in_table and not line:
            in_table = False
        elif not in_table:
            lines.append(_METADATA.sub("", line))
    return "\n".join(lines)


def problem(num_stages: int = 2):
    """The parameters, the batch and the step (for mpmd_jit_with_loop and jax.jit)."""
    keys = jax.random.split(jax.random.PRNGKey(0), num_stages * LAYERS_PER_STAGE + 2)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) * 0.4 for k in keys[:-2]]
    batch = (jax.random.normal(keys[-2], (MICROBATCHES, 4, WIDTH)),
             jax.random.normal(keys[-1], (MICROBATCHES, 4, WIDTH)))
    schedule = jaxpp_mpi.ZeroBubble(num_stages)

    def loss_fn(params, microbatch):
        x, y = microbatch
        for i, w in enumerate(params):
            x = jnp.tanh(x @ w)
            if (i + 1) % LAYERS_PER_STAGE == 0:
                x = jaxpp_mpi.mark_stage_end(x)
        return jnp.mean((x - y) ** 2)

    def step(params, batch):
        grad_fn = jax.value_and_grad(loss_fn)
        loss, grads = jaxpp_mpi.treduce(lambda mb: grad_fn(params, mb), batch,
                                        schedule=schedule)
        return loss, [w - 0.1 * g for w, g in zip(params, grads)]

    return params, batch, step


def main(out_dir: str) -> None:
    mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    group = mesh.my_mpmd_axis_index
    params, batch, step = problem()
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(params, batch)
    names = sorted(compiled.cost_analysis()[group]["per_executable"])
    hashes = {name: hashlib.sha256(program_text(compiled.as_text(group, name)).encode())
              .hexdigest() for name in names}
    loss, _ = compiled(params, batch)
    held = loss.is_partially_addressable
    report = {
        "group": group,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "affinity": sorted(os.sched_getaffinity(0)),
        "executables": hashes,
        "loss": np.asarray(loss.first_mpmd_replica).tolist() if held else None,
    }
    with open(os.path.join(out_dir, f"rank{group}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
