"""The plays of a built program, as the tests' reference for the lowering's scores.

The lowering scores its candidates from their walks' events (`task_models.play_walk`,
`Note: walk events` in compiler/walks.py); these play the program itself, through
`rendezvous.play` (blocking sends) or `simulate.posted_order` (posted sends), so a
test can check the two agree and score any program the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jaxpp_mpi._src.compiler import task_models
from jaxpp_mpi._src.ir import rendezvous, simulate
from jaxpp_mpi._src.ir.program import Program, Run


def play(program: Program, times: Callable[[str], tuple[float, ...]], k: int,
         sends: str = "blocking") -> list[tuple[float, float]]:
    """Per set of task times, (makespan, busiest group's work) of `program`: a Run ends
    its task's time after it starts; a blocking message when both sides have reached
    it, a posted one when its receiver has reached it and its sender had (messages
    free). `times(label)` gives a task's time in each of the `k` sets."""
    instrs = [g.instrs for g in program.groups]
    now = [[0.0] * len(instrs) for _ in range(k)]
    busy = [[0.0] * len(instrs) for _ in range(k)]

    def run_task(g: int, run: Run) -> None:
        for clock, work, t in zip(now, busy, times(run.task)):
            clock[g] += t
            work[g] += t

    if sends == "posted":
        posted: dict[tuple[int, int], list[float]] = {}
        for is_post, g, i, sender in simulate.posted_order(program):
            if is_post:
                posted[(g, i)] = [clock[g] for clock in now]
            elif sender is not None:
                for clock, t in zip(now, posted[sender]):
                    clock[g] = max(clock[g], t)
            elif isinstance(run := instrs[g][i], Run):
                run_task(g, run)
    else:
        for e in rendezvous.play(program):
            if isinstance(e, rendezvous.Matched):
                (s, _), (d, _) = e.send, e.recv
                for clock in now:
                    clock[s] = clock[d] = max(clock[s], clock[d])
            elif isinstance(run := instrs[e.group][e.index], Run):
                run_task(e.group, run)
    return [(max(clock, default=0.0), max(work, default=0.0)) for clock, work in zip(now, busy)]


def scores(program: Program, sends: str = "blocking") -> tuple[float, ...]:
    """Per model of `task_models.MODELS`: `program`'s makespan over its busiest group's
    work, each task at its time under the model (`label_times_models`)."""
    labels = {r.task for g in program.groups for r in g.instrs if type(r) is Run}
    per_model = task_models.label_times_models(labels, task_models.MODELS)
    times = {label: tuple(t.get(label, 0.0) for t in per_model) for label in labels}
    played = play(program, times.__getitem__, len(task_models.MODELS), sends)
    return tuple(m / b if b > 0 else m for m, b in played)


def makespan(program: Program, latency: Mapping[str, float], sends: str = "blocking") -> float:
    """The makespan of `program`, each Run taking its task's time in `latency`."""
    return play(program, lambda label: (latency.get(label, 0.0),), 1, sends)[0][0]
