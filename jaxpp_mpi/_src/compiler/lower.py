"""Lowering: a TaskGraph becomes a deadlock-free, verified Program.

The walks (walks.py) emit candidate orders; the task-time models (task_models.py)
score them from the walks' events; this module makes the best one's program, adds
Frees and verifies it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from jaxpp_mpi._src.compiler import task_models
from jaxpp_mpi._src.compiler.task_graph import TaskGraph
from jaxpp_mpi._src.compiler.timed_walk import TimedWalk
from jaxpp_mpi._src.compiler.walks import BufferNames, RoundWalk, Walk, WalkIndex
from jaxpp_mpi._src.ir import passes as program_passes
from jaxpp_mpi._src.ir import simulate
from jaxpp_mpi._src.ir.program import Free, GroupProgram, Program, Run

__all__ = ["build_program", "build_program_with_names", "live_buffer_profile"]


def _finish(lowering: Walk) -> tuple[Program, BufferNames]:
    """Runs `lowering`; its program with exchanges paired and tags assigned (no Frees)."""
    lowering.run()
    program, names = _paired(lowering)
    return program_passes.assign_tags(program), names


def _paired(walk: Walk) -> tuple[Program, BufferNames]:
    """The program of the walk `walk` ran, with exchanges paired, tags not yet assigned.

    Note: candidates untagged
      The candidates are scored from their walks' events (`Note: walk events` in
      walks.py), the plays of their programs without tags (all -1): untagged messages
      match in each channel's order (`passes.match_messages`: the k-th send on a
      channel meets its k-th receive), the very pairing `assign_tags` writes down, so
      every play and score is the tagged program's. Only the kept walk becomes a
      program, and only it gets its tags.
    """
    program, names = walk.program()
    return program_passes.pair_exchanges(program), names


def _timed_walks(graph: TaskGraph, estimates: Iterable[Mapping[str, float]],
                 index: WalkIndex | None = None,
                 watch: Callable[[TimedWalk], Callable[[], bool]] | None = None,
                 ) -> Iterator[TimedWalk]:
    """The eager and the lazy timed walk under each estimate (per task name, its time),
    run, each distinct order once (`Note: timed order`).

    A walk is a function of the graph, its estimate's times and `eager` alone, so an
    estimate equal to an earlier one is not walked again (the models differ only in
    the times of kinds of task a graph may lack: without I and W tasks, the second
    and the fourth model give every task the same time). A walk whose events and
    moved values equal an earlier one's makes the same program (`Note: emitted once`
    in walks.py) and is dropped. Two walks could still make the same program in
    different global orders: both are yielded then, and score alike, and the callers
    keep the earlier of equal scores, so the choice is the one by programs.

    `watch(walk)`, if given, is the walk's `hopeless` (`TimedWalk.run`): a walk it
    stops is not yielded (`Note: hopeless walks`).
    """
    index = index if index is not None else WalkIndex(graph)
    kept: list[tuple[list, list]] = []  # each kept walk's events and values moved
    walked: list[Mapping[str, float]] = []
    for estimate in estimates:
        if any(estimate == other for other in walked):
            continue
        walked.append(estimate)
        for eager in (True, False):
            walk = TimedWalk(graph, estimate, eager, index)
            walk.run(watch(walk) if watch is not None else None)
            if walk.stopped:
                continue
            order = (walk.events, walk.moved)
            if order not in kept:  # compared in order: distinct walks differ early
                kept.append(order)
                yield walk


def _lower_measured(graph: TaskGraph, task_ms: Mapping[str, float],
                    sends: str = "blocking") -> tuple[Program, BufferNames]:
    """The fastest of the round order and the timed orders under measured task times.

    The timed walks run eager and lazy on the measured times and on each estimate of
    `task_models.ESTIMATES`; every candidate is played with the measured times
    (`task_models.walk_makespan`), and the fastest wins, the earlier one (the round
    order first) on ties. With the times known, no hedging over task-time models is
    needed (`Note: timed order`). A walk whose makespan is bounded from below by the
    best so far (the longest path from each group's next task to the end at the
    measured times) stops there (`Note: hopeless walks`).
    """
    measured = task_models.measured_estimate(graph, task_ms)
    index = WalkIndex(graph)
    n = graph.num_groups
    best: Walk = RoundWalk(graph, index)
    best.run()
    best_time = task_models.walk_makespan(best.events, n, measured, sends)
    work = task_models.group_work(graph, (measured,))
    plays: dict[TimedWalk, task_models.ScorePlay] = {}

    def watch(walk: TimedWalk) -> Callable[[], bool]:
        tails = index.known_tails(measured)  # made by the first walk, on these times
        play = plays[walk] = task_models.ScorePlay(graph.tasks, (measured,), work,
                                                   lambda m: tails, sends)

        def hopeless() -> bool:
            play.advance(walk.events)
            return play.ends()[0] >= best_time - 1e-9 + _MARGIN * max(1.0, best_time)
        return hopeless

    estimates = (measured, *(task_models.estimate(graph, m) for m in task_models.ESTIMATES))
    for walk in _timed_walks(graph, estimates, index, watch):
        play = plays.pop(walk)
        play.advance(walk.events)
        t = play.makespans()[0]  # `walk_makespan(walk.events, ...)`, bit for bit
        if t < best_time - 1e-9:
            best, best_time = walk, t
    program, names = _paired(best)
    return program_passes.assign_tags(program), names


def _lower_best(graph: TaskGraph, sends: str = "blocking") -> tuple[Program, BufferNames]:
    """The best of the round order and the timed orders (`Note: timed order`).

    The timed walks run eager and lazy under each distinct estimate of
    `task_models.ESTIMATES`; walks that give the same instructions are scored once.
    Candidates are scored by `task_models.walk_scores` (their programs' scores, `Note:
    walk events`). A timed order is eligible only if it is no worse than the round order
    under every model; the eligible one with the best mean wins, the earlier one (the
    round order first) on ties. So no graph gets a program slower under any of
    `task_models.MODELS` than the round order. A round order already at the graph's own
    timeline under every model (`task_models.dataflow_scores`: GPipe) is kept without
    walking; once a timed order wins at that timeline (1F1B with its fused last stage,
    after the first walk), the walks stop: that timeline bounds every program's scores
    from below, so no later candidate could win (they would only tie, and ties keep the
    earlier one). The result is the one all the walks would give. Only the winner
    becomes a program (`Note: candidates untagged`).

    Note: hopeless walks
      A timed walk's events are played under every model as it goes
      (`task_models.ScorePlay`), and every few hundred steps its scores are bounded
      from below: each group's clock so far plus the longest path from its next task
      to the end (`WalkIndex.tails` under the model, where a walk made it already;
      else the rest of the group's own tasks). A walk whose
      bound is already worse than the round order's score under some model (it cannot
      be eligible) or whose bound's mean is no better than the best mean so far (it
      cannot win) stops there, unscored: it could not have changed the choice, so the
      result is the one every walk run to its end gives. The bound is compared with a
      margin (`_MARGIN`) well above its rounding, so a walk stops only when the
      arithmetic proves it could not win. On 16 groups x 128 microbatches
      Interleaved, the walks under the second estimate stop at about 70% of their
      steps, those under the third at about 40%. Under measured task times
      (`_lower_measured`) there is one set of times and no eligibility: the bound is
      the makespan's, against the best makespan so far, with the margin relative to
      it; there the walks take half the time (1.16 -> 0.55 s on the same workload).
    """
    index = WalkIndex(graph)
    n = graph.num_groups
    best: Walk = RoundWalk(graph, index)
    best.run()
    labels = frozenset(t.name for ts in graph.tasks for t in ts)  # every walk runs them all
    base = task_models.walk_scores(best.events, n, sends, labels)
    bound = task_models.dataflow_scores(graph, index)
    if not _at_bound(base, bound):  # else: already the graph's own timeline
        best_mean = sum(base) / len(base)
        latencies = task_models.model_latencies(labels)
        work = task_models.group_work(graph, latencies)
        plays: dict[TimedWalk, task_models.ScorePlay] = {}

        def watch(walk: TimedWalk) -> Callable[[], bool]:
            # the tails the walks made so far (this one's included): none made for this
            tails = [index.known_tails(m) for m in latencies]
            play = plays[walk] = task_models.ScorePlay(graph.tasks, latencies, work,
                                                       tails.__getitem__, sends)

            def hopeless() -> bool:
                play.advance(walk.events)
                floor = play.floor()
                return (any(x > y + 1e-9 + _MARGIN for x, y in zip(floor, base))
                        or sum(floor) / len(floor) >= best_mean - 1e-9 + _MARGIN)
            return hopeless

        estimates = (task_models.estimate(graph, m) for m in task_models.ESTIMATES)
        for walk in _timed_walks(graph, estimates, index, watch):
            play = plays.pop(walk)
            play.advance(walk.events)
            scores = play.scores()  # `walk_scores(walk.events, ...)`, bit for bit
            mean = sum(scores) / len(scores)
            if all(x <= y + 1e-9 for x, y in zip(scores, base)) and mean < best_mean - 1e-9:
                best, best_mean = walk, mean
                if _at_bound(scores, bound):
                    break  # no later candidate's mean can be lower by more than the tolerance
    program, names = _paired(best)
    return program_passes.assign_tags(program), names


# How far past the tolerance a walk's bound must be for the walk to stop (`Note: hopeless
# walks`): scores are ratios near 1, and the bound's rounding is far below this; measured
# makespans take it relative to their size.
_MARGIN = 1e-7


def _at_bound(scores: tuple[float, ...], bound: tuple[float, ...]) -> bool:
    """Whether `scores` reach the graph's dataflow timeline (`dataflow_scores`, a lower
    bound of every program's scores) under every model, within the tolerance."""
    return all(x <= y + 1e-9 for x, y in zip(scores, bound))


def build_program_with_names(
    graph: TaskGraph, task_ms: Mapping[str, float] | None = None, sends: str = "blocking"
) -> tuple[Program, BufferNames]:
    """Lowers `graph` to a verified Program, and names every buffer.

    The lowering pass: validates the graph, walks it in rounds (see `Note: global
    order`) and in estimated time (`Note: timed order`), keeps the best walk by its
    events' scores (`_lower_best`, `Note: walk events`), makes its program with its
    exchanges fused into SendRecv (`program_passes.pair_exchanges`), assigns its tags
    (`program_passes.assign_tags`; `Note: candidates untagged`), adds Frees
    (`program_passes.add_frees`) and verifies the result (`simulate.verify`). This is
    the one verification of a compiled program: the executors take it as verified.

    In the round walk, each round first runs, on every group in turn, its next task if
    all the task's inputs are present on the group (a Run; a donated value is first sent
    to its other consumers, see `Note: donation`), then delivers every message that some
    group's next task waits for and whose value exists. In every walk, a value produced
    on group a (by a task or as a step input) is sent to each other group b that
    consumes it once (the round walk when b first needs it, the timed walks possibly
    earlier) and stays live on b until its last use there. Step outputs stay where they
    were produced. Buffer ids count up per group in order of definition, step inputs
    first (by input index).

    Args:
      graph: the task graph.
      task_ms: measured task times (ms) by task label, or None. Given, the walks also
        run on these times and the fastest program under them is kept
        (`_lower_measured`) instead of the one best across task-time models.
      sends: how the runtime sends ("blocking", or "posted": `Note: posted sends` in
        mpi/posted.py): candidates are timed that way. Every program is verified with
        blocking sends either way.

    Returns:
      The program, and per group a mapping from buffer id to the name of the value it
      holds (`TaskGraph.value_name`).

    Raises:
      ValueError: if the graph is invalid (`TaskGraph.validate`), or if a round makes no
        progress (the task order has a cycle across groups), naming each group's stuck
        task and the values it waits for.
      ProgramError: if the result does not verify (a bug in this pass).
    """
    graph.validate()
    program, names = (_lower_best(graph, sends) if not task_ms
                      else _lower_measured(graph, task_ms, sends))
    program = program_passes.add_frees(program)
    simulate.verify(program)
    return program, names


def build_program(graph: TaskGraph) -> Program:
    """Lowers `graph` to a verified Program; see `build_program_with_names`."""
    return build_program_with_names(graph)[0]


def live_buffer_profile(
    group: GroupProgram, names: Mapping[int, str], predicate: Callable[[str], bool]
) -> int:
    """The largest number of buffers live at once whose value satisfies `predicate`.

    Args:
      group: one group's program.
      names: buffer id -> value name, as returned by `build_program_with_names`.
      predicate: selects the values counted (e.g. activations).

    Returns:
      The maximum, over the start and after every instruction, of the number of live
      matching buffers. A Run's donated inputs die before its outputs are counted
      (their memory is reused).
    """
    count = peak = sum(predicate(names[b]) for b, _ in group.inputs)
    for instr in group.instrs:
        dead: tuple[int, ...] = ()
        born: tuple[int, ...] = ()
        if isinstance(instr, Run):
            dead, born = instr.donate, instr.outs
        elif isinstance(instr, Free):
            dead = instr.bufs
        elif (r := program_passes.recv_half(instr)) is not None:
            born = (r[0],)
        count += sum(predicate(names[b]) for b in born) - sum(predicate(names[b]) for b in dead)
        peak = max(peak, count)
    return peak
