"""Does this MPI move GPU memory? A device buffer sent to self, in a child process.

An MPI that is not CUDA-aware takes a device pointer for host memory and crashes (or
copies garbage), so the probe never runs inside a rank: `run_probe` starts
`python -m jaxpp_mpi._src.mpi.cuda_probe` with the rank's interpreter and environment,
less the variables that would make its MPI join the rank's job (`probe_env`), so it
starts as a singleton MPI process on the same MPI library with the same settings (MCA
parameters such as Open MPI's transport choices, `OPAL_PREFIX`, UCX's `UCX_*`, Cray's
`MPICH_GPU_*` stay). The child fills two arrays on its first GPU with JAX, sends one to
the other with `MPI_Sendrecv` on `MPI_COMM_SELF` from their device pointers (as mpi4jax
does with `MPI4JAX_USE_CUDA_MPI=1`), at a small and a large size (eager and rendezvous
protocols), compares the values with numpy's and prints one verdict line. The parent
reads it, or the child's death: a crash, a timeout (the child's whole process group is
killed) or an error are all verdicts, never a hang.

A self-send exercises the library's handling of device memory (its datatype engine,
its memory-type detection), not every transport between processes; it is the check
that fails where mpi4jax's first send would crash.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

__all__ = ["ProbeResult", "probe_env", "run_probe"]

OK, WRONG, CRASHED, TIMED_OUT, FAILED = "ok", "wrong data", "crashed", "timed out", "failed"
# The child's verdict line: `MARK VERDICT: detail`.
MARK = "jaxpp_mpi cuda probe:"
DEFAULT_TIMEOUT_S = 120.0
SIZES = (4 << 10, 4 << 20)
# Variables through which a launcher makes a process part of its job (Open MPI, PMIx,
# PRRTE, PMI-1/2 as MPICH and Slurm set them, Hydra, Intel MPI): the child must not
# have them, or it would try to join the rank's job as that rank.
_JOB_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "HYDI_", "I_MPI_HYDRA_",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
# Among them, settings of the library stay: MCA parameters (they choose the transports)
# and the install prefixes of a relocated Open MPI, PMIx or PRRTE; except the MCA
# parameters through which Open MPI 4's launcher names the job.
_SETTINGS = ("OMPI_MCA_", "PMIX_MCA_", "PRTE_MCA_", "PMIX_PREFIX", "PRTE_PREFIX")
_JOB_MCA = ("OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_prte",
            "OMPI_MCA_plm", "OMPI_MCA_ras", "OMPI_MCA_rmaps", "OMPI_MCA_odls",
            "OMPI_MCA_state", "OMPI_MCA_schizo")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the probe saw: `verdict` is one of `ok`, `wrong data`, `crashed`,
    `timed out`, `failed` (it could not run); `detail` says more, in words."""

    verdict: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == OK


def probe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: `env` without the launcher's job variables, JAX on CUDA
    without preallocating GPU memory (the rank's JAX already holds its share).

    Args:
      env: the rank's environment.

    Returns:
      A new mapping for `subprocess`.
    """
    out = {k: v for k, v in env.items()
           if not k.startswith(_JOB_PREFIXES)
           or (k.startswith(_SETTINGS) and not k.startswith(_JOB_MCA))}
    out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    out["JAX_PLATFORMS"] = "cuda"
    return out


def run_probe(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> ProbeResult:
    """Runs the probe in a child process and reads its verdict.

    Args:
      argv: the child's command line (tests pass others); default this module's under
        this interpreter.
      env: the child's environment; default `probe_env(os.environ)`.
      timeout_s: how long the child may take, its start-up (JAX, CUDA) included.

    Returns:
      The child's verdict line when it printed one; else `crashed` when a signal ended
      it, `timed out` when it ran past `timeout_s` (its process group is killed), or
      `failed` with the end of its output.
    """
    if argv is None:
        argv = [sys.executable, "-m", __name__]
    if env is None:
        env = probe_env(os.environ)
    # Output goes to files, not pipes: a grandchild (an MPI daemon) holding a pipe open
    # would keep a read waiting after the child itself is gone.
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return ProbeResult(TIMED_OUT, f"no verdict within {timeout_s:g} s")
        finally:
            _kill_group(proc, only_leftovers=True)
        out.seek(0)
        text = out.read().decode(errors="replace")
    return _verdict(text, code)


def _kill_group(proc: subprocess.Popen, only_leftovers: bool = False) -> None:
    """SIGKILL the child's process group (its session: the child and what it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if not only_leftovers:
        proc.wait()


def _verdict(text: str, code: int) -> ProbeResult:
    """The child's last verdict line, else what its exit status says."""
    for line in reversed(text.splitlines()):
        if line.startswith(MARK):
            verdict, _, detail = line[len(MARK):].strip().partition(":")
            verdict = verdict.strip()
            if verdict in (OK, WRONG, FAILED):
                return ProbeResult(verdict, detail.strip())
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return ProbeResult(CRASHED, name)
    tail = " | ".join(line for line in text.strip().splitlines()[-3:] if line.strip())
    return ProbeResult(FAILED, f"exit status {code}, no verdict" + (f": {tail}" if tail
                                                                     else ""))


def _report(verdict: str, detail: str) -> None:
    """Prints the verdict line and leaves at once (no MPI or CUDA teardown to go wrong)."""
    print(f"{MARK} {verdict}: {detail}", flush=True)
    sys.stderr.flush()
    os._exit(0)


def _error(e: BaseException) -> str:
    """`Type: message` on one line (the type alone where the message is empty)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main() -> None:
    """The child: the probe proper (see the module docstring)."""
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except Exception as e:  # any failure to start is the verdict
        _report(FAILED, f"JAX found no GPU (JAX_PLATFORMS=cuda): {_error(e)}")
    if not gpus:
        _report(FAILED, "JAX found no GPU (JAX_PLATFORMS=cuda)")
    try:
        from mpi4py import MPI
    except Exception as e:
        _report(FAILED, f"mpi4py: {_error(e)}")
    from_address = (getattr(MPI, "buffer", None) or MPI.memory).fromaddress
    place = jax.sharding.SingleDeviceSharding(gpus[0])
    for nbytes in SIZES:
        n = nbytes // 4
        make = jax.jit(lambda n=n: (jnp.arange(n, dtype=jnp.float32),
                                    jnp.full((n,), -1.0, jnp.float32)),
                       out_shardings=(place, place))
        x, y = make()
        jax.block_until_ready((x, y))
        send = from_address(x.unsafe_buffer_pointer(), nbytes)
        recv = from_address(y.unsafe_buffer_pointer(), nbytes)
        MPI.COMM_SELF.Sendrecv([send, MPI.BYTE], 0, 17, [recv, MPI.BYTE], 0, 17)
        got = np.asarray(y)
        want = np.arange(n, dtype=np.float32)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            _report(WRONG, f"{nbytes} bytes: element {bad} is {got[bad]}, want {want[bad]}")
    version = MPI.Get_library_version().splitlines()[0].strip().strip("\x00").strip()
    _report(OK, f"{' and '.join(map(str, SIZES))} bytes from {gpus[0]} to itself on {version}")


if __name__ == "__main__":
    main()
