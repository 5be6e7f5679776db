"""`python -m jaxpp_mpi.reshard`: converts checkpoints between whole-model and per-stage.

Note: Reshard utility.
  Every leaf of a checkpoint is stored whole, once (see Note: Checkpoint format), so a
  conversion is a new manifest (placements from the plan, or none) plus one copy of each
  leaf's file. Leaf i is copied by rank `g % size`, where g is the first group of its
  destination placement (of its source placement for `to-spmd`): each rank moves what
  its groups own, reading the source files directly (a shared filesystem). MPI only
  makes the ranks agree: every check (source manifest, plan against it, destination
  free) runs on every rank before any data moves, and any failure raises on every rank;
  the destination is written with the atomic commit of checkpoints (Note: Atomic
  commit), so nothing appears at --dst unless the whole conversion succeeds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from jaxpp_mpi._src.arrays.comms import _mpi_world_size
from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint import leaf_files
from jaxpp_mpi._src.checkpoint import store as ck
from jaxpp_mpi._src.checkpoint.commit import Ranks, commit_checkpoint
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest
from jaxpp_mpi._src.checkpoint.plan import Plan
from jaxpp_mpi._src.launch.env import WORLD_SIZE_VARS
from jaxpp_mpi._src.runtime import agree

__all__ = ["UsageError", "convert", "destination_manifest", "main"]

KINDS = ("to-mpmd", "to-spmd", "repartition")
MAX_PROBLEMS = 20


def destination_manifest(kind: str, src: Manifest, plan: Plan | None) -> Manifest:
    """The manifest a conversion writes, after checking that it can be done.

    Args:
      kind: "to-mpmd" (whole-model source, plan required), "to-spmd" (per-stage source,
        no plan) or "repartition" (per-stage source, plan required).
      src: the source checkpoint's manifest.
      plan: the placement plan.

    Returns:
      The destination manifest: the source's leaves, step and dtypes, with the plan's
      placements (none for to-spmd), leaf i in `leaf_file(i)`.

    Raises:
      CheckpointError: the source's kind or the plan does not fit, listing every problem
        (missing or extra keys, shapes, dtypes, specs the group mesh cannot split by).
    """
    if kind not in KINDS:
        raise CheckpointError(f"unknown conversion {kind!r}; choose one of {KINDS}")
    staged = [leaf for leaf in src.leaves if leaf.placement is not None]
    if kind == "to-mpmd" and staged:
        raise CheckpointError(
            "to-mpmd needs a whole-model source, but the source has placed (per-stage) "
            "leaves; use repartition to change a per-stage checkpoint's placement")
    if kind != "to-mpmd" and len(staged) != len(src.leaves):
        raise CheckpointError(
            f"{kind} needs a per-stage source, but "
            f"{len(src.leaves) - len(staged)} leaves have no placement (a whole-model "
            "checkpoint); use to-mpmd to place them")
    if (plan is None) != (kind == "to-spmd"):
        raise CheckpointError(f"{kind} {'needs' if plan is None else 'takes no'} --plan")
    if plan is None:
        leaves = [fmt.LeafEntry(leaf.path, leaf.shape, leaf.dtype, fmt.leaf_file(i))
                  for i, leaf in enumerate(src.leaves)]
        return Manifest(tuple(leaves), src.step, None)
    problems = plan.problems_with(src)
    if problems:
        more = len(problems) - MAX_PROBLEMS
        raise CheckpointError(
            "the plan does not match the checkpoint:\n  " + "\n  ".join(problems[:MAX_PROBLEMS])
            + (f"\n  ... and {more} more" if more > 0 else ""))
    entries = plan.by_path()
    leaves = [fmt.LeafEntry(leaf.path, leaf.shape, leaf.dtype, fmt.leaf_file(i),
                            entries[leaf.path].placement)
              for i, leaf in enumerate(src.leaves)]
    return Manifest(tuple(leaves), src.step, plan.mpmd_dim)


def _writer(i: int, src: Manifest, dst: Manifest, size: int) -> int:
    placement = dst.leaves[i].placement or src.leaves[i].placement
    return (placement.mesh_ids[0] if placement is not None else i) % size


def _progress_printer(total_arrays: int, total_bytes: int,
                      log: Callable[[str], None]) -> Callable[[int, int], None]:
    shown = [-1]

    def show(arrays: int, nbytes: int) -> None:
        tenth = 10 * arrays // max(total_arrays, 1)
        if tenth > shown[0] or arrays == total_arrays:
            shown[0] = tenth
            log(f"reshard: {arrays}/{total_arrays} arrays, {_mib(nbytes)} of "
                f"{_mib(total_bytes)} moved")

    return show


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def convert(
    kind: str,
    src: str,
    dst: str,
    plan_path: str | None,
    ranks: Ranks,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Converts checkpoint `src` into `dst` (see Note: Reshard utility); every rank calls it.

    Args:
      kind: "to-mpmd", "to-spmd" or "repartition" (see `destination_manifest`).
      src: the source checkpoint directory.
      dst: the destination directory (must not exist unless `overwrite`).
      plan_path: the plan file written by `jaxpp_mpi.checkpoint.save_plan`, or None.
      ranks: the ranks of the job.
      overwrite: replace an existing checkpoint at `dst`.
      log: where rank 0 writes progress.

    Returns:
      (arrays, bytes) moved by all ranks together.

    Raises:
      CheckpointError: on every rank, before any data moves for a bad source, plan or
        destination; on every rank, with `dst` untouched, if a copy fails anywhere.
    """

    def prepare() -> tuple[Manifest, Manifest]:
        if os.path.abspath(src) == os.path.abspath(dst):
            raise CheckpointError("--src and --dst are the same directory")
        source = ck.read_manifest(src)
        plan = None if plan_path is None else ck.load_plan(plan_path)
        target = destination_manifest(kind, source, plan)
        if os.path.lexists(dst) and not overwrite:
            raise CheckpointError(f"--dst {dst} exists; pass --overwrite to replace it")
        for leaf in source.leaves:  # every file must be there before anything moves
            leaf_files.resolve_inside(src, leaf.file)
        return source, target

    source, target = ranks.run(prepare)
    mine = [(i, lambda leaf=leaf: ck.read_leaf(src, leaf))
            for i, leaf in enumerate(source.leaves)
            if _writer(i, source, target, ranks.size) == ranks.rank]
    total_bytes = sum(leaf.nbytes for leaf in source.leaves)
    per_rank = ranks.allgather(len(mine))
    progress = None
    if ranks.rank == 0:
        log(f"reshard {kind}: {src} -> {dst}, {len(source.leaves)} arrays "
            f"({_mib(total_bytes)}) over {ranks.size} rank(s), arrays per rank: "
            f"{', '.join(map(str, per_rank))}")
        progress = _progress_printer(len(source.leaves), total_bytes, log)
    return commit_checkpoint(dst, target, mine, ranks, overwrite=overwrite,
                                progress=progress)


def _job_ranks() -> Ranks:
    if _mpi_world_size() <= 1:
        return Ranks(None)
    return Ranks(agree.collectives().world_dup())


class UsageError(Exception):
    """Bad command-line arguments; reported on one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, parsed.

    Raises:
      UsageError: bad arguments (argparse's message and where to find help).
    """
    p = _Parser(
        prog="python -m jaxpp_mpi.reshard",
        description="Convert jaxpp_mpi checkpoints between a whole-model layout and "
                    "per-stage layouts; run under mpirun (one or more ranks).")
    sub = p.add_subparsers(dest="kind", required=True)
    helps = {"to-mpmd": "whole-model checkpoint -> per-stage checkpoint placed by --plan",
             "to-spmd": "per-stage checkpoint -> whole-model checkpoint",
             "repartition": "per-stage checkpoint -> per-stage checkpoint placed by --plan"}
    for kind in KINDS:
        s = sub.add_parser(kind, help=helps[kind])
        s.add_argument("--src", required=True, help="source checkpoint directory")
        s.add_argument("--dst", required=True, help="destination checkpoint directory")
        if kind != "to-spmd":
            s.add_argument("--plan", required=True,
                           help="placement plan JSON (jaxpp_mpi.checkpoint.save_plan)")
        s.add_argument("--overwrite", action="store_true",
                       help="replace an existing checkpoint at --dst")
    return p.parse_args(argv)


def _agreed_exit(status: int) -> int:
    """`status`, to return once every rank has reported the same user error.

    Every rank has reached this point (the ranks agreed on the failure, or each parsed
    the same bad command line), so in a launched job MPI is finalized here: `python -m
    mpi4py`, which is how `launch/jpprun` starts Python, would otherwise turn the
    non-zero exit into an `MPI_Abort` of the job. MPI is looked up, never imported, and
    left alone in a process no launcher started (e.g. a test calling `main`).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    launched = any(name in os.environ for name in WORLD_SIZE_VARS)
    if launched and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the utility (see Note: Reshard utility).

    A user error (bad arguments, source, plan or destination, a failed copy) is printed
    as one `error:` line on every rank, which all exit with status 2, without traceback
    or `MPI_Abort`; an unexpected exception (a bug) keeps its traceback.

    Returns:
      The exit status: 0, or 2 on a user error, on every rank.
    """
    try:
        args = parse_args(argv)
    except UsageError as e:  # every rank parses the same command line
        print(f"python -m jaxpp_mpi.reshard: error: {e}", file=sys.stderr, flush=True)
        return _agreed_exit(2)
    ranks = _job_ranks()
    try:
        arrays, nbytes = convert(args.kind, args.src, args.dst, getattr(args, "plan", None),
                                 ranks, overwrite=args.overwrite)
    except (CheckpointError, OSError) as e:
        print(f"[rank {ranks.rank}] reshard: error: {e}", file=sys.stderr, flush=True)
        ranks.barrier()  # every rank has reported before the launcher ends the job
        return _agreed_exit(2)
    if ranks.rank == 0:
        print(f"reshard: done, {arrays} arrays, {_mib(nbytes)} written to {args.dst}",
              flush=True)
    return 0
