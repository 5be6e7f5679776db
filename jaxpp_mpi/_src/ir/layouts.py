"""Layout pass: every buffer of a program gets the spec its producer gives it (no JAX).

Note: layouts.
  Inside a group a value may be split over the group mesh's axes; its `Aval.spec` says
  how. The compiler's program carries specs only where the user gave them (step inputs,
  step outputs with `out_shardings`); this pass fills in every other buffer:
  - Buffers that must share one layout form a *class*: a buffer, the executable result
    slot that defines it and every executable argument slot that reads it; a sent
    buffer and the buffer its message defines (transfers keep layouts, so a message
    moves shard j to device j); a donated argument and the result it is reused for
    Slots are per executable, not per run, so every run of one executable sees the same
    layouts; an accumulator, read and written by the runs of one executable, keeps one
    layout across microbatches.
  - Fixed points: the step inputs' specs, the specs of `out_shardings`, and, for a
    step result that `jax.jit` of the whole step would pair with a donated argument
    (`donation_pairs`), that argument's spec: weights and optimizer state keep the
    layout they came in, so the next step takes them as they are. Two fixed specs
    meeting in one class is an error naming both.
  - The rest is decided by XLA: executables are resolved in dependency order, each
    compiled with its arguments' layouts, its results' layouts where their class has one,
    and free results where not; the layouts XLA chose for those set their classes. A
    donated argument keeps its layout: the free result JAX pairs it with (the first of
    its shape and dtype, in order) is given the argument's layout, so XLA can reuse the
    buffer; the compiler orders a segment's results so that this pairs every donated
    weight and optimizer state with its update, as `jax.jit` of the whole step would.
  Resolution is deterministic and identical on every rank: in MPI mode each rank
  resolves only its own group's executables, and after each sweep over the program the
  ranks exchange what they resolved (`Exchange`), so every rank ends with the same
  layouts and the same program text (the program hash covers the specs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

from jaxpp_mpi._src.base.types import Spec
from jaxpp_mpi._src.ir.instructions import Aval, Recv, Run, SendRecv
from jaxpp_mpi._src.ir.passes import match_messages, recv_half, send_half
from jaxpp_mpi._src.ir.program import GroupProgram, Program

__all__ = [
    "ExeKey", "ExeLayout", "Exchange", "LayoutError", "Resolve", "donation_pairs",
    "infer_layouts",
]

ExeKey = tuple[int, str]
"""(group, executable name)."""


@dataclasses.dataclass(frozen=True)
class ExeLayout:
    """The layouts an executable was compiled for.

    Attributes:
      ins: per argument, its spec.
      outs: per result, its spec.
    """

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]


Resolve = Callable[[int, str, tuple[Aval, ...], tuple[Aval, ...], tuple[bool, ...]],
                   tuple[Spec, ...]]
"""(group, exe, argument avals, result avals, per result: is its spec fixed) -> the
result specs (fixed ones as given, free ones as the compiler chose)."""

Exchange = Callable[[dict[ExeKey, ExeLayout] | Exception], dict[ExeKey, ExeLayout]]
"""This process's layouts resolved in one sweep -> every process's (an allgather). Given
the exception a `resolve` raised instead, it raises on every process (no process is left
waiting for the next sweep)."""


class LayoutError(ValueError):
    """Two fixed layouts meet in one class, or resolution cannot make progress."""


_Slot = tuple  # ("buf", g, b) | ("in", g, exe, i) | ("out", g, exe, j)


class _Classes:
    """Union-find over slots; a class may carry a spec and whether it is fixed."""

    def __init__(self) -> None:
        self.parent: dict[_Slot, _Slot] = {}
        self.spec: dict[_Slot, Spec] = {}
        self.fixed: set[_Slot] = set()
        self.why: dict[_Slot, str] = {}

    def find(self, s: _Slot) -> _Slot:
        root = s
        while self.parent.setdefault(root, root) != root:
            root = self.parent[root]
        while s != root:  # path compression
            self.parent[s], s = root, self.parent[s]
        return root

    def fix(self, s: _Slot, spec: Spec, why: str) -> None:
        r = self.find(s)
        if r in self.fixed and self.spec[r] != spec:
            raise LayoutError(f"{why} must have layout {_fmt(spec)}, but it is also "
                              f"{self.why[r]} with layout {_fmt(self.spec[r])}")
        self.spec[r], self.why[r] = spec, why
        self.fixed.add(r)

    def union(self, a: _Slot, b: _Slot) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if ra in self.fixed and rb in self.fixed and self.spec[ra] != self.spec[rb]:
            raise LayoutError(f"{self.why[ra]} (layout {_fmt(self.spec[ra])}) and "
                              f"{self.why[rb]} (layout {_fmt(self.spec[rb])}) are the same "
                              "value")
        if rb in self.fixed:
            ra, rb = rb, ra
        self.parent[rb] = ra
        if ra not in self.spec and rb in self.spec:
            self.spec[ra] = self.spec[rb]

    def get(self, s: _Slot) -> Spec | None:
        return self.spec.get(self.find(s))

    def is_fixed(self, s: _Slot) -> bool:
        return self.find(s) in self.fixed

    def set(self, s: _Slot, spec: Spec) -> None:
        self.spec[self.find(s)] = spec


def _fmt(spec: Spec) -> str:
    """A spec as the user writes it, e.g. `P(None, 'model')`."""
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _runs(program: Program) -> dict[ExeKey, list[Run]]:
    """Every executable's runs, by group, in order of its first run."""
    runs: dict[ExeKey, list[Run]] = {}
    for g in program.groups:
        for instr in g.instrs:
            if isinstance(instr, Run):
                runs.setdefault((g.mpmd_idx, instr.exe), []).append(instr)
    return runs


def _link(program: Program, runs: Mapping[ExeKey, list[Run]],
          fixed_outputs: Mapping[int, Spec]) -> _Classes:
    """The classes of `Note: layouts`, with the fixed points applied."""
    classes = _Classes()
    for g in program.groups:
        avals = g.aval_map
        for b, k in g.inputs:
            classes.fix(("buf", g.mpmd_idx, b), avals[b].spec, f"step input {k}")
        for b, k in g.outputs:
            if k in fixed_outputs:
                classes.fix(("buf", g.mpmd_idx, b), fixed_outputs[k], f"step result {k}")
    for (g, exe), exe_runs in runs.items():
        for run in exe_runs:
            for i, b in enumerate(run.ins):
                classes.union(("in", g, exe, i), ("buf", g, b))
            for j, b in enumerate(run.outs):
                classes.union(("out", g, exe, j), ("buf", g, b))
    matching = match_messages(program)
    for g in program.groups:
        for i, instr in enumerate(g.instrs):
            half = send_half(instr)
            if half is not None:
                d, j = matching.recv_of[g.mpmd_idx][i]
                rbuf = recv_half(program.group(d).instrs[j])[0]
                classes.union(("buf", g.mpmd_idx, half[0]), ("buf", d, rbuf))
    return classes


def infer_layouts(
    program: Program,
    resolve: Resolve,
    *,
    local_groups: Collection[int],
    fixed_outputs: Mapping[int, Spec] | None = None,
    donated: Mapping[ExeKey, Sequence[int]] | None = None,
    exchange: Exchange | None = None,
) -> tuple[Program, dict[ExeKey, ExeLayout]]:
    """Gives every buffer of `program` a spec (see `Note: layouts`).

    Args:
      program: a verified program; its input buffers' avals carry the step inputs' specs.
      resolve: compiles one executable of a group this process holds (see `Resolve`).
      local_groups: the groups this process holds (all of them in local mode).
      fixed_outputs: step result index -> the spec the user asked for.
      donated: (group, exe) -> the argnums the executable donates.
      exchange: shares each sweep's layouts with the other processes (MPI mode); None
        when this process holds every group.

    Returns:
      The program with every buffer's and message's aval carrying its spec, and the
      layout of every executable.

    Raises:
      LayoutError: two fixed layouts meet (e.g. a step input also returned with another
        `out_shardings` spec), or no executable can be resolved.
    """
    runs = _runs(program)
    classes = _link(program, runs, fixed_outputs or {})
    layouts: dict[ExeKey, ExeLayout] = {}
    first = {key: exe_runs[0] for key, exe_runs in runs.items()}
    while len(layouts) < len(runs):
        try:
            mine = _sweep(program, resolve, classes, first, layouts, local_groups,
                          donated or {})
        except Exception as error:
            if exchange is not None:
                exchange(error)  # raises on every process
            raise
        everyone = exchange(mine) if exchange is not None else mine
        for key, layout in sorted(everyone.items()):
            if key not in mine:
                _record(classes, key, layout)
                layouts[key] = layout
        if not everyone:
            missing = sorted(set(runs) - set(layouts))
            raise LayoutError(f"cannot resolve the layouts of {missing}: their arguments "
                              "depend on each other")
    return _rewrite(program, classes), layouts


def _sweep(program: Program, resolve: Resolve, classes: _Classes,
           first: Mapping[ExeKey, Run], layouts: dict[ExeKey, ExeLayout],
           local_groups: Collection[int], donated: Mapping[ExeKey, Sequence[int]]
           ) -> dict[ExeKey, ExeLayout]:
    """Resolves, in program order, every executable of this process whose arguments'
    layouts are known; returns the new layouts (also added to `layouts`)."""
    mine: dict[ExeKey, ExeLayout] = {}
    for key in first:  # by group, then in program order
        g, exe = key
        if key in layouts or g not in local_groups:
            continue
        run = first[key]
        ins = tuple(classes.get(("in", g, exe, i)) for i in range(len(run.ins)))
        if any(s is None for s in ins):
            continue
        outs_known = tuple(classes.get(("out", g, exe, j)) for j in range(len(run.outs)))
        avals = program.group(g).aval_map
        in_avals = tuple(dataclasses.replace(avals[b], spec=s) for b, s in zip(run.ins, ins))
        out_avals = tuple(dataclasses.replace(avals[b], spec=s or ())
                          for b, s in zip(run.outs, outs_known))
        fixed = tuple(s is not None for s in outs_known)
        keep = {j: in_avals[i].spec for j, i in
                donation_pairs(in_avals, out_avals, donated.get(key, ())).items() if not fixed[j]}
        out_avals = tuple(dataclasses.replace(a, spec=keep[j]) if j in keep else a
                          for j, a in enumerate(out_avals))
        fixed = tuple(f or j in keep for j, f in enumerate(fixed))
        outs = resolve(g, exe, in_avals, out_avals, fixed)
        layout = ExeLayout(ins, tuple(_normal(o) for o in outs))
        _record(classes, key, layout)
        layouts[key] = mine[key] = layout
    return mine


def donation_pairs(ins: Sequence[Aval], outs: Sequence[Aval], argnums: Sequence[int]
                   ) -> dict[int, int]:
    """Which donated argument JAX gives each result: result j -> argument i.

    JAX pairs each result, in order, with the first donated argument of its shape and
    dtype not yet paired; XLA then reuses the argument's buffer only if the two are laid
    out alike.
    """
    donated = list(argnums)
    pairs: dict[int, int] = {}
    for j, o in enumerate(outs):
        i = next((i for i in donated if (ins[i].shape, ins[i].dtype) == (o.shape, o.dtype)),
                 None)
        if i is not None:
            donated.remove(i)
            pairs[j] = i
    return pairs


def _normal(spec: Spec) -> Spec:
    return Aval((0,) * len(spec), "float32", spec).spec


def _record(classes: _Classes, key: ExeKey, layout: ExeLayout) -> None:
    g, exe = key
    for j, spec in enumerate(layout.outs):
        known = classes.get(("out", g, exe, j))
        if known is None:
            classes.set(("out", g, exe, j), spec)
        elif _normal(known) != spec:
            raise LayoutError(f"executable {exe} of group {g} returns result {j} with layout "
                              f"{_fmt(spec)}, but it was decided as {_fmt(known)}")


def _rewrite(program: Program, classes: _Classes) -> Program:
    groups = []
    for g in program.groups:
        def aval(b: int, a: Aval, g: GroupProgram = g) -> Aval:
            spec = classes.get(("buf", g.mpmd_idx, b))
            return a if spec is None else dataclasses.replace(a, spec=spec)

        avals = {b: aval(b, a) for b, a in g.avals}
        instrs = []
        for instr in g.instrs:
            if isinstance(instr, Recv):
                instr = dataclasses.replace(instr, aval=avals[instr.buf])
            elif isinstance(instr, SendRecv):
                instr = dataclasses.replace(instr, aval=avals[instr.recv_buf])
            instrs.append(instr)
        groups.append(dataclasses.replace(g, instrs=tuple(instrs), avals=avals))
    return dataclasses.replace(program, groups=tuple(groups))
