"""What the runtime adds per instruction (`Note: runtime costs`): its charge on a program's
Runs, its effect on simulated times, and its fit to measured steps (no JAX)."""

import random

import pytest

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
from jaxpp_mpi._src.ir.simulate import MessageCost, simulate
from jaxpp_mpi._src.planner.runtime_cost import (
    RuntimeCost,
    RuntimeSample,
    fit_runtime_cost,
    run_charges,
    runtime_counts,
)

F32 = Aval((8,), "float32")
NONE = RuntimeCost(run_ms=0.0, message_ms=0.0, free_ms=0.0)


def _pipeline(runs_per_group: int, n: int, work: float = 6.0) -> tuple[Program, dict]:
    """n microbatches through 2 groups, forward only: on each group a microbatch's work
    `work` is split over `runs_per_group` chained Runs (as a group holding that many
    stages splits it); group 0 sends the result to group 1, which frees it at the end.
    Returns the program and each Run's work by its exe name."""
    g0, g1, work_of = [], [], {}
    buf = {0: 0, 1: 0}

    def fresh(g: int) -> int:
        buf[g] += 1
        return buf[g]

    for m in range(n):
        prev = None
        for k in range(runs_per_group):
            out, exe = fresh(0), f"f{m}s{k}g0"
            g0.append(Run(exe, (prev,) if prev else (), (out,), task=f"F{m}s{k}",
                          donate=(prev,) if prev else ()))
            work_of[exe], prev = work / runs_per_group, out
        g0.append(Send(prev, 1, m))
        g0.append(Free((prev,)))
        got = fresh(1)
        g1.append(Recv(got, 0, m, F32))
        prev = got
        for k in range(runs_per_group):
            out, exe = fresh(1), f"f{m}s{runs_per_group + k}g1"
            g1.append(Run(exe, (prev,), (out,), task=f"F{m}s{runs_per_group + k}",
                          donate=(prev,)))
            work_of[exe], prev = work / runs_per_group, out
        g1.append(Free((prev,)))
    avals = {b: F32 for b in range(max(buf.values()) + 1)}
    return Program((GroupProgram(0, (), g0, (), avals),
                    GroupProgram(1, (), g1, (), avals))), work_of


def _play(program: Program, work_of: dict, cost: RuntimeCost):
    charges = run_charges(program, cost)
    return simulate(program, lambda r: work_of[r.exe] + charges[id(r)],
                    MessageCost(0.5, float("inf")), sends="posted")


def test_charges_put_each_instruction_on_its_groups_run_before():
    x = Aval((8,), "float32")
    program = Program((
        GroupProgram(0, ((0, 0),), [Free((0,)), Run("a", (), (1,), task="F0s0"), Send(1, 1, 0),
                             SendRecv(1, 1, 1, 2, 1, 1, x), Free((2,)),
                             Run("b", (1,), (3,), task="B0s0"), AllReduce((3,), "sum")],
                     (), {b: x for b in range(4)}),
        GroupProgram(1, (), [Recv(1, 0, 0, x)], (), {1: x}),
    ))
    cost = RuntimeCost(run_ms=1.0, message_ms=0.1, free_ms=0.01)
    a, b = program.groups[0].instrs[1], program.groups[0].instrs[5]
    charges = run_charges(program, cost)
    assert charges == pytest.approx({id(a): 0.01 + 1.0 + 0.1 + 2 * 0.1 + 0.01,
                                     id(b): 1.0 + 0.1})
    assert runtime_counts(program) == [{"run": 2, "message": 4, "free": 2},
                                       {"run": 0, "message": 1, "free": 0}]
    # every instruction of a group with Runs is charged once
    assert sum(charges.values()) == pytest.approx(cost.of(runtime_counts(program)[0]))


@pytest.mark.parametrize("run_ms", [0.25, 2.0])
def test_a_run_cost_prices_more_runs_higher_by_exactly_their_number(run_ms):
    n = 4
    one, one_work = _pipeline(1, n)
    two, two_work = _pipeline(2, n)  # the same work in twice the Runs
    cost = RuntimeCost(run_ms=run_ms, message_ms=0.0, free_ms=0.0)
    base_one, base_two = _play(one, one_work, NONE), _play(two, two_work, NONE)
    assert base_one.busy == pytest.approx(base_two.busy)  # FLOPs alone: even
    priced_one, priced_two = _play(one, one_work, cost), _play(two, two_work, cost)
    for g in range(2):
        assert priced_one.busy[g] - base_one.busy[g] == pytest.approx(run_ms * n)
        assert priced_two.busy[g] - base_two.busy[g] == pytest.approx(run_ms * 2 * n)
    assert priced_two.makespan > priced_one.makespan


def test_one_group_step_grows_by_the_cost_of_its_instructions():
    program, work_of = _pipeline(3, 5)
    g0 = program.groups[0]
    alone = Program((GroupProgram(0, (), [i for i in g0.instrs if not isinstance(i, Send)],
                                  (), g0.avals),))
    cost = RuntimeCost(run_ms=0.3, message_ms=0.05, free_ms=0.02)
    base, priced = _play(alone, work_of, NONE), _play(alone, work_of, cost)
    assert priced.makespan - base.makespan == pytest.approx(
        cost.of(runtime_counts(alone)[0]))


def _samples(truth: RuntimeCost, work: float, noise: float, seed: int):
    rng = random.Random(seed)
    out = []
    for runs, messages, frees in [(32, 32, 48), (32, 18, 48), (64, 64, 112), (64, 38, 96),
                                  (40, 18, 56), (88, 40, 113), (48, 24, 60)]:
        counts = {"run": runs, "message": messages, "free": frees}
        out.append(RuntimeSample(counts, work + truth.of(counts) + rng.gauss(0, noise)))
    return out


def test_fit_recovers_the_costs_of_synthetic_steps():
    truth = RuntimeCost(run_ms=0.8, message_ms=0.05, free_ms=0.01)
    fitted, work = fit_runtime_cost(_samples(truth, 1200.0, 0.0, 0))
    assert fitted.run_ms == pytest.approx(0.8) and work == pytest.approx(1200.0)
    assert fitted.message_ms == pytest.approx(0.05, abs=1e-9)
    assert fitted.free_ms == pytest.approx(0.01, abs=1e-9)
    noisy, _ = fit_runtime_cost(_samples(truth, 1200.0, 0.2, 1), fit=("run",),
                                fixed=truth)
    assert noisy.run_ms == pytest.approx(0.8, abs=0.05)
    assert (noisy.message_ms, noisy.free_ms) == (truth.message_ms, truth.free_ms)


def test_fit_keeps_costs_non_negative():
    # steps that get faster with more messages: the message cost stays 0, the rest refit
    samples = [RuntimeSample({"run": r, "message": m}, 100 + 0.5 * r - 0.2 * m)
               for r, m in [(10, 10), (20, 5), (30, 30), (40, 12), (50, 40)]]
    fitted, _ = fit_runtime_cost(samples, fit=("run", "message"), fixed=NONE)
    assert fitted.message_ms == 0.0 and fitted.run_ms > 0


def test_fit_from_traced_steps_of_two_stage_counts():
    # one stage per group against two: the same work, twice the Runs per microbatch
    rng, run_ms = random.Random(2), 0.6
    work = {f"F{m}s{s}": rng.uniform(1, 3) for m in range(8) for s in range(2)}
    one = {label: w + run_ms for label, w in work.items()}
    two = {}
    for label, w in work.items():
        m, s = label[1:].split("s")
        for half in range(2):
            two[f"F{m}s{2 * int(s) + half}"] = w / 2 + run_ms
    samples = [RuntimeSample.from_task_times(t) for t in (one, two)]
    assert [s.counts["run"] for s in samples] == [16, 32]
    fitted, shared = fit_runtime_cost(samples, fit=("run",))
    assert fitted.run_ms == pytest.approx(run_ms) and shared == pytest.approx(
        sum(work.values()))
    fixed = RuntimeCost(message_ms=0.5, free_ms=0.25)
    got = RuntimeCost.fit_to_traced_steps([one, two], fixed=fixed)
    assert got.run_ms == pytest.approx(run_ms) and (got.message_ms, got.free_ms) == (0.5, 0.25)
    with pytest.raises(ValueError, match="different counts"):
        RuntimeCost.fit_to_traced_steps([one, dict(one)])


def test_from_dispatch_reads_the_runs_and_the_chosen_message_paths():
    result = {"mpi": {"rows": [
        {"instr": "Run", "runtime_us": 6.0}, {"instr": "Run", "runtime_us": 8.0},
        {"instr": "Send (posted)", "runtime_us": 9.0},
        {"instr": "Recv (chained)", "runtime_us": 13.0},
        {"instr": "Recv (staged)", "runtime_us": 70.0}]}}
    cost = RuntimeCost.from_dispatch(result)
    assert cost.run_ms == pytest.approx(0.007) and cost.message_ms == pytest.approx(0.011)
    assert RuntimeCost.from_dispatch(result, paths=("staged",)).message_ms == 0.07
    with pytest.raises(ValueError, match="no Run rows"):
        RuntimeCost.from_dispatch({"local": {"rows": []}})


def test_bad_input_says_what_to_do():
    with pytest.raises(ValueError, match="run_ms must be a finite number"):
        RuntimeCost(run_ms=-1.0)
    with pytest.raises(ValueError, match="message_ms"):
        RuntimeCost(message_ms=float("nan"))
    same = [RuntimeSample({"run": 4}, 10.0)] * 3
    with pytest.raises(ValueError, match="different counts"):
        fit_runtime_cost(same, fit=("run",))
    with pytest.raises(ValueError, match="at least 2 samples"):
        fit_runtime_cost(same[:1], fit=("run",))
    with pytest.raises(ValueError, match="choose among"):
        fit_runtime_cost(same, fit=("runs",))
    with pytest.raises(ValueError, match="collect_task_times_ms"):
        RuntimeSample.from_task_times({})
