"""This rank's message instructions as MPI calls: order chains, posted sends, staged threads.

The MPI executor (runtime/mpi.py) binds each Send, Recv, SendRecv and AllReduce of its
group's program through a `MessageBinder`, which holds what the messages go through.

Note: messages.
  A Send, Recv or SendRecv becomes calls of small single-device jitted *message chains*
  (`Note: message chains` in mpi/chains.py), compiled before the first step: mpi4jax's
  MPI calls without its ordered effect, ordered instead by one `order` array that every
  chain of this rank takes and returns (moved between devices when consecutive chains
  run on different devices), so this rank's MPI calls happen in program order. A value
  of a multi-device group moves *shard by shard*: its distinct shards (one per
  distinct index of its sharding, taken from the first device holding it, in mesh
  order) travel as separate messages, shard j with MPI tag j. The program's tags
  (`assign_tags` in ir/passes.py) number each channel's messages in the order both ends
  post them, and MPI matches the messages of one (source, communicator, tag) in posting
  order (non-overtaking), so the k-th receive of shard j on a channel gets the k-th send
  of it: the pairing the program's tags name, without the tag on the wire. One compiled
  chain therefore serves every microbatch of a channel (a tag is a compile-time
  attribute of mpi4jax's calls), and no program outgrows MPI_TAG_UB.
  The receiver gets each distinct shard on the first device that holds it, copies it
  to the other devices holding the same index, and assembles the array. Both ends
  compute the same shard list from the same Aval and equally shaped group meshes. A
  SendRecv pairs send shard j with receive shard j while both sit on the same mesh
  position; the unpaired rest (different layouts on both ends) follows with the lower
  rank sending first and the higher receiving first, so the exchange stays
  deadlock-free.

  An AllReduce (pipeline replicas, `Note: replicas` in compiler/replicas.py) runs over
  the replica communicator, through the same order chain: per device, the distinct
  shards that device holds first of the bucket's buffers travel as one flat buffer
  per combined dtype (every replica has the same layouts, so shard j meets shard j).

  On a CPU group, sends (and the send halves of SendRecvs) are *posted* instead
  (`Note: posted sends` in mpi/posted.py): non-blocking MPI sends from the array's host
  buffer, in program order, so this rank goes on computing while its message waits for
  the receiver. A SendRecv then posts its send shards and receives its receive shards
  through the chain; a posted send cannot block, so no pairing is needed there.

  Off CPU, unless MPI takes device buffers (and everywhere with
  JAXPP_MPI_STAGED_MESSAGES=1: `config.stages_messages`), every message is *staged*
  instead (`Note: staged messages` in mpi/staged.py, which argues its order and its
  deadlock freedom): a sender thread posts the sends from host copies, first in first
  out, and a receiver thread serves the receives in program order, a window ahead of
  the dispatching thread, and copies them to the devices; a Send only queues its
  shards, a Recv takes what the receiver has. Program order per channel, and so the
  pairing above, holds on each thread; both halves of a SendRecv go through the
  threads, unpaired; a Run donating a buffer whose staged send has no host copy yet
  waits for that copy first.

  Otherwise nothing blocks Python: each step dispatches executables and chains
  asynchronously (a posted send waits for the value it sends, a staged Recv for a
  value not received yet); the order chain keeps
  this rank's chained receives and sends in program order, which the verifier
  proved deadlock-free under rendezvous semantics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.ir.program import AllReduce, Aval, GroupProgram, Recv, Run, Send, SendRecv
from jaxpp_mpi._src.mpi import chains
from jaxpp_mpi._src.mpi.posted import PostedSends, posts_sends
from jaxpp_mpi._src.mpi.staged import StagedRecvs, StagedSends, stages_messages
from jaxpp_mpi._src.runtime.executor import (
    BufferLayout,
    Step,
    StepBinder,
    Table,
    bind_allreduce_identity,
    timed_message,
)
from jaxpp_mpi._src.runtime.shards import Messenger, ShardPlan

__all__ = ["MessageBinder"]


class MessageBinder:
    """Binds one group's message instructions to steps (see `Note: messages`).

    Args:
      gp: the group's program.
      layout: the executor's buffer layout (slots of `gp`'s buffers).
      mpmd_idx: the group (== this rank's rank in `comm`), naming the staged threads.
      sharding: `sharding(aval)` is the sharding of a value of this group.
      comm: the communicator (rank r runs group r).
      replica_comm: the communicator of this group's replicas (`AllReduce`), or None
        with one replica.
      options: the options (staged messages, posted sends).

    Attributes:
      chain: the order chain of this rank's chained MPI calls.
      sends, recvs: the staged sender and receiver threads (`Note: staged messages`),
        or None.
      posted: the posted sends (`Note: posted sends`), or None.
      sent_bufs: the buffers that staged sends bound so far (in binding order) take.
      sent_seq: per slot, its staged send's FIFO number.
    """

    def __init__(
        self,
        gp: GroupProgram,
        layout: BufferLayout,
        mpmd_idx: int,
        sharding: Callable[[Aval], NamedSharding],
        comm: Any,
        replica_comm: Any,
        options: Options,
    ):
        self._gp = gp
        self._layout = layout
        self._messenger = Messenger(comm, replica_comm)
        first_device = sharding(Aval((), "int32")).mesh.devices.flat[0]
        self.chain = chains.Chain(first_device)
        self.sends: StagedSends | None = None
        self.recvs: StagedRecvs | None = None
        if stages_messages(first_device, options):  # Note: staged messages
            self.sends = StagedSends(comm, f"jaxpp_mpi-sender-g{mpmd_idx}")
            self.recvs = StagedRecvs(comm, f"jaxpp_mpi-receiver-g{mpmd_idx}")
        self.sent_bufs: set[int] = set()  # buffers sent so far in binding order
        self.sent_seq = [0] * layout.size  # per slot: its staged send's FIFO number
        posted = self.sends is None and posts_sends(first_device, options.posted_sends)
        self.posted = PostedSends(comm) if posted else None
        self._plans: dict[Aval, ShardPlan] = {}
        self._sharding = sharding
        self._replica_comm = replica_comm

    def _plan(self, aval: Aval) -> ShardPlan:
        plan = self._plans.get(aval)
        if plan is None:
            plan = self._plans[aval] = ShardPlan(aval, self._sharding(aval))
        return plan

    def guard_donations(self, bind: StepBinder) -> StepBinder:
        """`bind` (Run's binder), whose steps first wait for the host copies of the
        donated buffers that a staged send took earlier in the program (`Note: staged
        messages`). Relies on `bind_steps` binding in program order: `_sent_bufs` holds
        the buffers sent before the Run being bound."""

        def guarded(group: int, instr: Run) -> tuple[Step, Step]:
            run, timed = bind(group, instr)
            slots = [self._layout.slot(group, b) for b in instr.donate if b in self.sent_bufs]
            if self.sends is None or not slots:
                return run, timed
            sends, seqs = self.sends, self.sent_seq

            def wait_then(step: Step) -> Step:
                def step_after_copies(table: Table, times: Any) -> None:
                    sends.wait_copied(max(seqs[s] for s in slots))
                    step(table, times)

                return step_after_copies

            return wait_then(run), wait_then(timed)

        return guarded

    def bind_send(self, group: int, instr: Send) -> tuple[Step, Step]:
        slot = self._layout.slot(group, instr.buf)
        plan = self._plan(self._gp.aval(instr.buf))
        m, chain, posted, dst = self._messenger, self.chain, self.posted, instr.dst
        args = {"dst": dst, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        if (staged := self.sends) is not None:
            self.sent_bufs.add(instr.buf)
            seqs = self.sent_seq

            def stage(table: Table, times: Any) -> None:
                seqs[slot] = staged.send(plan.shards_of(table[slot]), dst, args).seq

            return stage, timed_message(stage, group, "send", args, _nothing)
        if posted is not None:
            def post(table: Table, times: Any) -> None:
                posted.post_shards(plan.shards_of(table[slot]), dst)

            return post, timed_message(post, group, "send", args, _nothing)
        sends = [m.send(plan, j, dst) for j in range(len(plan.pieces))]

        def step(table: Table, times: Any) -> None:
            for (device, fn), shard in zip(sends, plan.shards_of(table[slot])):
                (chain.order,) = fn(chain.on(device), shard)

        return step, timed_message(step, group, "send", args, chain.wait)

    def bind_recv(self, group: int, instr: Recv) -> tuple[Step, Step]:
        slot = self._layout.slot(group, instr.buf)
        plan = self._plan(instr.aval)
        m, chain = self._messenger, self.chain
        args = {"src": instr.src, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        if (staged := self.recvs) is not None:
            k = staged.add(plan, instr.src, args)

            def take(table: Table, times: Any) -> None:
                table[slot] = staged.take(k)

            def take_ready(table: Table, times: Any) -> None:  # timed: on the device
                table[slot] = jax.block_until_ready(staged.take(k))

            return take, timed_message(take_ready, group, "recv", args, _nothing)
        recvs = [m.recv(plan, j, instr.src) for j in range(len(plan.pieces))]

        def step(table: Table, times: Any) -> None:
            table[slot] = plan.assemble(_received(chain, recvs))

        return step, timed_message(step, group, "recv", args, chain.wait)

    def bind_sendrecv(self, group: int, instr: SendRecv) -> tuple[Step, Step]:
        if instr.dst != instr.src:
            raise ValueError(f"group {group}: `{instr}` exchanges with two peers")
        s_slot = self._layout.slot(group, instr.send_buf)
        r_slot = self._layout.slot(group, instr.recv_buf)
        s_plan = self._plan(self._gp.aval(instr.send_buf))
        r_plan = self._plan(instr.aval)
        m, chain, peer = self._messenger, self.chain, instr.dst
        args = {"peer": peer, "send_tag": instr.send_tag, "recv_tag": instr.recv_tag,
                "send_buf": instr.send_buf, "recv_buf": instr.recv_buf,
                "send_bytes": s_plan.nbytes, "recv_bytes": r_plan.nbytes}
        if (staged := self.sends) is not None:  # both halves staged: nothing to pair
            self.sent_bufs.add(instr.send_buf)
            recvs_staged = self.recvs
            k = recvs_staged.add(r_plan, peer, args)
            seqs = self.sent_seq

            def stage(table: Table, times: Any) -> None:
                seqs[s_slot] = staged.send(s_plan.shards_of(table[s_slot]), peer, args).seq
                table[r_slot] = recvs_staged.take(k)

            def stage_ready(table: Table, times: Any) -> None:  # timed: on the device
                stage(table, times)
                jax.block_until_ready(table[r_slot])

            return stage, timed_message(stage_ready, group, "sendrecv", args, _nothing)
        if (posted := self.posted) is not None:  # posted first, so no order can block
            recvs = [m.recv(r_plan, j, peer) for j in range(len(r_plan.pieces))]

            def exchange(table: Table, times: Any) -> None:
                posted.post_shards(s_plan.shards_of(table[s_slot]), peer)
                table[r_slot] = r_plan.assemble(_received(chain, recvs))

            return exchange, timed_message(exchange, group, "sendrecv", args, chain.wait)
        # Shard j of each direction pairs into one sendrecv while both sit on one device.
        paired = 0
        for (s_dev, _, _), (r_dev, _, _) in zip(s_plan.pieces, r_plan.pieces):
            if s_dev != r_dev:
                break
            paired += 1
        both = [m.sendrecv(s_plan, r_plan, j, peer)
                for j in range(paired)]
        sends = [m.send(s_plan, j, peer)
                 for j in range(paired, len(s_plan.pieces))]
        recvs = [m.recv(r_plan, j, peer)
                 for j in range(paired, len(r_plan.pieces))]
        sends_first = group < peer  # the unpaired rest: the lower rank sends first

        def step(table: Table, times: Any) -> None:
            shards = s_plan.shards_of(table[s_slot])
            got = []
            for (device, fn), x in zip(both, shards):
                chain.order, y = fn(chain.on(device), x)
                got.append(y)
            if not sends_first:
                got += _received(chain, recvs)
            for (device, fn), x in zip(sends, shards[paired:]):
                (chain.order,) = fn(chain.on(device), x)
            if sends_first:
                got += _received(chain, recvs)
            table[r_slot] = r_plan.assemble(got)

        return step, timed_message(step, group, "sendrecv", args, chain.wait)

    def bind_allreduce(self, group: int, instr: AllReduce) -> tuple[Step, Step]:
        comm = self._replica_comm
        if comm is None:  # one replica: nothing to combine
            return bind_allreduce_identity()(group, instr)
        slots = [self._layout.slot(group, b) for b in instr.bufs]
        plans = [self._plan(self._gp.aval(b)) for b in instr.bufs]
        by_device: dict[Any, list[tuple[int, int]]] = {}
        for i, plan in enumerate(plans):
            for j, (device, _, _) in enumerate(plan.pieces):
                by_device.setdefault(device, []).append((i, j))
        m, chain = self._messenger, self.chain
        calls = [(device, pairs, m.allreduce(instr.op, tuple((plans[i], j) for i, j in pairs),
                                            device))
                 for device, pairs in by_device.items()]

        def step(table: Table, times: Any) -> None:
            shards = [plan.shards_of(table[slot]) for plan, slot in zip(plans, slots)]
            got: list[list[Any]] = [[None] * len(plan.pieces) for plan in plans]
            for device, pairs, fn in calls:
                chain.order, *ys = fn(chain.on(device), *(shards[i][j] for i, j in pairs))
                for (i, j), y in zip(pairs, ys):
                    got[i][j] = y
            for plan, slot, pieces in zip(plans, slots, got):
                table[slot] = plan.assemble(pieces)

        args = {"bufs": list(instr.bufs), "op": instr.op,
                "bytes": sum(plan.nbytes for plan in plans),
                "replicas": int(comm.Get_size())}
        return step, timed_message(step, group, "allreduce", args, chain.wait)


def _received(chain: chains.Chain, recvs: list) -> list[jax.Array]:
    """Runs receive chains `recvs` ((device, fn) per shard) in order on `chain`; their
    shards."""
    got = []
    for device, fn in recvs:
        chain.order, x = fn(chain.on(device))
        got.append(x)
    return got


def _nothing() -> None:
    """A posted send's wait in a trace: posting returns once MPI has the message (a
    staged one once it is queued; its thread's events show the rest)."""
