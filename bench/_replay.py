"""A step plan's stage executables on one device: compiled in parallel, timed alone and
replayed in program order (bench/gpu.py's part c).

`Compiler` compiles lowered modules on a thread pool, each distinct module once (XLA
releases the GIL while it compiles). `plan_executables` lowers every executable of a
plan (`build_step`: no devices) for one device, a `_first` variant that the runtime
builds from its plain one (`Note: first variants` in compiler/exes.py) as that
plain variant after a small fill, as `group_compiler.py` runs it. `StageReplay` runs one
stage's Runs of one group in program order, values flowing from Run to Run as in the
runtime (frees honoured), inputs from elsewhere (other stages, other groups, the step's
arguments) made once from their avals; it dispatches them back to back and waits once.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Compiler", "StageReplay", "exe_stage", "plan_executables", "stream_ms"]


class Compiler:
    """Compiles `jax.stages.Lowered` modules on `threads` threads, each distinct module
    (by its StableHLO text) once.

    Attributes:
      submitted: modules submitted; distinct: modules compiled.
    """

    def __init__(self, threads: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, threads))
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.submitted = 0

    def submit(self, lowered: Any) -> concurrent.futures.Future:
        """The future of `lowered.compile()` (shared with an identical module's)."""
        digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        self.submitted += 1
        if digest not in self.futures:
            self.futures[digest] = self.pool.submit(_compile, lowered)
        return self.futures[digest]

    @property
    def distinct(self) -> int:
        return len(self.futures)

    def wait(self) -> float:
        """Waits for every module submitted so far; returns the summed compile seconds."""
        return sum(f.result()[1] for f in list(self.futures.values()))


def _compile(lowered: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def exe_stage(exe: Any) -> int | None:
    """The stage of a loop task's executable (its family, e.g. 'B1', fused 'FB1'), or
    None outside the loop."""
    digits = exe.family.lstrip("FBIW")
    return int(digits) if exe.family and digits.isdigit() else None


def plan_executables(plan: Any, device: Any, compiler: Compiler) -> dict[tuple[int, str], Any]:
    """Lowers every loop-task executable of `plan` for `device` and submits it.

    Returns:
      (group, name) -> a thunk returning what runs it (its `Compiled`, or for a
      `_first` variant built from its plain one, plain after fill); call the thunks
      once the compiler is done.
    """
    import jax
    import numpy as np

    from jaxpp_mpi._src.compiler.exes import first_from_plain

    sharding = jax.sharding.SingleDeviceSharding(device)

    def lower(fn, avals, donate):
        if any(any(e is not None for e in a.spec) for a in avals):
            raise ValueError("bench/gpu.py plans groups of one device: no specs expected")
        structs = [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype), sharding=sharding)
                   for a in avals]
        return jax.jit(fn, donate_argnums=donate).lower(*structs)

    out: dict[tuple[int, str], Any] = {}
    for g, exes in enumerate(plan.exes):
        for name, exe in sorted(exes.items()):
            if exe_stage(exe) is None:
                continue
            ins, _ = plan.exe_avals[g][name]
            via = first_from_plain(exes, plan.exe_avals[g], name)
            if via is None:
                out[g, name] = _result(compiler.submit(lower(exe.fn, ins, exe.donate_argnums)))
                continue
            plain_name, fill = via
            plain_ins, _ = plan.exe_avals[g][plain_name]
            plain = compiler.submit(lower(exes[plain_name].fn, plain_ins,
                                          exes[plain_name].donate_argnums))
            filled = compiler.submit(jax.jit(fill.fn).lower())
            out[g, name] = _from_plain(plain, filled)
    return out


def _result(future: concurrent.futures.Future) -> Callable[[], Any]:
    return lambda: future.result()[0]


def _from_plain(plain: concurrent.futures.Future,
                fill: concurrent.futures.Future) -> Callable[[], Any]:
    def build():
        run, make = plain.result()[0], fill.result()[0]
        return lambda *args: run(*args, *make())

    return build


class StageReplay:
    """Stage `stage`'s Runs on group `group` of `plan`, in program order.

    Args:
      plan: the step plan.
      group, stage: which Runs (those whose executable's family is of `stage`).
      runs: (group, name) -> what runs that executable (`plan_executables`' thunks
        called).
      arrays: aval -> an array of it (made with `random_arrays`), for inputs made
        elsewhere; shared between replays (copied where a Run donates one).
    """

    def __init__(self, plan: Any, group: int, stage: int, runs: dict, arrays: Callable):
        from jaxpp_mpi._src.ir.program import Free, Run

        exes = plan.exes[group]
        self.steps: list[tuple[str, Any, tuple, tuple, tuple]] = []
        defined: set[int] = set()
        self.external: dict[int, Any] = {}
        for instr in plan.program.group(group).instrs:
            if isinstance(instr, Free):
                self.steps.append(("free", None, tuple(instr.bufs), (), ()))
                continue
            if not isinstance(instr, Run) or exe_stage(exes[instr.exe]) != stage:
                continue
            ins, _ = plan.exe_avals[group][instr.exe]
            for buf, aval in zip(instr.ins, ins):
                if buf not in defined and buf not in self.external:
                    self.external[buf] = arrays(aval)
            donated = tuple(instr.ins[k] for k in exes[instr.exe].donate_argnums)
            self.steps.append(("run", runs[group, instr.exe], tuple(instr.ins),
                               tuple(instr.outs), donated))
            defined.update(instr.outs)
        self.num_runs = sum(1 for s in self.steps if s[0] == "run")

    def __call__(self) -> tuple[float, float]:
        """One replay; returns (ms until the last Run is dispatched, ms until every
        result is ready)."""
        import jax

        # a donated input made elsewhere: a fresh copy per Run, made before timing
        fresh = [{b: self.external[b].copy() for b in donated if b in self.external}
                 for kind, _, _, _, donated in self.steps if kind == "run"]
        jax.block_until_ready(fresh)
        env: dict[int, Any] = {}
        used: set[int] = set()
        pending: list[Any] = []  # results nothing here reads (messages): waited for too
        r = 0
        start = time.perf_counter()
        for kind, fn, ins, outs, donated in self.steps:
            if kind == "free":
                for b in ins:
                    if b in env:
                        value = env.pop(b)
                        if b not in used:
                            pending.append(value)
                continue
            own = fresh[r]
            args = [own[b] if b in own else env[b] if b in env else self.external[b]
                    for b in ins]
            used.update(ins)
            for b in donated:  # used up by this Run
                env.pop(b, None)
            env.update(zip(outs, fn(*args)))
            r += 1
        dispatched = time.perf_counter()
        jax.block_until_ready((list(env.values()), pending))
        end = time.perf_counter()
        return (dispatched - start) * 1e3, (end - start) * 1e3


def stream_ms(fn: Callable, acc: Any, args: Sequence[Any], times: int) -> tuple[float, float]:
    """`fn(acc, *args)` called `times` times back to back, each call's first result the
    next call's `acc` (donated), one wait at the end; a fresh copy of `acc` first.

    Returns:
      (ms until the last call is dispatched, ms until its results are ready).
    """
    import jax

    acc = jax.tree.map(lambda x: x.copy(), acc)
    jax.block_until_ready(acc)
    start = time.perf_counter()
    for _ in range(times):
        acc, *rest = fn(acc, *args)
    dispatched = time.perf_counter()
    jax.block_until_ready((acc, rest))
    end = time.perf_counter()
    return (dispatched - start) * 1e3, (end - start) * 1e3
