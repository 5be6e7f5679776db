"""Instructions made unchecked (`Note: trusted instructions`) are the constructors'
instructions; the passes and the event-less play that use such shortcuts give what
the general paths give."""

import dataclasses

import pytest

from jaxpp_mpi._src.ir import rendezvous
from jaxpp_mpi._src.ir.passes import add_frees, assign_tags, match_messages, pair_exchanges
from jaxpp_mpi._src.ir.program import (
    Aval,
    Free,
    GroupProgram,
    Program,
    ProgramError,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.trusted import new_free, new_recv, new_run, new_send, new_sendrecv

F32 = Aval((4,), "float32")


class _Send(Send):
    pass


def _same(a, b):
    """Equal, of the same class, with fields of the same types."""
    assert type(a) is type(b) and a == b
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert type(x) is type(y) and x == y, f.name
        if isinstance(x, tuple):
            assert [type(v) for v in x] == [type(v) for v in y], f.name


def _outcome(make):
    try:
        return make()
    except Exception as e:  # noqa: BLE001 (the error is the outcome compared)
        return type(e), str(e)


def test_new_instructions_are_the_constructors():
    _same(new_send(3, 1, 0), Send(3, 1, 0))
    _same(new_recv(3, 1, 2, F32), Recv(3, 1, 2, F32))
    _same(new_sendrecv(1, 2, 3, 4, 5, 6, F32), SendRecv(1, 2, 3, 4, 5, 6, F32))
    _same(new_free((1, 4)), Free((1, 4)))


def test_group_program_from_a_dict():
    avals = {0: F32, 2: Aval((2,), "int32"), 5: F32}
    g = GroupProgram(0, (), (), (), avals)
    assert g == GroupProgram(0, (), (), (), tuple(avals.items()))
    assert g.aval_map == avals and g.aval_map is not avals
    avals[7] = F32  # the caller's dict is not the group's
    assert 7 not in g.aval_map
    unsorted = {2: F32, 0: F32}
    assert GroupProgram(0, (), (), (), unsorted).avals == ((0, F32), (2, F32))
    assert GroupProgram(0, (), (), (), {True: F32}).avals[0][0].__class__ is int
    with pytest.raises(TypeError, match="aval of %1 is not an Aval: 'x'"):
        GroupProgram(0, (), (), (), {0: F32, 1: "x"})
    h = g.with_instrs([Free((0,))])
    assert h.aval_map == dict(h.avals)
    assert g.with_instrs([Free((0,))], checked=True) == h


def test_add_frees_keeps_the_constructors_errors():
    g = GroupProgram(0, {-1: 0}, (Run("f", (), (0,)),), {0: 0}, {-1: F32, 0: F32})
    with pytest.raises(ValueError, match=r"buffer ids must be >= 0, got \(-1,\)"):
        add_frees(Program((g,)))


def _two(g0, g1, **kw):
    return Program(tuple(
        GroupProgram(a, kw.get("inputs", {0: 0}), tuple(instrs), {}, {b: F32 for b in range(4)})
        for a, instrs in enumerate((g0, g1))
    ))


@pytest.mark.parametrize(
    "program",
    [
        _two([Send(0, 1, -1), Recv(1, 1, -1, F32), Run("f", (1,), (2,))],
             [Run("g", (0,), (2,)), Send(0, 0, -1), Recv(1, 0, -1, F32)]),
        _two([Run("f", (0,), (1,)), Send(1, 1, -1), Send(0, 1, -1)],
             [Recv(1, 0, -1, F32), Run("g", (1,), (2,)), Recv(3, 0, -1, F32)]),
        _two([Send(0, 1, -1), Recv(1, 1, -1, F32)], [Recv(1, 0, -1, F32), Send(0, 0, -1)]),
        _two([Recv(1, 1, -1, F32), Send(0, 1, -1)], [Recv(1, 0, -1, F32), Send(0, 0, -1)]),
    ],
)
def test_passes_and_play_through_as_the_general_paths(program):
    paired = assign_tags(pair_exchanges(program))
    freed = add_frees(paired)
    for g, h in zip(paired.groups, freed.groups, strict=True):
        for x in h.instrs:
            if isinstance(x, Free):
                _same(x, Free(x.bufs))
        for x in g.instrs:
            _same(x, type(x)(*(getattr(x, f.name) for f in dataclasses.fields(x))))
    matching = match_messages(freed)
    through = _outcome(lambda: rendezvous.play_through(freed, matching))
    events = _outcome(lambda: list(rendezvous.play(freed, matching)))
    if through is None:
        assert isinstance(events, list)
    else:
        assert through == events and through[0] is ProgramError


def test_play_through_as_play_on_odd_messages():
    # a SendRecv to itself matches itself; a Send subclass is no send half: deadlock
    own = GroupProgram(0, {0: 0}, (SendRecv(0, 0, 0, 1, 0, 0, F32),), {0: 0, 1: 1},
                       {0: F32, 1: F32})
    rendezvous.play_through(Program((own,)), match_messages(Program((own,))))
    assert len(list(rendezvous.play(Program((own,))))) == 2  # Matched, Completed
    sub = _two([_Send(0, 1, 0), Run("f", (0,), (1,))], [Run("g", (0,), (1,))])
    with pytest.raises(ProgramError) as through:
        rendezvous.play_through(sub, match_messages(sub))
    with pytest.raises(ProgramError) as events:
        list(rendezvous.play(sub))
    assert str(through.value) == str(events.value)


def test_new_run_is_the_constructors():
    _same(new_run("fwd", (0, 2, 1), (3, 4), "F0s0", (1, 2)),
          Run("fwd", (0, 2, 1), (3, 4), "F0s0", (2, 1)))
    _same(new_run("post", (), (0,), "", ()), Run("post", [], [0]))
