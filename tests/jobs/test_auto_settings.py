"""A rank launched by a plain `mpirun` (or `srun`) gets from `import jaxpp_mpi` what
launch/jpprun gives it (Note: Settings at import in jaxpp_mpi/_src/launch/auto.py).

tests/jobs/harness/auto_settings_step.py (a ZeroBubble step on 2 ranks) runs under
jpprun and under plain launchers: `mpirun -n 2 python ...` as Open MPI binds it by
default, the same with `--bind-to none` (nothing bound: jaxpp_mpi pins each rank to its
core), and `srun` where Slurm runs here. Every rank reports its XLA_FLAGS, thread count,
affinity mask, compiled programs and losses; each launch must match jpprun's on every
rank (the same flags, the same optimized HLO, bit-identical losses) and jax.jit's losses.
With `JAXPP_MPI_AUTO_SETTINGS=0` the plain launch compiles other programs: the comparison
sees the settings. Structural only; persistent compilation caching is off, so every
launch compiles for itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

from jaxpp_mpi._src.launch import jpprun as launcher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/jobs/harness/auto_settings_step.py"
RANKS = 2
LIMIT_S = 120
ONE_THREAD_FLAGS = {"--xla_cpu_multi_thread_eigen=false",
                    "--xla_cpu_enable_concurrency_optimized_scheduler=false"}
CORES = sorted(os.sched_getaffinity(0))
# Settings a rank may inherit from this process's environment: the launches start clean.
_INHERITED = ("OMP_NUM_THREADS", "JAXPP_MPI_THREADS_PER_RANK", "JAXPP_MPI_AUTO_SETTINGS",
              "JAXPP_MPI_LOCAL_RANK", "JAXPP_MPI_LOCAL_SIZE", "JAX_COMPILATION_CACHE_DIR")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in job_env(**extra).items() if k not in _INHERITED or k in extra}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _mpirun(*args: str) -> list[str]:
    """The venv's mpirun as a user would call it, with only what this machine needs."""
    return launcher.plain_mpirun_argv(RANKS, [], mpirun=launcher.find_mpirun(),
                                      is_root=os.geteuid() == 0, cores=len(CORES)) + list(args)


def _launch(prefix: list[str], out: Path, **env: str) -> list[dict]:
    """Runs the step under `prefix` (the launcher's words); every rank's report."""
    out.mkdir()
    cmd = [*prefix, sys.executable, SCRIPT, str(out)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True,
                              text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(prefix)} did not finish in {LIMIT_S} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert [r["group"] for r in reports] == list(range(RANKS))
    return reports


def _jit_losses() -> np.ndarray:
    """The per-microbatch losses of the same step under jax.jit, in this process."""
    import jax

    spec = importlib.util.spec_from_file_location("auto_settings_step", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    params, batch, step = script.problem(RANKS)
    losses, _ = jax.jit(step)(params, batch)
    return np.asarray(losses)


@pytest.fixture(scope="module")
def jpprun_reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("auto") / "jpprun"
    return _launch([str(ROOT / "launch" / "jpprun"), "-n", str(RANKS)], out)


def _check_each_rank_on_its_own_cores(reports: list[dict]) -> None:
    if len(CORES) < RANKS:
        return  # oversubscribed: no launcher binds, nor does jaxpp_mpi
    masks = [set(r["affinity"]) for r in reports]
    assert all(m and len(m) < len(CORES) for m in masks), masks
    assert not set.intersection(*masks), masks


def test_jpprun_reference(jpprun_reports):
    for r in jpprun_reports:
        assert ONE_THREAD_FLAGS <= set(r["xla_flags"].split()) and r["omp_num_threads"] == "1"
    _check_each_rank_on_its_own_cores(jpprun_reports)
    held = [r["loss"] for r in jpprun_reports if r["loss"] is not None]
    assert len(held) == 1
    np.testing.assert_allclose(held[0], _jit_losses(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("launch", ["mpirun", "mpirun-unbound", "srun"])
def test_plain_launch_gets_jpprun_settings(launch, jpprun_reports, tmp_path):
    if launch == "srun":
        if shutil.which("srun") is None:
            pytest.skip("srun is not installed here (`make test-slurm` runs real SLURM jobs)")
        if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
            pytest.skip("srun is installed but no SLURM controller answers")
        prefix = ["srun", "-n", str(RANKS), "--mpi=pmix"]
    else:
        prefix = _mpirun("--bind-to", "none") if launch == "mpirun-unbound" else _mpirun()
    reports = _launch(prefix, tmp_path / launch)
    for got, want in zip(reports, jpprun_reports):
        for key in ("xla_flags", "omp_num_threads", "executables", "loss"):
            assert got[key] == want[key], (launch, got["group"], key)
    _check_each_rank_on_its_own_cores(reports)


def test_switched_off_the_plain_launch_compiles_other_programs(jpprun_reports, tmp_path):
    reports = _launch(_mpirun("--bind-to", "none"), tmp_path / "off",
                      JAXPP_MPI_AUTO_SETTINGS="0")
    for got, want in zip(reports, jpprun_reports):
        assert not ONE_THREAD_FLAGS & set(got["xla_flags"].split())
        assert got["omp_num_threads"] is None and got["affinity"] == CORES
        assert got["executables"].keys() == want["executables"].keys()
        assert got["executables"] != want["executables"]
