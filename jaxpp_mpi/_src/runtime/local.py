"""The local executor: every group of a Program in this one process.

Note: local order.
  In local mode all groups share one Python thread, so their programs are interleaved
  into one global order, computed once in the constructor from the rendezvous play
  (`rendezvous.play`, see `Note: rendezvous play`): each Run, Free and AllReduce is
  placed where its group completes it (an AllReduce is the identity: the local
  executor runs one replica), and each matched message becomes one transfer step,
  `jax.device_put(x, shardings(dst, aval))`, placed where its halves match (the sender
  is still at its send, so `x` is live; the receiver is at its receive, so nothing it
  runs later is out of order). Each `run` then just walks that flat list. JAX dispatch
  is asynchronous, so the global order costs no overlap: the devices of different
  groups still work together.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpp_mpi._src.ir import rendezvous
from jaxpp_mpi._src.ir.passes import recv_half, send_half
from jaxpp_mpi._src.ir.program import AllReduce, Aval, Free, Program, Run
from jaxpp_mpi._src.runtime.executor import (
    BufferLayout,
    Executable,
    InputBinder,
    OutputCollector,
    ShardingFn,
    Step,
    StepBinder,
    Table,
    bind_allreduce_identity,
    bind_free,
    bind_run,
    bind_steps,
    execute,
    wall_ns,
)
from jaxpp_mpi._src.timeline.timing import TraceEvent

__all__ = ["LocalExecutor", "Transfer", "local_order"]


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """One matched message of the local order: `src_buf` of `src` to `dst_buf` of `dst`."""

    src: int
    src_buf: int
    dst: int
    dst_buf: int
    aval: Aval


def local_order(program: Program) -> list[tuple[int, Run | Free | AllReduce | Transfer]]:
    """Interleaves the groups' programs into one global order (see `Note: local order`).

    Args:
      program: a verified program (`simulate.verify`).

    Returns:
      (group, op) pairs: Run, Free and AllReduce instructions of that group, and
      `Transfer`s (with the receiving group), in an order valid for every group.

    Raises:
      ProgramError: if a message has no partner or the play deadlocks (a program that
        `verify` accepts does neither).
    """
    instrs = [g.instrs for g in program.groups]
    order: list[tuple[int, Run | Free | AllReduce | Transfer]] = []
    for event in rendezvous.play(program):
        if isinstance(event, rendezvous.Matched):
            (s, i), (d, j) = event.send, event.recv
            buf = send_half(instrs[s][i])[0]  # type: ignore[index]
            rbuf, _, _, aval = recv_half(instrs[d][j])  # type: ignore[misc]
            order.append((d, Transfer(s, buf, d, rbuf, aval)))
        elif isinstance(instr := instrs[event.group][event.index], (Run, Free, AllReduce)):
            order.append((event.group, instr))
    return order


def _bind_transfer(layout: BufferLayout, shardings: ShardingFn) -> StepBinder:
    def bind(group: int, op: Transfer) -> tuple[Step, Step]:
        src, dst = layout.slot(op.src, op.src_buf), layout.slot(op.dst, op.dst_buf)
        sharding = shardings(op.dst, op.aval)

        def move(table: Table, times: Any) -> None:
            table[dst] = jax.device_put(table[src], sharding)

        args = {"src": op.src, "dst": op.dst, "src_buf": op.src_buf, "dst_buf": op.dst_buf,
                "bytes": math.prod(op.aval.shape) * jnp.dtype(op.aval.dtype).itemsize}

        def timed_move(table: Table, times: Any) -> None:
            events = times.events
            if events is None:
                move(table, times)
                return
            start = time.perf_counter_ns()
            table[dst] = jax.block_until_ready(jax.device_put(table[src], sharding))
            end = time.perf_counter_ns()
            events.append(TraceEvent("transfer", "message", op.dst, *wall_ns(start, end), args))

        return move, timed_move

    return bind


class LocalExecutor:
    """Runs a whole Program in this process (local mode, see DESIGN.md §1).

    Everything is planned in the constructor (`Note: executor steps`, `Note: local
    order`); `run` walks a flat list of closures.

    Args:
      program: a verified program: the compiler's (`build_program` verifies it once);
        one built by hand must pass `simulate.verify` first. It is not checked again
        here, beyond what `local_order` needs (matched messages, no deadlock).
      executables: `executables[g][name]` runs Run instructions `name` of group g: it
        takes the Run's input arrays positionally and returns a tuple or list of arrays,
        one per `Run.outs`, typically a `jax.jit` function placed on group g's devices.
      shardings: `shardings(g, aval)` is the sharding a value of group g with `aval`
        must have: step inputs are placed with it, and a message to group g is
        `jax.device_put(x, shardings(g, recv.aval))`.

    Raises:
      ProgramError: (a ValueError) if a message has no partner or the program
        deadlocks.
      ValueError: if `executables` does not have one mapping per group, or lacks an
        executable that a Run names.
    """

    def __init__(
        self,
        program: Program,
        executables: Sequence[Mapping[str, Executable]],
        shardings: ShardingFn,
    ):
        if len(executables) != program.num_groups:
            raise ValueError(
                f"got executables for {len(executables)} groups, the program has "
                f"{program.num_groups}"
            )
        self.program = program
        groups = program.groups
        self.layout = layout = BufferLayout(groups)
        self._new_table = layout.new_table
        binders: dict[type, StepBinder] = {
            Run: bind_run(layout, executables),
            Free: bind_free(layout),
            AllReduce: bind_allreduce_identity(),
            Transfer: _bind_transfer(layout, shardings),
        }
        self._steps = bind_steps(local_order(program), binders)
        self.num_inputs = 1 + max((k for g in groups for _, k in g.inputs), default=-1)
        self.num_outputs = 1 + max((k for g in groups for _, k in g.outputs), default=-1)
        self._bind_inputs = InputBinder(layout, groups, shardings, self.num_inputs)
        self._collect = OutputCollector(layout, groups, self.num_outputs)

    def run_replicas(self, step_inputs: Sequence[Any]) -> list[dict[int, jax.Array]]:
        """Runs one step; returns, per flat output index, {group: array} of its holders.

        Args:
          step_inputs: the flat step inputs (index = `GroupProgram.inputs`' second
            element); None where no group uses one. Arrays are placed as `InputBinder`
            says: already on `shardings(g, aval)` they are used as is.

        Raises:
          ValueError: on a wrong number of inputs, a None input that is used, an
            executable returning the wrong number of values, or an output not live at
            the end.
        """
        table = self._new_table()
        self._bind_inputs(table, step_inputs)
        execute(self._steps, table)
        return self._collect(table)

    def run(self, step_inputs: Sequence[Any]) -> list[jax.Array | None]:
        """Runs one step; returns the flat outputs.

        Output k is the array of the lowest-numbered group holding output k (an output
        replicated on several groups: see `run_replicas`), None if no group has one.
        Each array lives on its group's devices. Args and errors as `run_replicas`.
        """
        return [min(r.items())[1] if r else None for r in self.run_replicas(step_inputs)]
