"""``python -m jaxpp_mpi.schedules plan FILE.py:FUNCTION``: the planner's command line.

FUNCTION(mpmd_mesh) returns a dict: "step" (the training step), "args" (its example
arguments) and any other `plan_schedules` keyword ("batch_argnums", "donate_argnums",
"in_shardings", ...). The mesh has `--groups` groups of one CPU device each (the
command sets the CPU device count before JAX starts), so costs are XLA's CPU figures
unless `--task-times` gives measured ones.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.planner.runtime_cost import RuntimeCost  # no JAX
from jaxpp_mpi._src.schedules.cli import UsageError, _Parser  # the schedules CLI's own

__all__ = ["main"]

PROG = "python -m jaxpp_mpi.schedules plan"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Rank every schedule, microbatch count and stage split for a training "
        "step by predicted step time, with each group's peak device memory against a limit.",
        epilog=f"Example: {PROG} examples/train.py:plan_inputs --groups 2 --memory-limit 80GiB",
    )
    p.add_argument("model", help="FILE.py:FUNCTION or module:FUNCTION; FUNCTION(mpmd_mesh) "
                   "returns {'step': ..., 'args': (...), **plan_schedules options}")
    p.add_argument("--groups", type=int, default=2, help="MPMD groups (default 2)")
    p.add_argument("--memory-limit", metavar="SIZE", help="device memory, e.g. 80GiB")
    p.add_argument("--task-times", metavar="FILE.json",
                   help="measured task times, {label: ms}, of one traced step of the step "
                   "as written (collect_task_times_ms)")
    p.add_argument("--microbatches", metavar="N,N,...", help="microbatch counts to plan")
    p.add_argument("--schedules", metavar="NAME,...", help="schedules to plan (default all)")
    p.add_argument("--stages-per-group", metavar="V,V,...",
                   help="stages per group to plan (default 1 to 4, as the marks allow)")
    p.add_argument("--even-split", action="store_true",
                   help="only split the marks evenly (no balanced split)")
    p.add_argument("--exact-memory", action="store_true",
                   help="compile every distinct executable for XLA's scratch bytes")
    p.add_argument("--message-cost", metavar="MS,GBPS",
                   help="a message's latency in ms and bandwidth in GB/s (default free)")
    p.add_argument("--runtime-cost", metavar="RUN_MS,MESSAGE_MS,FREE_MS",
                   help="what the runtime adds per Run, message half and Free, in ms "
                   "(default: the figures fitted on a 2-core CPU VM, RuntimeCost())")
    p.add_argument("--top", type=int, default=0, help="show only the first N plans")
    p.add_argument("--json", metavar="OUT", help="also write the plans as JSON to OUT")
    return p


def _numbers(text: str | None, kind: type, what: str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def _split_spec(spec: str) -> tuple[str, str]:
    """(file or module, function) of a `FILE.py:FUNCTION` or `module:FUNCTION`."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(f"name the function: FILE.py:FUNCTION or module:FUNCTION, got {spec!r}")
    if where.endswith(".py") and not os.path.isfile(where):
        raise UsageError(f"{where}: no such file")
    return where, name


def _load(spec: str) -> Any:
    """The function a `FILE.py:FUNCTION` or `module:FUNCTION` names."""
    where, name = _split_spec(spec)
    if where.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        name_of_file = os.path.splitext(os.path.basename(where))[0]
        module_spec = importlib.util.spec_from_file_location(name_of_file, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name_of_file] = module  # dataclasses look their module up there
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{spec}: {where} has no function {name!r}")
    return fn


def _segment_table(costs: Any) -> list[str]:
    lines = ["stage segments (between consecutive marks), one microbatch at "
             f"{costs.rows} rows: ms of F / B / I / W"]
    for j in range(costs.num_segments):
        cells = " / ".join(f"{costs.work_ms[k][j]:.3g}" for k in "FBIW")
        lines.append(f"  segment {j}: {cells}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Plans the step `args.model` names and prints the ranked table."""
    if args.groups < 1:
        raise UsageError(f"--groups must be positive, got {args.groups}")
    _split_spec(args.model)  # bad input is refused before JAX starts
    runtime = _numbers(args.runtime_cost, float, "--runtime-cost")
    if runtime is not None and len(runtime) != 3:
        raise UsageError("--runtime-cost: give RUN_MS,MESSAGE_MS,FREE_MS")
    runtime_cost = None if runtime is None else RuntimeCost(*runtime)
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={args.groups}"
    import jax

    import jaxpp_mpi
    from jaxpp_mpi._src.planner.plan import plan
    from jaxpp_mpi._src.planner.ranking import format_plans, parse_bytes

    limit = None if args.memory_limit is None else parse_bytes(args.memory_limit)
    cost = _numbers(args.message_cost, float, "--message-cost")
    if cost is not None and len(cost) != 2:
        raise UsageError("--message-cost: give MS,GBPS")
    times = None
    if args.task_times:
        with open(args.task_times) as f:
            times = json.load(f)
    devices = jax.devices("cpu")[:args.groups]
    if len(devices) < args.groups:
        raise UsageError(f"--groups {args.groups}: only {len(devices)} CPU devices")
    mesh = jaxpp_mpi.MpmdMesh(jax.sharding.Mesh(
        [[d] for d in devices], ("stage", "data")), "stage")
    options = dict(_load(args.model)(mesh))
    step, example = options.pop("step"), options.pop("args")
    given = {"memory_limit": limit, "task_times_ms": times,
             "num_microbatches": _numbers(args.microbatches, int, "--microbatches"),
             "schedules": args.schedules.split(",") if args.schedules else None,
             "stages_per_group": _numbers(args.stages_per_group, int, "--stages-per-group"),
             "message_cost": None if cost is None else (cost[0], cost[1] * 1e6),
             "runtime_cost": runtime_cost}
    options.update({k: v for k, v in given.items() if v is not None})
    if args.even_split:
        options["balance_stages"] = False
    if args.exact_memory:
        options["exact_memory"] = True
    found = plan(step, *example, mpmd_mesh=mesh, **options)
    shown = found.plans[:args.top] if args.top > 0 else found.plans
    print(format_plans(shown, limit))
    if found.num_marks > min((p.schedule.num_stages for p in found.plans), default=0):
        print()
        print("\n".join(_segment_table(found.costs)))
    print(f"\n{len(found.plans)} plans, {len(found.skipped)} configurations skipped, "
          f"{found.compiles} XLA compiles")
    if args.json:
        rows = [{"schedule": repr(p.schedule), "num_stages": p.schedule.num_stages,
                 "num_microbatches": p.num_microbatches, "stage_marks": list(p.stage_marks),
                 "step_ms": p.step_ms, "bubble": p.bubble, "peak_bytes": list(p.peak_bytes),
                 "fits": p.fits, "reason": p.reason} for p in found.plans]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the planner's command line.

    Args:
      argv: The arguments after ``plan``; ``sys.argv[2:]`` if None.

    Returns:
      The exit status: 0, or 2 on bad input (reported on one line on stderr).
    """
    try:
        return run(_parser().parse_args(sys.argv[2:] if argv is None else argv))
    except (UsageError, ValueError, OSError, CompileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
