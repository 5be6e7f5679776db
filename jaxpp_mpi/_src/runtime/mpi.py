"""The MPI executor: this rank runs its own group's program; messages go through mpi4jax.

Note: messages.
  A Send, Recv or SendRecv becomes calls of small single-device jitted functions
  around `transport.send` / `recv` / `sendrecv`, compiled before the first step
  (mpi4jax ops carry ordered effects, which JAX allows only on one device). A value
  of a multi-device group moves *shard by shard*: its distinct shards (one per
  distinct index of its sharding, taken from the first device holding it, in mesh
  order) travel as separate messages, shard j
  of message tag t with wire tag `t * group_size + j`, so shards of one value (sent
  from different devices, whose effects are not ordered between each other) and
  messages of one channel never mix. The receiver gets each distinct shard on the first
  device that holds it, copies it to the other devices holding the same index, and
  assembles the array. Both ends compute the same shard list from the same Aval and
  equally shaped group meshes. A SendRecv pairs send shard j with receive shard j
  while both sit on the same mesh position; the unpaired rest (different layouts on
  both ends) follows with the lower rank sending first and the higher receiving first,
  so the exchange stays deadlock-free.

  Nothing blocks Python: each step dispatches executables asynchronously and mpi4jax's
  ordered effects keep this rank's MPI calls in program order per device, which the
  verifier proved deadlock-free under rendezvous semantics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from ..program import Aval, Free, GroupProgram, Program, Recv, Run, Send, SendRecv
from ..simulate import verify
from . import transport
from .executor import (
    BufferLayout,
    Executable,
    InputBinder,
    OutputCollector,
    Step,
    StepBinder,
    Table,
    bind_free,
    bind_run,
    bind_steps,
    execute,
    timed_message,
)

__all__ = ["MpiExecutor", "ShardPlan"]


class ShardPlan:
    """The distinct shards of a value of `aval` under `sharding` (see `Note: messages`).

    Attributes:
      shape, dtype: the value's global shape and dtype.
      sharding: its sharding on the group mesh.
      pieces: per distinct shard, (first device holding it, its shape, the other
        devices holding the same index).
    """

    def __init__(self, aval: Aval, sharding: NamedSharding):
        self.shape = aval.shape
        self.dtype = np.dtype(aval.dtype)
        self.sharding = sharding
        by_index: dict[tuple, list] = {}
        indices = sharding.devices_indices_map(self.shape)
        for device in sharding.mesh.devices.flat:
            index = indices[device]
            key = tuple((s.start, s.stop, s.step) for s in index)
            by_index.setdefault(key, []).append((device, index))
        self.pieces = []
        for holders in by_index.values():
            device, index = holders[0]
            shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, self.shape))
            self.pieces.append((device, shape, [d for d, _ in holders[1:]]))
        self.single = sharding.mesh.devices.size == 1
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def shards_of(self, x: jax.Array) -> list[jax.Array]:
        """The distinct shards' data, in plan order."""
        if self.single:
            return [x]
        data = {s.device: s.data for s in x.addressable_shards}
        return [data[device] for device, _, _ in self.pieces]

    def assemble(self, pieces: list[jax.Array]) -> jax.Array:
        """The value from its distinct shards (each on the first device holding it)."""
        if self.single:
            return pieces[0]
        arrays = {}
        for (device, _, others), x in zip(self.pieces, pieces):
            arrays[device] = x
            for other in others:
                arrays[other] = jax.device_put(x, other)
        ordered = [arrays[d] for d in self.sharding.mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, ordered)


def _compiled(fn: Callable, args: list, in_sh, out_sh):
    """`jax.jit(fn)`, compiled now (the first call then only traces and hits JAX's
    compilation cache). Not the AOT `Compiled` object: calling that does not thread the
    runtime token that mpi4jax's ordered effects need."""
    jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh)
    jitted.lower(*args).compile()
    return jitted


class _Messenger:
    """Pre-compiled send / recv / sendrecv executables, shared by identical messages."""

    def __init__(self, comm: Any, group_size: int):
        self.comm = comm
        self.n = group_size

    def _in_sharding(self, plan: ShardPlan, device):
        return plan.sharding if plan.single else SingleDeviceSharding(device)

    @functools.cache  # noqa: B019 - lives as long as the executor
    def send(self, shape, dtype, device, dst: int, tag: int, in_sh):
        comm = self.comm
        struct = jax.ShapeDtypeStruct(shape, dtype, sharding=in_sh)
        return _compiled(lambda x: transport.send(x, dst, tag, comm), [struct], in_sh, None)

    @functools.cache  # noqa: B019
    def recv(self, shape, dtype, device, src: int, tag: int, out_sh):
        comm = self.comm
        return _compiled(lambda: transport.recv(shape, dtype, src, tag, comm), [], (), out_sh)

    @functools.cache  # noqa: B019
    def sendrecv(self, s_shape, s_dtype, r_shape, r_dtype, peer: int, s_tag: int, r_tag: int,
                 in_sh, out_sh):
        comm = self.comm
        struct = jax.ShapeDtypeStruct(s_shape, s_dtype, sharding=in_sh)
        return _compiled(
            lambda x: transport.sendrecv(x, peer, s_tag, r_shape, r_dtype, peer, r_tag, comm),
            [struct], in_sh, out_sh)

    def sends(self, plan: ShardPlan, dst: int, tag: int) -> list:
        return [self.send(shape, plan.dtype, dev, dst, tag * self.n + j,
                          self._in_sharding(plan, dev))
                for j, (dev, shape, _) in enumerate(plan.pieces)]

    def recvs(self, plan: ShardPlan, src: int, tag: int) -> list:
        return [self.recv(shape, plan.dtype, dev, src, tag * self.n + j,
                          self._in_sharding(plan, dev))
                for j, (dev, shape, _) in enumerate(plan.pieces)]


class MpiExecutor:
    """Runs this rank's group of a Program; messages go over MPI (see `Note: messages`).

    Args:
      program: the whole program (every rank holds the same one); verified here.
      mpmd_idx: this rank's group (== its rank in `comm`).
      executables: group `mpmd_idx`'s executables by name (as for the local executor).
      sharding: `sharding(aval)` is the sharding of a value of this group.
      comm: the communicator (rank r runs group r).

    Raises:
      ProgramError: if the program does not verify.
      ValueError: if a wire tag would exceed the communicator's MPI_TAG_UB.
    """

    def __init__(
        self,
        program: Program,
        mpmd_idx: int,
        executables: Mapping[str, Executable],
        sharding: Callable[[Aval], NamedSharding],
        comm: Any,
    ):
        verify(program, check_leaks=False)
        self.program = program
        self.mpmd_idx = mpmd_idx
        gp: GroupProgram = program.group(mpmd_idx)
        self.group_program = gp
        self.layout = layout = BufferLayout([gp])
        group_size = sharding(Aval((), "int32")).mesh.devices.size
        self._check_tags(gp, group_size, comm)
        self._messenger = _Messenger(comm, group_size)
        self._plans: dict[Aval, ShardPlan] = {}
        self._sharding = sharding
        tables: list[Mapping[str, Executable]] = [{} for _ in range(program.num_groups)]
        tables[mpmd_idx] = executables
        binders: dict[type, StepBinder] = {
            Run: bind_run(layout, tables),
            Free: bind_free(layout),
            Send: self._bind_send,
            Recv: self._bind_recv,
            SendRecv: self._bind_sendrecv,
        }
        self._steps = bind_steps(((mpmd_idx, i) for i in gp.instrs), binders)
        groups = program.groups
        num_inputs = 1 + max((k for g in groups for _, k in g.inputs), default=-1)
        num_outputs = 1 + max((k for g in groups for _, k in g.outputs), default=-1)
        self._bind_inputs = InputBinder(layout, [gp], lambda g, a: sharding(a), num_inputs)
        self._collect = OutputCollector(layout, [gp], num_outputs)

    @staticmethod
    def _check_tags(gp: GroupProgram, group_size: int, comm: Any) -> None:
        tags = [t for i in gp.instrs for t in (getattr(i, "tag", None),
                getattr(i, "send_tag", None), getattr(i, "recv_tag", None)) if t is not None]
        if not tags:
            return
        top = max(tags) * group_size + group_size - 1
        ub = comm.Get_attr(transport.MPI.TAG_UB)
        if ub is not None and top > ub:
            raise ValueError(
                f"group {gp.mpmd_idx}'s program needs MPI tags up to {top}, above this MPI's "
                f"MPI_TAG_UB={ub}: use fewer microbatches per step or smaller group meshes"
            )

    def _plan(self, aval: Aval) -> ShardPlan:
        plan = self._plans.get(aval)
        if plan is None:
            plan = self._plans[aval] = ShardPlan(aval, self._sharding(aval))
        return plan

    def _bind_send(self, group: int, instr: Send) -> tuple[Step, Step]:
        slot = self.layout.slot(group, instr.buf)
        plan = self._plan(self.group_program.aval(instr.buf))
        sends = self._messenger.sends(plan, instr.dst, instr.tag)

        def step(table: Table, times: Any) -> None:
            for fn, shard in zip(sends, plan.shards_of(table[slot])):
                fn(shard)

        args = {"dst": instr.dst, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        return step, timed_message(step, group, "send", args)

    def _bind_recv(self, group: int, instr: Recv) -> tuple[Step, Step]:
        slot = self.layout.slot(group, instr.buf)
        plan = self._plan(instr.aval)
        recvs = self._messenger.recvs(plan, instr.src, instr.tag)

        def step(table: Table, times: Any) -> None:
            table[slot] = plan.assemble([fn() for fn in recvs])

        args = {"src": instr.src, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        return step, timed_message(step, group, "recv", args)

    def _bind_sendrecv(self, group: int, instr: SendRecv) -> tuple[Step, Step]:
        if instr.dst != instr.src:
            raise ValueError(f"group {group}: `{instr}` exchanges with two peers")
        s_slot = self.layout.slot(group, instr.send_buf)
        r_slot = self.layout.slot(group, instr.recv_buf)
        s_plan = self._plan(self.group_program.aval(instr.send_buf))
        r_plan = self._plan(instr.aval)
        m = self._messenger
        n = m.n
        # Shard j of each direction pairs into one sendrecv while both sit on one device.
        paired = 0
        for (s_dev, _, _), (r_dev, _, _) in zip(s_plan.pieces, r_plan.pieces):
            if s_dev != r_dev:
                break
            paired += 1
        both = []
        for j in range(paired):
            s_dev, s_shape, _ = s_plan.pieces[j]
            r_dev, r_shape, _ = r_plan.pieces[j]
            both.append(m.sendrecv(s_shape, s_plan.dtype, r_shape, r_plan.dtype, instr.dst,
                                   instr.send_tag * n + j, instr.recv_tag * n + j,
                                   m._in_sharding(s_plan, s_dev),
                                   m._in_sharding(r_plan, r_dev)))
        sends = m.sends(s_plan, instr.dst, instr.send_tag)[paired:]
        recvs = m.recvs(r_plan, instr.src, instr.recv_tag)[paired:]

        sends_first = group < instr.dst  # the unpaired rest: the lower rank sends first

        def step(table: Table, times: Any) -> None:
            shards = s_plan.shards_of(table[s_slot])
            got = [fn(x) for fn, x in zip(both, shards)]
            if not sends_first:
                got += [fn() for fn in recvs]
            for fn, x in zip(sends, shards[paired:]):
                fn(x)
            if sends_first:
                got += [fn() for fn in recvs]
            table[r_slot] = r_plan.assemble(got)

        args = {"peer": instr.dst, "send_tag": instr.send_tag, "recv_tag": instr.recv_tag,
                "send_buf": instr.send_buf, "recv_buf": instr.recv_buf,
                "send_bytes": s_plan.nbytes, "recv_bytes": r_plan.nbytes}
        return step, timed_message(step, group, "sendrecv", args)

    def run_replicas(self, step_inputs) -> list[dict[int, jax.Array]]:
        """Runs one step of this rank's program; per flat output, {group: array} for the
        outputs this group holds (empty dicts for the others)."""
        table = self.layout.new_table()
        self._bind_inputs(table, step_inputs)
        execute(self._steps, table)
        return self._collect(table)


def agree_on_program(program: Program, comm: Any) -> None:
    """Allgathers the program hash (the barrier before the first message).

    Raises:
      ValueError: on every rank, when the ranks built different programs, naming the
        ranks that differ from rank 0 and the first differing line of each.
    """
    mine = program.hash()
    hashes = comm.allgather(mine)
    if len(set(hashes)) == 1:
        return
    texts = comm.allgather(str(program))
    lines0 = texts[0].splitlines()
    details = []
    for r, (h, text) in enumerate(zip(hashes, texts)):
        if h == hashes[0]:
            continue
        lines = text.splitlines()
        k = next((i for i, (a, b) in enumerate(zip(lines0, lines)) if a != b),
                 min(len(lines0), len(lines)))
        a = lines0[k] if k < len(lines0) else "<end>"
        b = lines[k] if k < len(lines) else "<end>"
        details.append(f"  rank {r} (hash {h[:12]}) differs from rank 0 (hash "
                       f"{hashes[0][:12]}) at program line {k + 1}:\n"
                       f"    rank 0:  {a.strip()}\n    rank {r}:  {b.strip()}")
    raise ValueError(
        "the ranks compiled different programs for this step, so their messages would not "
        "match; every rank must call the step with the same shapes, dtypes, shardings and "
        "schedule:\n" + "\n".join(details)
    )
