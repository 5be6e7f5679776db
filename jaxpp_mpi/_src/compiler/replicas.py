"""Pipeline replicas: which microbatches a replica runs, and what is combined across them.

Note: replicas.
  With R pipeline replicas (Note: Pipeline replicas in mesh.py) the step keeps its
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
  `passes.add_replica_reductions` (`Note: replica reductions`) over the group's replica
  communicator. Messages never cross replicas, so an AllReduce cannot deadlock against
  them: the program verified for one replica holds for R.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxpp_mpi._src.compiler.task_graph import Value
from jaxpp_mpi._src.errors import CompileError
from jaxpp_mpi._src.ir import passes
from jaxpp_mpi._src.ir.program import Program
from jaxpp_mpi._src.ir.simulate import verify
from jaxpp_mpi._src.treduce import Add, Concat, Max, Op

__all__ = ["add_reductions", "local_microbatches", "reduce_op"]


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
      bucket_bytes: the largest AllReduce (`passes.add_replica_reductions`).

    Returns:
      The verified program with its AllReduce instructions.
    """
    reductions: dict[int, list[tuple[int, str]]] = {}
    for k, (value, g, op) in enumerate(zip(loop_outs, out_groups, ops)):
        if value == f"loopout{k}":
            continue
        buf = next((b for b, v in buffer_names[g].items() if v == value), None)
        if buf is None:  # read by nothing on its group
            continue
        aval = program.group(g).aval(buf)
        reductions.setdefault(g, []).append((buf, reduce_op(op, aval.dtype)))
    out = passes.add_replica_reductions(program, reductions, bucket_bytes)
    verify(out)
    return out
