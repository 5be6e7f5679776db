"""Type aliases shared across jaxpp_mpi (pure Python: no JAX or MPI import)."""

from __future__ import annotations

from typing import Any, TypeAlias

__all__ = ["Comm", "PyTree", "Spec", "SpecEntry"]

PyTree: TypeAlias = Any
"""A pytree of arrays (or of other leaves, as the context says)."""

SpecEntry: TypeAlias = Any
"""One entry of a spec: None, an axis name, or a tuple of axis names (most major
first); `PartitionSpec.UNCONSTRAINED` where a user's spec allows it."""

Spec: TypeAlias = tuple
"""A layout inside a group: a tuple of `SpecEntry`, one per leading dimension, as the
entries of a `PartitionSpec` (trailing dimensions are unsplit)."""

Comm: TypeAlias = Any
"""An MPI communicator with mpi4py's object collectives (`allgather`, `bcast`,
`Barrier`), or None where this process alone takes part."""
