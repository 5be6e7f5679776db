"""Split pass: a treduce loop body becomes per-stage task jaxprs, by dataflow.

Note: stage assignment.
  Marks are numbered by order: the k-th fwd mark ends stage k; the k-th bwd mark in
  body order belongs to stage S-1-k (transposition runs from the last stage down, and
  a boundary that carries no gradient, which can only be one of the earliest stages',
  has no bwd mark). Then, in
  one forward walk over the (inlined) body:
  - fwd mark k runs in FWD(min(k+1, S-1)) (an identity on the receiving side: its
    operands are stage k's outputs, sent to stage k+1); bwd mark k runs in BWD(k);
  - an eqn that depends on a bwd mark's output is backward: BWD(min of the stages of
    the bwd marks it depends on), the stage whose backward consumes it last;
  - otherwise an eqn that depends on a forward value is FWD(max of its operands'
    stages) — everything after the last mark (the loss) is in the last stage;
  - an eqn that depends on no mark but feeds fwd mark k (all of stage 0, a weight
    transform of stage k) is FWD(k), the earliest such k;
  - any other eqn depends only on loop invariants and the microbatch index: it is
    *free*, copied into every task that consumes it (e.g. slicing the labels).
  A reverse walk then *sinks* a forward eqn into BWD(s) when all its consumers are in
  BWD(s) (e.g. the loss's own backward): it runs when its result is needed, and its
  operands, not its result, are kept as residuals.
  For schedules with a split backward, BWD(s) becomes BWD_I(s) — the eqns on which
  another task depends (the cotangents sent to stage s-1) — and BWD_W(s), the rest
  (weight gradients), run later on the same group.
  Backward tasks then recompute cheap residuals (`Note: recomputed residuals` in
  compiler/recompute.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.extend import core as jex_core

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.inline import inline_marked_calls
from jaxpp_mpi._src.compiler.jaxpr_util import new_jaxpr
from jaxpp_mpi._src.compiler.recompute import recompute_residuals
from jaxpp_mpi._src.primitives.stage_marks import is_stage_end
from jaxpp_mpi._src.schedules.tasks import TaskType

__all__ = ["SplitBody", "SplitError", "TaskJaxpr", "TaskKey", "ValueRef", "fuse_tasks",
           "split_body"]

# The task kinds are the schedules' (`schedules/tasks.py`); short local names.
FWD, BWD, BWD_I, BWD_W = TaskType.FWD, TaskType.BWD, TaskType.BWD_I, TaskType.BWD_W
TaskKey = tuple[TaskType, int]  # (kind, stage)
# A task input: ("mb",) the microbatch index, ("inv", j) loop invariant j, or
# ("val", name) a value produced by another task of the same microbatch.
ValueRef = tuple


class SplitError(CompileError):
    """The loop body cannot be split into the schedule's stages."""


@dataclasses.dataclass(frozen=True)
class TaskJaxpr:
    """One stage task of one microbatch: `jaxpr(*ins) -> outs`.

    Attributes:
      key: (kind, stage).
      jaxpr: the task's closed jaxpr (no constants).
      ins: what each jaxpr input is (see `ValueRef`).
      outs: the names of the values it exports, one per jaxpr output.
    """

    key: TaskKey
    jaxpr: jex_core.ClosedJaxpr
    ins: tuple[ValueRef, ...]
    outs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SplitBody:
    """The loop body as stage tasks (the result of `split_body`).

    Attributes:
      num_stages: S.
      tasks: the non-empty tasks, FWD(0..S-1) then the backward ones by descending
        stage (a valid sequential order for one microbatch).
      body_outputs: for each body outvar, ("val", name) of the task value it is,
        ("inv", j), ("mb",) or ("lit", python value).
      value_task: the task that produces each named value.
      value_avals: the aval of each named value.
      value_eqns: the body eqn that makes each named value (for error messages).
    """

    num_stages: int
    tasks: tuple[TaskJaxpr, ...]
    body_outputs: tuple[ValueRef, ...]
    value_task: dict[str, TaskKey]
    value_avals: dict[str, object]
    value_eqns: dict[str, jex_core.JaxprEqn] = dataclasses.field(default_factory=dict)

    def task(self, key: TaskKey) -> TaskJaxpr | None:
        """The task with this key, or None when it is empty."""
        return next((t for t in self.tasks if t.key == key), None)


def _is_var(x) -> bool:
    return isinstance(x, jex_core.Var) and not isinstance(x, jex_core.Literal)


def _var_ins(eqns) -> list[list]:
    """Per eqn, its operands that are variables (not literals), in order: what every
    walk below reads (found once; an eqn's outvars are all variables)."""
    return [[v for v in e.invars if _is_var(v)] for e in eqns]


def _number_marks(eqns, num_stages: int) -> dict[int, tuple[str, int]]:
    """eqn index -> (direction, stage) for every stage mark; checks the counts."""
    fwd = [k for k, e in enumerate(eqns) if is_stage_end(e, "fwd")]
    bwd = [k for k, e in enumerate(eqns) if is_stage_end(e, "bwd")]
    if len(fwd) != num_stages:
        raise SplitError(
            f"the loop body has {len(fwd)} stage marks (mark_stage_end calls) but the "
            f"schedule has {num_stages} stages: mark the end of every stage, the last "
            "one included, or build the schedule with the right num_stages"
        )
    if len(bwd) > num_stages:
        raise SplitError(f"the loop body has {len(bwd)} backward marks for {num_stages} stages")
    marks = {k: ("fwd", s) for s, k in enumerate(fwd)}
    # Transposition emits bwd marks from the last stage down; stages whose boundary
    # carries no gradient (only ever the earliest ones) have none.
    marks.update({k: ("bwd", num_stages - 1 - s) for s, k in enumerate(bwd)})
    return marks


def _check_marks_reach_outputs(eqns, ins, marks, outvars) -> None:
    """Every forward mark's result must flow to a body output (the loss); `ins`: per
    eqn, its variable operands (`_var_ins`)."""
    live = {v for v in outvars if _is_var(v)}
    dead_marks = []
    for k in range(len(eqns) - 1, -1, -1):
        if not live.isdisjoint(eqns[k].outvars):
            live.update(ins[k])
        elif k in marks and marks[k][0] == "fwd":
            dead_marks.append(marks[k][1])
    if dead_marks:
        s = min(dead_marks)
        name = next(e.params.get("name") for k, e in enumerate(eqns)
                    if marks.get(k) == ("fwd", s))
        label = f" ({name!r})" if name else ""
        raise SplitError(
            f"the result of the mark_stage_end ending stage {s}{label} does not reach the "
            "loop body's outputs, so the stages after it are not fed by it: use the value "
            "mark_stage_end returns (x = mark_stage_end(x)), and compute the loss from the "
            "last stage's marked output"
        )


def _assign(eqns, ins, marks, num_stages: int) -> list[TaskKey | None]:
    """Forward walk of Note: stage assignment; None marks a free eqn. `ins`: per eqn,
    its variable operands (`_var_ins`)."""
    last = num_stages - 1
    # Reverse seeding: what a fwd mark k consumes is stage k's, so an eqn upstream of
    # mark k that depends on no earlier mark (e.g. all of stage 0) is FWD(k), not free.
    upstream: dict = {}
    for k in range(len(eqns) - 1, -1, -1):
        eqn = eqns[k]
        if k in marks and marks[k][0] == "fwd":
            seed = marks[k][1]
        else:
            seeds = [upstream[v] for v in eqn.outvars if v in upstream]
            if not seeds:
                continue
            seed = min(seeds)
        for v in ins[k]:
            upstream[v] = min(seed, upstream.get(v, seed))
    fstage: dict = {}
    bstage: dict = {}
    where: list[TaskKey | None] = []
    for k, eqn in enumerate(eqns):
        fs = [fstage[v] for v in ins[k] if v in fstage]
        bs = [bstage[v] for v in ins[k] if v in bstage]
        if k in marks:
            direction, s = marks[k]
            key = (FWD, min(s + 1, last)) if direction == "fwd" else (BWD, s)
        elif bs:
            key = (BWD, min(bs))
        elif fs:
            key = (FWD, min(max(fs), last))
        elif not upstream.keys().isdisjoint(eqn.outvars):
            key = (FWD, min(upstream[v] for v in eqn.outvars if v in upstream))
        else:
            key = None
        where.append(key)
        if key is None:
            continue
        if key[0] == BWD:
            # a backward value also counts as forward for max(): it is late.
            late = max(fs, default=key[1])
            for v in eqn.outvars:
                bstage[v] = key[1]
                fstage[v] = late
        else:
            for v in eqn.outvars:
                fstage[v] = key[1]
    return where


def _consumers(ins) -> dict:
    """Variable -> the eqns reading it, in order (`ins`: per eqn, its variable
    operands)."""
    consumers: dict = {}
    for k, vs in enumerate(ins):
        for v in vs:
            consumers.setdefault(v, []).append(k)
    return consumers


def _sink(eqns, where, outvars, consumers: dict) -> None:
    """Reverse walk: forward eqns whose consumers are all BWD(s) move into BWD(s);
    `consumers`: from `_consumers`."""
    is_out = {v for v in outvars if _is_var(v)}
    for k in range(len(eqns) - 1, -1, -1):
        key = where[k]
        if key is None or key[0] != FWD or is_stage_end(eqns[k]):
            continue
        users = [c for v in eqns[k].outvars for c in consumers.get(v, ())]
        if any(v in is_out for v in eqns[k].outvars) or not users:
            continue
        if all(where[c] == (BWD, key[1]) for c in users):
            where[k] = (BWD, key[1])


def _split_partial_bwd(eqns, ins, where) -> None:
    """BWD(s) -> BWD_I(s) (what other tasks need) + BWD_W(s) (the rest); `ins`: per
    eqn, its variable operands."""
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars}
    needed: set = set()  # values of backward eqns that another task consumes
    for k in range(len(eqns)):
        for v in ins[k]:
            p = producer.get(v)
            if p is not None and where[p] is not None and where[p][0] == BWD:
                if where[k] != where[p]:
                    needed.add(v)
    for k in range(len(eqns) - 1, -1, -1):
        key = where[k]
        if key is None or key[0] != BWD:
            continue
        if any(v in needed for v in eqns[k].outvars):
            where[k] = (BWD_I, key[1])
            needed.update(ins[k])
        else:
            where[k] = (BWD_W, key[1])


def split_body(
    body: jex_core.ClosedJaxpr, num_stages: int, *, partial_bwd: bool = False,
    recompute: bool = True,
) -> SplitBody:
    """Splits a treduce body into stage tasks (see Note: stage assignment).

    Args:
      body: the `treduce_p` body (invars: microbatch index, *invariants).
      num_stages: the schedule's number of stages.
      partial_bwd: split BWD into BWD_I + BWD_W (zero-bubble schedules).
      recompute: backward tasks recompute cheap residuals (Note: recomputed residuals).

    Returns:
      The SplitBody.

    Raises:
      SplitError: the marks do not match `num_stages`, or a forward mark's result
        does not reach the body's outputs.
      InlineError: a mark inside control flow or a custom-derivative function.
    """
    jaxpr = inline_marked_calls(body.jaxpr)
    if body.consts:
        raise SplitError("internal: treduce bodies are closed over no constants")
    eqns = list(jaxpr.eqns)
    ins = _var_ins(eqns)
    marks = _number_marks(eqns, num_stages)
    _check_marks_reach_outputs(eqns, ins, marks, jaxpr.outvars)
    where = _assign(eqns, ins, marks, num_stages)
    consumers = _consumers(ins)
    _sink(eqns, where, jaxpr.outvars, consumers)
    if partial_bwd:
        _split_partial_bwd(eqns, ins, where)
    copies = recompute_residuals(eqns, where) if recompute else None
    return _build_tasks(jaxpr, eqns, ins, consumers, where, num_stages, copies)


def _task_order(num_stages: int) -> list[TaskKey]:
    """Every task key in a valid sequential order for one microbatch."""
    order = [(FWD, s) for s in range(num_stages)]
    for s in reversed(range(num_stages)):
        order += [(BWD, s), (BWD_I, s), (BWD_W, s)]
    return order


def _build_tasks(jaxpr, eqns, ins, consumers: dict, where, num_stages: int,
                 copies: Sequence[set[TaskKey]] | None = None) -> SplitBody:
    """Names the body's values and cuts its eqns into tasks by `where` (None: free);
    eqn k also runs in each task of `copies[k]` (Note: recomputed residuals). `ins`:
    per eqn, its variable operands (`_var_ins`); `consumers`: from `_consumers`."""
    # An eqn's outvars are all variables (drop variables included), each made once.
    names: dict = {}
    for v in jaxpr.invars[:1]:
        names[v] = ("mb",)
    for j, v in enumerate(jaxpr.invars[1:]):
        names.setdefault(v, ("inv", j))
    counter = 0
    for eqn in eqns:
        for v in eqn.outvars:
            if v not in names:
                names[v] = ("val", f"v{counter}")
                counter += 1

    # Free eqns go into every task that consumes them (reverse walk, transitive),
    # recomputed copies included (`Note: recomputed residuals`: a copy may read a free
    # value, e.g. the labels' slice under a loss term the backward task runs again).
    free_in: list[set[TaskKey]] = [set() for _ in eqns]
    body_out = {v for v in jaxpr.outvars if _is_var(v)}
    last_fwd = (FWD, num_stages - 1)
    for k in range(len(eqns) - 1, -1, -1):
        if where[k] is not None:
            continue
        for v in eqns[k].outvars:
            for c in consumers.get(v, ()):
                free_in[k] |= {where[c]} if where[c] is not None else free_in[c]
                if copies is not None:
                    free_in[k] |= copies[c]
            if v in body_out:
                free_in[k].add(last_fwd)

    order = _task_order(num_stages)
    position = {key: j for j, key in enumerate(order)}.__getitem__  # order.index
    task_ks: dict[TaskKey, list[int]] = {key: [] for key in order}  # its eqns' indexes
    for k in range(len(eqns)):
        keys = [where[k]] if where[k] is not None else sorted(free_in[k], key=position)
        if copies is not None and copies[k]:
            keys += sorted(copies[k] - set(keys), key=position)
        for key in keys:
            task_ks[key].append(k)

    # Where each value is produced; a free value that is a body output is exported
    # by the last forward task (it is computed there too, see above).
    value_task: dict[str, TaskKey] = {}
    made_in: dict = {}  # the variable of each value a task (not a free eqn) makes -> it
    for k, eqn in enumerate(eqns):
        for v in eqn.outvars:
            if names[v][0] == "val":
                if where[k] is not None:
                    value_task[names[v][1]] = made_in[v] = where[k]
                elif v in body_out:
                    value_task[names[v][1]] = last_fwd

    # Which values each task must export: used by another task, or a body output.
    used_elsewhere: dict[TaskKey, set] = {key: set() for key in order}
    defined: dict[TaskKey, set] = {}  # per task, the variables its eqns make
    for key in order:
        made = defined[key] = {v for k in task_ks[key] for v in eqns[k].outvars}
        for k in task_ks[key]:
            for v in ins[k]:
                if v not in made:
                    t = made_in.get(v)
                    if t is not None:
                        used_elsewhere[t].add(v)
    for v in jaxpr.outvars:
        if _is_var(v) and names[v][0] == "val":
            used_elsewhere[value_task[names[v][1]]].add(v)

    tasks = []
    for key in order:
        ks = task_ks[key]
        if not ks:
            continue
        made = defined[key]
        task_ins, seen = [], set()
        for k in ks:
            for v in ins[k]:
                if v not in made and v not in seen:
                    seen.add(v)
                    task_ins.append(v)
        exported = used_elsewhere[key]
        body_eqns = [eqns[k] for k in ks]
        outs = [v for e in body_eqns for v in e.outvars if v in exported]
        closed = _closed(task_ins, outs, body_eqns, f"task {key[0].value}{key[1]}")
        tasks.append(TaskJaxpr(key, closed, tuple(names[v] for v in task_ins),
                               tuple(names[v][1] for v in outs)))
    body_outputs = tuple(
        names[v] if _is_var(v) else ("lit", v.val) for v in jaxpr.outvars
    )
    avals, made_by = {}, {}
    for e in eqns:
        for v in e.outvars:
            name = names[v]
            if name[0] == "val":
                avals[name[1]] = v.aval
                made_by[name[1]] = e
    return SplitBody(num_stages, tuple(tasks), body_outputs, value_task, avals, made_by)


def _closed(invars: Sequence, outvars: Sequence, eqns: Sequence, name: str
            ) -> jex_core.ClosedJaxpr:
    return jex_core.ClosedJaxpr(new_jaxpr(invars, outvars, eqns, name=name), [])


def fuse_tasks(a: TaskJaxpr, b: TaskJaxpr, keep: Sequence[str]) -> TaskJaxpr:
    """Task `a` then task `b` of the same microbatch as one task (`Note: back-to-back
    tasks` in compiler/loop_tasks.py).

    The values `a` makes for `b` stay inside; `a` exports only the values named in
    `keep`, then `b` exports all of its own. `b`'s inputs are matched to `a`'s by the
    value they are (`ValueRef`), not by variable: a pass may have rebuilt one task's
    jaxpr (`replicas.localize_split`). An eqn both tasks hold (free eqns are copied into
    every task that reads them) runs once.

    Args:
      a: the first task.
      b: the second; it may read `a`'s values, never the other way round.
      keep: names among `a.outs` that the fused task still exports (read by another
        task, or a body output).

    Returns:
      A TaskJaxpr with `a`'s key.
    """
    ja, jb = a.jaxpr.jaxpr, b.jaxpr.jaxpr
    made = dict(zip(a.outs, ja.outvars))
    read = dict(zip(a.ins, ja.invars))
    ins, refs, sub = list(ja.invars), list(a.ins), {}
    for v, ref in zip(jb.invars, b.ins):
        if ref[0] == "val" and ref[1] in made:
            sub[v] = made[ref[1]]
        elif ref in read:
            sub[v] = read[ref]
        else:
            ins.append(v)
            refs.append(ref)
    eqns = list(ja.eqns)
    defined = {v for e in eqns for v in e.outvars}
    for e in jb.eqns:
        if e.outvars and all(v in defined for v in e.outvars):
            continue  # `a` holds this eqn too
        if any(_is_var(x) and x in sub for x in e.invars):
            e = e.replace(invars=[sub.get(x, x) if _is_var(x) else x for x in e.invars])
        eqns.append(e)
    kept = [(v, name) for v, name in zip(ja.outvars, a.outs) if name in keep]
    outs = kept + [(sub.get(v, v) if _is_var(v) else v, name)
                   for v, name in zip(jb.outvars, b.outs)]
    name = f"task {a.key[0].value}{a.key[1]}+{b.key[0].value}{b.key[1]}"
    closed = _closed(ins, [v for v, _ in outs], eqns, name)
    return TaskJaxpr(a.key, closed, tuple(refs), tuple(n for _, n in outs))
