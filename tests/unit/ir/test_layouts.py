"""The layout pass (`ir/layouts.py`) over hand-written and golden programs, with a stand-in
for XLA: a free result takes the layout of the first argument of its shape, else none.

The stand-in makes each expectation computable by hand; the real compiler is exercised in
tests/local/test_group_sharding.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from jaxpp_mpi._src.ir.instructions import Recv, Run, SendRecv
from jaxpp_mpi._src.ir.layouts import ExeLayout, LayoutError, infer_layouts
from jaxpp_mpi._src.ir.program import Program
from jaxpp_mpi._src.ir.simulate import verify

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

# Group 0: stage 0 of a two-stage pipeline over two microbatches (B0_first starts the
# weight-gradient accumulator, B0 adds to it and donates it); group 1: stage 1.
PIPELINE = """\
group 0
  inputs %0=0 %1=1 %2=2
  run F0 (%0, %1) -> (%3, %4)  task=F0s0
  send %4 -> 1 tag=0
  run F0 (%0, %2) -> (%5, %6)  task=F1s0
  free %1 %2
  send %6 -> 1 tag=1
  recv %7 <- 1 tag=0 float32[8,4]
  run B0_first (%3, %7) -> (%8)  task=B0s0
  free %3 %4 %7
  recv %9 <- 1 tag=1 float32[8,4]
  run B0 (%5, %9, %8) -> (%10)  task=B1s0  donate=(%8)
  free %0 %5 %6 %9
  outputs %10=0
  aval %0 float32[4,4]{_,model}
  aval %1 float32[8,4]{data}
  aval %2 float32[8,4]{data}
  aval %3 float32[8,4]
  aval %4 float32[8,4]
  aval %5 float32[8,4]
  aval %6 float32[8,4]
  aval %7 float32[8,4]
  aval %8 float32[4,4]
  aval %9 float32[8,4]
  aval %10 float32[4,4]
group 1
  inputs %0=3
  recv %1 <- 0 tag=0 float32[8,4]
  run F1 (%1, %0) -> (%2)  task=F0s1
  recv %4 <- 0 tag=1 float32[8,4]
  run F1 (%4, %0) -> (%5)  task=F1s1
  run B1 (%2, %0) -> (%3)  task=B0s1
  send %3 -> 0 tag=0
  free %1 %2 %3
  run B1 (%5, %0) -> (%6)  task=B1s1
  send %6 -> 0 tag=1
  free %4 %5 %6
  outputs %0=1
  aval %0 float32[4,4]
  aval %1 float32[8,4]
  aval %2 float32[8,4]
  aval %3 float32[8,4]
  aval %4 float32[8,4]
  aval %5 float32[8,4]
  aval %6 float32[8,4]
"""


def stand_in(calls: list | None = None):
    """A `resolve` that gives a free result the spec of the first argument of its shape."""

    def resolve(g, exe, ins, outs, fixed):
        if calls is not None:
            calls.append((g, exe, tuple(a.spec for a in ins), fixed))
        specs = []
        for a, f in zip(outs, fixed):
            like = [i.spec for i in ins if i.shape == a.shape]
            specs.append(a.spec if f else (like[0] if like else ()))
        return tuple(specs)

    return resolve


def avals(program: Program, g: int) -> dict[int, tuple]:
    return {b: a.spec for b, a in program.group(g).avals}


def test_step_input_layouts_reach_every_consumer_and_message():
    program = Program.parse(PIPELINE)
    verify(program)
    out, layouts = infer_layouts(program, stand_in(), local_groups={0, 1})
    g0, g1 = avals(out, 0), avals(out, 1)
    # F0 is compiled with the data-split batch and gives its activation that layout...
    assert layouts[(0, "F0")] == ExeLayout(((None, "model"), ("data",)),
                                           (("data",), ("data",)))
    assert g0[4] == g0[6] == ("data",)
    # ...the message keeps it (shard j to device j), so stage 1 computes on split rows,
    assert g1[1] == g1[4] == ("data",) and g1[2] == ("data",)
    # and the gradient comes back the same way.
    assert g1[3] == g0[7] == g0[9] == ("data",)
    for g in out.groups:
        for instr in g.instrs:
            if isinstance(instr, (Recv, SendRecv)):
                assert instr.aval == g.aval(instr.buf if isinstance(instr, Recv)
                                            else instr.recv_buf)
    verify(out)  # still matched: both ends of every message carry the same spec


def test_accumulator_keeps_one_layout_across_microbatches():
    out, layouts = infer_layouts(Program.parse(PIPELINE), stand_in(), local_groups={0, 1},
                                 donated={(0, "B0"): (2,)})
    g0 = avals(out, 0)
    # B0_first decides the accumulator's layout (no argument of its shape: none); B0 is
    # compiled with that layout for its state in and gives its state out the same.
    assert layouts[(0, "B0_first")].outs == ((),)
    assert layouts[(0, "B0")].ins[2] == layouts[(0, "B0")].outs[0] == g0[8] == g0[10]


@pytest.mark.parametrize("donate", [True, False])
def test_donated_arguments_keep_their_layout(donate):
    calls = []
    plain = stand_in(calls)

    def model_split_b0(g, exe, ins, outs, fixed):  # XLA would split B0's result
        specs = plain(g, exe, ins, outs, fixed)
        if exe != "B0":
            return specs
        return tuple(s if f else ("model",) for s, f in zip(specs, fixed))

    out, layouts = infer_layouts(Program.parse(PIPELINE), model_split_b0,
                                 local_groups={0, 1},
                                 donated={(0, "B0"): (2,)} if donate else {})
    fixed_b0 = [f for _, exe, _, f in calls if exe == "B0"]
    if donate:  # compiled with the donated state's layout for the result JAX pairs it with
        assert fixed_b0 == [(True,)] and layouts[(0, "B0")].outs == ((),)
    else:
        assert fixed_b0 == [(False,)] and layouts[(0, "B0")].outs == (("model",),)
    assert avals(out, 0)[10] == layouts[(0, "B0")].outs[0]


def test_user_output_layout_is_a_fixed_point():
    program = Program.parse(PIPELINE)
    calls = []
    out, layouts = infer_layouts(program, stand_in(calls), local_groups={0, 1},
                                 fixed_outputs={0: ("model",)}, donated={(0, "B0"): (2,)})
    # The step result keeps the user's layout: B0 is compiled with it fixed (it reshards
    # the accumulator it reads inside its own executable).
    assert layouts[(0, "B0")].outs == (("model",),) and avals(out, 0)[10] == ("model",)
    assert [f for _, exe, _, f in calls if exe == "B0"] == [(True,)]


def test_each_executable_is_resolved_once_in_dependency_order():
    calls = []
    infer_layouts(Program.parse(PIPELINE), stand_in(calls), local_groups={0, 1})
    order = [(g, exe) for g, exe, _, _ in calls]
    assert sorted(order) == sorted(set(order)) and len(order) == 5
    assert order.index((0, "F0")) < order.index((1, "F1")) < order.index((1, "B1"))
    assert order.index((1, "B1")) < order.index((0, "B0_first")) < order.index((0, "B0"))


def test_conflicting_fixed_layouts_are_named():
    # Group 1 returns its input weight (step input 3, replicated) as step result 1.
    with pytest.raises(LayoutError, match=r"step result 1 must have layout "
                                          r"P\('model'\), but it is also step input 3"):
        infer_layouts(Program.parse(PIPELINE), stand_in(), local_groups={0, 1},
                      fixed_outputs={1: ("model",)})


def by_rank():
    """A `resolve` that gives a free result the spec of the first argument of its rank."""

    def resolve(g, exe, ins, outs, fixed):
        specs = []
        for a, f in zip(outs, fixed):
            like = [i.spec for i in ins if len(i.shape) == len(a.shape)]
            specs.append(a.spec if f else (like[0] if like else ()))
        return tuple(specs)

    return resolve


def _ranks(program: Program, num_groups: int, resolve=None, **kwargs) -> list:
    """Runs the pass as `num_groups` MPI ranks would (each resolves its own group's
    executables; an allgather after every sweep), in threads."""
    barrier = threading.Barrier(num_groups)
    slots: list = [None] * num_groups
    results: list = [None] * num_groups

    def rank(r: int) -> None:
        def exchange(mine):
            assert not isinstance(mine, Exception)
            slots[r] = mine
            barrier.wait()
            merged = {k: v for s in slots for k, v in s.items()}
            barrier.wait()
            return merged

        results[r] = infer_layouts(program, resolve or stand_in(), local_groups={r},
                                   exchange=exchange, **kwargs)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(num_groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


@pytest.mark.parametrize("name", ["std1f1b_s2_m4", "zerobubble_s2_m4",
                                  "interleaved1f1b_s4_g2_m4"])
def test_every_rank_reaches_the_same_program_as_one_process(name):
    text = (GOLDEN / f"{name}.txt").read_text()
    # Split group 0's first weight over "data", and give a free result the layout of
    # the first argument of its rank, so layouts travel through tasks and messages.
    weight = {"interleaved1f1b_s4_g2_m4": 9}.get(name, 5)
    program = Program.parse(text.replace(f"  aval %{weight} float32[4,4]\n",
                                         f"  aval %{weight} float32[4,4]{{data}}\n", 1))
    alone, alone_layouts = infer_layouts(program, by_rank(), local_groups={0, 1})
    ranks = _ranks(program, 2, resolve=by_rank())
    for out, layouts in ranks:
        assert str(out) == str(alone) and layouts == alone_layouts
    assert str(alone) != str(program)  # something did change
    verify(alone)


def test_a_resolve_error_reaches_every_process():
    raised = []

    def exchange(mine):
        if isinstance(mine, Exception):
            raised.append(mine)
            raise RuntimeError("every rank raises")
        return mine

    def failing(g, exe, ins, outs, fixed):
        raise ValueError(f"{exe} does not compile")

    with pytest.raises(RuntimeError, match="every rank raises"):
        infer_layouts(Program.parse(PIPELINE), failing, local_groups={0, 1},
                      exchange=exchange)
    assert isinstance(raised[0], ValueError)


def test_runs_without_layouts_leave_the_program_as_it_was():
    text = (GOLDEN / "gpipe_s2_m4.txt").read_text()
    program = Program.parse(text)
    out, layouts = infer_layouts(program, stand_in(), local_groups={0, 1})
    assert out == program
    assert all(isinstance(layouts[k], ExeLayout) for k in layouts)
    assert {exe for _, exe in layouts} == {
        i.exe for g in out.groups for i in g.instrs if isinstance(i, Run)}
