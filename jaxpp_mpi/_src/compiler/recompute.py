"""Which forward eqns a backward task runs again instead of reading their results.

Note: recomputed residuals.
  What a backward task reads from its stage's forward task (the *residuals*) is written
  to device memory by one executable and read back by another, and held in between: in
  one `jax.jit` of the whole step XLA fuses cheap elementwise work into its consumers
  instead (measured on a GPT-2-small stage: 8.7 GiB of residuals per microbatch, the
  split stage 1.45x its `jax.jit`). So each backward task recomputes a residual when
  that is cheaper in bytes: a residual made by a *cheap* eqn (elementwise arithmetic,
  type conversion, broadcast, reshape, transpose, select, compare, iota, and calls of
  only those; never a dot, a reduction, a gather or random bits) is copied into the
  task with the cheap eqns above it, up to `_RECOMPUTE_DEPTH` levels, when the values
  it then needs from the forward task (those not needed already, not computed by the
  task itself, not step invariants or free values) have fewer bytes than the residual
  (with the eqn's other results that are residuals too).
  Residuals are taken largest first, until nothing changes. Typical wins: a broadcast
  causal mask, a softmax's exp and its bf16 copy, a layer norm's centred values, a
  GELU's tanh. The forward task still computes those values for itself; only what
  crosses to the backward task shrinks. The values are the same: every copied eqn is
  deterministic and sees the same operands.
  Where a copy's operands come from: a value of the stage's own forward task is a
  residual or copied in turn; a value of another task (another stage's forward task,
  on this group or another: a skip connection, a weight cast made where the first
  stage uses it) is read from that task like any residual, which exports it; a *free*
  value (made from loop operands and the microbatch index only, e.g. the labels'
  slice a recomputed loss term reads) is computed in the backward task too:
  `split._build_tasks` copies each free eqn into every task that runs a copy reading
  it, as into every task that reads it directly. So every value a task reads is
  produced by some task (tests/local/test_recompute_placement.py checks it).
"""

from __future__ import annotations

from jax.extend import core as jex_core

from jaxpp_mpi._src.schedules.tasks import TaskType

__all__ = ["recompute_residuals"]

FWD = TaskType.FWD
TaskKey = tuple[TaskType, int]  # (kind, stage), as in split.py


def _is_var(x) -> bool:
    return isinstance(x, jex_core.Var) and not isinstance(x, jex_core.Literal)


# Note: recomputed residuals. Primitives cheap enough to run again in a backward task.
_CHEAP = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "cbrt", "ceil", "clamp", "concatenate",
    "convert_element_type", "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expand_dims", "expm1", "floor", "ge", "gt", "integer_pow", "iota",
    "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "not", "or", "pow", "reduce_precision", "reshape", "round", "rsqrt", "select_n", "sign",
    "sin", "slice", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tanh",
    "transpose", "xor",
})
_CALLS = ("pjit", "jit", "closed_call")
_RECOMPUTE_DEPTH = 8


def _cheap(eqn) -> bool:
    """Whether `eqn` may run again in a backward task (Note: recomputed residuals)."""
    if eqn.effects:
        return False
    name = eqn.primitive.name
    if name in _CALLS:
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        inner = getattr(inner, "jaxpr", inner)
        return inner is not None and all(_cheap(e) for e in inner.eqns)
    return name in _CHEAP


def _nbytes(v) -> int:
    aval = v.aval
    size = 1
    for d in getattr(aval, "shape", ()):
        size *= int(d)
    return size * getattr(getattr(aval, "dtype", None), "itemsize", 4)


def recompute_residuals(eqns, where) -> list[set[TaskKey]]:
    """Per eqn, the backward tasks that also run it (Note: recomputed residuals)."""
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars}
    copies: list[set[TaskKey]] = [set() for _ in eqns]
    reads: dict[TaskKey, set] = {}  # backward task -> the forward values it reads
    for k, eqn in enumerate(eqns):
        key = where[k]
        if key is None or key[0] == FWD:
            continue
        for v in eqn.invars:
            p = producer.get(v) if _is_var(v) else None
            if p is not None and where[p] is not None and where[p][0] == FWD:
                reads.setdefault(key, set()).add(v)
    sizes: dict = {}  # var -> `_nbytes`, shared by the tasks
    cheap: dict = {}  # eqn index -> `_cheap`, shared by the tasks
    for key, needed in reads.items():
        _Residuals(eqns, where, producer, copies, key, needed, sizes, cheap).shrink()
    return copies


class _Residuals:
    """One backward task's residuals while `_recompute` shrinks them.

    Attributes:
      needed: the forward values the task reads (its residuals, so far).
      computed: the values the task computes itself (outputs of eqns copied into it).
    """

    def __init__(self, eqns, where, producer, copies, key: TaskKey, needed: set,
                 sizes: dict, cheap: dict):
        self.eqns, self.where, self.producer, self.copies = eqns, where, producer, copies
        self.key, self.stage = key, key[1]
        self.needed, self.computed = needed, set()
        self._memo: dict = {}
        self._sizes, self._cheap = sizes, cheap  # memos of `_nbytes`, `_cheap`
        self._fwd = (FWD, key[1])

    def _nbytes(self, v) -> int:
        """`_nbytes(v)`, found once per var."""
        n = self._sizes.get(v)
        if n is None:
            n = self._sizes[v] = _nbytes(v)
        return n

    def _copyable(self, v, depth: int) -> int | None:
        """The producing eqn of `v` if the task may run it again, else None."""
        p = self.producer.get(v)
        if p is None or depth <= 0 or self.where[p] != self._fwd:
            return None
        cheap = self._cheap.get(p)
        if cheap is None:
            cheap = self._cheap[p] = _cheap(self.eqns[p])
        return p if cheap else None

    def cost(self, v, depth: int) -> int:
        """Bytes the task must still read from the forward task to have `v`, at best."""
        if not _is_var(v) or v in self.needed or v in self.computed:
            return 0
        p = self.producer.get(v)
        if p is None or self.where[p] is None:  # a step input, the index, a free value
            return 0
        if (v, depth) not in self._memo:
            q = self._copyable(v, depth)
            best = self._nbytes(v)
            if q is not None:
                best = min(best, self._inputs_cost(q, depth))
            self._memo[v, depth] = best
        return self._memo[v, depth]

    def _inputs_cost(self, p: int, depth: int) -> int:
        return sum(self.cost(x, depth - 1) for x in self.eqns[p].invars)

    def _gain(self, p: int, v) -> int:
        """Bytes the task no longer reads once it runs eqn `p` for `v`: `v` and its other
        results that are residuals already (a call may make several)."""
        return sum(self._nbytes(o) for o in self.eqns[p].outvars
                   if o is v or o in self.needed)

    def _copy(self, p: int, depth: int) -> None:
        self.copies[p].add(self.key)
        self.computed.update(self.eqns[p].outvars)
        self._memo.clear()
        for x in self.eqns[p].invars:
            self._take(x, depth - 1)

    def _take(self, v, depth: int) -> None:
        """Makes `v` available to the task as `cost` found cheapest."""
        if not _is_var(v) or v in self.needed or v in self.computed:
            return
        p = self.producer.get(v)
        if p is None or self.where[p] is None:
            return
        q = self._copyable(v, depth)
        if q is not None and self._inputs_cost(q, depth) < self._gain(q, v):
            self.needed.difference_update(self.eqns[q].outvars)
            self._copy(q, depth)
        else:
            self.needed.add(v)
            self._memo.clear()

    def _order(self, v) -> tuple[int, int, int]:
        """The order `shrink` tries residuals in: largest first, then by where the step
        makes them (a Var's printed form holds its address, which differs between
        processes: ranks would shrink differently)."""
        p = self.producer[v]
        return -self._nbytes(v), p, self.eqns[p].outvars.index(v)

    def shrink(self) -> None:
        """Recomputes residuals, largest first, while that reads fewer bytes."""
        changed = True
        while changed:
            changed = False
            for r in sorted(self.needed, key=self._order):
                p = self._copyable(r, _RECOMPUTE_DEPTH)
                if p is not None and self._inputs_cost(p, _RECOMPUTE_DEPTH) < self._gain(p, r):
                    self.needed.difference_update(self.eqns[p].outvars)
                    self._memo.clear()
                    self._copy(p, _RECOMPUTE_DEPTH)
                    changed = True
                    break
