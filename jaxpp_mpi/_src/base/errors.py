"""The compiler's error type (pure Python: no JAX import)."""

from __future__ import annotations

__all__ = ["CompileError"]


class CompileError(ValueError):
    """A step that `mpmd_jit_with_loop` cannot turn into a pipelined program.

    Raised while compiling, on every rank alike (compilation is deterministic), before
    any message is sent. The message names what is wrong and what to change.
    """
