"""Message chains: the executor's MPI calls without a JAX ordered effect.

Note: message chains.
  mpi4jax's send/recv carry a JAX *ordered effect*. JAX then threads a runtime token
  through every such computation, which takes its Python dispatch path on each call
  (measured: ~0.3-0.4 ms per call on this machine, against ~9 us for a jitted call
  without effects). A pipeline step makes several such calls per task, so that cost
  dominated small models.

  `mpi_chain_p` runs the same MPI calls (mpi4jax's own XLA FFI handlers
  `mpi_send_ffi`, `mpi_recv_ffi`, `mpi_sendrecv_ffi`) with no JAX effect: inside one
  computation the calls are chained by an XLA token created in that computation, and
  between computations they are ordered by *data*: every chain takes an `order` array
  and returns the next one. PJRT starts an execution only when all its argument
  buffers are ready and makes its results ready only when it has finished, so a chain
  passed the previous chain's `order` starts after that chain's MPI calls completed:
  this rank's MPI calls happen in program order, as with the effect, and a jitted
  chain keeps JAX's fast C++ dispatch path.

  The calls are marked `has_side_effect`, so XLA neither removes nor merges them; the
  `order` result keeps the primitive alive in JAX's own dead-code elimination. A
  dispatcher keeps its latest `order` in a `Chain`; every live Chain is waited for at
  exit, before MPI is finalized (JAX's own exit hook waits only for effect tokens).

  An "allreduce" op (`allreduce_fn`) runs mpi4jax's `mpi_allreduce_ffi` in the same way,
  over the communicator of its chain (the replica communicator, Note: Pipeline
  replicas in comms.py), ordered by the same `order` array as the messages.

  Relies on mpi4jax internals (the FFI target names and attributes, the communicator
  and datatype handles) as of mpi4jax 0.9; the MPI tests exercise every path.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

# Why mpi4jax internals: the handles its own lowerings pass to its FFI handlers; there
# is no public API for lowering its calls without its ordered effect (message chains).
from mpi4jax._src.decorators import translation_rule_cpu, translation_rule_cuda
from mpi4jax._src.jax_compat import abstract_token
from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle
from mpi4jax._src.xla_bridge import MPI_STATUS_IGNORE_ADDR
from mpi4py import MPI

from jaxpp_mpi._src.mpi import posted
from jaxpp_mpi._src.mpi.wire import from_wire, to_wire, wire_dtype

__all__ = ["Chain", "Op", "allreduce_fn", "chain", "chain_fn", "mpi_chain_p", "quiesce",
           "wait_for_chains"]

# ("send", peer, tag) | ("recv", peer, tag, shape, dtype)
# | ("sendrecv", peer, send_tag, recv_tag, shape, dtype)
# | ("allreduce", 0, mpi_op_name, shape, dtype); dtypes are MPI-native names.
Op = tuple

mpi_chain_p = Primitive("jaxpp_mpi_chain")
mpi_chain_p.multiple_results = True


def chain(order: jax.Array, sends: Sequence[jax.Array], ops: tuple[Op, ...],
          comm: Any) -> tuple[jax.Array, list[jax.Array]]:
    """Runs `ops` in order (traceable; use inside jit). See `Note: message chains`.

    Args:
      order: the previous chain's order array (an int32 scalar).
      sends: one array per "send"/"sendrecv" op, in op order, of MPI-native dtypes.
      ops: the calls.
      comm: the communicator.

    Returns:
      The next order array, and one array per "recv"/"sendrecv" op, in op order.
    """
    out = mpi_chain_p.bind(order, *sends, ops=ops, comm=int(to_mpi_handle(comm)))
    return out[0], list(out[1:])


def _received(ops):
    return [jax.core.ShapedArray(op[-2], np.dtype(op[-1])) for op in ops
            if op[0] in ("recv", "sendrecv", "allreduce")]


@mpi_chain_p.def_abstract_eval
def _mpi_chain_abstract_eval(order, *sends, ops, comm):
    return [jax.core.ShapedArray(order.shape, order.dtype), *_received(ops)]


def _ffi(ctx, target, operands, avals_in, avals_out, **attrs):
    sub = ctx.replace(avals_in=avals_in, avals_out=avals_out)
    return jax.ffi.ffi_lowering(target, has_side_effect=True)(sub, *operands, **attrs)


def _mpi_chain_lowering(ctx, order, *sends, ops, comm):
    token = hlo.create_token()
    send_avals = iter(zip(sends, ctx.avals_in[1:]))
    recv_avals = iter(ctx.avals_out[1:])
    received = []
    comm = np.int64(comm)
    for op in ops:
        kind, peer = op[0], np.int64(op[1])
        if kind == "send":
            x, aval = next(send_avals)
            (token,) = _ffi(
                ctx, "mpi_send_ffi", (x, token), (aval, abstract_token), (abstract_token,),
                nitems=np.int64(np.prod(aval.shape, dtype=np.int64)), dest=peer,
                tag=np.int64(op[2]), comm=comm, dtype=np.int64(to_dtype_handle(aval.dtype)))
        elif kind == "recv":
            aval = next(recv_avals)
            y, token = _ffi(
                ctx, "mpi_recv_ffi", (token,), (abstract_token,), (aval, abstract_token),
                nitems=np.int64(np.prod(aval.shape, dtype=np.int64)), source=peer,
                tag=np.int64(op[2]), comm=comm, dtype=np.int64(to_dtype_handle(aval.dtype)),
                status=np.int64(MPI_STATUS_IGNORE_ADDR))
            received.append(y)
        elif kind == "allreduce":
            x, aval = next(send_avals)
            r_aval = next(recv_avals)
            y, token = _ffi(
                ctx, "mpi_allreduce_ffi", (x, token), (aval, abstract_token),
                (r_aval, abstract_token),
                nitems=np.int64(np.prod(aval.shape, dtype=np.int64)),
                op=np.int64(to_mpi_handle(getattr(MPI, op[2]))), comm=comm,
                dtype=np.int64(to_dtype_handle(aval.dtype)))
            received.append(y)
        elif kind == "sendrecv":
            x, s_aval = next(send_avals)
            r_aval = next(recv_avals)
            y, token = _ffi(
                ctx, "mpi_sendrecv_ffi", (x, token), (s_aval, abstract_token),
                (r_aval, abstract_token),
                sendcount=np.int64(np.prod(s_aval.shape, dtype=np.int64)), dest=peer,
                sendtag=np.int64(op[2]), sendtype=np.int64(to_dtype_handle(s_aval.dtype)),
                recvcount=np.int64(np.prod(r_aval.shape, dtype=np.int64)), source=peer,
                recvtag=np.int64(op[3]), recvtype=np.int64(to_dtype_handle(r_aval.dtype)),
                comm=comm, status=np.int64(MPI_STATUS_IGNORE_ADDR))
            received.append(y)
        else:
            raise ValueError(f"unknown MPI chain op {op!r}")
    one = mlir.ir_constant(np.array(1, dtype=ctx.avals_in[0].dtype))
    return [hlo.add(order, one), *received]


# mpi4jax's own per-platform wrappers run its set-up first (on CUDA: load its CUDA
# extension and apply MPI4JAX_USE_CUDA_MPI), as for its own primitives.
mlir.register_lowering(mpi_chain_p, translation_rule_cpu(_mpi_chain_lowering),
                       platform="cpu")
mlir.register_lowering(mpi_chain_p, translation_rule_cuda(_mpi_chain_lowering),
                       platform="cuda")

_chains: weakref.WeakSet[Chain] = weakref.WeakSet()


class Chain:
    """The current `order` array of one dispatcher of chains (see `Note: message chains`).

    Args:
      device: where the first order array lives.
    """

    def __init__(self, device: jax.Device):
        self.device = device
        self.order: jax.Array = jax.device_put(np.zeros((), np.int32), device)
        _chains.add(self)

    def on(self, device: jax.Device) -> jax.Array:
        """The order array, moved to `device` first if it lives elsewhere (the copy
        waits for it, so the order carries over)."""
        if device != self.device:
            self.order = jax.device_put(self.order, device)
            self.device = device
        return self.order

    def wait(self) -> None:
        """Blocks until every chain dispatched so far has finished."""
        self.order.block_until_ready()


def chain_fn(ops: tuple[Op, ...], comm: Any) -> Any:
    """A traceable `fn(order, *sends) -> (order, *received)` running `ops`.

    User dtypes go in and come out: bfloat16 and friends travel bitcast (see
    `Note: Wire dtypes`).

    Args:
      ops: the chain's sends and receives, in order (see `chain`).
      comm: the communicator.

    Returns:
      The function, to jit once per chain.
    """
    wire_ops = tuple(op[:-1] + (wire_dtype(op[-1]).name,) if op[0] != "send" else op
                     for op in ops)
    recv_dtypes = [op[-1] for op in ops if op[0] != "send"]

    def fn(order, *sends):
        order, got = chain(order, [to_wire(x) for x in sends], wire_ops, comm)
        return (order, *[from_wire(y, d) for y, d in zip(got, recv_dtypes)])

    return fn


_MPI_OPS = {"sum": "SUM", "max": "MAX", "bor": "BOR"}


def _reduced_dtype(op: str, dtype: np.dtype) -> np.dtype:
    """The dtype a value of `dtype` is combined in: its bit pattern's unsigned integer
    for a bitwise OR, float32 for arithmetic on dtypes MPI lacks (`Note: Wire dtypes`)."""
    if op == "bor":
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return dtype if wire_dtype(dtype) == dtype else np.dtype(np.float32)


def _to_reduced(x: jax.Array, dtype: np.dtype) -> jax.Array:
    if x.dtype == dtype:
        return x
    if x.dtype == np.bool_ or dtype == np.float32:
        return x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, dtype)


def _from_reduced(y: jax.Array, dtype: np.dtype) -> jax.Array:
    if y.dtype == dtype:
        return y
    if dtype == np.bool_ or y.dtype == np.float32:
        return y.astype(dtype)
    return jax.lax.bitcast_convert_type(y, dtype)


def allreduce_fn(op: str, avals: tuple[tuple[tuple[int, ...], str], ...], comm: Any) -> Any:
    """A traceable `fn(order, *xs) -> (order, *reduced)`: each x combined by `op` ("sum",
    "max", "bor") over `comm`, all of one combined dtype in one MPI call (a bucket).

    Args:
      op: the reduction (`ir.instructions.REDUCE_OPS`).
      avals: (shape, dtype name) of each x.
      comm: the communicator (the replica communicator).

    Returns:
      The function, to jit once per bucket and device.
    """
    dtypes = [np.dtype(d) for _, d in avals]
    reduced = [_reduced_dtype(op, d) for d in dtypes]
    by_dtype: dict[np.dtype, list[int]] = {}
    for i, d in enumerate(reduced):
        by_dtype.setdefault(d, []).append(i)
    mpi_op = _MPI_OPS[op]

    def fn(order, *xs):
        out: list[Any] = [None] * len(xs)
        for d, idxs in by_dtype.items():
            flat = jnp.concatenate([jnp.ravel(_to_reduced(xs[i], d)) for i in idxs])
            order, (y,) = chain(order, [flat], (("allreduce", 0, mpi_op, flat.shape, d.name),),
                                comm)
            start = 0
            for i in idxs:
                size = int(np.prod(avals[i][0], dtype=np.int64))
                part = y[start:start + size].reshape(avals[i][0])
                out[i] = _from_reduced(part, dtypes[i])
                start += size
        return (order, *out)

    return fn


def quiesce() -> None:
    """Waits until this process's dispatched MPI work is done.

    That is effectful computations (`jax.effects_barrier`), every live message `Chain`
    and every posted send (`Note: posted sends` in mpi/posted.py).
    """
    jax.effects_barrier()
    for c in list(_chains):
        c.wait()
    posted.wait_for_posted()


@atexit.register
def wait_for_chains() -> None:
    """Waits for every live `Chain`, then every posted send (runs at exit, before mpi4py
    finalizes MPI)."""
    for wait in [c.wait for c in list(_chains)] + [posted.wait_for_posted]:
        try:
            wait()
        except Exception:  # noqa: BLE001 - a failed step already reported its error
            pass
