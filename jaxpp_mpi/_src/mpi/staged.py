"""Staged messages: a group's messages moved through host memory by two threads.

Note: staged messages.
  Without CUDA-aware MPI, mpi4jax's GPU handler copies a message's device buffer to
  host and calls MPI from inside the executable, synchronously: the dispatching thread,
  and the group's next computation, wait for every message. A *staged* group (the
  option JAXPP_MPI_STAGED_MESSAGES, `config.stages_messages`) takes its messages off
  that path, through host memory, with two daemon threads per MPI executor:

  - Sends. At a Send (or a SendRecv's send half) the dispatching thread starts each
    shard's device-to-host copy (`copy_to_host_async`) and queues the shards for the
    *sender thread* (`StagedSends`), which takes them first in, first out: it waits for
    the host copies and posts them with MPI_Isend from host memory, shard j with MPI
    tag j (`Note: messages` in runtime/mpi_messages.py), keeping each request and its host
    buffer until the request completes.
  - Receives. The *receiver thread* (`StagedRecvs`) serves the group's receive halves
    (Recv, SendRecv) in program order, up to a window ahead of the dispatching thread:
    at most `window` (4) messages and `window_bytes` (256 MiB) posted or received and
    not yet taken, one message always (however large). For each it posts MPI_Irecv
    into fresh host buffers, waits for them in order, starts the host-to-device copy
    (`jax.device_put` of each shard to its device, `ShardPlan.assemble`) and hands the
    array over; the dispatching thread takes it at the Recv, waiting only if it is not
    there yet. The receiver starts a step's receives when the dispatching thread starts
    the step, never earlier: no receive is posted for a step that may not come, on a
    communicator that other code may use between steps.

  Order. One thread posts every send of the group in program order, one thread every
  receive, so on each channel MPI's non-overtaking rule pairs the k-th send with the
  k-th receive: the pairing `Note: messages` relies on. On the wire a staged message is
  a chained or posted one (same tags, datatypes and order); ends may differ.

  Deadlock freedom. The verifier proved that the program completes with blocking sends
  (the rendezvous play: each instruction waits for every earlier one of its group, a
  send for its receive). Staging only removes waits from that play: the dispatching
  thread waits for no send (as with posted sends; the lowering times such programs with
  `simulate(..., sends="posted")`, `simulate.runtime_sends`); a send waits for the
  earlier sends (FIFO) and the receives before it (it was queued after they were
  taken); a receive waits for the earlier receives and, through the window, for the
  dispatching thread, which waits only for receives, in order (and for host copies,
  which wait for local work, no message). This holds whatever the peers do (chained,
  posted or staged), since it bounds each rank's own waits. Every wait left is a
  wait of the blocking play, so the play's order of completion is still a valid order
  and no cycle of waits can form; messages can only complete earlier.

  Donation. A Run may donate a buffer that a Send before it queued: once JAX deletes
  the donated array its host copy can no longer be taken. The executor knows
  statically which donated buffers of a Run were sent earlier in the program; such a
  Run first waits until the sender thread holds their host copies (`wait_copied`, by
  the sends' FIFO numbers; usually done long before). Only a step's inputs and
  outputs outlive it: a step returns once the host copies of those it sent are taken,
  so neither the next step nor the caller can donate one too early. On CPU the host
  copy is a view of the array's own buffer, which JAX does not donate while the view
  lives (as for posted sends).

  Failures. An exception in either thread is kept, wakes the dispatching thread (whose
  next wait for that thread raises it, wrapped) and is raised again in the thread, so
  the `threading.excepthook` of `Note: abort on exception` (runtime/failure.py)
  reports it and aborts the job. A stalled message shows in the watchdog (`Note:
  watchdog`): the dispatching thread waits for a late receive at its Recv (its `pc`),
  and each Send's mark (its `StagedSend`) is ready once the sender thread posted it.

  Lifetime. The threads poll their requests (`Test`, with a backoff from 20 us to 1
  ms, which also drives MPI's progress); a receive the dispatching thread is waiting
  for is waited for in MPI. A step may leave sends in flight, as posted sends do (a
  step whose trace events are recorded waits for them, so its events are complete):
  `chains.quiesce` and the exit hook wait for them (a `StagedSends` registers with
  `posted.wait_for_posted`). At exit, before MPI_Finalize, each live executor's
  threads finish their work and stop (`close_all`); they are daemon threads.

  The threads call MPI while the dispatching thread may too (AllReduce chains): staging
  needs MPI_THREAD_MULTIPLE. With less, `stages_messages` says no, with one warning,
  and the group keeps JAXPP_MPI_STAGED_MESSAGES=0's path.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

# Why an mpi4jax internal: the MPI datatype its messages use for each dtype, so that a
# staged end names the datatype a chained or posted end does.
from mpi4jax._src.utils import MPI_TYPE_MAP
from mpi4py import MPI

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.mpi import posted
from jaxpp_mpi._src.mpi.wire import wire_dtype

__all__ = ["StagedRecvs", "StagedSend", "StagedSends", "close_all", "stages_messages"]

WINDOW = 4  # messages the receiver may hold ahead of the dispatching thread...
WINDOW_BYTES = 256 << 20  # ...and their bytes (one message always)
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3
_WAKE_S = 1.0  # how often a waiting dispatching thread looks at its thread's health

# record(name, start_ns, end_ns, args): a trace hook, perf_counter_ns times.
Record = Callable[[str, int, int, dict], None]

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_warned = False


def stages_messages(device: jax.Device, options: Options) -> bool:
    """Whether this rank's group on `device` stages its messages (`Note: staged
    messages`): the option says so (`config.stages_messages`) and MPI runs with
    MPI_THREAD_MULTIPLE; with less, False and one warning naming the fix."""
    global _warned
    if not config.stages_messages(options, device.platform):
        return False
    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return True
    if not _warned:
        _warned = True
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                 "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        warnings.warn(
            "jaxpp_mpi: staged messages (JAXPP_MPI_STAGED_MESSAGES) need MPI initialised "
            f"with MPI_THREAD_MULTIPLE, but MPI runs with {names.get(level, level)}; "
            "this rank sends as with JAXPP_MPI_STAGED_MESSAGES=0 (message chains; posted "
            "sends on CPU). Fix: leave mpi4py.rc.thread_level at its default 'multiple' "
            "(set before mpi4py.MPI is imported) with an MPI built with thread support, "
            "or set JAXPP_MPI_STAGED_MESSAGES=0.", RuntimeWarning, stacklevel=2)
    return False


def _datatype(wire: np.dtype) -> Any:
    return getattr(MPI, MPI_TYPE_MAP[wire.name])


def _host(shard: jax.Array) -> np.ndarray:
    """`shard`'s bytes in host memory, as its wire dtype (waits for the copy that
    `copy_to_host_async` started; on CPU a view of the buffer itself)."""
    host = np.asarray(shard)
    wire = wire_dtype(host.dtype)
    return host if wire == host.dtype else host.view(wire)


class _Thread:
    """What both threads share: the daemon thread, its condition and its failure."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise  # threading.excepthook: `Note: abort on exception`

    def _run(self) -> None:
        raise NotImplementedError

    def _check(self) -> None:
        """Raises the thread's failure (call with `_cond` held, or without)."""
        if self._error is not None:
            raise RuntimeError(f"jaxpp_mpi: the staged-message thread {self._name} failed: "
                               f"{self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError(f"jaxpp_mpi: the staged-message thread {self._name} stopped")

    def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Waits (on the dispatching thread) until `ready()`; raises if the thread fails."""
        with self._cond:
            while not ready():
                self._check()
                self._cond.wait(_WAKE_S)


class StagedSend:
    """One queued send: its FIFO number; `is_ready()` once posted (the watchdog's mark)."""

    __slots__ = ("args", "dst", "posted", "record", "seq", "shards", "start_ns")

    def __init__(self, shards: list[jax.Array], dst: int, seq: int, record: Record | None,
                 args: dict | None):
        self.shards, self.dst, self.seq = shards, dst, seq
        self.record, self.args = record, args
        self.start_ns = time.perf_counter_ns()
        self.posted = False

    def is_ready(self) -> bool:
        return self.posted


_DONE = StagedSend([], -1, 0, None, None)
_DONE.posted = True
_STOP = object()


class StagedSends(_Thread):
    """A group's sender thread (see `Note: staged messages`).

    Args:
      comm: the communicator the messages go over.
      name: the thread's name.
    """

    def __init__(self, comm: Any, name: str = "jaxpp_mpi-sender"):
        super().__init__(name)
        self.comm = comm
        self.last: StagedSend = _DONE  # the latest queued send
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._issued = 0  # FIFO numbers handed out (dispatching thread)
        self._copied = 0  # sends whose host copies are taken (sender thread)
        self._record: Record | None = None
        posted._live.add(self)  # `chains.quiesce` and the exit hook call `wait`
        _live.add(self)

    def start_step(self, record: Record | None) -> None:
        """Called when a step starts: sets the trace hook of the step's sends."""
        self._record = record

    def send(self, shards: list[jax.Array], dst: int, args: dict | None = None) -> StagedSend:
        """Queues a value's distinct shards for `dst` (shard j, tag j); returns at once."""
        if self._error is not None:
            self._check()
        self._issued += 1
        job = StagedSend(shards, dst, self._issued, self._record, args)
        for shard in shards:
            shard.copy_to_host_async()
        self._ensure_started()
        self._queue.put(job)
        self.last = job
        return job

    def wait_copied(self, seq: int) -> None:
        """Blocks until the host copies of sends 1..`seq` are taken (`Note: staged
        messages`, donation)."""
        if self._copied < seq:
            self._wait_until(lambda: self._copied >= seq)

    def wait(self) -> None:
        """Blocks until every queued send has completed."""
        if self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(done)
        self._wait_until(done.is_set)

    def stop(self) -> None:
        """Lets the thread complete every queued send, then end (returns at once)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)

    def close(self) -> None:
        """Completes every queued send, then stops the thread (at exit: `close_all`)."""
        self.stop()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        pending: list = []  # [request, host buffer, job]
        poll = _POLL_MIN_S
        while True:
            try:
                item = self._queue.get(timeout=poll) if pending else self._queue.get()
            except queue.Empty:
                if not self._reap(pending):
                    poll = min(2 * poll, _POLL_MAX_S)
                continue
            poll = _POLL_MIN_S
            if isinstance(item, StagedSend):
                self._post(item, pending)
                self._reap(pending)
                continue
            MPI.Request.Waitall([p[0] for p in pending])
            self._reap(pending)
            if item is _STOP:
                return
            item.set()
            with self._cond:
                self._cond.notify_all()

    def _post(self, job: StagedSend, pending: list) -> None:
        hosts = [_host(shard) for shard in job.shards]
        copied = time.perf_counter_ns()
        job.shards = []  # the device arrays may go now
        with self._cond:
            self._copied = job.seq
            self._cond.notify_all()
        for j, host in enumerate(hosts):
            request = self.comm.Isend([host, _datatype(host.dtype)], job.dst, j)
            pending.append([request, host, job])
        job.posted = True
        if job.record is not None:
            job.record("copy to host", job.start_ns, copied, job.args or {})
            job.start_ns = copied  # from here on: when its MPI transfer started

    def _reap(self, pending: list) -> bool:
        """Drops completed requests (and their host buffers); whether any completed."""
        still, done = [], []
        for p in pending:
            (done if p[0].Test() else still).append(p)
        if not done:
            return False
        pending[:] = still
        end = time.perf_counter_ns()
        for _, _, job in done:
            if job.record is not None and not any(p[2] is job for p in still):
                job.record("MPI send", job.start_ns, end, job.args or {})
                job.record = None  # once per message
        return True


class StagedRecvs(_Thread):
    """A group's receiver thread (see `Note: staged messages`).

    Args:
      comm: the communicator the messages come over.
      name: the thread's name.
      window: the most messages received ahead of the dispatching thread...
      window_bytes: ...and their bytes (one message is always allowed).
    """

    def __init__(self, comm: Any, name: str = "jaxpp_mpi-receiver", window: int = WINDOW,
                 window_bytes: int = WINDOW_BYTES):
        super().__init__(name)
        self.comm = comm
        self.window, self.window_bytes = max(1, window), window_bytes
        self._specs: list[tuple[Any, int, dict]] = []  # (ShardPlan, source, trace args)
        self._bytes = [0]  # prefix sums of the receives' bytes
        self._started = 0  # steps started (dispatching thread)
        self._served = 0  # steps whose receives are all delivered (receiver thread)
        self._taken = 0  # receives of this step taken (dispatching thread)
        self._wanted = -1  # the receive the dispatching thread waits for, or -1
        self._ready: dict[int, jax.Array] = {}
        self._record: Record | None = None
        self._stop = False
        _live.add(self)

    def add(self, plan: Any, src: int, args: dict | None = None) -> int:
        """Adds the next receive of the program (a `ShardPlan`'s value from `src`);
        its index, for `take`. Called in program order, before the first step."""
        self._specs.append((plan, src, args or {}))
        self._bytes.append(self._bytes[-1] + plan.nbytes)
        return len(self._specs) - 1

    def start_step(self, record: Record | None) -> None:
        """Called when a step starts: the receiver begins the step's receives.

        Raises:
          RuntimeError: if the last step's receives are not all done (its dispatch was
            abandoned midway), or the thread failed.
        """
        if not self._specs:
            return
        with self._cond:
            self._check()
            if self._served != self._started and self._taken < len(self._specs):
                raise RuntimeError("jaxpp_mpi: a step started while the last one's staged "
                                   "receives are unfinished (its dispatch was abandoned)")
            while self._served != self._started:  # the thread's last bookkeeping
                self._check()
                self._cond.wait(_WAKE_S)
            self._taken, self._wanted, self._record = 0, -1, record
            self._ready.clear()
            self._started += 1
            self._cond.notify_all()
        self._ensure_started()

    def take(self, k: int) -> jax.Array:
        """Receive `k` of this step (taken in order), once the receiver has it."""
        with self._cond:
            if k not in self._ready:
                self._wanted = k
                self._cond.notify_all()
                while k not in self._ready:
                    self._check()
                    self._cond.wait(_WAKE_S)
            x = self._ready.pop(k)
            self._taken, self._wanted = k + 1, -1
            self._cond.notify_all()
        return x

    def stop(self) -> None:
        """Ends the thread (returns at once); an unfinished step's receives are
        cancelled."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stops the thread and waits for it (at exit: `close_all`)."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._started == self._served and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                record = self._record
            self._serve(record)
            with self._cond:
                self._served += 1
                self._cond.notify_all()

    def _serve(self, record: Record | None) -> None:
        """Delivers this step's receives in order, within the window."""
        n, inflight = len(self._specs), collections.deque()
        posted_upto, poll = 0, _POLL_MIN_S
        while inflight or posted_upto < n:
            with self._cond:
                taken, wanted, stop = self._taken, self._wanted, self._stop
            if stop:
                for _, requests, _, _ in inflight:
                    for r in requests:
                        r.Cancel()
                MPI.Request.Waitall([r for _, rs, _, _ in inflight for r in rs])
                return
            while posted_upto < n and (posted_upto == taken or (
                    posted_upto - taken < self.window and
                    self._bytes[posted_upto + 1] - self._bytes[taken] <= self.window_bytes)):
                inflight.append(self._post(posted_upto))
                posted_upto += 1
            if inflight:
                k, requests, buffers, start = inflight[0]
                if k == wanted:  # the dispatching thread waits: wait in MPI
                    MPI.Request.Waitall(requests)
                elif not MPI.Request.Testall(requests):
                    with self._cond:
                        if self._wanted != k and self._taken == taken and not self._stop:
                            self._cond.wait(poll)
                    poll = min(2 * poll, _POLL_MAX_S)
                    continue
                inflight.popleft()
                poll = _POLL_MIN_S
                self._deliver(k, buffers, start, record)
            else:  # the window is full of received values: wait until one is taken
                with self._cond:
                    while self._taken == taken and not self._stop:
                        self._cond.wait(_WAKE_S)

    def _post(self, k: int) -> tuple[int, list, list, int]:
        plan, src, _ = self._specs[k]
        wire = wire_dtype(plan.dtype)
        buffers = [np.empty(shape, wire) for _, shape, _ in plan.pieces]
        requests = [self.comm.Irecv([b, _datatype(wire)], src, j) for j, b in enumerate(buffers)]
        return k, requests, buffers, time.perf_counter_ns()

    def _deliver(self, k: int, buffers: list, start: int, record: Record | None) -> None:
        plan, _, args = self._specs[k]
        received = time.perf_counter_ns()
        pieces = []
        for (device, _, _), buffer in zip(plan.pieces, buffers):
            host = buffer if buffer.dtype == plan.dtype else buffer.view(plan.dtype)
            target = plan.sharding if plan.single else SingleDeviceSharding(device)
            pieces.append(jax.device_put(host, target))
        x = plan.assemble(pieces)
        if record is not None:
            record("MPI recv", start, received, args)
            jax.block_until_ready(x)
            record("copy to device", received, time.perf_counter_ns(), args)
        with self._cond:
            self._ready[k] = x
            self._cond.notify_all()


@atexit.register
def close_all() -> None:
    """Completes every live staged send and stops every staged thread (at exit, before
    mpi4py finalizes MPI: registered after mpi4py's own hook, so it runs first)."""
    for staged in list(_live):
        try:
            staged.close()
        except Exception:  # noqa: BLE001 - a failed thread already reported its error
            pass
