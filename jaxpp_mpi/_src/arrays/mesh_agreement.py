"""The ranks' `make_mpmd_mesh` arguments, compared before any communicator is made.

Note: mesh agreement.
  In MPI mode `make_mpmd_mesh` is collective, and so are the communicators it makes
  (a `Dup`, and with replicas two `Split`s): a rank that asks for another mesh than its
  peers (other `axis_shapes`, a missing replica axis) makes other calls, or the same
  calls with other arguments, and the job hangs or fails on that rank alone with
  `MPI_ERR_ARG`. So before any of them the ranks allgather, in one round, what each
  was asked (`MeshReport`: its arguments spelled as text, the global mesh they give,
  its device count and CUDA answer), and every rank refuses a job whose ranks differ,
  naming each differing argument with every rank's value (`differing_arguments_error`);
  the errors that follow from the arguments themselves are then raised by every rank
  alike. The same round tells every rank where each runs (`MeshReport.host`, `Note:
  rank hosts` in runtime/hosts.py). The round waits under the deadline `make_mpmd_mesh
  argument agreement`, the communicators under `make_mpmd_mesh communicators` (`Note:
  deadlines` in runtime/failure.py), so a rank that never arrives ends the job.
  Pure Python: the spelling and the comparison; make_mesh.py communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["MeshReport", "differing_arguments_error", "rank_ranges", "spell_arguments"]

ARGUMENTS = ("axis_shapes", "axis_names", "mpmd_axis_name", "replica_axis_name",
             "axis_types")


class MeshReport(NamedTuple):
    """What one rank was asked to build, as the ranks exchange it.

    Attributes:
      arguments: (name, value spelled as text) per compared argument, in `ARGUMENTS`
        order; equal spellings mean equal meshes.
      mesh: the global mesh those arguments give, in words (or why they give none).
      devices: this rank's device count.
      cuda_problem: why this rank's GPU buffers may not go to its MPI, or None.
      types_given: whether `axis_types` was passed (else it follows `axis_names`, and a
        difference in it is only theirs: not reported on its own).
      host: this rank's host name, never compared: the ranks learn where each runs, for
        the reports of faults (`Note: rank hosts` in runtime/hosts.py).
    """

    arguments: tuple[tuple[str, str], ...]
    mesh: str
    devices: int
    cuda_problem: str | None
    types_given: bool = True
    host: str = ""


def _spell(normalise: Any, value: Any) -> str:
    try:
        return repr(normalise(value))
    except (TypeError, ValueError):  # malformed: its own spelling, refused later
        return repr(value)


def _type_name(t: Any) -> str:
    return getattr(t, "name", repr(t))


def spell_arguments(axis_shapes: Any, axis_names: Any, mpmd_axis_name: Any,
                    replica_axis_name: Any, axis_types: Any) -> tuple[tuple[str, str], ...]:
    """`make_mpmd_mesh`'s arguments as comparable text (never raises, whatever they are).

    Sizes are spelled as the ints they are read as, sequences as tuples, and
    `axis_types=None` as its default (`Auto` per axis), so two spellings of one mesh
    compare equal.

    Returns:
      (name, text) per argument of `ARGUMENTS`.
    """
    shapes = _spell(lambda v: tuple(int(s) for s in v), axis_shapes)
    names = _spell(tuple, axis_names)
    if axis_types is None:
        types = _spell(lambda v: ("Auto",) * len(tuple(v)), axis_names)
    else:
        types = _spell(lambda v: tuple(_type_name(t) for t in v), axis_types)
    values = (shapes, names, repr(mpmd_axis_name), repr(replica_axis_name), types)
    return tuple(zip(ARGUMENTS, values))


def rank_ranges(ranks: Sequence[int]) -> str:
    """`rank 3`, `ranks 0-2`, `ranks 0, 2, 5-7`: sorted ranks with runs joined."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"
                     for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _by_value(values: Sequence[str]) -> str:
    """`A on ranks 0-2; B on rank 3`, values in order of their first rank."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on {rank_ranges(ranks)}" for value, ranks in groups.items())


def differing_arguments_error(reports: Sequence[MeshReport]) -> ValueError | None:
    """The error every rank raises when the ranks were asked for different meshes.

    Args:
      reports: every rank's `MeshReport`, in rank order.

    Returns:
      A ValueError naming each argument that differs with every rank's value, the
      meshes they give and what to do; None when every rank was asked for the same mesh.
    """
    lines = []
    for k, name in enumerate(ARGUMENTS):
        values = [r.arguments[k][1] for r in reports]
        if name == "axis_types" and not any(r.types_given for r in reports):
            continue  # Auto per axis on every rank: it differs only where axis_names do
        if len(set(values)) > 1:
            lines.append(f"  {name}: {_by_value(values)}")
    if not lines:
        return None
    meshes = _by_value([r.mesh for r in reports])
    return ValueError(
        "make_mpmd_mesh was called with different arguments on different ranks:\n"
        + "\n".join(lines) + f"\nso the ranks would build different meshes: {meshes}.\n"
        "Every rank must pass the same arguments, the whole job's mesh (axis_shapes, "
        "axis_names, mpmd_axis_name, replica_axis_name, axis_types), not its own part: "
        "compute them from what every rank shares (the job size, a config file), not "
        "from the rank, and build the mesh at the same point of the program on every "
        "rank.")
