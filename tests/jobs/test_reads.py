"""Reading a result never waits for peers by surprise (Note: implicit reads are local,
Note: reading values): the loss-logging loop of JAX's multi-process code runs to its
end on 4 ranks and on 2, with deadlines on and off; a rank that does not hold the loss
gets an error from an implicit read in under a second; `process_allgather` gives
`jax.jit`'s loss on every rank.

The job (tests/jobs/harness/loss_logging.py, 4 ranks) runs the loop on a mesh of all 4,
then on two meshes of 2 (pairs of ranks), and prints one JSON line per rank and mesh.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/jobs/harness/loss_logging.py"
STEPS = 4
LIMIT_S = 150  # the job's hard limit: a read that waited would sit here until killed


@pytest.mark.parametrize("deadlines", ["on", "off"])
def test_loss_logging_loop_runs_and_non_holders_raise_at_once(deadlines):
    extra = ({"JAXPP_MPI_STEP_TIMEOUT": "off"} if deadlines == "off"
             else {"JAXPP_MPI_DEADLINE": "60"})
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", "4", "python", SCRIPT, str(STEPS)]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env(JAX_PLATFORMS="cpu", **extra),
                          capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    meshes = {}  # (size, first job rank) -> reports, by rank in the mesh
    for r in reports:
        first = r["job_rank"] - r["rank"]
        meshes.setdefault((r["ranks"], first), []).append(r)
    assert sorted(meshes) == [(2, 0), (2, 2), (4, 0)], proc.stdout
    for (ranks, _), mesh_reports in meshes.items():
        _check(ranks, sorted(mesh_reports, key=lambda r: r["rank"]))
    print({k: [round(r["loop_s"], 3) for r in v] for k, v in meshes.items()})


def _check(ranks: int, reports: list[dict]) -> None:
    """One mesh's reports: the loop ran everywhere, where held it logged the loss, the
    others raised at once, and every rank read jax.jit's loss explicitly."""
    assert [r["rank"] for r in reports] == list(range(ranks)), reports
    holders = [r for r in reports if r["held"]]
    assert len(holders) == 1 and holders[0]["rank"] == ranks - 1, reports
    want = holders[0]["want"]
    for r in reports:
        assert len(r["logged"]) == STEPS
        np.testing.assert_allclose(r["everywhere"], r["want"], rtol=1e-5)
        np.testing.assert_allclose(r["everywhere"], want, rtol=1e-5)
        if r["held"]:
            assert r["logged"][-1] == r["everywhere"] and r["raised"] is None
            assert r["shown"] == f"{r['everywhere']:.4f}"
        else:
            assert r["logged"] == [None] * STEPS and r["shown"].startswith("MpmdArray(")
            assert r["raise_s"] < 1.0, r  # the bound: an implicit read never waits
            text = r["raised"]
            assert text.startswith("float() of an MpmdArray of shape () and dtype float32 "
                                   f"held by groups ({ranks - 1},), not by this rank's "
                                   f"group ({r['rank']})"), text
            assert "x.to_mpmd_local_array" in text
            assert "jaxpp_mpi.process_allgather(x)" in text
