"""The lowering's work per instruction does not grow with the program: Python lines
executed (a trace's count, a structural fact, unlike a time) per instruction of the
lowered program, for each schedule at 8 and at 64 microbatches. A pass quadratic in the
microbatches through Python code, or one repeated per microbatch, multiplies its lines
per instruction by about 8 between the two; the fixed costs of a small program only
lower the larger one's figure. Times at depth are bench/startup.py's (`Note: the memory
floor` there)."""

from __future__ import annotations

import gc
import sys

import pytest
from test_lower import SCHEDULES, schedule_graph

from jaxpp_mpi._src.compiler import task_models
from jaxpp_mpi._src.compiler.lower import build_program_with_names


def lines_per_instruction(schedule, num_microbatches: int) -> float:
    """Python lines the lowering of `schedule`'s graph executes, per instruction."""
    graph = schedule_graph(schedule, num_microbatches)  # a new graph: nothing cached on it
    task_models.model_latencies.cache_clear()  # the task times made again, whatever ran
    task_models._kind_counts.cache_clear()  # before: the count does not depend on order
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return trace

    was = gc.isenabled()
    gc.disable()
    sys.settrace(trace)
    try:
        program, _ = build_program_with_names(graph)
    finally:
        sys.settrace(None)
        if was:
            gc.enable()
    return lines / sum(len(g.instrs) for g in program.groups)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_lines_per_instruction_do_not_grow(name):
    schedule = SCHEDULES[name](4)
    small, large = (lines_per_instruction(schedule, m) for m in (8, 64))
    assert large <= 1.05 * small, f"{name}: {small:.1f} -> {large:.1f} lines per instruction"
