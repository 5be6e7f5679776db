"""The MPI executor: this rank runs its own group's program; messages go through mpi4jax.

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

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.mpi import chains
from jaxpp_mpi._src.mpi.heap import tune_heap
from jaxpp_mpi._src.mpi.posted import PostedSends, posts_sends
from jaxpp_mpi._src.mpi.staged import StagedRecvs, StagedSends, stages_messages
from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.executor import (
    BufferLayout,
    Executable,
    InputBinder,
    OutputCollector,
    Step,
    StepBinder,
    StepLists,
    Table,
    bind_allreduce_identity,
    bind_free,
    bind_run,
    bind_steps,
    execute,
    timed_message,
    wall_ns,
)
from jaxpp_mpi._src.runtime.failure import Watchdog, describe_task, install_abort_on_exception
from jaxpp_mpi._src.runtime.shards import Messenger, ShardPlan
from jaxpp_mpi._src.timeline.timing import TraceEvent, active_task_times

__all__ = ["MpiExecutor", "adopt_comm"]

_MPI_INSTRS = (Send, Recv, SendRecv, AllReduce)  # what the order chain carries


class MpiExecutor:
    """Runs this rank's group of a Program; messages go over MPI (see `Note: messages`).

    Args:
      program: the whole program (every rank holds the same one), verified by the
        compiler (`build_program`); a hand-built one must pass `simulate.verify` first.
      mpmd_idx: this rank's group (== its rank in `comm`).
      executables: group `mpmd_idx`'s executables by name (as for the local executor).
      sharding: `sharding(aval)` is the sharding of a value of this group.
      comm: the communicator (rank r runs group r).
      replica_comm: the communicator of this group's replicas (`AllReduce`), or None
        with one replica.
      job_comm: every rank of the job (the watchdog's rank and abort), default `comm`.
    """

    def __init__(
        self,
        program: Program,
        mpmd_idx: int,
        executables: Mapping[str, Executable],
        sharding: Callable[[Aval], NamedSharding],
        comm: Any,
        options: Options | None = None,
        replica_comm: Any = None,
        job_comm: Any = None,
    ):
        options = options or config.options()
        if options.heap_tuning:
            tune_heap()
        self.program = program
        self.mpmd_idx = mpmd_idx
        gp: GroupProgram = program.group(mpmd_idx)
        self.group_program = gp
        self.layout = layout = BufferLayout([gp])
        self._messenger = Messenger(comm, replica_comm)
        first_device = sharding(Aval((), "int32")).mesh.devices.flat[0]
        self._chain = chains.Chain(first_device)
        self._sends: StagedSends | None = None
        self._recvs: StagedRecvs | None = None
        if stages_messages(first_device, options):  # Note: staged messages
            self._sends = StagedSends(comm, f"jaxpp_mpi-sender-g{mpmd_idx}")
            self._recvs = StagedRecvs(comm, f"jaxpp_mpi-receiver-g{mpmd_idx}")
            weakref.finalize(self, _stop_threads, self._sends, self._recvs)
        self._sent_bufs: set[int] = set()  # buffers sent so far in binding order
        self._sent_seq = [0] * layout.size  # per slot: its staged send's FIFO number
        posted = self._sends is None and posts_sends(first_device, options.posted_sends)
        self._posted = PostedSends(comm) if posted else None
        self._plans: dict[Aval, ShardPlan] = {}
        self._sharding = sharding
        self._replica_comm = replica_comm
        tables: list[Mapping[str, Executable]] = [{} for _ in range(program.num_groups)]
        tables[mpmd_idx] = executables
        binders: dict[type, StepBinder] = {
            Run: self._guard_donations(bind_run(layout, tables)),
            Free: bind_free(layout),
            Send: self._bind_send,
            Recv: self._bind_recv,
            SendRecv: self._bind_sendrecv,
            AllReduce: self._bind_allreduce,
        }
        self._steps = bind_steps(((mpmd_idx, i) for i in gp.instrs), binders)
        # The staged sends of values that outlive the step (`Note: staged messages`).
        lasting = {b for b, _ in gp.inputs} | {b for b, _ in gp.outputs}
        self._lasting_sends = [layout.slot(mpmd_idx, b) for b in sorted(lasting & self._sent_bufs)]
        self._watchdog = None
        self._has_messages = any(isinstance(i, _MPI_INSTRS) for i in gp.instrs)
        if options.watchdog:
            job = job_comm or comm  # a stall in one replica ends every replica
            self._watchdog = Watchdog(job.Get_rank(), options, functools.partial(
                describe_instr, gp), len(gp.instrs), job.Abort)
            self._steps = self._marked(self._steps, self._watchdog)
        groups = program.groups
        num_inputs = 1 + max((k for g in groups for _, k in g.inputs), default=-1)
        num_outputs = 1 + max((k for g in groups for _, k in g.outputs), default=-1)
        self._bind_inputs = InputBinder(layout, [gp], lambda g, a: sharding(a), num_inputs)
        self._collect = OutputCollector(layout, [gp], num_outputs)

    def _plan(self, aval: Aval) -> ShardPlan:
        plan = self._plans.get(aval)
        if plan is None:
            plan = self._plans[aval] = ShardPlan(aval, self._sharding(aval))
        return plan

    def _guard_donations(self, bind: StepBinder) -> StepBinder:
        """`bind` (Run's binder), whose steps first wait for the host copies of the
        donated buffers that a staged send took earlier in the program (`Note: staged
        messages`). Relies on `bind_steps` binding in program order: `_sent_bufs` holds
        the buffers sent before the Run being bound."""

        def guarded(group: int, instr: Run) -> tuple[Step, Step]:
            run, timed = bind(group, instr)
            slots = [self.layout.slot(group, b) for b in instr.donate if b in self._sent_bufs]
            if self._sends is None or not slots:
                return run, timed
            sends, seqs = self._sends, self._sent_seq

            def wait_then(step: Step) -> Step:
                def step_after_copies(table: Table, times: Any) -> None:
                    sends.wait_copied(max(seqs[s] for s in slots))
                    step(table, times)

                return step_after_copies

            return wait_then(run), wait_then(timed)

        return guarded

    def _start_staged(self, times: Any) -> None:
        """A step's start for staged messages: the threads' trace hooks (when events
        are recorded) and the receiver's go."""
        events = times.events if times is not None else None
        self._sends.start_step(_recorder(events, self.mpmd_idx, "sender"))
        self._recvs.start_step(_recorder(events, self.mpmd_idx, "receiver"))

    def _bind_send(self, group: int, instr: Send) -> tuple[Step, Step]:
        slot = self.layout.slot(group, instr.buf)
        plan = self._plan(self.group_program.aval(instr.buf))
        m, chain, posted, dst = self._messenger, self._chain, self._posted, instr.dst
        args = {"dst": dst, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        if (staged := self._sends) is not None:
            self._sent_bufs.add(instr.buf)
            seqs = self._sent_seq

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

    def _bind_recv(self, group: int, instr: Recv) -> tuple[Step, Step]:
        slot = self.layout.slot(group, instr.buf)
        plan = self._plan(instr.aval)
        m, chain = self._messenger, self._chain
        args = {"src": instr.src, "tag": instr.tag, "buf": instr.buf, "bytes": plan.nbytes}
        if (staged := self._recvs) is not None:
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

    def _bind_sendrecv(self, group: int, instr: SendRecv) -> tuple[Step, Step]:
        if instr.dst != instr.src:
            raise ValueError(f"group {group}: `{instr}` exchanges with two peers")
        s_slot = self.layout.slot(group, instr.send_buf)
        r_slot = self.layout.slot(group, instr.recv_buf)
        s_plan = self._plan(self.group_program.aval(instr.send_buf))
        r_plan = self._plan(instr.aval)
        m, chain, peer = self._messenger, self._chain, instr.dst
        args = {"peer": peer, "send_tag": instr.send_tag, "recv_tag": instr.recv_tag,
                "send_buf": instr.send_buf, "recv_buf": instr.recv_buf,
                "send_bytes": s_plan.nbytes, "recv_bytes": r_plan.nbytes}
        if (staged := self._sends) is not None:  # both halves staged: nothing to pair
            self._sent_bufs.add(instr.send_buf)
            recvs_staged = self._recvs
            k = recvs_staged.add(r_plan, peer, args)
            seqs = self._sent_seq

            def stage(table: Table, times: Any) -> None:
                seqs[s_slot] = staged.send(s_plan.shards_of(table[s_slot]), peer, args).seq
                table[r_slot] = recvs_staged.take(k)

            def stage_ready(table: Table, times: Any) -> None:  # timed: on the device
                stage(table, times)
                jax.block_until_ready(table[r_slot])

            return stage, timed_message(stage_ready, group, "sendrecv", args, _nothing)
        if (posted := self._posted) is not None:  # posted first, so no order can block
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

    def _bind_allreduce(self, group: int, instr: AllReduce) -> tuple[Step, Step]:
        comm = self._replica_comm
        if comm is None:  # one replica: nothing to combine
            return bind_allreduce_identity()(group, instr)
        slots = [self.layout.slot(group, b) for b in instr.bufs]
        plans = [self._plan(self.group_program.aval(b)) for b in instr.bufs]
        by_device: dict[Any, list[tuple[int, int]]] = {}
        for i, plan in enumerate(plans):
            for j, (device, _, _) in enumerate(plan.pieces):
                by_device.setdefault(device, []).append((i, j))
        m, chain = self._messenger, self._chain
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

    def run_replicas(self, step_inputs) -> list[dict[int, jax.Array]]:
        """Runs one step of this rank's program; per flat output, {group: array} for the
        outputs this group holds (empty dicts for the others)."""
        table = self.layout.new_table()
        if self._posted is not None:
            self._posted.reap()  # the last step's sends, mostly done by now
        self._bind_inputs(table, step_inputs)
        times = active_task_times()
        if self._sends is not None:
            self._start_staged(times)
        wd = self._watchdog
        if wd is None:
            execute(self._steps, table)
            self._lasting_copied(times)
            return self._collect(table)
        wd.step_started()
        try:
            for k, step in enumerate(self._steps.untimed if times is None
                                     else self._steps.timed):
                wd.pc = k
                step(table, times)
        except BaseException:
            wd.step_abandoned()  # the error is the caller's to report, not a hang
            raise
        last = self._chain.order if self._has_messages else None
        if self._sends is not None:  # done once its sends are posted, too
            last = _AllReady((last, self._sends.last))
        wd.step_dispatched(last)
        self._lasting_copied(times)
        return self._collect(table)

    def _lasting_copied(self, times: Any) -> None:
        """Waits until the staged sends of the step's inputs and outputs hold their host
        copies: the caller, or the next step, may donate them (`Note: staged
        messages`). A step whose events are recorded waits for all of its sends, so its
        events are complete when it returns."""
        if times is not None and times.events is not None and self._sends is not None:
            self._sends.wait()
        elif self._lasting_sends:
            self._sends.wait_copied(max(self._sent_seq[s] for s in self._lasting_sends))

    def _marked(self, steps: StepLists, wd: Watchdog) -> StepLists:
        """`steps` where each message step leaves its chain's order array in
        `wd.marks` (see `Note: watchdog`); a staged send its `StagedSend` (ready once
        posted), a staged receive nothing (taken, it is done)."""
        chain, marks, sends = self._chain, wd.marks, self._sends

        def mark(k: int, step: Step, what: Callable[[], Any]) -> Step:
            def marked(table: Table, times: Any) -> None:
                step(table, times)
                marks[k] = what()

            return marked

        def order() -> Any:
            return chain.order

        def last_send() -> Any:
            return sends.last

        pairs = []
        for k, (instr, untimed, timed) in enumerate(
                zip(self.group_program.instrs, steps.untimed, steps.timed)):
            what = order if isinstance(instr, _MPI_INSTRS) else None
            if sends is not None and isinstance(instr, (Recv, Send, SendRecv)):
                what = None if isinstance(instr, Recv) else last_send
            if what is not None:
                untimed, timed = mark(k, untimed, what), mark(k, timed, what)
            pairs.append((untimed, timed))
        return StepLists(pairs)


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


class _AllReady:
    """Ready when each of `marks` (None, or anything with `is_ready`) is: the
    watchdog's end of a step with staged sends."""

    def __init__(self, marks: tuple):
        self.marks = marks

    def is_ready(self) -> bool:
        return all(m is None or m.is_ready() for m in self.marks)


def _recorder(events: list | None, group: int, track: str) -> Callable | None:
    """The trace hook of a staged-message thread: its work as `TraceEvent`s on its own
    track (see `Note: trace events`), or None when no events are recorded."""
    if events is None:
        return None

    def record(name: str, start: int, end: int, args: dict) -> None:
        events.append(TraceEvent(name, "message", group, *wall_ns(start, end), dict(args),
                                 track=track))

    return record


def _stop_threads(sends: StagedSends, recvs: StagedRecvs) -> None:
    """An executor's end: its staged threads finish their work and stop."""
    sends.stop()
    recvs.stop()


def describe_instr(gp: GroupProgram, k: int) -> str:
    """Instruction k of `gp` for a person: the message and the task it feeds or drains,
    e.g. 'Recv(%17 from rank 1, tag 5) of task B3s1 (backward, microbatch 3, stage 1)'."""
    instrs = gp.instrs
    instr = instrs[k]
    if isinstance(instr, Run):
        return describe_task(instr.task or instr.exe)

    def producer(buf: int) -> str | None:
        return next((i.task for i in reversed(instrs[:k])
                     if isinstance(i, Run) and buf in i.outs and i.task), None)

    def consumer(buf: int) -> str | None:
        return next((i.task for i in instrs[k + 1:]
                     if isinstance(i, Run) and buf in i.ins and i.task), None)

    if isinstance(instr, Send):
        what, task = f"Send(%{instr.buf} to rank {instr.dst}, tag {instr.tag})", producer(
            instr.buf)
    elif isinstance(instr, Recv):
        what, task = f"Recv(%{instr.buf} from rank {instr.src}, tag {instr.tag})", consumer(
            instr.buf)
    elif isinstance(instr, SendRecv):
        what = (f"SendRecv(%{instr.send_buf} to rank {instr.dst}, tag {instr.send_tag}; "
                f"%{instr.recv_buf} from rank {instr.src}, tag {instr.recv_tag})")
        task = consumer(instr.recv_buf) or producer(instr.send_buf)
    elif isinstance(instr, AllReduce):
        what = (f"AllReduce({', '.join(f'%{b}' for b in instr.bufs)} op={instr.op} across "
                "the pipeline replicas)")
        task = producer(instr.bufs[0])
    else:
        return str(instr)
    return f"{what} of {describe_task(task)}" if task else what


def adopt_comm(comm: Any) -> None:
    """Sets the job up to run over `comm`, the communicator of a newly built MPI-mode mesh.

    In a job of several ranks, installs the hooks of `Note: abort on exception`
    (runtime/failure.py) unless JAXPP_MPI_ABORT_ON_EXCEPTION=0. It runs when the mesh
    is built, before anything is traced, so an exception on one rank from there on ends
    the job instead of leaving the others waiting in their next collective.

    Args:
      comm: the mesh's communicator (a stand-in without `Abort`, as in tests, is left
        alone).
    """
    abort = getattr(comm, "Abort", None)
    if config.options().abort_on_exception and abort and comm.Get_size() > 1:
        install_abort_on_exception(int(comm.Get_rank()), abort)


def agree_on_program(program: Program, comm: Any) -> None:
    """Allgathers the program hash (the barrier before the first message).

    The logic lives in `jaxpp_mpi._src.runtime.agree.agree_on_program` (Note: raise on every
    rank), with the other collective decisions.

    Raises:
      ValueError: on every rank, when the ranks built different programs, naming the
        ranks that differ from rank 0 and the first differing line of each.
    """
    agree.agree_on_program(program, comm)
