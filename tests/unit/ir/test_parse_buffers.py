"""Buffer lists in the text form: every well-formed list parses, every malformed one is refused."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.ir.program import Free, Run, parse_instr


@pytest.mark.parametrize("ins", [(), (0,), (7, 3), (123456, 0, 42, 9)])
def test_buffer_lists_parse(ins):
    text = "run f (" + ", ".join(f"%{b}" for b in ins) + ") -> (%1)  task=F0s0"
    assert parse_instr(text) == Run("f", ins, (1,), "F0s0")
    assert parse_instr("#3 " + text) == Run("f", ins, (1,), "F0s0")


@pytest.mark.parametrize("bufs", ["%1,%2", "%1, 2", "%1, %", "%-1", "%1 , %2", "%١", "%1, %2, "])
def test_malformed_buffer_lists_are_refused(bufs):
    with pytest.raises(ValueError, match="bad buffer"):
        parse_instr(f"run f ({bufs}) -> ()")


def test_free_lists_parse():
    assert parse_instr("free %4 %10") == Free((4, 10))
