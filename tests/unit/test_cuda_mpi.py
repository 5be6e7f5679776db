"""The CUDA-aware MPI check (mpi/cuda_mpi.py) and its child-process probe (mpi/cuda_probe.py).

The decision is tested with fake queries and probes (no GPU here); the probe's runner with
fake children that crash, hang, print verdicts or leave a grandchild behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from jaxpp_mpi._src.mpi import cuda_mpi, cuda_probe
from jaxpp_mpi._src.mpi.cuda_mpi import cuda_mpi_problem
from jaxpp_mpi._src.mpi.cuda_probe import (
    CRASHED,
    FAILED,
    MARK,
    OK,
    TIMED_OUT,
    WRONG,
    ProbeResult,
    probe_env,
    run_probe,
)

# --- the decision -----------------------------------------------------------------------

NOT_ASKED = object()


def _decide(platforms, value, support, verdict):
    """cuda_mpi_problem with fakes; returns (message, query asked, probe run)."""
    asked, probed = [], []

    def query():
        asked.append(True)
        return support

    def probe():
        probed.append(True)
        return ProbeResult(verdict, "what it saw")

    msg = cuda_mpi_problem(platforms, {} if value is None else {"MPI4JAX_USE_CUDA_MPI": value},
                           query, probe)
    return msg, bool(asked), bool(probed)


@pytest.mark.parametrize("platforms,value", [
    (["cpu"], "1"),             # no GPU buffers to hand over
    (["cpu", "cpu"], "true"),
    (["gpu"], "0"),             # messages go through host memory
    (["gpu"], "false"),
    (["gpu"], ""),
    (["gpu"], None),            # unset: mpi4jax copies through host memory too
    (["gpu"], " 1"),            # mpi4jax does not strip: not true for it either
])
def test_nothing_is_asked_when_mpi_gets_no_gpu_buffers(platforms, value):
    assert _decide(platforms, value, 0, CRASHED) == (None, False, False)


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_an_mpi_that_says_it_is_cuda_aware_is_believed_without_a_probe(value):
    assert _decide(["gpu"], value, 1, CRASHED) == (None, True, False)


@pytest.mark.parametrize("platforms", [["gpu"], ["cuda"], ["cpu", "gpu"]])
@pytest.mark.parametrize("support", [0, None])
def test_the_probe_decides_when_the_query_says_no_or_nothing(platforms, support):
    assert _decide(platforms, "1", support, OK) == (None, True, True)


@pytest.mark.parametrize("support,said", [
    (0, "says MPIX_Query_cuda_support() = 0"),
    (None, "has no MPIX_Query_cuda_support()"),
])
@pytest.mark.parametrize("verdict,saw", [
    (WRONG, "arrived with wrong values (what it saw)"),
    (CRASHED, "crashed that process (what it saw)"),
    (TIMED_OUT, "did not finish (what it saw)"),
    (FAILED, "could not be checked (what it saw)"),
])
def test_anything_but_the_probes_ok_refuses(support, said, verdict, saw):
    msg, asked, probed = _decide(["gpu"], "true", support, verdict)
    assert asked and probed
    assert msg.startswith("MPI4JAX_USE_CUDA_MPI=true makes mpi4jax hand GPU buffers to MPI")
    assert f"it {said}, and a GPU buffer it sent to itself in a child process {saw}." in msg
    assert "Set MPI4JAX_USE_CUDA_MPI=0" in msg and "README.md: CUDA-aware MPI" in msg


def test_the_default_probe_runs_once_per_process(monkeypatch):
    runs = []
    monkeypatch.setattr(cuda_mpi, "run_probe",
                        lambda: runs.append(True) or ProbeResult(CRASHED, "SIGSEGV"))
    cuda_mpi.probe_cuda_mpi.cache_clear()
    try:
        first = cuda_mpi.probe_cuda_mpi()
        assert cuda_mpi.probe_cuda_mpi() is first and runs == [True]
        msg = cuda_mpi_problem(["gpu"], {"MPI4JAX_USE_CUDA_MPI": "1"}, lambda: 0)
        assert "crashed that process (SIGSEGV)" in msg and runs == [True]
    finally:
        cuda_mpi.probe_cuda_mpi.cache_clear()


# --- the child's environment -------------------------------------------------------------

def test_the_child_leaves_the_job_but_keeps_the_transport_settings():
    env = {
        "PATH": "/bin", "LD_LIBRARY_PATH": "/opt/mpi/lib", "CUDA_VISIBLE_DEVICES": "3",
        "OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^openib", "UCX_TLS": "cuda_copy,sm",
        "MPICH_GPU_SUPPORT_ENABLED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
        "JAX_PLATFORMS": "cuda,cpu", "OPAL_PREFIX": "/tmp/ompi", "PMIX_PREFIX": "/tmp/ompi",
        "PMIX_MCA_gds": "hash", "PRTE_MCA_plm": "ssh",
        # what launchers set to make a process one of the job's ranks
        "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_FILE_LOCATION": "/t",
        "OMPI_MCA_orte_hnp_uri": "x", "OMPI_MCA_ess_base_vpid": "1", "OMPI_MCA_pmix": "^s1",
        "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-x", "PMIX_SERVER_URI41": "y",
        "PRTE_NAMESPACE": "x", "PMI_RANK": "1", "PMI_FD": "5", "HYDI_CONTROL_FD": "6",
        "MPI_LOCALRANKID": "1",
    }
    got = probe_env(env)
    assert got == {
        "PATH": "/bin", "LD_LIBRARY_PATH": "/opt/mpi/lib", "CUDA_VISIBLE_DEVICES": "3",
        "OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^openib", "UCX_TLS": "cuda_copy,sm",
        "MPICH_GPU_SUPPORT_ENABLED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "JAX_PLATFORMS": "cuda", "OPAL_PREFIX": "/tmp/ompi", "PMIX_PREFIX": "/tmp/ompi",
        "PMIX_MCA_gds": "hash", "PRTE_MCA_plm": "ssh",
    }
    assert env["PMIX_RANK"] == "1"  # the rank's own environment is left alone


# --- the child-process runner ------------------------------------------------------------

def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_segfaults_is_a_crash():
    result = run_probe(_python("import ctypes; ctypes.string_at(0)"), dict(os.environ), 60)
    assert result == ProbeResult(CRASHED, "SIGSEGV") and not result.ok


def test_a_child_that_aborts_is_a_crash():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"
    assert run_probe(_python(code), dict(os.environ), 60) == ProbeResult(CRASHED, "SIGABRT")


def test_a_child_that_hangs_times_out_with_its_grandchildren(tmp_path):
    pid_file = tmp_path / "grandchild"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(300)\n")
    start = time.monotonic()
    result = run_probe(_python(code), dict(os.environ), timeout_s=3)
    assert result == ProbeResult(TIMED_OUT, "no verdict within 3 s")
    assert time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # killed with the child's process group; reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if _is_zombie(grandchild):
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, signal.SIGKILL)
        pytest.fail("the hung child's grandchild survived the timeout")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("printed,code,want", [
    (f"{MARK} ok: 4096 bytes on Open MPI", 0, ProbeResult(OK, "4096 bytes on Open MPI")),
    (f"{MARK} ok: fine", 3, ProbeResult(OK, "fine")),   # a verdict outlives a bad exit
    (f"noise\n{MARK} wrong data: element 7 is -1.0, want 7.0\nmore noise", 0,
     ProbeResult(WRONG, "element 7 is -1.0, want 7.0")),
    (f"{MARK} failed: JAX found no GPU", 0, ProbeResult(FAILED, "JAX found no GPU")),
    ("Traceback\nImportError: no mpi4py", 1,
     ProbeResult(FAILED, "exit status 1, no verdict: Traceback | ImportError: no mpi4py")),
    ("", 0, ProbeResult(FAILED, "exit status 0, no verdict")),
    (f"{MARK} crashed: a child cannot claim this", 0,
     ProbeResult(FAILED, f"exit status 0, no verdict: {MARK} crashed: a child cannot "
                 "claim this")),
])
def test_the_runner_reads_the_childs_verdict_line(printed, code, want):
    script = f"import sys; sys.stdout.write({printed!r}); sys.stdout.flush(); sys.exit({code})"
    assert run_probe(_python(script), dict(os.environ), 60) == want


def test_the_real_probe_gives_a_verdict_here():
    """The module itself as the child: without a GPU (as here) it says so; on a GPU
    machine it gives whatever verdict that machine's MPI earns, never a hang."""
    result = run_probe(timeout_s=170)
    assert result.verdict in (OK, WRONG, CRASHED, FAILED), result
    if result.verdict == FAILED:
        assert result.detail.startswith(("JAX found no GPU", "mpi4py")), result
    assert cuda_probe.DEFAULT_TIMEOUT_S >= 60
