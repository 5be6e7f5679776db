"""The front end: mpmd_jit_with_loop and mpmd_jit_by_yield."""
