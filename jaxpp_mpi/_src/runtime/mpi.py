"""The MPI executor: this rank runs its own group's program; messages go through mpi4jax.

Its message instructions are bound by a `MessageBinder` (`Note: messages` in
runtime/mpi_messages.py). Here: a step's run (its inputs, the staged threads' start,
the watchdog's marks, its outputs once the host copies they need are taken), the
watchdog's words for an instruction, and the job's setup over a new mesh's
communicator (`adopt_comm`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
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
from jaxpp_mpi._src.launch.abort import bounded
from jaxpp_mpi._src.mpi.heap import tune_heap
from jaxpp_mpi._src.mpi.staged import StagedRecvs, StagedSends
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
    bind_free,
    bind_run,
    bind_steps,
    execute,
    wall_ns,
)
from jaxpp_mpi._src.runtime.failure import (
    Watchdog,
    describe_task,
    install_abort_on_exception,
    step_call_deadline_s,
)
from jaxpp_mpi._src.runtime.hosts import describe_hosts, host_of, hosts_of
from jaxpp_mpi._src.runtime.mpi_messages import MessageBinder
from jaxpp_mpi._src.timeline.timing import TraceEvent, active_task_times

__all__ = ["MpiExecutor", "adopt_comm"]

_MPI_INSTRS = (Send, Recv, SendRecv, AllReduce)  # what the order chain carries


class MpiExecutor:
    """Runs this rank's group of a Program; messages go over MPI (`Note: messages`).

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
        self._messages = msgs = MessageBinder(gp, layout, mpmd_idx, sharding, comm,
                                              replica_comm, options)
        self._chain, self._posted = msgs.chain, msgs.posted
        self._sends, self._recvs = msgs.sends, msgs.recvs
        if self._sends is not None:
            weakref.finalize(self, _stop_threads, self._sends, self._recvs)
        tables: list[Mapping[str, Executable]] = [{} for _ in range(program.num_groups)]
        tables[mpmd_idx] = executables
        binders: dict[type, StepBinder] = {
            Run: msgs.guard_donations(bind_run(layout, tables)),
            Free: bind_free(layout),
            Send: msgs.bind_send,
            Recv: msgs.bind_recv,
            SendRecv: msgs.bind_sendrecv,
            AllReduce: msgs.bind_allreduce,
        }
        self._steps = bind_steps(((mpmd_idx, i) for i in gp.instrs), binders)
        # The staged sends of values that outlive the step (`Note: staged messages`).
        lasting = {b for b, _ in gp.inputs} | {b for b, _ in gp.outputs}
        self._lasting_sends = [layout.slot(mpmd_idx, b) for b in sorted(lasting & msgs.sent_bufs)]
        self._options = options
        self._watchdog = None
        self._has_messages = any(isinstance(i, _MPI_INSTRS) for i in gp.instrs)
        if options.watchdog:
            job = job_comm or comm  # a stall in one replica ends every replica
            rank = int(job.Get_rank())
            # Note: rank hosts: where each peer runs, named in the watchdog's words.
            describe = functools.partial(describe_instr, gp, hosts=hosts_of(comm),
                                         replica_hosts=hosts_of(replica_comm))
            self._watchdog = Watchdog(rank, options, describe, len(gp.instrs),
                                      bounded(job.Abort, rank))
            self._steps = self._marked(self._steps, self._watchdog)
        groups = program.groups
        num_inputs = 1 + max((k for g in groups for _, k in g.inputs), default=-1)
        num_outputs = 1 + max((k for g in groups for _, k in g.outputs), default=-1)
        self._bind_inputs = InputBinder(layout, [gp], lambda g, a: sharding(a), num_inputs)
        self._collect = OutputCollector(layout, [gp], num_outputs)

    def call_deadline_s(self, slowest_gap_s: float) -> float | None:
        """The deadline of the next step call's agreement (`step_call_deadline_s`: the
        watchdog's deadline for the coming step), given the longest the caller's loop
        spent between two calls; None: the usual deadline."""
        wd = self._watchdog
        return step_call_deadline_s(self._options, None if wd is None else wd.deadline_s(),
                                    slowest_gap_s)

    def _start_staged(self, times: Any) -> None:
        """A step's start for staged messages: the threads' trace hooks (when events
        are recorded) and the receiver's go."""
        events = times.events if times is not None else None
        self._sends.start_step(_recorder(events, self.mpmd_idx, "sender"))
        self._recvs.start_step(_recorder(events, self.mpmd_idx, "receiver"))

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
            self._sends.wait_copied(max(self._messages.sent_seq[s] for s in self._lasting_sends))

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


def describe_instr(gp: GroupProgram, k: int, hosts: Sequence[str | None] = (),
                   replica_hosts: Sequence[str | None] = ()) -> str:
    """Instruction k of `gp` for a person: the message, its peer's host and the task it
    feeds or drains, e.g. 'Recv(%17 from rank 1 on host n2, tag 5) of task B3s1
    (backward, microbatch 3, stage 1)'.

    Args:
      gp: the group's program.
      k: the instruction's index.
      hosts: the host of each rank of the pipeline's communicator, if known (`Note:
        rank hosts` in runtime/hosts.py).
      replica_hosts: the same for the replica communicator (AllReduce).
    """
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
        what = (f"Send(%{instr.buf} to rank {instr.dst}{host_of(hosts, instr.dst)}, tag "
                f"{instr.tag})")
        task = producer(instr.buf)
    elif isinstance(instr, Recv):
        what = (f"Recv(%{instr.buf} from rank {instr.src}{host_of(hosts, instr.src)}, tag "
                f"{instr.tag})")
        task = consumer(instr.buf)
    elif isinstance(instr, SendRecv):
        what = (f"SendRecv(%{instr.send_buf} to rank {instr.dst}{host_of(hosts, instr.dst)}, "
                f"tag {instr.send_tag}; %{instr.recv_buf} from rank {instr.src}"
                f"{host_of(hosts, instr.src)}, tag {instr.recv_tag})")
        task = consumer(instr.recv_buf) or producer(instr.send_buf)
    elif isinstance(instr, AllReduce):
        where = describe_hosts(replica_hosts)
        what = (f"AllReduce({', '.join(f'%{b}' for b in instr.bufs)} op={instr.op} across "
                f"the pipeline replicas{f' ({where})' if where else ''})")
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
        rank = int(comm.Get_rank())
        install_abort_on_exception(rank, bounded(abort, rank))  # Note: bounded abort


def agree_on_program(program: Program, comm: Any) -> None:
    """Allgathers the program hash (the barrier before the first message).

    The logic lives in `jaxpp_mpi._src.runtime.agree.agree_on_program` (Note: raise on every
    rank), with the other collective decisions.

    Raises:
      ValueError: on every rank, when the ranks built different programs, naming the
        ranks that differ from rank 0 and the first differing line of each.
    """
    agree.agree_on_program(program, comm)
