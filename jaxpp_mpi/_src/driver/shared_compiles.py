"""Compiling each distinct executable once across the ranks of an MPI job.

Note: shared compiles.
  Ranks often need the same executables: the middle stages of a pipeline of identical
  blocks, every pipeline replica's copy of its group, optimizer updates of equal shapes.
  XLA's compile time follows a module's distinct kernels (bench/README.md), so a rank
  compiling one stage pays nearly what one process pays for the whole model, and every
  further rank that compiles the same module pays it again. So in MPI mode the ranks
  lower their executables (cheap) and allgather a digest of each: the module's text,
  the compiler options, the platform, kind and ids of the devices it is compiled for,
  XLA_FLAGS and JAX's version (any difference only costs the sharing). Each distinct
  digest is compiled once: largest first (`module_cost`, from the module's text), by
  the least loaded of the ranks that need it, or by the least loaded rank with the
  same devices where that rank would be done with it before they would start it (a
  rank whose modules others compile helps the first and last stages, which no other
  rank shares). A helper lowers the module itself, for its own devices (every group
  has the same shape), and compiles it only if its digest is the same. The owners send
  each module, serialized (`jax.experimental.serialize_executable`), to the other
  ranks that need it, with one object alltoall that moves only what each rank needs; a
  receiver loads it (`deserialize_and_load`) for its own devices, which the digest
  says are alike.
  - A module that cannot be serialized or loaded, or serializes to more than
    `MAX_SHARED_BYTES`, or that a helper could not lower alike or compile, is compiled
    by each rank needing it.
  - A compile that fails fails its owner, whose error every rank raises (one allgather
    of the outcome, as the layout pass does: `Note: raise on every rank` in agree.py),
    before the executor is built; the ranks that needed the module raise it too.
  - The collectives wait under the compile barrier's deadline, which this rank's own
    compile time extends (`Note: deadlines` in runtime/failure.py), after an idle wait
    (`Note: idle waits` in agree.py): a peer may still be compiling.
  `JAXPP_MPI_SHARED_COMPILES=0` turns it off: each rank compiles all of its own; so does
  JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`), since an executable
  loaded from it does not serialize whole (`_persistent_cache_on`). Ranks decide
  together (the digests' allgather carries each rank's will), so a rank whose settings
  differ turns sharing off for all rather than leaving them in a collective.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxpp_mpi._src.base import compat, config
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.base.types import Comm
from jaxpp_mpi._src.runtime import agree, failure

__all__ = ["LABEL", "MAX_SHARED_BYTES", "SharedReport", "assign_owners", "compile_lowered",
           "digest", "module_cost"]

LABEL = "compile barrier"
"""The deadline label of the collectives here (they follow the same local work)."""


def digest(lowered: jax.stages.Lowered, devices: Sequence[Any],
           compiler_options: Mapping[str, Any] | None) -> str:
    """What makes two ranks' compiles of `lowered` interchangeable, as a sha256 digest.

    Args:
      lowered: the lowered module.
      devices: the devices it is compiled for (their platform, kind and ids).
      compiler_options: the XLA options it is compiled with.
    """
    return _digest(lowered.as_text(), devices, compiler_options)


def _where(devices: Sequence[Any]) -> str:
    """The platform, kind and id of each device, as text."""
    return repr([(d.platform, getattr(d, "device_kind", ""), d.id) for d in devices])


def _digest(text: str, devices: Sequence[Any],
            compiler_options: Mapping[str, Any] | None) -> str:
    """`digest` of a module whose text is `text`."""
    parts = (text, repr(sorted((compiler_options or {}).items())), _where(devices),
             os.environ.get("XLA_FLAGS", ""), jax.__version__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


_KERNEL_ROOTS = re.compile(
    r"\b(?:stablehlo|chlo)\.(?:dot_general|dot|convolution|reduce|reduce_window|transpose|"
    r"gather|scatter|sort|select_and_scatter|custom_call|while|case|if|fft|all_reduce|"
    r"all_gather|reduce_scatter|all_to_all|collective_permute)\b")


def module_cost(text: str) -> int:
    """A module's compile cost, in rough units of one XLA kernel, from its StableHLO text:
    2 for the module, 1 per op that starts a kernel of its own (dots, reductions,
    transposes, gathers, control flow, collectives: elementwise ops fuse into them) and
    1 per result (each is written by a kernel). On the 4-stage example's modules, one
    unit took 0.019-0.033 s of compile on this project's CPU VM (text length, by
    contrast, ranks an optimizer update above a forward that takes 3x as long)."""
    return 2 + len(_KERNEL_ROOTS.findall(text)) + text.count("jax.result_info")


def assign_owners(wants: Sequence[Mapping[str, int]], helpers: bool = False,
                  where: Sequence[str] | None = None) -> dict[str, int]:
    """digest -> the rank that compiles it (`Note: shared compiles`).

    Largest first, each module goes to the least loaded of the ranks that need it, or,
    with `helpers`, to the least loaded rank with the same devices (`where`) where that
    rank would be done with it before the best of those even starts it.

    Args:
      wants: per rank, the digests it needs with their costs (the same cost for the
        same digest on every rank).
      helpers: whether a rank may compile a module it does not need.
      where: per rank, its devices (`_where`): a helper's must be those of the ranks
        that need the module, or it would lower the module otherwise.

    Returns:
      For every digest some rank needs, the rank that compiles it; the same on every
      rank given the same `wants`.
    """
    needers: dict[str, tuple[int, list[int]]] = {}
    for r, mine in enumerate(wants):
        for d, cost in mine.items():
            needers.setdefault(d, (cost, []))[1].append(r)
    load = [0] * len(wants)
    owner = {}
    for d, (cost, ranks) in sorted(needers.items(), key=lambda x: (-x[1][0], x[0])):
        best = min(ranks, key=lambda r: (load[r], r))
        alike = [r for r in range(len(wants)) if where is None or where[r] == where[best]]
        anyone = min(alike, key=lambda r: (load[r], r))
        owner[d] = anyone if helpers and load[anyone] + cost <= load[best] else best
        load[owner[d]] += cost
    return owner


class SharedReport(dict):
    """What one rank's `compile_lowered` did: `compiled` (XLA compiles it ran),
    `helped` (of those, modules only other ranks need), `received` (modules loaded from
    another rank's compile), `needed` (distinct modules this rank needed) and `distinct`
    (distinct modules the whole job needed)."""


def _compile_here(lowered: Mapping[str, jax.stages.Lowered],
                  compile_one: Callable[[jax.stages.Lowered], jax.stages.Compiled],
                  ) -> tuple[dict[str, jax.stages.Compiled], SharedReport]:
    """Every module compiled by this rank (`compile_lowered` without sharing)."""
    out = {name: compile_one(low) for name, low in lowered.items()}
    return out, SharedReport(compiled=len(out), helped=0, received=0, needed=len(out),
                             distinct=len(out))


def _persistent_cache_on(devices: Sequence[Any]) -> bool:
    """Whether JAX's persistent compilation cache is in use. Then a rank does not share:
    an executable loaded from that cache serializes without its code (jax 0.10 on CPU:
    the loaded copy fails with "Function ... not found"), and with a warm cache there is
    little left to share."""
    return bool(devices) and compat.persistent_cache_used(devices[0])


def _failed(failed: list[int], messages: Sequence[str | None]) -> CompileError:
    return CompileError(f"rank(s) {failed} failed to compile their executables: "
                        f"{messages[failed[0]]}")


MAX_SHARED_BYTES = 1 << 30
"""The largest serialized executable passed on (mpi4py's object messages count bytes in
a C int); a larger one is compiled by each rank that needs it."""


def _serialized(compiled: jax.stages.Compiled) -> Any:
    """The bytes another rank loads, or ("unsupported", why)."""
    from jax.experimental.serialize_executable import serialize

    try:
        payload = serialize(compiled)[0]
    except Exception as e:  # noqa: BLE001 - the receivers compile it themselves
        return ("unsupported", agree.describe(e))
    if len(payload) > MAX_SHARED_BYTES:
        return ("unsupported", f"{len(payload)} bytes serialized")
    return payload


def _loaded(got: Any, lowered: jax.stages.Lowered, devices: Sequence[Any]
            ) -> jax.stages.Compiled | None:
    """The executable another rank sent (`got`, its serialized bytes) loaded for
    `devices`, or None where it sent none or it does not load (then this rank compiles
    `lowered` itself)."""
    if not isinstance(got, (bytes, bytearray)):
        return None
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        return deserialize_and_load(got, lowered.in_tree, lowered.out_tree,
                                    execution_devices=list(devices))
    except Exception:  # noqa: BLE001 - the caller compiles it instead
        return None


def compile_lowered(
    lowered: Mapping[str, jax.stages.Lowered] | None,
    error: BaseException | None,
    comm: Comm,
    *,
    devices: Sequence[Any],
    compiler_options: Mapping[str, Any] | None = None,
    compile_one: Callable[[jax.stages.Lowered], jax.stages.Compiled] | None = None,
    lower_for: Callable[[int, str], jax.stages.Lowered] | None = None,
) -> tuple[dict[str, jax.stages.Compiled], SharedReport]:
    """Compiles `lowered` (name -> module), sharing the work with the ranks of `comm`
    that need the same modules (`Note: shared compiles`). Every rank of `comm` calls it.

    Args:
      lowered: this rank's modules by name, or None where lowering them failed.
      error: this rank's error so far (lowering), or None.
      comm: the ranks that compile together (None, or sharing off: this rank alone).
      devices: the devices this rank's modules are compiled for, in their device
        assignment's order (a received module is loaded for them).
      compiler_options: XLA options, as `Lowered.compile` takes them.
      compile_one: compiles one module (default: `Lowered.compile` with the options).
      lower_for: `(rank r, name)` -> rank r's module `name`, lowered here for this
        rank's devices; given, this rank may compile modules it does not need, where
        that ends sooner (`assign_owners`). A module whose digest comes out other than
        rank r's is left to the ranks that need it.

    Returns:
      (name -> compiled executable, this rank's report).

    Raises:
      CompileError or this rank's own error, on every rank, when any rank failed to
      lower or compile a module it or another rank needed.
    """
    options = dict(compiler_options) if compiler_options else None
    compile_one = compile_one or (lambda low: low.compile(options))
    if comm is None or comm.Get_size() == 1:
        if error is not None:
            raise error
        return _compile_here(lowered, compile_one)
    started = time.perf_counter()
    me = comm.Get_rank()
    willing = config.options().shared_compiles and not _persistent_cache_on(devices)
    digests, costs, names = {}, {}, {}
    if error is None and willing:
        try:
            for name, low in lowered.items():
                text = low.as_text()
                digests[name] = _digest(text, devices, options)
                costs[digests[name]] = module_cost(text)
                names.setdefault(digests[name], name)
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            error = e
    agree.wait_idle(comm, LABEL)
    gathered = agree.allgather_or_raise((willing, costs, names, _where(devices)), error,
                                        comm, _failed, own="if_all", label=LABEL)
    if not all(g[0] for g in gathered):  # some rank does not share: each its own
        try:
            out, error = _compile_here(lowered, compile_one), None
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            out, error = None, e
        failure.record_work(LABEL, time.perf_counter() - started)
        agree.wait_idle(comm, LABEL)
        agree.raise_if_any(error, comm, _failed, own="if_all", label=LABEL)
        return out
    wants = [g[1] for g in gathered]
    owner = assign_owners(wants, helpers=lower_for is not None, where=[g[3] for g in gathered])
    first = names  # digest -> one of this rank's names for it
    done: dict[str, jax.stages.Compiled] = {}
    errors: dict[str, str] = {}  # this rank's own failed compiles
    left: dict[str, str] = {}  # modules helped with here that their ranks compile
    compiled_here = 0
    for d in (d for d, r in owner.items() if r == me):
        if d in first:
            low = lowered[first[d]]
        else:  # another rank's module (`lower_for`)
            r = next(r for r, theirs in enumerate(wants) if d in theirs)
            try:
                low = lower_for(r, gathered[r][2][d])
                if _digest(low.as_text(), devices, options) != d:
                    left[d] = "lowered otherwise here"
                    continue
            except Exception as e:  # noqa: BLE001 - the ranks that need it compile it
                left[d] = agree.describe(e)
                continue
        compiled_here += 1
        try:
            done[d] = compile_one(low)
        except Exception as e:  # noqa: BLE001 - sent to whoever needs it
            if d in first:
                errors[d] = agree.describe(e)
            else:
                left[d] = agree.describe(e)
    outgoing: list[dict[str, Any]] = [{} for _ in wants]
    for r, theirs in enumerate(wants):
        for d in theirs:
            if r != me and owner[d] == me:
                outgoing[r][d] = (("error", errors[d]) if d in errors else
                                  ("unsupported", left[d]) if d in left else
                                  _serialized(done[d]))
    failure.record_work(LABEL, time.perf_counter() - started)
    agree.wait_idle(comm, LABEL)  # Note: idle waits
    with failure.deadline(LABEL, comm):
        incoming = comm.alltoall(outgoing)
    received = 0
    for d, name in first.items():
        if d in done or d in errors:
            continue
        got = incoming[owner[d]].get(d)
        if isinstance(got, tuple) and got and got[0] == "error":
            continue  # its owner failed: every rank raises just below, naming it
        loaded = _loaded(got, lowered[name], devices)
        if loaded is not None:
            done[d] = loaded
            received += 1
            continue
        compiled_here += 1  # not passed on, or not loadable: compiled here
        try:
            done[d] = compile_one(lowered[name])
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            errors[d] = agree.describe(e)
    failed = CompileError(next(iter(errors.values()))) if errors else None
    agree.raise_if_any(failed, comm, _failed, own="if_all", label=LABEL)
    report = SharedReport(compiled=compiled_here, helped=sum(d not in first for d in done),
                          received=received, needed=len(first), distinct=len(owner))
    return {name: done[d] for name, d in digests.items()}, report
