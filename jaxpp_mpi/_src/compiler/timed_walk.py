"""The timed walk: a task graph's instructions in estimated time (`Note: timed order`),
one of the candidate orders lower.py chooses among (the round walk, `RoundWalk` in
walks.py, is the other).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value
from jaxpp_mpi._src.compiler.walks import Walk, WalkIndex

__all__ = ["TimedWalk"]

# A message still owed: (value, sender, receiver).
_Owed = tuple[Value, int, int]
_ASK_EVERY = 256  # steps of a walk between two questions to `hopeless`


class TimedWalk(Walk):
    """Walks the graph in estimated time and appends each group's instructions.

    Note: timed order
      The round walk (`RoundWalk.run`) gives every task one round, so with tasks of
      different lengths a message lands on its sender after tasks that, in time, come
      after the receiver needs it (a backward twice a forward, a long weight-gradient
      task before a send). This walk plays the groups in estimated time instead
      (`latency` per task; messages take no time): each group is busy until `time[g]`;
      the earliest group acts next (ties by index): it first delivers its pending
      messages with each peer that is there at the same time (both idle: they cost
      neither), then runs its next task if its inputs are present, else waits for the
      next event. Before running a task while a value it made is still owed to a busy
      peer, it compares the estimated end of the step both ways (`tail`: the longest
      path from a task's start to the end of the step, along group order and data) and
      waits for the peer when that ends earlier. Donated values are delivered before
      their task runs (`Note: donation`), waiting for the peer if needed.

      The best order depends on task times the compiler does not know, and a walk on
      a wrong estimate can wait where the round walk does not. So the lowering
      (`_lower_best` in lower.py) builds the round order and the eager and lazy timed
      orders under each of four estimates (`ESTIMATES` in task_models.py, the
      task-time models of `MODELS`: no single estimate wins everywhere: on 4 groups
      Interleaved and KimiK2 reach their own timeline under every model when walked
      with B four times F, ZeroBubble and DualPipeV gain only from the lazy walk on the
      defaults) and simulates each under every model, each task at its time under the
      model as the walks estimated it (`label_times`: the first stage's W, which has no
      I task, does both), and with the runtime's sends (`sends`: blocking, or posted
      where the MPI executor posts them, `Note: posted sends` in mpi/posted.py; every
      candidate is deadlock-free with blocking sends either way); a timed order
      replaces the round order only if it is no slower under any model, and the one
      with the best mean wins. bench/lowering.py measures the result against each
      schedule's own dataflow timeline. When the user gives measured task times
      (`task_times_ms`), there is nothing to hedge: the walks also run on those times
      and the program fastest under them wins (`_lower_measured` in lower.py).

      With `eager`, two idle groups exchange every value one owes the other; without,
      only what the receiver's next task needs or what a receiver with nothing ready
      takes (a receive before an independent Run could make that Run wait on the
      sender, if the estimate is wrong). Each event is still appended at one point of a
      single global order, both sides of a message at once, so `Note: global order`'s
      argument (rendezvous play, no deadlock) holds unchanged.
    """

    def __init__(self, graph: TaskGraph, latency: Mapping[str, float], eager: bool,
                 index: WalkIndex | None = None):
        super().__init__(graph, index)
        self.latency = latency
        self.eager = eager
        n = len(self.groups)
        self.time = [0.0] * n
        # per group, the messages it owes or is owed, keyed by (value, receiver)
        self.pending: list[dict[tuple[Value, int], _Owed]] = [{} for _ in range(n)]
        readers = self.index.readers
        for v in self.input_bufs:
            src = self.prod[v]
            for dst in readers.get(v, ()):
                self.pending[src][v, dst] = self.pending[dst][v, dst] = (v, src, dst)
        self.tail = self.index.tails(latency)
        self.stopped = False  # whether `run` stopped early (`hopeless`)

    def run(self, hopeless: Callable[[], bool] | None = None) -> None:
        """Plays the groups in estimated time until all tasks ran and all values arrived.

        One loop over plain lists (`Note: the timed walk's loop`).

        Args:
          hopeless: asked every `_ASK_EVERY` steps; once it answers True, the walk stops
            where it is and `stopped` is True (`Note: hopeless walks` in lower.py).

        Raises:
          ValueError: if no group can act (the task order has a cycle across groups).

        Note: the timed walk's loop
          Each step, the earliest group acts (`act`: deliver, wait, run or idle until the
          next event; ties by index), found in a heap of the clocks (`clock`, an entry per
          change, stale ones dropped when met) rather than by a scan of every group, which
          made a step's cost grow with the group count. The state is per group in plain
          lists (its next task, the values it received, its clock) and per group a dict of
          the messages it owes or is owed, each as (value, sender, receiver), read in
          sorted order. A value's messages are owed to all its readers on other groups
          when it is made: nothing is delivered before it is owed, so every reader is
          still waiting then. A donated value is never owed when its task runs: a task
          runs only once no message of its group's donated values is pending (`act` waits
          for a busy peer, or delivers to an idle one first), so unlike the round walk the
          run itself never sends (`Note: donation`). Like every walk, it records events
          and moved values only (`Note: emitted once` in walks.py).
        """
        groups, pending, time = self.groups, self.pending, self.time
        tasks = [gs.tasks for gs in groups]
        ends = [len(ts) for ts in tasks]
        pos = [gs.pos for gs in groups]
        waits = [gs.waits for gs in groups]  # per group and task, what it waits for
        have = [gs.have for gs in groups]  # per group, the values received
        latency, tail, eager = self.latency, self.tail, self.eager
        first_use, sent, readers = self.index.first_use, self.index.sent, self.index.readers
        events, moved = self.events, self.moved
        # The groups' clocks in a heap (`Note: the timed walk's loop`): an entry
        # (time, group) per change of a clock; one is valid while its group is live
        # and its clock still reads that time.
        clock: list[tuple[float, int]] = []
        push, pop = heapq.heappush, heapq.heappop

        def valid(entry: tuple[float, int]) -> bool:
            h = entry[1]
            return time[h] == entry[0] and (pos[h] < ends[h] or bool(pending[h]))

        def meet(a: int, b: int) -> None:
            """Sets both clocks to the later one (a message or an exchange)."""
            ta, tb = time[a], time[b]
            if ta < tb:
                time[a] = tb
                push(clock, (tb, a))
            elif tb < ta:
                time[b] = ta
                push(clock, (ta, b))

        def next_after(t: float) -> float | None:
            """The earliest clock of a live group later than t (None if none)."""
            held = []
            later = None
            while clock:
                entry = clock[0]
                if not valid(entry):
                    pop(clock)
                elif entry[0] > t:
                    later = entry[0]
                    break
                else:
                    held.append(pop(clock))
            for entry in held:
                push(clock, entry)
            return later

        def deliver(messages: list[_Owed]) -> bool:
            """Delivers `messages` pair by pair (sorted), in the order receivers need
            them (`Note: global order`: the k-th message each way between a pair is an
            exchange); returns whether a group may have ended (nothing left owed)."""
            if len(messages) == 1:  # most often: the loop below, for one message
                v, s, d = messages[0]
                have[d].add(v)
                events.append((s, d, False))
                moved.append(v)
                owed_s, owed_d = pending[s], pending[d]
                del owed_s[v, d], owed_d[v, d]
                meet(s, d)
                return not (owed_s and owed_d)
            by_pair: dict[tuple[int, int], list[_Owed]] = {}
            for m in messages:
                key = (m[1], m[2]) if m[1] < m[2] else (m[2], m[1])
                by_pair.setdefault(key, []).append(m)
            ended = False
            for a, b in sorted(by_pair) if len(by_pair) > 1 else by_pair:
                ms = by_pair[a, b]
                up = [m for m in ms if m[1] == a]
                down = [m for m in ms if m[1] != a] if len(up) < len(ms) else []
                # each way in the order the receiver reads them (stable: the sort of
                # `ms` as a whole, split)
                if len(up) > 1:
                    up.sort(key=lambda m: (first_use[b][m[0]], m[0]))
                if len(down) > 1:
                    down.sort(key=lambda m: (first_use[a][m[0]], m[0]))
                for k in range(max(len(up), len(down))):
                    if k < len(up) and k < len(down):
                        v, w = up[k][0], down[k][0]
                        have[b].add(v)
                        have[a].add(w)
                        events.append((a, b, True))
                        moved.append((v, w))
                    else:
                        v, s, d = up[k] if k < len(up) else down[k]
                        have[d].add(v)
                        events.append((s, d, False))
                        moved.append(v)
                owed_a, owed_b = pending[a], pending[b]
                for v, _, d in ms:
                    del owed_a[v, d], owed_b[v, d]
                if not (owed_a and owed_b):
                    ended = True
                meet(a, b)
            return ended

        def takes_now(m: _Owed) -> bool:
            """Whether m's receiver, idle, should take m now (see `Note: timed order`)."""
            r = m[2]
            p = pos[r]
            if p >= ends[r]:
                return True
            ins = waits[r][p]
            return m[0] in ins or not all(map(have[r].__contains__, ins))  # or r waits

        def worth_waiting(m: _Owed, task: TaskNode, t: float) -> bool:
            """Whether g should wait for busy m's receiver to take m before running
            `task` at t."""
            h = m[2]
            th, hts = time[h], tasks[h]
            use = first_use[h][m[0]]
            before = sum(latency[x.name] for x in hts[pos[h]:use])
            consumer = tail[hts[use].name]
            end_wait = max(th + tail[task.name], th + before + consumer)
            end_run = max(t + tail[task.name],
                          max(th + before, t + latency[task.name]) + consumer)
            return end_wait < end_run

        def act(g: int, live: list[int]) -> int:
            """One step of group g at its time: 0 if nothing changed, 2 if a group may
            have ended, else 1."""
            t = time[g]
            owes = pending[g]
            if owes:
                owed = [owes[k] for k in sorted(owes)]  # by value, then receiver
                if eager:
                    here = [m for m in owed if time[m[1] if m[2] == g else m[2]] <= t]
                else:
                    here = [m for m in owed
                            if time[m[1] if m[2] == g else m[2]] <= t and takes_now(m)]
                if here:
                    return 2 if deliver(here) else 1
            p = pos[g]
            b = have[g]
            if p < ends[g] and all(map(b.__contains__, waits[g][p])):
                task = tasks[g][p]
                donate = task.donate
                if owes:
                    busy = [m for m in owed if m[1] == g and time[m[2]] > t]
                    wait = [time[m[2]] for m in busy if m[0] in donate] or [
                        time[m[2]] for m in busy if worth_waiting(m, task, t)]
                    if wait:
                        time[g] = min(wait)
                        push(clock, (time[g], g))
                        return 1
                    # A donated value owed to an idle peer that did not take it yet
                    # (`takes_now`) goes now, before its task consumes it.
                    donated = [m for m in owed if m[1] == g and m[0] in donate]
                    if donated:
                        return 2 if deliver(donated) else 1
                if donate:
                    b.difference_update(donate)
                events.append((g, task.name))
                pos[g] = p + 1
                for v in sent[task.name]:  # the outputs some other group reads
                    for dst in readers[v]:
                        pending[g][v, dst] = pending[dst][v, dst] = (v, g, dst)
                time[g] = t + latency[task.name]
                push(clock, (time[g], g))
                return 2 if p + 1 == ends[g] else 1
            later = next_after(t)
            if later is not None:
                time[g] = later
                push(clock, (later, g))
                return 1
            return 0

        live = list(range(len(groups)))
        for g in live:
            push(clock, (time[g], g))
        ended = True  # whether a group may have ended since the loop last looked
        ask = _ASK_EVERY if hopeless is not None else -1
        try:
            while True:
                # A group with no task left and nothing owed to or by it never acts
                # again; only a group's last task or a delivery can end one.
                if ended:
                    live = [g for g in live if pos[g] < ends[g] or pending[g]]
                    if not live:
                        return
                # The earliest group almost always acts; `act` changes nothing when
                # it does not, so trying it first and then every group in order is the
                # same walk. The heap's first valid entry is the earliest live group,
                # the lowest index of equals (every live group's clock has a valid
                # entry); `live` ascends and sorted keeps the first of equals: ties by
                # index.
                while not valid(clock[0]):
                    pop(clock)
                done = act(clock[0][1], live)
                if not done:
                    for g in sorted(live, key=time.__getitem__):
                        done = act(g, live)
                        if done:
                            break
                    else:
                        for gs, p in zip(groups, pos):
                            gs.pos = p
                        raise ValueError(self._stuck_message())
                ended = done == 2
                ask -= 1
                if not ask:
                    if hopeless():
                        self.stopped = True
                        return
                    ask = _ASK_EVERY
        finally:
            for gs, p in zip(groups, pos):
                gs.pos = p
