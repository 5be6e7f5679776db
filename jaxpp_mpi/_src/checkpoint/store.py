"""Checkpoints of pytrees of MpmdArrays and plain arrays: atomic save, checked restore.

The files are described in Note: Checkpoint format (checkpoint/format.py), the way they
are written in Note: Atomic commit (checkpoint/commit.py).

Note: Checkpoints with replicas.
  With pipeline replicas (Note: Pipeline replicas in comms.py) every replica holds the
  same values, so a checkpoint does not depend on how many there are: `save` writes it
  once, by the ranks of replica 0 over their pipeline communicator (`mesh.comm`,
  exactly as a one-replica job with the same groups does: same manifest, same files),
  while the other replicas wait for the outcome over `mesh.job_comm`, under the save's
  deadline grown by the time the whole checkpoint takes to write; every rank of the job
  then returns, or raises, alike. Every other decision (the tree's agreement, `find`,
  `restore`'s checks, `save_plan`) is taken over `mesh.job_comm`, so the job's rank 0
  recovers and writes what one rank must; `restore` reads the same files on every
  replica, each rank its group's leaves. A checkpoint saved with R replicas restores
  onto any R and any layout of the same leaves.
"""

from __future__ import annotations

import glob
import os
import secrets
from typing import Any

import jax
import numpy as np

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint import leaf_files
from jaxpp_mpi._src.checkpoint.async_save import wait_for_saves
from jaxpp_mpi._src.checkpoint.commit import commit_checkpoint, recover
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest
from jaxpp_mpi._src.checkpoint.plan import Plan, plan_from_shardings
from jaxpp_mpi._src.checkpoint.snapshot import abstract, describe_save, mesh_of, ranks_of

__all__ = ["find", "load_plan", "load_whole", "read_manifest", "restore", "save",
           "save_plan"]


def save(
    path: str,
    tree: PyTree,
    step: int | None = None,
    *,
    mesh: MpmdMesh | None = None,
    overwrite: bool = False,
) -> None:
    """Saves a pytree of MpmdArrays and plain arrays as a checkpoint directory;
    collective in MPI mode: every rank calls it alike.

    Every rank calls it with the same tree. An MpmdArray is written once, by the process
    holding its first group (`mesh_ids[0]`), with its placement; a plain leaf (a
    `jax.Array`, numpy array or scalar, the same on every rank) is written by rank 0 with
    no placement. Rank 0 writes the manifest last; the directory appears at `path` only
    when complete (see Note: Atomic commit). With pipeline replicas, replica 0 writes
    and the others wait: the files are those a one-replica job writes (`Note:
    Checkpoints with replicas`).

    Args:
      path: the checkpoint directory (created; its parent too).
      tree: the pytree to save; dict keys must be str or int.
      step: the training step, kept in the manifest.
      mesh: the MPMD mesh; needed only when the tree holds no MpmdArray in an MPI job.
      overwrite: replace an existing checkpoint at `path`, unless it holds a newer
        step than `step` (never backwards: Note: Atomic commit).

    Raises:
      CheckpointError: on every rank: an unsupported leaf or dtype, ranks passing
        different trees, `path` existing (or, with `overwrite`, holding a newer step),
        or a write failing on any rank.
    """
    wait_for_saves()  # one save at a time: an asynchronous one in flight finishes first
    described = describe_save(path, tree, step, mesh)
    manifest, mine, ranks, writers = (described.manifest, described.mine, described.ranks,
                                      described.writers)
    if writers is ranks:
        commit_checkpoint(path, manifest, mine, ranks, overwrite=overwrite)
        return
    # Replicas (Note: Checkpoints with replicas): replica 0 commits, every rank learns
    # the outcome; the others may wait for the whole write.
    ranks.expect_io(sum(leaf.nbytes for leaf in manifest.leaves))
    error = None
    if writers is not None:
        try:
            commit_checkpoint(path, manifest, mine, writers, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            error = e
    ranks.allgather_or_raise(None, error)


# -- reading ------------------------------------------------------------------------


def find(path: str, *, mesh: MpmdMesh | None = None) -> Manifest | None:
    """The checkpoint to resume from at `path`: its manifest, or None (start afresh);
    collective in MPI mode: every rank calls it alike.

    Collective in MPI mode (every rank of the job, every replica, calls it): rank 0
    first completes a save that was interrupted between its two renames (`.NAME.old-*`
    / `.NAME.tmp-*` left beside a missing NAME: see Note: Atomic commit), then every
    rank reads the manifest.

    Example:
      found = checkpoint.find(ckpt, mesh=mesh)
      if found is not None:
          state = checkpoint.restore(ckpt, state, shardings=...)
          first_step = found.step

    Args:
      path: the checkpoint directory that `save` writes.
      mesh: the MPMD mesh (needed in an MPI job of several ranks).

    Returns:
      The manifest of the checkpoint now at `path`, or None when there is none.

    Raises:
      CheckpointError: on every rank, when `path` exists but is not a readable
        checkpoint.
    """
    target = os.path.abspath(path)
    ranks = ranks_of(mesh, f"checkpoint find of {path}")
    found = ranks.run(lambda: recover(target) is not None or os.path.lexists(target)
                      if ranks.rank == 0 else None)
    if not ranks.bcast(found):
        return None
    return ranks.run(lambda: read_manifest(path))



def read_manifest(path: str) -> Manifest:
    """The checked manifest of the checkpoint directory `path` (no array is read).

    Raises:
      CheckpointError: no checkpoint at `path`, or a malformed manifest.
    """
    file = os.path.join(path, fmt.MANIFEST)
    if not os.path.isfile(file):
        parent, name = os.path.split(os.path.abspath(path))
        olds = glob.glob(os.path.join(parent, glob.escape(f".{name}.old-") + "*"))
        hint = (f" (an interrupted save left the previous one at {olds[0]}; the next save "
                "to this path restores it)") if olds else ""
        raise CheckpointError(f"no checkpoint at {path}: {fmt.MANIFEST} is missing{hint}")
    return Manifest.from_json(fmt.read_json_file(file, "manifest"), f"{path}/{fmt.MANIFEST}")


def read_leaf(path: str, leaf: fmt.LeafEntry) -> np.ndarray:
    """One leaf's value from checkpoint `path`, checked (see Note: Untrusted files)."""
    return leaf_files.read_npy(leaf_files.resolve_inside(path, leaf.file), leaf.shape,
                               leaf.np_dtype, fmt.format_key_path(leaf.path))


def _check_like(path: str, manifest: Manifest, paths: list, leaves: list) -> None:
    have = [leaf.path for leaf in manifest.leaves]
    problems = []
    if have != paths:
        have_set, paths_set = set(have), set(paths)
        missing = [fmt.format_key_path(p) for p in paths if p not in have_set]
        extra = [fmt.format_key_path(p) for p in have if p not in paths_set]
        problems += [f"`like` has {m}, the checkpoint does not" for m in missing[:10]]
        problems += [f"the checkpoint has {e}, `like` does not" for e in extra[:10]]
        if not problems:
            problems.append("the leaves are in another order than in `like`")
    else:
        for leaf, x in zip(manifest.leaves, leaves):
            shape, dtype = abstract(x)
            if shape != leaf.shape or dtype.name != leaf.dtype:
                problems.append(f"{fmt.format_key_path(leaf.path)}: checkpoint has "
                                f"{leaf.dtype}{list(leaf.shape)}, `like` {dtype.name}"
                                f"{list(shape)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match `like`:\n  "
                              + "\n  ".join(problems[:20]))


def _plain_like(value: np.ndarray, like: Any) -> Any:
    if isinstance(like, jax.Array):
        return jax.device_put(value, like.sharding)
    if isinstance(like, jax.ShapeDtypeStruct):
        return jax.device_put(value, like.sharding) if like.sharding else jax.numpy.asarray(value)
    if isinstance(like, (bool, int, float, complex, np.generic)):
        return type(like)(value.item()) if not isinstance(like, np.generic) else value[()]
    return value


def restore(
    path: str,
    like: PyTree,
    *,
    shardings: PyTree = None,
    mesh: MpmdMesh | None = None,
) -> PyTree:
    """Restores a checkpoint into a pytree placed like `like`; collective in MPI mode:
    every rank calls it alike.

    The manifest is checked against `like` (key paths, shapes, dtypes) before any array
    is read. A leaf placed by an `MpmdSharding` (the leaf of `shardings` if given, else
    the `like` leaf's own, if an MpmdArray) comes back as an MpmdArray; only processes
    holding one of its groups read its file. Other leaves come back as `like`'s kind: a
    `jax.Array` with its sharding, a numpy array or scalar, a Python scalar; every
    process reads them. The placement recorded in the checkpoint does not matter: a
    checkpoint saved on one layout restores onto any other, and with pipeline replicas
    every replica reads the same files (`Note: Checkpoints with replicas`).

    Args:
      path: the checkpoint directory.
      like: a pytree with the checkpoint's key paths; leaves give shape and dtype
        (MpmdArrays, arrays, `jax.ShapeDtypeStruct`s, scalars).
      shardings: optional pytree prefix-compatible with `like`, with `MpmdSharding` (or
        None) leaves, e.g. a sub-tree of `compile(...).in_shardings`.
      mesh: the MPMD mesh; needed only when nothing in `like` / `shardings` names one in
        an MPI job.

    Returns:
      The restored pytree (structure of `like`).

    Raises:
      CheckpointError: on every rank: no checkpoint, a malformed manifest or file, a
        mismatch with `like`.
    """
    paths, leaves, treedef = fmt.flatten_with_paths(like)
    if shardings is None:
        targets = [x.mpmd_sharding if isinstance(x, MpmdArray) else None for x in leaves]
    else:
        try:
            targets = treedef.flatten_up_to(shardings)
        except (ValueError, TypeError) as e:
            raise CheckpointError(
                f"shardings must have the structure of `like` (None for leaves placed as "
                f"in `like`): {e}") from None
        bad = [t for t in targets if t is not None and not isinstance(t, MpmdSharding)]
        if bad:
            raise CheckpointError(f"shardings leaves must be MpmdSharding or None, got {bad[0]!r}")
    mesh = mesh_of(targets, mesh)
    ranks = ranks_of(mesh, f"checkpoint restore of {path}")

    def check() -> Manifest:
        manifest = read_manifest(path)
        _check_like(path, manifest, paths, leaves)
        return manifest

    manifest = ranks.run(check)
    ranks.expect_io(sum(leaf.nbytes for leaf in manifest.leaves))

    def read() -> list[Any]:
        out = []
        for leaf, x, target in zip(manifest.leaves, leaves, targets):
            if target is None:
                out.append(_plain_like(read_leaf(path, leaf), x))
                continue
            local = target.local_mesh_ids
            value = read_leaf(path, leaf) if local else None
            arrays = [jax.device_put(value, target.sharding_for(g)) for g in local]
            out.append(MpmdArray(arrays, target, shape=leaf.shape, dtype=leaf.np_dtype))
        return out

    return jax.tree.unflatten(treedef, ranks.run(read))


def _nest(items: list[tuple[fmt.KeyPath, Any]], where: str, gaps: list[int],
          prefix: fmt.KeyPath = ()) -> Any:
    """The tree of `items` (key path, value) below `prefix` (see `load_whole`).

    Sequences are rebuilt from the indexes present, with None in the gaps empty
    containers leave (e.g. optax's `EmptyState`); `gaps[0]` is what remains of the
    checkpoint's budget of gaps (one per leaf), spent before any list is allocated, so a
    huge index costs a message, not memory.

    Raises:
      CheckpointError: naming `where` and the path: a level mixing sequence indexes
        with dict keys, two keys that would become the same dict key, or more gaps than
        the budget.
    """
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    at = fmt.format_key_path(prefix)
    if any(p == () for p, _ in items):  # excluded by Manifest.from_json
        raise CheckpointError(f"{where}: a leaf at {at} also holds other leaves")
    groups: dict[fmt.PathEntry, list] = {}
    for p, v in items:
        groups.setdefault(p[0], []).append((p[1:], v))
    kinds = {kind for kind, _ in groups}
    if kinds <= {"idx", "flat"}:
        if len(kinds) > 1:
            raise CheckpointError(f"{where}: at {at} the leaves mix \"idx\" and \"flat\" "
                                  "indexes; pass `like=` to load this checkpoint")
        size = 1 + max(key for _, key in groups)
        if size - len(groups) > gaps[0]:
            raise CheckpointError(
                f"{where}: at {at} a sequence has index {size - 1} but only {len(groups)} "
                f"entries: more gaps than the checkpoint's leaves can explain; pass `like=` "
                "to load it")
        gaps[0] -= size - len(groups)
        out: list[Any] = [None] * size
        for (kind, key), group in groups.items():
            out[key] = _nest(group, where, gaps, (*prefix, (kind, key)))
        return out
    if kinds & {"idx", "flat"}:
        raise CheckpointError(f"{where}: at {at} the leaves mix sequence indexes with dict "
                              "keys or attributes; pass `like=` to load this checkpoint")
    children: dict[Any, Any] = {}
    for (kind, key), group in groups.items():
        if key in children:
            raise CheckpointError(f"{where}: at {at} both a dict key and an attribute are "
                                  f"named {key!r}; pass `like=` to load this checkpoint")
        children[key] = _nest(group, where, gaps, (*prefix, (kind, key)))
    return children


def load_whole(path: str, like: PyTree = None) -> PyTree:
    """Every leaf of a checkpoint as numpy arrays, in one process, no MPI and no mesh.

    Works on whole-model and per-stage checkpoints alike (placement is ignored).

    Args:
      path: the checkpoint directory.
      like: optional pytree with the checkpoint's key paths; the result then has its
        structure. Without it the tree is rebuilt from the key paths: dict keys and
        attribute names become dicts, sequence indexes lists (empty containers are not
        kept: an empty entry of a sequence comes back as None, and a checkpoint whose
        sequences have more such gaps than it has leaves is refused).

    Returns:
      The pytree of numpy arrays (bfloat16 / float8 as ml_dtypes arrays).

    Raises:
      CheckpointError: no checkpoint, a malformed manifest or file, a mismatch with
        `like`.
    """
    manifest = read_manifest(path)
    if like is not None:
        paths, leaves, treedef = fmt.flatten_with_paths(like)
        _check_like(path, manifest, paths, leaves)
        return jax.tree.unflatten(treedef, [read_leaf(path, leaf) for leaf in manifest.leaves])
    if not manifest.leaves:
        return {}
    where = f"{path}/{fmt.MANIFEST}"
    paths = [leaf.path for leaf in manifest.leaves]
    _nest([(p, None) for p in paths], where, [len(paths)])  # the structure, before any read
    values = [read_leaf(path, leaf) for leaf in manifest.leaves]
    return _nest(list(zip(paths, values)), where, [len(paths)])


# -- plans --------------------------------------------------------------------------


def save_plan(path: str, shardings: PyTree, like: PyTree = None) -> Plan:
    """Writes a placement plan (e.g. `compile(...).in_shardings`, or the sub-tree matching
    a checkpoint's tree) as JSON, for the reshard utility and `load_plan`; collective
    in MPI mode: every rank calls it alike.

    In MPI mode every rank calls it; rank 0 writes and the others wait for it.

    Args:
      path: the JSON file (replaced atomically).
      shardings: a pytree of `MpmdSharding` (None leaves are skipped).
      like: optional pytree of arrays with the same key paths: their shapes and dtypes
        are recorded so that a mismatching checkpoint is caught.

    Returns:
      The plan written.
    """
    plan = plan_from_shardings(shardings, like)
    mesh = mesh_of(jax.tree.leaves(shardings), None)
    ranks = ranks_of(mesh, f"plan save of {path}")

    def write() -> None:
        if ranks.rank != 0:
            return
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(plan.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    ranks.run(write)
    return plan


def load_plan(path: str) -> Plan:
    """Reads a plan written by `save_plan`; `plan.shardings_like(like, mesh)` turns it
    into `MpmdSharding`s for `restore`.

    Raises:
      CheckpointError: a missing or malformed plan file.
    """
    return Plan.from_json(fmt.read_json_file(path, "plan"), path)
