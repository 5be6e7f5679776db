"""The lowering's choice among its candidate orders equals the choice over all of them.

`_lower_best` scores walks from their events, walks an estimate equal to an earlier one
once, stops a walk that can no longer win (`Note: hopeless walks`), and stops walking
once a timed order reaches the graph's dataflow timeline (a lower bound of every
program's scores); `_lower_measured` stops hopeless walks under measured times too. This
checks, schedule by schedule, that the program each keeps is the one scoring every
candidate's program would keep, and that a walk's events play as its program does.
"""

from __future__ import annotations

import random

import program_plays
import pytest
from test_lower import SCHEDULES, schedule_graph

from jaxpp_mpi._src.compiler import lower, task_models, timed_walk, walks
from jaxpp_mpi._src.ir.passes import assign_tags


def exhaustive_best(graph):
    """The round order and every distinct timed order scored, as `_lower_best`'s rule
    reads without any shortcut: eligible if no worse than the round order under every
    model, the best mean wins, the earlier one on ties; its tags assigned."""
    rounds = lower._finish(walks.RoundWalk(graph))
    base = program_plays.scores(rounds[0])
    best, best_mean = rounds, sum(base) / len(base)
    if all(x <= y + 1e-9 for x, y in zip(base, task_models.dataflow_scores(graph))):
        return rounds
    for candidate in every_timed_walk(graph):
        scores = program_plays.scores(candidate[0])
        mean = sum(scores) / len(scores)
        if all(x <= y + 1e-9 for x, y in zip(scores, base)) and mean < best_mean - 1e-9:
            best, best_mean = candidate, mean
    return assign_tags(best[0]), best[1]


def every_timed_walk(graph):
    """The programs of the eager and the lazy timed walk under every estimate, each
    walked on its own (equal estimates too), in the lowering's order, the first of
    equal programs kept."""
    programs = []
    for model in task_models.ESTIMATES:
        for eager in (True, False):
            walk = timed_walk.TimedWalk(graph, task_models.estimate(graph, model), eager)
            walk.run()
            program = lower._paired(walk)
            if program not in programs:
                programs.append(program)
    return programs


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("groups,num_microbatches", [(2, 4), (4, 8), (4, 16)])
def test_choice_equals_the_exhaustive_one(name, groups, num_microbatches):
    graph = schedule_graph(SCHEDULES[name](groups), num_microbatches)
    program, names = lower._lower_best(graph)
    want, want_names = exhaustive_best(graph)
    assert program == want and names == want_names


@pytest.fixture
def stopped(monkeypatch):
    """Walks asked after every step whether they are hopeless; per walk run, whether it
    stopped."""
    monkeypatch.setattr(timed_walk, "_ASK_EVERY", 1)
    out = []
    run = timed_walk.TimedWalk.run

    def spy(self, hopeless=None):
        run(self, hopeless)
        out.append(self.stopped)

    monkeypatch.setattr(timed_walk.TimedWalk, "run", spy)
    return out


def test_stopping_hopeless_walks_keeps_the_choice(stopped):
    """With the walks asked after every step whether they are hopeless (`Note: hopeless
    walks`), the choice is still the exhaustive one, schedule by schedule; some walks
    do stop, and some run to their end."""
    for name in sorted(SCHEDULES):
        for groups, num_microbatches in [(4, 8), (4, 16)]:
            graph = schedule_graph(SCHEDULES[name](groups), num_microbatches)
            program, names = lower._lower_best(graph)
            want, want_names = exhaustive_best(graph)
            assert program == want and names == want_names, (name, groups, num_microbatches)
    assert any(stopped) and not all(stopped)


def measured_times(graph, seed):
    rng = random.Random(seed)
    return {t.name: rng.uniform(0.1, 3.0) for ts in graph.tasks for t in ts}


def exhaustive_measured(graph, task_ms, sends):
    """`_lower_measured`'s rule without any shortcut: the round order and every timed
    order under the measured times and each estimate, each walked to its end; the
    fastest under the measured times wins, the earlier one on ties."""
    measured = task_models.measured_estimate(graph, task_ms)
    rounds = walks.RoundWalk(graph)
    rounds.run()
    best, best_time = rounds, task_models.walk_makespan(rounds.events, graph.num_groups,
                                                        measured, sends)
    for estimate in (measured, *(task_models.estimate(graph, m)
                                 for m in task_models.ESTIMATES)):
        for eager in (True, False):
            walk = timed_walk.TimedWalk(graph, estimate, eager)
            walk.run()
            t = task_models.walk_makespan(walk.events, graph.num_groups, measured, sends)
            if t < best_time - 1e-9:
                best, best_time = walk, t
    program, names = lower._paired(best)
    return assign_tags(program), names


def test_stopping_hopeless_walks_keeps_the_measured_choice(stopped):
    """Under measured task times, with the walks asked after every step whether they
    are hopeless, the choice is the exhaustive one; some walks do stop."""
    for name in sorted(SCHEDULES):
        for groups, num_microbatches in [(4, 8), (4, 16)]:
            graph = schedule_graph(SCHEDULES[name](groups), num_microbatches)
            for sends in ("blocking", "posted"):
                task_ms = measured_times(graph, f"{name}{num_microbatches}{sends}")
                got = lower._lower_measured(graph, task_ms, sends)
                assert got == exhaustive_measured(graph, task_ms, sends), (name, sends)
    assert any(stopped) and not all(stopped)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_score_play_bounds_and_equals_measured_makespans(name):
    graph = schedule_graph(SCHEDULES[name](4), 8)
    measured = measured_times(graph, name)
    work = task_models.group_work(graph, (measured,))
    tails = walks.WalkIndex(graph).tails(measured)
    estimates = [measured, *(task_models.estimate(graph, m) for m in task_models.ESTIMATES)]
    for walk in lower._timed_walks(graph, estimates):
        final = task_models.walk_makespan(walk.events, graph.num_groups, measured)
        for known in ([tails], [None]):
            play = task_models.ScorePlay(graph.tasks, (measured,), work, known.__getitem__)
            for k in range(0, len(walk.events) + 1, 5):
                play.advance(walk.events[:k])
                assert play.ends()[0] <= final + 1e-9
            play.advance(walk.events)
            assert play.makespans() == [final]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("sends", ["blocking", "posted"])
def test_a_score_play_floors_and_equals_walk_scores(name, sends):
    """`ScorePlay` bounds a walk's final scores from below at every prefix of its
    events, and ends at `walk_scores`' scores, bit for bit."""
    graph = schedule_graph(SCHEDULES[name](4), 8)
    labels = frozenset(t.name for ts in graph.tasks for t in ts)
    latencies = task_models.model_latencies(labels)
    work = task_models.group_work(graph, latencies)
    index = walks.WalkIndex(graph)
    known = [index.tails(m) for m in latencies]
    n = graph.num_groups
    estimates = [task_models.estimate(graph, m) for m in task_models.ESTIMATES]
    rounds = walks.RoundWalk(graph)
    rounds.run()
    for walk in [rounds, *lower._timed_walks(graph, estimates)]:
        final = task_models.walk_scores(walk.events, n, sends)
        # every model's tails known, or none (each group's remaining work instead)
        for tails in (known.__getitem__, lambda m: None):
            play = task_models.ScorePlay(graph.tasks, latencies, work, tails, sends)
            for k in range(0, len(walk.events) + 1, 7):
                play.advance(walk.events[:k])
                assert all(f <= s + 1e-12 for f, s in zip(play.floor(), final))
            play.advance(walk.events)
            assert play.scores() == final


def test_dataflow_scores_bound_every_candidate():
    graph = schedule_graph(SCHEDULES["1f1b"](4), 8)
    bound = task_models.dataflow_scores(graph)
    estimates = [task_models.estimate(graph, m) for m in task_models.ESTIMATES]
    candidates = [lower._finish(walks.RoundWalk(graph)),
                  *map(lower._paired, lower._timed_walks(graph, estimates))]
    for program, _ in candidates:
        assert all(x >= y - 1e-9 for x, y in zip(program_plays.scores(program), bound))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("sends", ["blocking", "posted"])
def test_a_walks_events_play_as_its_program(name, sends):
    """Scores and makespans from the events (`Note: walk events`) equal, bit for bit,
    those of the program the walk emits, played by `program_plays.play`."""
    graph = schedule_graph(SCHEDULES[name](4), 8)
    rng = random.Random(name)
    measured = {t.name: rng.uniform(0.1, 3.0) for ts in graph.tasks for t in ts}
    estimates = [measured, *(task_models.estimate(graph, m) for m in task_models.ESTIMATES)]
    rounds = walks.RoundWalk(graph)
    rounds.run()
    played = 0
    for walk in [rounds, *lower._timed_walks(graph, estimates)]:
        program, _ = lower._paired(walk)
        n = graph.num_groups
        assert (task_models.walk_scores(walk.events, n, sends)
                == program_plays.scores(program, sends))
        assert (task_models.walk_makespan(walk.events, n, measured, sends)
                == program_plays.makespan(program, measured, sends))
        played += 1
    assert played >= 2
