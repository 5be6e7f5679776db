"""`jaxpp_mpi.trace.export`: every rank's recorded events in one Chrome trace, under a deadline.

The trace itself (its format, clocks, tracks) is timeline/chrome.py's; this module is
the collective that brings every rank's events to one rank (`Note: trace format`,
`Note: trace clocks` there). Like every collective of the library it waits under a
deadline (`Note: deadlines` in failure.py), labelled `trace.export to PATH`: a rank that
never calls it leaves the others waiting until then, and every waiting rank names it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.runtime.failure import deadline
from jaxpp_mpi._src.timeline.chrome import (
    chrome_trace,
    decode_events,
    encode_events,
    write_trace,
)
from jaxpp_mpi._src.timeline.timing import TraceEvent

__all__ = ["export"]


def export(
    path: str | os.PathLike,
    events: Sequence[TraceEvent],
    mpmd_mesh: Any,
    *,
    root: int = 0,
    other_data: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Writes the Chrome trace of every rank's `events` to `path` on rank `root`.

    In MPI mode this is collective over the mesh's job (`mpmd_mesh.job_comm`: every
    rank of every pipeline replica): every rank calls it with its own events (from
    `record`); they are gathered to `root` as JSON (no pickle), put on root's clock (see
    `Note: trace clocks`) and written there; a failure to write raises on every rank.
    It waits under the deadline `trace.export to PATH` (`Note: deadlines`). In local
    mode the one process writes its events.

    Args:
      path: the JSON file to write (its directory is created; written atomically).
      events: this process's events of the recorded step(s).
      mpmd_mesh: the `MpmdMesh` the step ran on.
      root: the rank of the job that writes the file.
      other_data: extra entries for the trace's `otherData`.

    Returns:
      The trace dict on the rank that wrote it, None on the others.

    Raises:
      OSError: on every rank, if `root` could not write `path`.
    """
    if mpmd_mesh.is_local:
        trace = chrome_trace([list(events)], local=True, other_data=other_data)
        write_trace(path, trace)
        return trace
    from jaxpp_mpi._src.mpi import collectives  # imports mpi4py: MPI mode only

    job = mpmd_mesh.job_comm
    with deadline(f"trace.export to {os.fspath(path)}", job):
        comm = job.Dup()  # collective too; private tags: nothing can match a runtime message
        try:
            gathered = collectives.gather_bytes(encode_events(events), comm, root)
            offsets = collectives.clock_offsets_ns(comm, root)
            trace, error = None, ""
            if gathered is not None:
                trace = chrome_trace([decode_events(b) for b in gathered],
                                     offsets_ns=offsets, other_data=other_data,
                                     replicas=mpmd_mesh.num_replicas)
                try:
                    write_trace(path, trace)
                except (OSError, TypeError, ValueError) as e:  # raised on every rank below
                    error = f"rank {root} could not write the trace to {path}: {e}"
            error = collectives.bcast_bytes(error.encode(), comm, root).decode()
        finally:
            comm.Free()
    if error:
        raise OSError(error)
    return trace
