"""Local mode: a recorded step exports as a Chrome trace with every task exactly once."""

from __future__ import annotations

import logging
from collections import Counter

import jax
from models import make_step, mlp, schedule
from trace_schema import check_chrome_trace, program_tasks, task_counts

import jaxpp_mpi
import jaxpp_mpi.trace
from jaxpp_mpi._src.timeline.gantt import trace_chart
from jaxpp_mpi.trace import TaskPart, parse_label


def test_local_step_trace_has_every_task_once(tmp_path, caplog):
    """DualPipeV on 2 groups (two stages per group, split backwards): one track per
    group, each labelled Run of the program once, and a chart cell per loop task.
    Compilation reports its progress to the 'jaxpp_mpi' logger at INFO."""
    sched = schedule("dualpipev", 2)
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((2,), ("stage",)), "stage")
    params, batch, loss_fn = mlp(sched.num_stages, 4)
    step, opt = make_step(loss_fn, sched)
    with caplog.at_level(logging.INFO, logger="jaxpp_mpi"):
        compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
            opt.init(params), params, batch)
    exes = [len(compiled.plan.exes[g]) for g in range(2)]
    for g in range(2):
        assert f"compiling {exes[g]} executables for group {g} ({sum(exes)} across 2 " \
            "groups)" in caplog.text
        assert f"group {g}: {exes[g]}/{exes[g]} executables compiled in " in caplog.text
    args = (opt.init(params), params, batch)
    jax.block_until_ready(compiled(*args))  # warm-up
    with jaxpp_mpi.trace.record() as events:
        jax.block_until_ready(compiled(*args))
    path = tmp_path / "trace.json"
    trace = jaxpp_mpi.trace.export(path, events, mesh)
    assert jaxpp_mpi.trace.load(path) == trace
    assert check_chrome_trace(trace) == {(0, 0): "group 0", (0, 1): "group 1"}
    want = program_tasks(compiled.program(), range(2), lambda g: 0)
    assert task_counts(trace) == want and max(want.values()) == 1
    messages = [e for e in trace["traceEvents"] if e.get("cat") == "message"]
    assert messages and all(e["name"] == "transfer" and e["args"]["bytes"] > 0
                            for e in messages)
    chart = trace_chart(trace)
    loop_tasks = Counter((g, p) for (_, g, label) in want for p in parse_label(label)
                         if p.kind in "FBIW")
    assert Counter((c.row, TaskPart(c.kind, int(c.text), c.stage))
                   for c in chart.tasks()) == loop_tasks
    assert {c.chunk for c in chart.tasks()} == {0, 1}
