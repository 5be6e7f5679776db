"""The bytes a group's program holds on each device over one step, from buffer lifetimes.

Note: live bytes.
  A group program says exactly when each of its buffers is born and when it dies (`Note:
  program invariants` in program.py): step inputs are live from the start, a Run's
  outputs from that Run, a Recv's buffer from the Recv; a buffer dies at its Free or at
  the Run that donates it. Walking the instructions in order and adding up the
  per-device size of every live buffer gives the bytes the executor's buffer table holds
  after each instruction; the largest is the step's *peak live bytes*. During a Run the
  device also holds the executable's outputs while its inputs are still live (a donated
  input's memory becomes an output's: it counts once) and XLA's own scratch space for
  the call (`temp_bytes`, from XLA's memory analysis of the executable), so the peak of
  a Run is live + new outputs + temp. An AllReduce packs its bucket into one flat buffer
  per device while it runs. Messages in flight outside the device (host staging, MPI's
  own buffers) are not device memory and are not counted.

  Sizes are per device: each dimension of a buffer's global shape is divided (rounding
  up) by the product of the mesh axes its spec entry names, as XLA shards it. The user's
  own references to step inputs and results are outside the program and not counted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from jaxpp_mpi._src.ir.instructions import AllReduce, Aval, Free, Recv, Run, SendRecv
from jaxpp_mpi._src.ir.program import GroupProgram

__all__ = ["MemoryProfile", "device_bytes", "itemsize", "live_bytes"]

_BITS = re.compile(r"(\d+)")


def itemsize(dtype: str) -> int:
    """Bytes per element of the numpy dtype named `dtype` (`bool`: 1; sub-byte types such
    as `int4` take a byte each, as XLA stores them unpacked on the host)."""
    if dtype == "bool":
        return 1
    match = _BITS.search(dtype)
    if match is None:
        raise ValueError(f"unknown dtype {dtype!r}")
    return max(1, int(match.group(1)) // 8)


def device_bytes(aval: Aval, axis_sizes: Mapping[str, int]) -> int:
    """The bytes of one device's shard of a buffer of `aval` on a group mesh whose axes
    have `axis_sizes` (a replicated buffer: the whole value on every device).

    Raises:
      KeyError: if the spec names an axis missing from `axis_sizes`.
    """
    elements = 1
    for d, size in enumerate(aval.shape):
        entry = aval.spec[d] if d < len(aval.spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        parts = math.prod(axis_sizes[n] for n in names)
        elements *= -(-size // parts)
    return elements * itemsize(aval.dtype)


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """One group's device memory over one step (`Note: live bytes`), per device.

    Attributes:
      peak_bytes: the step's peak: live buffers plus, during each Run, its new outputs
        and its executable's scratch space (`temp_bytes`).
      peak_live_bytes: the most bytes the program's live buffers hold between
        instructions (what the executor's buffer table holds).
      argument_bytes: the step inputs the group holds (weights, optimizer state, the
        batch), live from the start.
      peak_at: the index of the instruction where `peak_bytes` is reached (-1: at the
        start).
      live_after: the live bytes after each instruction.
    """

    peak_bytes: int
    peak_live_bytes: int
    argument_bytes: int
    peak_at: int
    live_after: tuple[int, ...]


def live_bytes(gp: GroupProgram, axis_sizes: Mapping[str, int] | None = None,
               temp_bytes: Mapping[str, int] | None = None) -> MemoryProfile:
    """Walks `gp` and adds up its live buffers per device (`Note: live bytes`).

    Args:
      gp: the group's program.
      axis_sizes: the sizes of the group mesh's axes (default: every spec entry must
        be absent, i.e. one device or replicated buffers only).
      temp_bytes: per executable name, XLA's scratch bytes of one run (missing: 0).

    Returns:
      The group's `MemoryProfile`.
    """
    axis_sizes = axis_sizes or {}
    temp_bytes = temp_bytes or {}
    avals = gp.aval_map

    def size(buf: int) -> int:
        return device_bytes(avals[buf], axis_sizes)

    live: dict[int, int] = {b: size(b) for b, _ in gp.inputs}
    total = arguments = sum(live.values())
    peak, peak_at = total, -1
    live_after = []

    def born(buf: int) -> None:
        nonlocal total
        live[buf] = size(buf)
        total += live[buf]

    def dead(buf: int) -> None:
        nonlocal total
        total -= live.pop(buf, 0)

    for k, instr in enumerate(gp.instrs):
        at = total
        if isinstance(instr, Run):
            # inputs still live (donated ones included), the outputs that reuse no
            # donated memory, and the call's scratch space
            new = sum(size(b) for b in instr.outs)
            reused = sum(live.get(b, 0) for b in instr.donate)
            at = total + max(0, new - reused) + int(temp_bytes.get(instr.exe, 0))
            for b in instr.donate:
                dead(b)
            for b in instr.outs:
                born(b)
        elif isinstance(instr, (Recv, SendRecv)):
            born(instr.buf if isinstance(instr, Recv) else instr.recv_buf)
            at = total
        elif isinstance(instr, Free):
            for b in instr.bufs:
                dead(b)
        elif isinstance(instr, AllReduce):  # one flat copy of the bucket while it runs
            at = total + sum(live.get(b, 0) for b in instr.bufs)
        # Send: the buffer stays live until its Free; nothing new on the device.
        if at > peak:
            peak, peak_at = at, k
        live_after.append(total)
    peak_live = max([arguments, *live_after])
    return MemoryProfile(peak_bytes=peak, peak_live_bytes=peak_live,
                         argument_bytes=arguments, peak_at=peak_at,
                         live_after=tuple(live_after))
