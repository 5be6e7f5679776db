"""Reading files that may be hostile: bounded reads (no JAX, no MPI: the schedules
package and the checkpoint format both use it)."""

from __future__ import annotations

from typing import BinaryIO

__all__ = ["read_at_most"]


def read_at_most(f: BinaryIO, limit: int, chunk: int = 1 << 20) -> bytes:
    """The bytes of `f` up to its end or to `limit` + 1 bytes, whichever comes first.

    Reads chunk by chunk: one `f.read(limit + 1)` would allocate `limit` bytes even for a
    small file, and a device or pipe (`/dev/zero`, `<(...)`) reports no size to trust.
    """
    parts, total = [], 0
    while total <= limit:
        part = f.read(min(chunk, limit + 1 - total))
        if not part:
            break
        parts.append(part)
        total += len(part)
    return b"".join(parts)
