"""Pipeline replicas: which microbatches a replica runs, and what is combined across them.

Note: replicas.
  With R pipeline replicas (Note: Pipeline replicas in comms.py) the step keeps its
  meaning: it is traced on the global arguments, exactly as for one pipeline, and its
  microbatch loop of n microbatches is partitioned over the replicas. Replica r runs
  microbatches r * n/R ... (r+1) * n/R - 1, in its schedule's order for n/R microbatches;
  every replica runs the same program (the same P group programs: the program hash is
  the same on every rank), only the microbatch indexes it is given differ
  (`StepPlan.mb_inputs` hold the replica-local microbatch; the compiled step adds r * n/R
  when it places them).

  Every loop output (a `treduce` result) is then combined across replicas by its own
  op, right after the task that finishes it on its group: `Add` by a sum, `Max` by a
  maximum (bool states of either by an OR), and `Concat` by the bitwise OR of the bit
  patterns, exact because its state is the global-length stack in which each replica
  wrote only its own microbatches over zeros. From there on every replica holds the
  loop's global result, so the code after the loop (the optimizer update) computes the
  same values on every replica and each replica's parameters stay equal, with no
  broadcast. The sums are associated differently from `jax.jit`'s sequential loop
  (replica by replica), so results agree with it to rounding, as any data-parallel sum.

  The reductions are `AllReduce` instructions (ir/instructions.py) placed by
  `reductions.add_replica_reductions` (`Note: replica reductions`) over the group's replica
  communicator; an output a forward finishes (a loss) waits for the group's last
  backward, unless something reads it earlier, so replicas meet only where gradients
  are reduced. Messages never cross replicas, so an AllReduce cannot deadlock against
  them: the program verified for one replica holds for R.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jaxpp_mpi._src.base.compat import split_inputs
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.task_graph import Value
from jaxpp_mpi._src.ir.program import Program, Run
from jaxpp_mpi._src.ir.reductions import add_replica_reductions
from jaxpp_mpi._src.ir.simulate import verify
from jaxpp_mpi._src.primitives.treduce import Add, Concat, Max, Op
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = ["add_reductions", "local_microbatches", "localize", "localize_split", "reduce_op",
           "split_dim"]


def local_microbatches(num_microbatches: int, num_replicas: int) -> int:
    """How many microbatches each replica runs (Note: replicas).

    Raises:
      CompileError: `num_replicas` does not divide `num_microbatches`.
    """
    if num_microbatches % num_replicas:
        raise CompileError(
            f"the loop has {num_microbatches} microbatches, which {num_replicas} pipeline "
            f"replicas cannot share equally: use a multiple of {num_replicas} microbatches "
            "(each replica runs the same number)")
    return num_microbatches // num_replicas


def reduce_op(op: Op, dtype: str) -> str:
    """The AllReduce op that combines replicas' states of treduce op `op` (`Note:
    replicas`)."""
    if isinstance(op, Concat) or np.dtype(dtype) == np.bool_:
        return "bor"
    if isinstance(op, Max):
        return "max"
    if isinstance(op, Add):
        return "sum"
    raise CompileError(f"no reduction across pipeline replicas for treduce op {op!r}")


def _last_backward(program: Program) -> dict[int, int]:
    """Per group, the position of its last Run of a backward task (B, I or W): a loop
    output a forward finishes (a loss) is reduced after it, with the gradients, so the
    replicas do not wait for each other in the middle of the loop."""
    out = {}
    for g in program.groups:
        for i, instr in enumerate(g.instrs):
            if isinstance(instr, Run) and any(
                    part.kind in "BIW" for part in parse_label(instr.task)):
                out[g.mpmd_idx] = i
    return out


def add_reductions(program: Program, buffer_names: Sequence[Mapping[int, Value]],
                   loop_outs: Sequence[Value], out_groups: Sequence[int],
                   ops: Sequence[Op], bucket_bytes: int) -> Program:
    """`program` with each loop output combined across replicas (`Note: replicas`).

    Args:
      program: the verified program of one replica.
      buffer_names: per group, buffer id -> value name (from the lowering).
      loop_outs: per loop output, the value name of its final state; outputs no
        variable names (`loopout<k>`, read by nothing) are left alone.
      out_groups: per loop output, the group that computes it.
      ops: per loop output, its treduce op.
      bucket_bytes: the largest AllReduce (`reductions.add_replica_reductions`).

    Returns:
      The verified program with its AllReduce instructions.
    """
    reductions: dict[int, list[tuple[int, str]]] = {}
    bufs: dict[int, dict[Value, int]] = {}  # per group read: value name -> its buffer
    for k, (value, g, op) in enumerate(zip(loop_outs, out_groups, ops)):
        if value == f"loopout{k}":
            continue
        if g not in bufs:
            bufs[g] = {}
            for b, v in buffer_names[g].items():
                bufs[g].setdefault(v, b)
        buf = bufs[g].get(value)
        if buf is None:  # read by nothing on its group
            continue
        aval = program.group(g).aval(buf)
        reductions.setdefault(g, []).append((buf, reduce_op(op, aval.dtype)))
    out = add_replica_reductions(program, reductions, bucket_bytes,
                                        not_before=_last_backward(program))
    verify(out)
    return out


# Note: replica shares.
#   An argument whose `in_shardings` spec names the replica axis on dimension d (alone,
#   or first in a tuple entry) is *split over the replicas*: each rank passes only its
#   replica's share, the global array's d-th dimension cut into R equal consecutive
#   blocks (replica r: block r), which is what a data loader reading only its part of
#   the global batch produces. The step is still traced on the global array (its
#   dimension d R times the share's), so its meaning does not change with R. Such an
#   argument may only be read by the microbatch loop, one microbatch's rows at a time:
#   every `dynamic_slice` of it in a loop task reads at global start s on dimension d,
#   and the task reads the share at s mod (share size), which is the same row when the
#   slice lies in the replica's own block, as the microbatches a replica runs do
#   (`Note: replicas`: replica r runs microbatches r*n/R..). treduce's `xs` and `x[i]`
#   in a `treduce_i` body read so; any other use (outside the loop, or another
#   operation on the whole argument) is refused by name, and so is a slice that does not
#   lie within one share (the replica axis named on another dimension than the one the
#   microbatches are taken from): the error names the argument's path, the replica axis,
#   the global and share shapes and the spec to give instead. Tracing and this rewrite
#   happen while the step compiles, which every rank does before any message, so every
#   rank raises it (`Note: raise on every rank`).


def split_dim(spec: Sequence | None, replica_axis: str | None) -> int | None:
    """The dimension a spec splits over the replica axis (`Note: replica shares`).

    Raises:
      ValueError: the replica axis appears other than alone or first in an entry, or
        on two dimensions.
    """
    if not spec or replica_axis is None:
        return None
    dims = []
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if replica_axis in names:
            if names[0] != replica_axis:
                raise ValueError(
                    f"spec {tuple(spec)} names the replica axis {replica_axis!r} after "
                    f"{names[0]!r} in one entry: put it first (the replicas split the "
                    "dimension into consecutive blocks, the group axes split each block)")
            dims.append(d)
    if len(dims) > 1:
        raise ValueError(f"spec {tuple(spec)} names the replica axis {replica_axis!r} on "
                         f"dimensions {dims}: split one dimension over the replicas")
    return dims[0] if dims else None


def _misread(subject: str, shape: Sequence[int], d: int, size: int,
             sizes: Sequence[int], replica_axis: str | None) -> CompileError:
    """The error for a share read by a `dynamic_slice` no replica's share can serve
    (`Note: replica shares`): slices of `sizes` of the global `shape`, split on `d`."""
    axis = replica_axis or "replica"
    share = (*shape[:d], size, *shape[d + 1:])
    head = (f"{subject} is split over the pipeline replicas on dimension {d} (its "
            f"in_shardings name the replica axis {axis!r} there): the global array has "
            f"shape {tuple(shape)}, each replica passes a share of shape {share}")
    read = [k for k, (n, s) in enumerate(zip(sizes, shape)) if n < s]
    if sizes[d] > size and read and d not in read:
        k = read[0]
        spec = ", ".join(repr(axis) if j == k else "None" for j in range(k + 1))
        return CompileError(
            f"{head}, but the loop reads it one microbatch at a time along dimension {k} "
            f"(slices of shape {tuple(sizes)}), each slice spanning the whole of dimension "
            f"{d}, which no replica holds: name the replica axis on dimension {k}, the one "
            f"the microbatches are taken from (in_shardings P({spec})), and pass each "
            f"replica its consecutive block of dimension {k}; or pass the argument whole "
            "(not split over the replica axis)")
    if sizes[d] > size:
        what = f"more than a share holds ({size})"
    else:
        what = (f"which do not tile a share of {size}: a slice would straddle two "
                "replicas' blocks")
    return CompileError(
        f"{head}, but the loop reads slices of shape {tuple(sizes)}, {sizes[d]} along "
        f"dimension {d}, {what}: read it one microbatch at a time (treduce's xs, or x[i] "
        "in a treduce_i body) with a number of microbatches that is a multiple of the "
        "replicas', or pass the argument whole (not split over the replica axis)")


def localize(closed: Any, split: Mapping[int, tuple[int, int]], where: str, *,
             names: Mapping[int, str] | None = None,
             replica_axis: str | None = None) -> Any:
    """The task jaxpr `closed` reading replica shares (`Note: replica shares`).

    Args:
      closed: a loop task's closed jaxpr.
      split: jaxpr input position -> (split dimension, share size along it).
      where: what reads them, for errors: the task (with `names`), or the argument.
      names: jaxpr input position -> the argument's path, for errors.
      replica_axis: the replica axis's name, for errors.

    Returns:
      A closed jaxpr whose split inputs have the share's shape and whose dynamic slices
      of them start at the global start modulo the share size.

    Raises:
      CompileError: naming the argument, its shapes and the replica axis: a split
        input read otherwise than by `dynamic_slice`, or by slices that do not lie
        within one replica's share (the replica axis on another dimension than the one
        the microbatches are taken from).
    """
    jaxpr = closed.jaxpr
    constvars, invars = split_inputs(jaxpr, len(closed.consts))
    shares = {invars[i]: dims for i, dims in split.items()}
    subjects = {invars[i]: (f"argument {names[i]} (read by {where})" if names and i in names
                            else where) for i in split}

    def fn(*args):
        env: dict[Any, Any] = {}
        read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
        for v, c in zip(constvars, closed.consts):
            env[v] = c
        for v, a in zip(invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            touched = [v for v in eqn.invars
                       if not isinstance(v, jex_core.Literal) and v in shares]
            invals = [read(v) for v in eqn.invars]
            if touched:
                if eqn.primitive is not lax.dynamic_slice_p or touched != [eqn.invars[0]]:
                    raise CompileError(
                        f"{subjects[touched[0]]} is split over the pipeline replicas (its "
                        f"in_shardings name the replica axis) but the loop reads it with "
                        f"`{eqn.primitive.name}`: such an argument may only be read one "
                        "microbatch at a time (treduce's xs, or x[i] in a treduce_i "
                        "body); pass it whole instead (not split over the replica axis)")
                var = eqn.invars[0]
                d, size = shares[var]
                sizes = tuple(eqn.params["slice_sizes"])
                if sizes[d] > size or (sizes[d] and size % sizes[d]):
                    raise _misread(subjects[var], var.aval.shape, d, size, sizes,
                                   replica_axis)
                start = invals[1 + d]
                invals[1 + d] = lax.rem(start, np.asarray(size, dtype=np.result_type(start)))
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns: Sequence[Any] = ()
            if isinstance(params, tuple):  # (subfuns, params) for call-like primitives
                subfuns, params = params
            out = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = out if eqn.primitive.multiple_results else [out]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    avals = []
    for i, v in enumerate(jaxpr.invars):
        aval = v.aval
        if i in split:
            d, size = split[i]
            aval = aval.update(shape=(*aval.shape[:d], size, *aval.shape[d + 1:]))
        avals.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                          weak_type=getattr(aval, "weak_type", False)))
    return jax.make_jaxpr(fn)(*avals)


def localize_split(split: Any, jaxpr: jex_core.Jaxpr, loop: jex_core.JaxprEqn,
                   num_consts: int, replica_dims: Sequence[int | None], num_replicas: int,
                   names: Sequence[str], replica_axis: str | None = None
                   ) -> tuple[Any, dict[int, tuple[int, ...]]]:
    """The split loop body reading replica shares (`Note: replica shares`).

    Args:
      split: the `SplitBody`.
      jaxpr: the traced step; loop: its treduce eqn.
      num_consts: how many of `jaxpr`'s inputs are constants (arguments follow).
      replica_dims: per flat argument, the dimension split over the replicas, or None.
      num_replicas: R.
      names: per flat argument, its path (for errors).
      replica_axis: the replica axis's name (for errors).

    Returns:
      The SplitBody with localized task jaxprs, and per split flat step input (constants
      counted), the share's shape.

    Raises:
      CompileError: a split argument read outside the loop, or returned by it.
    """
    shapes: dict[int, tuple[int, ...]] = {}
    share_of: dict[int, tuple[int, int]] = {}  # loop invariant -> (dim, share size)
    name_of: dict[int, str] = {}  # loop invariant -> its argument's path
    for j, d in enumerate(replica_dims):
        if d is None:
            continue
        var = jaxpr.invars[num_consts + j]
        shape = tuple(var.aval.shape)
        size = shape[d] // num_replicas
        shapes[num_consts + j] = (*shape[:d], size, *shape[d + 1:])
        outside = [e.primitive.name for e in jaxpr.eqns
                   if e is not loop and any(v is var for v in e.invars)]
        if outside or any(v is var for v in jaxpr.outvars):
            what = f"`{outside[0]}` outside the loop" if outside else "as a step result"
            raise CompileError(
                f"argument {names[j]} is split over the pipeline replicas (its in_shardings "
                f"name the replica axis) but the step uses it {what}: such an argument "
                "may only be read by the microbatch loop, one microbatch at a time; pass "
                "it whole (not split over the replica axis) to use it there")
        for i, v in enumerate(loop.invars):
            if v is var:
                share_of[i] = (d, size)
                name_of[i] = names[j]
    if not share_of:
        return split, shapes
    for ref in split.body_outputs:
        if ref[0] == "inv" and ref[1] in share_of:
            raise CompileError("a loop output is an argument split over the pipeline "
                               "replicas: return it from outside the loop, whole")
    tasks = []
    for task in split.tasks:
        mine = {i: share_of[ref[1]] for i, ref in enumerate(task.ins)
                if ref[0] == "inv" and ref[1] in share_of}
        if mine:
            label = f"{task.key[0].value}{task.key[1]}"
            which = {i: name_of[ref[1]] for i, ref in enumerate(task.ins) if i in mine}
            task = dataclasses.replace(task, jaxpr=localize(
                task.jaxpr, mine, f"task {label}", names=which, replica_axis=replica_axis))
        tasks.append(task)
    return dataclasses.replace(split, tasks=tuple(tasks)), shapes
